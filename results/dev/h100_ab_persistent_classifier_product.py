"""The dC product by TMA (``cce.classifier_product``) as a persistent kernel, one program per SM
walking its output tiles in turn, against one program per output tile; H100 A/B, writes
h100_ab_persistent_classifier_product.json.

In one program per tile, each tile pays for its own pipeline fill, barrier setup and launch;
at Gemma 3 most vocabulary blocks hold one or two stored tiles (two to four 64-deep steps), and
at Llama N = 1024 every block holds at most eight. Persistent, the producer fills the stages for
a program's next tile while the consumer writes the last one's block of dC. Variants,
alternating over ROUNDS rounds:

- ``a program per tile``: ``classifier_product.persistent_programs`` returns more programs than
  tiles, so that each program takes one (the kernel as it was);
- ``persistent``: cce as it is (one program per SM).

Per variant: forward + backward medians (CUDA events, as ``experiments.bench``), one profiled
call's kernel times, and dE and dC against the first variant's.

Run from the repository root: ``python results/dev/h100_ab_persistent_classifier_product.py OUT_DIR``.
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
from cce import classifier_product
from experiments.harness import environment, time_fn
from experiments.synthetic import lm_like_inputs

SHAPES = {"gemma3": (8192, 262144, 640), "llama3_8b_n1024": (1024, 128256, 4096),
          "gemma2_2b": (8192, 256000, 2304), "llama3_8b": (8192, 128256, 4096),
          "phi3_5_mini": (8192, 32064, 3072), "llama3_8b_n4096": (4096, 128256, 4096)}
WARMUP, REPEATS, ROUNDS = 5, 20, 3
VARIANTS = ("a program per tile", "persistent")


@contextlib.contextmanager
def variant(label):
    programs = classifier_product.persistent_programs
    if label == "a program per tile":
        classifier_product.persistent_programs = lambda device: 2**31 - 1
    try:
        yield
    finally:
        classifier_product.persistent_programs = programs


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
                print(name, label, round_index, round(ms, 3), kernels.get("classifier_product_kernel"),
                      row["bitwise_equal"], flush=True)
                results["rows"].append(row)
        del e, c, targets, reference
        torch.cuda.empty_cache()
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "h100_ab_persistent_classifier_product.json").write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
