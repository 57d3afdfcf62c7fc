"""The dE product's loop written out in Gluon, against Triton's and cuBLAS (study, not used by cce).

Question: does a pipeline written by hand, with the gathered rows of c copied asynchronously
(cp.async) into a ring of shared-memory buffers, the index loads issued a step ahead of the
copies that need them, and asynchronous wgmma, bring the product near cuBLAS where Triton's
automatic pipelining does not (docs/notes/backward.md, "What bounds the products' loop")?

Same synthetic chunk as ``h100_de_product_study.py`` (random tiles, a random vocabulary order,
a fixed kept fraction of each token block's vocabulary blocks listed). One program owns 128
tokens x BLOCK_OUT columns of dE and walks its list in DEPTH-deep steps:

    step k:   wait for the copies of step k          (cp.async group)
              wgmma on buffer k % STAGES             (asynchronous)
              wait for the wgmma of step k - 1       (its buffer is free)
              copy step k + STAGES - 1 into it       (addresses loaded one step earlier)
              load the addresses of step k + STAGES

``python results/dev/h200_gluon_de_product.py --compile-only`` compiles for sm_90 without a GPU
and prints registers, spills and shared memory; without the flag it times every variant on
the GPU and writes ``$OUT/gluon_de_product.json``.
"""
import importlib.util
import json
import os
import statistics
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy as cp
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma,
                                                              warpgroup_mma, warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor


@gluon.jit
def gluon_de_product(scratch_ptr, lists_ptr, counts_ptr, c_ptr, order_ptr, out_ptr,
                     num_tokens, vocab_size, dim, chunk_vocab_blocks, list_stride,
                     BLOCK: gl.constexpr, BLOCK_OUT: gl.constexpr, DEPTH: gl.constexpr,
                     STAGES: gl.constexpr, num_warps: gl.constexpr):
    STEPS: gl.constexpr = BLOCK // DEPTH
    dtype: gl.constexpr = scratch_ptr.dtype.element_ty
    num_out_blocks = gl.cdiv(num_tokens, BLOCK)
    out_block = gl.program_id(0) % num_out_blocks
    out_chunk = gl.program_id(0) // num_out_blocks
    n_steps = gl.load(counts_ptr + out_block) * STEPS
    list_base = lists_ptr + out_block * list_stride

    # 16-byte copies: a row of the stored slice (DEPTH entries) is DEPTH / 8 threads, a row of c
    # (BLOCK_OUT entries) a whole warp.
    a_layout: gl.constexpr = gl.BlockedLayout([1, 8], [32 * 8 // DEPTH, DEPTH // 8],
                                              [num_warps, 1], [1, 0])
    b_layout: gl.constexpr = gl.BlockedLayout([1, 8], [32 * 8 // BLOCK_OUT, BLOCK_OUT // 8],
                                              [num_warps, 1], [1, 0])
    mma_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0],
                                                         warps_per_cta=[num_warps, 1],
                                                         instr_shape=[16, BLOCK_OUT, 16])
    a_shared: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK, DEPTH], dtype)
    b_shared: gl.constexpr = gl.NVMMASharedLayout.get_default_for([DEPTH, BLOCK_OUT], dtype)
    a_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK, DEPTH], a_shared)
    b_smem = gl.allocate_shared_memory(dtype, [STAGES, DEPTH, BLOCK_OUT], b_shared)

    tokens = out_block * BLOCK + gl.arange(0, BLOCK, layout=gl.SliceLayout(1, a_layout))
    a_cols = gl.arange(0, DEPTH, layout=gl.SliceLayout(0, a_layout))
    a_base = (scratch_ptr + (tokens.to(gl.int64) * chunk_vocab_blocks * BLOCK)[:, None]
              + a_cols[None, :])
    a_mask = (tokens < num_tokens)[:, None] & (a_cols < DEPTH)[None, :]
    b_rows = gl.arange(0, DEPTH, layout=gl.SliceLayout(1, b_layout))
    out_dims_b = out_chunk * BLOCK_OUT + gl.arange(0, BLOCK_OUT, layout=gl.SliceLayout(0, b_layout))
    out_mask_b = out_dims_b < dim

    # Prologue: the first STAGES - 1 steps' copies, then the addresses of step STAGES - 1.
    for s in gl.static_range(STAGES - 1):
        blk = gl.load(list_base + s // STEPS, mask=s < n_steps, other=0)
        first = blk * BLOCK + (s % STEPS) * DEPTH
        live = s < n_steps
        vmask = ((first + b_rows) < vocab_size) & live
        vocab = gl.load(order_ptr + first + b_rows, mask=vmask, other=0)
        cp.async_copy_global_to_shared(a_smem.index(s), a_base + first, mask=a_mask & live)
        cp.async_copy_global_to_shared(
            b_smem.index(s), c_ptr + vocab.to(gl.int64)[:, None] * dim + out_dims_b[None, :],
            mask=vmask[:, None] & out_mask_b[None, :])
        cp.commit_group()
    ahead = STAGES - 1
    blk_i = gl.load(list_base + ahead // STEPS, mask=ahead < n_steps, other=0)
    first_i = blk_i * BLOCK + (ahead % STEPS) * DEPTH
    vmask_i = ((first_i + b_rows) < vocab_size) & (ahead < n_steps)
    vocab_i = gl.load(order_ptr + first_i + b_rows, mask=vmask_i, other=0)
    blk_n = gl.load(list_base + (ahead + 1) // STEPS, mask=ahead + 1 < n_steps, other=0)

    acc = gl.zeros([BLOCK, BLOCK_OUT], gl.float32, layout=mma_layout)
    for k in range(n_steps):
        cp.wait_group(STAGES - 2)
        fence_async_shared()
        gl.thread_barrier()
        buf = k % STAGES
        acc = warpgroup_mma(a_smem.index(buf), b_smem.index(buf), acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc, ))
        gl.thread_barrier()
        # Step k - 1's buffer is free: copy step k + STAGES - 1 into it.
        j = k + STAGES - 1
        live = j < n_steps
        nbuf = j % STAGES
        cp.async_copy_global_to_shared(a_smem.index(nbuf), a_base + first_i, mask=a_mask & live)
        cp.async_copy_global_to_shared(
            b_smem.index(nbuf), c_ptr + vocab_i.to(gl.int64)[:, None] * dim + out_dims_b[None, :],
            mask=vmask_i[:, None] & out_mask_b[None, :])
        cp.commit_group()
        # The addresses of step j + 1, and the list entry of step j + 2.
        first_i = blk_n * BLOCK + ((j + 1) % STEPS) * DEPTH
        vmask_i = ((first_i + b_rows) < vocab_size) & (j + 1 < n_steps)
        vocab_i = gl.load(order_ptr + first_i + b_rows, mask=vmask_i, other=0)
        blk_n = gl.load(list_base + (j + 2) // STEPS, mask=j + 2 < n_steps, other=0)
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
    cp.wait_group(0)

    out_rows = out_block * BLOCK + gl.arange(0, BLOCK, layout=gl.SliceLayout(1, mma_layout))
    out_dims = out_chunk * BLOCK_OUT + gl.arange(0, BLOCK_OUT, layout=gl.SliceLayout(0, mma_layout))
    gl.store(out_ptr + out_rows.to(gl.int64)[:, None] * dim + out_dims[None, :],
             acc.to(out_ptr.dtype.element_ty),
             mask=(out_rows < num_tokens)[:, None] & (out_dims < dim)[None, :])


@gluon.jit
def _ws_consumer(a_smem, b_smem, ready, empty, n_steps, BLOCK: gl.constexpr,
                 BLOCK_OUT: gl.constexpr, STAGES: gl.constexpr, num_warps: gl.constexpr):
    """Two warp groups: wait for a stage, multiply, release the previous stage."""
    mma_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[8, 1],
                                                         instr_shape=[16, BLOCK_OUT, 16])
    acc = gl.zeros([BLOCK, BLOCK_OUT], gl.float32, layout=mma_layout)
    for k in range(n_steps):
        buf = k % STAGES
        mbarrier.wait(ready.index(buf), (k // STAGES) & 1)
        fence_async_shared()
        acc = warpgroup_mma(a_smem.index(buf), b_smem.index(buf), acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc, ))
        gl.thread_barrier()
        mbarrier.arrive(empty.index((k + STAGES - 1) % STAGES), pred=k > 0)
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
    return (acc, )


@gluon.jit
def _ws_producer(a_smem, b_smem, ready, empty, scratch_ptr, a_desc, b_desc, list_base, c_ptr,
                 order_ptr,
                 out_block, out_chunk, n_steps, num_tokens, vocab_size, dim, chunk_vocab_blocks,
                 BLOCK: gl.constexpr, BLOCK_OUT: gl.constexpr, DEPTH: gl.constexpr,
                 STAGES: gl.constexpr, A_TMA: gl.constexpr, B_TMA: gl.constexpr,
                 TILE_MAJOR: gl.constexpr):
    """Four warps: look up each step's rows and copy them into a free stage."""
    STEPS: gl.constexpr = BLOCK // DEPTH
    a_layout: gl.constexpr = gl.BlockedLayout([1, 8], [32 * 8 // DEPTH, DEPTH // 8], [4, 1],
                                              [1, 0])
    b_layout: gl.constexpr = gl.BlockedLayout([1, 8], [32 * 8 // BLOCK_OUT, BLOCK_OUT // 8],
                                              [4, 1], [1, 0])
    local_rows = gl.arange(0, BLOCK, layout=gl.SliceLayout(1, a_layout))
    tokens = out_block * BLOCK + local_rows
    a_cols = gl.arange(0, DEPTH, layout=gl.SliceLayout(0, a_layout))
    if TILE_MAJOR:
        # Each stored tile contiguous (BLOCK x BLOCK), a token block's tiles side by side.
        a_base = (scratch_ptr + out_block.to(gl.int64) * chunk_vocab_blocks * BLOCK * BLOCK
                  + (local_rows * BLOCK)[:, None] + a_cols[None, :])
        TILE_STRIDE: gl.constexpr = BLOCK * BLOCK
    else:
        a_base = (scratch_ptr + (tokens.to(gl.int64) * chunk_vocab_blocks * BLOCK)[:, None]
                  + a_cols[None, :])
        TILE_STRIDE: gl.constexpr = BLOCK
    a_mask = (tokens < num_tokens)[:, None] & (a_cols < DEPTH)[None, :]
    b_rows = gl.arange(0, DEPTH, layout=gl.SliceLayout(1, b_layout))
    out_dims = out_chunk * BLOCK_OUT + gl.arange(0, BLOCK_OUT, layout=gl.SliceLayout(0, b_layout))
    out_mask = out_dims < dim
    # Addresses one step ahead of the copies that use them, list entries two.
    blk = gl.load(list_base, mask=n_steps > 0, other=0)
    first = blk * BLOCK
    a_step = blk * TILE_STRIDE
    vmask = ((first + b_rows) < vocab_size) & (n_steps > 0)
    vocab = gl.load(order_ptr + first + b_rows, mask=vmask, other=0)
    blk_n = gl.load(list_base + 1 // STEPS, mask=n_steps > 1, other=0)
    for k in range(n_steps):
        buf = k % STAGES
        mbarrier.wait(empty.index(buf), ((k // STAGES) & 1) ^ 1)
        if A_TMA or B_TMA:
            mbarrier.expect(ready.index(buf), (A_TMA * BLOCK + B_TMA * BLOCK_OUT) * DEPTH * 2)
        if A_TMA:
            # The stored slice is a plain tile of the scratch: one bulk tensor copy.
            tma.async_copy_global_to_shared(a_desc, [out_block * BLOCK, first],
                                            ready.index(buf), a_smem.index(buf))
        else:
            cp.async_copy_global_to_shared(a_smem.index(buf), a_base + a_step, mask=a_mask)
        if B_TMA:
            # Only right for the identity order: the rows of c are then a plain tile.
            tma.async_copy_global_to_shared(b_desc, [first, out_chunk * BLOCK_OUT],
                                            ready.index(buf), b_smem.index(buf))
        else:
            cp.async_copy_global_to_shared(
                b_smem.index(buf), c_ptr + vocab.to(gl.int64)[:, None] * dim + out_dims[None, :],
                mask=vmask[:, None] & out_mask[None, :])
        if not (A_TMA and B_TMA):
            cp.mbarrier_arrive(ready.index(buf), increment_count=False)
        sub = ((k + 1) % STEPS) * DEPTH
        first = blk_n * BLOCK + sub
        a_step = blk_n * TILE_STRIDE + sub
        vmask = ((first + b_rows) < vocab_size) & (k + 1 < n_steps)
        vocab = gl.load(order_ptr + first + b_rows, mask=vmask, other=0)
        blk_n = gl.load(list_base + (k + 2) // STEPS, mask=k + 2 < n_steps, other=0)


@gluon.jit
def gluon_ws_de_product(scratch_ptr, a_desc, b_desc, lists_ptr, counts_ptr, c_ptr, order_ptr, out_ptr,
                        num_tokens, vocab_size, dim, chunk_vocab_blocks, list_stride,
                        BLOCK: gl.constexpr, BLOCK_OUT: gl.constexpr, DEPTH: gl.constexpr,
                        STAGES: gl.constexpr, A_TMA: gl.constexpr, B_TMA: gl.constexpr,
                        READY_COUNT: gl.constexpr, TILE_MAJOR: gl.constexpr,
                        num_warps: gl.constexpr):
    """The same product, warp-specialized: 4 producer warps, 8 consumer warps."""
    STEPS: gl.constexpr = BLOCK // DEPTH
    dtype: gl.constexpr = scratch_ptr.dtype.element_ty
    num_out_blocks = gl.cdiv(num_tokens, BLOCK)
    out_block = gl.program_id(0) % num_out_blocks
    out_chunk = gl.program_id(0) // num_out_blocks
    n_steps = gl.load(counts_ptr + out_block) * STEPS
    list_base = lists_ptr + out_block * list_stride
    a_shared: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK, DEPTH], dtype)
    b_shared: gl.constexpr = gl.NVMMASharedLayout.get_default_for([DEPTH, BLOCK_OUT], dtype)
    a_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK, DEPTH], a_shared)
    b_smem = gl.allocate_shared_memory(dtype, [STAGES, DEPTH, BLOCK_OUT], b_shared)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(ready.index(s), count=READY_COUNT)
        mbarrier.init(empty.index(s), count=1)
    acc, = gl.warp_specialize(
        [(_ws_consumer, (a_smem, b_smem, ready, empty, n_steps, BLOCK, BLOCK_OUT, STAGES,
                         num_warps)),
         (_ws_producer, (a_smem, b_smem, ready, empty, scratch_ptr, a_desc, b_desc, list_base,
                         c_ptr,
                         order_ptr, out_block, out_chunk, n_steps, num_tokens, vocab_size, dim,
                         chunk_vocab_blocks, BLOCK, BLOCK_OUT, DEPTH, STAGES, A_TMA, B_TMA,
                         TILE_MAJOR))],
        [4], [88])
    mma_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[8, 1],
                                                         instr_shape=[16, BLOCK_OUT, 16])
    out_rows = out_block * BLOCK + gl.arange(0, BLOCK, layout=gl.SliceLayout(1, mma_layout))
    out_dims = out_chunk * BLOCK_OUT + gl.arange(0, BLOCK_OUT, layout=gl.SliceLayout(0, mma_layout))
    gl.store(out_ptr + out_rows.to(gl.int64)[:, None] * dim + out_dims[None, :],
             acc.to(out_ptr.dtype.element_ty),
             mask=(out_rows < num_tokens)[:, None] & (out_dims < dim)[None, :])


@triton.jit
def tile_major_de_product(scratch_ptr, lists_ptr, counts_ptr, c_ptr, order_ptr, out_ptr,
                          num_tokens, vocab_size, dim, chunk_vocab_blocks, list_stride,
                          BLOCK: tl.constexpr, BLOCK_OUT: tl.constexpr):
    """cce's loop (128-deep steps, masks) over tiles stored tile by tile."""
    num_out_blocks = tl.cdiv(num_tokens, BLOCK)
    out_block = tl.program_id(0) % num_out_blocks
    out_chunk = tl.program_id(0) // num_out_blocks
    out_dims = out_chunk * BLOCK_OUT + tl.arange(0, BLOCK_OUT)
    out_mask = out_dims < dim
    count = tl.load(counts_ptr + out_block)
    ar = tl.arange(0, BLOCK)
    rows = out_block * BLOCK + ar
    row_mask = rows < num_tokens
    a_base = (scratch_ptr + out_block.to(tl.int64) * chunk_vocab_blocks * BLOCK * BLOCK
              + (ar * BLOCK)[:, None] + ar[None, :])
    list_base = lists_ptr + out_block * list_stride
    acc = tl.zeros((BLOCK, BLOCK_OUT), dtype=tl.float32)
    for position in range(0, count):
        blk = tl.load(list_base + position)
        positions = blk * BLOCK + ar
        vmask = positions < vocab_size
        vocab = tl.load(order_ptr + positions, mask=vmask, other=0)
        a = tl.load(a_base + blk.to(tl.int64) * BLOCK * BLOCK, mask=row_mask[:, None], other=0.0)
        b = tl.load(c_ptr + vocab.to(tl.int64)[:, None] * dim + out_dims[None, :],
                    mask=vmask[:, None] & out_mask[None, :], other=0.0)
        acc = tl.dot(a, b, acc)
    tl.store(out_ptr + rows.to(tl.int64)[:, None] * dim + out_dims[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & out_mask[None, :])


def run_tile_major_triton(scratch, lists, counts, c, order, out, n, block_out=256):
    v, d = c.shape
    grid = (triton.cdiv(n, 128) * triton.cdiv(d, block_out),)
    tile_major_de_product[grid](scratch, lists, counts, c, order, out, n, v, d,
                                triton.cdiv(v, 128), lists.stride(0), BLOCK=128,
                                BLOCK_OUT=block_out, num_warps=8, num_stages=2)


def run_gluon(scratch, lists, counts, c, order, out, n, depth, stages, block_out=256,
              num_warps=8, kernel="pipelined"):
    v, d = c.shape
    vb = triton.cdiv(v, 128)
    grid = (triton.cdiv(n, 128) * triton.cdiv(d, block_out),)
    args = (lists, counts, c, order, out, n, v, d, vb, lists.stride(0))
    consts = dict(BLOCK=128, BLOCK_OUT=block_out, DEPTH=depth, STAGES=stages,
                  num_warps=num_warps)
    if kernel == "pipelined":
        gluon_de_product[grid](scratch, *args, **consts)
        return
    a_desc = TensorDescriptor(scratch, [n, vb * 128], [vb * 128, 1], [128, depth],
                              gl.NVMMASharedLayout.get_default_for([128, depth], gl.bfloat16))
    b_desc = TensorDescriptor(c, [v, d], [d, 1], [depth, block_out],
                              gl.NVMMASharedLayout.get_default_for([depth, block_out],
                                                                   gl.bfloat16))
    a_tma = "stored tile by TMA" in kernel or "both by TMA" in kernel
    b_tma = "rows of c by TMA" in kernel or "both by TMA" in kernel
    gluon_ws_de_product[grid](scratch, a_desc, b_desc, *args, A_TMA=a_tma, B_TMA=b_tma,
                              READY_COUNT=(0 if a_tma and b_tma else 128) + (a_tma or b_tma),
                              TILE_MAJOR=kernel.endswith("tile-major"), **consts)


VARIANTS = (("pipelined", 64, 4), ("pipelined", 128, 2), ("warp-specialized", 64, 4),
            ("warp-specialized", 64, 3), ("warp-specialized, stored tile by TMA", 64, 4),
            ("warp-specialized, stored tile by TMA", 64, 3))
BEST = ("warp-specialized", 64, 3)
TILE_MAJOR_VARIANTS = (("warp-specialized, tile-major", 64, 3),
                       ("warp-specialized, tile-major", 64, 4))


def compile_only():
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    sig = {"scratch_ptr": "*bf16", "lists_ptr": "*i32", "counts_ptr": "*i32", "c_ptr": "*bf16",
           "order_ptr": "*i64", "out_ptr": "*bf16", "num_tokens": "i32", "vocab_size": "i32",
           "dim": "i32", "chunk_vocab_blocks": "i32", "list_stride": "i32"}
    for kernel, depth, stages in VARIANTS:
        if kernel != "pipelined":
            continue  # its tensor descriptor argument is built on a GPU
        consts = {"BLOCK": 128, "BLOCK_OUT": 256, "DEPTH": depth, "STAGES": stages,
                  "num_warps": 8}
        # As the launcher specializes them: 16-byte aligned pointers, dim a multiple of 16.
        aligned = {(i,): [["tt.divisibility", 16]] for i in (0, 1, 2, 3, 4, 5, 8, 9)}
        src = GluonASTSource(gluon_de_product, {**sig, **{k: "constexpr" for k in consts}},
                             consts, aligned)
        k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 8})
        sass_free = k.asm["ptx"]
        print(f"{kernel} depth {depth} stages {stages}: shared {k.metadata.shared} B, "
              f"wgmma {sass_free.count('wgmma.mma_async')}, cp.async "
              f"{sass_free.count('cp.async.cg') + sass_free.count('cp.async.ca')}, "
              f"bar {sass_free.count('bar.sync')}", flush=True)
        Path(f"/tmp/gluon_de_{kernel}_{depth}_{stages}.ptx").write_text(sass_free)


def ms(fn, n=20, w=3):
    for _ in range(w):
        fn()
    times = []
    for _ in range(n):
        a = torch.cuda.Event(enable_timing=True)
        b = torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def main():
    spec = importlib.util.spec_from_file_location(
        "study", Path(__file__).with_name("h100_de_product_study.py"))
    study = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(study)
    rows = [{"device": torch.cuda.get_device_name(), "torch": torch.__version__,
             "triton": triton.__version__}]
    for name, n, v, d, kept in (("llama", 4096, 128256, 4096, 0.45),
                                ("gemma2", 1024, 256000, 2304, 0.26),
                                ("phi", 2048, 32064, 3072, 0.87),
                                ("gemma3", 512, 262144, 640, 0.25)):
        scratch, c, random_order, flags, lists, counts = study.synthetic_chunk(n, v, d, kept)
        flop = 2 * counts.sum().item() * 128 * 128 * d
        # The vocabulary order as a random permutation (as the real order is, with respect to
        # memory), and as the identity (rows of c in memory order): what the gather costs.
        for order_name, order in (("random", random_order),
                                  ("identity", torch.arange(v, device="cuda"))):
            ref = torch.empty(n, d, device="cuda", dtype=torch.bfloat16)
            study.run(0, scratch, lists, counts, c, order, ref, n, 2)
            runs = {"triton 128-deep, 2 stages (cce)":
                    lambda out, order=order: study.run(0, scratch, lists, counts, c, order, out,
                                                       n, 2)}
            if v % 128 == 0 and d % 256 == 0:
                runs["triton 64-deep, no masks, 7 stages (cce whole blocks)"] = (
                    lambda out, order=order: study.run(5, scratch, lists, counts, c, order, out,
                                                       n, 7))
            for kernel, depth, stages in VARIANTS:
                if order_name == "identity" and (kernel, depth, stages) != BEST:
                    continue
                runs[f"gluon {kernel}, {depth}-deep, {stages} stages"] = (
                    lambda out, kernel=kernel, depth=depth, stages=stages, order=order:
                    run_gluon(scratch, lists, counts, c, order, out, n, depth, stages,
                              kernel=kernel))
            # The same tiles stored tile by tile (each 128 x 128 tile contiguous).
            tiled = scratch.view(n // 128, 128, -1, 128).permute(0, 2, 1, 3).contiguous()
            for kernel, depth, stages in TILE_MAJOR_VARIANTS:
                runs[f"gluon {kernel}, {depth}-deep, {stages} stages"] = (
                    lambda out, kernel=kernel, depth=depth, stages=stages, order=order,
                    tiled=tiled: run_gluon(tiled.view(-1), lists, counts, c, order, out, n,
                                           depth, stages, kernel=kernel))
            runs["triton 128-deep, 2 stages, tile-major"] = (
                lambda out, order=order, tiled=tiled:
                run_tile_major_triton(tiled.view(-1), lists, counts, c, order, out, n))
            for label, fn in runs.items():
                out = torch.full((n, d), float("nan"), device="cuda", dtype=torch.bfloat16)
                try:
                    fn(out)
                    torch.cuda.synchronize()
                    diff = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
                    t = ms(lambda: fn(out))
                    rows.append({"shape": name, "order": order_name, "variant": label, "ms": t,
                                 "tflops": flop / t / 1e9, "rel_diff_to_cce_loop": diff})
                except Exception as ex:  # a variant that does not compile is a result too
                    rows.append({"shape": name, "order": order_name, "variant": label,
                                 "error": str(ex)[:300]})
                print(rows[-1], flush=True)
        # Which lists: every token block walking the first block's list (so that the programs
        # of one output chunk read the same rows of c at the same time), or every block; with
        # every block and the identity order, the product is a plain matrix product, and both
        # operands can be copied as tiles (TMA).
        every_block = (torch.arange(lists.shape[1], device="cuda", dtype=torch.int32)
                       .expand_as(lists).contiguous(), torch.full_like(counts, lists.shape[1]))
        identity = torch.arange(v, device="cuda")
        for list_name, (same_lists, same_counts), order_name, order in (
                ("one list for every token block",
                 (lists[:1].expand_as(lists).contiguous(),
                  counts[:1].expand_as(counts).contiguous()), "random", random_order),
                ("every vocabulary block listed", every_block, "random", random_order),
                ("every vocabulary block listed", every_block, "identity", identity)):
            same_flop = 2 * same_counts.sum().item() * 128 * 128 * d
            ref = torch.empty(n, d, device="cuda", dtype=torch.bfloat16)
            study.run(0, scratch, same_lists, same_counts, c, order, ref, n, 2)
            kernels = ["warp-specialized"]
            if order_name == "identity":
                kernels += ["warp-specialized, stored tile by TMA",
                            "warp-specialized, rows of c by TMA", "warp-specialized, both by TMA"]
            runs = {"triton 128-deep, 2 stages (cce)":
                    lambda out, order=order: study.run(0, scratch, same_lists, same_counts, c,
                                                       order, out, n, 2)}
            for kernel in kernels:
                runs[f"gluon {kernel}, 64-deep, 3 stages"] = (
                    lambda out, kernel=kernel, order=order: run_gluon(
                        scratch, same_lists, same_counts, c, order, out, n, 64, 3,
                        kernel=kernel))
            for label, fn in runs.items():
                out = torch.full((n, d), float("nan"), device="cuda", dtype=torch.bfloat16)
                try:
                    fn(out)
                    torch.cuda.synchronize()
                    diff = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
                    t = ms(lambda: fn(out))
                    rows.append({"shape": name, "order": order_name, "lists": list_name,
                                 "variant": label, "ms": t, "tflops": same_flop / t / 1e9,
                                 "rel_diff_to_cce_loop": diff})
                except Exception as ex:
                    rows.append({"shape": name, "order": order_name, "lists": list_name,
                                 "variant": label, "error": str(ex)[:300]})
                print(rows[-1], flush=True)
        a = torch.randn(n, int(counts.float().mean().item()) * 128, device="cuda").bfloat16()
        bm = torch.randn(a.shape[1], d, device="cuda").bfloat16()
        t = ms(lambda: a @ bm)
        rows.append({"shape": name, "variant": "cuBLAS, same work", "ms": t,
                     "tflops": 2 * a.shape[0] * a.shape[1] * d / t / 1e9})
        print(rows[-1], flush=True)
        torch.cuda.empty_cache()
    json.dump(rows, open(os.environ.get("OUT", ".") + "/gluon_de_product.json", "w"), indent=1)


def profile_once():
    """One launch each of cce's loop, the warp-specialized loop and cuBLAS on the Llama chunk
    with every vocabulary block listed, for a profiler (``--profile``)."""
    spec = importlib.util.spec_from_file_location(
        "study", Path(__file__).with_name("h100_de_product_study.py"))
    study = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(study)
    n, v, d = 4096, 128256, 4096
    scratch, c, order, _, lists, counts = study.synthetic_chunk(n, v, d, 0.45)
    lists = torch.arange(lists.shape[1], device="cuda", dtype=torch.int32).expand_as(lists)
    lists, counts = lists.contiguous(), torch.full_like(counts, lists.shape[1])
    out = torch.empty(n, d, device="cuda", dtype=torch.bfloat16)
    for _ in range(2):  # compile outside the profiled launches
        study.run(0, scratch, lists, counts, c, order, out, n, 2)
        run_gluon(scratch, lists, counts, c, order, out, n, 64, 3, kernel="warp-specialized")
    a = torch.randn(n, lists.shape[1] * 128, device="cuda").bfloat16()
    bm = torch.randn(a.shape[1], d, device="cuda").bfloat16()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    study.run(0, scratch, lists, counts, c, order, out, n, 2)
    run_gluon(scratch, lists, counts, c, order, out, n, 64, 3, kernel="warp-specialized")
    torch.mm(a, bm)
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()


if __name__ == "__main__":
    if "--compile-only" in sys.argv:
        compile_only()
    elif "--profile" in sys.argv:
        profile_once()
    else:
        main()
