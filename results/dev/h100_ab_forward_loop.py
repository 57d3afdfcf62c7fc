"""The forward's vocabulary loop, flattened with the D loop and/or warp-specialized by Triton,
with both operands by tensor descriptor (H100 A/B; writes h100_ab_forward_loop.json).

``h200_ab_forward_flatten.json`` (2026-11-21) flattened the loop when the operands were pointer
loads: +10-20%. Since then the tiles come by TMA (``lse_forward.classifier_by_position``), the
case Triton's persistent matmul tutorial flattens to issue the next tile's copies during this
tile's epilogue. Variants (environment switches read by a temporary patch of
``cce/lse_forward.py``, ``h100_ab_forward_loop.patch``), alternating over ROUNDS rounds:
``base``, ``flatten``, ``warp_specialize``, ``flatten + warp_specialize``, and flattened with 4
stages or with 128-deep D slices in 2 stages. Per variant: the forward with gradients enabled
(CUDA events, median), one profiled forward's LSE kernel time, and the LSE against the base's.

Run from the repository root, with the patch applied:
``python results/dev/h100_ab_forward_loop.py OUT_DIR``. ``AB_ROUNDS``, ``AB_VARIANTS`` (names
separated by ``;``), ``AB_SHAPES`` (by ``,``) and ``AB_OUT`` (the file's name) narrow a run:
``h100_ab_forward_loop.json`` is every variant in 3 rounds, ``_rounds.json`` base and flatten in
8, ``_stages.json`` base, flatten and the two stage settings in 6.
"""

from __future__ import annotations

import functools
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

import cce  # noqa: E402
from ab_rounds import WARMUP, REPEATS, kernel_ms  # noqa: E402
from experiments.harness import environment, time_fn  # noqa: E402
from experiments.synthetic import lm_like_inputs  # noqa: E402

SHAPES = {"gemma3": (8192, 262144, 640), "gemma2_2b": (8192, 256000, 2304),
          "llama3_8b": (8192, 128256, 4096), "phi3_5_mini": (8192, 32064, 3072),
          "llama3_8b_n1024": (1024, 128256, 4096)}
ROUNDS = int(os.environ.get("AB_ROUNDS", "3"))
VARIANTS = {"base": {}, "flatten": {"CCE_AB_FLATTEN": "1"},
            "warp_specialize": {"CCE_AB_WS": "1"},
            "flatten + warp_specialize": {"CCE_AB_FLATTEN": "1", "CCE_AB_WS": "1"},
            "flatten, 4 stages": {"CCE_AB_FLATTEN": "1", "CCE_AB_STAGES": "4"},
            "flatten, 128-deep slices, 2 stages": {"CCE_AB_FLATTEN": "1",
                                                   "CCE_AB_BLOCK_DIM": "128",
                                                   "CCE_AB_STAGES": "2"}}
if os.environ.get("AB_VARIANTS"):
    VARIANTS = {name: VARIANTS[name] for name in os.environ["AB_VARIANTS"].split(";")}
if os.environ.get("AB_SHAPES"):
    SHAPES = {name: SHAPES[name] for name in os.environ["AB_SHAPES"].split(",")}


def forward(e, c, targets):
    return cce.linear_cross_entropy(e, c, targets, return_lse=True)


def lse_kernel_ms(e, c, targets):
    return kernel_ms(functools.partial(forward, e, c, targets)).get("lse_forward_kernel",
                                                                     float("nan"))


def main(out_dir: Path) -> None:
    results = {"environment": environment(), "rows": []}
    for name, (n, v, d) in SHAPES.items():
        e, c, targets = lm_like_inputs(n, v, d, seed=1, device="cuda")
        reference = None
        for round_index in range(ROUNDS):
            for label, switches in VARIANTS.items():
                for key in ("CCE_AB_FLATTEN", "CCE_AB_WS", "CCE_AB_STAGES", "CCE_AB_BLOCK_DIM"):
                    os.environ.pop(key, None)
                os.environ.update(switches)
                try:
                    ms = time_fn(functools.partial(forward, e, c, targets), warmup=WARMUP,
                                 repeats=REPEATS)
                    kernel = lse_kernel_ms(e, c, targets)
                    _, lse = forward(e, c, targets)
                    error = None
                except Exception as failure:  # a variant that does not compile
                    ms = kernel = None
                    error = repr(failure)[:300]
                    lse = None
                if reference is None:
                    reference = lse
                row = {"shape": name, "variant": label, "round": round_index, "fwd_ms": ms,
                       "lse_forward_kernel_ms": kernel, "error": error,
                       "lse_max_abs_vs_base": (None if lse is None else
                                               float((lse - reference).abs().max()))}
                print(row, flush=True)
                results["rows"].append(row)
        del e, c, targets, reference
        torch.cuda.empty_cache()
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / os.environ.get("AB_OUT", "h100_ab_forward_loop.json")).write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
