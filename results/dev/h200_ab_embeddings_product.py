"""The one pass's dE product by cce.embeddings_product (Gluon, warp-specialized) against the
Triton product, forward+backward medians (CUDA events) alternating over ROUNDS rounds on one
GPU, and the dE product's own time under the profiler (H200 study; writes
h200_ab_embeddings_product.json).

``h200_ab_embeddings_product_chained_lookups.json`` is the same comparison (with Llama at N =
2048 too) for a first version of the producer that looked a step's list entry, slot, page and
rows of c up one after another, one step ahead of its copies.

The kernel it compares was removed after this comparison (``git log --
cce/embeddings_product.py``); the script runs where that file exists.

Run from the repository root: ``python results/dev/h200_ab_embeddings_product.py OUT_DIR``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from cce import embeddings_product
from experiments.harness import environment
from experiments.synthetic import lm_like_inputs
from results.dev.h200_small_levers import median_ms, step

ROUNDS = 3  # each median: h200_small_levers.median_ms (3 warm-up calls, 15 timed)
SHAPES = (("llama3_8b", 1024, 128256, 4096), ("llama3_8b", 4096, 128256, 4096),
          ("llama3_8b", 8192, 128256, 4096), ("gemma2_2b", 2048, 256000, 2304),
          ("phi3_5_mini", 1024, 32064, 3072))


def de_product_ms(e, c, targets):
    """Profiler time of the sparse products in one call (dE, and dC where it is Triton's)."""
    step(e, c, targets)
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        step(e, c, targets)
        torch.cuda.synchronize()
    return sum(ev.time_range.elapsed_us() for ev in prof.events()
               if ev.name.startswith(("embeddings_product_kernel", "sparse_tile_matmul_kernel"))
               and ev.device_type == torch.autograd.DeviceType.CUDA) / 1e3


def main(out_dir: Path) -> None:
    usable = embeddings_product.usable
    rows = []
    for name, n, v, d in SHAPES:
        e, c, targets = lm_like_inputs(n, v, d, seed=1, device="cuda")
        for round_index in range(ROUNDS):
            for variant in ("triton", "gluon"):
                embeddings_product.usable = usable if variant == "gluon" else (lambda *a: False)
                row = {"shape": name, "N": n, "variant": variant, "round": round_index,
                       "fwd_bwd_ms": median_ms(e, c, targets),
                       "sparse_products_ms": de_product_ms(e, c, targets)}
                print(row, flush=True)
                rows.append(row)
        embeddings_product.usable = usable
        del e, c, targets
        torch.cuda.empty_cache()
    (out_dir / "h200_ab_embeddings_product.json").write_text(
        json.dumps({"environment": environment(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
