"""Deterministic mode's head size on the real Gemma 3 inputs: live tiles and forward + backward.

On the real inputs the head launch's bounds (8 forward tiles, 2048 positions of the order) left
47695 tiles of 131072 live at Gemma 3 against the default's 35271 (lm_like inputs of the same
shape: 33112 against 35579), and deterministic mode took 17.1-17.6 ms against 15.8-15.9
(``h200_ab_deterministic_real.json``). Here the head is 8, 16, 32 or 64 forward tiles; each
variant: the live table's size, and forward + backward timed as the benchmark times it, over
two alternated rounds. The default mode is the first variant.

``CCE_GEMMA3_GGUF=... PYTHONPATH=. python results/dev/h200_deterministic_head_sweep.py OUT_DIR``
from the repository root, with the real model importable.
"""

from __future__ import annotations

import contextlib
import functools
import json
import sys
from pathlib import Path
from unittest import mock

import torch

sys.path.insert(0, str(Path(__file__).parent))

import cce.cce_function  # noqa: E402
from ab_rounds import training_step  # noqa: E402
from experiments.harness import environment, time_fn  # noqa: E402
from h200_ab_deterministic_head_size import deterministic_with_head  # noqa: E402
from h200_ab_deterministic_real import real_inputs  # noqa: E402

HEADS = (8, 16, 32, 64)


def variant(head):
    """A context in which cce runs deterministic with a head of ``head`` tiles (None: default)."""
    return contextlib.nullcontext() if head is None else deterministic_with_head(head)


def live_count(e, c, targets) -> int:
    seen = {}
    table = cce.cce_function.recompute_table

    def counting(*args, **kwargs):
        live = table(*args, **kwargs)
        seen["live"] = int((live != 0).sum())
        return live

    with mock.patch.object(cce.cce_function, "recompute_table", counting):
        training_step(e, c, targets)
    return seen["live"]


def main(out_dir: Path) -> None:
    rows = []
    for name in ("gemma3", "gemma3_masked"):
        e, c, targets = real_inputs(name)
        for round_index in range(2):
            for head in (None, *HEADS):
                with variant(head):
                    row = {"shape": name, "head": head, "round": round_index,
                           "live_tiles": live_count(e, c, targets),
                           "fwd_bwd_ms": time_fn(functools.partial(training_step, e, c, targets),
                                                 warmup=5, repeats=20)}
                rows.append(row)
                print(row, flush=True)
        del e, c, targets
        torch.cuda.empty_cache()
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "h200_deterministic_head_sweep.json").write_text(
        json.dumps({"environment": environment(), "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
