"""The one pass without a host sync where half of dC holds a slot for every grid tile, against
the one pass that reads the live tiles' counts and packs them (one sync at the backward's
start), alternated over three rounds at small N, where the grid fits. Needs the tree with
``h200_ab_grid_slots.patch`` applied (``cce.backward._grid_fits``; not kept).

``PYTHONPATH=. python results/dev/h200_ab_grid_slots.py OUT_DIR NAME`` from the repository root.
"""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path
from unittest import mock

sys.path.insert(0, str(Path(__file__).parent))

import cce.backward  # noqa: E402
from ab_rounds import alternate  # noqa: E402

SHAPES = {"llama3_8b_n1024": (1024, 128256, 4096), "llama3_8b_n2048": (2048, 128256, 4096),
          "gemma2_2b_n1024": (1024, 256000, 2304), "phi3_5_mini_n1024": (1024, 32064, 3072)}
VARIANTS = {
    "packed": lambda: mock.patch.object(cce.backward, "_grid_fits", lambda *args: False),
    "grid slots": contextlib.nullcontext,
}

if __name__ == "__main__":
    alternate(SHAPES, VARIANTS, rounds=3, out_file=Path(sys.argv[1]) / f"{sys.argv[2]}.json",
              watched_kernel="classifier_product_kernel")
