"""Backward, the one pass's dE product on Hopper GPUs: ``dE = G C`` over every stored tile, in a
warp-specialized Gluon kernel.

Same work and result as :func:`cce.sparse_tile_matmul.gradient_times_embeddings` reading the
one pass's slots (one program per block of 128 tokens and BLOCK_OUT columns of dE, walking the
list of the vocabulary blocks whose tiles are stored; a tile's slot comes from the slot map), in
the pipeline of :mod:`cce.hopper_pipeline`: each tile in two DEPTH-deep steps, for which the
producer copies the stored tile's DEPTH columns (cp.async, through the slot map and the page
table) and DEPTH rows of c (cp.async, through the vocabulary order), and the consumer adds
``tile @ rows of c``.

Why: in the one pass the Triton product's steps are the slowest of all products (3.2 us per 128
x 256 x 128 step on an H100, ``docs/notes/backward.md``): each waits on three dependent loads
(list entry, slot, page) before its copies. The producer here staggers them over the tiles
ahead, so that no lookup waits on another. The rows of c are still gathered by cp.async: Hopper's TMA copies boxes,
not rows picked through an order.

Used where :func:`usable` says so (16-bit inputs on a Hopper GPU with Triton 3.6, no rank-one
term, one program per output block); :mod:`cce.sparse_tile_matmul` does everything else.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import torch
import triton

from cce import hopper_pipeline
from cce.config import kernel_configs
from cce.scratch import Scratch

if TYPE_CHECKING:
    from cce.sparse_tile_matmul import MassCorrection

if hopper_pipeline.gluon is not None:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy as cp
    from triton.experimental.gluon.language.nvidia.hopper import mbarrier

    from cce.gradient_tiles import KEPT_MASS_ONE, KEPT_MASS_UNIT
    from cce.hopper_pipeline import accumulator_layout, multiply_steps, segment_starts


def available(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether this kernel runs for inputs of ``dtype`` on ``device``
    (:func:`cce.hopper_pipeline.available`, and a step depth configured)."""
    return (kernel_configs(dtype).embeddings_product.step_depth > 0
            and hopper_pipeline.available(device, dtype))


def usable(c: torch.Tensor, scratch: Scratch, has_rank_one: bool) -> bool:
    """Whether this kernel can compute the one pass's dE product of these operands."""
    return (available(c.device, c.dtype) and not has_rank_one and c.shape[1] % 8 == 0
            and hopper_pipeline.copyable(c) and hopper_pipeline.scratch_copyable(scratch))


if hopper_pipeline.gluon is not None:

    @gluon.jit
    def _tile_addresses(slot, vocab_block, valid, vocab_order_ptr, pages_ptr, local_rows, b_rows,
                        vocab_size, page_stride, SORTED: gl.constexpr, IN_ORDER: gl.constexpr,
                        SEGMENTS_PER_PAGE: gl.constexpr, BLOCK: gl.constexpr,
                        DEPTH: gl.constexpr):
        """Where a listed tile's operands are: the start of each of its token rows in the
        scratch, and the vocabulary entries (rows of c) of its two DEPTH-deep halves."""
        tile_starts = segment_starts(pages_ptr, slot.to(gl.int64) * BLOCK + local_rows, valid,
                                     page_stride, SEGMENTS_PER_PAGE, BLOCK, IN_ORDER)
        positions = vocab_block * BLOCK + b_rows
        first_mask = (positions < vocab_size) & valid
        second_mask = (positions + DEPTH < vocab_size) & valid
        if SORTED:
            first = gl.load(vocab_order_ptr + positions, mask=first_mask, other=0)
            second = gl.load(vocab_order_ptr + positions + DEPTH, mask=second_mask, other=0)
        else:
            first = positions
            second = positions + DEPTH
        return tile_starts, first, first_mask, second, second_mask

    @gluon.jit
    def _copy_steps(a_smem, b_smem, ready, empty, scratch_ptr, pages_ptr, slot_row, list_base,
                    c_ptr, vocab_order_ptr, n_tiles, out_block, out_chunk, num_tokens,
                    vocab_size, dim, c_row_stride, page_stride, SORTED: gl.constexpr,
                    IN_ORDER: gl.constexpr, SEGMENTS_PER_PAGE: gl.constexpr,
                    BLOCK: gl.constexpr, BLOCK_OUT: gl.constexpr, DEPTH: gl.constexpr,
                    STAGES: gl.constexpr):
        """The producer: each listed tile in two DEPTH-deep steps, its DEPTH columns of the
        stored tile and DEPTH rows of c each."""
        gl.static_assert(BLOCK == 2 * DEPTH, "two steps per tile")
        # 16 bytes per thread and copy: [BLOCK token rows, DEPTH positions] of the tile and
        # [DEPTH positions, BLOCK_OUT columns] of c.
        a_layout: gl.constexpr = gl.BlockedLayout([1, 8], [32 * 8 // DEPTH, DEPTH // 8],
                                                  [gl.num_warps(), 1], [1, 0])
        b_layout: gl.constexpr = gl.BlockedLayout([1, 8], [32 * 8 // BLOCK_OUT, BLOCK_OUT // 8],
                                                  [gl.num_warps(), 1], [1, 0])
        local_rows = gl.arange(0, BLOCK, layout=gl.SliceLayout(1, a_layout))
        token_mask = (out_block * BLOCK + local_rows) < num_tokens
        entries = gl.arange(0, DEPTH, layout=gl.SliceLayout(0, a_layout))
        b_rows = gl.arange(0, DEPTH, layout=gl.SliceLayout(1, b_layout))
        out_dims = out_chunk * BLOCK_OUT + gl.arange(0, BLOCK_OUT,
                                                     layout=gl.SliceLayout(0, b_layout))
        out_mask = out_dims < dim
        c_columns = c_ptr + out_dims[None, :]
        # The lookups are staggered so that none waits on another: a tile's rows one tile
        # ahead of its copies, its slot two, its list entry three.
        block = gl.load(list_base, mask=n_tiles > 0, other=0)
        slot = gl.load(slot_row + block, mask=n_tiles > 0, other=0)
        tile_starts, first, first_mask, second, second_mask = _tile_addresses(
            slot, block, n_tiles > 0, vocab_order_ptr, pages_ptr, local_rows, b_rows,
            vocab_size, page_stride, SORTED, IN_ORDER, SEGMENTS_PER_PAGE, BLOCK, DEPTH)
        next_block = gl.load(list_base + 1, mask=n_tiles > 1, other=0)
        next_slot = gl.load(slot_row + next_block, mask=n_tiles > 1, other=0)
        later_block = gl.load(list_base + 2, mask=n_tiles > 2, other=0)
        for tile in range(n_tiles):
            for half in gl.static_range(2):
                step = 2 * tile + half
                stage = step % STAGES
                mbarrier.wait(empty.index(stage), ((step // STAGES) & 1) ^ 1)
                # Tile rows past the last token come as zeros, and rows of c past the
                # vocabulary.
                cp.async_copy_global_to_shared(
                    a_smem.index(stage),
                    scratch_ptr + tile_starts[:, None] + (half * DEPTH + entries)[None, :],
                    mask=token_mask[:, None])
                if half == 0:
                    rows, rows_mask = first, first_mask
                else:
                    rows, rows_mask = second, second_mask
                cp.async_copy_global_to_shared(
                    b_smem.index(stage), c_columns + rows.to(gl.int64)[:, None] * c_row_stride,
                    mask=rows_mask[:, None] & out_mask[None, :])
                cp.mbarrier_arrive(ready.index(stage), increment_count=False)
            tile_starts, first, first_mask, second, second_mask = _tile_addresses(
                next_slot, next_block, tile + 1 < n_tiles, vocab_order_ptr, pages_ptr,
                local_rows, b_rows, vocab_size, page_stride, SORTED, IN_ORDER,
                SEGMENTS_PER_PAGE, BLOCK, DEPTH)
            next_block = later_block
            next_slot = gl.load(slot_row + later_block, mask=tile + 2 < n_tiles, other=0)
            later_block = gl.load(list_base + tile + 3, mask=tile + 3 < n_tiles, other=0)

    @gluon.jit
    def embeddings_product_kernel(
        scratch_ptr, pages_ptr, lists_ptr, counts_ptr, slot_map_ptr, c_ptr, vocab_order_ptr,
        out_ptr, classifier_mean_ptr, prob_scale_ptr, kept_mass_ptr,
        num_tokens, vocab_size, dim, c_row_stride, page_stride, num_out_blocks, num_vocab_blocks,
        list_stride,
        SORTED: gl.constexpr, MASS_CORRECTION: gl.constexpr, IN_ORDER: gl.constexpr,
        SEGMENTS_PER_PAGE: gl.constexpr, BLOCK: gl.constexpr, BLOCK_OUT: gl.constexpr,
        DEPTH: gl.constexpr, STAGES: gl.constexpr, PRODUCER_WARPS: gl.constexpr,
        PRODUCER_REGISTERS: gl.constexpr,
    ):
        dtype: gl.constexpr = scratch_ptr.dtype.element_ty
        # Output blocks vary fastest: the programs in flight read the same rows of c.
        out_block = gl.program_id(0) % num_out_blocks
        out_chunk = gl.program_id(0) // num_out_blocks
        n_tiles = gl.load(counts_ptr + out_block)
        n_steps = n_tiles * (BLOCK // DEPTH)
        list_base = lists_ptr + out_block * list_stride
        slot_row = slot_map_ptr + out_block.to(gl.int64) * num_vocab_blocks

        a_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK, DEPTH], dtype)
        b_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([DEPTH, BLOCK_OUT], dtype)
        a_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK, DEPTH], a_layout)
        b_smem = gl.allocate_shared_memory(dtype, [STAGES, DEPTH, BLOCK_OUT], b_layout)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for stage in gl.static_range(STAGES):
            # Each producer thread's cp.async arrival.
            mbarrier.init(ready.index(stage), count=PRODUCER_WARPS * 32)
            mbarrier.init(empty.index(stage), count=1)

        acc, = gl.warp_specialize(
            [(multiply_steps, (a_smem, b_smem, ready, empty, n_steps, BLOCK, BLOCK_OUT, STAGES,
                               False)),
             (_copy_steps, (a_smem, b_smem, ready, empty, scratch_ptr, pages_ptr, slot_row,
                            list_base, c_ptr, vocab_order_ptr, n_tiles, out_block, out_chunk,
                            num_tokens, vocab_size, dim, c_row_stride, page_stride, SORTED,
                            IN_ORDER,
                            SEGMENTS_PER_PAGE, BLOCK, BLOCK_OUT, DEPTH, STAGES))],
            [PRODUCER_WARPS], [PRODUCER_REGISTERS])

        mma_layout: gl.constexpr = accumulator_layout(gl.num_warps(), BLOCK_OUT)
        rows = out_block * BLOCK + gl.arange(0, BLOCK, layout=gl.SliceLayout(1, mma_layout))
        row_mask = rows < num_tokens
        out_dims = out_chunk * BLOCK_OUT + gl.arange(0, BLOCK_OUT,
                                                     layout=gl.SliceLayout(0, mma_layout))
        out_mask = out_dims < dim
        if MASS_CORRECTION:
            # What the filter dropped, along the mean row of c (cce.sparse_tile_matmul).
            kept_mass = gl.load(kept_mass_ptr + rows, mask=row_mask, other=0)
            dropped_mass = (kept_mass - KEPT_MASS_ONE).to(gl.float32) * -KEPT_MASS_UNIT
            prob_scale = gl.load(prob_scale_ptr + rows, mask=row_mask, other=0.0)
            dropped = prob_scale * dropped_mass
            classifier_mean = gl.load(classifier_mean_ptr + out_dims, mask=out_mask, other=0.0)
            acc += dropped[:, None] * classifier_mean[None, :]
        gl.store(out_ptr + rows.to(gl.int64)[:, None] * dim + out_dims[None, :],
                 acc.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & out_mask[None, :])


def gradient_times_embeddings_by_slots(scratch: Scratch, lists: torch.Tensor,
                                       counts: torch.Tensor, slot_map: torch.Tensor,
                                       c: torch.Tensor, vocab_order: Optional[torch.Tensor],
                                       grad_e: torch.Tensor,
                                       mass_correction: Optional["MassCorrection"],
                                       block_out: int) -> None:
    """The one pass's ``grad_e = G @ c`` (plus the filter's mass along the mean row of c when
    ``mass_correction``, a :class:`cce.sparse_tile_matmul.MassCorrection`, is given), every
    token block's list in one launch; the caller checked :func:`usable`."""
    configs = kernel_configs(c.dtype)
    config, block = configs.embeddings_product, configs.live_grid.block_tokens
    num_out_blocks = lists.shape[0]
    classifier_mean, prob_scale, kept_mass = mass_correction or (None, None, None)
    programs = num_out_blocks * triton.cdiv(c.shape[1], block_out)
    embeddings_product_kernel[(programs,)](
        scratch.buffer, scratch.pages, lists, counts, slot_map, c, vocab_order, grad_e,
        classifier_mean, prob_scale, kept_mass,
        grad_e.shape[0], c.shape[0], c.shape[1], c.stride(0), scratch.page_stride, num_out_blocks,
        slot_map.shape[1], lists.stride(0),
        SORTED=vocab_order is not None, MASS_CORRECTION=mass_correction is not None,
        IN_ORDER=scratch.in_order, SEGMENTS_PER_PAGE=scratch.segments_per_page, BLOCK=block,
        BLOCK_OUT=block_out, DEPTH=config.step_depth, STAGES=config.num_stages,
        PRODUCER_WARPS=hopper_pipeline.PRODUCER_WARPS,
        PRODUCER_REGISTERS=hopper_pipeline.PRODUCER_REGISTERS, num_warps=config.num_warps,
    )
