"""Backward (paper Alg. 3): dE and dC from logit-gradient tiles recomputed once per pass.

Two passes over the tile grid, each in chunks. A chunk's surviving tiles of ``G`` (the gradient
of the logits) are recomputed once and stored (:mod:`cce.gradient_tiles`), then multiplied by
block-sparse products that own their outputs (:mod:`cce.sparse_tile_matmul`):

1. dE, chunks of token blocks x the whole vocabulary: ``dE[chunk] = G[chunk] C``. The chunk is
   stored in dC's memory, which is not written yet, so a chunk of whole rows of the grid holds
   about D tokens. Where that is few (small D), only the live tiles are stored, each in a slot,
   and a chunk holds about 1 / (live fraction) times more tokens (one more host sync: the live
   tiles per token block).
2. dC, chunks of vocabulary blocks x all tokens: ``dC[chunk] = G[:, chunk]^T E``. Only the
   tiles pass 1 stored are recomputed, and each gets a slot of its own in the rows of dC that
   are still free (those of later vocabulary positions). A chunk is as wide as its tiles fit
   there: wide where sorting left few live tiles (the tail of the vocabulary), narrower as dC
   fills up; once a small spare buffer would take more blocks than the free rows, the rest of
   the vocabulary goes through it. Sizing the chunks takes one host sync (the tiles per
   vocabulary block); the lists of every chunk's tiles are built in one launch before pass 1's
   last product, and their lengths copied to the host behind it, so the host plans pass 2
   while the GPU runs that product (:mod:`cce.host_copy`). Where the host must not wait (CUDA
   graph capture, torch.compile, ``torch.cuda.set_sync_debug_mode``), the chunks are sized for
   every tile being stored instead: no sync, narrower chunks.

**One pass** instead, when both gradients are needed, the host may wait, and every live tile
fits in dC's memory (few tokens, or a classifier wide for its vocabulary: about kept tiles <= D
/ N): each live tile is recomputed once into a slot in dC's last rows, in position order, the dE
product reads every slot, then dC is written in chunks of vocabulary blocks, each the widest
whose rows hold no slot still to be read; the last blocks, whose tiles lie in their own rows, are
recomputed again into the spare buffer. ``keep_tiles=True`` runs it in a buffer of its own
wherever the tiles do not fit. Deciding takes one host sync (the live tiles per vocabulary
block), during which the GPU computes the filter correction's mean classifier row.

Peak memory is dE + dC + a few MB of tables, partial sums and the spare buffer; every gradient
is accumulated in float32 on-chip and written once, without atomics, so the result is
deterministic (the filter correction's kept mass is added up atomically, but in integers).
Label smoothing's rank-one term of G, which has an entry in every tile, is added by the products
in closed form (:mod:`cce.sparse_tile_matmul`), so it keeps no tile live.
Tiles that the forward's bounds prove negligible (``live_tiles``) are never recomputed; pass 1
records which tiles survive the exact filter, so pass 2 only recomputes those.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, NamedTuple, Optional

import numpy as np
import torch
import triton

from cce.config import (DEDICATED_SCRATCH_BYTES, kernel_configs, slot_chunk_tokens,
                        sm_utilization, spare_scratch_bytes, whole_waves)
from cce.gradient_tiles import RecomputeInputs, gradient_tiles, listed_gradient_tiles
from cce.host_copy import start_host_copy
from cce.tile_lists import TileLists
from cce.scratch import Scratch, rows_can_hold_segments
from cce.sparse_tile_matmul import (FilterCorrection, RankOneUpdate, embeddings_block_out,
                                    embeddings_product_programs, gradient_times_classifier,
                                    gradient_times_embeddings, product_programs_per_block)


class CorrectionInputs(NamedTuple):
    """What ``filter_correction`` reads besides the recompute's inputs
    (:class:`cce.sparse_tile_matmul.FilterCorrection`): ``counted_mass``, float32 (N,), each row's
    softmax mass in the entries the tiles add up, those of ``c`` off its target (None: all of
    them); ``classifier_row_sum``, float32 (D,) ``c.sum(0)`` where the forward has it (None:
    the backward reads ``c`` for it)."""

    counted_mass: Optional[torch.Tensor] = None
    classifier_row_sum: Optional[torch.Tensor] = None


class BackwardRequest(NamedTuple):
    """What a backward computes, besides the recomputed tiles' inputs.

    ``live_tiles``: the live-grid table of tiles that may hold a significant entry (None: every
    tile may); ``needs_grad_e``, ``needs_grad_c``: the gradients wanted (dbias comes with dC);
    ``correction``: dE gets back what the filter dropped, estimated along the mean classifier
    row (``filter_correction``; needs ``filter_eps`` and no softcap), or None;
    ``keep_tiles``: when both gradients are needed and the host may wait, run the one-pass
    backward with its tiles in a buffer of their own even where they do not fit in dC;
    ``grad_e_dtype``: dE's dtype (None: e's; float32 for a dE summed over shards)."""

    live_tiles: Optional[torch.Tensor]
    needs_grad_e: bool
    needs_grad_c: bool
    correction: Optional[CorrectionInputs] = None
    keep_tiles: bool = False
    grad_e_dtype: Optional[torch.dtype] = None


def linear_cross_entropy_backward(
    recompute: RecomputeInputs, request: BackwardRequest,
) -> "tuple[Optional[torch.Tensor], Optional[torch.Tensor], Optional[torch.Tensor]]":
    """(dE, dC, dbias), each None when not needed, of the tiles ``recompute`` describes
    (:class:`cce.gradient_tiles.RecomputeInputs`). When ``c`` is one shard of the vocabulary
    (:mod:`cce.vocab_parallel`), ``recompute.lse`` is the whole vocabulary's."""
    e, c, bias, vocab_order, rank_one = (recompute.e, recompute.c, recompute.bias,
                                         recompute.vocab_order, recompute.rank_one)
    prob_scale = recompute.prob_scale
    live_tiles, needs_grad_e, needs_grad_c, correction_inputs, keep_tiles, grad_e_dtype = request
    num_tokens, dim = e.shape
    vocab_size = c.shape[0]
    grid = kernel_configs(e.dtype).live_grid
    num_token_blocks = triton.cdiv(num_tokens, grid.block_tokens)
    num_vocab_blocks = triton.cdiv(vocab_size, grid.block_vocab)
    grad_c = (torch.empty((vocab_size, dim), dtype=c.dtype, device=c.device)
              if needs_grad_c else None)
    grad_bias = torch.empty_like(bias) if needs_grad_c and bias is not None else None

    correction = None
    if (needs_grad_e and needs_grad_c and host_may_sync(e.device)
            and (keep_tiles or _one_pass_may_pay(num_token_blocks, num_vocab_blocks, grad_c))):
        table = _live_table(live_tiles, num_token_blocks, num_vocab_blocks, e.device)
        live_listed = _list_tiles(table)
        # Queued behind the copy of the list lengths: the GPU runs it while the host plans.
        correction = (FilterCorrection.of(c, prob_scale, *correction_inputs)
                      if correction_inputs is not None else None)
        one_pass = _one_pass_plan(live_listed, table, grad_c, vocab_order, keep_tiles)
        if one_pass is not None:
            grad_e = torch.empty((num_tokens, dim), dtype=grad_e_dtype or e.dtype,
                                 device=e.device)
            _one_pass_backward(one_pass, recompute, correction, grad_e, grad_c, grad_bias)
            return grad_e, grad_c, grad_bias

    # Pass 1's record: 1 where the tile survived the filter and was stored.
    flags = torch.zeros((num_token_blocks, num_vocab_blocks), dtype=torch.int32, device=e.device)
    listed = None  # pass 2's tiles
    grad_e = None
    if needs_grad_e:
        grad_e = torch.empty((num_tokens, dim), dtype=grad_e_dtype or e.dtype, device=e.device)
        scratch = _embeddings_pass_scratch(grad_c, e, c, num_vocab_blocks, grid.block_tokens,
                                           grid.block_vocab)
        row_segments = grid.block_tokens * num_vocab_blocks  # one token block, every vocab block
        block_out = embeddings_block_out(num_tokens, c.shape[0], dim, e.dtype, slot_map=False,
                                         rank_one=rank_one is not None)
        whole_rows_chunk = _embeddings_chunk(scratch, num_token_blocks, row_segments, dim,
                                             block_out, e.dtype, e.device)
        slots = None
        if _live_tiles_in_slots(live_tiles, whole_rows_chunk, num_token_blocks,
                                grid.block_tokens):
            live_rows = TileLists.of(live_tiles)
            read_tiles_per_row = start_host_copy(live_rows.counts)
            slots = _slot_map(live_rows)
        # With slots, queued behind the copy of the row counts: the GPU runs it while the host
        # plans.
        if correction_inputs is not None and correction is None:
            correction = FilterCorrection.of(c, prob_scale, *correction_inputs)
        if slots is not None:
            tiles_per_row = read_tiles_per_row()
            chunks = _slot_chunks(tiles_per_row, scratch.segments // grid.block_tokens)
        else:
            chunks = [range(first, min(first + whole_rows_chunk, num_token_blocks))
                      for first in range(0, num_token_blocks, whole_rows_chunk)]
        update = RankOneUpdate.for_embeddings(rank_one, c) if rank_one is not None else None
        room = None
        for token_blocks in chunks:
            if slots is None:
                first_slot = None
                used_segments = len(token_blocks) * row_segments
            else:
                first_slot = live_rows.first_slots[token_blocks.start:]
                used_segments = int(tiles_per_row[token_blocks.start:token_blocks.stop].sum()
                                    ) * grid.block_tokens
            room = _room_after(scratch, used_segments)
            gradient_tiles(recompute, live_tiles, flags, scratch, token_blocks,
                           range(num_vocab_blocks),
                           correction.kept_mass if correction is not None else None,
                           slots, first_slot)
            if needs_grad_c and token_blocks.stop == num_token_blocks:
                # Pass 1 filtered every tile exactly: its final flags are the tiles pass 2
                # stores. Listed before the last product, which the GPU runs while the host
                # reads the lists' lengths and plans pass 2.
                listed = _list_tiles(flags)
            gradient_times_embeddings(scratch, flags, c, vocab_order, grad_e, token_blocks, room,
                                      correction, update, slots, first_slot)
        del scratch, room

    if needs_grad_c:
        if listed is None:  # no pass 1: the live tiles, filtered in pass 2
            listed = _list_tiles(_live_table(live_tiles, num_token_blocks, num_vocab_blocks,
                                             e.device))
        tile_lists, read_lengths = listed
        tiles_per_block = read_lengths()
        spare_tiles = _spare_tiles(tiles_per_block, c)
        # Vocabulary positions -> rows of dC: the free rows are those of later positions.
        position_rows = _position_rows(vocab_order, vocab_size, c.device)
        update = RankOneUpdate.for_classifier(rank_one, e) if rank_one is not None else None
        spare = None
        for vocab_blocks, in_spare in _classifier_chunks(
                tiles_per_block, vocab_size, dim, grid.block_tokens, grid.block_vocab,
                rows_can_hold_segments(grad_c, grid.block_vocab), spare_tiles):
            if in_spare:
                spare = spare or _spare_scratch(spare_tiles, c)
                scratch = spare
            else:
                free_rows = position_rows[vocab_blocks.stop * grid.block_vocab:]
                scratch = Scratch.in_rows(grad_c, free_rows, grid.block_vocab)
            chunk_lists = tile_lists.rows(vocab_blocks)
            # Pass 1's tiles survived the filter already: the same recompute needs no test.
            listed_gradient_tiles(recompute._replace(filter_eps=None) if needs_grad_e
                                  else recompute, scratch, chunk_lists,
                                  _longest_list(tiles_per_block, vocab_blocks), vocab_blocks)
            gradient_times_classifier(scratch, chunk_lists, e, vocab_order, grad_c, grad_bias,
                                      vocab_blocks, update)
    return grad_e, grad_c, grad_bias


# The one pass's dE product must keep the SMs at least this busy over its waves.
_ONE_PASS_MIN_UTILIZATION = 0.9


@dataclass(frozen=True)
class OnePassPlan:
    """Where the one-pass backward keeps its tiles, and the chunks in which it writes dC."""

    tile_lists: TileLists  # the live tiles of each vocabulary block, slots numbered over all
    tiles_per_block: np.ndarray  # their counts, on the host
    live_tiles: torch.Tensor  # int32 grid, nonzero = listed (the dE product's flags)
    scratch: Scratch  # every slot
    # dC's chunks of vocabulary blocks, in order; True: its tiles are recomputed again into the
    # spare buffer, because they lie in the rows the chunk writes.
    chunks: "list[tuple[range, bool]]"


def _one_pass_plan(listed: ListedTiles, live_tiles: torch.Tensor, grad_c: torch.Tensor,
                   vocab_order: Optional[torch.Tensor], keep_tiles: bool
                   ) -> Optional[OnePassPlan]:
    """The one-pass backward's plan for the live tiles (``listed``, listed from the table
    ``live_tiles``): with ``keep_tiles``, every live tile in a buffer of its own; otherwise when
    every live tile fits in dC's memory (the tiles of the later chunks in the rows of later
    positions), None when they do not. Reads the lists' lengths on the host."""
    grid = kernel_configs(grad_c.dtype).live_grid
    vocab_size, dim = grad_c.shape
    tile_lists, read_lengths = listed
    tiles_per_block = read_lengths()
    num_vocab_blocks = len(tiles_per_block)
    if keep_tiles:
        scratch = Scratch.dedicated(max(int(tiles_per_block.sum()), 1) * grid.block_tokens,
                                    grid.block_vocab, grad_c.dtype, grad_c.device)
        chunks = [(range(num_vocab_blocks), False)]
    else:
        placed = _one_pass_chunks(tiles_per_block, vocab_size, dim, grid.block_tokens,
                                  grid.block_vocab, _spare_tiles(tiles_per_block, grad_c))
        if placed is None:
            return None
        first_position, chunks = placed
        # The slots fill the rows of dC from first_position on, in position order.
        rows = _position_rows(vocab_order, vocab_size, grad_c.device)[first_position:]
        scratch = Scratch.in_rows(grad_c, rows, grid.block_vocab)
    return OnePassPlan(tile_lists, tiles_per_block, live_tiles, scratch, chunks)


def _one_pass_may_pay(num_token_blocks: int, num_vocab_blocks: int,
                      grad_c: torch.Tensor) -> bool:
    """Whether to look for room for the one pass in dC (a host sync): when dC's rows can hold
    tiles, when they would hold half the grid's tiles (a sync that finds too many costs the
    backward its lead over the GPU: 0.8-1.2 ms at N = 8192, H100), and when the dE product,
    which multiplies every tile in one launch without splits, fills whole waves of the GPU
    (with 144 programs for 132 SMs, 2B shape at N = 2048, the one pass was 16% slower)."""
    grid = kernel_configs(grad_c.dtype).live_grid
    vocab_size, dim = grad_c.shape
    if not rows_can_hold_segments(grad_c, grid.block_vocab):
        return False
    half_grid_segments = num_token_blocks * num_vocab_blocks * grid.block_tokens // 2
    programs = num_token_blocks * product_programs_per_block(dim, grad_c.dtype)
    return (half_grid_segments <= vocab_size * (dim // grid.block_vocab)
            and sm_utilization(programs, grad_c.device) >= _ONE_PASS_MIN_UTILIZATION)


def _one_pass_backward(plan: OnePassPlan, recompute: RecomputeInputs,
                       correction: Optional[FilterCorrection], grad_e: torch.Tensor,
                       grad_c: torch.Tensor, grad_bias: Optional[torch.Tensor]) -> None:
    """Both gradients from one recompute of every live tile: each tile is stored in its slot
    (tiles the exact filter drops as zeros), the dE product reads them all through a map from
    grid tile to slot, then dC is written chunk by chunk (module docstring)."""
    e, c, vocab_order, rank_one = (recompute.e, recompute.c, recompute.vocab_order,
                                   recompute.rank_one)
    tile_lists, scratch = plan.tile_lists, plan.scratch
    num_token_blocks, num_vocab_blocks = plan.live_tiles.shape
    all_vocab_blocks = range(num_vocab_blocks)
    listed_gradient_tiles(recompute, scratch, tile_lists,
                          _longest_list(plan.tiles_per_block, all_vocab_blocks), all_vocab_blocks,
                          correction.kept_mass if correction is not None else None)
    gradient_times_embeddings(scratch, plan.live_tiles, c, vocab_order, grad_e,
                              range(num_token_blocks), filter_correction=correction,
                              rank_one=(RankOneUpdate.for_embeddings(rank_one, c)
                                        if rank_one is not None else None),
                              slot_map=_slot_map(tile_lists, transposed=True))
    update = RankOneUpdate.for_classifier(rank_one, e) if rank_one is not None else None
    spare = None
    for vocab_blocks, in_spare in plan.chunks:
        chunk_lists = tile_lists.rows(vocab_blocks)
        if in_spare:
            spare = spare or _spare_scratch(_spare_tiles(plan.tiles_per_block, c), c)
            listed_gradient_tiles(recompute, spare, chunk_lists,
                                  _longest_list(plan.tiles_per_block, vocab_blocks),
                                  vocab_blocks)
        gradient_times_classifier(spare if in_spare else scratch, chunk_lists, e, vocab_order,
                                  grad_c, grad_bias, vocab_blocks, update,
                                  chunk_slots=in_spare)


def _live_table(live_tiles: Optional[torch.Tensor], num_token_blocks: int,
                num_vocab_blocks: int, device: torch.device) -> torch.Tensor:
    """The live-tile table, or every tile live when there is none (no filter)."""
    if live_tiles is not None:
        return live_tiles
    return torch.ones((num_token_blocks, num_vocab_blocks), dtype=torch.int32, device=device)


def _slot_map(tile_lists: TileLists, transposed: bool = False) -> torch.Tensor:
    """int32 (rows, columns) of the lists' flags, or (columns, rows) when ``transposed``: the
    slot of each listed tile (the k-th of row r's list is in slot first_slots[r] + k; unlisted
    tiles: 0). Built by indexing rather than by a boolean mask, which would make the host wait
    for the GPU."""
    num_rows, num_columns = tile_lists.lists.shape
    device = tile_lists.counts.device
    entries = torch.arange(num_columns, device=device, dtype=torch.int32)
    listed = entries[None, :] < tile_lists.counts[:, None]
    rows = torch.arange(num_rows, device=device, dtype=torch.int64)[:, None]
    places = (tile_lists.lists * num_rows + rows if transposed
              else rows * num_columns + tile_lists.lists)
    # Entries past a list's end go to an extra element, dropped at the end.
    places = torch.where(listed, places, num_rows * num_columns)
    slot_map = torch.zeros(num_rows * num_columns + 1, dtype=torch.int32, device=device)
    slot_map[places.flatten()] = (tile_lists.first_slots[:, None] + entries).flatten()
    shape = (num_columns, num_rows) if transposed else (num_rows, num_columns)
    return slot_map[:-1].view(shape)


def _spare_tiles(tiles_per_block: np.ndarray, like: torch.Tensor) -> int:
    """Tiles the spare buffer holds: its bytes' worth of tiles of ``like``'s dtype, or one
    vocabulary block's tiles if more."""
    grid = kernel_configs(like.dtype).live_grid
    tile_bytes = grid.block_tokens * grid.block_vocab * like.element_size()
    return max(spare_scratch_bytes() // tile_bytes, int(tiles_per_block.max()))


def _spare_scratch(spare_tiles: int, like: torch.Tensor) -> Scratch:
    """The spare buffer: ``spare_tiles`` tiles of ``like``'s dtype, on its device."""
    grid = kernel_configs(like.dtype).live_grid
    return Scratch.dedicated(spare_tiles * grid.block_tokens, grid.block_vocab, like.dtype,
                             like.device)


def _longest_list(tiles_per_block: np.ndarray, vocab_blocks: range) -> int:
    """The most tiles of one block of ``vocab_blocks``: a listed recompute's programs per
    block."""
    return int(tiles_per_block[vocab_blocks.start:vocab_blocks.stop].max())


def _tiles_before(tiles_per_block: np.ndarray) -> np.ndarray:
    """int64 (blocks + 1,): the tiles of the blocks before each block (and of all, last)."""
    tiles_before = np.zeros(len(tiles_per_block) + 1, dtype=np.int64)
    np.cumsum(tiles_per_block, out=tiles_before[1:])
    return tiles_before


def _position_rows(vocab_order: Optional[torch.Tensor], vocab_size: int,
                   device: torch.device) -> torch.Tensor:
    """The row of dC (the vocabulary entry) at each vocabulary position."""
    if vocab_order is not None:
        return vocab_order
    return torch.arange(vocab_size, dtype=torch.int32, device=device)


def host_may_sync(device: torch.device) -> bool:
    """Whether the host may wait for the GPU here: not while a CUDA graph is being captured,
    not inside torch.compile's tracing, and not when the caller asked torch to flag every sync
    (``torch.cuda.set_sync_debug_mode``)."""
    if device.type != "cuda":
        return True
    return not (torch.cuda.is_current_stream_capturing() or torch.compiler.is_compiling()
                or torch.cuda.get_sync_debug_mode() != 0)


class ListedTiles(NamedTuple):
    """The tiles of each vocabulary block (``TileLists``), and a function that returns their
    number per block on the host (:func:`_list_tiles`)."""

    tile_lists: TileLists
    read_lengths: Callable[[], np.ndarray]


def _list_tiles(table: torch.Tensor) -> ListedTiles:
    """The lists of the tiles flagged in ``table`` (token blocks x vocabulary blocks), by
    vocabulary block. Their lengths set the chunks' widths. When the host may wait, their copy
    to the host is queued now and read later (one sync, :mod:`cce.host_copy`), so the GPU runs
    what is queued in between while the host plans. Otherwise the lengths are the bound known in
    advance, every token block, so that the schedule needs nothing from the GPU (CUDA graphs),
    at the cost of narrower chunks and idle programs."""
    tile_lists = TileLists.of(table.T)
    if host_may_sync(table.device):
        return ListedTiles(tile_lists, start_host_copy(tile_lists.counts))
    bound = np.full(table.shape[1], table.shape[0], dtype=np.int64)
    return ListedTiles(tile_lists, lambda: bound)


def _embeddings_pass_scratch(grad_c: Optional[torch.Tensor], e: torch.Tensor,
                             c: torch.Tensor, num_vocab_blocks: int, block_tokens: int,
                             block_vocab: int) -> Scratch:
    """dC's memory when it can hold at least one token block of tiles, else a buffer of its own
    (dC not needed, or too small). Without dC (a frozen classifier) that buffer may take the
    memory dC would have taken, so the dE-only backward gets chunks as wide as the full one's."""
    row_segments = block_tokens * num_vocab_blocks
    if grad_c is not None and rows_can_hold_segments(grad_c, block_vocab):
        scratch = Scratch.in_all_rows(grad_c, block_vocab)
        if scratch.segments >= row_segments:
            return scratch
    budget = DEDICATED_SCRATCH_BYTES if grad_c is not None else max(
        DEDICATED_SCRATCH_BYTES, c.numel() * c.element_size())
    segments = max(row_segments,
                   budget // (block_vocab * e.element_size()) // row_segments * row_segments)
    segments = min(segments, triton.cdiv(e.shape[0], block_tokens) * row_segments)
    return Scratch.dedicated(segments, block_vocab, e.dtype, e.device)


def _live_tiles_in_slots(live_tiles: Optional[torch.Tensor], whole_rows_chunk: int,
                         num_token_blocks: int, block_tokens: int) -> bool:
    """Whether pass 1 stores only the live tiles, each in a slot, rather than whole rows of the
    grid (``whole_rows_chunk`` token blocks per chunk). Each chunk's recompute and dE product
    read all of c, so whole rows at small D (dC holds about D tokens of them) take many chunks
    that wait on memory; slots let a chunk hold about 1 / (live fraction) times more. Slots
    cost the dE product its whole-block loop, more than they save where whole rows already
    hold many tokens (:func:`cce.config.slot_chunk_tokens`). The host reads the rows' live
    counts, so not where it must not wait. Slot chunks follow the live tiles, and with them the
    product's splits and the order of its float32 sums: in deterministic mode the live tiles
    are a function of the inputs (:func:`cce.forward.lse_forward.lse_forward`)."""
    return (live_tiles is not None and whole_rows_chunk < num_token_blocks
            and whole_rows_chunk * block_tokens < slot_chunk_tokens()
            and host_may_sync(live_tiles.device))


def _embeddings_chunk(scratch: Scratch, num_token_blocks: int, row_segments: int, dim: int,
                      block_out: int, dtype: torch.dtype, device: torch.device) -> int:
    """Token blocks per chunk of pass 1: as many as the scratch holds, trimmed to whole waves of
    the product (``block_out`` columns per program); or one less, when the room that frees in
    the scratch lets a split product fill the SMs better (small D: dC then holds few token
    blocks, and their product few programs)."""
    most = whole_waves(min(num_token_blocks, scratch.segments // row_segments),
                       triton.cdiv(dim, block_out), device)
    if most == 1:
        return most

    def utilization(blocks: int) -> float:
        room_bytes = (scratch.segments - blocks * row_segments) * scratch.segment_bytes
        return sm_utilization(
            embeddings_product_programs(blocks, dim, block_out, dtype, device, room_bytes),
            device)

    return most - 1 if utilization(most - 1) > utilization(most) else most


def _room_after(scratch: Scratch, used_segments: int) -> Optional[torch.Tensor]:
    """The scratch after its first ``used_segments``, as float32, when its segments lie in order
    in its buffer (None otherwise)."""
    if not scratch.in_order:
        return None
    start = used_segments * scratch.segment_elements
    end = scratch.segments * scratch.segment_elements
    end -= (end - start) % 2  # whole float32 words
    return scratch.buffer[start:end].view(torch.float32) if end > start else None


def _classifier_chunks(tiles_per_block: np.ndarray, vocab_size: int, dim: int,
                       block_tokens: int, block_vocab: int, rows_hold_segments: bool,
                       spare_tiles: int) -> "list[tuple[range, bool]]":
    """Pass 2's chunks of vocabulary blocks, in order, and whether each is stored in the spare
    buffer. A chunk's tiles (``tiles_per_block`` of each block, ``block_tokens`` segments each)
    go to the rows of dC of later positions (``dim / block_vocab`` segments per row): each chunk
    is the widest whose tiles fit there. The free rows run out as dC fills up, so the chunks
    narrow, each taking about half the blocks left; once the spare buffer would take more
    blocks (as many as its ``spare_tiles`` hold, one at least), every later chunk goes there,
    rather than many small chunks that run at the host's pace.

    Runs on the host after the list lengths arrive, while the GPU has only pass 1's last
    product left, so each chunk's end is a binary search rather than a Python loop over the
    blocks (2048 of them at V = 262144)."""
    num_blocks = len(tiles_per_block)
    tiles_before = _tiles_before(tiles_per_block)
    # Blocks [first, end) fit in the free rows when their segments, plus the segments of the
    # rows up to the end of block `end`, are at most all of dC's:
    #   (tiles_before[end] - tiles_before[first]) * block_tokens
    #       <= (vocab_size - end * block_vocab) * segments_per_row,
    # and the left-hand side minus the right one grows with `end`.
    segments_per_row = dim // block_vocab
    footprint = (tiles_before * block_tokens
                 + np.arange(num_blocks + 1, dtype=np.int64) * block_vocab * segments_per_row)

    chunks = []
    first = 0
    in_spare = not rows_hold_segments
    while first < num_blocks:
        spare_end = _spare_chunk_end(tiles_before, first, spare_tiles)
        if not in_spare:
            room = vocab_size * segments_per_row + tiles_before[first] * block_tokens
            rows_end = int(np.searchsorted(footprint, room, side="right")) - 1
            in_spare = rows_end < spare_end
        end = spare_end if in_spare else rows_end
        chunks.append((range(first, end), in_spare))
        first = end
    return chunks


def _one_pass_chunks(tiles_per_block: np.ndarray, vocab_size: int, dim: int,
                     block_tokens: int, block_vocab: int, spare_tiles: int
                     ) -> "Optional[tuple[int, list[tuple[range, bool]]]]":
    """Where the one-pass backward's slots go in dC, and its chunks of dC: ``(first position,
    chunks)``, or None when the tiles do not fit in dC's memory.

    The slots fill dC's rows in position order, up to the last row, from the first position on.
    A chunk of vocabulary blocks writes the rows of its positions, so it may only write rows
    that hold no tile of its blocks or of later ones: rows before the first position, and rows
    of tiles already multiplied. Each chunk is the widest that writes only those. Sorting puts
    the blocks with many tiles first, so the chunks widen; at the end of the vocabulary, once a
    block's own tiles lie in its rows, the remaining blocks are recomputed again into the spare
    buffer (``spare_tiles``), as pass 2's last chunks are."""
    segments_per_row = dim // block_vocab
    num_blocks = len(tiles_per_block)
    tiles_before = _tiles_before(tiles_per_block)
    slot_rows = -(-int(tiles_before[-1]) * block_tokens // segments_per_row)
    first_position = vocab_size - slot_rows
    if first_position < 0:
        return None
    chunks = []
    first = 0
    while first < num_blocks:
        # The rows before this one hold no slot of block `first` or of a later block.
        writable = (vocab_size if tiles_before[first] == tiles_before[-1] else
                    first_position + tiles_before[first] * block_tokens // segments_per_row)
        end = num_blocks if writable >= vocab_size else min(num_blocks, writable // block_vocab)
        if end <= first:
            break
        chunks.append((range(first, end), False))
        first = end
    while first < num_blocks:
        end = _spare_chunk_end(tiles_before, first, spare_tiles)
        chunks.append((range(first, end), True))
        first = end
    return first_position, chunks


def _slot_chunks(tiles_per_row: np.ndarray, slots: int) -> "list[range]":
    """Pass 1's chunks of token blocks when each live tile has a slot: consecutive rows of the
    grid whose ``tiles_per_row`` fit in ``slots``, as few chunks as the greedy cut gives, with
    their tiles shared out about equally (room is left for the dE product's partial sums).
    A row fits whatever its tiles: the scratch holds a whole row of the grid."""
    num_rows = len(tiles_per_row)
    tiles_before = _tiles_before(tiles_per_row)
    count, first = 0, 0
    while first < num_rows:
        first = max(first + 1,
                    int(np.searchsorted(tiles_before, tiles_before[first] + slots,
                                        side="right")) - 1)
        count += 1
    for parts in range(count, num_rows + 1):
        shares = tiles_before[-1] * np.arange(1, parts) / parts
        cuts = [0, *np.searchsorted(tiles_before, shares, side="left").tolist(), num_rows]
        chunks = [range(a, b) for a, b in zip(cuts, cuts[1:])]
        if all(len(chunk) and tiles_before[chunk.stop] - tiles_before[chunk.start] <= slots
               for chunk in chunks):
            return chunks
    return [range(row, row + 1) for row in range(num_rows)]


def _spare_chunk_end(tiles_before: np.ndarray, first: int, spare_tiles: int) -> int:
    """The end of the widest chunk of blocks from ``first`` on whose tiles the spare buffer
    holds (``tiles_before[k]``: the tiles of the blocks before k; one block at least)."""
    end = int(np.searchsorted(tiles_before, tiles_before[first] + spare_tiles, side="right")) - 1
    return max(end, first + 1)
