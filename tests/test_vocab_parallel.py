"""Vocabulary parallelism (``vocab_parallel=cce.VocabParallelOptions(start, stop)``): every rank
gets the loss, lse, entropy, argmax and dE of the unsharded call, and the dC and dbias rows of
its shard.

The ranks are processes joined over gloo (on the CPU, where the kernels run in Triton's
interpreter, or sharing the GPUs there are), with uneven shards; each checks its results
against the unsharded call and the float64 reference on the same inputs, and that loss, lse and
dE are bitwise the same on every rank. Cases share a spawn per world size, since starting
processes is slow; every spawn has a time limit, so a hang fails (tests/distributed.py).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import pytest
import torch
import torch.distributed as dist

import cce
import cce.cce_function
from cce.options import VOCAB_PARALLEL_IMPLS
from tests.distributed import rank_device, run_ranks
from tests.helpers import (Inputs, assert_matches, confident_inputs, make_grad_output,
                           make_inputs, peaked_inputs, run, run_reference)
from tests.reference import Result, relative_error

N, V, D = 24, 300, 40
# Each world size's shard boundaries: rank r holds rows [BOUNDS[r], BOUNDS[r + 1]), uneven.
SHARD_BOUNDS = {2: (0, 113, V), 3: (0, 40, 211, V)}
SPAWN_TIMEOUT_S = 900


@dataclass(frozen=True)
class Case:
    """One vocabulary-parallel call, compared with the unsharded one; ``options`` go to
    linear_cross_entropy."""

    dtype: torch.dtype
    impl: str = "cce"
    bias: bool = False
    shape: tuple = (N,)
    ignore_index: int = -100
    lse_gradient: bool = False
    options: dict = field(default_factory=dict)


CASES = (
    # float32 with exact gradients: as close to the unsharded call as float32 sums allow.
    Case(torch.float32, lse_gradient=True, options=dict(filter_eps=None)),
    Case(torch.float32, bias=True,
         options=dict(filter_eps=None, reduction="sum", softcap=20.0)),
    Case(torch.float32, shape=(2, 12), ignore_index=-1,
         options=dict(filter_eps=None, reduction="none", shift=1)),
    # 16-bit with the default gradient filter, vocabulary sorting and filter correction.
    Case(torch.bfloat16, bias=True),
    Case(torch.bfloat16, lse_gradient=True, options=dict(reduction="sum", softcap=20.0)),
    Case(torch.bfloat16, options=dict(vocab_sorting=False, filter_correction=False)),
    Case(torch.float32, bias=True, lse_gradient=True,
         options=dict(filter_eps=None, softcap=20.0, temperature=0.7, z_loss=1e-2)),
    Case(torch.bfloat16, options=dict(temperature=0.5, z_loss=1e-3)),  # e / 0.5 is exact
    Case(torch.float16, options=dict(reduction="none")),
    # Materialized shard logits, autograd for the backward.
    Case(torch.float32, impl="torch", bias=True, lse_gradient=True,
         options=dict(reduction="sum", softcap=20.0)),
    Case(torch.bfloat16, impl="torch"),
)


def case_inputs(case: Case, gen: torch.Generator, bounds: tuple,
                device: torch.device) -> Inputs:
    """Random inputs with ignored targets and, in every shard, targets on its first and last
    rows."""
    inputs = make_inputs(gen, device, case.dtype, shape=case.shape, vocab=V, dim=D,
                         bias=case.bias, ignore_index=case.ignore_index)
    flat_targets = inputs.targets.view(-1)
    for rank in range(len(bounds) - 1):
        flat_targets[2 * rank] = bounds[rank]
        flat_targets[2 * rank + 1] = bounds[rank + 1] - 1
    flat_targets[-2] = case.ignore_index  # the shift's scored positions have one too
    return inputs


def shard_inputs(inputs: Inputs, start: int, stop: int) -> Inputs:
    bias = None if inputs.bias is None else inputs.bias[start:stop]
    return dataclasses.replace(inputs, c=inputs.c[start:stop], bias=bias)


def shard_result(result: Result, start: int, stop: int) -> Result:
    """What a rank holding rows [start, stop) expects of an unsharded result."""
    grad_bias = None if result.grad_bias is None else result.grad_bias[start:stop]
    return dataclasses.replace(result, grad_c=result.grad_c[start:stop], grad_bias=grad_bias)


def assert_same_on_every_rank(result: Result, world_size: int,
                              names: tuple = ("loss", "lse", "grad_e")) -> None:
    for name in names:
        # In float32, which holds 16-bit values exactly, on the CPU, where gloo gathers any dtype.
        value = getattr(result, name).to("cpu", torch.float32).contiguous()
        gathered = [torch.empty_like(value) for _ in range(world_size)]
        dist.all_gather(gathered, value)
        assert all(torch.equal(other, gathered[0]) for other in gathered), (
            f"{name} differs between ranks")


def matches_unsharded_worker(rank: int, world_size: int) -> None:
    bounds = SHARD_BOUNDS[world_size]
    start, stop = bounds[rank], bounds[rank + 1]
    shard = cce.VocabParallelOptions(start, stop)
    device = rank_device(rank)
    for index, case in enumerate(CASES):
        gen = torch.Generator().manual_seed(index)  # the same inputs on every rank
        inputs = case_inputs(case, gen, bounds, device)
        reduction = case.options.get("reduction", "mean")
        grad_output = make_grad_output(gen, inputs, reduction)
        grad_lse = (torch.randn(inputs.targets.shape, generator=gen).to(device)
                    if case.lse_gradient else None)
        options = {key: value for key, value in case.options.items() if key != "reduction"}
        try:
            sharded = run(case.impl, shard_inputs(inputs, start, stop), grad_output, grad_lse,
                          reduction=reduction, vocab_parallel=shard, **options)
            unsharded = run(case.impl, inputs, grad_output, grad_lse, reduction=reduction,
                            **options)
            reference = run_reference(inputs, grad_output, grad_lse, reduction=reduction,
                                      **options)
            for expected in (unsharded, reference):
                assert_matches(sharded, shard_result(expected, start, stop), case.impl,
                               case.dtype, inputs.targets, reduction)
            assert_same_on_every_rank(sharded, world_size)
        except AssertionError as error:
            raise AssertionError(f"rank {rank} of {world_size}, {case}") from error
    shards_skip_negligible_tiles(rank, world_size)
    confident_rows_are_as_accurate_as_pytorch(rank, world_size)
    entropy_and_argmax_are_the_unsharded_ones(rank, world_size)
    if world_size == 3:
        an_empty_shard_contributes_nothing(rank)


# return_entropy and return_argmax: float32 with exact gradients (bias, softcap, temperature,
# shift, lse), bfloat16 with the default filter (and z_loss), and the materialized shards.
ENTROPY_CASES = (
    Case(torch.float32, bias=True, shape=(2, 12), lse_gradient=True,
         options=dict(filter_eps=None, reduction="none", shift=1, softcap=20.0,
                      temperature=0.7)),
    Case(torch.bfloat16, options=dict(z_loss=1e-3)),
    Case(torch.float32, impl="torch", bias=True, options=dict(reduction="sum")),
)


def entropy_and_argmax_are_the_unsharded_ones(rank: int, world_size: int) -> None:
    """Every rank gets the entropy (within the float32 tolerance) and the argmax (exactly) of
    the unsharded call, bitwise the same on every rank, and with a random upstream gradient of
    the entropy the unsharded dE and its shard's dC and dbias; with 3 ranks also where one
    holds no rows."""
    splits = [SHARD_BOUNDS[world_size]] + ([(0, 150, 150, V)] if world_size == 3 else [])
    device = rank_device(rank)
    for bounds in splits:
        start, stop = bounds[rank], bounds[rank + 1]
        for index, case in enumerate(ENTROPY_CASES):
            gen = torch.Generator().manual_seed(200 + index)  # the same inputs on every rank
            inputs = case_inputs(case, gen, bounds, device)
            reduction = case.options.get("reduction", "mean")
            grad_output = make_grad_output(gen, inputs, reduction)
            grad_lse = (torch.randn(inputs.targets.shape, generator=gen).to(device)
                        if case.lse_gradient else None)
            grad_entropy = torch.randn(inputs.targets.shape, generator=gen).to(device)
            options = {key: value for key, value in case.options.items() if key != "reduction"}
            try:
                sharded = run(case.impl, shard_inputs(inputs, start, stop), grad_output,
                              grad_lse, grad_entropy, reduction=reduction, return_argmax=True,
                              vocab_parallel=cce.VocabParallelOptions(start, stop), **options)
                unsharded = run(case.impl, inputs, grad_output, grad_lse, grad_entropy,
                                reduction=reduction, return_argmax=True, **options)
                reference = run_reference(inputs, grad_output, grad_lse, grad_entropy,
                                          reduction=reduction, **options)
                assert torch.equal(sharded.argmax, unsharded.argmax), "argmax"
                for expected in (unsharded, reference):  # entropy and argmax included
                    assert_matches(sharded, shard_result(expected, start, stop), case.impl,
                                   case.dtype, inputs.targets, reduction)
                assert_same_on_every_rank(sharded, world_size,
                                          ("loss", "lse", "entropy", "argmax", "grad_e"))
            except AssertionError as error:
                raise AssertionError(f"rank {rank} of {world_size}, rows [{start}, {stop}), "
                                     f"{case}") from error


def confident_rows_are_as_accurate_as_pytorch(rank: int, world_size: int) -> None:
    """Where the model is sure of the target (1 - p_target about 1e-7), the loss and the
    gradients come from 1 - p_target to its own precision, as on one GPU
    (tests/test_correctness.py): at least as accurate as PyTorch's float32 logits."""
    bounds = SHARD_BOUNDS[world_size]
    start, stop = bounds[rank], bounds[rank + 1]
    device = rank_device(rank)
    gen = torch.Generator().manual_seed(1)
    inputs = Inputs(*confident_inputs(gen, device, torch.float32, N, V, D, 1e-7))
    grad_output = make_grad_output(gen, inputs, "none")
    for impl in VOCAB_PARALLEL_IMPLS:
        sharded = run(impl, shard_inputs(inputs, start, stop), grad_output, reduction="none",
                      filter_eps=None, vocab_parallel=cce.VocabParallelOptions(start, stop))
        reference = shard_result(run_reference(inputs, grad_output, reduction="none"), start,
                                 stop)
        theirs = run("torch", inputs, grad_output, reduction="none")
        theirs = shard_result(theirs, start, stop)
        for name in ("loss", "grad_e", "grad_c"):
            ours_error = relative_error(getattr(sharded, name), getattr(reference, name))
            their_error = relative_error(getattr(theirs, name), getattr(reference, name))
            assert ours_error <= max(their_error, 1e-5), (
                f"rank {rank}, impl {impl}: {name} {ours_error:.1e} > PyTorch's "
                f"{their_error:.1e}")


def an_empty_shard_contributes_nothing(rank: int) -> None:
    """A rank may hold no rows (more ranks than a split gives rows to): it gets the unsharded
    loss, lse and dE like the others, and an empty dC."""
    bounds = (0, 150, 150, V)  # rank 1 holds [150, 150)
    start, stop = bounds[rank], bounds[rank + 1]
    device = rank_device(rank)
    for index, (impl, dtype) in enumerate((("cce", torch.float32), ("cce", torch.bfloat16),
                                           ("torch", torch.float32))):
        gen = torch.Generator().manual_seed(100 + index)
        inputs = make_inputs(gen, device, dtype, vocab=V, dim=D, bias=True)
        grad_output = make_grad_output(gen, inputs, "mean")
        grad_lse = torch.randn(inputs.targets.shape, generator=gen).to(device)
        sharded = run(impl, shard_inputs(inputs, start, stop), grad_output, grad_lse,
                      vocab_parallel=cce.VocabParallelOptions(start, stop))
        unsharded = run(impl, inputs, grad_output, grad_lse)
        assert sharded.grad_c.shape == (stop - start, D)
        assert_matches(sharded, shard_result(unsharded, start, stop), impl, dtype,
                       inputs.targets, "mean")
        assert_same_on_every_rank(sharded, 3)


def shards_skip_negligible_tiles(rank: int, world_size: int) -> None:
    """With a peaked softmax whose targets are its likeliest tokens, every rank's backward
    skips tiles without recomputing them (the forward's bounds cover the rows whose target is
    another shard's: with no bound for them, every tile of their token blocks would be live),
    and the gradients stay within the 16-bit tolerance."""
    vocab = 3 * V  # a few vocabulary blocks per shard
    start, stop = vocab * rank // world_size, vocab * (rank + 1) // world_size
    device = rank_device(rank)
    e, c, targets = peaked_inputs(torch.Generator().manual_seed(0), device, 40, vocab, D)
    targets = torch.where(targets >= 0, (e @ c.T).argmax(dim=1), -1)
    inputs = Inputs(e.bfloat16(), c.bfloat16(), targets, options=dict(ignore_index=-1))
    grad_output = torch.tensor(1.0, device=device)
    tables = []
    recompute_table = cce.cce_function.recompute_table

    def recorded_table(*args) -> torch.Tensor:
        tables.append(recompute_table(*args))
        return tables[-1]

    cce.cce_function.recompute_table = recorded_table
    try:
        sharded = run("cce", shard_inputs(inputs, start, stop), grad_output,
                      vocab_parallel=cce.VocabParallelOptions(start, stop))
    finally:
        cce.cce_function.recompute_table = recompute_table
    live_fraction = tables[0].float().mean().item()
    assert live_fraction < 1, f"rank {rank}: every tile is live"
    reference = shard_result(run_reference(inputs, grad_output), start, stop)
    assert_matches(sharded, reference, "cce", torch.bfloat16, targets, "mean")


def ranks_worker(rank: int, world_size: int) -> None:
    """What the ranks of one spawn check, in order: the unsharded results
    (matches_unsharded_worker), a DTensor classifier (dtensor_worker) and, with 3 ranks,
    inconsistent ranges (bad_arguments_worker)."""
    matches_unsharded_worker(rank, world_size)
    dtensor_worker(rank, world_size)
    if world_size == 3:
        bad_arguments_worker(rank, world_size)


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 3])
def test_every_rank_gets_the_unsharded_results(world_size: int, tmp_path: Path) -> None:
    """Every case of CASES, then the tile skipping of shards_skip_negligible_tiles, confident
    rows, the entropy and argmax (entropy_and_argmax_are_the_unsharded_ones) and, with 3 ranks,
    an empty shard; then, in the same processes (each spawn starts as many Pythons that import
    torch and cce), a classifier that is a DTensor sharded by rows is a vocab-parallel call
    (dtensor_worker) and, with 3 ranks, inconsistent ranges raise on every rank
    (bad_arguments_worker)."""
    run_ranks(ranks_worker, world_size, tmp_path, timeout_s=SPAWN_TIMEOUT_S)


# Ranges of 3 ranks that do not partition [0, V) in rank order, and the error every rank raises.
BAD_RANGES = (
    (((0, 40), (40, 30), (30, V)), r"rank 1 holds rows \[40, 30\).*stop must not be less "
                                   r"than start"),
    (((5, 40), (40, 211), (211, V)), r"rank 0's rows \[5, 40\) must start at 0"),
    (((0, 40), (45, 211), (211, V)), r"rank 1's rows \[45, 211\) leave a gap after rank 0's "
                                     r"\[0, 40\)"),
    (((0, 40), (30, 211), (211, V)), r"rank 1's rows \[30, 211\) overlap rank 0's \[0, 40\)"),
)


def bad_arguments_worker(rank: int, world_size: int) -> None:
    """Every rank raises the same ValueError; good calls afterwards (one without tokens) show
    that no rank was left inside a collective."""
    gen = torch.Generator().manual_seed(0)
    device = rank_device(rank)
    e = torch.randn(N, D, generator=gen).to(device)
    c = torch.randn(V, D, generator=gen).to(device)
    targets = torch.randint(0, V, (N,), generator=gen).to(device)
    good_ranges = [(SHARD_BOUNDS[3][r], SHARD_BOUNDS[3][r + 1]) for r in range(3)]

    def call(ranges, rows: Optional[int] = None, call_targets: torch.Tensor = targets):
        start, stop = ranges[rank]
        c_local = c[start:start + (rows if rows is not None else max(stop - start, 0))]
        return cce.linear_cross_entropy(e, c_local, call_targets, filter_eps=None,
                                        vocab_parallel=cce.VocabParallelOptions(start, stop))

    for ranges, message in BAD_RANGES:
        with pytest.raises(ValueError, match=message):
            call(ranges)
    with pytest.raises(ValueError, match=r"rank 2's c has 70 rows .*\[211, 300\) of 89 rows"):
        call(good_ranges, rows=70 if rank == 2 else None)
    with pytest.raises(ValueError, match=r"targets must be in \[0, 300\)"):
        call(good_ranges, call_targets=torch.full((N,), V, device=device))

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    sharded_c = distribute_tensor(c.cpu(), init_device_mesh("cpu", (world_size,)), [Shard(0)])
    with pytest.raises(ValueError, match="c is a DTensor"):
        cce.linear_cross_entropy(e.cpu(), sharded_c, targets.cpu())

    assert torch.isfinite(call(good_ranges))
    start, stop = good_ranges[rank]
    c_local = c[start:stop].requires_grad_()
    no_tokens = cce.linear_cross_entropy(e[:0], c_local, targets[:0], reduction="sum",
                                         vocab_parallel=cce.VocabParallelOptions(start, stop))
    no_tokens.backward()
    assert no_tokens == 0 and torch.equal(c_local.grad, torch.zeros_like(c_local))


def test_options_are_checked_before_any_collective() -> None:
    e, c = torch.randn(4, 8), torch.randn(10, 8)
    targets = torch.zeros(4, dtype=torch.long)
    with pytest.raises(ValueError, match="VocabParallelOptions.start must be an int"):
        cce.VocabParallelOptions(1.0, 10)
    with pytest.raises(ValueError, match="vocab_parallel must be None or a"):
        cce.linear_cross_entropy(e, c, targets, vocab_parallel=(0, 10))
    with pytest.raises(ValueError, match=r"impl must be one of \('cce', 'torch'\) with "
                                         r"vocab_parallel"):
        cce.LinearCrossEntropy(impl="chunked", vocab_parallel=cce.VocabParallelOptions(0, 10))
    with pytest.raises(ValueError, match="needs torch.distributed to be initialized"):
        cce.linear_cross_entropy(e, c, targets, vocab_parallel=cce.VocabParallelOptions(0, 10))


def dtensor_worker(rank: int, world_size: int) -> None:
    """A classifier that is a DTensor sharded by rows, as tensor parallelism places an output
    layer's weight, with e a DTensor of the same mesh: the loss, dE and the DTensor's dC (and
    dbias) are the unsharded call's, with no VocabParallelOptions; V = 37 does not divide
    between the ranks (torch.chunk's split). A replicated classifier is the plain call."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    gen = torch.Generator().manual_seed(0)
    num_tokens, vocab, dim = 23, 37, 16
    e = torch.randn(num_tokens, dim, generator=gen)
    c = torch.randn(vocab, dim, generator=gen) * 0.5
    bias = torch.randn(vocab, generator=gen)
    targets = torch.randint(0, vocab, (num_tokens,), generator=gen)
    targets[::5] = -100
    mesh = init_device_mesh("cpu", (world_size,))
    for placement in (Shard(0), Replicate()):
        leaves = [e.clone().requires_grad_(), c.clone().requires_grad_(),
                  bias.clone().requires_grad_()]
        expected = cce.linear_cross_entropy(*leaves[:2], targets, bias=leaves[2],
                                            filter_eps=None, temperature=0.8, z_loss=1e-2)
        expected.backward()
        e_d = distribute_tensor(e, mesh, [Replicate()]).requires_grad_()
        c_d = distribute_tensor(c, mesh, [placement]).requires_grad_()
        bias_d = distribute_tensor(bias, mesh, [placement]).requires_grad_()
        loss = cce.linear_cross_entropy(e_d, c_d, targets, bias=bias_d, filter_eps=None,
                                        temperature=0.8, z_loss=1e-2)
        loss.backward()
        assert relative_error(loss, expected) <= 1e-6, placement
        for name, got, want in (("e", e_d.grad, leaves[0].grad), ("c", c_d.grad, leaves[1].grad),
                                ("bias", bias_d.grad, leaves[2].grad)):
            assert tuple(got.placements) == tuple(
                {"e": e_d, "c": c_d, "bias": bias_d}[name].placements), (name, placement)
            error = relative_error(got.full_tensor(), want)
            assert error <= 1e-5, f"{name} ({placement}): relative error {error:.1e}"
    with pytest.raises(ValueError, match="vocab_parallel must be None when c is a DTensor"):
        cce.linear_cross_entropy(distribute_tensor(e, mesh, [Replicate()]),
                                 distribute_tensor(c, mesh, [Shard(0)]), targets,
                                 vocab_parallel=cce.VocabParallelOptions(0, vocab))
    with pytest.raises(ValueError, match=r"c is a DTensor placed as Shard\(dim=1\)"):
        cce.linear_cross_entropy(distribute_tensor(e, mesh, [Replicate()]),
                                 distribute_tensor(c, mesh, [Shard(1)]), targets)
