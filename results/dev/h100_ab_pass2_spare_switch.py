"""Pass 2's chunks: the spare buffer as soon as it takes more vocabulary blocks than dC's free
rows (``cce.backward._classifier_chunks``), against the free rows until not one block fits
(the rule before); H100 A/B, writes h100_ab_pass2_spare_switch.json.

Nsight Compute (h100_backward_ncu.*) showed pass 2 at the Gemma 3 shape in 17 chunks, the last
9 under one wave of either kernel (3-114 dC programs, 14-35 us each) as the free rows ran out:
each chunk halves the blocks left. Also prints each variant's number of chunks per call.
The measured variant ("spare when as wide") gave ties to the spare buffer; the library gives
them to the free rows (h100_pass2_plans.py compares the plans).

``python results/dev/h100_ab_pass2_spare_switch.py OUT_DIR`` from the repository root.
"""

from __future__ import annotations

import sys
from pathlib import Path
from unittest import mock

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))

import cce.backward  # noqa: E402
from ab_rounds import alternate  # noqa: E402

SHAPES = {"gemma3": (8192, 262144, 640), "gemma2_2b": (8192, 256000, 2304),
          "phi3_5_mini": (8192, 32064, 3072), "llama3_8b_n16384": (16384, 128256, 4096)}
planned = cce.backward._classifier_chunks


def plan_with(switch):
    """Pass 2's planner with another rule for leaving dC's free rows: ``switch(first, rows_end,
    spare_end)`` -> whether the chunk from block ``first`` goes to the spare buffer, given the
    widest chunks that fit in the rows and in the buffer."""
    def plan(tiles_per_block, vocab_size, dim, block_tokens, block_vocab, rows_hold_segments,
             spare_tiles):
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
                in_spare = switch(first, rows_end, spare_end)
            end = spare_end if in_spare else rows_end
            chunks.append((range(first, end), in_spare))
            first = end
        return chunks
    return plan


# The rule before: dC's free rows until not even one block's tiles fit there.
rows_to_the_last_block = plan_with(lambda first, rows_end, spare_end: rows_end == first)
rows_to_the_last_block.__name__ = "rows_to_the_last_block"


def counted(planner):
    def plan(*args):
        chunks = planner(*args)
        print("chunks", planner.__name__, len(chunks), sum(s for _, s in chunks), flush=True)
        return chunks
    return plan


VARIANTS = {
    "rows to the last block": lambda: mock.patch.object(
        cce.backward, "_classifier_chunks", counted(rows_to_the_last_block)),
    "spare when as wide": lambda: mock.patch.object(
        cce.backward, "_classifier_chunks", counted(planned)),
}

if __name__ == "__main__":
    alternate(SHAPES, VARIANTS, rounds=3,
              out_file=Path(sys.argv[1]) / "h100_ab_pass2_spare_switch.json",
              watched_kernel="classifier_product_kernel")
