"""Deterministic mode's head of 8 forward tiles against 32, and the default, alternated on the
benchmark's synthetic shapes and at N = 1024: whether the larger head that tightens the real
Gemma 3 inputs' bounds (``h200_deterministic_head_sweep.json``) costs elsewhere.

``PYTHONPATH=. python results/dev/h200_ab_deterministic_head_size.py OUT_DIR NAME`` from the
repository root.
"""

from __future__ import annotations

import contextlib
import functools
import sys
from pathlib import Path
from unittest import mock

sys.path.insert(0, str(Path(__file__).parent))

import cce.lse_forward  # noqa: E402
from ab_rounds import alternate  # noqa: E402
from h100_ab_deterministic_head import SHAPES, VARIANTS as HEAD_AB_VARIANTS  # noqa: E402


def deterministic_with_head(head: int) -> contextlib.ExitStack:
    """The head A/B's deterministic variant with a head of ``head`` forward tiles."""
    stack = contextlib.ExitStack()
    stack.enter_context(mock.patch.object(cce.lse_forward, "deterministic_head_blocks",
                                          lambda blocks: min(head, blocks)))
    stack.enter_context(HEAD_AB_VARIANTS["deterministic"]())
    return stack


VARIANTS = {"default": contextlib.nullcontext,
            "head 8": functools.partial(deterministic_with_head, 8),
            "head 32": functools.partial(deterministic_with_head, 32)}

if __name__ == "__main__":
    alternate(SHAPES, VARIANTS, rounds=2, out_file=Path(sys.argv[1]) / f"{sys.argv[2]}.json",
              watched_kernel="lse_forward_kernel")
