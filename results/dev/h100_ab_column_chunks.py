"""One recompute per live tile in pass 2's column chunks (dE added up in a float32
accumulator) against the two passes, forward + backward on one GPU (A/B, alternating over
ROUNDS rounds); writes ab_column_chunks.json.

"column chunks" sets ``cce.backward.COLUMN_CHUNKS`` and lifts ``_column_chunks_may_pay``'s
limit on the accumulator's size, so that every shape here takes it; the chunks are planned as if
the accumulator took dC's last rows. Per shape: fwd+bwd medians (harness.time_fn), peak memory
of one call above the inputs, the number of dE products (chunks) and the relative difference of
dE and dC from the two passes' (same inputs, bf16).

Measured with ``h100_ab_column_chunks.patch`` applied (``git apply``): a prototype whose
accumulator is a buffer of its own, not kept (docs/notes/backward.md, "Column chunks with one
recompute per tile"). Run from the repository root:
``python results/dev/h100_ab_column_chunks.py OUT``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

import cce
import cce.backward
from experiments.bench import SHAPES
from experiments.harness import environment, relative_error, time_fn
from experiments.synthetic import lm_like_inputs

SHAPE_NAMES = ("gemma2_2b", "gemma3", "phi3_5_mini", "llama3_8b_n16384")
ROUNDS = 3


def set_column_chunks(on: bool) -> None:
    cce.backward.COLUMN_CHUNKS = on
    cce.backward._column_chunks_may_pay = (
        (lambda num_tokens, grad_c: True) if on else (lambda num_tokens, grad_c: False))


def measure_shape(name: str, results: dict) -> None:
    shape = SHAPES[name]
    e, c, targets = lm_like_inputs(shape.n_tokens, shape.vocab_size, shape.dim, seed=1)
    c.requires_grad_(True)

    def step():
        cce.linear_cross_entropy(e, c, targets).backward()

    def gradients():
        step()
        grads = e.grad.clone(), c.grad.clone()
        e.grad = c.grad = None
        return grads

    products = []
    original = cce.backward.gradient_times_embeddings

    def counted(*args, **kwargs):
        products.append(1)
        return original(*args, **kwargs)

    cce.backward.gradient_times_embeddings = counted
    outputs = {}
    for label, on in (("two passes", False), ("column chunks", True)):
        set_column_chunks(on)
        products.clear()
        outputs[label] = gradients()
        results["calls"].append({"shape": name, "variant": label, "de_products": len(products)})
    cce.backward.gradient_times_embeddings = original
    results["differences"].append({
        "shape": name,
        "de_rel_diff": relative_error(outputs["column chunks"][0], outputs["two passes"][0]),
        "dc_rel_diff": relative_error(outputs["column chunks"][1], outputs["two passes"][1])})
    print(results["calls"][-2:], results["differences"][-1], flush=True)
    del outputs

    def timed_step():
        step()
        e.grad = c.grad = None

    for round_index in range(ROUNDS):
        for label, on in (("two passes", False), ("column chunks", True)):
            set_column_chunks(on)
            ms = time_fn(timed_step, warmup=3, repeats=15)
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
            timed_step()
            peak_mb = (torch.cuda.max_memory_allocated() - before) / 2**20
            results["timings"].append({"shape": name, "variant": label, "round": round_index,
                                       "fwd_bwd_ms": ms, "peak_mb": peak_mb})
            print(results["timings"][-1], flush=True)
    set_column_chunks(False)


def main(out_dir: Path) -> None:
    results = {"environment": environment(), "inputs": "experiments.synthetic.lm_like_inputs "
               "(seed 1) at each shape's N, V, D", "calls": [], "differences": [],
               "timings": []}
    for name in SHAPE_NAMES:
        measure_shape(name, results)
    (out_dir / "ab_column_chunks.json").write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
