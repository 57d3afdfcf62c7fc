"""Products' software pipeline depth (num_stages 2, 3, 4 at 256 output columns), H100.

With 2 stages Triton 3.6 loads each step's list entry and vocabulary order synchronously inside
the loop; with 4 it copies all three levels (list entry -> order -> operand rows) asynchronously.
Per shape: fwd+bwd median (CUDA events), profiler time per kernel, dE/dC bitwise vs stages 2.
"""
import dataclasses, json, os, statistics, sys
import torch
from torch.profiler import profile, ProfilerActivity
import cce, cce.config as cfg
from experiments.synthetic import lm_like_inputs
from experiments.harness import time_fn, environment

BASE = cfg._GPU_16BIT
def set_stages(s, warps=8, out=256):
    cfg._GPU_16BIT = dataclasses.replace(BASE, sparse_tile_matmul=cfg.KernelConfig(
        block_out=out, num_warps=warps, num_stages=s))

def step(e, c, t):
    e.grad = c.grad = None
    cce.linear_cross_entropy(e, c, t).backward()

def kernel_ms(e, c, t, calls=3):
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            step(e, c, t)
        torch.cuda.synchronize()
    out = {}
    for ev in prof.key_averages():
        name = ev.key
        for k in ("sparse_tile_matmul", "gradient_tiles", "lse_forward"):
            if k in name:
                out[k] = out.get(k, 0.0) + ev.device_time_total / 1e3 / calls
    return out

shapes = [("gemma3_lm", 8192, 262144, 640), ("gemma2_2b", 8192, 256000, 2304),
          ("llama3_8b", 8192, 128256, 4096), ("phi3_5_mini", 8192, 32064, 3072),
          ("llama3_8b_n1024", 1024, 128256, 4096)]
if len(sys.argv) > 1:
    shapes = [s for s in shapes if s[0] in sys.argv[1:]]
variants = [(2, 8, 256), (3, 8, 256), (4, 8, 256)]
rows = []
for name, n, v, d in shapes:
    e, c, t = lm_like_inputs(n, v, d, seed=1, device="cuda")
    ref = None
    for rnd, order in enumerate((variants, variants[::-1])):
        for s, w, o in order:
            set_stages(s, w, o)
            step(e, c, t)
            g = (e.grad.clone(), c.grad.clone())
            if ref is None and s == 2:
                ref = g
            same = (ref is not None and torch.equal(g[0], ref[0]) and torch.equal(g[1], ref[1]))
            ms = time_fn(lambda: step(e, c, t), warmup=3, repeats=15)
            r = {"shape": name, "round": rnd, "stages": s, "warps": w, "block_out": o,
                 "fwd_bwd_ms": ms, "grads_equal_stages2": same, **kernel_ms(e, c, t)}
            print(json.dumps(r), flush=True)
            rows.append(r)
    del e, c, t, ref, g
    torch.cuda.empty_cache()
json.dump({"environment": environment(), "rows": rows},
          open(os.environ.get("OUT", ".") + "/product_stages.json", "w"), indent=1)
