"""Pass 1 with the live tiles in slots against whole rows of the grid, at small D, where
``cce.config.slot_chunk_tokens`` decides between them (chunks of whole rows hold about D tokens):
Gemma 3 270M's D = 640 at three N, and D = 1152 (Gemma 3 1B's width) near the threshold.
The first A/B of slots (``h100_ab_pass1_slots.*``) found them faster at D = 640 and slower at
D >= 2304, where whole rows hold enough tokens.

``PYTHONPATH=. python results/dev/h100_ab_pass1_slot_rule.py OUT_DIR NAME`` from the repository
root.
"""

from __future__ import annotations

import sys
from pathlib import Path
from unittest import mock

sys.path.insert(0, str(Path(__file__).parent))

import cce.config  # noqa: E402
from ab_rounds import alternate  # noqa: E402

SHAPES = {"gemma3": (8192, 262144, 640), "gemma3_n4096": (4096, 262144, 640),
          "gemma3_n16384": (16384, 262144, 640), "d1152": (8192, 262144, 1152)}
VARIANTS = {
    "whole rows": lambda: mock.patch.object(cce.config, "_SLOT_CHUNK_TOKENS", 0),
    "slots": lambda: mock.patch.object(cce.config, "_SLOT_CHUNK_TOKENS", 2**31),
}

if __name__ == "__main__":
    alternate(SHAPES, VARIANTS, rounds=3, out_file=Path(sys.argv[1]) / f"{sys.argv[2]}.json",
              watched_kernel="gradient_tiles_kernel")
