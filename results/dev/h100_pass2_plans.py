"""Pass 2's chunk plans at the A/B shapes of h100_ab_pass2_spare_switch.py, from the list lengths
of one real backward each (lm_like inputs, seed 1): chunks (and how many in the spare buffer)
with the free rows to the last block, with ties going to the spare buffer (the A/B's variant)
and with ties going to the free rows (``cce.backward._classifier_chunks``). Writes
h100_pass2_plans.json.

``python results/dev/h100_pass2_plans.py OUT_DIR`` from the repository root.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from unittest import mock

sys.path.insert(0, str(Path(__file__).parent))

import cce.backward  # noqa: E402
from ab_rounds import training_step  # noqa: E402
from experiments.harness import environment  # noqa: E402
from experiments.synthetic import lm_like_inputs  # noqa: E402
from h100_ab_pass2_spare_switch import (SHAPES, plan_with, planned,  # noqa: E402
                                        rows_to_the_last_block)

# The A/B's variant: the spare buffer once it takes at least as many blocks.
ties_to_the_spare = plan_with(lambda first, rows_end, spare_end: rows_end <= spare_end)


rows = []
for shape, (n, v, d) in SHAPES.items():
    seen = []

    def record(*args):
        seen.append(args)
        return planned(*args)

    e, c, targets = lm_like_inputs(n, v, d, seed=1, device="cuda")
    with mock.patch.object(cce.backward, "_classifier_chunks", record):
        training_step(e, c, targets)
    row = {"shape": shape}
    for name, planner in (("rows to the last block", rows_to_the_last_block),
                          ("ties to the spare", ties_to_the_spare),
                          ("ties to the rows", planned)):
        chunks = planner(*seen[0])
        row[name] = {"chunks": len(chunks), "in_spare": sum(s for _, s in chunks),
                     "blocks": [len(blocks) for blocks, _ in chunks]}
    rows.append(row)
    print(row, flush=True)
    del e, c, targets
Path(sys.argv[1], "h100_pass2_plans.json").write_text(
    json.dumps({"environment": environment(), "rows": rows}, indent=1) + "\n")
