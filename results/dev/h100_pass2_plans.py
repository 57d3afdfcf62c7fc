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

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))

import cce.backward  # noqa: E402
from ab_rounds import training_step  # noqa: E402
from experiments.harness import environment  # noqa: E402
from experiments.synthetic import lm_like_inputs  # noqa: E402
from h100_ab_pass2_spare_switch import SHAPES, rows_to_the_last_block  # noqa: E402

planned = cce.backward._classifier_chunks


def ties_to_the_spare(tiles_per_block, vocab_size, dim, block_tokens, block_vocab,
                      rows_hold_segments, spare_tiles):
    """The A/B's variant: the spare buffer once it takes at least as many blocks."""
    tiles_before = cce.backward._tiles_before(tiles_per_block)
    segments_per_row = dim // block_vocab
    footprint = (tiles_before * block_tokens
                 + np.arange(len(tiles_per_block) + 1, dtype=np.int64) * block_vocab
                 * segments_per_row)
    chunks, first, in_spare = [], 0, not rows_hold_segments
    while first < len(tiles_per_block):
        spare_end = cce.backward._spare_chunk_end(tiles_before, first, spare_tiles)
        if not in_spare:
            room = vocab_size * segments_per_row + tiles_before[first] * block_tokens
            rows_end = int(np.searchsorted(footprint, room, side="right")) - 1
            in_spare = rows_end <= spare_end
        end = spare_end if in_spare else rows_end
        chunks.append((range(first, end), in_spare))
        first = end
    return chunks


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
