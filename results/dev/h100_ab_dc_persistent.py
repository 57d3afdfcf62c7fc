"""The dC product (``cce.classifier_product``) with one persistent program per SM, each walking
output blocks in turn, against one program per output block (the kernel before); H100 A/B,
writes h100_ab_dc_persistent.json.

The roofline had the dC product at 36-73% of cuBLAS, lowest where each output block's list is
short (Llama N = 1024: about 4 tiles per block, 38%): every program paid its pipeline's fill and
its rows' store alone. Persistent, a block's store overlaps the next block's copies.
The variant "one block per program" runs the same kernel with as many programs as blocks.
Not kept (docs/notes/backward.md): the kernel is in h100_ab_dc_persistent.patch, which also
adds a two-program case to the bit-for-bit test.

``git apply results/dev/h100_ab_dc_persistent.patch``, then
``PYTHONPATH=. python results/dev/h100_ab_dc_persistent.py OUT_DIR`` from the repository root.
"""

from __future__ import annotations

import sys
from pathlib import Path
from unittest import mock

sys.path.insert(0, str(Path(__file__).parent))

import cce.classifier_product  # noqa: E402
from ab_rounds import alternate  # noqa: E402

SHAPES = {"llama3_8b_n1024": (1024, 128256, 4096), "gemma3": (8192, 262144, 640),
          "gemma2_2b": (8192, 256000, 2304), "phi3_5_mini": (8192, 32064, 3072),
          "llama3_8b": (8192, 128256, 4096)}

VARIANTS = {
    "one block per program": lambda: mock.patch.object(
        cce.classifier_product, "_programs", lambda outputs, device: outputs),
    "persistent": lambda: mock.patch.object(
        cce.classifier_product, "_programs", cce.classifier_product._programs),
}

if __name__ == "__main__":
    alternate(SHAPES, VARIANTS, rounds=3,
              out_file=Path(sys.argv[1]) / "h100_ab_dc_persistent.json",
              watched_kernel="classifier_product_kernel")
