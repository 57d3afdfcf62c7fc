"""The backward's paths (cce.backward), exercised where they take every branch.

With D a multiple of the vocabulary block, pass 1 (dE) stores its chunks of logit gradients in
dC's memory and pass 2 (dC) in the rows of dC that are still free, with chunks that shrink as dC
fills up, and then in a spare buffer for the end of the vocabulary. When every live tile fits in
dC's memory, one pass recomputes each once instead, into dC's last rows, and writes dC in chunks
that widen, then through the spare buffer. The shapes below, derived from the tile grid of the
dtype, make each path take several chunks and leave a tail for the spare buffer; the gradients
must match the float64 reference whatever the path.
"""

from __future__ import annotations

from typing import Callable, Iterator, Optional

import numpy as np
import pytest
import torch

import cce.backward.plan
import cce.backward.run
import cce.backward.classifier_product
from cce.backward.plan import BackwardPlan, ClassifierPlan, forced
from cce.cce_function import loss_backward, loss_forward
from cce.forward.classifier_sums import (classifier_sums, classifier_sums_by_kernel,
                                         classifier_sums_by_torch)
from cce.config import dot_precision, kernel_configs
from cce.host_copy import start_host_copy
from cce.backward.tile_lists import build_tile_lists
from cce.backward.partial_sums import sum_partials
from tests.helpers import (Inputs, check, make_grad_output, make_inputs, peaked_inputs,
                           run_reference)
from tests.reference import relative_error

# Tokens: eight token blocks, the last one partial (pass 1's chunks of whole rows of the grid
# hold 7 of them at D = two segments); SMALL_N: three, for the tests that need no more chunks.
N = 229
SMALL_N = 89


def _shape(dtype: torch.dtype, vocab_blocks: int = 5) -> "tuple[int, int]":
    """(V, D): ``vocab_blocks`` vocabulary blocks (the last one partial) and two segments per
    row of dC. (Five: pass 2 still takes two chunks of dC's rows, then the spare buffer.)"""
    block = kernel_configs(dtype).live_grid.block_vocab
    return vocab_blocks * block - 30, 2 * block


@pytest.fixture(autouse=True)
def spare_buffer_of_one_block() -> Iterator[None]:
    """The real spare buffer holds more than these small vocabularies: shrink it to one
    vocabulary block, so that pass 2 uses the free rows of dC first."""
    with forced(spare_bytes=1):
        yield


@pytest.fixture
def two_passes() -> Iterator[None]:
    """The two-pass backward even where the tiles would fit in dC's memory."""
    with forced(one_pass=False):
        yield


def _backwards(plans: "list[BackwardPlan | ClassifierPlan]"
               ) -> "list[tuple[BackwardPlan, Optional[ClassifierPlan]]]":
    """Each backward's plan, with its dC plan (made with it, or after its pass 1)."""
    backwards = []
    for plan in plans:
        if isinstance(plan, BackwardPlan):
            backwards.append((plan, plan.classifier))
        else:
            backwards[-1] = (backwards[-1][0], plan)
    return backwards


def _in_spare(classifier: ClassifierPlan) -> "list[bool]":
    return [chunk.in_spare for chunk in classifier.chunks]


# Left out for CI's time: float32 without a filter, which stores every tile as bfloat16 does;
# float32 unsorted (the order is the sorted case's with another permutation); bfloat16 without
# a filter unsorted (every tile is stored: sorting changes only their order).
@pytest.mark.parametrize("dtype, filter_eps, vocab_sorting", [
    pytest.param(torch.float32, "auto", True, id="fp32-filter-sorted"),
    pytest.param(torch.bfloat16, "auto", True, id="bf16-filter-sorted"),
    pytest.param(torch.bfloat16, "auto", False, id="bf16-filter-unsorted"),
    pytest.param(torch.bfloat16, None, True, id="bf16-nofilter-sorted")])
def test_chunked_passes_match_reference(dtype: torch.dtype, filter_eps: Optional[str],
                                        vocab_sorting: bool, device: str,
                                        gen: torch.Generator, two_passes: None) -> None:
    """Several dE chunks of whole rows of the grid (as at large D; these small shapes' few
    tokens per chunk would take slots, which the next test covers), several shrinking dC chunks
    and a tail through the spare buffer (one segment per page), all exact."""
    vocab, dim = _shape(dtype)
    inputs = make_inputs(gen, device, dtype, shape=(N,), vocab=vocab, dim=dim, bias=True,
                         softcap=20.0)
    with forced(slots=False) as plans:
        check("cce", inputs, gen, "mean", filter_eps=filter_eps, vocab_sorting=vocab_sorting)
    ((plan, classifier),) = _backwards(plans)
    in_spare = _in_spare(classifier)
    assert len(plan.pass_one.chunks) >= 2 and plan.pass_one.slot_map is None
    assert in_spare.count(False) >= 2 and in_spare[-1]
    assert in_spare == sorted(in_spare)  # free rows first, then the spare buffer


@pytest.mark.parametrize("deterministic", [False, True], ids=["default", "deterministic"])
def test_pass_one_stores_only_live_tiles_in_slots(deterministic: bool, device: str,
                                                  gen: torch.Generator,
                                                  two_passes: None) -> None:
    """Where chunks of whole rows of the grid would hold few tokens (small D: here 3 token
    blocks) and the forward's bounds leave tiles dead, pass 1 gives each live tile a slot of
    dC's memory instead, so that a chunk holds more token blocks than whole rows would; the
    gradients still match the reference, in deterministic mode too (its live tiles do not
    depend on the forward's schedule). (bf16: float32's default filter threshold keeps nearly
    every tile live.)"""
    grid = kernel_configs(torch.bfloat16).live_grid
    vocab = _shape(torch.bfloat16)[0]
    row_segments = grid.block_tokens * -(-vocab // grid.block_vocab)
    dim = -(-3 * row_segments // vocab) * grid.block_vocab  # dC: 3 whole rows of the grid
    e, c, targets = peaked_inputs(gen, device, 8 * grid.block_tokens - 5, vocab, dim)
    # Targets among each row's likeliest entries, as a trained model's are: they keep few
    # tiles live.
    targets = torch.where(targets >= 0, (e @ c.T).argmax(dim=1), targets)
    inputs = Inputs(e.bfloat16(), c.bfloat16(), targets, options={"ignore_index": -1})
    with forced() as plans:
        check("cce", inputs, gen, "mean", deterministic=deterministic)
    ((plan, _),) = _backwards(plans)
    whole_rows_per_chunk = vocab * (dim // grid.block_vocab) // row_segments
    token_blocks = [chunk.token_blocks for chunk in plan.pass_one.chunks]
    assert plan.pass_one.slot_map is not None
    assert [block for chunk in token_blocks for block in chunk] == list(range(8))
    assert max(len(chunk) for chunk in token_blocks) > whole_rows_per_chunk


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_split_embeddings_product_matches_reference(dtype: torch.dtype, device: str,
                                                    gen: torch.Generator,
                                                    two_passes: None) -> None:
    """Each output block's list of the dE product split among 3 programs, as on a GPU when a
    chunk has too few output blocks to fill it: the partial sums add up to the exact dE."""
    vocab, dim = _shape(dtype)
    inputs = make_inputs(gen, device, dtype, shape=(N,), vocab=vocab, dim=dim)
    with forced(splits=3) as plans:
        check("cce", inputs, gen, "mean")
    ((plan, _),) = _backwards(plans)
    assert {chunk.product.splits for chunk in plan.pass_one.chunks} == {3}


# The paths follow the blocks' shapes, not the dtype: one float32 case, for CI's time.
@pytest.mark.parametrize("dtype, label_smoothing, dim_in_widths", [
    pytest.param(torch.float32, 0.0, 4, id="fp32-plain-whole"),
    pytest.param(torch.bfloat16, 0.0, 4, id="bf16-plain-whole"),
    pytest.param(torch.bfloat16, 0.1, 4, id="bf16-smoothed-whole"),
    pytest.param(torch.bfloat16, 0.0, 2.5, id="bf16-plain-half-width"),
    pytest.param(torch.bfloat16, 0.1, 2.5, id="bf16-smoothed-half-width")])
def test_whole_blocks_match_reference(dtype: torch.dtype, label_smoothing: float,
                                      dim_in_widths: float, device: str, gen: torch.Generator,
                                      two_passes: None) -> None:
    """When every token, vocabulary and output block is whole, pass 1's dE product runs without
    masks and, where its configuration says so (16-bit on a GPU, and in the interpreter), takes
    each tile in shallower steps: the gradients still match the reference. A D that only half
    the configured output width divides (2.5 widths: Gemma 3's 640 on a GPU) gets outputs of
    that half, all whole, except with label smoothing's rank-one term (measured slower). (Pass
    1 in whole rows of the grid: slots, which these few tokens per chunk would get, forgo the
    whole-block loop.)"""
    configs = kernel_configs(dtype)
    grid, width = configs.live_grid, configs.sparse_tile_matmul.block_out
    inputs = make_inputs(gen, device, dtype, shape=(3 * grid.block_tokens,),
                         vocab=3 * grid.block_vocab, dim=int(dim_in_widths * width))
    with forced(slots=False) as plans:
        check("cce", inputs, gen, "mean", label_smoothing=label_smoothing)
    ((plan, classifier),) = _backwards(plans)
    embeddings = [chunk.product for chunk in plan.pass_one.chunks]
    depth = configs.whole_block_embeddings_product.step_depth
    whole_widths = dim_in_widths == int(dim_in_widths)
    halved = not whole_widths and not label_smoothing and depth > 0
    whole = depth > 0 and (whole_widths or halved)
    assert embeddings and all(product.whole_blocks == whole for product in embeddings)
    assert all(product.block_out == (width // 2 if halved else width) for product in embeddings)
    # Whole blocks take the configuration of shallower steps (its step depth).
    assert all(product.config == (configs.whole_block_embeddings_product if whole
                                  else configs.sparse_tile_matmul) for product in embeddings)
    assert not classifier.product.whole_blocks


@pytest.mark.parametrize("spare_tiles", [4, 9])
def test_classifier_chunks_are_the_widest_that_fit(spare_tiles: int,
                                                   gen: torch.Generator) -> None:
    """Pass 2's chunks cover the vocabulary blocks in order; each holds the most blocks whose
    tiles fit in the rows of dC of later positions, and once the spare buffer holds more, the
    most it holds (tiles per block as sorting leaves them: many at the head, few after)."""
    block_tokens, block_vocab, dim = 32, 128, 256
    vocab = 60 * block_vocab - 5
    tiles_per_block = np.array([9] * 6 + torch.randint(0, 4, (54,), generator=gen).tolist())
    chunks = cce.backward.plan._classifier_chunks(tiles_per_block, vocab, dim, block_tokens,
                                             block_vocab, True, spare_tiles)

    def fits(blocks: range, in_spare: bool) -> bool:
        tiles = sum(tiles_per_block[blocks.start:blocks.stop])
        if in_spare:
            return tiles <= spare_tiles
        free_segments = (vocab - blocks.stop * block_vocab) * (dim // block_vocab)
        return tiles * block_tokens <= free_segments

    _assert_widest_chunks(chunks, 60, fits)

    def widest(first: int, in_spare: bool) -> int:
        """The most blocks from ``first`` on that fit (the spare buffer takes one at least)."""
        widths = [width for width in range(1, 61 - first)
                  if fits(range(first, first + width), in_spare)]
        return max(widths, default=1 if in_spare else 0)

    for blocks, in_spare in chunks:
        assert in_spare == (widest(blocks.start, True) > widest(blocks.start, False))
    # The buffer took over while the free rows still held a block: the case the rule is for.
    assert any(in_spare and widest(blocks.start, False) > 0 for blocks, in_spare in chunks)


# Without a filter nothing is sorted (the order only serves the backward's skipping), so an
# unsorted case without a filter would repeat the sorted one, kernel for kernel.
@pytest.mark.parametrize("dtype, filter_eps, vocab_sorting", [
    pytest.param(torch.float32, "auto", True, id="fp32-filter-sorted"),
    pytest.param(torch.float32, "auto", False, id="fp32-filter-unsorted"),
    pytest.param(torch.float32, None, True, id="fp32-nofilter-sorted"),
    pytest.param(torch.bfloat16, "auto", True, id="bf16-filter-sorted"),
    pytest.param(torch.bfloat16, "auto", False, id="bf16-filter-unsorted"),
    pytest.param(torch.bfloat16, None, True, id="bf16-nofilter-sorted")])
def test_one_pass_matches_reference(dtype: torch.dtype, filter_eps: Optional[str],
                                    vocab_sorting: bool, device: str,
                                    gen: torch.Generator) -> None:
    """Two token blocks for a classifier four segments wide: every tile fits in dC's memory, so
    each live one is recomputed once; one dE product, then dC in chunks from dC's rows and a
    tail through the spare buffer (one segment per page), all exact."""
    vocab, _ = _shape(dtype, 7)
    grid = kernel_configs(dtype).live_grid
    inputs = make_inputs(gen, device, dtype, shape=(2 * grid.block_tokens - 7,), vocab=vocab,
                         dim=4 * grid.block_vocab, bias=True, softcap=20.0)
    # On a GPU this small a dE product leaves most SMs idle, where two passes are faster.
    with forced(one_pass=True) as plans:
        check("cce", inputs, gen, "mean", filter_eps=filter_eps, vocab_sorting=vocab_sorting)
    ((plan, classifier),) = _backwards(plans)
    in_spare = _in_spare(classifier)
    assert plan.one_pass is not None and plan.pass_one is None
    assert in_spare.count(False) >= 1 and in_spare[-1]
    assert in_spare == sorted(in_spare)  # dC's rows first, then the spare buffer


@pytest.mark.parametrize("spare_tiles", [4, 30])
def test_one_pass_chunks_write_only_rows_whose_tiles_were_read(spare_tiles: int,
                                                               gen: torch.Generator) -> None:
    """The one pass's slots fill dC's last rows in position order; each chunk of dC is the
    widest that writes no row holding a slot of its own blocks or of later ones (those are read
    by this chunk's product or a later one), and once one block's tiles lie in its own rows, the
    rest goes through the spare buffer, as many blocks as it holds. None when the tiles do not
    fit in dC at all."""
    block_tokens, block_vocab, dim = 32, 128, 256
    segments_per_row = dim // block_vocab
    vocab = 60 * block_vocab - 5
    tiles_per_block = np.array([4] * 10 + torch.randint(0, 3, (50,), generator=gen).tolist())
    first_position, chunks = cce.backward.plan._one_pass_chunks(
        tiles_per_block, vocab, dim, block_tokens, block_vocab, spare_tiles)
    tiles_before = np.concatenate([[0], np.cumsum(tiles_per_block)])
    slot_rows = -(-tiles_before[-1] * block_tokens // segments_per_row)
    assert first_position == vocab - slot_rows

    def writable(blocks: range, in_spare: bool) -> bool:
        if in_spare:
            return sum(tiles_per_block[blocks.start:blocks.stop]) <= spare_tiles
        # Rows from this one on hold slots of blocks >= blocks.start.
        first_unread_row = (vocab if tiles_before[blocks.start] == tiles_before[-1] else
                            first_position + tiles_before[blocks.start] * block_tokens
                            // segments_per_row)
        return min(blocks.stop * block_vocab, vocab) <= first_unread_row

    _assert_widest_chunks(chunks, 60, writable)
    # The first chunk in the spare buffer is there because not even its first block was
    # writable in dC.
    first_in_spare = next(blocks for blocks, spare in chunks if spare)
    assert not writable(range(first_in_spare.start, first_in_spare.start + 1), False)
    too_many = np.full(60, vocab * segments_per_row // block_tokens // 60 + 1)
    assert cce.backward.plan._one_pass_chunks(too_many, vocab, dim, block_tokens, block_vocab,
                                         spare_tiles) is None


def _recorded_launches(monkeypatch: pytest.MonkeyPatch) -> "list[tuple[str, range]]":
    """Every launch the backward's loop makes from now on, in order: a recompute by grid rows
    ("rows", its token blocks) or by lists ("lists", its vocabulary blocks), a product ("dE" or
    "dC", its output blocks)."""
    launches: "list[tuple[str, range]]" = []
    store, multiply = cce.backward.run.store_gradient_tiles, cce.backward.run.multiply

    def recorded_store(recompute, tiles, *args) -> None:
        launches.append(("rows", tiles.token_blocks) if tiles.tile_lists is None
                        else ("lists", tiles.vocab_blocks))
        store(recompute, tiles, *args)

    def recorded_multiply(product) -> None:
        launches.append(("dC" if product.transposed else "dE", product.out_blocks))
        multiply(product)

    monkeypatch.setattr(cce.backward.run, "store_gradient_tiles", recorded_store)
    monkeypatch.setattr(cce.backward.run, "multiply", recorded_multiply)
    return launches


@pytest.mark.parametrize("passes", ["two", "one"])
def test_each_product_follows_the_recompute_of_its_tiles(passes: str, device: str,
                                                         gen: torch.Generator,
                                                         monkeypatch: pytest.MonkeyPatch
                                                         ) -> None:
    """The backward's schedule, as its loop launches it. Two passes: each chunk of grid rows
    is recomputed right before its dE product, then each chunk of dC's vocabulary blocks right
    before its dC product. One pass: every live tile recomputed once, by lists, for one dE
    product; of dC's chunks only those in the spare buffer are recomputed again. Every grid row
    gets one dE product and every vocabulary block one dC product, in order."""
    dtype = torch.bfloat16
    grid = kernel_configs(dtype).live_grid
    if passes == "two":
        vocab, dim = _shape(dtype)
        tokens = N
    else:
        vocab, dim = _shape(dtype, 7)[0], 4 * grid.block_vocab
        tokens = 2 * grid.block_tokens - 7
    inputs = make_inputs(gen, device, dtype, shape=(tokens,), vocab=vocab, dim=dim)
    launches = _recorded_launches(monkeypatch)
    with forced(one_pass=passes == "one", slots=False) as plans:
        check("cce", inputs, gen, "mean")
    ((plan, classifier),) = _backwards(plans)
    token_blocks, vocab_blocks = -(-tokens // grid.block_tokens), -(-vocab // grid.block_vocab)
    if passes == "two":
        embeddings = [launch for chunk in plan.pass_one.chunks
                      for launch in (("rows", chunk.token_blocks), ("dE", chunk.token_blocks))]
    else:
        embeddings = [("lists", range(vocab_blocks)), ("dE", range(token_blocks))]
    classifier_launches = [launch for chunk in classifier.chunks
                           for launch in ([("lists", chunk.vocab_blocks)] if chunk.recomputes
                                          else []) + [("dC", chunk.vocab_blocks)]]
    assert launches == embeddings + classifier_launches
    for product, blocks in (("dE", token_blocks), ("dC", vocab_blocks)):
        covered = [block for kind, chunk in launches if kind == product for block in chunk]
        assert covered == list(range(blocks))
    recomputed = [chunk.recomputes for chunk in classifier.chunks]
    assert any(recomputed) and (passes == "two") == all(recomputed)


@pytest.mark.parametrize("frozen", ["e", "c"])
def test_one_frozen_input(frozen: str, device: str, gen: torch.Generator) -> None:
    """Only the gradient asked for is computed; without dC, pass 1 gets a buffer of its own."""
    vocab, dim = _shape(torch.float32)
    inputs = make_inputs(gen, device, torch.float32, shape=(SMALL_N,), vocab=vocab, dim=dim)
    grad_output = make_grad_output(gen, inputs, "sum")
    expected = run_reference(inputs, grad_output, reduction="sum")
    e = inputs.e.detach().requires_grad_(frozen != "e")
    c = inputs.c.detach().requires_grad_(frozen != "c")
    loss = cce.linear_cross_entropy(e, c, inputs.targets, reduction="sum")
    (gradient,) = torch.autograd.grad(loss * grad_output, [c if frozen == "e" else e])
    assert relative_error(gradient, expected.grad_c if frozen == "e" else expected.grad_e) < 1e-5


def test_backward_is_deterministic(device: str, gen: torch.Generator) -> None:
    """The backward's only atomics add integers (the filter correction's kept mass, in fixed
    point), so two backward passes of one forward give bit-identical gradients. (The forward's
    LSE merges under a lock in arrival order, so two forwards may differ in the last bit.)"""
    vocab, dim = _shape(torch.bfloat16)
    tokens = 2 * kernel_configs(torch.bfloat16).live_grid.block_tokens - 7
    inputs = make_inputs(gen, device, torch.bfloat16, shape=(tokens,), vocab=vocab, dim=dim)
    e = inputs.e.detach().requires_grad_()
    c = inputs.c.detach().requires_grad_()
    loss = cce.linear_cross_entropy(e, c, inputs.targets)
    first = torch.autograd.grad(loss, (e, c), retain_graph=True)
    second = torch.autograd.grad(loss, (e, c))
    assert torch.equal(first[0], second[0]) and torch.equal(first[1], second[1])


@pytest.mark.parametrize("layout", ["rows", "columns"])
@pytest.mark.parametrize("columns", [1, 63, 200])
def test_tile_lists_hold_the_stored_tiles_of_each_row_in_order(layout: str, columns: int,
                                                               device: str,
                                                               gen: torch.Generator) -> None:
    """Each row's list starts with the columns of its stored tiles, in increasing order, and
    its count says how many; flags come as rows of a table (pass 1) or as a transposed slice of
    its columns (pass 2). Rows with no stored tile and with every tile stored included."""
    rows = 5
    table = (torch.rand(columns + 3, rows, generator=gen) < 0.3).to(torch.int32)
    table[:, 0] = 0
    table[:, 1] = 1
    table = table.to(device)
    flags = table[2:columns + 2].T if layout == "columns" else table[2:columns + 2].T.contiguous()
    lists, counts = build_tile_lists(flags)
    for row in range(rows):
        expected = torch.nonzero(flags[row]).flatten().to(torch.int32)
        assert int(counts[row]) == expected.numel()
        assert torch.equal(lists[row, :expected.numel()], expected)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_sum_partials_adds_the_splits_in_order_and_rounds_once(dtype: torch.dtype, device: str,
                                                              gen: torch.Generator) -> None:
    """The split dE product's epilogue: out = ((p0 + p1) + p2) in float32, rounded to out's
    dtype once, as torch rounds; here into the first rows of a larger buffer, as for a chunk's
    valid rows (a count that is no multiple of the kernel's block)."""
    partial = torch.randn(3, 40, 72, generator=gen).to(device)
    out = torch.zeros(50, 72, dtype=dtype, device=device)
    sum_partials(partial[:, :37], out[5:42], dot_precision(dtype))
    expected = ((partial[0, :37] + partial[1, :37]) + partial[2, :37]).to(dtype)
    assert torch.equal(out[5:42], expected)
    assert not out[:5].any() and not out[42:].any()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_classifier_sums_kernel_gives_both_sums_from_one_read(dtype: torch.dtype, device: str,
                                                              gen: torch.Generator) -> None:
    """c @ vector and c.sum(0) in float32, near float64 at sizes that are no multiple of the
    kernel's blocks, for a c with rows of any stride; the row sum is the same bits with or
    without the vector, so the backward's mass correction does not depend on which computed it."""
    full = torch.randn(333, 300, generator=gen).to(device=device, dtype=dtype)
    for c in (full[:, :201], full[:, ::2]):
        vector = torch.randn(c.shape[1], generator=gen).to(device=device, dtype=dtype)
        dots, row_sum = classifier_sums_by_kernel(c, vector)
        assert dots.dtype == row_sum.dtype == torch.float32
        assert relative_error(dots, c.double() @ vector.double()) < 1e-6
        assert relative_error(row_sum, c.double().sum(0)) < 1e-6
        alone = classifier_sums_by_kernel(c)
        assert alone.dots is None and torch.equal(alone.row_sum, row_sum)
        assert torch.equal(classifier_sums_by_kernel(c, vector).dots, dots)  # deterministic
        if device == "cuda":  # what the loss calls: the kernel on a GPU
            assert torch.equal(classifier_sums(c, vector).dots, dots)


def test_classifier_sums_of_a_cpu_classifier(gen: torch.Generator) -> None:
    """A CPU c: the same float32 sums, from PyTorch, a block of rows at a time."""
    c = torch.randn(333, 201, generator=gen).bfloat16()
    vector = torch.randn(201, generator=gen).bfloat16()
    dots, row_sum = classifier_sums_by_torch(c, vector, block_rows=100)
    assert dots.dtype == row_sum.dtype == torch.float32 and dots.shape == (333,)
    assert relative_error(dots, c.double() @ vector.double()) < 1e-6
    assert relative_error(row_sum, c.double().sum(0)) < 1e-6
    assert torch.equal(classifier_sums(c).row_sum, row_sum)


def test_sum_partials_rejects_an_output_it_cannot_write_in_place(device: str) -> None:
    partial = torch.zeros(2, 8, 4, device=device)
    with pytest.raises(ValueError, match=r"out must be a contiguous \(8, 4\) tensor"):
        sum_partials(partial, torch.zeros(4, 8, device=device).T, "ieee")
    with pytest.raises(ValueError, match=r"out must be a contiguous \(8, 4\) tensor"):
        sum_partials(partial, torch.zeros(8, 5, device=device), "ieee")


def _gradients_of_one_forward(e: torch.Tensor, c: torch.Tensor, targets: torch.Tensor,
                              gen: torch.Generator, loosen_bounds: float = 0.0,
                              vocab_sorting: bool = True, keep_tiles: bool = False):
    """One filtering forward of the ops; then a function of ``needs_grad_e`` and the backward's
    forced choices giving (dE, dC of a random upstream gradient, the backward's plan, its dC
    plan), each from the same forward. ``loosen_bounds`` is added to the tile bounds."""
    (_, lse, _, _, complement, positions, order, tile_bound, curvature_sum, row_sum,
     entropy_terms, classifier_copy) = loss_forward(e, c, None, targets, None, None, 2.0**-12,
                                                    vocab_sorting, True, 0.0, False, keep_tiles,
                                                    False, False, True, True)
    grad_loss = torch.rand(e.shape[0], generator=gen).to(e.device)

    def gradients(needs_grad_e: bool = True, **choices: object
                  ) -> "tuple[torch.Tensor, torch.Tensor, BackwardPlan, ClassifierPlan]":
        with forced(**choices) as plans:
            grad_e, grad_c, _ = loss_backward(e, c, None, targets, None, lse, complement,
                                              positions, order, tile_bound + loosen_bounds,
                                              curvature_sum, row_sum, entropy_terms,
                                              classifier_copy, grad_loss, None, None, None,
                                              2.0**-12, True, 0.0, keep_tiles,
                                              needs_grad_e=needs_grad_e, needs_grad_c=True)
        ((plan, classifier),) = _backwards(plans)
        return grad_e, grad_c, plan, classifier

    return gradients


def test_dc_alone_is_dc_beside_de_bit_for_bit(device: str, gen: torch.Generator) -> None:
    """Without dE there are no exact flags from pass 1: pass 2 lists every tile the forward's
    bounds leave live, more than pass 1 would store, and stores those the filter drops as zeros.
    From the same forward, dC comes out identical to the bit. (The bounds are loosened by e^4,
    still sound, so that they surely leave more tiles live than the filter keeps.)"""
    # Nine token and nine vocabulary blocks: too many live tiles for the one pass, and enough
    # of the vocabulary's tail for the bounds to leave more tiles live than the filter keeps.
    num_tokens = 261
    vocab, dim = _shape(torch.bfloat16, 9)
    e, c, targets = peaked_inputs(gen, device, num_tokens, vocab, dim)
    gradients = _gradients_of_one_forward(e.bfloat16(), c.bfloat16(), targets, gen,
                                          loosen_bounds=4.0)
    _, beside, _, pass_two_beside = gradients(needs_grad_e=True)
    _, alone, _, pass_two_alone = gradients(needs_grad_e=False)
    stored_beside = int(pass_two_beside.tile_lists.counts.sum())
    assert int(pass_two_alone.tile_lists.counts.sum()) > stored_beside > 0
    assert torch.equal(alone, beside)


@pytest.mark.parametrize("passes, dim", [("two", 512), ("two", 200), ("one", 512)],
                         ids=["two-passes-paged", "two-passes-buffer", "one-pass"])
def test_classifier_product_by_tma_is_the_triton_product_bit_for_bit(
        passes: str, dim: int, device: str, gen: torch.Generator) -> None:
    """On a Hopper GPU with 16-bit inputs, dC comes from cce.backward.classifier_product, which
    copies the rows of e by TMA. From the same forward it is the Triton product's dC to the bit:
    through dC's free rows (paged) and the spare buffer, or through a buffer of its own where D is
    not a whole number of segments (no one pass then); in two passes and in the one pass's slots;
    with partial token, vocabulary and output blocks."""
    if not cce.backward.classifier_product.available(torch.device(device), torch.bfloat16):
        pytest.skip("needs a Hopper GPU and Triton 3.6")
    vocab, _ = _shape(torch.bfloat16, 9)
    tokens = 2 * kernel_configs(torch.bfloat16).live_grid.block_tokens - 7
    e, c, targets = peaked_inputs(gen, device, tokens, vocab, dim)
    gradients = _gradients_of_one_forward(e.bfloat16(), c.bfloat16(), targets, gen)
    one_pass = passes == "one"
    _, with_tma, plan, classifier = gradients(one_pass=one_pass, triton_classifier_product=False)
    assert classifier.product.by_tma and (plan.one_pass is not None) == one_pass
    _, by_triton, _, classifier = gradients(one_pass=one_pass, triton_classifier_product=True)
    assert not classifier.product.by_tma and torch.equal(with_tma, by_triton)


@pytest.mark.parametrize("one_pass", [True, False], ids=["one-pass", "two-passes"])
def test_tiles_read_by_descriptor_are_the_gathered_tiles_bit_for_bit(
        one_pass: bool, device: str, gen: torch.Generator) -> None:
    """Without sorting, c's rows lie in position order: the recomputes read them and e's by
    tensor descriptor, a block of consecutive rows per D slice (TMA on Hopper, and in the
    interpreter), as the forward does. From the same forward, dE and dC are those of the
    recomputes that gather the rows, to the bit, in both paths."""
    e, c, targets = peaked_inputs(gen, device, SMALL_N, *_shape(torch.bfloat16))
    gradients = _gradients_of_one_forward(e.bfloat16(), c.bfloat16(), targets, gen,
                                          vocab_sorting=False)
    by_descriptor = gradients(one_pass=one_pass)
    gathered = gradients(one_pass=one_pass, gathered_rows=True)
    assert by_descriptor[2].classifier_by_position is not None
    assert gathered[2].classifier_by_position is None
    assert (by_descriptor[2].one_pass is not None) == one_pass
    assert (gathered[2].one_pass is not None) == one_pass
    assert torch.equal(by_descriptor[0], gathered[0])
    assert torch.equal(by_descriptor[1], gathered[1])


@pytest.mark.parametrize("vocab_sorting, keep_tiles, dim, dtype", [
    (True, True, 200, torch.bfloat16), (True, True, 200, torch.float16),
    (False, False, 512, torch.bfloat16), (True, False, 512, torch.bfloat16)],
    ids=["sorted-kept-tiles", "sorted-kept-tiles-fp16", "unsorted-in-dC", "sorted-in-dC"])
def test_embeddings_product_by_tma_is_the_triton_product_bit_for_bit(
        vocab_sorting: bool, keep_tiles: bool, dim: int, dtype: torch.dtype, device: str,
        gen: torch.Generator) -> None:
    """On a Hopper GPU with 16-bit inputs, the one pass's dE comes from
    cce.backward.embeddings_product, which copies rows of c by TMA, where they lie in position
    order: without sorting, and with sorting where the tiles are kept in memory of their own
    (the forward keeps its copy of c in position order for it). From the same forward it is the
    Triton product's dE to the bit, the filter correction included, with partial token,
    vocabulary and output blocks. With sorting and the tiles in dC's rows (no copy), the Triton
    product runs."""
    if not cce.backward.classifier_product.available(torch.device(device), dtype):
        pytest.skip("needs a Hopper GPU and Triton 3.6")
    vocab, _ = _shape(dtype, 9)
    tokens = 2 * kernel_configs(dtype).live_grid.block_tokens - 7
    e, c, targets = peaked_inputs(gen, device, tokens, vocab, dim)
    gradients = _gradients_of_one_forward(e.to(dtype), c.to(dtype), targets, gen,
                                          vocab_sorting=vocab_sorting, keep_tiles=keep_tiles)
    by_tma = not vocab_sorting or keep_tiles
    # One program per output block (no split): the kernel's condition, which a GPU's many
    # SMs would otherwise trade for splits at this small N.
    with_tma, grad_c, plan, _ = gradients(one_pass=True, splits=1)
    assert plan.one_pass is not None and plan.one_pass.product.by_tma == by_tma
    assert plan.correction is not None
    by_triton, grad_c_by_triton, plan, _ = gradients(one_pass=True, splits=1,
                                                     triton_embeddings_product=True)
    assert not plan.one_pass.product.by_tma
    assert torch.equal(with_tma, by_triton) and torch.equal(grad_c, grad_c_by_triton)


@pytest.mark.parametrize("device", [
    "cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(),
                                                          reason="needs a GPU"))])
def test_host_copy_reads_the_values_queued_before_it(device: str) -> None:
    # The backward reads its list lengths this way while the GPU goes on with later work.
    values = torch.arange(100_000, dtype=torch.int32, device=device)
    read = start_host_copy(values)
    values.mul_(3)  # queued after the copy
    assert np.array_equal(read(), np.arange(100_000, dtype=np.int32))


def _assert_widest_chunks(chunks: "list[tuple[range, bool]]", num_blocks: int,
                          allowed: Callable[[range, bool], bool]) -> None:
    """A planner's chunks cover the blocks in order, first in dC's rows (two chunks at least),
    then in the spare buffer; each is allowed and one block wider would not be."""
    assert [block for blocks, _ in chunks for block in blocks] == list(range(num_blocks))
    in_spare = [spare for _, spare in chunks]
    assert in_spare == sorted(in_spare) and in_spare.count(False) >= 2 and in_spare[-1]
    for blocks, spare in chunks:
        assert len(blocks) >= 1 and allowed(blocks, spare)
        if blocks.stop < num_blocks:
            assert not allowed(range(blocks.start, blocks.stop + 1), spare)
