"""Specification of the PyTorch path: ``impl="cce_torch"``, and ``impl="cce"`` on CPU tensors
when Triton's interpreter is off.

It computes the loss from float32 logits of the rounded inputs, a chunk of tokens at a time, with
exact gradients, on any device. So in every dtype its loss and lse are as accurate as float32
sums allow, and its gradients are float32 results rounded once to the input dtype. The tests
run with the default chunk size (one chunk for these sizes) and with chunks of 5 tokens, which
leave a remainder of 2 of N=37 tokens.

The dispatch tests run in a subprocess without ``TRITON_INTERPRET``, which ``conftest.py`` sets
for the kernel tests on a CPU-only machine.
"""

from __future__ import annotations

import importlib.util
import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

import cce
from cce.reference import chunked_torch
from cce.config import interpreting
from tests.helpers import (DTYPE_IDS, DTYPES, N, V, Inputs, autograd_functions, make_grad_output,
                           make_inputs, run, run_reference, same_non_finite)
from tests.reference import Result, relative_error

REPOSITORY = Path(__file__).resolve().parents[1]
CHUNK_TOKENS = 5  # 37 tokens = 7 chunks of 5 + 2

dtypes = pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)


def set_chunk_tokens(monkeypatch: pytest.MonkeyPatch, tokens: int) -> None:
    monkeypatch.setattr(chunked_torch, "CHUNK_LOGIT_BYTES", tokens * 4 * V)
    assert chunked_torch.chunk_rows(V) == tokens


@pytest.fixture(params=["one-chunk", f"chunks-of-{CHUNK_TOKENS}"])
def chunking(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """Runs a test with the default chunk size and with chunks of CHUNK_TOKENS tokens."""
    if request.param != "one-chunk":
        set_chunk_tokens(monkeypatch, CHUNK_TOKENS)


with_chunking = pytest.mark.usefixtures("chunking")


FORWARD_TOLERANCE = 1e-6  # every dtype: exact products, float32 sums


def gradient_tolerance(dtype: torch.dtype) -> float:
    """float32: 1e-5; 16-bit: half the dtype's epsilon (one rounding of a float32 result)."""
    return 1e-5 if dtype == torch.float32 else torch.finfo(dtype).eps / 2


def assert_accurate(result: Result, ref: Result, dtype: torch.dtype) -> None:
    """Loss, lse and gradients within tolerance of the float64 reference, in float32."""
    grad_tol = gradient_tolerance(dtype)
    pairs = {"loss": (result.loss, ref.loss, FORWARD_TOLERANCE),
             "lse": (result.lse, ref.lse, FORWARD_TOLERANCE),
             "grad_e": (result.grad_e, ref.grad_e, grad_tol),
             "grad_c": (result.grad_c, ref.grad_c, grad_tol)}
    if ref.grad_bias is not None:
        pairs["grad_bias"] = (result.grad_bias, ref.grad_bias, grad_tol)
    errors = {name: relative_error(out, expected) for name, (out, expected, _) in pairs.items()}
    failed = {name: f"{errors[name]:.1e} > {tol:.0e}" for name, (_, _, tol) in pairs.items()
              if not errors[name] <= tol}
    assert not failed, f"relative errors {failed}"
    assert result.loss.dtype == result.lse.dtype == torch.float32
    assert result.grad_e.dtype == result.grad_c.dtype == dtype


def check(inputs: Inputs, gen: torch.Generator, reduction: str, lse_gradient: bool = False,
          **options) -> Result:
    """Run impl="cce_torch" and the float64 reference on ``inputs``; assert they agree."""
    grad_output = make_grad_output(gen, inputs, reduction)
    grad_lse = (torch.randn(inputs.targets.shape, generator=gen).to(inputs.targets.device)
                if lse_gradient else None)
    result = run("cce_torch", inputs, grad_output, grad_lse, reduction=reduction, **options)
    ref = run_reference(inputs, grad_output, grad_lse, reduction=reduction, **options)
    assert_accurate(result, ref, inputs.e.dtype)
    return result


# --- Same loss and exact gradients -----------------------------------------------------------


@with_chunking
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@dtypes
def test_matches_reference(dtype: torch.dtype, reduction: str, device: str,
                           gen: torch.Generator) -> None:
    """Bias, 10% of the targets ignored, and an upstream gradient on the lse too."""
    inputs = make_inputs(gen, device, dtype, bias=True)
    check(inputs, gen, reduction, lse_gradient=True)


@with_chunking
@dtypes
def test_softcap(dtype: torch.dtype, device: str, gen: torch.Generator) -> None:
    """softcap * tanh(logits / softcap) before the softmax, and its derivative in the backward
    (large logits, so that the cap matters)."""
    inputs = make_inputs(gen, device, dtype, scale=40.0, bias=True, softcap=30.0)
    check(inputs, gen, "none", lse_gradient=True)


@with_chunking
@pytest.mark.parametrize("shift, ignore_index", [(1, -100), (3, 7)])
def test_shift_and_ignore_index(shift: int, ignore_index: int, device: str,
                                gen: torch.Generator) -> None:
    """e of shape (B, T, D): position t is scored against targets[:, t + shift]."""
    inputs = make_inputs(gen, device, torch.bfloat16, shape=(2, 19), ignore_index=ignore_index,
                         shift=shift)
    result = check(inputs, gen, "none")
    assert torch.all(result.loss[:, -shift:] == 0)


@with_chunking
def test_filter_options_do_not_apply(device: str, gen: torch.Generator) -> None:
    """Gradients are exact whatever filter_eps, vocab_sorting and filter_correction say."""
    inputs = make_inputs(gen, device, torch.bfloat16)
    check(inputs, gen, "sum", filter_eps=0.5, vocab_sorting=False, filter_correction=False)


@with_chunking
def test_same_loss_as_pytorch_linear_cross_entropy(device: str, gen: torch.Generator) -> None:
    """torch's own F.linear_cross_entropy (2.10+) gives the same loss and gradients."""
    if not hasattr(F, "linear_cross_entropy"):
        pytest.skip(f"torch {torch.__version__} has no F.linear_cross_entropy")
    inputs = make_inputs(gen, device, torch.float32, bias=True)
    outcomes = []
    for loss_function in (
            lambda e, c, bias: cce.linear_cross_entropy(e, c, inputs.targets, bias=bias,
                                                        impl="cce_torch"),
            lambda e, c, bias: F.linear_cross_entropy(e, c, inputs.targets, linear_bias=bias)):
        leaves = [tensor.detach().requires_grad_() for tensor in (inputs.e, inputs.c,
                                                                  inputs.bias)]
        loss = loss_function(*leaves)
        outcomes.append([loss, *torch.autograd.grad(loss, leaves)])
    for name, ours, theirs in zip(("loss", "grad_e", "grad_c", "grad_bias"), *outcomes):
        assert relative_error(ours, theirs) <= 1e-5, name


def test_second_derivatives_are_refused(device: str, gen: torch.Generator) -> None:
    """The backward is not itself differentiable: differentiating it is an error that says so
    (not an obscure one about in-place operations, nor a wrong second derivative)."""
    inputs = make_inputs(gen, device, torch.float32)
    e = inputs.e.requires_grad_()
    weights = torch.rand(inputs.targets.shape, generator=gen).to(device).requires_grad_()
    loss = cce.linear_cross_entropy(e, inputs.c, inputs.targets, reduction="none",
                                    impl="cce_torch")
    (grad_e,) = torch.autograd.grad((loss * weights).sum(), e, create_graph=True)
    with pytest.raises(RuntimeError, match="differentiable once"):
        grad_e.sum().backward()


# --- Memory: one chunk of logits at a time ---------------------------------------------------


class LargestTensor(TorchDispatchMode):
    """Records the number of elements of the largest tensor any operation returns."""

    def __init__(self) -> None:
        super().__init__()
        self.numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for leaf in pytree.tree_leaves(out):
            if isinstance(leaf, torch.Tensor):
                self.numel = max(self.numel, leaf.numel())
        return out


def test_no_tensor_larger_than_a_chunk_of_logits(device: str, gen: torch.Generator,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Forward and backward create no tensor larger than one chunk of logits or an input (here
    D is small, so the N x V logits would be far larger than c or its gradient)."""
    set_chunk_tokens(monkeypatch, CHUNK_TOKENS)
    num_tokens, dim = 200, 8
    inputs = make_inputs(gen, device, torch.bfloat16, shape=(num_tokens,), dim=dim, bias=True)
    grad_output = make_grad_output(gen, inputs, "none")
    largest = LargestTensor()
    with largest:
        run("cce_torch", inputs, grad_output, grad_lse=grad_output, reduction="none")
    assert largest.numel <= max(CHUNK_TOKENS * V, V * dim) < num_tokens * V


@with_chunking
@pytest.mark.parametrize("options, recomputes", [
    ({"label_smoothing": 0.1}, False), ({"softcap": 30.0}, True),
    ({"return_entropy": True}, True)], ids=["smoothing", "softcap", "entropy"])
@dtypes
def test_memory_fast_keeps_the_softmax(options: dict, recomputes: bool, dtype: torch.dtype,
                                       device: str, gen: torch.Generator,
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """memory="fast" keeps the forward's softmax (N x V, float32) for the backward, which then
    computes no logits: the same loss, lse and gradients to the bit, with a bias, class weights,
    ignored tokens and an upstream gradient on the lse. With a softcap or the entropy, whose
    gradients need the logits, the backward recomputes them as with memory="low"."""
    inputs = make_inputs(gen, device, dtype, bias=True)
    weight = torch.rand(V, generator=gen).to(device)
    grad_output = make_grad_output(gen, inputs, "none")
    grad_lse = torch.randn(inputs.targets.shape, generator=gen).to(device)
    products = []
    chunk_logits = chunked_torch._chunk_logits
    monkeypatch.setattr(chunked_torch, "_chunk_logits",
                        lambda *args: products.append(None) or chunk_logits(*args))
    results = {}
    for memory in ("low", "fast"):
        products.clear()
        results[memory] = run("cce_torch", inputs, grad_output, grad_lse, reduction="none",
                              weight=weight, memory=memory, **options)
        results[memory + " products"] = len(products)
    chunks = math.ceil(N / chunked_torch.chunk_rows(V))
    assert results["low products"] == 2 * chunks
    assert results["fast products"] == (2 if recomputes else 1) * chunks
    for name in ("loss", "lse", "grad_e", "grad_c", "grad_bias", "entropy"):
        low, fast = getattr(results["low"], name), getattr(results["fast"], name)
        assert (low is None and fast is None) or torch.equal(low, fast), name


# --- Non-finite inputs, as in PyTorch --------------------------------------------------------


@with_chunking
@pytest.mark.parametrize("dtype, bad_value, ignored",
                         [(torch.float32, math.nan, False), (torch.bfloat16, math.inf, False),
                          (torch.float32, -math.inf, False), (torch.float32, math.nan, True)],
                         ids=["fp32-nan", "bf16-inf", "fp32-minus-inf", "fp32-nan-ignored"])
def test_non_finite_row_propagates_like_pytorch(dtype: torch.dtype, bad_value: float,
                                                ignored: bool, device: str,
                                                gen: torch.Generator) -> None:
    """A NaN or infinite entry in one row of e: NaN or infinite loss, lse and gradients exactly
    where the materialized F.cross_entropy has them (an infinite logit: lse +inf, loss NaN; a
    NaN row's gradient reaches every row of dC, even when its target is ignored), and the
    other rows as accurate as ever."""
    inputs = make_inputs(gen, device, dtype, bias=True, ignored_fraction=0.0)
    bad_row = 5
    inputs.e[bad_row, 3] = bad_value
    if ignored:
        inputs.targets[bad_row] = -100
    grad_output = make_grad_output(gen, inputs, "none")
    result = run("cce_torch", inputs, grad_output, grad_lse=grad_output, reduction="none")
    torch_result = run("torch", inputs, grad_output, grad_lse=grad_output, reduction="none")

    assert not torch.isfinite(torch_result.grad_c).any()
    for name in ("loss", "lse", "grad_e", "grad_c", "grad_bias"):
        assert same_non_finite(getattr(result, name), getattr(torch_result, name)), name
    good = torch.arange(N, device=device) != bad_row
    good_inputs = Inputs(inputs.e[good], inputs.c, inputs.targets[good], inputs.bias)
    ref = run_reference(good_inputs, grad_output[good], grad_output[good], reduction="none")
    assert relative_error(result.loss[good], ref.loss) <= FORWARD_TOLERANCE
    assert relative_error(result.lse[good], ref.lse) <= FORWARD_TOLERANCE
    assert relative_error(result.grad_e[good], ref.grad_e) <= gradient_tolerance(dtype)


# --- Which path impl="cce" takes -------------------------------------------------------------


@pytest.mark.skipif(not interpreting(), reason="needs TRITON_INTERPRET=1 (CPU-only machines)")
def test_default_runs_the_kernels_on_cpu_when_interpreting(gen: torch.Generator) -> None:
    """With TRITON_INTERPRET=1 (as the kernel tests set it), CPU tensors run the kernels."""
    inputs = make_inputs(gen, "cpu", torch.float32)
    e = inputs.e.requires_grad_()
    functions = autograd_functions(cce.linear_cross_entropy(e, inputs.c, inputs.targets))
    assert "_LinearCrossEntropyBackward" in functions


def _run_without_interpreter(code: str) -> subprocess.CompletedProcess:
    environment = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, env=environment, cwd=REPOSITORY)


# The child process's check: impl="cce" on CPU tensors, with gradients, through the PyTorch
# path; the same loss and gradients as the materialized baseline; TRITON_INTERPRET left unset.
_CHECK_DEFAULT_ON_CPU = """
    import os
    import torch
    torch.manual_seed(0)
    e, c = torch.randn(37, 72, requires_grad=True), torch.randn(1000, 72, requires_grad=True)
    targets = torch.randint(0, 1000, (37,))
    results = []
    for impl in ("cce", "torch"):
        loss = cce.linear_cross_entropy(e, c, targets, impl=impl)
        results.append([loss, *torch.autograd.grad(loss, (e, c))])
    functions, stack = set(), [results[0][0].grad_fn]
    while stack:
        node = stack.pop()
        functions.add(type(node).__name__)
        stack += [next_node for next_node, _ in node.next_functions if next_node is not None]
    assert "ChunkedLinearCrossEntropyBackward" in functions, functions
    # float32 with logits near 30: the sums' order (the BLAS's threads) moves entries by ~1e-6.
    for name, ours, theirs in zip(("loss", "dE", "dC"), *results):
        error = ((ours - theirs).norm() / theirs.norm()).item()
        assert error <= 1e-5, (name, error)
    assert "TRITON_INTERPRET" not in os.environ
    print("ok")
"""


@pytest.mark.parametrize("first_import", ["cce", "triton", "transformers"])
def test_default_on_cpu_is_the_pytorch_path_whatever_was_imported_first(
        first_import: str) -> None:
    """Without TRITON_INTERPRET, impl="cce" computes CPU tensors with the PyTorch path, and
    importing triton (or transformers, which imports it) before cce changes nothing."""
    if first_import == "transformers":
        if importlib.util.find_spec("transformers") is None:
            pytest.skip("transformers is not installed")
        # A model class, not just the package: that is what imports triton.
        first = "from transformers import Gemma3ForCausalLM\nassert 'triton' in sys.modules\n"
    else:
        first = f"import {first_import}\n"
    output = _run_without_interpreter("import sys\n" + first + "import cce\n"
                                      + textwrap.dedent(_CHECK_DEFAULT_ON_CPU))
    assert output.returncode == 0, output.stderr
    assert output.stdout.strip() == "ok"
