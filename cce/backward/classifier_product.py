"""Backward, the dC product on Hopper GPUs: ``dC = G^T E`` with the rows of e copied as tiles by
the tensor memory accelerator (TMA), in a warp-specialized Gluon kernel.

Same work and result as the dC product of :func:`cce.backward.sparse_tile_matmul.multiply` (one
program per block of 128 vocabulary positions and BLOCK_OUT columns of dC, walking the list of the
token blocks whose tiles are stored in its slots), written out by hand:

    producer (4 warps), step k            consumer (8 warps = 2 warp groups), step k
      wait until stage k % STAGES is free   wait until stage k % STAGES is full
      DEPTH token rows of the stored tile   acc += tile^T @ rows of e     (wgmma, asynchronous)
        (cp.async, through the page table)  wait for step k - 1's wgmma
      DEPTH rows of e (one TMA copy)        free stage (k - 1) % STAGES
      look up step k + 1's addresses

Why: the products' steps are starved, not the tensor cores. In isolated copies of the dE loop
(``results/dev/h200_gluon_de_product.*``, H200) neither warp specialization, nor deeper
pipelines, nor TMA for the stored tiles, nor rows of c in memory order moved the loop much
(400-500 TFLOP/s at the Llama 3 8B shape); copying the operand whose rows are 512-byte
pieces by TMA instead of cp.async did (635-688 TFLOP/s, cuBLAS 802). In dE those rows are rows
of c through the vocabulary order, which TMA cannot gather on Hopper; in dC they are rows of e,
contiguous. The stored tiles still come by cp.async: their segments lie wherever the page table
says.

Used where :func:`usable` says so (16-bit inputs on a Hopper GPU with Triton 3.6, no bias
gradient or rank-one term, rows of e in 16-byte pieces); :mod:`cce.backward.sparse_tile_matmul` does
everything else. It pays at every benchmark shape and batch size measured, from N = 1024 and D =
640 up (``docs/notes/backward.md``, "What feeds the products").
"""

from __future__ import annotations

from typing import Optional

import torch
import triton

from cce.backward.product_arguments import ProductIO, ProductSettings, ProductTiles
from cce.config import KernelConfig, cdiv, interpreting, tma_copies_rows

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy as cp
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier,
                                                                  tma, warpgroup_mma,
                                                                  warpgroup_mma_wait)
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
except ImportError:  # a Triton without Gluon: the Triton kernels run instead
    gluon = None

# The Gluon API changes between Triton releases; this kernel is built and tested on 3.6.
_TRITON_VERSIONS = ("3.6.",)
_PRODUCER_WARPS = 4
_PRODUCER_REGISTERS = 88


def available(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether this kernel runs for inputs of ``dtype`` on ``device``: a Hopper GPU, Triton 3.6
    (not its interpreter) and 16-bit inputs."""
    return (gluon is not None and not interpreting()
            and triton.__version__.startswith(_TRITON_VERSIONS)
            and device.type == "cuda" and torch.cuda.get_device_capability(device)[0] == 9
            and dtype in (torch.bfloat16, torch.float16))


def usable(e: torch.Tensor, config: KernelConfig, grad_bias: Optional[torch.Tensor],
           has_rank_one: bool, pages: Optional[torch.Tensor]) -> bool:
    """Whether this kernel can compute the dC product of these operands, where ``config`` (its
    :attr:`cce.config.KernelConfigs.classifier_product`) uses it. ``pages``: the matrix whose
    rows hold the stored tiles (dC), None for buffers of their own (:func:`copies_segments`)."""
    return (config.step_depth > 0 and available(e.device, e.dtype) and grad_bias is None
            and not has_rank_one and tma_copies_rows(e) and copies_segments(pages))


def copies_segments(pages: Optional[torch.Tensor]) -> bool:
    """Whether cp.async can copy the stored tiles in 16-byte pieces: always from a buffer of
    their own (``pages`` None: fresh allocations of 128 entries), from the rows of ``pages``
    (dC) where they start and run 16-byte aligned."""
    return pages is None or (pages.data_ptr() % 16 == 0
                             and (pages.shape[1] * pages.element_size()) % 16 == 0)


if gluon is not None:

    @gluon.constexpr_function
    def accumulator_layout(num_warps, block_out):
        """The wgmma accumulator's register layout: the warp groups stacked along the rows."""
        return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                         instr_shape=[16, block_out, 16])

    @gluon.jit
    def segment_starts(pages_ptr, segments, mask, page_stride,
                       SEGMENTS_PER_PAGE: gl.constexpr, IN_ORDER: gl.constexpr,
                       BLOCK: gl.constexpr):
        """Where the given segments (int64) of a scratch start, in elements (the Gluon twin of
        :func:`cce.backward.scratch.segment_offsets`, a Triton function, which Gluon cannot
        call); ``mask``: the page lookups to make."""
        if IN_ORDER:
            starts = segments * BLOCK
        else:
            page = gl.load(pages_ptr + segments // SEGMENTS_PER_PAGE, mask=mask, other=0)
            starts = page.to(gl.int64) * page_stride + (segments % SEGMENTS_PER_PAGE) * BLOCK
        return starts

    @gluon.jit
    def _tile_row_starts(pages_ptr, first_slot, step, rows, n_steps, page_stride,
                         SEGMENTS_PER_PAGE: gl.constexpr, IN_ORDER: gl.constexpr,
                         BLOCK: gl.constexpr, DEPTH: gl.constexpr):
        """Where step ``step``'s DEPTH token rows of the stored tile start: its tile is in slot
        ``first_slot + step // STEPS``."""
        STEPS: gl.constexpr = BLOCK // DEPTH
        segments = ((first_slot + step // STEPS).to(gl.int64) * BLOCK + (step % STEPS) * DEPTH
                    + rows)
        return segment_starts(pages_ptr, segments, step < n_steps, page_stride,
                              SEGMENTS_PER_PAGE, IN_ORDER, BLOCK)

    @gluon.jit
    def _copy_steps(a_smem, b_smem, ready, empty, e_desc, scratch_ptr, pages_ptr, list_base,
                    first_slot, n_steps, out_chunk, num_tokens, page_stride,
                    SEGMENTS_PER_PAGE: gl.constexpr, IN_ORDER: gl.constexpr,
                    BLOCK: gl.constexpr, BLOCK_OUT: gl.constexpr, DEPTH: gl.constexpr,
                    STAGES: gl.constexpr):
        """The producer: each step's DEPTH token rows of the stored tile and of e."""
        STEPS: gl.constexpr = BLOCK // DEPTH
        # [DEPTH token rows, BLOCK positions], 16 bytes per thread and copy.
        layout: gl.constexpr = gl.BlockedLayout([1, 8], [32 * 8 // BLOCK, BLOCK // 8],
                                                [gl.num_warps(), 1], [1, 0])
        rows = gl.arange(0, DEPTH, layout=gl.SliceLayout(1, layout))
        columns = gl.arange(0, BLOCK, layout=gl.SliceLayout(0, layout))
        # Each step's addresses are looked up a step ahead, its list entry two.
        starts = _tile_row_starts(pages_ptr, first_slot, 0, rows, n_steps, page_stride,
                                  SEGMENTS_PER_PAGE, IN_ORDER, BLOCK, DEPTH)
        token_block = gl.load(list_base, mask=n_steps > 0, other=0)
        next_block = gl.load(list_base + 1 // STEPS, mask=n_steps > 1, other=0)
        for step in range(n_steps):
            stage = step % STAGES
            first_token = token_block * BLOCK + (step % STEPS) * DEPTH
            token_mask = (first_token + rows) < num_tokens
            mbarrier.wait(empty.index(stage), ((step // STAGES) & 1) ^ 1)
            mbarrier.expect(ready.index(stage), e_desc.block_type.nbytes)
            # Rows of e past the last token come as zeros; so do the tile's, which may hold
            # anything there.
            tma.async_copy_global_to_shared(e_desc, [first_token, out_chunk * BLOCK_OUT],
                                            ready.index(stage), b_smem.index(stage))
            cp.async_copy_global_to_shared(a_smem.index(stage),
                                           scratch_ptr + starts[:, None] + columns[None, :],
                                           mask=token_mask[:, None])
            cp.mbarrier_arrive(ready.index(stage), increment_count=False)
            starts = _tile_row_starts(pages_ptr, first_slot, step + 1, rows, n_steps,
                                      page_stride, SEGMENTS_PER_PAGE, IN_ORDER, BLOCK, DEPTH)
            token_block = next_block
            next_block = gl.load(list_base + (step + 2) // STEPS, mask=step + 2 < n_steps,
                                 other=0)

    @gluon.jit
    def stage_barriers(STAGES: gl.constexpr, PRODUCER_WARPS: gl.constexpr):
        """Each stage's barriers: ``ready`` once every producer thread's cp.async arrived and
        the TMA copy's bytes landed, ``empty`` once the consumer freed the stage."""
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for stage in gl.static_range(STAGES):
            mbarrier.init(ready.index(stage), count=PRODUCER_WARPS * 32 + 1)
            mbarrier.init(empty.index(stage), count=1)
        return ready, empty

    @gluon.jit
    def multiply_steps(a_smem, b_smem, ready, empty, n_steps, BLOCK: gl.constexpr,
                       BLOCK_OUT: gl.constexpr, STAGES: gl.constexpr, A_TRANSPOSED: gl.constexpr):
        """The consumer: two warp groups, 64 output rows each, accumulating in float32 the
        products of each stage's ``a`` (transposed where ``A_TRANSPOSED``) and ``b``."""
        acc = gl.zeros([BLOCK, BLOCK_OUT], gl.float32,
                       layout=accumulator_layout(gl.num_warps(), BLOCK_OUT))
        for step in range(n_steps):
            stage = step % STAGES
            mbarrier.wait(ready.index(stage), (step // STAGES) & 1)
            fence_async_shared()  # the cp.async writes, before the tensor cores read them
            a = a_smem.index(stage)
            if A_TRANSPOSED:
                a = a.permute((1, 0))
            acc = warpgroup_mma(a, b_smem.index(stage), acc, is_async=True)
            acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc, ))
            # Both warp groups are done with the previous stage: free it.
            gl.thread_barrier()
            mbarrier.arrive(empty.index((step + STAGES - 1) % STAGES), pred=step > 0)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
        return (acc, )

    @gluon.jit
    def classifier_product_kernel(
        e_desc, tiles, io,
        CHUNK_SLOTS: gl.constexpr, SEGMENTS_PER_PAGE: gl.constexpr, BLOCK: gl.constexpr,
        BLOCK_OUT: gl.constexpr, DEPTH: gl.constexpr, STAGES: gl.constexpr,
        PRODUCER_WARPS: gl.constexpr, PRODUCER_REGISTERS: gl.constexpr,
    ):
        # ``tiles`` and ``io`` as the Triton product takes them (its ProductTiles, ProductIO);
        # the rows of e (io.operand) come through e_desc. Which paths compile follows from
        # which tensors are given.
        SORTED: gl.constexpr = io.vocab_order is not None
        IN_ORDER: gl.constexpr = tiles.scratch.pages is None
        scratch_ptr = tiles.scratch.buffer
        dtype: gl.constexpr = scratch_ptr.dtype.element_ty
        # Output blocks vary fastest: the programs in flight read the same rows of e.
        out_block = gl.program_id(0) % tiles.num_out_blocks
        out_chunk = gl.program_id(0) // tiles.num_out_blocks
        n_steps = gl.load(tiles.counts + out_block) * (BLOCK // DEPTH)
        # The k-th listed tile is in slot first_slot + k (the chunk's lists are a slice).
        first_slot = gl.load(tiles.first_slots + out_block)
        if CHUNK_SLOTS:
            first_slot -= gl.load(tiles.first_slots)
        list_base = tiles.lists + out_block * tiles.list_stride

        a_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([DEPTH, BLOCK], dtype)
        a_smem = gl.allocate_shared_memory(dtype, [STAGES, DEPTH, BLOCK], a_layout)
        b_smem = gl.allocate_shared_memory(dtype, [STAGES, DEPTH, BLOCK_OUT], e_desc.layout)
        ready, empty = stage_barriers(STAGES, PRODUCER_WARPS)

        acc, = gl.warp_specialize(
            [(multiply_steps, (a_smem, b_smem, ready, empty, n_steps, BLOCK, BLOCK_OUT,
                               STAGES, True)),
             (_copy_steps, (a_smem, b_smem, ready, empty, e_desc, scratch_ptr,
                            tiles.scratch.pages, list_base, first_slot, n_steps, out_chunk,
                            io.num_tokens, tiles.scratch.page_stride, SEGMENTS_PER_PAGE,
                            IN_ORDER, BLOCK, BLOCK_OUT, DEPTH, STAGES))],
            [PRODUCER_WARPS], [PRODUCER_REGISTERS])

        mma_layout: gl.constexpr = accumulator_layout(gl.num_warps(), BLOCK_OUT)
        positions = ((tiles.first_block + out_block) * BLOCK
                     + gl.arange(0, BLOCK, layout=gl.SliceLayout(1, mma_layout)))
        row_mask = positions < io.vocab_size
        if SORTED:
            vocab = gl.load(io.vocab_order + positions, mask=row_mask, other=0)
        else:
            vocab = positions
        out_dims = out_chunk * BLOCK_OUT + gl.arange(0, BLOCK_OUT,
                                                     layout=gl.SliceLayout(0, mma_layout))
        gl.store(io.out + vocab.to(gl.int64)[:, None] * io.dim + out_dims[None, :],
                 acc.to(io.out.dtype.element_ty),
                 mask=row_mask[:, None] & (out_dims < io.dim)[None, :])


def row_descriptor(rows: torch.Tensor, depth: int, block_out: int) -> "TensorDescriptor":
    """The TMA descriptor by which a Hopper product's producer copies ``depth`` consecutive rows
    of its 16-bit operand (e for dC, c in position order for dE), ``block_out`` columns each."""
    layout = gl.NVMMASharedLayout.get_default_for(
        [depth, block_out], gl.bfloat16 if rows.dtype == torch.bfloat16 else gl.float16)
    return TensorDescriptor(rows, list(rows.shape), list(rows.stride()), [depth, block_out],
                            layout)


def launch(tiles: ProductTiles, io: ProductIO, settings: ProductSettings,
           segments_per_page: int, chunk_slots: bool) -> None:
    """The dC product of :func:`cce.backward.sparse_tile_matmul.multiply`'s launch groups
    (``io.operand`` is e; no bias gradient or rank-one term), where the plan chose this kernel
    (``settings.by_tma``, after :func:`usable`)."""
    config, block, block_out = settings.config, settings.grid.block_tokens, settings.block_out
    programs = tiles.num_out_blocks * cdiv(io.dim, block_out)
    classifier_product_kernel[(programs,)](
        row_descriptor(io.operand, config.step_depth, block_out), tiles, io,
        CHUNK_SLOTS=chunk_slots, SEGMENTS_PER_PAGE=segments_per_page, BLOCK=block,
        BLOCK_OUT=block_out, DEPTH=config.step_depth, STAGES=config.num_stages,
        PRODUCER_WARPS=_PRODUCER_WARPS, PRODUCER_REGISTERS=_PRODUCER_REGISTERS,
        num_warps=config.num_warps,
    )
