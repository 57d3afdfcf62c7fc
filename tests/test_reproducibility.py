"""Determinism, CUDA-graph capture and the kept-tiles backward, through the public API.

``deterministic=True`` (or ``torch.use_deterministic_algorithms(True)``) makes the loss, lse
and gradients bitwise identical across calls; ``keep_tiles=True`` recomputes each live tile
once and must give the default backward's gradients. The GPU-only tests capture forward and
backward in a CUDA graph, replay it on new inputs, and run with every host sync flagged as an
error (``torch.cuda.set_sync_debug_mode("error")``).
"""

from __future__ import annotations

import pytest
import torch

import cce
from tests.helpers import backward_paths_inputs
from tests.reference import relative_error

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def lm_like(n: int, v: int, d: int, dtype: torch.dtype, device: str, gen: torch.Generator):
    """Peaked rows (as a language model's) so that the filter skips most tiles."""
    e = torch.randn(n, d, generator=gen) * 3
    c = torch.randn(v, d, generator=gen) / d**0.5
    targets = torch.randint(0, v, (n,), generator=gen)
    targets[::5] = -100
    return (e.to(device, dtype).requires_grad_(), c.to(device, dtype).requires_grad_(),
            targets.to(device))


def loss_and_grads(e, c, targets, lse_weight: float = 1e-3, **options):
    """Loss, lse, dE and dC of ``loss + lse_weight * lse.sum()``."""
    e.grad = c.grad = None
    loss, lse = cce.linear_cross_entropy(e, c, targets, return_lse=True, **options)
    (loss + lse.sum() * lse_weight).backward()
    return loss.detach().clone(), lse.detach().clone(), e.grad.clone(), c.grad.clone()


# Several blocks of every size (32 tokens x 128 vocabulary x 32 dims in Triton's interpreter; 256
# vocabulary entries in its forward), multiples of none, in a third of the time of 150 x 700 x 72.
N, V, D = 100, 500, 40


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_deterministic_and_kept_tiles_match_the_default(device, gen, dtype):
    e, c, targets = lm_like(N, V, D, dtype, device, gen)
    default = loss_and_grads(e, c, targets)
    deterministic = loss_and_grads(e, c, targets, deterministic=True)
    kept = loss_and_grads(e, c, targets, keep_tiles=True)
    tolerance = 1e-5 if dtype == torch.float32 else 4e-3
    for name, values in (("deterministic", deterministic), ("keep_tiles", kept)):
        for what, value, expected in zip(("loss", "lse", "dE", "dC"), values, default):
            assert relative_error(value, expected) < tolerance, (name, what)


def test_use_deterministic_algorithms_is_honoured(device, gen):
    e, c, targets = lm_like(N, V, D, torch.bfloat16, device, gen)
    torch.use_deterministic_algorithms(True)
    try:
        first = loss_and_grads(e, c, targets)
        second = loss_and_grads(e, c, targets)
    finally:
        torch.use_deterministic_algorithms(False)
    assert all(torch.equal(a, b) for a, b in zip(first, second))


@pytest.mark.parametrize("value", [1, "yes", None])
def test_bad_flags_are_rejected(device, gen, value):
    e, c, targets = lm_like(8, 50, 16, torch.float32, device, gen)
    if value is not None:
        with pytest.raises(ValueError, match="deterministic"):
            cce.linear_cross_entropy(e, c, targets, deterministic=value)
    with pytest.raises(ValueError, match="keep_tiles"):
        cce.linear_cross_entropy(e, c, targets, keep_tiles=value)


@needs_cuda
@pytest.mark.parametrize("keep_tiles", [False, True])
def test_deterministic_is_bitwise_at_a_bench_shape(gen, keep_tiles):
    """The Gemma 2 2B shape, where the default's spin-lock merge order shows in the last bits."""
    e, c, targets = lm_like(8192, 256000, 2304, torch.bfloat16, "cuda", gen)
    runs = [loss_and_grads(e, c, targets, deterministic=True, keep_tiles=keep_tiles)
            for _ in range(3)]
    for run in runs[1:]:
        for what, value, expected in zip(("loss", "lse", "dE", "dC"), run, runs[0]):
            assert torch.equal(value, expected), what


def bias_smoothing_run(e, c, bias, weight, targets, **options):
    """Loss, lse, dE, dC and dbias of ``loss.sum() + 0.01 lse.sum()`` with label smoothing."""
    leaves = [x.clone().requires_grad_() for x in (e, c, bias)]
    loss, lse = cce.linear_cross_entropy(leaves[0], leaves[1], targets, bias=leaves[2],
                                         weight=weight, label_smoothing=0.1, return_lse=True,
                                         reduction="none", **options)
    (loss.sum() + 0.01 * lse.sum()).backward()
    return [loss.detach(), lse.detach()] + [x.grad for x in leaves]


@needs_cuda
def test_deterministic_is_bitwise_with_class_weights_and_smoothing(gen):
    inputs = backward_paths_inputs(gen)
    first = bias_smoothing_run(*inputs, deterministic=True)
    second = bias_smoothing_run(*inputs, deterministic=True)
    for what, value, expected in zip(("loss", "lse", "dE", "dC", "dbias"), second, first):
        assert torch.equal(value, expected), what


@needs_cuda
@pytest.mark.parametrize("with_weight", [False, True], ids=["unweighted", "weighted"])
@pytest.mark.parametrize("deterministic", [False, True], ids=["default", "deterministic"])
def test_bias_and_smoothing_gradients_match_float64(gen, with_weight: bool,
                                                    deterministic: bool):
    """The dC product with a bias gradient and a rank-one term, its tiles in dC's own rows."""
    e, c, bias, weight, targets = backward_paths_inputs(gen)
    weight = weight if with_weight else None
    got = bias_smoothing_run(e, c, bias, weight, targets, deterministic=deterministic)
    leaves = [x.double().requires_grad_() for x in (e, c, bias)]
    logits = leaves[0] @ leaves[1].T + leaves[2]
    loss = torch.nn.functional.cross_entropy(
        logits, targets, weight=None if weight is None else weight.double(), reduction="none",
        label_smoothing=0.1)
    (loss.sum() + 0.01 * logits.logsumexp(-1).sum()).backward()
    for what, value, expected in zip(("dE", "dC", "dbias"), got[2:], leaves):
        assert relative_error(value, expected.grad) < 5e-3, what


def replays_on_new_inputs(graph: torch.cuda.CUDAGraph, buffers: "tuple[torch.Tensor, ...]",
                          shape: "tuple[int, int, int]"):
    """Replays ``graph`` on two new bf16 ``lm_like`` inputs of ``shape`` (N, V, D), each copied
    into the captured ``buffers`` (e, c, targets) first; yields the inputs after each replay."""
    for seed in range(2):
        inputs = lm_like(*shape, torch.bfloat16, "cuda", torch.Generator().manual_seed(seed))
        with torch.no_grad():
            for buffer, value in zip(buffers, inputs, strict=True):
                buffer.copy_(value)
        graph.replay()
        yield inputs


@needs_cuda
@pytest.mark.parametrize("shape", [(2048, 32064, 3072), (4096, 128256, 1024)])
def test_capture_and_replay_match_eager(gen, shape):
    n, v, d = shape
    e, c, targets = lm_like(n, v, d, torch.bfloat16, "cuda", gen)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up (compilation) outside the capture
        for _ in range(2):
            loss_and_grads(e, c, targets, deterministic=True)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    e.grad = c.grad = None
    with torch.cuda.graph(graph):
        loss = cce.linear_cross_entropy(e, c, targets, deterministic=True)
        loss.backward()
    for new_e, new_c, new_targets in replays_on_new_inputs(graph, (e, c, targets), shape):
        expected = loss_and_grads(new_e, new_c, new_targets, lse_weight=0.0,
                                  deterministic=True)
        torch.cuda.synchronize()
        assert relative_error(loss, expected[0]) < 1e-6
        assert relative_error(e.grad, expected[2]) < 1e-2
        assert relative_error(c.grad, expected[3]) < 1e-2


# Every output, with z_loss and a temperature: what an RL step asks of one call.
ALL_OUTPUTS = dict(return_lse=True, return_entropy=True, return_argmax=True, z_loss=1e-4,
                   temperature=0.7)


def all_outputs_and_grads(e, c, targets, entropy_weight, **options):
    """Loss, lse, entropy, argmax, dE and dC of ``loss + 1e-3 * lse.sum() + (entropy *
    entropy_weight).sum()``."""
    e.grad = c.grad = None
    loss, lse, entropy, argmax = cce.linear_cross_entropy(e, c, targets, **ALL_OUTPUTS,
                                                          **options)
    (loss + 1e-3 * lse.sum() + (entropy * entropy_weight).sum()).backward()
    return (loss.detach().clone(), lse.detach().clone(), entropy.detach().clone(),
            argmax.clone(), e.grad.clone(), c.grad.clone())


@needs_cuda
def test_capture_and_replay_with_entropy_and_argmax_match_eager(gen):
    """As above with the lse, entropy (and an entropy bonus's gradient) and argmax returned,
    z_loss and a temperature."""
    e, c, targets = lm_like(2048, 32064, 1024, torch.bfloat16, "cuda", gen)
    entropy_weight = 1e-2 * torch.rand(targets.shape, generator=gen).to("cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up (compilation) outside the capture
        for _ in range(2):
            all_outputs_and_grads(e, c, targets, entropy_weight, deterministic=True)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    e.grad = c.grad = None
    with torch.cuda.graph(graph):
        loss, lse, entropy, argmax = cce.linear_cross_entropy(e, c, targets, deterministic=True,
                                                              **ALL_OUTPUTS)
        (loss + 1e-3 * lse.sum() + (entropy * entropy_weight).sum()).backward()
    for new_e, new_c, new_targets in replays_on_new_inputs(graph, (e, c, targets),
                                                           (2048, 32064, 1024)):
        expected = all_outputs_and_grads(new_e, new_c, new_targets, entropy_weight,
                                         deterministic=True)
        torch.cuda.synchronize()
        for name, value, want in zip(("loss", "lse", "entropy"), (loss, lse, entropy),
                                     expected):
            assert relative_error(value, want) < 1e-6, name
        assert torch.equal(argmax, expected[3])
        assert relative_error(e.grad, expected[4]) < 1e-2
        assert relative_error(c.grad, expected[5]) < 1e-2


@needs_cuda
def test_no_host_sync_with_entropy_and_argmax(gen):
    e, c, targets = lm_like(2048, 32064, 512, torch.bfloat16, "cuda", gen)
    entropy_weight = 1e-2 * torch.rand(targets.shape, generator=gen).to("cuda")
    expected = all_outputs_and_grads(e, c, targets, entropy_weight, deterministic=True)
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = all_outputs_and_grads(e, c, targets, entropy_weight, deterministic=True)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert torch.equal(got[3], expected[3])  # argmax
    for value, reference in zip(got[:3] + got[4:], expected[:3] + expected[4:]):
        assert relative_error(value, reference) < 1e-2


@needs_cuda
def test_no_host_sync_when_syncs_are_errors(gen):
    e, c, targets = lm_like(2048, 32064, 512, torch.bfloat16, "cuda", gen)
    expected = loss_and_grads(e, c, targets, deterministic=True)
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = loss_and_grads(e, c, targets, deterministic=True)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    for value, reference in zip(got, expected):
        assert relative_error(value, reference) < 1e-2
