"""The dE product with the rows of c by tensor descriptor (TMA) against gathered through the
order, where c is in position order: with ``keep_tiles=True`` (a sorted copy of c for the
product) and with ``vocab_sorting=False`` (c itself). A/B on one GPU; writes
ab_de_product_by_descriptor.json.

For each shape and option, alternating over ROUNDS rounds: forward + backward medians
(harness.time_fn), the peak memory of one call above the inputs, and one profiled call's
kernel time of the dE product (``sparse_tile_matmul_kernel``: on Hopper dC is
``classifier_product_kernel``) and of all kernels. "gathered" replaces
``cce.backward.classifier_by_position`` by a function returning None.

Measured with ``h100_ab_de_product_by_descriptor.patch`` applied (``git apply``), which the
results did not justify keeping (docs/notes/backward.md, "What feeds the products"). Run from
the repository root: ``python results/dev/h100_ab_de_product_by_descriptor.py OUT``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

import cce
import cce.backward
from experiments.bench import SHAPES
from experiments.harness import environment, time_fn
from experiments.synthetic import lm_like_inputs

SHAPE_NAMES = ("llama3_8b", "gemma2_2b", "phi3_5_mini", "gemma3")
OPTIONS = {"keep_tiles": {"keep_tiles": True}, "unsorted": {"vocab_sorting": False}}
ROUNDS = 3


def kernel_ms(step) -> "tuple[float, float]":
    """(dE product, all kernels) CUDA time of one call, in ms, from the profiler."""
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    product = total = 0.0
    for event in prof.key_averages():
        time_us = event.device_time_total
        total += time_us
        if "sparse_tile_matmul" in event.key:
            product += time_us
    return product / 1e3, total / 1e3


def measure_shape(name: str, results: dict) -> None:
    shape = SHAPES[name]
    e, c, targets = lm_like_inputs(shape.n_tokens, shape.vocab_size, shape.dim, seed=1)
    c.requires_grad_(True)
    by_descriptor = cce.backward.classifier_by_position
    for option, kwargs in OPTIONS.items():

        def step():
            cce.linear_cross_entropy(e, c, targets, **kwargs).backward()
            e.grad = c.grad = None

        for round_index in range(ROUNDS):
            for label, choose in (("descriptor", by_descriptor),
                                  ("gathered", lambda *args, **kw: None)):
                cce.backward.classifier_by_position = choose
                ms = time_fn(step, warmup=3, repeats=15)
                torch.cuda.reset_peak_memory_stats()
                before = torch.cuda.memory_allocated()
                step()
                peak_mb = (torch.cuda.max_memory_allocated() - before) / 2**20
                product_ms, kernels_ms = kernel_ms(step)
                results["timings"].append({
                    "shape": name, "option": option, "variant": label, "round": round_index,
                    "fwd_bwd_ms": ms, "de_product_ms": product_ms, "kernels_ms": kernels_ms,
                    "peak_mb": peak_mb})
                print(results["timings"][-1], flush=True)
        cce.backward.classifier_by_position = by_descriptor


def main(out_dir: Path) -> None:
    results = {"environment": environment(), "inputs": "experiments.synthetic.lm_like_inputs "
               "(seed 1) at each shape's N, V, D", "timings": []}
    for name in SHAPE_NAMES:
        measure_shape(name, results)
    (out_dir / "ab_de_product_by_descriptor.json").write_text(json.dumps(results, indent=1)
                                                              + "\n")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
