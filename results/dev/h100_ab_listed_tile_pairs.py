"""Pass 2's and the one pass's recompute with two listed tiles per program (a 256 x 128
product) against one (128 x 128), H100 A/B; writes h100_ab_listed_tile_pairs.json.

``h100_recompute_tile_shape.json`` timed the recompute kernel alone on dense chunks: 256 x 128
tiles with 8 warps ran at 1.20-1.22x the speed per FLOP of 128 x 128 tiles with 4 warps at
D = 2304 and 4096, 1.04x at 3072 and 0.98x at 640. Here the whole call, with the lists of real
backward passes (odd lists leave half a program idle). Variants, alternating over ROUNDS rounds:

- ``one tile``: ``config.listed_gradient_tiles`` as ``gradient_tiles`` (128 x 128, 4 warps);
- ``two tiles``: cce as it is (``listed_gradient_tiles``: 256 rows, 8 warps).

Per variant: forward + backward medians (CUDA events, as ``experiments.bench``), one profiled
call's kernel times, and dE and dC against the first variant's.

Run from the repository root: ``python results/dev/h100_ab_listed_tile_pairs.py OUT_DIR``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import sys
from collections import defaultdict
from pathlib import Path

import torch

import cce
from cce import config
from experiments.harness import environment, time_fn
from experiments.synthetic import lm_like_inputs

SHAPES = {"gemma2_2b": (8192, 256000, 2304), "llama3_8b": (8192, 128256, 4096),
          "phi3_5_mini": (8192, 32064, 3072), "gemma3": (8192, 262144, 640),
          "llama3_8b_n1024": (1024, 128256, 4096), "llama3_8b_n16384": (16384, 128256, 4096)}
WARMUP, REPEATS, ROUNDS = 5, 20, 3
VARIANTS = ("one tile", "two tiles")


@contextlib.contextmanager
def variant(label):
    configs = config._GPU_16BIT
    if label == "one tile":
        config._GPU_16BIT = dataclasses.replace(
            configs, listed_gradient_tiles=configs.gradient_tiles)
    try:
        yield
    finally:
        config._GPU_16BIT = configs


def step(e, c, targets):
    cce.linear_cross_entropy(e, c, targets).backward()
    grads = e.grad, c.grad
    e.grad = c.grad = None
    return grads


def kernel_ms(e, c, targets):
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        step(e, c, targets)
        torch.cuda.synchronize()
    totals = defaultdict(float)
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            totals[event.name[:40]] += event.time_range.elapsed_us() / 1000
    return {name: round(ms, 4) for name, ms in sorted(totals.items(), key=lambda kv: -kv[1])[:8]}


def relative(x, reference):
    return float((x.float() - reference.float()).norm() / reference.float().norm())


def main(out_dir: Path) -> None:
    results = {"environment": environment(), "rows": []}
    for name, (n, v, d) in SHAPES.items():
        e, c, targets = lm_like_inputs(n, v, d, seed=1, device="cuda")
        reference = None
        for round_index in range(ROUNDS):
            for label in VARIANTS:
                with variant(label):
                    ms = time_fn(functools.partial(step, e, c, targets), warmup=WARMUP,
                                 repeats=REPEATS)
                    kernels = kernel_ms(e, c, targets)
                    grad_e, grad_c = step(e, c, targets)
                if reference is None:
                    reference = grad_e, grad_c
                row = {"shape": name, "variant": label, "round": round_index,
                       "fwd_bwd_ms": ms, "kernels_ms": kernels,
                       "dE_vs_first": relative(grad_e, reference[0]),
                       "dC_vs_first": relative(grad_c, reference[1]),
                       "bitwise_equal": bool(torch.equal(grad_e, reference[0])
                                             and torch.equal(grad_c, reference[1]))}
                print(name, label, round_index, round(ms, 3), kernels.get("gradient_tiles_kernel"),
                      row["bitwise_equal"], flush=True)
                results["rows"].append(row)
        del e, c, targets, reference
        torch.cuda.empty_cache()
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "h100_ab_listed_tile_pairs.json").write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
