"""Where the dC product by TMA could run beyond its thresholds, and where a call's time goes
outside cce's kernels (H200 study; writes h200_small_levers.json).

1. Forward+backward medians (CUDA events) with ``classifier_product``'s thresholds and output
   width changed at run time, default and variant alternating over ROUNDS rounds: Llama 3 8B at
   N = 1024-4096, Gemma 2 2B and Phi 3.5 mini at N = 4096, Gemma 3 at N = 8192.
2. One call under torch.profiler (CUDA activity only) per shape: the sum of kernel times and the
   span from the first kernel's start to the last one's end; the difference is the time the GPU
   waits for the host within the call.

It ran with ``classifier_product``'s thresholds of the time (MIN_TOKENS 8192, MIN_DIM 2048),
since removed.

Run from the repository root: ``python results/dev/h200_small_levers.py OUT_DIR``.
"""

from __future__ import annotations

import functools
import json
import sys
from collections import defaultdict
from pathlib import Path

import torch

import cce
from cce import classifier_product, sparse_tile_matmul
from experiments.harness import environment, time_fn
from experiments.synthetic import lm_like_inputs

WARMUP, REPEATS, ROUNDS = 3, 15, 3


def step(e, c, targets):
    loss = cce.linear_cross_entropy(e, c, targets)
    loss.backward()
    e.grad = c.grad = None


def median_ms(e, c, targets):
    return time_fn(functools.partial(step, e, c, targets), warmup=WARMUP, repeats=REPEATS)


def with_settings(min_tokens, min_dim, block_out, fn):
    saved = classifier_product.MIN_TOKENS, classifier_product.MIN_DIM
    original_block_out = sparse_tile_matmul._block_out
    classifier_product.MIN_TOKENS, classifier_product.MIN_DIM = min_tokens, min_dim
    if block_out:
        sparse_tile_matmul._block_out = lambda dim, dtype: min(block_out, original_block_out(dim, dtype))
    try:
        return fn()
    finally:
        classifier_product.MIN_TOKENS, classifier_product.MIN_DIM = saved
        sparse_tile_matmul._block_out = original_block_out


def profile(e, c, targets):
    step(e, c, targets)
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        step(e, c, targets)
        torch.cuda.synchronize()
    kernels = [ev for ev in prof.events() if ev.device_type == torch.autograd.DeviceType.CUDA]
    starts = [ev.time_range.start for ev in kernels]
    ends = [ev.time_range.end for ev in kernels]
    by_name = defaultdict(lambda: [0, 0.0])
    for ev in kernels:
        by_name[ev.name[:60]][0] += 1
        by_name[ev.name[:60]][1] += ev.time_range.elapsed_us() / 1e3
    busy = sum(ev.time_range.elapsed_us() for ev in kernels) / 1e3
    top = sorted(by_name.items(), key=lambda item: -item[1][1])[:14]
    return {"kernels": len(kernels), "busy_ms": busy, "span_ms": (max(ends) - min(starts)) / 1e3,
            "top": [[name, count, round(ms, 3)] for name, (count, ms) in top]}


def main(out_dir: Path) -> None:
    results = {"environment": environment(), "timings": [], "profiles": []}
    cases = [
        ("llama3_8b", 1024, 128256, 4096), ("llama3_8b", 2048, 128256, 4096),
        ("llama3_8b", 4096, 128256, 4096), ("gemma2_2b", 4096, 256000, 2304),
        ("phi3_5_mini", 4096, 32064, 3072), ("gemma3", 8192, 262144, 640),
    ]
    for name, n, v, d in cases:
        e, c, targets = lm_like_inputs(n, v, d, seed=1, device="cuda")
        variants = [("default", classifier_product.MIN_TOKENS, classifier_product.MIN_DIM, 0)]
        if n < classifier_product.MIN_TOKENS:
            variants.append(("tma at any N", 0, classifier_product.MIN_DIM, 0))
        if d < classifier_product.MIN_DIM:
            variants += [("tma, 256 columns", 0, 0, 0), ("tma, 128 columns", 0, 0, 128)]
        for round_index in range(ROUNDS):
            for label, min_tokens, min_dim, block_out in variants:
                ms = with_settings(min_tokens, min_dim, block_out,
                                   functools.partial(median_ms, e, c, targets))
                row = {"shape": name, "N": n, "variant": label, "round": round_index,
                       "fwd_bwd_ms": ms}
                print(row, flush=True)
                results["timings"].append(row)
        del e, c, targets
        torch.cuda.empty_cache()
    for name, n, v, d in [("gemma3", 8192, 262144, 640), ("phi3_5_mini", 8192, 32064, 3072),
                          ("llama3_8b", 1024, 128256, 4096), ("llama3_8b", 8192, 128256, 4096)]:
        e, c, targets = lm_like_inputs(n, v, d, seed=1, device="cuda")
        row = {"shape": name, "N": n, **profile(e, c, targets)}
        print(json.dumps(row), flush=True)
        results["profiles"].append(row)
        del e, c, targets
        torch.cuda.empty_cache()
    (out_dir / "h200_small_levers.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
