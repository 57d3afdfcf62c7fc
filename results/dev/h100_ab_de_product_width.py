"""The dE product at D = 640 (Gemma 3): 128 output columns in whole blocks against 256 columns with
a half-empty last block (H100 study; writes h100_ab_de_product_width.json).

With 256 output columns, D = 640 is two whole blocks and a half-empty one, and a D that is not a
multiple of the output width keeps the dE product off its whole-block loop (64-deep steps, 7
stages, no masks; ``sparse_tile_matmul._launch``), on the masked 128-deep loop with 2 stages.
With 128 columns D = 640 is five whole blocks. Variants, alternating over ROUNDS rounds:

- ``256``: cce as it is;
- ``128 for dE``: ``sparse_tile_matmul._block_out`` returns 128 where 256 does not divide D,
  the dC product (``classifier_product``) keeps 256;
- ``128 for both``: the dC product takes 128 too.

Per variant: forward + backward medians (CUDA events, as ``experiments.bench``), one profiled
call's kernel times, and dE and dC against the first variant's.

It ran on the tree of 075c4c4, before ``sparse_tile_matmul.embeddings_block_out``, which narrows
only the whole-block dE products without a rank-one term.

Run from the repository root: ``python results/dev/h100_ab_de_product_width.py OUT_DIR``.
"""

from __future__ import annotations

import contextlib
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

SHAPES = {"gemma3": (8192, 262144, 640), "gemma3_n4096": (4096, 262144, 640)}
WARMUP, REPEATS, ROUNDS = 5, 20, 3
VARIANTS = ("256", "128 for dE", "128 for both")


@contextlib.contextmanager
def variant(label):
    block_out = sparse_tile_matmul._block_out
    tma_product = classifier_product.gradient_times_classifier_tma
    if label != "256":
        sparse_tile_matmul._block_out = (
            lambda dim, dtype: 128 if dim % block_out(dim, dtype) else block_out(dim, dtype))
    if label == "128 for dE":
        def tma_product_256(*args):
            return tma_product(*args[:-1], block_out(args[2].shape[1], args[2].dtype))
        classifier_product.gradient_times_classifier_tma = tma_product_256
    try:
        yield
    finally:
        sparse_tile_matmul._block_out = block_out
        classifier_product.gradient_times_classifier_tma = tma_product


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
                       "dC_vs_first": relative(grad_c, reference[1])}
                print(row, flush=True)
                results["rows"].append(row)
        del e, c, targets, reference
        torch.cuda.empty_cache()
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "h100_ab_de_product_width.json").write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
