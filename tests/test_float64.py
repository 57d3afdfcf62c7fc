"""Specification of float64 inputs: accepted on every path, and exact.

F.cross_entropy takes float64 logits and ``torch.autograd.gradcheck`` needs float64, so cce takes
float64 ``e``, ``c`` and ``bias`` too and computes in float64: loss, lse and gradients are
float64 and agree with float64 PyTorch to float64 rounding. The Triton kernels are 16/32-bit:
impl "cce" computes float64 on the chunked PyTorch path (vocabulary-parallel: on materialized
shard logits), wherever the kernels would run. Under torch.autocast float64 stays float64, as in
F.linear.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import cce
from tests.distributed import rank_device, run_ranks
from tests.helpers import make_grad_output, make_inputs, run, run_reference
from tests.reference import reference, relative_error

N, V, D = 37, 1000, 72
IMPLS = ("cce", "cce_torch", "torch", "torch_compile", "chunked")
EXACT_IMPLS = ("cce", "cce_torch", "torch")  # the ones checked case by case (no compile time)
# float64 against float64: only rounding, amplified a little by the sums over V and D.
TOLERANCE = 1e-12

# Each case: (id, make_inputs keywords, linear_cross_entropy options, lse gets a gradient).
CASES = [
    ("mean-bias", dict(bias=True), dict(), False),
    ("none-ignore_index-lse", dict(ignore_index=-1), dict(reduction="none"), True),
    ("sum-weight-label_smoothing", dict(), dict(reduction="sum", label_smoothing=0.1,
                                                weight="random"), False),
    ("none-softcap-label_smoothing-weight", dict(bias=True),
     dict(reduction="none", softcap=2.5, label_smoothing=0.2, weight="random"), True),
    ("mean-shift", dict(shape=(3, 13)), dict(shift=1), False),
]


@pytest.mark.parametrize("make_options, options, lse_gradient",
                         [case[1:] for case in CASES], ids=[case[0] for case in CASES])
@pytest.mark.parametrize("impl", EXACT_IMPLS)
def test_float64_matches_float64_pytorch(impl: str, make_options: dict, options: dict,
                                         lse_gradient: bool, gen: torch.Generator,
                                         device: str) -> None:
    """Loss, lse and every gradient as F.cross_entropy on float64 logits, to ~1e-12."""
    inputs = make_inputs(gen, device, torch.float64, vocab=V, dim=D, **make_options)
    if options.get("weight") == "random":
        options = dict(options, weight=torch.rand(V, generator=gen, dtype=torch.float64)
                       .to(device))
    grad_output = make_grad_output(gen, inputs, options.get("reduction", "mean")).double()
    grad_lse = (torch.randn(inputs.targets.shape, generator=gen, dtype=torch.float64)
                .to(device) if lse_gradient else None)
    result = run(impl, inputs, grad_output, grad_lse, **options)
    ref = run_reference(inputs, grad_output, grad_lse, **options)
    for name in ("loss", "lse", "grad_e", "grad_c", "grad_bias"):
        value, wanted = getattr(result, name), getattr(ref, name)
        if wanted is None:
            continue
        assert value.dtype == torch.float64, f"{name} is {value.dtype}"
        assert relative_error(value, wanted) <= TOLERANCE, (
            f"{name}: relative error {relative_error(value, wanted):.1e}")


@pytest.mark.parametrize("impl", IMPLS)
def test_every_impl_accepts_float64(impl: str, gen: torch.Generator, device: str) -> None:
    """The baselines too: float64 in, float64 loss out, as in F.cross_entropy."""
    inputs = make_inputs(gen, device, torch.float64, vocab=V, dim=D, bias=True)
    loss = cce.linear_cross_entropy(inputs.e, inputs.c, inputs.targets, bias=inputs.bias,
                                    impl=impl)
    expected = reference(inputs.e, inputs.c, inputs.targets, bias=inputs.bias).loss
    assert loss.dtype == torch.float64 and relative_error(loss, expected) <= TOLERANCE


GRADCHECK_CASES = {
    "plain": dict(reduction="none"),
    "softcap-label_smoothing-weight": dict(softcap=1.5, label_smoothing=0.3, weight=True),
}


@pytest.mark.parametrize("options", GRADCHECK_CASES.values(), ids=GRADCHECK_CASES.keys())
@pytest.mark.parametrize("impl", EXACT_IMPLS)
def test_gradcheck(impl: str, options: dict, gen: torch.Generator, device: str) -> None:
    """torch.autograd.gradcheck of loss and lse with respect to e, c and bias, at sizes that
    are no multiple of any block, with an ignored position."""
    shape, vocab, dim = (3, 5), 7, 5
    e = torch.randn(*shape, dim, generator=gen, dtype=torch.float64).to(device)
    c = torch.randn(vocab, dim, generator=gen, dtype=torch.float64).to(device)
    bias = torch.randn(vocab, generator=gen, dtype=torch.float64).to(device)
    targets = torch.randint(0, vocab, shape, generator=gen).to(device)
    targets[0, 1] = -100
    if options.get("weight"):
        options = dict(options, weight=torch.rand(vocab, generator=gen, dtype=torch.float64)
                       .to(device) + 0.5)

    def loss_and_lse(e, c, bias):
        return cce.linear_cross_entropy(e, c, targets, bias=bias, return_lse=True, impl=impl,
                                        **options)

    leaves = tuple(tensor.requires_grad_() for tensor in (e, c, bias))
    assert torch.autograd.gradcheck(loss_and_lse, leaves)


@pytest.mark.parametrize("impl", EXACT_IMPLS)
def test_autocast_leaves_float64_alone(impl: str, gen: torch.Generator, device: str) -> None:
    """torch.autocast casts no float64 input of F.linear: nor does cce."""
    inputs = make_inputs(gen, device, torch.float64, vocab=V, dim=D, bias=True)
    expected = cce.linear_cross_entropy(inputs.e, inputs.c, inputs.targets, bias=inputs.bias,
                                        impl=impl)
    with torch.autocast(device, dtype=torch.bfloat16):
        assert F.linear(inputs.e, inputs.c, inputs.bias).dtype == torch.float64
        loss = cce.linear_cross_entropy(inputs.e, inputs.c, inputs.targets, bias=inputs.bias,
                                        impl=impl)
    assert loss.dtype == torch.float64 and torch.equal(loss, expected)


# --- Vocabulary-parallel ---------------------------------------------------------------------

SHARD_BOUNDS = (0, 113, 300)  # rank r holds rows [SHARD_BOUNDS[r], SHARD_BOUNDS[r + 1])


def vocab_parallel_worker(rank: int, world_size: int) -> None:
    """Every rank: float64 loss, lse and dE of the whole vocabulary and dC, dbias of its shard,
    with impl "cce" and "torch", as float64 PyTorch; a module as ``c`` raises on every rank."""
    gen = torch.Generator().manual_seed(0)
    device = rank_device(rank)
    vocab = SHARD_BOUNDS[-1]
    inputs = make_inputs(gen, device, torch.float64, vocab=vocab, dim=D, bias=True)
    grad_output = torch.randn(N, generator=gen, dtype=torch.float64).to(device)
    grad_lse = torch.randn(N, generator=gen, dtype=torch.float64).to(device)
    ref = reference(inputs.e, inputs.c, inputs.targets, bias=inputs.bias, reduction="none",
                    grad_output=grad_output, grad_lse=grad_lse, softcap=20.0)
    start, stop = SHARD_BOUNDS[rank], SHARD_BOUNDS[rank + 1]
    shard = cce.VocabParallelOptions(start, stop)
    for impl in ("cce", "torch"):
        e = inputs.e.detach().requires_grad_()
        c = inputs.c[start:stop].detach().requires_grad_()
        bias = inputs.bias[start:stop].detach().requires_grad_()
        loss, lse = cce.linear_cross_entropy(e, c, inputs.targets, bias=bias, softcap=20.0,
                                             reduction="none", return_lse=True, impl=impl,
                                             vocab_parallel=shard)
        grads = torch.autograd.grad([loss, lse], [e, c, bias], [grad_output, grad_lse])
        for name, value, wanted in (("loss", loss, ref.loss), ("lse", lse, ref.lse),
                                    ("grad_e", grads[0], ref.grad_e),
                                    ("grad_c", grads[1], ref.grad_c[start:stop]),
                                    ("grad_bias", grads[2], ref.grad_bias[start:stop])):
            assert value.dtype == torch.float64, f"{impl} {name} is {value.dtype}"
            error = relative_error(value, wanted)
            assert error <= TOLERANCE, f"{impl} {name}: relative error {error:.1e}"

    with pytest.raises(ValueError, match=r"(?<![\w.])c(?![\w(])"):
        cce.linear_cross_entropy(inputs.e, nn.Linear(D, stop - start, dtype=torch.float64,
                                                     device=device),
                                 inputs.targets, vocab_parallel=shard)
    dist.barrier()  # no rank was left inside a collective


def test_vocab_parallel_float64(tmp_path: Path) -> None:
    run_ranks(vocab_parallel_worker, 2, tmp_path, timeout_s=900)
