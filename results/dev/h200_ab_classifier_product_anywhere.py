"""The dC product by TMA (cce.classifier_product) at any N and D against its thresholds
(MIN_TOKENS 8192, MIN_DIM 2048): forward+backward medians (CUDA events) and the call's kernel
time (torch.profiler, one call), alternating over ROUNDS rounds on one GPU (H200 study; writes
h200_ab_classifier_product_anywhere.json). Below the thresholds the Triton product runs; dE is
the same in both variants, so the kernel time's difference is the dC product's.

Run from the repository root: ``python results/dev/h200_ab_classifier_product_anywhere.py OUT``.
"""

from __future__ import annotations

import functools
import json
import sys
from pathlib import Path

import torch

from cce import classifier_product
from experiments.harness import environment
from experiments.synthetic import lm_like_inputs
from results.dev.h200_small_levers import median_ms, profile, with_settings

ROUNDS = 3
CASES = (("gemma2_2b", 4096, 256000, 2304), ("llama3_8b", 4096, 128256, 4096),
         ("phi3_5_mini", 4096, 32064, 3072), ("gemma3", 8192, 262144, 640))


def main(out_dir: Path) -> None:
    rows = []
    for name, n, v, d in CASES:
        e, c, targets = lm_like_inputs(n, v, d, seed=1, device="cuda")
        for round_index in range(ROUNDS):
            for label, min_tokens, min_dim in (
                    ("thresholds", classifier_product.MIN_TOKENS, classifier_product.MIN_DIM),
                    ("anywhere", 0, 0)):
                ms = with_settings(min_tokens, min_dim, 0,
                                   functools.partial(median_ms, e, c, targets))
                busy = with_settings(min_tokens, min_dim, 0,
                                     functools.partial(profile, e, c, targets))["busy_ms"]
                row = {"shape": name, "N": n, "variant": label, "round": round_index,
                       "fwd_bwd_ms": ms, "kernel_ms": busy}
                print(row, flush=True)
                rows.append(row)
        del e, c, targets
        torch.cuda.empty_cache()
    (out_dir / "h200_ab_classifier_product_anywhere.json").write_text(
        json.dumps({"environment": environment(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
