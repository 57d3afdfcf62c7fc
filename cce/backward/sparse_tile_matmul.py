"""Backward, step 2 (paper Alg. 3, the two products): ``dE = G C`` and ``dC = G^T E``, reading
the stored logit-gradient tiles of one chunk and skipping the filtered ones.

Each program owns one block of output rows (a block of the live grid) and BLOCK_OUT columns,
and accumulates in float32 registers the products of the live tiles of its row of the grid,
found in a list (:mod:`cce.backward.tile_lists`: the grid blocks with a stored tile, ``tile_counts``
of them). Walking a list instead of testing every tile keeps the loop free of branches, so Triton
can pipeline its loads. The output is written once, in its dtype: no atomics, deterministic. When
the output has too few blocks to fill the GPU, each list is split among SPLITS programs that
write float32 partial sums, added up afterwards (dE only; :mod:`cce.backward.partial_sums`).

- dE (TRANSPOSED=False): output rows are the chunk's tokens; the list walks vocabulary blocks;
  the second operand is rows of c, through the vocabulary order.
- dC (TRANSPOSED=True): output rows are vocabulary positions, written through the order; the
  list walks token blocks; the first operand is the transposed tile (the k-th of an output
  block's list is in slot ``first_slots[block] - first_slots[0] + k`` of a chunk's scratch, or
  ``first_slots[block] + k`` when the scratch holds every block's tiles), the second rows of e.
  The bias gradient (column sums of G) comes along.

The products' epilogues add the rank-one term of label smoothing and the filter correction
(:mod:`cce.backward.epilogue_terms`). The backward's schedule describes each launch as a
:class:`Product`, which :func:`multiply` launches here or, on Hopper GPUs, through
:mod:`cce.backward.classifier_product` (dC) or :mod:`cce.backward.embeddings_product` (the one
pass's dE, where c's rows lie in position order), with the same arguments
(:mod:`cce.backward.product_arguments`).
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
import triton
import triton.language as tl

from cce.backward import classifier_product, embeddings_product
from cce.backward.product_arguments import ProductIO, ProductSettings, ProductTiles
from cce.backward.epilogue_terms import FilterCorrection, RankOneUpdate
from cce.backward.gradient_tiles import KEPT_MASS_ONE, KEPT_MASS_UNIT
from cce.logit_tile import round_to, tile_dot, vocab_block_entries
from cce.backward.partial_sums import sum_partials
from cce.backward.scratch import Scratch, segment_offsets
from cce.config import cdiv


@triton.jit
def sparse_tile_matmul_kernel(
    tiles, io, correction, rank_one,
    TRANSPOSED: tl.constexpr, SPLITS: tl.constexpr, CHUNK_SLOTS: tl.constexpr,
    SEGMENTS_PER_PAGE: tl.constexpr, BLOCK_TOKENS: tl.constexpr, BLOCK_VOCAB: tl.constexpr,
    BLOCK_OUT: tl.constexpr, DOT_PRECISION: tl.constexpr, STEPS: tl.constexpr,
    WHOLE_BLOCKS: tl.constexpr,
):
    # Which paths compile follows from which tensors are given.
    SORTED: tl.constexpr = io.vocab_order is not None
    HAS_BIAS: tl.constexpr = io.grad_bias is not None
    SLOT_MAP: tl.constexpr = tiles.slot_map is not None
    # Output blocks vary fastest: the programs in flight walk the same operand rows together.
    num_out_chunks = tl.cdiv(io.dim, BLOCK_OUT)
    out_block = tl.program_id(0) % tiles.num_out_blocks
    out_chunk = (tl.program_id(0) // tiles.num_out_blocks) % num_out_chunks
    split = tl.program_id(0) // (tiles.num_out_blocks * num_out_chunks)
    out_dims = out_chunk * BLOCK_OUT + tl.arange(0, BLOCK_OUT)
    # Masks that whole blocks make all true are folded away at compile time.
    out_mask = (out_dims < io.dim) | WHOLE_BLOCKS
    count = tl.load(tiles.counts + out_block)
    list_start = split * count // SPLITS
    list_end = (split + 1) * count // SPLITS
    BLOCK_ROWS: tl.constexpr = BLOCK_VOCAB if TRANSPOSED else BLOCK_TOKENS

    if SLOT_MAP and CHUNK_SLOTS and not TRANSPOSED:
        # The slot map numbers the slots of every chunk; this chunk's start at its scratch's 0.
        slot_base = tl.load(tiles.first_slots)
    else:
        slot_base = 0
    if TRANSPOSED:
        vocab, row_mask = vocab_block_entries(
            io.vocab_order, tiles.first_block + out_block, tl.arange(0, BLOCK_VOCAB),
            io.vocab_size, BLOCK_VOCAB, SORTED, WHOLE_BLOCKS)
        out_rows = vocab
        # Its k-th listed tile is in slot first_slot + k; the chunk's lists are a slice.
        first_slot = tl.load(tiles.first_slots + out_block)
        if CHUNK_SLOTS:
            first_slot -= tl.load(tiles.first_slots)
    else:
        chunk_rows = out_block * BLOCK_TOKENS + tl.arange(0, BLOCK_TOKENS)
        out_rows = tiles.first_block * BLOCK_TOKENS + chunk_rows
        row_mask = (out_rows < io.num_tokens) | WHOLE_BLOCKS

    acc = tl.zeros((BLOCK_ROWS, BLOCK_OUT), dtype=tl.float32)
    # The bias gradient's column sums of G, by the tensor cores: G^T times a column of ones
    # (the other 15 columns zeros, the narrowest product). A sum across the warps in the loop
    # (tl.sum) compiled to wrong results with a rank-one term at 8 warps and 2 stages on an
    # H200 (Triton 3.6; docs/notes/backward.md).
    bias_sums = tl.zeros((BLOCK_ROWS, 16), dtype=tl.float32)
    # Each listed tile is multiplied in STEPS slices along the summed dimension, in one flat
    # loop: shallower steps let the software pipeline keep more of them in flight.
    DEPTH: tl.constexpr = (BLOCK_TOKENS if TRANSPOSED else BLOCK_VOCAB) // STEPS
    for step in range(STEPS * list_start, STEPS * list_end):
        if STEPS == 1:
            position = step
            entries = tl.arange(0, DEPTH)
        else:
            position = step // STEPS
            entries = (step % STEPS) * DEPTH + tl.arange(0, DEPTH)
        other_block = tl.load(tiles.lists + out_block * tiles.list_stride + position)
        if TRANSPOSED:
            token_rows = other_block * BLOCK_TOKENS + entries
            token_mask = (token_rows < io.num_tokens) | WHOLE_BLOCKS
            segments = (first_slot + position).to(tl.int64) * BLOCK_TOKENS + entries
            offsets = segment_offsets(tiles.scratch, segments, tl.arange(0, BLOCK_VOCAB),
                                      token_mask, SEGMENTS_PER_PAGE, BLOCK_VOCAB)
            operand_a = tl.trans(tl.load(tiles.scratch.buffer + offsets,
                                         mask=token_mask[:, None], other=0.0))
            operand_b = tl.load(
                io.operand + token_rows.to(tl.int64)[:, None] * io.operand_strides[0]
                + out_dims[None, :] * io.operand_strides[1],
                mask=token_mask[:, None] & out_mask[None, :], other=0.0)
            if HAS_BIAS:
                ones = tl.where((tl.arange(0, 16)[None, :] == 0) & (entries[:, None] >= 0),
                                1.0, 0.0).to(operand_a.dtype)
                bias_sums = tile_dot(operand_a, ones, bias_sums, DOT_PRECISION)
        else:
            if SLOT_MAP:
                # Tiles kept whole in slots (the dC product's layout): look the slot up.
                slot = tl.load(tiles.slot_map + (tiles.first_block + out_block).to(tl.int64)
                               * tiles.chunk_vocab_blocks + other_block) - slot_base
                segments = (slot.to(tl.int64) * BLOCK_TOKENS
                            + tl.arange(0, BLOCK_TOKENS))
            else:
                segments = chunk_rows.to(tl.int64) * tiles.chunk_vocab_blocks + other_block
            offsets = segment_offsets(tiles.scratch, segments, entries, row_mask,
                                      SEGMENTS_PER_PAGE, BLOCK_VOCAB)
            operand_a = tl.load(tiles.scratch.buffer + offsets, mask=row_mask[:, None], other=0.0)
            vocab, vocab_mask = vocab_block_entries(
                io.vocab_order, other_block, entries, io.vocab_size, BLOCK_VOCAB, SORTED,
                WHOLE_BLOCKS)
            operand_b = tl.load(
                io.operand + vocab.to(tl.int64)[:, None] * io.operand_strides[0]
                + out_dims[None, :] * io.operand_strides[1],
                mask=vocab_mask[:, None] & out_mask[None, :], other=0.0)
        acc = tile_dot(operand_a, operand_b, acc, DOT_PRECISION)

    if correction.kept_mass is not None:
        if split == 0:
            # The filter dropped prob_scale * (1 - kept mass) of each row's gradient (the
            # targets' tiles are never dropped). 1 - kept mass in fixed point: exact.
            kept_mass = tl.load(correction.kept_mass + out_rows, mask=row_mask, other=0)
            dropped_mass = (kept_mass - KEPT_MASS_ONE).to(tl.float32) * -KEPT_MASS_UNIT
            prob_scale = tl.load(correction.prob_scale + out_rows, mask=row_mask, other=0.0)
            dropped = prob_scale * dropped_mass
            mean_row = tl.load(correction.mean_row + out_dims, mask=out_mask, other=0.0)
            acc += dropped[:, None] * mean_row[None, :]

    grad_bias = tl.sum(bias_sums, axis=1)  # adds the zero columns: exact
    if rank_one.column_vector is not None:
        if split == 0:
            if rank_one.row_factor is not None:
                factor = tl.load(rank_one.row_factor + out_rows, mask=row_mask, other=0.0)
            else:
                factor = row_mask.to(tl.float32)
            columns = tl.load(rank_one.column_vector + out_dims, mask=out_mask, other=0.0)
            acc += factor[:, None] * columns[None, :]
            if HAS_BIAS:
                grad_bias += factor * tl.load(rank_one.bias_factor)

    if SPLITS == 1:
        tl.store(io.out + out_rows.to(tl.int64)[:, None] * io.dim + out_dims[None, :],
                 round_to(acc, io.out.dtype.element_ty, DOT_PRECISION),
                 mask=row_mask[:, None] & out_mask[None, :])
    else:
        partial_rows = ((split * tiles.num_out_blocks + out_block) * BLOCK_ROWS
                        + tl.arange(0, BLOCK_ROWS))
        tl.store(io.partial + partial_rows.to(tl.int64)[:, None] * io.dim + out_dims[None, :],
                 acc, mask=out_mask[None, :])
    if HAS_BIAS:
        if out_chunk == 0:
            tl.store(io.grad_bias + out_rows,
                     round_to(grad_bias, io.grad_bias.dtype.element_ty, DOT_PRECISION),
                     mask=row_mask)


class Product(NamedTuple):
    """One product launch, as the backward's schedule gives it (:mod:`cce.backward.run`): the
    tiles of ``scratch`` times ``operand`` into ``out``, ``settings`` deciding how. Each output
    block (``out_blocks``) sums the tiles of its list: ``lists`` (int32, a row per output block)
    holds the other blocks, ``counts`` of them (:func:`cce.backward.tile_lists.build_tile_lists`).

    - dE (``transposed`` False): ``out[rows of out_blocks] = G @ operand`` (``operand`` = c) for
      a chunk of rows of the tile grid (``out_blocks``: token blocks), its tiles stored as whole
      rows of the grid, or in slots with ``slot_map`` (int32 (token blocks, vocabulary blocks),
      the slot of each stored tile); ``chunk_slots``: the slot map numbers every chunk's slots,
      this chunk's from ``first_slots[0]`` at the scratch's start. ``room``: free float32 memory
      for the partial sums of a split product. ``correction``: the filtered mass along the mean
      row of c.
    - dC (``transposed`` True): ``out[rows of out_blocks] = G^T @ operand`` (``operand`` = e;
      ``grad_bias`` too, when given) for a chunk of whole columns of the tile grid
      (``out_blocks``: vocabulary blocks), the k-th tile of block r's list in slot
      ``first_slots[r] + k``; ``chunk_slots``: counted from ``first_slots[0]`` at the scratch's
      start (pass 2), else over all blocks (``lists`` is then a slice of lists built for every
      block).

    ``rank_one``: added when given (:meth:`RankOneUpdate.for_embeddings`,
    :meth:`RankOneUpdate.for_classifier`); ``vocab_order``: the rows of c (dE's operand, dC's
    output) by vocabulary position."""

    transposed: bool
    scratch: Scratch
    out_blocks: range
    lists: torch.Tensor
    counts: torch.Tensor
    operand: torch.Tensor
    vocab_order: Optional[torch.Tensor]
    out: torch.Tensor
    settings: ProductSettings
    first_slots: Optional[torch.Tensor] = None
    chunk_slots: bool = False
    slot_map: Optional[torch.Tensor] = None
    room: Optional[torch.Tensor] = None
    grad_bias: Optional[torch.Tensor] = None
    correction: Optional[FilterCorrection] = None
    rank_one: Optional[RankOneUpdate] = None


def multiply(product: Product) -> None:
    """Launch ``product`` (:class:`Product`)."""
    scratch, settings, operand, out = (product.scratch, product.settings, product.operand,
                                       product.out)
    transposed, first_block, lists = product.transposed, product.out_blocks.start, product.lists
    grid, config, block_out, splits = (settings.grid, settings.config, settings.block_out,
                                       settings.splits)
    dim = operand.shape[1]
    num_out_blocks = lists.shape[0]
    num_tokens = out.shape[0] if not transposed else operand.shape[0]
    vocab_size = out.shape[0] if transposed else operand.shape[0]
    programs = num_out_blocks * cdiv(dim, block_out)
    rows = num_out_blocks * grid.block_tokens
    partial = None
    if splits > 1:
        # The partial sums go to the scratch's unused end where they fit.
        room = product.room
        if room is not None and splits * rows * dim <= room.numel():
            partial = room[:splits * rows * dim].view(splits, rows, dim)
        else:
            partial = torch.empty((splits, rows, dim), dtype=torch.float32, device=out.device)
    # dE's tiles are addressed by their grid column, of all the grid's.
    chunk_vocab_blocks = (len(product.out_blocks) if transposed
                          else cdiv(vocab_size, grid.block_vocab))
    tiles = ProductTiles(scratch=scratch.view, lists=lists, counts=product.counts,
                         list_stride=lists.stride(0), first_slots=product.first_slots,
                         slot_map=product.slot_map, chunk_vocab_blocks=chunk_vocab_blocks,
                         first_block=first_block, num_out_blocks=num_out_blocks)
    io = ProductIO(operand=operand, operand_strides=operand.stride(),
                   vocab_order=product.vocab_order, out=out, partial=partial,
                   grad_bias=product.grad_bias, num_tokens=num_tokens, vocab_size=vocab_size,
                   dim=dim)
    if settings.by_tma:
        # The plan chose a Hopper kernel where its usable() holds: no rank-one term or split;
        # dC's without a bias gradient, dE's through the one pass's slot map, with c's rows in
        # position order.
        assert partial is None and product.rank_one is None
        if transposed:
            assert product.grad_bias is None
            classifier_product.launch(tiles, io, settings, scratch.segments_per_page,
                                      product.chunk_slots)
        else:
            assert (product.slot_map is not None and not product.chunk_slots
                    and product.vocab_order is None)
            embeddings_product.launch(tiles, io, product.correction, settings,
                                      scratch.segments_per_page)
        return
    sparse_tile_matmul_kernel[(programs * splits,)](
        tiles, io, product.correction or FilterCorrection(None, None, None),
        product.rank_one or RankOneUpdate(None, None, None),
        TRANSPOSED=transposed, SPLITS=splits, CHUNK_SLOTS=product.chunk_slots,
        SEGMENTS_PER_PAGE=scratch.segments_per_page,
        BLOCK_TOKENS=grid.block_tokens, BLOCK_VOCAB=grid.block_vocab,
        BLOCK_OUT=block_out, DOT_PRECISION=settings.dot_precision,
        STEPS=grid.block_vocab // config.step_depth if settings.whole_blocks else 1,
        WHOLE_BLOCKS=settings.whole_blocks,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
    if partial is not None:
        first_row = first_block * grid.block_tokens
        valid_rows = min(rows, num_tokens - first_row)
        sum_partials(partial[:, :valid_rows], out[first_row:first_row + valid_rows],
                     settings.dot_precision)
