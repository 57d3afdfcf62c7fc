"""What deterministic mode costs with bounds from a head launch: ``deterministic=True`` against
the default, alternated, at the benchmark's shapes and at N = 1024.

In deterministic mode the forward first runs the head of the vocabulary order (its first
``config.deterministic_head_blocks`` forward tiles, one program per token block), then the rest
with the head's LSE in every bound instead of other programs' merges; no lock. The live table is
then a function of the inputs (``results/dev/cpu_deterministic_bounds.json`` for how tight), so
pass 1 may store its tiles in slots there too. Before this change deterministic mode cost
nothing measurable against the default (``results/bench.md``, 2026-11-27: 2B 43.4 vs 44.1 ms,
Llama 45.3 vs 45.1, Phi 16.4 vs 16.3). The lse_forward kernel's time is the watched one.

``PYTHONPATH=. python results/dev/h100_ab_deterministic_head.py OUT_DIR NAME`` from the
repository root.
"""

from __future__ import annotations

import contextlib
import functools
import sys
from pathlib import Path
from unittest import mock

sys.path.insert(0, str(Path(__file__).parent))

import cce  # noqa: E402
from ab_rounds import alternate  # noqa: E402

SHAPES = {"gemma3": (8192, 262144, 640), "gemma2_2b": (8192, 256000, 2304),
          "llama3_8b": (8192, 128256, 4096), "phi3_5_mini": (8192, 32064, 3072),
          "llama3_8b_n1024": (1024, 128256, 4096)}
VARIANTS = {
    "default": contextlib.nullcontext,
    "deterministic": lambda: mock.patch.object(
        cce, "linear_cross_entropy",
        functools.partial(cce.linear_cross_entropy, deterministic=True)),
}

if __name__ == "__main__":
    alternate(SHAPES, VARIANTS, rounds=3, out_file=Path(sys.argv[1]) / f"{sys.argv[2]}.json",
              watched_kernel="lse_forward_kernel")
