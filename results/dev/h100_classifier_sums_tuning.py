"""``c @ v`` and ``c.sum(0)`` from one read of ``c``: kernel layouts against two cuBLAS
matrix-vector products (study for ``cce/classifier_sums.py``).

Variants:
- "slices outer": each program walks its row blocks once per D slice (the first kernel:
  products added to the output slice after slice, column sums in registers);
- "rows outer": each program walks its row blocks once, each block's rows whole (D slices
  inner): products in registers, written once; the slice's column sums added to the program's
  float32 row of partials (zeroed first), read back by the same program at its next row block;
- "slice per program": programs = row chunks x D slices; each walks its chunk's row blocks in
  one slice, column sums in registers, written once; each row's product over the slice written
  to a (slices x V) float32 table; both tables added over their first axis afterwards.

``python results/dev/h100_classifier_sums_tuning.py`` writes ``$OUT/classifier_sums_tuning.json``.
"""
import json
import os
import statistics

import torch
import triton
import triton.language as tl


@triton.jit
def slices_outer(c_ptr, vector_ptr, dots_ptr, partial_ptr, num_rows, dim, blocks_per_program,
                 BLOCK_ROWS: tl.constexpr, BLOCK_DIM: tl.constexpr):
    program = tl.program_id(0)
    first_block = program * blocks_per_program
    for dim_start in range(0, dim, BLOCK_DIM):
        dims = dim_start + tl.arange(0, BLOCK_DIM)
        dim_mask = dims < dim
        vector = tl.load(vector_ptr + dims, mask=dim_mask, other=0.0).to(tl.float32)
        column_sum = tl.zeros((BLOCK_ROWS, BLOCK_DIM), dtype=tl.float32)
        for block in range(first_block, first_block + blocks_per_program):
            rows = block * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
            row_mask = rows < num_rows
            tile = tl.load(c_ptr + rows.to(tl.int64)[:, None] * dim + dims[None, :],
                           mask=row_mask[:, None] & dim_mask[None, :], other=0.0).to(tl.float32)
            column_sum += tile
            dot = tl.load(dots_ptr + rows, mask=row_mask & (dim_start > 0), other=0.0)
            dot += tl.sum(tile * vector[None, :], axis=1)
            tl.store(dots_ptr + rows, dot, mask=row_mask)
        tl.store(partial_ptr + program * dim + dims, tl.sum(column_sum, axis=0), mask=dim_mask)
        tl.debug_barrier()


@triton.jit
def rows_outer(c_ptr, vector_ptr, dots_ptr, partial_ptr, num_rows, dim, blocks_per_program,
               BLOCK_ROWS: tl.constexpr, BLOCK_DIM: tl.constexpr):
    program = tl.program_id(0)
    first_block = program * blocks_per_program
    partial = partial_ptr + program * dim
    for block in range(first_block, first_block + blocks_per_program):
        rows = block * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
        row_mask = rows < num_rows
        dot = tl.zeros((BLOCK_ROWS, ), dtype=tl.float32)
        for dim_start in range(0, dim, BLOCK_DIM):
            dims = dim_start + tl.arange(0, BLOCK_DIM)
            dim_mask = dims < dim
            vector = tl.load(vector_ptr + dims, mask=dim_mask, other=0.0).to(tl.float32)
            tile = tl.load(c_ptr + rows.to(tl.int64)[:, None] * dim + dims[None, :],
                           mask=row_mask[:, None] & dim_mask[None, :], other=0.0).to(tl.float32)
            dot += tl.sum(tile * vector[None, :], axis=1)
            column = tl.load(partial + dims, mask=dim_mask, other=0.0)
            tl.store(partial + dims, column + tl.sum(tile, axis=0), mask=dim_mask)
        tl.store(dots_ptr + rows, dot, mask=row_mask)
        # The next block's threads read the partials this block's threads wrote.
        tl.debug_barrier()


@triton.jit
def slice_per_program(c_ptr, vector_ptr, dots_ptr, partial_ptr, num_rows, dim, blocks_per_program,
                      BLOCK_ROWS: tl.constexpr, BLOCK_DIM: tl.constexpr):
    chunk = tl.program_id(0)
    dims = tl.program_id(1) * BLOCK_DIM + tl.arange(0, BLOCK_DIM)
    dim_mask = dims < dim
    vector = tl.load(vector_ptr + dims, mask=dim_mask, other=0.0).to(tl.float32)
    column_sum = tl.zeros((BLOCK_ROWS, BLOCK_DIM), dtype=tl.float32)
    for block in range(chunk * blocks_per_program, (chunk + 1) * blocks_per_program):
        rows = block * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
        row_mask = rows < num_rows
        tile = tl.load(c_ptr + rows.to(tl.int64)[:, None] * dim + dims[None, :],
                       mask=row_mask[:, None] & dim_mask[None, :], other=0.0).to(tl.float32)
        column_sum += tile
        tl.store(dots_ptr + tl.program_id(1).to(tl.int64) * num_rows + rows,
                 tl.sum(tile * vector[None, :], axis=1), mask=row_mask)
    tl.store(partial_ptr + chunk * dim + dims, tl.sum(column_sum, axis=0), mask=dim_mask)


def run_sliced(c, vector, block_rows, block_dim, programs_per_sm, num_warps, num_stages):
    v, d = c.shape
    sms = torch.cuda.get_device_properties(c.device).multi_processor_count
    slices = triton.cdiv(d, block_dim)
    num_blocks = triton.cdiv(v, block_rows)
    chunks = max(1, min(num_blocks, programs_per_sm * sms // slices))
    per_program = triton.cdiv(num_blocks, chunks)
    chunks = triton.cdiv(num_blocks, per_program)
    dots = torch.empty(slices, v, device=c.device, dtype=torch.float32)
    partial = torch.empty(chunks, d, device=c.device, dtype=torch.float32)
    slice_per_program[(chunks, slices)](c, vector, dots, partial, v, d, per_program,
                                        BLOCK_ROWS=block_rows, BLOCK_DIM=block_dim,
                                        num_warps=num_warps, num_stages=num_stages)
    return dots.sum(0), partial.sum(0)


def run(kernel, c, vector, block_rows, block_dim, programs_per_sm, num_warps, num_stages):
    if kernel is slice_per_program:
        return run_sliced(c, vector, block_rows, block_dim, programs_per_sm, num_warps,
                          num_stages)
    v, d = c.shape
    sms = torch.cuda.get_device_properties(c.device).multi_processor_count
    num_blocks = triton.cdiv(v, block_rows)
    per_program = triton.cdiv(num_blocks, min(programs_per_sm * sms, num_blocks))
    programs = triton.cdiv(num_blocks, per_program)
    dots = torch.empty(v, device=c.device, dtype=torch.float32)
    partial = (torch.zeros if kernel is rows_outer else torch.empty)(programs, d, device=c.device,
                                                                    dtype=torch.float32)
    kernel[(programs, )](c, vector, dots, partial, v, d, per_program, BLOCK_ROWS=block_rows,
                         BLOCK_DIM=block_dim, num_warps=num_warps, num_stages=num_stages)
    return dots, partial.sum(0)


def ms(fn, n=30, w=5):
    for _ in range(w):
        fn()
    times = []
    for _ in range(n):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


VARIANTS = [("slices outer", slices_outer, 64, 128, 2, 8, 2),
            ("rows outer", rows_outer, 64, 128, 2, 8, 3)]
for br, bd, per_sm, warps, stages in ((64, 128, 2, 8, 3), (64, 128, 4, 8, 3), (32, 256, 4, 8, 3),
                                      (64, 256, 2, 8, 3), (128, 128, 2, 8, 3), (32, 128, 8, 4, 4),
                                      (64, 128, 4, 4, 3), (64, 64, 8, 4, 4)):
    VARIANTS.append(("slice per program", slice_per_program, br, bd, per_sm, warps, stages))


def main():
    rows = [{"device": torch.cuda.get_device_name(), "torch": torch.__version__,
             "triton": triton.__version__}]
    g = torch.Generator(device="cuda").manual_seed(0)
    for name, v, d in (("gemma3", 262144, 640), ("gemma2_2b", 256000, 2304),
                       ("llama3_8b", 128256, 4096), ("phi3_5", 32064, 3072)):
        c = torch.randn(v, d, device="cuda", generator=g).bfloat16()
        vector = torch.randn(d, device="cuda", generator=g)
        ref_dots = c.double() @ vector.double()
        ref_sum = c.double().sum(0)
        gb = v * d * 2 / 1e9
        t = ms(lambda: (c @ vector.to(c.dtype), c.sum(0, dtype=torch.float32)))
        rows.append({"shape": name, "variant": "torch: c @ v, then c.sum(0)", "ms": t,
                     "read_tb_s": 2 * gb / t})
        print(rows[-1], flush=True)
        for label, kernel, br, bd, per_sm, warps, stages in VARIANTS:
            fn = lambda: run(kernel, c, vector, br, bd, per_sm, warps, stages)
            dots, col = fn()
            err_dots = ((dots.double() - ref_dots).norm() / ref_dots.norm()).item()
            err_sum = ((col.double() - ref_sum).norm() / ref_sum.norm()).item()
            same = torch.equal(dots, fn()[0])
            t = ms(fn)
            rows.append({"shape": name, "variant": label, "block_rows": br, "block_dim": bd,
                         "programs_per_sm": per_sm, "num_warps": warps, "num_stages": stages,
                         "ms": t, "read_tb_s": gb / t, "dots_rel_err": err_dots,
                         "row_sum_rel_err": err_sum, "repeatable": same})
            print(rows[-1], flush=True)
        torch.cuda.empty_cache()
    json.dump(rows, open(os.environ.get("OUT", ".") + "/classifier_sums_tuning.json", "w"),
              indent=1)


if __name__ == "__main__":
    main()
