"""dE product loop variants against cce's (H100 study, synthetic chunk: random tiles, random
vocabulary order, lists at a fixed kept fraction; times by CUDA events, median of 20).

AHEAD=0: cce's loop (list entry and order loaded in the step that uses them, 128-deep steps).
AHEAD=1: vocabulary rows of every step precomputed (one level of indirection, as the forward's).
AHEAD=2: indices carried in registers 2-3 steps ahead (Triton then does not pipeline the loop).
AHEAD=3: 64-deep halves of each tile in one flat loop, rows precomputed.
AHEAD=4: 64-deep halves, list entry -> order -> rows, masks kept.
AHEAD=5: as 4 without masks (full blocks only).
h100_de_product_expanded.json ran VARIANTS = ((0, 2), (1, 2), (1, 3), (1, 4), (0, 2));
h100_de_product_halves.json the VARIANTS below.
"""
import json, os, statistics
import torch
import triton
import triton.language as tl


@triton.jit
def de_product(scratch_ptr, lists_ptr, counts_ptr, c_ptr, order_ptr, out_ptr, rows_ptr,
               num_tokens, vocab_size, dim, chunk_vocab_blocks, list_stride,
               BLOCK: tl.constexpr, BLOCK_OUT: tl.constexpr, AHEAD: tl.constexpr):
    num_out_blocks = tl.cdiv(num_tokens, BLOCK)
    out_block = tl.program_id(0) % num_out_blocks
    out_chunk = tl.program_id(0) // num_out_blocks
    out_dims = out_chunk * BLOCK_OUT + tl.arange(0, BLOCK_OUT)
    out_mask = out_dims < dim
    count = tl.load(counts_ptr + out_block)
    rows = out_block * BLOCK + tl.arange(0, BLOCK)
    row_mask = rows < num_tokens
    ar = tl.arange(0, BLOCK)
    list_base = lists_ptr + out_block * list_stride
    acc = tl.zeros((BLOCK, BLOCK_OUT), dtype=tl.float32)
    if AHEAD == 0:
        for position in range(0, count):
            blk = tl.load(list_base + position)
            positions = blk * BLOCK + ar
            vmask = positions < vocab_size
            vocab = tl.load(order_ptr + positions, mask=vmask, other=0)
            a = tl.load(scratch_ptr + (rows.to(tl.int64) * chunk_vocab_blocks + blk)[:, None] * BLOCK
                        + ar[None, :], mask=row_mask[:, None], other=0.0)
            b = tl.load(c_ptr + vocab.to(tl.int64)[:, None] * dim + out_dims[None, :],
                        mask=vmask[:, None] & out_mask[None, :], other=0.0)
            acc = tl.dot(a, b, acc)
    elif AHEAD == 1:
        # expanded: vocab rows of every step precomputed (lists_ptr -> rows_ptr), list entry
        # loaded as a broadcast vector: one level of indirection, as in the forward.
        for position in range(0, count):
            blk = tl.load(list_base + position + tl.zeros([BLOCK], dtype=tl.int32))
            step = (out_block * list_stride + position).to(tl.int64) * BLOCK
            vocab = tl.load(rows_ptr + step + ar)
            vmask = vocab >= 0
            a = tl.load(scratch_ptr + (rows.to(tl.int64) * chunk_vocab_blocks + blk)[:, None] * BLOCK
                        + ar[None, :], mask=row_mask[:, None], other=0.0)
            b = tl.load(c_ptr + vocab.to(tl.int64)[:, None] * dim + out_dims[None, :],
                        mask=vmask[:, None] & out_mask[None, :], other=0.0)
            acc = tl.dot(a, b, acc)
    elif AHEAD == 3:
        # 64-deep halves of each listed tile, one flat loop; vocab rows expanded (one level).
        HALF: tl.constexpr = BLOCK // 2
        ah = tl.arange(0, HALF)
        for step in range(0, 2 * count):
            position = step // 2
            half = step % 2
            blk = tl.load(list_base + position + tl.zeros([BLOCK], dtype=tl.int32))
            first = (out_block * list_stride + position).to(tl.int64) * BLOCK + half * HALF
            vocab = tl.load(rows_ptr + first + ah)
            vmask = vocab >= 0
            a = tl.load(scratch_ptr + ((rows.to(tl.int64) * chunk_vocab_blocks + blk) * BLOCK
                                       + half * HALF)[:, None] + ah[None, :],
                        mask=row_mask[:, None], other=0.0)
            b = tl.load(c_ptr + vocab.to(tl.int64)[:, None] * dim + out_dims[None, :],
                        mask=vmask[:, None] & out_mask[None, :], other=0.0)
            acc = tl.dot(a, b, acc)
    elif AHEAD == 4:
        # 64-deep halves, list entry -> order -> rows (two levels), one flat loop.
        HALF: tl.constexpr = BLOCK // 2
        ah = tl.arange(0, HALF)
        for step in range(0, 2 * count):
            position = step // 2
            half = step % 2
            blk = tl.load(list_base + position)
            positions = blk * BLOCK + half * HALF + ah
            vmask = positions < vocab_size
            vocab = tl.load(order_ptr + positions, mask=vmask, other=0)
            a = tl.load(scratch_ptr + ((rows.to(tl.int64) * chunk_vocab_blocks + blk) * BLOCK
                                       + half * HALF)[:, None] + ah[None, :],
                        mask=row_mask[:, None], other=0.0)
            b = tl.load(c_ptr + vocab.to(tl.int64)[:, None] * dim + out_dims[None, :],
                        mask=vmask[:, None] & out_mask[None, :], other=0.0)
            acc = tl.dot(a, b, acc)
    elif AHEAD == 5:
        # as 4, without masks (full blocks, no vocabulary padding): the per-step overhead
        HALF: tl.constexpr = BLOCK // 2
        ah = tl.arange(0, HALF)
        a_rows = scratch_ptr + rows.to(tl.int64) * chunk_vocab_blocks * BLOCK
        b_cols = c_ptr + out_dims
        for step in range(0, 2 * count):
            position = step // 2
            half = step % 2
            blk = tl.load(list_base + position)
            vocab = tl.load(order_ptr + blk * BLOCK + half * HALF + ah)
            a = tl.load(a_rows[:, None] + (blk * BLOCK + half * HALF + ah)[None, :])
            b = tl.load(b_cols[None, :] + (vocab * dim)[:, None])
            acc = tl.dot(a, b, acc)
    else:
        blk0 = tl.load(list_base, mask=count > 0, other=0)
        blk1 = tl.load(list_base + 1, mask=count > 1, other=0)
        blk2 = tl.load(list_base + 2, mask=count > 2, other=0)
        vocab0 = tl.load(order_ptr + blk0 * BLOCK + ar, mask=blk0 * BLOCK + ar < vocab_size, other=0)
        vocab1 = tl.load(order_ptr + blk1 * BLOCK + ar, mask=blk1 * BLOCK + ar < vocab_size, other=0)
        for position in range(0, count):
            blk3 = tl.load(list_base + position + 3, mask=position + 3 < count, other=0)
            vocab2 = tl.load(order_ptr + blk2 * BLOCK + ar, mask=blk2 * BLOCK + ar < vocab_size,
                             other=0)
            vmask = blk0 * BLOCK + ar < vocab_size
            a = tl.load(scratch_ptr + (rows.to(tl.int64) * chunk_vocab_blocks + blk0)[:, None] * BLOCK
                        + ar[None, :], mask=row_mask[:, None], other=0.0)
            b = tl.load(c_ptr + vocab0.to(tl.int64)[:, None] * dim + out_dims[None, :],
                        mask=vmask[:, None] & out_mask[None, :], other=0.0)
            acc = tl.dot(a, b, acc)
            blk0, blk1, blk2 = blk1, blk2, blk3
            vocab0, vocab1 = vocab1, vocab2
    tl.store(out_ptr + rows.to(tl.int64)[:, None] * dim + out_dims[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & out_mask[None, :])


def run(ahead, scratch, lists, counts, c, order, out, n, stages, rows=None, block_out=256):
    v, d = c.shape
    grid = (triton.cdiv(n, 128) * triton.cdiv(d, block_out),)
    de_product[grid](scratch, lists, counts, c, order, out, rows, n, v, d, triton.cdiv(v, 128),
                     lists.stride(0), BLOCK=128, BLOCK_OUT=block_out, AHEAD=ahead,
                     num_warps=8, num_stages=stages)


def ms(fn, n=20, w=3):
    for _ in range(w):
        fn()
    out = []
    for _ in range(n):
        a = torch.cuda.Event(enable_timing=True); b = torch.cuda.Event(enable_timing=True)
        a.record(); fn(); b.record(); b.synchronize(); out.append(a.elapsed_time(b))
    return statistics.median(out)


def synthetic_chunk(n, v, d, kept):
    """One chunk's operands: scratch tiles, classifier, a random vocabulary order, and each
    token block's list of kept vocabulary blocks (a random ``kept`` fraction), seed 0."""
    g = torch.Generator(device="cuda").manual_seed(0)
    vb, tb = triton.cdiv(v, 128), triton.cdiv(n, 128)
    scratch = torch.randn(n * vb * 128, device="cuda", generator=g).to(torch.bfloat16)
    c = torch.randn(v, d, device="cuda", generator=g).to(torch.bfloat16)
    order = torch.randperm(v, device="cuda", generator=g)
    flags = torch.rand(tb, vb, device="cuda", generator=g) < kept
    counts = flags.sum(1).int()
    lists = torch.zeros(tb, vb, dtype=torch.int32, device="cuda")
    for i in range(tb):
        idx = flags[i].nonzero().flatten().int()
        lists[i, :idx.numel()] = idx
    return scratch, c, order, flags, lists, counts


VARIANTS = ((0, 2), (3, 3), (3, 5), (3, 7), (4, 4), (4, 7), (4, 10), (0, 2))
if __name__ == "__main__":
    rows = []
    for name, n, v, d, kept in (("llama", 4096, 128256, 4096, 0.45), ("gemma2", 1024, 256000, 2304, 0.26),
                                ("phi", 2048, 32064, 3072, 0.87), ("gemma3", 512, 262144, 640, 0.25)):
        scratch, c, order, flags, lists, counts = synthetic_chunk(n, v, d, kept)
        vb = triton.cdiv(v, 128)
        # expanded vocab rows per listed step: order[list * 128 + ar], -1 past the vocabulary
        pos = lists.long()[:, :, None] * 128 + torch.arange(128, device="cuda")
        padded = torch.cat([order, order.new_full((vb * 128 - v,), -1)])
        step_rows = padded[pos].int().contiguous()
        outs = {}
        for ahead, stages in VARIANTS:
            out = torch.empty(n, d, device="cuda", dtype=torch.bfloat16)
            try:
                run(ahead, scratch, lists, counts, c, order, out, n, stages, step_rows)
                t = ms(lambda: run(ahead, scratch, lists, counts, c, order, out, n, stages, step_rows))
            except Exception as ex:
                rows.append({"shape": name, "ahead": ahead, "stages": stages, "error": str(ex)[:200]})
                print(rows[-1], flush=True)
                continue
            outs[(ahead, stages)] = out
            flop = 2 * counts.sum().item() * 128 * 128 * d
            rows.append({"shape": name, "ahead": ahead, "stages": stages, "ms": t,
                         "tflops": flop / t / 1e9,
                         "equal_to_ahead0": bool(torch.equal(out, outs.get((0, 2), out)))})
            print(rows[-1], flush=True)
        # the same work as one cuBLAS GEMM of the kept fraction
        a = torch.randn(n, int(counts.float().mean().item()) * 128, device="cuda").bfloat16()
        bm = torch.randn(a.shape[1], d, device="cuda").bfloat16()
        rows.append({"shape": name, "cublas_ms_same_work": ms(lambda: a @ bm)})
        print(rows[-1], flush=True)
        # reference check of ahead=0 on 64 rows in float64
        r = slice(0, 64)
        dense = torch.zeros(64, vb * 128, dtype=torch.float64, device="cuda")
        s2 = scratch.view(n, vb, 128)[r].double()
        for rr in range(64):
            f = flags[rr // 128].double()
            dense[rr] = (s2[rr] * f[:, None]).flatten()
        cs = torch.zeros(vb * 128, d, dtype=torch.float64, device="cuda")
        cs[:v] = c[order].double()
        ref = dense @ cs
        err = ((outs[(0, 2)][r].double() - ref).norm() / ref.norm()).item()
        rows.append({"shape": name, "ahead0_rel_err_vs_float64": err})
        print(rows[-1], flush=True)
        del scratch, c, order, flags, lists
        torch.cuda.empty_cache()
    json.dump(rows, open(os.environ.get("OUT", ".") + "/de_prefetch.json", "w"), indent=1)
