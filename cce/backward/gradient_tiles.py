"""Backward, step 1 (paper Alg. 3, recompute): the logit-gradient tiles of one chunk, written once.

Tiles are recomputed on-chip (one N x V x D product's worth of work for a whole chunk), filtered
exactly (gradient filtering: every entry below ``filter_eps``) and stored in the chunk's scratch
(:mod:`cce.backward.scratch`) in the input dtype, for the products that follow.

- Pass 1 (by grid rows; :class:`TileStore` says which tiles): one program per tile of the
  chunk's rows of the live grid. Tiles that the forward's bounds prove negligible are skipped
  without a recompute; ``flags`` records which tiles survived the filter and were stored. The
  stored tiles fill whole rows of the grid, or, given a slot for every live tile, only their
  slots: a chunk of the same scratch then holds more rows. With ``kept_mass``, it also adds up
  each row's softmax mass in the stored tiles (off its target), for the dE product's estimate
  of what the filter dropped (:mod:`cce.backward.sparse_tile_matmul`). The sum is in fixed
  point (units of 2^-62), so that the atomic additions are exact and the result does not
  depend on their order.
- Pass 2 and the one pass (by lists): one program per tile of the chunk's lists (pass 2: the
  tiles pass 1 stored; :mod:`cce.backward.tile_lists`), each stored in a slot of its own, so
  that the chunk's scratch holds only those.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
import triton
import triton.language as tl

try:
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # a Triton without descriptors: the rows are gathered (lse_forward's test)
    TensorDescriptor = None

from cce.config import KernelConfigs, cdiv
from cce.logit_tile import (LogitOperands, logit_gradient_tile, logit_operands, round_to,
                            vocab_block_entries)
from cce.backward.tile_lists import TileLists
from cce.backward.scratch import Scratch, ScratchView, segment_offsets
from cce.weighting import EntropyTerm, RankOneTerm

KEPT_MASS_ONE = tl.constexpr(2**62)  # a softmax mass m is added up as int64 m * 2^62
KEPT_MASS_UNIT = tl.constexpr(2.0**-62)


@triton.jit
def store_tile(scratch_ptr, offsets, grad, row_mask, DOT_PRECISION: tl.constexpr):
    tl.store(scratch_ptr + offsets, round_to(grad, scratch_ptr.dtype.element_ty, DOT_PRECISION),
             mask=row_mask[:, None])


class TileOperands(NamedTuple):
    """What recomputing a tile reads, as the recompute kernel takes it (one argument): the
    logits' operands, the rows' values and the terms, None where absent (the kernel tests for
    None as it compiles; :func:`tile_operands`)."""

    logits: LogitOperands
    target_positions: torch.Tensor
    lse: torch.Tensor
    prob_scale: torch.Tensor
    target_entry: torch.Tensor
    uniform: RankOneTerm  # the share of label smoothing's term the tiles hold, or Nones
    entropy: EntropyTerm  # or Nones
    filter_eps: Optional[float]


class TileChoice(NamedTuple):
    """A :class:`TileStore` as the recompute kernel takes it (one argument). By grid rows:
    ``chunk_token_blocks x chunk_vocab_blocks`` grid tiles from (``first_token_block``,
    ``first_vocab_block``), live ones only with ``live_tiles``, each in its slot with
    ``slot_map`` (counted from ``first_slots[0]``), else whole rows; ``flags`` set. By lists:
    the tiles of ``lists`` (per vocabulary block of the chunk, ``counts`` token blocks from slot
    ``first_slots[block]``)."""

    scratch: ScratchView
    flags: Optional[torch.Tensor]
    kept_mass: Optional[torch.Tensor]
    first_slots: Optional[torch.Tensor]
    first_token_block: int
    first_vocab_block: int
    chunk_token_blocks: int
    chunk_vocab_blocks: int
    live_tiles: Optional[torch.Tensor]
    num_vocab_blocks: int  # the width of the grid that live_tiles and slot_map index
    slot_map: Optional[torch.Tensor]
    lists: Optional[torch.Tensor]
    counts: Optional[torch.Tensor]
    list_stride: int
    longest_list: int


@triton.jit
def gradient_tiles_kernel(operands, e_desc, c_desc, tiles, SEGMENTS_PER_PAGE: tl.constexpr,
                          BLOCK_TOKENS: tl.constexpr, BLOCK_VOCAB: tl.constexpr,
                          BLOCK_DIM: tl.constexpr, DOT_PRECISION: tl.constexpr):
    # Which paths compile follows from which tensors are given.
    LISTED: tl.constexpr = tiles.lists is not None
    SORTED: tl.constexpr = operands.logits.vocab_order is not None
    # Token blocks vary fastest: the programs in flight share their tiles of c.
    if LISTED:
        # The k-th listed token block of a vocabulary block of the chunk goes to slot
        # first_slots[block] - first_slots[0] + k (the chunk's lists are a slice of all blocks');
        # programs past the end of a block's list have nothing to do.
        entry = tl.program_id(0) % tiles.longest_list
        chunk_vocab_block = tl.program_id(0) // tiles.longest_list
        live = entry < tl.load(tiles.counts + chunk_vocab_block)
        token_block = tl.load(tiles.lists + chunk_vocab_block * tiles.list_stride + entry,
                              mask=live, other=0)
        slot = (tl.load(tiles.first_slots + chunk_vocab_block) - tl.load(tiles.first_slots)
                + entry)
        segments = slot.to(tl.int64) * BLOCK_TOKENS + tl.arange(0, BLOCK_TOKENS)
    else:
        chunk_token_block = tl.program_id(0) % tiles.chunk_token_blocks
        chunk_vocab_block = tl.program_id(0) // tiles.chunk_token_blocks
        token_block = tiles.first_token_block + chunk_token_block
        grid_tile = (token_block * tiles.num_vocab_blocks + tiles.first_vocab_block
                     + chunk_vocab_block)
        live = True
        if tiles.live_tiles is not None:
            live = tl.load(tiles.live_tiles + grid_tile) != 0
        if tiles.slot_map is not None:
            # Only live tiles are stored, each in its slot (numbered from the chunk's first).
            slot = tl.load(tiles.slot_map + grid_tile) - tl.load(tiles.first_slots)
            segments = slot.to(tl.int64) * BLOCK_TOKENS + tl.arange(0, BLOCK_TOKENS)
        else:
            chunk_rows = chunk_token_block * BLOCK_TOKENS + tl.arange(0, BLOCK_TOKENS)
            segments = chunk_rows.to(tl.int64) * tiles.chunk_vocab_blocks + chunk_vocab_block
        flag_ptr = tiles.flags + grid_tile
    vocab_block = tiles.first_vocab_block + chunk_vocab_block

    if live:
        rows = token_block * BLOCK_TOKENS + tl.arange(0, BLOCK_TOKENS)
        row_mask = rows < operands.logits.num_tokens
        # Where the tile goes, looked up before the tile is computed: afterwards the lookup
        # competes with the tile for registers.
        entries = tl.arange(0, BLOCK_VOCAB)
        offsets = segment_offsets(tiles.scratch, segments, entries, row_mask, SEGMENTS_PER_PAGE,
                                  BLOCK_VOCAB)
        vocab, vocab_mask = vocab_block_entries(
            operands.logits.vocab_order, vocab_block, entries, operands.logits.vocab_size,
            BLOCK_VOCAB, SORTED)
        grad, keep, row_mass = logit_gradient_tile(
            operands, e_desc, c_desc, token_block * BLOCK_TOKENS, rows, row_mask, vocab_block,
            vocab, vocab_mask,
            BLOCK_TOKENS, BLOCK_VOCAB, BLOCK_DIM, DOT_PRECISION,
        )
        if LISTED:
            # Every listed tile is read by the product: one the filter drops reads as zeros.
            store_tile(tiles.scratch.buffer, offsets, tl.where(keep, grad, 0.0), row_mask,
                       DOT_PRECISION)
        elif keep:
            store_tile(tiles.scratch.buffer, offsets, grad, row_mask, DOT_PRECISION)
            tl.store(flag_ptr, 1)
        else:
            tl.store(flag_ptr, 0)
        if tiles.kept_mass is not None:
            if keep:
                # A NaN row's dE is NaN through its tiles; its mass must not reach the cast.
                row_mass = tl.where(row_mass == row_mass, row_mass, 0.0)
                tl.atomic_add(tiles.kept_mass + rows, (row_mass * KEPT_MASS_ONE).to(tl.int64),
                              mask=row_mask, sem="relaxed")
    elif not LISTED:
        tl.store(flag_ptr, 0)


class RecomputeInputs(NamedTuple):
    """What recomputing a tile of ``G`` reads, the same in every pass. ``target_positions``:
    see :func:`cce.forward.vocab_order.target_positions`; ``prob_scale``: each row's weight of the
    softmax (:mod:`cce.weighting`); ``target_entry``: each row's gradient at its target
    (:func:`cce.weighting.target_entry`); ``filter_eps``: the
    exact filter's threshold (None: store every recomputed tile); ``rank_one``: the gradient's
    rank-one term (label smoothing), which the products add; with a softcap the tiles hold its
    part that is not rank-one (:func:`cce.logit_tile.logit_gradient_tile`); ``entropy``: the
    entropy's term (:class:`cce.weighting.EntropyTerm`), None without an entropy gradient;
    ``sorted_classifier``: with sorting, c's rows in position order (the forward's copy), or
    None."""

    e: torch.Tensor
    c: torch.Tensor
    target_positions: torch.Tensor
    bias: Optional[torch.Tensor]
    softcap: Optional[float]
    lse: torch.Tensor
    prob_scale: torch.Tensor
    target_entry: torch.Tensor
    vocab_order: Optional[torch.Tensor]
    filter_eps: Optional[float]
    rank_one: Optional[RankOneTerm]
    entropy: Optional[EntropyTerm] = None
    sorted_classifier: Optional[torch.Tensor] = None


class TileStore(NamedTuple):
    """One recompute launch, as the backward's schedule gives it (:mod:`cce.backward.run`):
    which tiles of ``G`` it stores in ``scratch``.

    - By grid rows (pass 1; ``flags`` given): the tiles of ``token_blocks x vocab_blocks``
      (live-grid blocks), live ones only with ``live_tiles``; the survivors' ``flags`` (int32,
      one per live-grid tile) set to 1, the others' to 0. They go to whole rows of the grid,
      or, with ``slot_map`` (int32, token blocks x vocabulary blocks; needs ``live_tiles``),
      each to its slot, counted from ``first_slot`` (int32, first element) at the scratch's
      start.
    - By lists (pass 2 and the one pass; ``tile_lists`` given): the listed tiles of
      ``vocab_blocks`` (per vocabulary block, the token blocks to store; ``longest_list``: at
      least the longest of those lists), each in its slot; tiles the filter drops are stored
      as zeros.

    ``kept_mass`` (int64 (N,), module docstring): adds the softmax mass of the stored tiles off
    the targets, when given. ``filters``: False where an earlier pass filtered these tiles
    already, so the recompute skips the test."""

    scratch: Scratch
    vocab_blocks: range
    token_blocks: range = range(0)
    flags: Optional[torch.Tensor] = None
    live_tiles: Optional[torch.Tensor] = None
    slot_map: Optional[torch.Tensor] = None
    first_slot: Optional[torch.Tensor] = None
    tile_lists: Optional[TileLists] = None
    longest_list: int = 1
    kept_mass: Optional[torch.Tensor] = None
    filters: bool = True


def store_gradient_tiles(recompute: RecomputeInputs, store: TileStore,
                         configs: KernelConfigs,
                         classifier_by_position: Optional[torch.Tensor] = None) -> None:
    """Recompute and store the tiles ``store`` names (:class:`TileStore`). ``configs``: the
    backward's kernel settings (:func:`cce.config.kernel_configs`); ``classifier_by_position``:
    c's rows in position order, read by tensor descriptor (TMA on Hopper; None: gathered
    through the order)."""
    listed = store.tile_lists is not None
    grid = configs.live_grid
    if listed and recompute.softcap is not None:
        config = configs.softcap_listed_gradient_tiles
    else:
        config = configs.gradient_tiles
    # Pass 1: one program per tile of the chunk; by lists: one per entry of each block's list.
    programs = len(store.vocab_blocks) * (store.longest_list if listed
                                          else len(store.token_blocks))
    if programs == 0:
        return
    tile_lists = store.tile_lists
    tiles = TileChoice(
        num_vocab_blocks=cdiv(recompute.c.shape[0], grid.block_vocab),
        first_token_block=store.token_blocks.start, first_vocab_block=store.vocab_blocks.start,
        chunk_token_blocks=len(store.token_blocks), chunk_vocab_blocks=len(store.vocab_blocks),
        live_tiles=store.live_tiles, slot_map=store.slot_map,
        first_slots=tile_lists.first_slots if listed else store.first_slot,
        lists=tile_lists.lists if listed else None,
        counts=tile_lists.counts if listed else None,
        list_stride=tile_lists.lists.stride(0) if listed else 0,
        longest_list=store.longest_list, scratch=store.scratch.view, flags=store.flags,
        kept_mass=store.kept_mass)
    if not store.filters:
        recompute = recompute._replace(filter_eps=None)
    e_desc = c_desc = None
    if classifier_by_position is not None:
        e_desc = TensorDescriptor.from_tensor(recompute.e, [grid.block_tokens, config.block_dim])
        c_desc = TensorDescriptor.from_tensor(classifier_by_position,
                                              [grid.block_vocab, config.block_dim])
    gradient_tiles_kernel[(programs,)](
        tile_operands(recompute), e_desc, c_desc, tiles,
        SEGMENTS_PER_PAGE=store.scratch.segments_per_page,
        BLOCK_TOKENS=grid.block_tokens, BLOCK_VOCAB=grid.block_vocab,
        BLOCK_DIM=config.block_dim, DOT_PRECISION=configs.dot_precision,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )


def tile_operands(recompute: RecomputeInputs) -> TileOperands:
    """The recompute kernel's view of ``recompute``."""
    e, c, softcap, rank_one = recompute.e, recompute.c, recompute.softcap, recompute.rank_one
    # Without a softcap the tiles hold nothing of the rank-one term.
    uniform = (rank_one if rank_one is not None and softcap is not None
               else RankOneTerm(None, None))
    return TileOperands(
        logits=logit_operands(e, c, recompute.bias, recompute.vocab_order, softcap),
        target_positions=recompute.target_positions, lse=recompute.lse,
        prob_scale=recompute.prob_scale, target_entry=recompute.target_entry, uniform=uniform,
        entropy=recompute.entropy or EntropyTerm(None, None), filter_eps=recompute.filter_eps)
