"""How much of a forward + backward the forward's prologue costs: an upper bound of what fusing
its small operations could save (H100 study; writes h100_prologue_upper_bound.json).

The prologue runs before the log-sum-exp kernel: the canonical targets and their range flag
(about ten PyTorch operations and a copy to the host, ``cce.loss``), then the vocabulary order
(a mask, a matrix-vector product, ``classifier_sums``, an argsort). Under the profiler the GPU
waits 0.9-1.5 ms per call for the host there (``h100_kernel_breakdown.json``). Here the steps'
results are computed once and handed back from then on, so that a call runs without them:

- ``default``: cce as it is;
- ``targets cached``: the canonical targets and the out-of-range mask handed back (its
  ``any()`` and the host's read of it stay);
- ``targets and order cached``: the vocabulary order and the row sum of ``c`` too.

The first difference bounds what one fused targets kernel could save; the second is all that
the order costs, its read of ``c`` included. Forward + backward medians (CUDA events, as
``experiments.bench``), the three variants alternating over ROUNDS rounds.

Run from the repository root: ``python results/dev/h100_prologue_upper_bound.py OUT_DIR``.
"""

from __future__ import annotations

import contextlib
import functools
import json
import sys
from pathlib import Path

import torch

import cce
import cce.cce_function
import cce.loss
from experiments.harness import environment, time_fn
from experiments.synthetic import lm_like_inputs

SHAPES = {"gemma3": (8192, 262144, 640), "phi3_5_mini": (8192, 32064, 3072),
          "llama3_8b": (8192, 128256, 4096), "llama3_8b_n1024": (1024, 128256, 4096)}
WARMUP, REPEATS, ROUNDS = 5, 20, 3


def step(e, c, targets):
    cce.linear_cross_entropy(e, c, targets).backward()
    e.grad = c.grad = None


@contextlib.contextmanager
def cached(module, name):
    """``module.name`` computed on the first call, its result handed back afterwards."""
    original = getattr(module, name)
    results = []

    def once(*args, **kwargs):
        if not results:
            results.append(original(*args, **kwargs))
        return results[0]

    setattr(module, name, once)
    try:
        yield
    finally:
        setattr(module, name, original)


def variant(label):
    stack = contextlib.ExitStack()
    if label != "default":
        stack.enter_context(cached(cce.loss, "_canonical_targets"))
    if label == "targets and order cached":
        stack.enter_context(cached(cce.cce_function, "sort_vocabulary"))
    return stack


def main(out_dir: Path) -> None:
    results = {"environment": environment(), "warmup": WARMUP, "repeats": REPEATS, "rows": []}
    labels = ("default", "targets cached", "targets and order cached")
    for name, (n, v, d) in SHAPES.items():
        e, c, targets = lm_like_inputs(n, v, d, seed=1, device="cuda")
        for round_index in range(ROUNDS):
            for label in labels:
                with variant(label):
                    ms = time_fn(functools.partial(step, e, c, targets), warmup=WARMUP,
                                 repeats=REPEATS)
                    loss = cce.linear_cross_entropy(e, c, targets)
                row = {"shape": name, "variant": label, "round": round_index, "fwd_bwd_ms": ms,
                       "loss": loss.item()}
                print(row, flush=True)
                results["rows"].append(row)
        del e, c, targets
        torch.cuda.empty_cache()
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "h100_prologue_upper_bound.json").write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
