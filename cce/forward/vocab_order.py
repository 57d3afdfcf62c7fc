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
    classifier_row_sum: torch.Tensor  # float32 (D,): c.sum(0), from the same read of c


def sort_vocabulary(e: torch.Tensor, c: torch.Tensor, bias: Optional[torch.Tensor],
                    targets: torch.Tensor) -> SortedVocabulary:
    """The vocabulary order (:func:`vocab_order`) and the sum of the rows of ``c``."""
    valid = (targets >= 0).to(e.dtype)
    # e.T @ valid avoids an (N, D) temporary; the scale of the mean does not change the order.
    mean_embedding = torch.mv(e.T, valid)
    average_logit, row_sum = classifier_sums.classifier_sums(c, mean_embedding)
    if bias is not None:
        average_logit = average_logit + bias.float() * valid.sum()
    # Stable: equal average logits (tied or repeated classifier rows) keep one order every call.
    order = torch.argsort(average_logit, descending=True, stable=True).to(torch.int32)
    return SortedVocabulary(order, row_sum)


def vocab_order(e: torch.Tensor, c: torch.Tensor, bias: Optional[torch.Tensor],
                targets: torch.Tensor) -> torch.Tensor:
    """int32 (V,) vocabulary indices by decreasing average logit over non-ignored tokens."""
    return sort_vocabulary(e, c, bias, targets).order


@triton.jit
def invert_order_kernel(order_ptr, position_of_ptr, vocab_size, BLOCK: tl.constexpr):
    positions = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = positions < vocab_size
    vocab = tl.load(order_ptr + positions, mask=mask, other=0)
    tl.store(position_of_ptr + vocab, positions, mask=mask)


@triton.jit
def target_positions_kernel(targets_ptr, position_of_ptr, positions_ptr, marks, num_tokens,
                            SORTED: tl.constexpr, BLOCK: tl.constexpr):
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    row_mask = rows < num_tokens
    targets = tl.load(targets_ptr + rows, mask=row_mask, other=-1)
    if SORTED:
        positions = tl.load(position_of_ptr + targets, mask=targets >= 0, other=-1)
    else:
        positions = tl.where(targets >= 0, targets, -1)
    tl.store(positions_ptr + rows, positions.to(tl.int32), mask=row_mask)
    if marks.tiles is not None:
        tiles = ((rows // marks.block_tokens).to(tl.int64) * marks.num_vocab_blocks
                 + positions // marks.block_vocab)
        tl.store(marks.tiles + tiles, 1, mask=positions >= 0)  # every writer writes 1: no race


class TileMarks(NamedTuple):
    """A grid of tiles for :func:`target_positions` to mark those that hold a row's position:
    ``tiles`` int8 zeros (token blocks x ``num_vocab_blocks``, row-major) of
    ``block_tokens`` x ``block_vocab`` tiles; it receives 1 where a tile holds one."""

    tiles: torch.Tensor
    block_tokens: int
    block_vocab: int
    num_vocab_blocks: int


def target_positions(targets: torch.Tensor, vocab_order: Optional[torch.Tensor],
                     marks: Optional[TileMarks] = None) -> torch.Tensor:
    """int32 (N,) position of each token's target in the vocabulary order (the target itself
    without sorting), -1 for ignored tokens; with ``marks``, also the tiles that hold one. Two
    small kernels where PyTorch would take ten operations: before the forward's LSE kernel,
    the host's time is the GPU's wait. On CPU tensors outside Triton's interpreter (the
    experiments' tables on a GPU machine), those PyTorch operations."""
    if not kernels_run_on(targets.device):
        return _target_positions_by_torch(targets, vocab_order, marks)
    num_tokens = targets.shape[0]
    positions = torch.empty(num_tokens, dtype=torch.int32, device=targets.device)
    if num_tokens == 0:
        return positions
    position_of = None
    if vocab_order is not None:
        vocab_size = vocab_order.shape[0]
        position_of = torch.empty_like(vocab_order)
        if vocab_size:  # a vocabulary-parallel shard may hold no rows (and no targets)
            invert_order_kernel[(cdiv(vocab_size, _BLOCK),)](
                vocab_order, position_of, vocab_size, BLOCK=_BLOCK)
    target_positions_kernel[(cdiv(num_tokens, _BLOCK),)](
        targets.contiguous(), position_of, positions, marks or TileMarks(None, 1, 1, 0),
        num_tokens, SORTED=vocab_order is not None, BLOCK=_BLOCK)
    return positions


def _target_positions_by_torch(targets: torch.Tensor, vocab_order: Optional[torch.Tensor],
                               marks: Optional[TileMarks]) -> torch.Tensor:
    """:func:`target_positions` by PyTorch."""
    index = targets.clamp(min=0)
    if vocab_order is not None and vocab_order.numel():
        position_of = torch.empty_like(vocab_order)
        position_of[vocab_order.long()] = torch.arange(
            vocab_order.shape[0], dtype=vocab_order.dtype, device=vocab_order.device)
        index = position_of[index]
    positions = torch.where(targets >= 0, index, -1).to(torch.int32)
    if marks is not None:
        rows = torch.arange(targets.shape[0], device=targets.device)
        held = positions >= 0
        marks.tiles[(rows[held] // marks.block_tokens) * marks.num_vocab_blocks
                    + positions[held] // marks.block_vocab] = 1
    return positions
