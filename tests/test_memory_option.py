"""Specification of the ``memory`` option: "low" (default) keeps the peak at a few MB above the
inputs and gradients; "fast" spends memory for speed. Without softcap, label smoothing, entropy
or argmax, "fast" takes the dense path (the gradient of the logits kept from the forward, three
GEMMs) on a vocabulary of at most 65,536, and on larger ones at N <= D / 2 with 16-bit inputs
and ``c`` trained, where that gradient is kept in dC's own memory; otherwise it keeps the
backward's live tiles. All compute the same loss, lse and gradients as the default, to the
float64 reference's tolerances.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch

import cce
from tests.helpers import (INTERPRETER_NON_FINITE_WARNINGS, Inputs, autograd_functions, check,
                           confident_inputs, make_grad_output, make_inputs, pytorch_errors, run,
                           run_reference, same_non_finite, tolerances)
from tests.reference import relative_error


def takes_dense_path(loss: torch.Tensor) -> bool:
    return any("Dense" in name for name in autograd_functions(loss))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("reduction, lse_gradient", [("mean", False), ("none", True)])
def test_fast_matches_reference(dtype: torch.dtype, reduction: str, lse_gradient: bool,
                                device: str, gen: torch.Generator) -> None:
    """With a bias, class weights, z_loss and an upstream gradient on the lse, as the default
    path does."""
    inputs = make_inputs(gen, device, dtype, bias=True)
    weight = torch.rand(inputs.c.shape[0], generator=gen).to(device)
    check("cce", inputs, gen, reduction=reduction, lse_gradient=lse_gradient, memory="fast",
          weight=weight, z_loss=1e-3)


@pytest.mark.parametrize("options, dense", [
    ({}, True), ({"return_lse": True, "z_loss": 1e-3, "temperature": 0.7, "shift": 1}, True),
    ({"softcap": 30.0}, False), ({"label_smoothing": 0.1}, False),
    ({"return_entropy": True}, False), ({"return_argmax": True}, False)],
    ids=["plain", "lse-z_loss-temperature-shift", "softcap", "smoothing", "entropy", "argmax"])
def test_fast_takes_the_dense_path_where_it_applies(options: dict, dense: bool, device: str,
                                                    gen: torch.Generator) -> None:
    inputs = make_inputs(gen, device, torch.bfloat16, shape=(2, 9))
    e = inputs.e.requires_grad_()
    out = cce.linear_cross_entropy(e, inputs.c, inputs.targets, memory="fast", **options)
    loss = out[0] if isinstance(out, tuple) else out
    assert takes_dense_path(loss) == dense
    default = cce.linear_cross_entropy(e, inputs.c, inputs.targets, **options)
    assert not takes_dense_path(default[0] if isinstance(default, tuple) else default)


def test_fast_above_the_dense_vocabulary_keeps_tiles(device: str, gen: torch.Generator,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Above ``cce.config.DENSE_MAX_VOCAB`` (lowered here below the test's vocabulary: a real one
    would take the interpreter minutes), with more than D / 2 tokens, "fast" is
    ``keep_tiles=True``."""
    inputs = make_inputs(gen, device, torch.bfloat16, shape=(2, 19))
    monkeypatch.setattr("cce.dense.loss.DENSE_MAX_VOCAB", inputs.c.shape[0] - 1)
    grad_output = make_grad_output(gen, inputs, "mean")
    e = inputs.e.detach().requires_grad_()
    assert not takes_dense_path(cce.linear_cross_entropy(e, inputs.c, inputs.targets,
                                                         memory="fast"))
    fast = run("cce", inputs, grad_output, memory="fast", deterministic=True)
    kept = run("cce", inputs, grad_output, keep_tiles=True, deterministic=True)
    for name in ("loss", "lse", "grad_e", "grad_c"):
        assert torch.equal(getattr(fast, name), getattr(kept, name)), name


@pytest.mark.parametrize("dtype, small_batch", [(torch.float32, False), (torch.bfloat16, False),
                                                (torch.bfloat16, True)],
                         ids=["fp32", "bf16", "bf16-in-grad_c"])
def test_fast_confident_rows_are_as_accurate_as_pytorch(
        dtype: torch.dtype, small_batch: bool, device: str, gen: torch.Generator,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Where 1 - p_target is 1e-6, the dense path's loss and gradients come from the LSE of the
    non-target logits, as the tile path's: no worse than PyTorch's on logits in e's dtype;
    also with G kept in dC's memory (N <= D / 2, above the dense vocabulary, lowered on CPU)."""
    if small_batch:
        num_tokens, vocab, dim = (96, 70000, 256) if device == "cuda" else (24, 700, 64)
        if device != "cuda":
            monkeypatch.setattr("cce.dense.loss.DENSE_MAX_VOCAB", 1)
    else:
        num_tokens, vocab, dim = (2048, 50000, 256) if device == "cuda" else (64, 700, 64)
    e, c, targets = confident_inputs(gen, device, dtype, num_tokens, vocab, dim, 1e-6)
    inputs = Inputs(e, c, targets)
    grad_output = make_grad_output(gen, inputs, "none")
    ref = run_reference(inputs, grad_output, reduction="none")
    ours = run("cce", inputs, grad_output, reduction="none", memory="fast")
    theirs = pytorch_errors(inputs, grad_output, ref)
    floor = tolerances("cce", dtype)[1]
    assert relative_error(ours.loss, ref.loss) <= max(theirs["loss"], 1e-5)
    assert relative_error(ours.grad_e, ref.grad_e) <= max(theirs["grad_e"], floor)
    assert relative_error(ours.grad_c, ref.grad_c) <= max(theirs["grad_c"], floor)


@INTERPRETER_NON_FINITE_WARNINGS
@pytest.mark.parametrize("bad_value", [math.nan, math.inf], ids=["nan", "inf"])
def test_fast_non_finite_rows_propagate_like_pytorch(bad_value: float, device: str,
                                                     gen: torch.Generator) -> None:
    inputs = make_inputs(gen, device, torch.float32, ignored_fraction=0.0)
    inputs.e[5, 3] = bad_value
    grad_output = make_grad_output(gen, inputs, "none")
    ours = run("cce", inputs, grad_output, reduction="none", memory="fast")
    theirs = run("torch", inputs, grad_output, reduction="none")
    for name in ("loss", "lse", "grad_e", "grad_c"):
        assert same_non_finite(getattr(ours, name), getattr(theirs, name)), name


def test_fast_without_gradients_and_differentiated_twice(device: str,
                                                         gen: torch.Generator) -> None:
    """Without a backward the forward keeps nothing and gives the same loss; a second
    derivative raises, as on the default path."""
    inputs = make_inputs(gen, device, torch.float32)
    with torch.no_grad():
        plain = cce.linear_cross_entropy(inputs.e, inputs.c, inputs.targets, memory="fast")
    e = inputs.e.detach().requires_grad_()
    loss = cce.linear_cross_entropy(e, inputs.c, inputs.targets, memory="fast")
    assert torch.equal(plain, loss.detach())
    (grad_e,) = torch.autograd.grad(loss, e, create_graph=True)
    with pytest.raises(RuntimeError, match="differentiable once"):
        grad_e.square().sum().backward()


def test_fast_vmap_of_grad_gives_per_sample_gradients(device: str,
                                                      gen: torch.Generator) -> None:
    """torch.func.vmap over the dense path: per-sample gradients equal to a loop over the
    samples, without PyTorch's warning about a missing batching rule."""
    inputs = make_inputs(gen, device, torch.float32, shape=(3, 11))

    def loss(e, c, targets):
        return cce.linear_cross_entropy(e, c, targets, memory="fast")

    assert takes_dense_path(loss(inputs.e[0].detach().requires_grad_(), inputs.c,
                                 inputs.targets[0]))
    per_sample = torch.func.vmap(torch.func.grad(loss, argnums=(0, 1)), in_dims=(0, None, 0))
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*batching rule")
        grad_e, grad_c = per_sample(inputs.e, inputs.c, inputs.targets)
    for sample in range(3):
        e = inputs.e[sample].detach().requires_grad_()
        c = inputs.c.detach().requires_grad_()
        expected = torch.autograd.grad(loss(e, c, inputs.targets[sample]), [e, c])
        assert relative_error(grad_e[sample], expected[0]) <= 1e-6
        assert relative_error(grad_c[sample], expected[1]) <= 1e-6


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("reduction, lse_gradient", [("mean", False), ("none", True)])
@pytest.mark.parametrize("tail_bytes", [8 << 20, 0], ids=["tail-copied", "in-place-to-the-end"])
def test_fast_at_small_batches_keeps_the_gradient_in_grad_c(
        dtype: torch.dtype, reduction: str, lse_gradient: bool, tail_bytes: int, device: str,
        gen: torch.Generator, monkeypatch: pytest.MonkeyPatch) -> None:
    """At N <= D / 2 the dense path takes any vocabulary (the limit is lowered below the test's
    here) and keeps G^T in dC's buffer; dC written over it segment by segment, down to the last
    row with ``tail_bytes`` 0, is the reference's, with a bias, class weights, z_loss and an
    upstream gradient on the lse."""
    monkeypatch.setattr("cce.dense.loss.DENSE_MAX_VOCAB", 1)
    monkeypatch.setattr("cce.dense.loss.DENSE_IN_PLACE_TAIL_BYTES", tail_bytes)
    kept_transposed = []
    write = cce.dense.loss.transposed_gradient
    monkeypatch.setattr("cce.dense.loss.transposed_gradient",
                        lambda *args: kept_transposed.append(args[-1].shape) or write(*args))
    inputs = make_inputs(gen, device, dtype, bias=True, shape=(2, 9), dim=40)
    weight = torch.rand(inputs.c.shape[0], generator=gen).to(device)
    check("cce", inputs, gen, reduction=reduction, lse_gradient=lse_gradient, memory="fast",
          weight=weight, z_loss=1e-3)
    # (D - N) / 2 = 11 tokens' float32 logits at a time in the buffer's head: two chunks
    assert kept_transposed == [(inputs.c.shape[0], 11), (inputs.c.shape[0], 7)]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="measures CUDA memory")
def test_fast_at_small_batches_peaks_at_the_gradients_and_a_scaled_copy_of_e(
        gen: torch.Generator) -> None:
    """With G^T in dC's buffer (N 1024 <= D / 2, V above the dense path's limit) forward and
    backward hold no more than dE + dC, the rows of e scaled for dC's product (N x D in e's
    dtype), the copied tail of G^T and 1 MiB: G C, float32 N x D, waits in the buffer's head."""
    num_tokens, dim, vocab_size = 1024, 2048, cce.config.DENSE_MAX_VOCAB + 1000
    e = (torch.randn(num_tokens, dim, generator=gen) / dim**0.5).to("cuda", torch.bfloat16)
    c = torch.randn(vocab_size, dim, generator=gen).to("cuda", torch.bfloat16)
    targets = torch.randint(0, vocab_size, (num_tokens,), generator=gen).to("cuda")
    e.requires_grad_()
    c.requires_grad_()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    loss = cce.linear_cross_entropy(e, c, targets, memory="fast")
    assert takes_dense_path(loss)
    loss.backward()
    torch.cuda.synchronize()
    gradients = (e.numel() + c.numel()) * e.element_size()
    scaled_e = e.numel() * e.element_size()
    above = torch.cuda.max_memory_allocated() - before
    assert above <= gradients + scaled_e + cce.config.DENSE_IN_PLACE_TAIL_BYTES + 2**20, (
        f"{(above - gradients) / 2**20:.1f} MiB above dE + dC")


def test_fast_at_small_batches_backward_twice_raises(device: str, gen: torch.Generator,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """The backward writes dC over the kept gradient: a second one through the same graph
    raises, whatever retain_graph said."""
    monkeypatch.setattr("cce.dense.loss.DENSE_MAX_VOCAB", 1)
    inputs = make_inputs(gen, device, torch.bfloat16, shape=(2, 9), dim=40)
    c = inputs.c.detach().requires_grad_()
    loss = cce.linear_cross_entropy(inputs.e, c, inputs.targets, memory="fast")
    assert takes_dense_path(loss)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="second backward"):
        loss.backward()


def test_fast_at_small_batches_reads_the_targets_queued_last(
        device: str, gen: torch.Generator, monkeypatch: pytest.MonkeyPatch) -> None:
    """With G in dC's memory the first logits' GEMM is queued before the targets are made
    canonical, which on a GPU runs on a second stream (cce.streams): targets that the caller's
    last kernel writes, queued behind a long one, are those the loss scores and range-checks."""
    monkeypatch.setattr("cce.dense.loss.DENSE_MAX_VOCAB", 1)
    inputs = make_inputs(gen, device, torch.bfloat16, shape=(2, 9), dim=40)
    expected = cce.linear_cross_entropy(inputs.e, inputs.c, inputs.targets, reduction="none")
    c = inputs.c.detach().requires_grad_()

    def targets_written_late(values: torch.Tensor) -> torch.Tensor:
        targets = torch.zeros_like(values)
        if device == "cuda":
            torch.cuda._sleep(20_000_000)  # the GPU is still busy when the loss is called
        return targets.copy_(values)

    loss = cce.linear_cross_entropy(inputs.e, c, targets_written_late(inputs.targets),
                                    reduction="none", memory="fast")
    assert takes_dense_path(loss)
    assert relative_error(loss, expected) <= 1e-5
    out_of_range = inputs.targets.clone()
    out_of_range[0, 3] = inputs.c.shape[0] + 5
    with pytest.raises(ValueError, match="targets must be in"):
        cce.linear_cross_entropy(inputs.e, c, targets_written_late(out_of_range),
                                 memory="fast")


def test_fast_with_one_token_and_two_dimensions_runs(device: str, gen: torch.Generator,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """N = 1, D = 2 (N <= D / 2): the head of dC's buffer would hold no row of float32 logits,
    so the call takes the kept tiles, as memory="fast" does where the dense path does not apply,
    and matches the reference (it stopped on a chunk of zero tokens)."""
    monkeypatch.setattr("cce.dense.loss.DENSE_MAX_VOCAB", 1)
    inputs = make_inputs(gen, device, torch.float16, shape=(1,), dim=2, ignored_fraction=0.0)
    check("cce", inputs, gen, memory="fast")


def test_fast_at_small_batches_under_fullgraph_compile(device: str, gen: torch.Generator,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """torch.compile(fullgraph=True) of a call that eager runs with G in dC's memory compiles
    without a graph break (it takes kept tiles there: AOTAutograd does not take a backward that
    writes over what the forward saved) and gives eager's loss and gradients within the
    reference's tolerances."""
    monkeypatch.setattr("cce.dense.loss.DENSE_MAX_VOCAB", 1)
    inputs = make_inputs(gen, device, torch.bfloat16, shape=(2, 9), dim=40)

    def loss_and_gradients(function):
        e, c = (x.detach().requires_grad_() for x in (inputs.e, inputs.c))
        loss = function(e, c, inputs.targets)
        return (loss, *torch.autograd.grad(loss, [e, c]))

    def fast(e, c, targets):
        return cce.linear_cross_entropy(e, c, targets, memory="fast")

    eager = loss_and_gradients(fast)
    compiled = loss_and_gradients(torch.compile(fast, fullgraph=True))
    for name, ours, theirs, limit in zip(("loss", "dE", "dC"), compiled, eager,
                                          (1e-5, 1e-2, 1e-2)):
        assert relative_error(ours, theirs) <= limit, name


def test_memory_must_be_low_or_fast() -> None:
    e, c, targets = torch.randn(4, 8), torch.randn(16, 8), torch.zeros(4, dtype=torch.long)
    with pytest.raises(ValueError, match="memory must be one of"):
        cce.linear_cross_entropy(e, c, targets, memory="max")


def test_dense_ops_pass_torch_library_opcheck(device: str, gen: torch.Generator) -> None:
    """torch.library.opcheck of the dense path's custom ops, G kept as (N, V) and in dC's memory:
    schemas, fake implementations against the real ones, autograd registration and tracing by
    AOTAutograd (torch.compile)."""
    from cce.dense.loss import (dense_backward, dense_backward_in_grad_c, dense_forward,
                                dense_forward_in_grad_c, queue_first_logits)

    inputs = make_inputs(gen, device, torch.float32, bias=True, ignored_fraction=0.2)
    targets = torch.where(inputs.targets >= 0, inputs.targets, -1)
    e, c, bias = (x.detach().requires_grad_() for x in (inputs.e, inputs.c, inputs.bias))
    weight = torch.rand(c.shape[0], generator=gen).to(device)
    forward_args = (e, c, bias, targets, weight, True)
    torch.library.opcheck(dense_forward, forward_args, rtol=1e-4, atol=1e-5)
    _, _, gradient = dense_forward(*forward_args)
    grad_loss = make_grad_output(gen, inputs, "none")
    backward_args = (inputs.e, inputs.c, inputs.bias, targets, weight, gradient, grad_loss,
                     torch.randn_like(grad_loss), True, True)
    torch.library.opcheck(dense_backward, backward_args, rtol=1e-4, atol=1e-5)

    inputs = make_inputs(gen, device, torch.bfloat16, bias=True, shape=(2, 9), dim=40)
    targets = inputs.targets.reshape(-1)
    targets = torch.where(targets >= 0, targets, -1)
    e, c = inputs.e.reshape(-1, 40), inputs.c
    buffer = queue_first_logits(e, c)
    forward_args = (e, c, inputs.bias, targets, weight, buffer, True)
    # Not traced by AOTAutograd: the path is not taken under torch.compile (its backward writes
    # over what the forward saved); its autograd formula is the autograd.Function's (an op that
    # mutates an input takes none).
    torch.library.opcheck(dense_forward_in_grad_c, forward_args, rtol=1e-2, atol=1e-3,
                          test_utils=("test_schema", "test_faketensor"))
    dense_forward_in_grad_c(*forward_args)
    grad_loss = torch.rand(targets.shape, generator=gen).to(device)
    backward_args = (e, c, inputs.bias, targets, weight, buffer, True, grad_loss,
                     torch.randn_like(grad_loss))
    torch.library.opcheck(dense_backward_in_grad_c, backward_args, rtol=1e-2, atol=1e-3)
