"""Pass 2's and the one pass's recompute with two listed tiles per program (a 256 x 128
product) against one (128 x 128), H100 A/B; writes h100_ab_listed_tile_pairs.json.

``h100_recompute_tile_shape.json`` timed the recompute kernel alone on dense chunks: 256 x 128
tiles with 8 warps ran at 1.20-1.22x the speed per FLOP of 128 x 128 tiles with 4 warps at
D = 2304 and 4096, 1.04x at 3072 and 0.98x at 640. Here the whole call, with the lists of real
backward passes (odd lists leave half a program idle). Variants, alternating over ROUNDS rounds:

- ``one tile``: ``config.listed_gradient_tiles`` as ``gradient_tiles`` (128 x 128, 4 warps);
- ``two tiles``: the patched code as it is (``listed_gradient_tiles``: 256 rows, 8 warps).

Per variant: forward + backward medians (CUDA events, as ``experiments.bench``), one profiled
call's kernel times, and dE and dC against the first variant's.

Run from the repository root, with ``h100_ab_listed_tile_pairs.patch`` applied (``git apply``;
the variants need the code it adds): ``python results/dev/h100_ab_listed_tile_pairs.py OUT_DIR``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from ab_rounds import alternate  # noqa: E402
from cce import config  # noqa: E402

SHAPES = {"gemma2_2b": (8192, 256000, 2304), "llama3_8b": (8192, 128256, 4096),
          "phi3_5_mini": (8192, 32064, 3072), "gemma3": (8192, 262144, 640),
          "llama3_8b_n1024": (1024, 128256, 4096), "llama3_8b_n16384": (16384, 128256, 4096)}
ROUNDS = 3


@contextlib.contextmanager
def one_tile():
    configs = config._GPU_16BIT
    config._GPU_16BIT = dataclasses.replace(configs,
                                            listed_gradient_tiles=configs.gradient_tiles)
    try:
        yield
    finally:
        config._GPU_16BIT = configs


VARIANTS = {"one tile": one_tile, "two tiles": contextlib.nullcontext}

if __name__ == "__main__":
    alternate(SHAPES, VARIANTS, ROUNDS, Path(sys.argv[1]) / "h100_ab_listed_tile_pairs.json",
              "gradient_tiles_kernel")
