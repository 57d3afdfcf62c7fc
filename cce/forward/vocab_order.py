"""Vocabulary sorting: the order of the vocabulary and where each target lands in it.

The paper orders the vocabulary by average logit, accumulated in the forward with an atomic
add. The average of ``e_i . c_v + b_v`` over tokens is exactly ``mean(e) . c_v + b_v``: one
matrix-vector product, cheap enough to run *before* the forward, so that the forward walks the
sorted vocabulary too and its per-tile bounds describe the backward's tiles. (With a softcap
the order is that of the pre-cap average: the cap is monotone, and the order only changes speed.)
The same read of ``c`` sums its rows, which the backward's mass correction needs
(:mod:`cce.forward.classifier_sums`).
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
import triton
import triton.language as tl

from cce.config import cdiv, kernels_run_on
from cce.forward import classifier_sums

_BLOCK = 1024


class SortedVocabulary(NamedTuple):
    order: torch.Tensor  # int32 (V,)
    position_of: torch.Tensor  # int32 (V,): each vocabulary entry's position in the order
    classifier_row_sum: torch.Tensor  # float32 (D,): c.sum(0), from the same read of c


def sort_vocabulary(e: torch.Tensor, c: torch.Tensor, bias: Optional[torch.Tensor],
                    targets: torch.Tensor) -> SortedVocabulary:
    """The vocabulary order (:func:`vocab_order`), its inverse and the sum of the rows of
    ``c``."""
    valid = (targets >= 0).to(e.dtype)
    # e.T @ valid avoids an (N, D) temporary; the scale of the mean does not change the order.
    mean_embedding = torch.mv(e.T, valid)
    average_logit, row_sum = classifier_sums.classifier_sums(c, mean_embedding)
    if bias is not None:
        average_logit = average_logit + bias.float() * valid.sum()
    # Stable: equal average logits (tied or repeated classifier rows) keep one order every call.
    ranked = torch.argsort(average_logit, descending=True, stable=True)
    order, position_of = _order_and_inverse(ranked)
    return SortedVocabulary(order, position_of, row_sum)


def vocab_order(e: torch.Tensor, c: torch.Tensor, bias: Optional[torch.Tensor],
                targets: torch.Tensor) -> torch.Tensor:
    """int32 (V,) vocabulary indices by decreasing average logit over non-ignored tokens."""
    return sort_vocabulary(e, c, bias, targets).order


@triton.jit
def order_kernel(ranked_ptr, order_ptr, position_of_ptr, vocab_size, BLOCK: tl.constexpr):
    """``position_of[ranked[p]] = p`` and, with ``order_ptr``, ``order = ranked`` in int32."""
    positions = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = positions < vocab_size
    vocab = tl.load(ranked_ptr + positions, mask=mask, other=0)
    if order_ptr is not None:
        tl.store(order_ptr + positions, vocab.to(tl.int32), mask=mask)
    tl.store(position_of_ptr + vocab, positions, mask=mask)


def _order_and_inverse(ranked: torch.Tensor) -> "tuple[torch.Tensor, torch.Tensor]":
    """int32 (V,) each: ``ranked`` (an order, any integer dtype) and its inverse, in one launch
    where the kernels run."""
    vocab_size = ranked.shape[0]
    position_of = torch.empty(vocab_size, dtype=torch.int32, device=ranked.device)
    if not kernels_run_on(ranked.device):
        position_of[ranked.long()] = torch.arange(vocab_size, dtype=torch.int32,
                                                  device=ranked.device)
        return ranked.to(torch.int32), position_of
    order = ranked if ranked.dtype == torch.int32 else torch.empty_like(position_of)
    if vocab_size:  # a vocabulary-parallel shard may hold no rows
        order_kernel[(cdiv(vocab_size, _BLOCK),)](
            ranked, None if order is ranked else order, position_of, vocab_size, BLOCK=_BLOCK)
    return order, position_of


class TileMarks(NamedTuple):
    """A grid of tiles in which to mark those that hold a row's position: ``tiles`` int8 zeros
    (token blocks x ``num_vocab_blocks``, row-major) of ``block_tokens`` x ``block_vocab``
    tiles; it receives 1 where a tile holds one."""

    tiles: Optional[torch.Tensor]
    block_tokens: int
    block_vocab: int
    num_vocab_blocks: int


# No tiles to mark (without tiles its sizes are never read).
NO_MARKS = TileMarks(None, 1, 1, 0)


class TargetPlacement(NamedTuple):
    """Where a launch that reads the targets (:func:`place_targets`) puts each row's target's
    position in the order: ``positions`` int32 (N,), -1 for ignored tokens (None: nowhere),
    read through ``position_of`` (int32 (V,), the order's inverse; None: unsorted, the
    position is the target), and the tiles of ``marks`` that hold one."""

    position_of: Optional[torch.Tensor]
    positions: Optional[torch.Tensor]
    marks: TileMarks


@triton.jit
def place_targets(targets, rows, row_mask, placement):
    """Write the positions of ``targets`` (int, -1: ignored) of ``rows`` as ``placement``
    (:class:`TargetPlacement`) says."""
    if placement.position_of is not None:
        positions = tl.load(placement.position_of + targets, mask=targets >= 0, other=-1)
    else:
        positions = tl.where(targets >= 0, targets, -1)
    tl.store(placement.positions + rows, positions.to(tl.int32), mask=row_mask)
    marks = placement.marks
    if marks.tiles is not None:
        tiles = ((rows // marks.block_tokens).to(tl.int64) * marks.num_vocab_blocks
                 + positions // marks.block_vocab)
        # Every writer writes 1: no race.
        tl.store(marks.tiles + tiles, 1, mask=row_mask & (positions >= 0))


@triton.jit
def target_positions_kernel(targets_ptr, placement, num_tokens, BLOCK: tl.constexpr):
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    row_mask = rows < num_tokens
    targets = tl.load(targets_ptr + rows, mask=row_mask, other=-1)
    place_targets(targets, rows, row_mask, placement)


def target_positions(targets: torch.Tensor, vocab_order: Optional[torch.Tensor],
                     marks: Optional[TileMarks] = None) -> torch.Tensor:
    """int32 (N,) position of each token's target in the vocabulary order (the target itself
    without sorting), -1 for ignored tokens; with ``marks``, also the tiles that hold one. The
    loss's forward places them in its indexed dot's launch
    (:func:`cce.forward.indexed_dot.indexed_dot`); this is the same on its own, for the tables
    and tests. On CPU tensors outside Triton's interpreter (the experiments' tables on a GPU
    machine), by PyTorch."""
    if not kernels_run_on(targets.device):
        return _target_positions_by_torch(targets, vocab_order, marks)
    num_tokens = targets.shape[0]
    positions = torch.empty(num_tokens, dtype=torch.int32, device=targets.device)
    position_of = None if vocab_order is None else _order_and_inverse(vocab_order)[1]
    if num_tokens:
        target_positions_kernel[(cdiv(num_tokens, _BLOCK),)](
            targets.contiguous(),
            TargetPlacement(position_of, positions, marks or NO_MARKS),
            num_tokens, BLOCK=_BLOCK)
    return positions


def _target_positions_by_torch(targets: torch.Tensor, vocab_order: Optional[torch.Tensor],
                               marks: Optional[TileMarks]) -> torch.Tensor:
    """:func:`target_positions` by PyTorch."""
    index = targets.clamp(min=0)
    if vocab_order is not None and vocab_order.numel():
        index = _order_and_inverse(vocab_order)[1][index]
    positions = torch.where(targets >= 0, index, -1).to(torch.int32)
    if marks is not None:
        rows = torch.arange(targets.shape[0], device=targets.device)
        held = positions >= 0
        marks.tiles[(rows[held] // marks.block_tokens) * marks.num_vocab_blocks
                    + positions[held] // marks.block_vocab] = 1
    return positions
