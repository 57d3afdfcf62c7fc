"""Would a recompute of two neighbouring grid tiles per program (128 tokens x 256 positions, the
forward's tile) pay? Only if the two are usually kept together (study, CPU, no timing).

The recompute runs one 128 x 128 tile per program at 46-70% of cuBLAS; the forward's 128 x 256
tiles were 20-27% faster per FLOP than 128 x 128 ones (docs/notes/forward.md, "Tile shape"). A
program for the pair of position blocks (2j, 2j + 1) of a token block computes both tiles whenever
either is kept, so it does ``2 x pairs with a kept tile`` tiles' work for the kept tiles'. This
counts that ratio on the benchmark's calibrated inputs (:func:`experiments.synthetic.lm_like_inputs`,
seed 1), with kept tiles as in ``cpu_kept_tiles_by_position.py`` (a softmax entry >= 2^-12).

``token_pairs``: the same count for two neighbouring token blocks (2i, 2i + 1) of a position
block, which a dE product with 256 x 128 output blocks would take together. Per FLOP it gathers
half as many rows of ``c`` (its slow operand) as today's 128 x 256 blocks, but it multiplies
both tiles wherever either is kept.

``python results/dev/cpu_kept_tile_pairs.py`` writes ``cpu_kept_tile_pairs.json`` beside itself.
"""

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

from cpu_kept_tiles_by_position import EPS, TILE, TOKENS, kept_tiles  # noqa: E402
from cce.vocab_order import vocab_order  # noqa: E402
from experiments.synthetic import lm_like_inputs  # noqa: E402

SHAPES = {"gemma3_270m": (262144, 640), "gemma2_2b": (256000, 2304),
          "llama3_8b": (128256, 4096), "phi3_5_mini": (32064, 3072)}


def pair_counts(kept: torch.Tensor) -> dict:
    """Pairs of neighbouring columns (2j, 2j + 1) of ``kept`` with both or one tile kept, and the
    work of computing both tiles of every pair with a kept one, over the kept tiles' work."""
    pairs = kept.shape[1] // 2 * 2
    left, right = kept[:, 0:pairs:2], kept[:, 1:pairs:2]
    both, one = int((left & right).sum()), int((left ^ right).sum())
    return {"pairs_both_kept": both, "pairs_one_kept": one,
            "pair_work_over_kept_work": 2 * (both + one) / int(kept[:, :pairs].sum())}


def main() -> None:
    results = {"tokens": TOKENS, "tile": TILE, "eps": EPS, "inputs": "lm_like_inputs, seed 1",
               "shapes": {}}
    for name, (vocab, dim) in SHAPES.items():
        e, c, targets = lm_like_inputs(TOKENS, vocab, dim, seed=1, device="cpu",
                                       requires_grad=False)
        kept = kept_tiles(e, c, vocab_order(e, c, None, targets))
        results["shapes"][name] = {"kept_fraction": float(kept.float().mean()),
                                   **pair_counts(kept), "token_pairs": pair_counts(kept.T)}
        print(name, results["shapes"][name], flush=True)
    Path(__file__).with_suffix(".json").write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
