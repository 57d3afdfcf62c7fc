"""One read of c for the vocabulary order and the mass correction's mean row, against two
(A/B, run on an H100; writes ab_one_read_of_c.json, kept as h100_ab_one_read_of_c.json for the
first kernel and h100_ab_one_read_of_c_tuned.json for the kernel of 64 x 256 slices).

1. The sums alone: ``classifier_sums(c, mean_e)`` (both sums, one read) against
   ``torch.mv(c, mean_e)`` and ``torch.mv(c.T, ones)`` (the two reads of before), and
   ``classifier_sums(c)`` (the row sum alone, the backward's fallback), with the bandwidth that
   reading c once means.
2. Forward + backward medians (harness.time_fn), alternating over ROUNDS rounds: "one read"
   (this code) against "two reads" (the forward's order by two matrix-vector products, as
   before, and no row sum handed to the backward, which then reads c for it).

Run from the repository root: ``python results/dev/h100_ab_one_read_of_c.py OUT_DIR``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

import cce
from cce import cce_function
from cce.classifier_sums import classifier_sums
from cce.vocab_order import SortedVocabulary
from experiments.harness import environment, time_fn
from experiments.synthetic import lm_like_inputs

SHAPES = {"gemma3": (8192, 262144, 640, True), "gemma2_2b": (8192, 256000, 2304, True),
          "gemma2_2b_frozen": (8192, 256000, 2304, False),
          "llama3_8b": (8192, 128256, 4096, True), "llama3_8b_n1024": (1024, 128256, 4096, True),
          "phi3_5_mini": (8192, 32064, 3072, True)}
ROUNDS = 3


def two_reads(e, c, bias, targets):
    """The order as computed before: two matrix-vector products; no row sum for the backward."""
    valid = (targets >= 0).to(e.dtype)
    average_logit = torch.mv(c, torch.mv(e.T, valid)).float()
    order = torch.argsort(average_logit, descending=True, stable=True).to(torch.int32)
    return SortedVocabulary(order, None)


def main(out_dir: Path) -> None:
    results = {"environment": environment(), "sums_ms": {}, "timings": []}
    one_read = cce_function.sort_vocabulary
    for name, (n, v, d, trains_c) in SHAPES.items():
        e, c, targets = lm_like_inputs(n, v, d, seed=1)
        c.requires_grad_(trains_c)
        if name not in ("gemma2_2b_frozen", "llama3_8b_n1024"):
            with torch.no_grad():
                mean_e = torch.mv(e.T, torch.ones(n, device=e.device, dtype=e.dtype))
                ones = torch.ones(v, device=e.device, dtype=e.dtype)
                row = {"both sums, one read": time_fn(lambda: classifier_sums(c, mean_e)),
                       "row sum alone": time_fn(lambda: classifier_sums(c)),
                       "mv(c, mean_e)": time_fn(lambda: torch.mv(c, mean_e)),
                       "mv(c.T, ones)": time_fn(lambda: torch.mv(c.T, ones))}
                row["one read GB/s"] = v * d * c.element_size() / row["both sums, one read"] / 1e6
                results["sums_ms"][name] = row
                print(name, row, flush=True)

        def step():
            cce.linear_cross_entropy(e, c, targets).backward()
            e.grad = c.grad = None

        for round_index in range(ROUNDS):
            for label, sort in (("one read", one_read), ("two reads", two_reads)):
                cce_function.sort_vocabulary = sort
                ms = time_fn(step, warmup=3, repeats=15)
                results["timings"].append({"shape": name, "variant": label,
                                           "round": round_index, "fwd_bwd_ms": ms})
                print(results["timings"][-1], flush=True)
        cce_function.sort_vocabulary = one_read
    (out_dir / "ab_one_read_of_c.json").write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
