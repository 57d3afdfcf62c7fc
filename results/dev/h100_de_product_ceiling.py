"""Ceilings of a Triton mainloop on the dE product's work (H100 study): cce's loop and the
64-deep flat loop with both operands L2-resident, and a plain affine Triton matmul of the same
size, against cuBLAS."""
import json, os, sys
import torch, triton
import triton.language as tl
sys.path.insert(0, os.path.dirname(__file__))
from h100_de_product_study import run, ms, synthetic_chunk


@triton.jit
def dense_mm(a_ptr, b_ptr, c_ptr, M, N, K, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    num_m = tl.cdiv(M, BM)
    pid_m = tl.program_id(0) % num_m
    pid_n = tl.program_id(0) // num_m
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k in range(0, K, BK):
        a = tl.load(a_ptr + rm[:, None].to(tl.int64) * K + (k + rk)[None, :])
        b = tl.load(b_ptr + (k + rk)[:, None].to(tl.int64) * N + rn[None, :])
        acc = tl.dot(a, b, acc)
    tl.store(c_ptr + rm[:, None].to(tl.int64) * N + rn[None, :], acc.to(tl.bfloat16))


rows = []
n, v, d, kept = 4096, 128256, 4096, 0.45
scratch, c, perm, flags, lists, counts = synthetic_chunk(n, v, d, kept)
out = torch.empty(n, d, device="cuda", dtype=torch.bfloat16)
flop = 2 * counts.sum().item() * 128 * 128 * d
for name, (ls, order) in {"real": (lists, perm), "both_in_l2": (lists % 16, perm % 4096)}.items():
    for ahead, stages in ((0, 2), (4, 7), (5, 4), (5, 7)):
        run(ahead, scratch, ls, counts, c, order, out, n, stages, None)
        t = ms(lambda: run(ahead, scratch, ls, counts, c, order, out, n, stages, None))
        rows.append({"case": name, "ahead": ahead, "stages": stages, "ms": t, "tflops": flop / t / 1e9})
        print(rows[-1], flush=True)
kk = int(counts.float().mean().item()) * 128
a = torch.randn(n, kk, device="cuda").bfloat16()
bm = torch.randn(kk, d, device="cuda").bfloat16()
t = ms(lambda: a @ bm)
rows.append({"case": "cublas", "ms": t, "tflops": 2 * n * kk * d / t / 1e9}); print(rows[-1])
cm = torch.empty(n, d, device="cuda", dtype=torch.bfloat16)
for bk, st in ((64, 3), (64, 4), (128, 2)):
    grid = (triton.cdiv(n, 128) * triton.cdiv(d, 256),)
    f = lambda: dense_mm[grid](a, bm, cm, n, d, kk, BM=128, BN=256, BK=bk, num_warps=8, num_stages=st)
    try:
        f(); t = ms(f)
        rows.append({"case": "triton affine matmul 128x256", "block_k": bk, "stages": st, "ms": t,
                     "tflops": 2 * n * kk * d / t / 1e9,
                     "rel_err_vs_cublas": ((cm.float() - (a @ bm).float()).norm() / (a @ bm).float().norm()).item()})
    except Exception as ex:
        rows.append({"case": "triton affine matmul", "block_k": bk, "stages": st, "error": str(ex)[:150]})
    print(rows[-1], flush=True)
json.dump(rows, open(os.environ.get("OUT", ".") + "/de_ceiling.json", "w"), indent=1)
