"""Where in the vocabulary order the kept tiles lie: how much of dE's product a copy of the head of
``c`` (its first positions' rows, contiguous) would cover (study, CPU, no timing).

dE's product reads, for every kept tile, its 128 rows of ``c`` gathered through the vocabulary
order, by cp.async, at about 55% of cuBLAS; rows that are contiguous in memory could come by TMA
(86%, docs/notes/backward.md, "What feeds the products"). A copy of all of ``c`` in position order
does not fit in the backward's memory, but a copy of its first P positions might share the
scratch with the tiles. This counts, on the benchmark's calibrated inputs
(:func:`experiments.synthetic.lm_like_inputs`, seed 1, as ``experiments.bench``), the kept tiles
(128 tokens x 128 positions with a softmax entry >= 2^-12, the exact filter) that lie in the
first P of the positions, for several P.

``python results/dev/cpu_kept_tiles_by_position.py`` writes ``cpu_kept_tiles_by_position.json``
beside itself.
"""

import json
import math
from pathlib import Path

import torch

from cce.vocab_order import vocab_order
from experiments.synthetic import lm_like_inputs

SHAPES = {"gemma2_2b": (256000, 2304), "llama3_8b": (128256, 4096), "phi3_5_mini": (32064, 3072)}
TOKENS = 2048  # the share depends on each row's softmax, not on the token count
TILE = 128
EPS = 2.0**-12
HEADS = (0.05, 0.1, 0.2, 0.3, 0.5)


def kept_tiles(e: torch.Tensor, c: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """bool (token blocks, position blocks): tiles with a softmax entry >= EPS."""
    num_blocks = math.ceil(c.shape[0] / TILE)
    kept = torch.zeros(math.ceil(e.shape[0] / TILE), num_blocks, dtype=torch.bool)
    sorted_c = c[order.long()].float()
    for block, rows in enumerate(e.float().split(TILE)):
        probs = torch.softmax(rows @ sorted_c.T, dim=1)
        padded = torch.nn.functional.pad(probs >= EPS, (0, num_blocks * TILE - c.shape[0]))
        kept[block] = padded.view(rows.shape[0], num_blocks, TILE).any(2).any(0)
    return kept


def main() -> None:
    results = {"tokens": TOKENS, "tile": TILE, "eps": EPS, "inputs": "lm_like_inputs, seed 1",
               "shapes": {}}
    for name, (vocab, dim) in SHAPES.items():
        e, c, targets = lm_like_inputs(TOKENS, vocab, dim, seed=1, device="cpu",
                                       requires_grad=False)
        order = vocab_order(e, c, None, targets)
        kept = kept_tiles(e, c, order)
        by_position = kept.sum(0).double().cumsum(0) / kept.sum()
        num_blocks = kept.shape[1]
        share = {f"{head:g}": float(by_position[max(0, math.ceil(head * num_blocks) - 1)])
                 for head in HEADS}
        results["shapes"][name] = {"kept_fraction": float(kept.float().mean()),
                                   "kept_share_in_first_positions": share}
        print(name, results["shapes"][name], flush=True)
    Path(__file__).with_suffix(".json").write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
