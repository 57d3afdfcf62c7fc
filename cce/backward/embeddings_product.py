"""Backward, the dE product on Hopper GPUs where ``c``'s rows lie in position order: ``dE = G C``
with the rows of c copied as tiles by the tensor memory accelerator (TMA), in a warp-specialized
Gluon kernel.

Same work and result as the one pass's dE product of
:func:`cce.backward.sparse_tile_matmul.multiply` (one program per block of 128 tokens and
BLOCK_OUT columns of dE, walking the list of the vocabulary blocks whose tiles are in its slots),
written out by hand, as :mod:`cce.backward.classifier_product` writes dC's:

    producer (4 warps), step k                 consumer (8 warps = 2 warp groups), step k
      wait until stage k % STAGES is free        wait until stage k % STAGES is full
      DEPTH positions of c's rows (one TMA copy) acc += tile @ rows of c   (wgmma, asynchronous)
      DEPTH entries of each token row of the     wait for step k - 1's wgmma
        stored tile (cp.async, by the slot map)  free stage (k - 1) % STAGES
      look up step k + 1's addresses

Why: the product is fed, not computed. The rows of c that a step multiplies are 512-byte
pieces of 128 rows; gathered through the vocabulary order by cp.async, the loop ran at 400-430
TFLOP/s at the Llama 3 8B shape, by TMA from rows in position order at 635 (cuBLAS 802; isolated
copies of the loop, ``results/dev/h200_gluon_de_product.json``, H200). TMA copies blocks of
consecutive rows only, so the kernel needs ``c`` in position order: ``c`` itself without
sorting, else a copy of it, which the forward makes and keeps only where the tiles are kept in
memory of their own (``keep_tiles``, ``memory="fast"``; :func:`reads_sorted_copy`): the copy is
as large as dC. The forward's tile products read it too.
"""

from __future__ import annotations

from typing import Optional

import torch

from cce.backward.classifier_product import available, copies_segments
from cce.backward.epilogue_terms import FilterCorrection
from cce.backward.gradient_tiles import KEPT_MASS_ONE, KEPT_MASS_UNIT
from cce.backward.product_arguments import ProductIO, ProductSettings, ProductTiles
from cce.config import KernelConfig, cdiv, tma_copies_rows

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy as cp
    from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma

    from cce.backward.classifier_product import (accumulator_layout, multiply_steps,
                                                 row_descriptor, segment_starts,
                                                 stage_barriers)
except ImportError:  # a Triton without Gluon: the Triton kernels run instead
    gluon = None

_PRODUCER_WARPS = 4
_PRODUCER_REGISTERS = 88


def usable(c: torch.Tensor, config: KernelConfig, has_rank_one: bool, splits: int,
           pages: Optional[torch.Tensor]) -> bool:
    """Whether this kernel can compute a one pass's dE product with ``c`` (the rows it will
    read, in position order), where ``config`` (its
    :attr:`cce.config.KernelConfigs.embeddings_product`) uses it: no rank-one term, one
    program per output block, rows of c and of the stored tiles (``pages``: the matrix whose
    rows hold them, None for a buffer of their own) in 16-byte pieces."""
    return (config.step_depth > 0 and available(c.device, c.dtype) and not has_rank_one
            and splits == 1 and tma_copies_rows(c) and copies_segments(pages))


def reads_sorted_copy(c: torch.Tensor, keep_tiles: bool, label_smoothing: float,
                      grad_c_follows: bool) -> bool:
    """Whether a sorting backward's one pass with ``keep_tiles`` would read a copy of ``c`` in
    position order, this kernel's operand, which the forward then makes and keeps for it
    (:mod:`cce.forward.plan`): where the backward computes dC (``grad_c_follows``; the one pass
    needs both gradients), on Hopper GPUs, for 16-bit ``c`` in rows of 16-byte pieces, without
    label smoothing (its rank-one term). Decided from the options, device, dtype and shape
    alone, as the ops' fake implementations must."""
    return (keep_tiles and grad_c_follows and not label_smoothing
            and available(c.device, c.dtype) and (c.shape[1] * c.element_size()) % 16 == 0)


if gluon is not None:

    @gluon.jit
    def _copy_steps(a_smem, b_smem, ready, empty, c_desc, scratch_ptr, pages_ptr, slot_row,
                    list_base, n_steps, first_token, out_chunk, num_tokens, page_stride,
                    SEGMENTS_PER_PAGE: gl.constexpr, IN_ORDER: gl.constexpr,
                    BLOCK: gl.constexpr, BLOCK_OUT: gl.constexpr, DEPTH: gl.constexpr,
                    STAGES: gl.constexpr):
        """The producer: each step's DEPTH positions of the stored tile's token rows and of c."""
        STEPS: gl.constexpr = BLOCK // DEPTH
        # [BLOCK token rows, DEPTH positions], 16 bytes per thread and copy.
        layout: gl.constexpr = gl.BlockedLayout([1, 8], [32 * 8 // DEPTH, DEPTH // 8],
                                                [gl.num_warps(), 1], [1, 0])
        rows = gl.arange(0, BLOCK, layout=gl.SliceLayout(1, layout))
        columns = gl.arange(0, DEPTH, layout=gl.SliceLayout(0, layout))
        # The tile's rows past the last token may hold anything: they come as zeros.
        token_mask = (first_token + rows) < num_tokens
        # Each tile's rows are looked up a step ahead of their first copy, its list entry a tile
        # ahead.
        vocab_block = gl.load(list_base, mask=n_steps > 0, other=0)
        slot = gl.load(slot_row + vocab_block, mask=n_steps > 0, other=0)
        starts = segment_starts(pages_ptr, slot.to(gl.int64) * BLOCK + rows, n_steps > 0,
                                page_stride, SEGMENTS_PER_PAGE, IN_ORDER, BLOCK)
        next_block = gl.load(list_base + 1, mask=n_steps > STEPS, other=0)
        for step in range(n_steps):
            stage = step % STAGES
            depth = (step % STEPS) * DEPTH
            mbarrier.wait(empty.index(stage), ((step // STAGES) & 1) ^ 1)
            mbarrier.expect(ready.index(stage), c_desc.block_type.nbytes)
            # Positions past the vocabulary's end come as zero rows of c.
            tma.async_copy_global_to_shared(c_desc, [vocab_block * BLOCK + depth,
                                                     out_chunk * BLOCK_OUT],
                                            ready.index(stage), b_smem.index(stage))
            cp.async_copy_global_to_shared(a_smem.index(stage),
                                           scratch_ptr + (starts + depth)[:, None]
                                           + columns[None, :],
                                           mask=token_mask[:, None])
            cp.mbarrier_arrive(ready.index(stage), increment_count=False)
            if (step + 1) % STEPS == 0:
                entry = (step + 1) // STEPS
                vocab_block = next_block
                slot = gl.load(slot_row + vocab_block, mask=step + 1 < n_steps, other=0)
                starts = segment_starts(pages_ptr, slot.to(gl.int64) * BLOCK + rows,
                                        step + 1 < n_steps, page_stride, SEGMENTS_PER_PAGE,
                                        IN_ORDER, BLOCK)
                next_block = gl.load(list_base + entry + 1, mask=(entry + 1) * STEPS < n_steps,
                                     other=0)

    @gluon.jit
    def embeddings_product_kernel(
        c_desc, tiles, io, correction,
        SEGMENTS_PER_PAGE: gl.constexpr, BLOCK: gl.constexpr, BLOCK_OUT: gl.constexpr,
        DEPTH: gl.constexpr, STAGES: gl.constexpr, PRODUCER_WARPS: gl.constexpr,
        PRODUCER_REGISTERS: gl.constexpr,
    ):
        # ``tiles``, ``io`` and ``correction`` as the Triton product takes them (its
        # ProductTiles, ProductIO, FilterCorrection); the rows of c in position order come
        # through c_desc. Which paths compile follows from which tensors are given.
        IN_ORDER: gl.constexpr = tiles.scratch.pages is None
        scratch_ptr = tiles.scratch.buffer
        dtype: gl.constexpr = scratch_ptr.dtype.element_ty
        # Output blocks vary fastest: the programs in flight read the same rows of c.
        out_block = gl.program_id(0) % tiles.num_out_blocks
        out_chunk = gl.program_id(0) // tiles.num_out_blocks
        token_block = tiles.first_block + out_block
        n_steps = gl.load(tiles.counts + out_block) * (BLOCK // DEPTH)
        list_base = tiles.lists + out_block * tiles.list_stride
        # The slot of the token block's tile in each vocabulary block.
        slot_row = tiles.slot_map + token_block.to(gl.int64) * tiles.chunk_vocab_blocks

        a_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK, DEPTH], dtype)
        a_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK, DEPTH], a_layout)
        b_smem = gl.allocate_shared_memory(dtype, [STAGES, DEPTH, BLOCK_OUT], c_desc.layout)
        ready, empty = stage_barriers(STAGES, PRODUCER_WARPS)

        acc, = gl.warp_specialize(
            [(multiply_steps, (a_smem, b_smem, ready, empty, n_steps, BLOCK, BLOCK_OUT, STAGES,
                               False)),
             (_copy_steps, (a_smem, b_smem, ready, empty, c_desc, scratch_ptr,
                            tiles.scratch.pages, slot_row, list_base, n_steps,
                            token_block * BLOCK, out_chunk, io.num_tokens,
                            tiles.scratch.page_stride, SEGMENTS_PER_PAGE, IN_ORDER, BLOCK,
                            BLOCK_OUT, DEPTH, STAGES))],
            [PRODUCER_WARPS], [PRODUCER_REGISTERS])

        mma_layout: gl.constexpr = accumulator_layout(gl.num_warps(), BLOCK_OUT)
        rows = token_block * BLOCK + gl.arange(0, BLOCK, layout=gl.SliceLayout(1, mma_layout))
        row_mask = rows < io.num_tokens
        out_dims = out_chunk * BLOCK_OUT + gl.arange(0, BLOCK_OUT,
                                                     layout=gl.SliceLayout(0, mma_layout))
        out_mask = out_dims < io.dim
        if correction.kept_mass is not None:
            # As the Triton product: the filter dropped prob_scale * (1 - kept mass) of each
            # row's gradient, added back along the mean row of c.
            kept_mass = gl.load(correction.kept_mass + rows, mask=row_mask, other=0)
            dropped_mass = (kept_mass - KEPT_MASS_ONE).to(gl.float32) * -KEPT_MASS_UNIT
            prob_scale = gl.load(correction.prob_scale + rows, mask=row_mask, other=0.0)
            dropped = prob_scale * dropped_mass
            mean_row = gl.load(correction.mean_row + out_dims, mask=out_mask, other=0.0)
            acc += dropped[:, None] * mean_row[None, :]
        gl.store(io.out + rows.to(gl.int64)[:, None] * io.dim + out_dims[None, :],
                 acc.to(io.out.dtype.element_ty), mask=row_mask[:, None] & out_mask[None, :])


def launch(tiles: ProductTiles, io: ProductIO, correction: Optional[FilterCorrection],
           settings: ProductSettings, segments_per_page: int) -> None:
    """The one pass's dE product of :func:`cce.backward.sparse_tile_matmul.multiply` (``io.operand``
    is c with its rows in position order, ``tiles.slot_map`` given; no rank-one term or split),
    where the plan chose this kernel (``settings.by_tma``, after :func:`usable`)."""
    config, block, block_out = settings.config, settings.grid.block_tokens, settings.block_out
    programs = tiles.num_out_blocks * cdiv(io.dim, block_out)
    embeddings_product_kernel[(programs,)](
        row_descriptor(io.operand, config.step_depth, block_out), tiles, io,
        correction or FilterCorrection(None, None, None),
        SEGMENTS_PER_PAGE=segments_per_page, BLOCK=block, BLOCK_OUT=block_out,
        DEPTH=config.step_depth, STAGES=config.num_stages, PRODUCER_WARPS=_PRODUCER_WARPS,
        PRODUCER_REGISTERS=_PRODUCER_REGISTERS, num_warps=config.num_warps,
    )
