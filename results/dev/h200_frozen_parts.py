"""Where the frozen-classifier step's time goes at the Gemma 2 2B shape (H200 study; writes
h200_frozen_parts.json).

1. Forward+backward medians (harness.time_fn) with the forward's copy of ``c`` in position
   order allowed (the default since N >= D) and refused, alternating over ROUNDS rounds.
2. One step under torch.profiler (CUDA activity only): kernel time by name, busy and span.
3. The copy itself: ``index_select`` with int32 and int64 indices against a plain copy of ``c``.

Run from the repository root: ``python results/dev/h200_frozen_parts.py OUT_DIR``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import cce
from cce import cce_function
from cce.vocab_order import vocab_order
from experiments.harness import environment, time_fn
from experiments.synthetic import lm_like_inputs
from results.dev.h200_small_levers import profile

N, V, D = 8192, 256000, 2304
ROUNDS = 3


def frozen_step(e, c, targets):
    cce.linear_cross_entropy(e, c, targets).backward()
    e.grad = None


def main(out_dir: Path) -> None:
    e, c, targets = lm_like_inputs(N, V, D, seed=1)
    c.requires_grad_(False)
    allowed = cce_function._may_copy_classifier
    results = {"environment": environment(), "shape": [N, V, D], "timings": []}
    for round_index in range(ROUNDS):
        for label, rule in [("copy", allowed), ("gather", lambda *args: False)]:
            cce_function._may_copy_classifier = rule
            ms = time_fn(lambda: frozen_step(e, c, targets), warmup=3, repeats=15)
            results["timings"].append({"variant": label, "round": round_index, "fwd_bwd_ms": ms})
            print(results["timings"][-1], flush=True)
    cce_function._may_copy_classifier = allowed
    results["profile"] = profile(e, c, targets)
    order = vocab_order(e, c, None, targets)
    wide = order.long()
    results["copy_ms"] = {
        "index_select int32": time_fn(lambda: c.index_select(0, order)),
        "index_select int64": time_fn(lambda: c.index_select(0, wide)),
        "clone": time_fn(lambda: c.clone()),
    }
    print(json.dumps(results["profile"], indent=1), results["copy_ms"], flush=True)
    (out_dir / "h200_frozen_parts.json").write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
