"""Linear-log-sum-exp forward (paper Alg. 2): ``LSE_i = logsumexp_j(C_j . E_i)`` without logits.

Each program owns one block of tokens and a contiguous range of vocabulary blocks. It computes
their logit tiles on-chip, keeps a running per-row (max, sum of exponentials) in registers and
merges the result into the global LSE once, under a spin lock (one lock per token block), so
the N x V logits never reach global memory and the lock is taken once per program rather than
once per tile.

When a backward will follow it also records, for every tile of the live-tile grid
(``config.live_grid``: the forward's tiles are one or two of its tiles), a bound on the
log-probability of each of its entries on the non-ignored rows: ``max_i(max_j z_ij - L_i)``
with ``L_i`` a lower bound of row i's final LSE known when the tile is computed (its target's
logit, the LSE of the program's tiles so far, and whatever other programs have merged already).
Being per row, it stays tight when the LSE differs between the rows of a tile, as on real data.
Tiles follow ``vocab_order`` when given (vocabulary sorting), so that the forward's and the
backward's tiles are the same, and the head of the vocabulary, which holds most of the mass, is
merged first. In deterministic mode the bounds must not depend on when other programs merged:
a first launch covers only the head of the order, and every later program reads the head's LSE
instead of the merged one, so that the bounds, like the results, are a function of the inputs.

On Hopper GPUs the tiles' operands come by tensor descriptor, one bulk copy (TMA) per operand
and D slice instead of one address per row: rows of ``e``, and rows of ``c`` in position order,
which with sorting means a copy of ``c`` (:func:`classifier_by_position`).

For label smoothing it also adds up each row's (class-weighted) sum of logits, and with a softcap
of their squared tanh, merged under the same lock as the LSE (:mod:`cce.weighting`). For the
entropy it keeps, beside the running sum of exponentials, their running sum weighted by the
logits (centred on the running maximum), from which each program's entropy follows and merges
as the LSE does; for the argmax, the running largest
logit and its index. Each is a constexpr branch: a call that does not ask pays nothing.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
import triton
import triton.language as tl

try:
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # a Triton without host-side descriptors: rows are gathered instead
    TensorDescriptor = None

from cce.config import (cdiv, deterministic_head_blocks, forward_vocab_splits,
                        interpreting, kernel_configs, tma_copies_rows)
from cce.logit_tile import (LOG2_E, finish_logits, holds_padding, logit_operands, logit_tile,
                            tile_product_by_descriptor, vocab_block_entries)
from cce.forward.vocab_order import TargetPlacement, TileMarks
from cce.weighting import entropy_of_parts, first_largest

ARGMAX_NONE = tl.constexpr(2**31 - 1)  # the index of no candidate yet: any index is smaller
# The lowest float32: a -inf logit's term in the entropy is 0, and 0 * -inf would be NaN.
FLOAT32_LOWEST = tl.constexpr(-3.4028234663852886e38)
LN_2 = tl.constexpr(0.6931471805599453)


@triton.jit
def exp_shift(maximum):
    """What a log-sum-exp subtracts before exp: the maximum, or 0 where it is infinite (inf - inf
    would be NaN). So all -inf gives -inf, and a +inf anywhere gives +inf, as in
    torch.logsumexp; NaN inputs still propagate through the sum."""
    return tl.where(tl.abs(maximum) == float("inf"), 0.0, maximum)


@triton.jit
def log_add_exp(a, b):
    shift = exp_shift(tl.maximum(a, b))
    return shift + tl.log(tl.exp(a - shift) + tl.exp(b - shift))


@triton.jit
def lower_bound_of_sum(a, b, DISJOINT: tl.constexpr):
    """A lower bound of the final LSE from two lower bounds: where they add up disjoint sets of
    entries (the target's logit, and LSEs that leave the target out), one of the LSE of their
    sum, ``max(a, b) + log(1 + e^-|a - b|)``, whose convex second term is at least its tangent
    at 0, ``ln 2 - |a - b| / 2``, and 0: no exp or log, for every row of every tile; else the
    larger. A tighter bound leaves fewer tiles for the backward to recompute."""
    larger = tl.maximum(a, b)
    if DISJOINT:
        # Where a == b the term is ln 2, also for equal infinities (whose difference is NaN).
        return larger + tl.where(a == b, LN_2, tl.maximum(-0.5 * tl.abs(a - b) + LN_2, 0.0))
    else:
        return larger


@triton.jit
def part_entropy_term(entropy, lse, merged_lse):
    """A part's term of the entropy of a union of disjoint parts of a row's entries:
    ``w (H + L - L_part)``, w = exp(L_part - L) its share of the mass, H its own entropy (0 for
    a part of no mass). Every term is positive: the sum keeps its relative precision."""
    weight = tl.exp(lse - exp_shift(merged_lse))
    return tl.where(weight > 0, weight * (entropy + (merged_lse - lse)), 0.0)


@triton.jit
def argmax_merge(value, index, other_value, other_index):
    """The (value, index) of the larger of two candidates, of equal values the smaller index,
    as torch.argmax chooses (rows with a NaN are the caller's: see :func:`lse_forward`)."""
    takes_other = (other_value > value) | ((other_value == value) & (other_index < index))
    return (tl.where(takes_other, other_value, value),
            tl.where(takes_other, other_index, index))


@triton.jit
def tile_argmax(logits, vocab):
    """Each row's (largest logit, its smallest vocabulary index) in a tile: the indices are
    compared, not the positions, which with sorting need not be in index order. (Padding
    entries are -inf: one wins only where every logit is -inf, where the index is 0 anyway.)
    One reduction more than the LSE's: +3-7% forward time on an H200, where NaN-aware keys
    cost +69% and spilled registers (docs/notes/semantics.md)."""
    row_max = tl.max(logits, axis=1)
    return row_max, tl.min(tl.where(logits == row_max[:, None], vocab[None, :], ARGMAX_NONE),
                           axis=1)


@triton.jit
def log_probability_bound(row_max, lse_lower, recorded_rows):
    """The bound of a live-grid tile's log-probabilities from its rows' largest logits."""
    return tl.max(tl.where(recorded_rows, row_max - lse_lower, float("-inf")))


class ForwardLaunch(NamedTuple):
    """One launch of the forward kernel: forward tiles [first_block, last_block) of the order,
    each token block's shared by programs of ``blocks_per_program`` tiles, whose partials (in
    deterministic mode) are splits ``first_split, ...`` of all launches' ``num_splits``."""

    first_block: int
    last_block: int
    blocks_per_program: int
    first_split: int
    num_splits: int

    @property
    def splits(self) -> int:
        return cdiv(self.last_block - self.first_block, self.blocks_per_program)


class BoundRecord(NamedTuple):
    """What recording the live grid's bounds reads and writes (Nones without a record): the
    targets (ignored rows are left out), their logits (a first lower bound of the LSE), the
    table of bounds, and in deterministic mode the head's LSE (:func:`lse_forward`)."""

    targets: Optional[torch.Tensor]
    target_logit: Optional[torch.Tensor]
    tile_bound: Optional[torch.Tensor]
    head_lse: Optional[torch.Tensor]


class LeftOut(NamedTuple):
    """The entry each row leaves out of its LSE (int32 (N,) positions, -1 for none) and which
    forward tiles hold one (int8, token blocks x vocabulary blocks), or Nones."""

    positions: Optional[torch.Tensor]
    tiles: Optional[torch.Tensor]


class RowResults(NamedTuple):
    """Where the programs put what they add up per row, None for what is not asked: merged
    under the token block's lock into ``lse``, the sums, the entropy and the argmax or, in
    deterministic mode (``partials`` given, no locks), each program's into its split of
    ``partials``' planes: the LSE, the sums, the entropy (``entropy_plane``), the argmax's
    values and index bits (``argmax_plane``); the planes' numbers are None for what is not
    asked in either mode. ``class_weight`` weighs the logit sum."""

    lse: Optional[torch.Tensor]
    locks: Optional[torch.Tensor]
    partials: Optional[torch.Tensor]
    logit_sum: Optional[torch.Tensor]
    curvature_sum: Optional[torch.Tensor]
    class_weight: Optional[torch.Tensor]
    entropy: Optional[torch.Tensor]
    argmax_value: Optional[torch.Tensor]
    argmax_index: Optional[torch.Tensor]
    entropy_plane: Optional[int]
    argmax_plane: Optional[int]


@triton.jit
def lse_forward_kernel(operands, e_desc, c_desc, launch, record, left_out, results,
                       LIVE_BLOCK_VOCAB: tl.constexpr, BLOCK_TOKENS: tl.constexpr,
                       BLOCK_VOCAB: tl.constexpr, BLOCK_DIM: tl.constexpr,
                       DOT_PRECISION: tl.constexpr):
    # Which paths compile follows from which tensors are given.
    SORTED: tl.constexpr = operands.vocab_order is not None
    BY_DESCRIPTOR: tl.constexpr = c_desc is not None
    RECORD_TILE_BOUND: tl.constexpr = record.tile_bound is not None
    LEAVES_OUT: tl.constexpr = left_out.positions is not None
    DETERMINISTIC: tl.constexpr = results.partials is not None
    LOGIT_SUM: tl.constexpr = results.logit_sum is not None
    CURVATURE_SUM: tl.constexpr = results.curvature_sum is not None
    HAS_CLASS_WEIGHT: tl.constexpr = results.class_weight is not None
    ENTROPY: tl.constexpr = results.entropy is not None
    ARGMAX: tl.constexpr = results.argmax_plane is not None
    num_tokens = operands.num_tokens
    vocab_size = operands.vocab_size
    # Token blocks vary fastest: the programs in flight walk the same slice of c at about the
    # same time (read once from memory), while the much smaller e stays in L2.
    num_token_blocks = tl.cdiv(num_tokens, BLOCK_TOKENS)
    num_live_vocab_blocks = tl.cdiv(vocab_size, LIVE_BLOCK_VOCAB)
    RECORDS_PER_TILE: tl.constexpr = BLOCK_VOCAB // LIVE_BLOCK_VOCAB
    token_block = tl.program_id(0) % num_token_blocks
    split = launch.first_split + tl.program_id(0) // num_token_blocks  # over all launches
    first_vocab_block = (launch.first_block
                         + (tl.program_id(0) // num_token_blocks) * launch.blocks_per_program)
    last_vocab_block = tl.minimum(first_vocab_block + launch.blocks_per_program,
                                  launch.last_block)

    rows = token_block * BLOCK_TOKENS + tl.arange(0, BLOCK_TOKENS)
    row_mask = rows < num_tokens
    if RECORD_TILE_BOUND:
        # Ignored tokens get no loss gradient: leaving them out tightens the backward's bound.
        targets = tl.load(record.targets + rows, mask=row_mask, other=-1)
        recorded_rows = targets >= 0
        # Lower bounds of the final LSE known before the first tile: the target's logit and,
        # in deterministic mode, the LSE of the head of the order (an earlier launch's; -inf
        # in the head's own).
        known_lower = tl.load(record.target_logit + rows, mask=recorded_rows,
                              other=float("-inf"))
        if DETERMINISTIC:
            known_lower = lower_bound_of_sum(known_lower, tl.load(
                record.head_lse + rows, mask=row_mask, other=float("-inf")), LEAVES_OUT)
    if LEAVES_OUT:
        left_out_tiles = left_out.tiles + token_block * tl.cdiv(vocab_size, BLOCK_VOCAB)
        next_holds = tl.load(left_out_tiles + first_vocab_block,
                             mask=first_vocab_block < last_vocab_block, other=0).to(tl.int32)
    running_max = tl.full((BLOCK_TOKENS,), float("-inf"), dtype=tl.float32)
    running_sum = tl.zeros((BLOCK_TOKENS,), dtype=tl.float32)
    logit_sum = tl.zeros((BLOCK_TOKENS,), dtype=tl.float32)
    curvature_sum = tl.zeros((BLOCK_TOKENS,), dtype=tl.float32)
    # sum_j exp(z_j - max) (z_j - max), centred on the running maximum: the entropy of the
    # program's entries is log(sum) - moment / sum, two positive numbers (no cancellation).
    logit_moment = tl.zeros((BLOCK_TOKENS,), dtype=tl.float32)
    best_value = tl.full((BLOCK_TOKENS,), float("-inf"), dtype=tl.float32)
    best_index = tl.full((BLOCK_TOKENS,), ARGMAX_NONE, dtype=tl.int32)
    # Flattened over descriptor tiles, Triton pipelines the next tile's loads across the loop's
    # end (docs/notes/forward.md): the body then may hold no runtime branch. Not with the
    # argmax: the next tile's registers and the argmax's spill.
    FLATTEN: tl.constexpr = BY_DESCRIPTOR and not ARGMAX
    for vocab_block in tl.range(first_vocab_block, last_vocab_block, flatten=FLATTEN):
        vocab, vocab_mask = vocab_block_entries(operands.vocab_order, vocab_block,
                                                tl.arange(0, BLOCK_VOCAB), vocab_size,
                                                BLOCK_VOCAB, SORTED)
        if BY_DESCRIPTOR:
            logits = finish_logits(
                tile_product_by_descriptor(e_desc, c_desc, token_block * BLOCK_TOKENS,
                                           vocab_block * BLOCK_VOCAB, operands.dim, BLOCK_DIM,
                                           DOT_PRECISION),
                operands, vocab, vocab_mask)
        else:
            logits = logit_tile(operands, rows, row_mask, vocab, vocab_mask,
                                BLOCK_TOKENS, BLOCK_VOCAB, BLOCK_DIM, DOT_PRECISION)
        if LOGIT_SUM:
            # Before the padding gets -inf: its weight is 0.
            if HAS_CLASS_WEIGHT:
                class_weight = tl.load(results.class_weight + vocab, mask=vocab_mask, other=0.0)
            else:
                class_weight = vocab_mask.to(tl.float32)
            weighted = logits * class_weight[None, :]
            logit_sum += tl.sum(weighted, axis=1)
            if CURVATURE_SUM:
                # sum_v w_v z_v^2, divided by softcap^2 once per row after the loop: the tanh^2
                # of the pre-cap logits, with no tile-sized temporary of its own.
                curvature_sum += tl.sum(weighted * logits, axis=1)
        # Padding columns get -inf after the softcap (a capped 0 would still carry exp(0)); every
        # tile is masked on the descriptor path, whose flattened loop takes no other branch
        # than the target's below.
        if BY_DESCRIPTOR:
            logits = tl.where(vocab_mask[None, :], logits, float("-inf"))
        elif holds_padding(vocab_block, vocab_size, BLOCK_VOCAB):
            logits = tl.where(vocab_mask[None, :], logits, float("-inf"))
        if ARGMAX:  # before the target is left out: it may be the largest
            tile_value, tile_index = tile_argmax(logits, vocab)
            best_value, best_index = argmax_merge(best_value, best_index, tile_value,
                                                  tile_index)
        if LEAVES_OUT:
            # So do the left-out entries, in the few tiles that hold one (a tile's flag is loaded
            # one tile ahead, the positions only there: kept in registers through the loop they
            # cost 3% more forward time at D = 640, a select on every tile 5%; docs/notes/
            # forward.md, "Leaving the target out").
            holds = next_holds
            next_holds = tl.load(left_out_tiles + vocab_block + 1,
                                 mask=vocab_block + 1 < last_vocab_block, other=0).to(tl.int32)
            if holds != 0:
                left_out_positions = tl.load(left_out.positions + rows, mask=row_mask, other=-1)
                logits = tl.where((vocab_block * BLOCK_VOCAB + tl.arange(0, BLOCK_VOCAB))[None, :]
                                  != left_out_positions[:, None], logits, float("-inf"))
        if RECORD_TILE_BOUND and RECORDS_PER_TILE == 2:
            # The row maxima of each live-grid tile, by masking the other one's columns: the
            # LSE's row maxima are their maxima. (A reshape of the tile, or joining the two
            # halves' maxima, moves data through shared memory: +15% forward kernel time at
            # D = 640 on an H200, against +4% for the masks; docs/notes/forward.md.)
            left = (tl.arange(0, BLOCK_VOCAB) < LIVE_BLOCK_VOCAB)[None, :]
            left_row_max = tl.max(tl.where(left, logits, float("-inf")), axis=1)
            right_row_max = tl.max(tl.where(left, float("-inf"), logits), axis=1)
            tile_row_max = tl.maximum(left_row_max, right_row_max)
        else:
            tile_row_max = tl.max(logits, axis=1)
            left_row_max = tile_row_max  # the only live-grid tile when RECORDS_PER_TILE == 1
        new_max = tl.maximum(running_max, tile_row_max)
        safe_max = exp_shift(new_max)
        # exp(z - m) as exp2(z * log2(e) - m * log2(e)): one fused multiply-add per entry
        # (exp costs more: 12% of the kernel at D = 640 on an H200, docs/notes/forward.md).
        scaled_max = safe_max * LOG2_E
        rescale = tl.exp2(running_max * LOG2_E - scaled_max)
        probs = tl.exp2(logits * LOG2_E - scaled_max[:, None])
        if ENTROPY:
            # Re-centred from the old maximum to the new one: (z - m) = (z - m') + (m' - m).
            centred = tl.maximum(logits - safe_max[:, None], FLOAT32_LOWEST)
            moved = tl.where(running_sum > 0, exp_shift(running_max) - safe_max, 0.0)
            logit_moment = ((logit_moment + moved * running_sum) * rescale
                            + tl.sum(probs * centred, axis=1))
        running_sum = running_sum * rescale + tl.sum(probs, axis=1)
        running_max = new_max
        if RECORD_TILE_BOUND:
            # A lower bound of the final LSE: what was known before the loop, this program's
            # tiles so far and, by default, what other programs have merged (merges only ever
            # raise it, so a read without the lock is a bound too; volatile: read again for
            # every tile, never from a stale L1 line). Deterministic mode reads no merge: its
            # bounds must not depend on the schedule.
            lse_lower = lower_bound_of_sum(known_lower, safe_max + tl.log(running_sum),
                                           LEAVES_OUT)
            if not DETERMINISTIC:
                lse_lower = lower_bound_of_sum(lse_lower, tl.load(
                    results.lse + rows, mask=row_mask, other=float("-inf"), volatile=True),
                    LEAVES_OUT)
            # From row maxima: a maximum per column would cost a reduction across warps.
            bound = (record.tile_bound + token_block * num_live_vocab_blocks
                     + vocab_block * RECORDS_PER_TILE)
            tl.store(bound, log_probability_bound(left_row_max, lse_lower, recorded_rows))
            if RECORDS_PER_TILE == 2:
                tl.store(bound + 1,
                         log_probability_bound(right_row_max, lse_lower, recorded_rows),
                         mask=vocab_block * 2 + 1 < num_live_vocab_blocks)
    safe_max = exp_shift(running_max)
    program_lse = safe_max + tl.log(running_sum)
    # 0 for a row of no entries (all -inf): it weighs nothing in a merge.
    program_entropy = tl.where(running_sum > 0,
                               tl.log(running_sum) - logit_moment / running_sum, 0.0)
    if CURVATURE_SUM:
        curvature_sum = curvature_sum / (operands.softcap * operands.softcap)

    if DETERMINISTIC:
        # The returned LSE (and sums): each program's partial, merged in a fixed order
        # afterwards, with no lock.
        planes = results.partials
        num_splits = launch.num_splits
        tl.store(planes + split * num_tokens + rows, program_lse, mask=row_mask)
        if LOGIT_SUM:
            tl.store(planes + (num_splits + split) * num_tokens + rows, logit_sum, mask=row_mask)
            if CURVATURE_SUM:
                tl.store(planes + (2 * num_splits + split) * num_tokens + rows, curvature_sum,
                         mask=row_mask)
        if ENTROPY:
            tl.store(planes + (results.entropy_plane * num_splits + split) * num_tokens + rows,
                     program_entropy, mask=row_mask)
        if ARGMAX:  # the index's bits in a float32 plane
            argmax_partials = planes + (results.argmax_plane * num_splits + split) * num_tokens
            tl.store(argmax_partials + rows, best_value, mask=row_mask)
            tl.store(argmax_partials + num_splits * num_tokens + rows,
                     best_index.to(tl.float32, bitcast=True), mask=row_mask)
    else:
        _merge_under_lock(results.locks + token_block, results, rows, row_mask, program_lse,
                          logit_sum, curvature_sum, program_entropy, best_value, best_index)


@triton.jit
def _merge_under_lock(lock, results, rows, row_mask, program_lse, logit_sum, curvature_sum,
                      program_entropy, best_value, best_index):
    """Adds a program's partial LSE (and sums, entropy, argmax) into the token block's
    (``results``: :class:`RowResults`), under its spin lock."""
    while tl.atomic_cas(lock, 0, 1) == 1:
        pass
    # .cg: read the merged value from L2, never a stale L1 line of another program's update.
    current = tl.load(results.lse + rows, mask=row_mask, cache_modifier=".cg")
    merged = log_add_exp(current, program_lse)
    tl.store(results.lse + rows, merged, mask=row_mask)
    if results.entropy is not None:
        current_entropy = tl.load(results.entropy + rows, mask=row_mask, cache_modifier=".cg")
        tl.store(results.entropy + rows,
                 part_entropy_term(current_entropy, current, merged)
                 + part_entropy_term(program_entropy, program_lse, merged), mask=row_mask)
    if results.argmax_plane is not None:
        value, index = argmax_merge(
            tl.load(results.argmax_value + rows, mask=row_mask, cache_modifier=".cg"),
            tl.load(results.argmax_index + rows, mask=row_mask, cache_modifier=".cg"),
            best_value, best_index)
        tl.store(results.argmax_value + rows, value, mask=row_mask)
        tl.store(results.argmax_index + rows, index, mask=row_mask)
    if results.logit_sum is not None:
        merged_sum = tl.load(results.logit_sum + rows, mask=row_mask, cache_modifier=".cg")
        tl.store(results.logit_sum + rows, merged_sum + logit_sum, mask=row_mask)
        if results.curvature_sum is not None:
            merged_curvature = tl.load(results.curvature_sum + rows, mask=row_mask,
                                       cache_modifier=".cg")
            tl.store(results.curvature_sum + rows, merged_curvature + curvature_sum,
                     mask=row_mask)
    tl.debug_barrier()  # every thread's store is issued before the lock is released
    tl.atomic_xchg(lock, 0)


def classifier_by_position(e: torch.Tensor, c: torch.Tensor, vocab_order: Optional[torch.Tensor],
                           sorted_copy: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """``c`` with its rows in position order, for the tile products to read as blocks of
    consecutive rows by tensor descriptor (TMA on Hopper), or None where the rows are gathered
    through the order instead.

    Without sorting ``c`` is in position order already. With sorting it is ``sorted_copy``, a
    copy the caller made (``c.index_select``; the forward's plan decides,
    :mod:`cce.forward.plan`: where the memory allows it and the forward is long enough to repay
    it), None where there is none: on an H200 the descriptors save 10-17% of the kernel's time
    and the copy costs about one read and one write of ``c`` (Llama 3 8B shape: 16.2 -> 14.1 ms
    for a 0.58 ms copy at N = 8192, 1.86 -> 1.58 ms at N = 1024; ``docs/notes/forward.md``)."""
    if not descriptors_ready(e, c):
        return None
    return c if vocab_order is None else sorted_copy


def descriptors_ready(e: torch.Tensor, c: torch.Tensor) -> bool:
    """Whether the forward's tile products can read ``e`` and ``c`` (or a copy of ``c``'s rows
    in another order) by tensor descriptor."""
    return _descriptor_ready(e) and _descriptor_ready(c)


def _descriptor_ready(x: torch.Tensor) -> bool:
    """Whether a tensor descriptor can describe ``x``: 16-bit rows that TMA can copy, on a
    Hopper or later GPU (or in Triton's interpreter)."""
    device_ok = interpreting() or (x.device.type == "cuda"
                                   and torch.cuda.get_device_capability(x.device)[0] >= 9)
    return (TensorDescriptor is not None and device_ok
            and x.dtype in (torch.bfloat16, torch.float16) and tma_copies_rows(x))


def leave_out_targets(targets: torch.Tensor, position_of: Optional[torch.Tensor],
                      dtype: torch.dtype, vocab_size: int) -> TargetPlacement:
    """Where the indexed dot (:func:`cce.forward.indexed_dot.indexed_dot`'s ``placement``)
    writes what :func:`lse_forward`'s ``left_out`` takes to leave each row's target out of its
    LSE: the targets' positions in the order (``position_of``: its inverse, None without
    sorting) and which of the forward's tiles (for ``dtype``'s kernel settings) hold one."""
    config = kernel_configs(dtype).lse_forward
    num_vocab_blocks = cdiv(vocab_size, config.block_vocab)
    tiles = torch.zeros(cdiv(targets.shape[0], config.block_tokens) * num_vocab_blocks,
                        dtype=torch.int8, device=targets.device)
    positions = torch.empty(targets.shape[0], dtype=torch.int32, device=targets.device)
    return TargetPlacement(position_of, positions, TileMarks(
        tiles, config.block_tokens, config.block_vocab, num_vocab_blocks))


def _launches(num_token_blocks: int, num_vocab_blocks: int, device: torch.device,
              record: bool, with_head: bool) -> "list[ForwardLaunch]":
    """The forward's launches: in deterministic mode with bounds, first the head of the order
    (``config.deterministic_head_blocks``), one program per tile so that it spreads over the
    GPU even at small N; then the rest, in programs of several tiles
    (``config.forward_vocab_splits``)."""
    head = deterministic_head_blocks(num_vocab_blocks) if with_head else 0
    ranges = [(0, head, 1)] if head else []
    if head < num_vocab_blocks:
        splits = forward_vocab_splits(num_token_blocks, num_vocab_blocks - head, device, record)
        ranges.append((head, num_vocab_blocks, cdiv(num_vocab_blocks - head, splits)))
    launches, num_splits = [], 0
    for first, last, per_program in ranges:
        launches.append(ForwardLaunch(first, last, per_program, num_splits, 0))
        num_splits += launches[-1].splits
    return [launch._replace(num_splits=num_splits) for launch in launches]


def lse_forward(e: torch.Tensor, c: torch.Tensor, bias: Optional[torch.Tensor],
                softcap: Optional[float], targets: torch.Tensor,
                vocab_order: Optional[torch.Tensor],
                target_logit: Optional[torch.Tensor] = None, *,
                left_out: Optional[TargetPlacement] = None,
                logit_sum: Optional[torch.Tensor] = None,
                curvature_sum: Optional[torch.Tensor] = None,
                class_weight: Optional[torch.Tensor] = None,
                entropy: Optional[torch.Tensor] = None,
                argmax: Optional[torch.Tensor] = None,
                argmax_value: Optional[torch.Tensor] = None, deterministic: bool = False,
                sorted_classifier: Optional[torch.Tensor] = None,
                ) -> "tuple[torch.Tensor, Optional[torch.Tensor]]":
    """float32 (N,) log-sum-exp of every row and, when ``target_logit`` (float32 (N,), from
    :func:`cce.forward.indexed_dot.indexed_dot`) is given, the float32 table of log-probability
    bounds of the live-tile grid (in ``vocab_order``): every softmax entry of a tile on a
    non-ignored row (``targets >= 0``) is at most exp(its bound); -inf where a tile has no such row.

    ``left_out``: a position of the order (the vocabulary index without sorting) per row, -1
    for none, with the tiles that hold one (:func:`leave_out_targets`, placed by the indexed
    dot): the LSE is then of the
    row's other logits. Given each row's target, it is the LSE of the non-target logits,
    ``log(sum_{j != t} exp(z_j))``, from which ``1 - p_t`` (a row's gradient at its target)
    comes with full relative precision, however sure the model is of the target:
    ``exp(L_i - z_t) - 1`` would cancel (:mod:`cce.weighting`).

    ``logit_sum``: float32 (N,) zeros, when given, receives ``sum_v class_weight[v] z_iv`` of
    every row (``class_weight``: float32 (V,), None for all 1), for label smoothing
    (:mod:`cce.weighting`); ``curvature_sum`` likewise (with ``logit_sum`` and a softcap)
    ``sum_v class_weight[v] tanh^2`` of the capped logits.

    ``entropy``: float32 (N,) zeros, when given, receives the entropy of the softmax of the
    logits that the LSE adds up, ``sum_j exp(z_j - L) (L - z_j)`` (:mod:`cce.weighting`);
    ``argmax``: int64 (N,), when given, receives the
    index of every row's largest logit, the left-out one included (:func:`argmax_merge`), and
    ``argmax_value`` (float32 (N,), optional), that logit. A row whose logits hold a NaN gets
    an index the caller must replace (its LSE is NaN: :func:`cce.weighting.argmax_or_none`).

    ``deterministic``: the spin-lock merge's order varies between calls, and with it the LSE's
    last bits; instead, the returned LSE merges every program's partial LSE in a fixed order
    afterwards (bitwise reproducible on one device, a few more small launches). The bounds, which
    decide which tiles the backward recomputes (:func:`cce.backward.live_tiles.live_tiles`), do not
    read other programs' merges then: the head of the order runs first, in a launch of its own
    (``config.deterministic_head_blocks``), and its LSE bounds every later program's rows.

    ``sorted_classifier``: with sorting, ``c``'s rows in position order (a copy the caller made,
    :mod:`cce.forward.plan` decides), which the kernel reads by descriptor where it can
    (:func:`classifier_by_position`); None: the rows are gathered through the order."""
    num_tokens = e.shape[0]
    vocab_size = c.shape[0]
    configs = kernel_configs(e.dtype)
    config, live_grid = configs.lse_forward, configs.live_grid
    num_token_blocks = cdiv(num_tokens, config.block_tokens)
    num_vocab_blocks = cdiv(vocab_size, config.block_vocab)
    record = target_logit is not None
    with_head = deterministic and record  # the head of the order bounds the later programs
    launches = _launches(num_token_blocks, num_vocab_blocks, e.device, record, with_head)
    num_splits = launches[-1].num_splits

    lse = locks = None
    if not deterministic:
        lse = torch.full((num_tokens,), float("-inf"), dtype=torch.float32, device=e.device)
        locks = torch.zeros(num_token_blocks, dtype=torch.int32, device=e.device)
    sums = [total for total in (logit_sum, curvature_sum) if total is not None]
    # Deterministic mode's planes of partials: the LSE, the sums, the entropy, the argmax's
    # values and indices.
    entropy_plane = 1 + len(sums)
    argmax_plane = entropy_plane + (entropy is not None)
    num_planes = argmax_plane + 2 * (argmax is not None)
    split_lse = (torch.empty((num_planes, num_splits, num_tokens), dtype=torch.float32,
                             device=e.device) if deterministic else None)
    argmax_index = None
    if argmax is not None and not deterministic:
        if argmax_value is None:
            argmax_value = torch.empty((num_tokens,), dtype=torch.float32, device=e.device)
        argmax_value.fill_(float("-inf"))
        argmax_index = torch.full((num_tokens,), ARGMAX_NONE.value, dtype=torch.int32,
                                  device=e.device)
    tile_bound = (torch.empty((num_token_blocks, cdiv(vocab_size, live_grid.block_vocab)),
                              dtype=torch.float32, device=e.device) if record else None)
    e_desc = c_desc = None
    c_by_position = classifier_by_position(e, c, vocab_order, sorted_classifier)
    if c_by_position is not None:
        e_desc = TensorDescriptor.from_tensor(e, [config.block_tokens, config.block_dim])
        c_desc = TensorDescriptor.from_tensor(c_by_position,
                                              [config.block_vocab, config.block_dim])
    head_lse = torch.full_like(target_logit, float("-inf")) if with_head else None
    bounds = BoundRecord(targets=targets if record else None, target_logit=target_logit,
                         tile_bound=tile_bound, head_lse=head_lse)
    results = RowResults(lse=lse, locks=locks, partials=split_lse, logit_sum=logit_sum,
                         curvature_sum=curvature_sum, class_weight=class_weight,
                         entropy=entropy, argmax_value=argmax_value, argmax_index=argmax_index,
                         entropy_plane=entropy_plane if entropy is not None else None,
                         argmax_plane=argmax_plane if argmax is not None else None)
    for launch in launches:
        if launch.first_split:  # after the head's launch: its LSE bounds every later row
            torch.logsumexp(split_lse[0, :launch.first_split], dim=0, out=head_lse)
        lse_forward_kernel[(num_token_blocks * launch.splits,)](
            logit_operands(e, c, bias, vocab_order, softcap), e_desc, c_desc, launch, bounds,
            LeftOut(None, None) if left_out is None
            else LeftOut(left_out.positions, left_out.marks.tiles), results,
            LIVE_BLOCK_VOCAB=live_grid.block_vocab, BLOCK_TOKENS=config.block_tokens,
            BLOCK_VOCAB=config.block_vocab, BLOCK_DIM=config.block_dim,
            DOT_PRECISION=configs.dot_precision,
            num_warps=config.num_warps, num_stages=config.num_stages,
        )
    if deterministic:
        lse = torch.logsumexp(split_lse[0], dim=0)
        for index, total in enumerate(sums, 1):
            total += split_lse[index].sum(dim=0)
        if entropy is not None:
            entropy += entropy_of_parts(split_lse[entropy_plane], split_lse[0], lse)
        if argmax is not None:
            value, index = first_largest(split_lse[argmax_plane],
                                         split_lse[argmax_plane + 1].view(torch.int32))
            argmax.copy_(index)
            if argmax_value is not None:
                argmax_value.copy_(value)
    elif argmax is not None:
        argmax.copy_(argmax_index)
    return lse, tile_bound
