"""The dC product by TMA (``cce.classifier_product``) as a persistent kernel, one program per SM
walking its output tiles in turn, against one program per output tile; H100 A/B, writes
h100_ab_persistent_classifier_product.json.

In one program per tile, each tile pays for its own pipeline fill, barrier setup and launch;
at Gemma 3 most vocabulary blocks hold one or two stored tiles (two to four 64-deep steps), and
at Llama N = 1024 every block holds at most eight. Persistent, the producer fills the stages for
a program's next tile while the consumer writes the last one's block of dC. Variants,
alternating over ROUNDS rounds:

- ``a program per tile``: ``classifier_product.persistent_programs`` returns more programs than
  tiles, so that each program takes one (the kernel as it was);
- ``persistent``: the patched kernel as it is (one program per SM).

Per variant: forward + backward medians (CUDA events, as ``experiments.bench``), one profiled
call's kernel times, and dE and dC against the first variant's.

Run from the repository root, with ``h100_ab_persistent_classifier_product.patch`` applied
(``git apply``; the variants need the code it adds):
``python results/dev/h100_ab_persistent_classifier_product.py OUT_DIR``.
"""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from ab_rounds import alternate  # noqa: E402
from cce import classifier_product  # noqa: E402

SHAPES = {"gemma3": (8192, 262144, 640), "llama3_8b_n1024": (1024, 128256, 4096),
          "gemma2_2b": (8192, 256000, 2304), "llama3_8b": (8192, 128256, 4096),
          "phi3_5_mini": (8192, 32064, 3072), "llama3_8b_n4096": (4096, 128256, 4096)}
ROUNDS = 3


@contextlib.contextmanager
def a_program_per_tile():
    programs = classifier_product.persistent_programs
    classifier_product.persistent_programs = lambda device: 2**31 - 1
    try:
        yield
    finally:
        classifier_product.persistent_programs = programs


VARIANTS = {"a program per tile": a_program_per_tile, "persistent": contextlib.nullcontext}

if __name__ == "__main__":
    alternate(SHAPES, VARIANTS, ROUNDS,
              Path(sys.argv[1]) / "h100_ab_persistent_classifier_product.json",
              "classifier_product_kernel")
