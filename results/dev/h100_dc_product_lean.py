"""dC product loop (tiles in slots, in order): cce's 128-deep step against 64-deep halves in one
flat loop with 3 buffers and no masks (H100 study)."""
import json, os, sys
import torch, triton
import triton.language as tl
sys.path.insert(0, os.path.dirname(__file__))
from h100_de_product_study import ms


@triton.jit
def dc_product(slots_ptr, lists_ptr, counts_ptr, first_slots_ptr, e_ptr, out_ptr, dim, list_stride,
               num_out_blocks, BLOCK: tl.constexpr, BLOCK_OUT: tl.constexpr, LEAN: tl.constexpr):
    out_block = tl.program_id(0) % num_out_blocks
    out_chunk = tl.program_id(0) // num_out_blocks
    out_dims = out_chunk * BLOCK_OUT + tl.arange(0, BLOCK_OUT)
    count = tl.load(counts_ptr + out_block)
    first_slot = tl.load(first_slots_ptr + out_block)
    ar = tl.arange(0, BLOCK)
    acc = tl.zeros((BLOCK, BLOCK_OUT), dtype=tl.float32)
    list_base = lists_ptr + out_block * list_stride
    if LEAN == 0:
        for position in range(0, count):
            blk = tl.load(list_base + position)
            token_rows = blk * BLOCK + ar
            seg = (first_slot + position).to(tl.int64) * BLOCK + ar
            a = tl.trans(tl.load(slots_ptr + seg[:, None] * BLOCK + ar[None, :]))
            b = tl.load(e_ptr + token_rows.to(tl.int64)[:, None] * dim + out_dims[None, :])
            acc = tl.dot(a, b, acc)
    else:
        HALF: tl.constexpr = BLOCK // 2
        ah = tl.arange(0, HALF)
        b_cols = e_ptr + out_dims
        for step in range(0, 2 * count):
            position = step // 2
            half = step % 2
            blk = tl.load(list_base + position)
            tokens = blk * BLOCK + half * HALF + ah
            seg = (first_slot + position).to(tl.int64) * BLOCK + half * HALF + ah
            a = tl.trans(tl.load(slots_ptr + seg[:, None] * BLOCK + ar[None, :]))
            b = tl.load(b_cols[None, :] + (tokens.to(tl.int64) * dim)[:, None])
            acc = tl.dot(a, b, acc)
    tl.store(out_ptr + (out_block * BLOCK + ar).to(tl.int64)[:, None] * dim + out_dims[None, :],
             acc.to(out_ptr.dtype.element_ty))


rows = []
for name, n, v, d, kept in (("llama", 8192, 128256, 4096, 0.45), ("phi", 8192, 32064, 3072, 0.87),
                            ("gemma2", 8192, 256000, 2304, 0.26)):
    g = torch.Generator(device="cuda").manual_seed(0)
    vb, tb = v // 128, n // 128
    vb = min(vb, 400)  # a chunk of columns
    flags = torch.rand(vb, tb, device="cuda", generator=g) < kept
    counts = flags.sum(1).int()
    first_slots = torch.cumsum(counts, 0).int() - counts
    lists = torch.zeros(flags.shape, dtype=torch.int32, device="cuda")
    for i in range(vb):
        idx = flags[i].nonzero().flatten().int()
        lists[i, :idx.numel()] = idx
    slots = torch.randn(int(counts.sum()) * 128 * 128, device="cuda", generator=g).bfloat16()
    e = torch.randn(n, d, device="cuda", generator=g).bfloat16()
    flop = 2 * counts.sum().item() * 128 * 128 * d
    outs = {}
    for lean, stages in ((0, 2), (1, 4), (1, 7)):
        out = torch.empty(vb * 128, d, device="cuda", dtype=torch.bfloat16)
        f = lambda: dc_product[(vb * (d // 256),)](slots, lists, counts, first_slots, e, out, d,
                                                   lists.stride(0), vb, BLOCK=128, BLOCK_OUT=256,
                                                   LEAN=lean, num_warps=8, num_stages=stages)
        f(); t = ms(f)
        outs[(lean, stages)] = out
        rows.append({"shape": name, "lean": lean, "stages": stages, "ms": t, "tflops": flop / t / 1e9,
                     "equal_to_cce_loop": bool(torch.equal(out, outs[(0, 2)]))})
        print(rows[-1], flush=True)
    kk = int(counts.float().mean().item()) * 128
    a = torch.randn(vb * 128, kk, device="cuda").bfloat16()
    bm = torch.randn(kk, d, device="cuda").bfloat16()
    t = ms(lambda: a @ bm)
    rows.append({"shape": name, "cublas_ms_same_work": t, "tflops": 2 * a.shape[0] * kk * d / t / 1e9})
    print(rows[-1], flush=True)
json.dump(rows, open(os.environ.get("OUT", ".") + "/dc_lean.json", "w"), indent=1)
