"""Pass 1 with the live tiles in slots (``cce.backward._live_tiles_in_slots``) against whole rows
of the grid, where the scratch cannot hold every row; the dE product walks the lists of live
tiles (dropped ones stored as zeros), so that a row's k-th tile is in slot first + k, and the
chunks are cut to whole waves of that product. H100 A/B, writes h100_ab_pass1_listed_slots.json.

The first form (h100_ab_pass1_slots.*) read each slot through a map in the dE product: faster at
Gemma 3, slower at 2B, Phi and Llama N = 16384.

``python results/dev/h100_ab_pass1_listed_slots.py OUT_DIR`` from the repository root, with
h100_ab_pass1_listed_slots.patch applied (``git apply``).
"""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path
from unittest import mock

sys.path.insert(0, str(Path(__file__).parent))

import cce.backward  # noqa: E402
from ab_rounds import alternate  # noqa: E402

SHAPES = {"gemma3": (8192, 262144, 640), "gemma2_2b": (8192, 256000, 2304),
          "phi3_5_mini": (8192, 32064, 3072), "llama3_8b_n16384": (16384, 128256, 4096)}
VARIANTS = {
    "whole rows": lambda: mock.patch.object(cce.backward, "_live_tiles_in_slots",
                                            lambda *args: False),
    "slots": contextlib.nullcontext,
}

if __name__ == "__main__":
    alternate(SHAPES, VARIANTS, rounds=3,
              out_file=Path(sys.argv[1]) / "h100_ab_pass1_listed_slots.json",
              watched_kernel="sparse_tile_matmul_kernel")
