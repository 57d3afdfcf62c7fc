"""Pass 1 with the live tiles in slots (``cce.backward._live_tiles_in_slots``) against whole rows
of the grid, where the scratch cannot hold every row; H100 A/B of two forms, each a patch:

- h100_ab_pass1_slots.patch (writes h100_ab_pass1_slots.json): the dE product reads each slot
  through a map of the grid;
- h100_ab_pass1_listed_slots.patch (``NAME`` h100_ab_pass1_listed_slots): the dE product walks
  the lists of live tiles (dropped ones stored as zeros), so that a row's k-th tile is in slot
  first + k, and the chunks are cut to whole waves of that product.

Whole rows store every tile of a token block, dead or not, so at D = 640 dC's memory holds 5
token blocks of 64: 16 chunks, each reading all of c in its recompute and again in its dE
product (Nsight Compute, h100_backward_ncu.*: 47-50% of DRAM bandwidth in the recompute, 72% in
the product). In slots, a chunk holds about 1 / (live fraction) times more.

``python results/dev/h100_ab_pass1_slots.py OUT_DIR [NAME]`` from the repository root, with the
form's patch applied (``git apply``).
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
    name = sys.argv[2] if len(sys.argv) > 2 else "h100_ab_pass1_slots"
    alternate(SHAPES, VARIANTS, rounds=3, out_file=Path(sys.argv[1]) / f"{name}.json",
              watched_kernel="sparse_tile_matmul_kernel")
