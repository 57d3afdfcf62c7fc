"""The dE product with the gathered rows of c copied by TMA, one box per row (study, not used by cce).

Question: the dE product's loop reaches about 55% of cuBLAS because its rows of c, gathered
through the vocabulary order, come by cp.async; with every row copied by TMA (possible only for
the identity order, where they form a box) the same loop reached 86% (docs/notes/backward.md,
"What feeds the products"). Gluon rejects a [1, 64] box copied into one row of a 128-byte-swizzled
stage ("splitting along the swizzling pattern", ``sm90_row_tma_probe.py``), but it compiles when
the destination row is taken from an unswizzled view of the same stage: the descriptor keeps
its 128-byte swizzle, and the hardware swizzles by shared-memory address, so each row should
land where wgmma expects it. This script checks that (a gather into a stage, read back) and
times the product with each 64-deep step's 64 rows x 4 boxes copied by PARTS one-warp producers,
against the warp-specialized cp.async loop and cuBLAS on the same synthetic chunks as
``h200_gluon_de_product.py``.

``python results/dev/h100_row_tma_de_product.py`` writes ``$OUT/row_tma_de_product.json``
(committed as ``h100_row_tma_de_product.json``).

Result (H100, torch 2.11, Triton 3.6, 2026-11-26): neither holds.
- The rows do not land where wgmma expects them: the gather's read-back matches in 8 rows of 64,
  the rows 0, 8, 16, ...: the hardware swizzles each box by its own rows, not by the address.
- Slow even so: at the Llama chunk 18 (1 copying warp), 176-181 (2) and 134-135 TFLOP/s (4),
  against 347 for cp.async in the same loop and 760 for cuBLAS. 256 boxes of 128 bytes per
  64-deep step are more than the copy engine issues in the time of the step's products.
"""
import importlib.util
import json
import os
from pathlib import Path

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (mbarrier, tma,
                                                              warpgroup_mma, warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

HERE = Path(__file__).parent


def _load(name):
    spec = importlib.util.spec_from_file_location(name, HERE / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@gluon.jit
def _row_view(stage, ROWS: gl.constexpr, BLOCK_OUT: gl.constexpr):
    """The stage ([ROWS, BLOCK_OUT], 128-byte swizzle: BLOCK_OUT / 64 column blocks of ROWS x 128
    bytes) as unswizzled 128-byte rows, so that one row can be a TMA destination."""
    flat: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=16, rank=2)
    return stage._reinterpret(gl.bfloat16, [BLOCK_OUT // 64 * ROWS, 64], flat)


@gluon.jit
def gather_probe(c_desc, order_ptr, out_ptr, ROWS: gl.constexpr, BLOCK_OUT: gl.constexpr):
    """Rows order[0:ROWS] of c, columns [0, BLOCK_OUT), by one TMA box per row and 64 columns,
    read back through the swizzled layout."""
    layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([ROWS, BLOCK_OUT], gl.bfloat16)
    stage = gl.allocate_shared_memory(gl.bfloat16, [ROWS, BLOCK_OUT], layout)
    bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(bar, count=1)
    mbarrier.expect(bar, ROWS * BLOCK_OUT * 2)
    rows = _row_view(stage, ROWS, BLOCK_OUT)
    for r in gl.static_range(ROWS):
        row = gl.load(order_ptr + r).to(gl.int32)
        for j in gl.static_range(BLOCK_OUT // 64):
            tma.async_copy_global_to_shared(c_desc, [row, j * 64], bar,
                                            rows.slice(j * ROWS + r, 1, dim=0))
    mbarrier.wait(bar, 0)
    blocked: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    vals = stage.load(blocked)
    r_idx = gl.arange(0, ROWS, layout=gl.SliceLayout(1, blocked))
    c_idx = gl.arange(0, BLOCK_OUT, layout=gl.SliceLayout(0, blocked))
    gl.store(out_ptr + r_idx[:, None] * BLOCK_OUT + c_idx[None, :], vals)


@gluon.jit
def _consumer(a_smem, b_smem, ready, empty, n_steps, BLOCK: gl.constexpr,
              BLOCK_OUT: gl.constexpr, STAGES: gl.constexpr):
    mma_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[8, 1],
                                                         instr_shape=[16, BLOCK_OUT, 16])
    acc = gl.zeros([BLOCK, BLOCK_OUT], gl.float32, layout=mma_layout)
    for k in range(n_steps):
        buf = k % STAGES
        mbarrier.wait(ready.index(buf), (k // STAGES) & 1)
        acc = warpgroup_mma(a_smem.index(buf), b_smem.index(buf), acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc, ))
        mbarrier.arrive(empty.index((k + STAGES - 1) % STAGES), pred=k > 0)
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
    return (acc, )


@gluon.jit
def _producer(a_smem, b_smem, ready, empty, a_desc, c_desc, order_ptr, list_base, out_block,
              out_chunk, n_steps, vocab_size, PART: gl.constexpr, PARTS: gl.constexpr,
              BLOCK: gl.constexpr, BLOCK_OUT: gl.constexpr, DEPTH: gl.constexpr,
              STAGES: gl.constexpr):
    """One warp: its DEPTH / PARTS rows of c for every step, one box per row and 64 columns;
    part 0 also copies the stored tile's slice."""
    STEPS: gl.constexpr = BLOCK // DEPTH
    ROWS: gl.constexpr = DEPTH // PARTS
    A_BYTES: gl.constexpr = BLOCK * DEPTH * 2 if PART == 0 else 0
    for k in range(n_steps):
        blk = gl.load(list_base + k // STEPS)
        first = blk * BLOCK + (k % STEPS) * DEPTH
        rows = ()
        for r in gl.static_range(ROWS):
            pos = first + PART * ROWS + r
            # Past the vocabulary: a row out of c's bounds, which TMA fills with zeros.
            rows = rows + (gl.load(order_ptr + pos, mask=pos < vocab_size,
                                   other=vocab_size).to(gl.int32), )
        buf = k % STAGES
        mbarrier.wait(empty.index(buf), ((k // STAGES) & 1) ^ 1)
        mbarrier.expect(ready.index(buf), A_BYTES + ROWS * BLOCK_OUT * 2)
        if PART == 0:
            tma.async_copy_global_to_shared(a_desc, [out_block * BLOCK, first], ready.index(buf),
                                            a_smem.index(buf))
        dest = _row_view(b_smem.index(buf), DEPTH, BLOCK_OUT)
        for r in gl.static_range(ROWS):
            for j in gl.static_range(BLOCK_OUT // 64):
                tma.async_copy_global_to_shared(
                    c_desc, [rows[r], out_chunk * BLOCK_OUT + j * 64], ready.index(buf),
                    dest.slice(j * DEPTH + PART * ROWS + r, 1, dim=0))


@gluon.jit
def row_tma_de_product(a_desc, c_desc, lists_ptr, counts_ptr, order_ptr, out_ptr, num_tokens,
                       vocab_size, dim, list_stride, BLOCK: gl.constexpr,
                       BLOCK_OUT: gl.constexpr, DEPTH: gl.constexpr, STAGES: gl.constexpr,
                       PARTS: gl.constexpr, num_warps: gl.constexpr):
    """dE[128 tokens, BLOCK_OUT columns] = sum over the token block's list of stored tiles x rows
    of c; 8 multiplying warps, PARTS copying warps."""
    STEPS: gl.constexpr = BLOCK // DEPTH
    num_out_blocks = gl.cdiv(num_tokens, BLOCK)
    out_block = gl.program_id(0) % num_out_blocks
    out_chunk = gl.program_id(0) // num_out_blocks
    n_steps = gl.load(counts_ptr + out_block) * STEPS
    list_base = lists_ptr + out_block * list_stride
    a_shared: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK, DEPTH], gl.bfloat16)
    b_shared: gl.constexpr = gl.NVMMASharedLayout.get_default_for([DEPTH, BLOCK_OUT], gl.bfloat16)
    a_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK, DEPTH], a_shared)
    b_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES, DEPTH, BLOCK_OUT], b_shared)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(ready.index(s), count=PARTS)
        mbarrier.init(empty.index(s), count=1)
    if PARTS == 1:
        acc, = gl.warp_specialize(
            [(_consumer, (a_smem, b_smem, ready, empty, n_steps, BLOCK, BLOCK_OUT, STAGES)),
             (_producer, (a_smem, b_smem, ready, empty, a_desc, c_desc, order_ptr, list_base, out_block,
                          out_chunk, n_steps, vocab_size, 0, 1, BLOCK, BLOCK_OUT, DEPTH, STAGES))], [1], [96])
    elif PARTS == 2:
        acc, = gl.warp_specialize(
            [(_consumer, (a_smem, b_smem, ready, empty, n_steps, BLOCK, BLOCK_OUT, STAGES)),
             (_producer, (a_smem, b_smem, ready, empty, a_desc, c_desc, order_ptr, list_base, out_block,
                          out_chunk, n_steps, vocab_size, 0, 2, BLOCK, BLOCK_OUT, DEPTH, STAGES)),
             (_producer, (a_smem, b_smem, ready, empty, a_desc, c_desc, order_ptr, list_base, out_block,
                          out_chunk, n_steps, vocab_size, 1, 2, BLOCK, BLOCK_OUT, DEPTH, STAGES))], [1, 1], [96, 96])
    else:
        acc, = gl.warp_specialize(
            [(_consumer, (a_smem, b_smem, ready, empty, n_steps, BLOCK, BLOCK_OUT, STAGES)),
             (_producer, (a_smem, b_smem, ready, empty, a_desc, c_desc, order_ptr, list_base, out_block,
                          out_chunk, n_steps, vocab_size, 0, 4, BLOCK, BLOCK_OUT, DEPTH, STAGES)),
             (_producer, (a_smem, b_smem, ready, empty, a_desc, c_desc, order_ptr, list_base, out_block,
                          out_chunk, n_steps, vocab_size, 1, 4, BLOCK, BLOCK_OUT, DEPTH, STAGES)),
             (_producer, (a_smem, b_smem, ready, empty, a_desc, c_desc, order_ptr, list_base, out_block,
                          out_chunk, n_steps, vocab_size, 2, 4, BLOCK, BLOCK_OUT, DEPTH, STAGES)),
             (_producer, (a_smem, b_smem, ready, empty, a_desc, c_desc, order_ptr, list_base, out_block,
                          out_chunk, n_steps, vocab_size, 3, 4, BLOCK, BLOCK_OUT, DEPTH, STAGES))],
            [1, 1, 1, 1], [96, 96, 96, 96])
    mma_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[8, 1],
                                                         instr_shape=[16, BLOCK_OUT, 16])
    out_rows = out_block * BLOCK + gl.arange(0, BLOCK, layout=gl.SliceLayout(1, mma_layout))
    out_dims = out_chunk * BLOCK_OUT + gl.arange(0, BLOCK_OUT, layout=gl.SliceLayout(0, mma_layout))
    gl.store(out_ptr + out_rows.to(gl.int64)[:, None] * dim + out_dims[None, :],
             acc.to(out_ptr.dtype.element_ty),
             mask=(out_rows < num_tokens)[:, None] & (out_dims < dim)[None, :])


def row_descriptor(c):
    return TensorDescriptor(c, list(c.shape), [c.stride(0), 1], [1, 64],
                            gl.NVMMASharedLayout.get_default_for([1, 64], gl.bfloat16))


def run_row_tma(scratch, lists, counts, c, order, out, n, stages, parts, depth=64,
                block_out=256):
    v, d = c.shape
    vb = triton.cdiv(v, 128)
    a_desc = TensorDescriptor(scratch.view(n, vb * 128), [n, vb * 128], [vb * 128, 1],
                              [128, depth],
                              gl.NVMMASharedLayout.get_default_for([128, depth], gl.bfloat16))
    grid = (triton.cdiv(n, 128) * triton.cdiv(d, block_out),)
    row_tma_de_product[grid](a_desc, row_descriptor(c), lists, counts, order, out, n, v, d,
                             lists.stride(0), BLOCK=128, BLOCK_OUT=block_out, DEPTH=depth,
                             STAGES=stages, PARTS=parts, num_warps=8)


def check_gather():
    g = torch.Generator(device="cuda").manual_seed(1)
    c = torch.randn(5000, 384, device="cuda", generator=g).bfloat16()
    order = torch.randperm(5000, device="cuda", generator=g)[:64].contiguous()
    out = torch.empty(64, 256, device="cuda", dtype=torch.bfloat16)
    gather_probe[(1,)](row_descriptor(c), order, out, ROWS=64, BLOCK_OUT=256, num_warps=4)
    ref = c[order, :256]
    return {"check": "gather of 64 rows x 256 columns by per-row TMA",
            "bitwise_equal": bool(torch.equal(out, ref)),
            "rows_equal": int((out == ref).all(1).sum().item())}


def main():
    study = _load("h100_de_product_study")
    gluon_study = _load("h200_gluon_de_product")
    rows = [{"device": torch.cuda.get_device_name(), "torch": torch.__version__,
             "triton": triton.__version__}, check_gather()]
    print(rows, flush=True)
    for name, n, v, d, kept in (("llama", 4096, 128256, 4096, 0.45),
                                ("gemma2", 1024, 256000, 2304, 0.26),
                                ("phi", 2048, 32064, 3072, 0.87)):
        scratch, c, order, _, lists, counts = study.synthetic_chunk(n, v, d, kept)
        flop = 2 * counts.sum().item() * 128 * 128 * d
        ref = torch.empty(n, d, device="cuda", dtype=torch.bfloat16)
        study.run(0, scratch, lists, counts, c, order, ref, n, 2)
        runs = {"triton 128-deep, 2 stages (cce's loop)":
                lambda out: study.run(0, scratch, lists, counts, c, order, out, n, 2),
                "gluon warp-specialized, rows by cp.async, 64-deep, 3 stages":
                lambda out: gluon_study.run_gluon(scratch, lists, counts, c, order, out, n, 64, 3,
                                                  kernel="warp-specialized")}
        for stages in (3, 4):
            for parts in (1, 2, 4):
                runs[f"gluon rows by per-row TMA, {parts} copying warps, 64-deep, {stages} stages"] = (
                    lambda out, stages=stages, parts=parts: run_row_tma(
                        scratch, lists, counts, c, order, out, n, stages, parts))
        for label, fn in runs.items():
            out = torch.full((n, d), float("nan"), device="cuda", dtype=torch.bfloat16)
            try:
                fn(out)
                torch.cuda.synchronize()
                diff = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
                t = study.ms(lambda: fn(out))
                rows.append({"shape": name, "variant": label, "ms": t, "tflops": flop / t / 1e9,
                             "rel_diff_to_cce_loop": diff})
            except Exception as ex:  # a variant that fails is a result too
                rows.append({"shape": name, "variant": label, "error": str(ex)[:400]})
            print(rows[-1], flush=True)
        a = torch.randn(n, int(counts.float().mean().item()) * 128, device="cuda").bfloat16()
        bm = torch.randn(a.shape[1], d, device="cuda").bfloat16()
        t = study.ms(lambda: a @ bm)
        rows.append({"shape": name, "variant": "cuBLAS, same work", "ms": t,
                     "tflops": 2 * a.shape[0] * a.shape[1] * d / t / 1e9})
        print(rows[-1], flush=True)
        torch.cuda.empty_cache()
    json.dump(rows, open(os.environ.get("OUT", ".") + "/row_tma_de_product.json", "w"), indent=1)


if __name__ == "__main__":
    main()
