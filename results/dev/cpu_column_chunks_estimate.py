"""How many column chunks a backward with one recompute per tile would take (study, CPU, no
timing): the proposal of docs/notes/backward.md, "Column chunks with one recompute per tile".

Pass 2's planner (:func:`cce.backward._classifier_chunks`) places each chunk's tiles in the rows
of dC of later positions. The proposal also keeps a float32 dE accumulator (N x D) in the rows of
dC written last, so those rows hold no tiles: the planner runs here on a vocabulary shortened by
as many rows (2N for 16-bit dC). Tiles per vocabulary block: the kept tiles
(:func:`cpu_kept_tiles_by_position.kept_tiles`, the exact filter without the targets' tiles) of
the benchmark's calibrated inputs (:func:`experiments.synthetic.lm_like_inputs`, seed 1) at
2048 tokens, times 4 for N = 8192 (the share of a block's tiles that is kept is a per-row
statistic). The proposal would store live tiles, a few percent more than kept ones (roofline:
+11% at 2B, +14% at Gemma 3, +0.2% at Phi), so these counts are a lower bound.

``python results/dev/cpu_column_chunks_estimate.py`` writes ``cpu_column_chunks_estimate.json``
beside itself.
"""

import importlib.util
import json
from pathlib import Path

from cce.backward import _classifier_chunks
from cce.config import spare_scratch_bytes
from cce.vocab_order import vocab_order
from experiments.bench import SHAPES
from experiments.synthetic import lm_like_inputs

_SPEC = importlib.util.spec_from_file_location(
    "cpu_kept_tiles_by_position", Path(__file__).with_name("cpu_kept_tiles_by_position.py"))
kept_study = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(kept_study)

SHAPE_NAMES = ("gemma3", "gemma2_2b", "phi3_5_mini")
TILE = kept_study.TILE
ELEMENT_BYTES = 2  # bf16 dC
COPY_GB_PER_S = 3007.2  # results/roofline.md, H100 copy bandwidth (read + write)


def plan(tiles_per_block, vocab_size: int, dim: int) -> dict:
    spare_tiles = max(spare_scratch_bytes() // (TILE * TILE * ELEMENT_BYTES),
                      int(tiles_per_block.max()))
    chunks = _classifier_chunks(tiles_per_block, vocab_size, dim, TILE, TILE, True, spare_tiles)
    return {"chunks": len(chunks), "in_spare_buffer": sum(spare for _, spare in chunks),
            "blocks_in_spare_buffer": sum(len(blocks) for blocks, spare in chunks if spare)}


def main() -> None:
    results = {"tokens_counted": kept_study.TOKENS, "scaled_to": {}, "inputs":
               "lm_like_inputs, seed 1", "shapes": {}}
    for name in SHAPE_NAMES:
        shape = SHAPES[name]
        n, vocab, dim = shape.n_tokens, shape.vocab_size, shape.dim
        e, c, targets = lm_like_inputs(kept_study.TOKENS, vocab, dim, seed=1, device="cpu",
                                       requires_grad=False)
        order = vocab_order(e, c, None, targets)
        kept = kept_study.kept_tiles(e, c, order)
        tiles_per_block = kept.sum(0).numpy().astype("int64") * (n // kept_study.TOKENS)
        accumulator_rows = n * 4 // ELEMENT_BYTES  # float32 N x D in rows of D 16-bit entries
        accumulator_bytes = n * dim * 4
        proposal = plan(tiles_per_block, vocab - accumulator_rows, dim)
        results["scaled_to"][name] = n
        results["shapes"][name] = {
            "kept_fraction": float(kept.float().mean()),
            "pass2_today": plan(tiles_per_block, vocab, dim),
            "proposal": proposal,
            "accumulator_mb": accumulator_bytes / 2**20,
            # Each chunk reads and writes the accumulator once.
            "accumulator_traffic_ms": (proposal["chunks"] * 2 * accumulator_bytes
                                       / (COPY_GB_PER_S * 1e6)),
        }
        print(name, results["shapes"][name], flush=True)
    Path(__file__).with_suffix(".json").write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
