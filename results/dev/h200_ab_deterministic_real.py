"""Deterministic mode against the default on the real Gemma 3 inputs, alternated: the
benchmark of 2026-11-27 (``results/bench.md``, H200, one run) gave deterministic mode 18.2 ms
forward + backward against 16.1 at Gemma 3 (backward 11.0 against 9.7), while the alternated
rounds on lm_like inputs of the same shape (``h100_ab_deterministic_head.json``) gave 15.91
against 15.87. The backward's kernels' times say where a difference comes from.

``CCE_GEMMA3_GGUF=... PYTHONPATH=. python results/dev/h200_ab_deterministic_real.py OUT_DIR NAME``
from the repository root, with the real model importable (``experiments.real_model``).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from ab_rounds import alternate  # noqa: E402
from experiments.bench import SHAPES as BENCH_SHAPES, shape_inputs  # noqa: E402
from h100_ab_deterministic_head import VARIANTS  # noqa: E402

SHAPES = {name: (BENCH_SHAPES[name].n_tokens, BENCH_SHAPES[name].vocab_size,
                 BENCH_SHAPES[name].dim) for name in ("gemma3", "gemma3_masked")}


def real_inputs(name: str) -> tuple:
    e, c, targets, source = shape_inputs(BENCH_SHAPES[name])
    if not source.startswith("real"):
        raise SystemExit(f"{name}: {source}")
    return e, c, targets


if __name__ == "__main__":
    alternate(SHAPES, VARIANTS, rounds=3, out_file=Path(sys.argv[1]) / f"{sys.argv[2]}.json",
              watched_kernel="gradient_tiles_kernel", inputs=real_inputs)
