"""How long the products' tile lists are at the benchmark's shapes: per vocabulary block, the
token blocks whose tiles dC's program walks, and per token block, the vocabulary blocks dE's
walks (study, CPU, no timing).

At the Gemma 3 shape (D = 640) the dC product runs at 34% of cuBLAS although its rows of e fit
in L2, against 52-73% at the other shapes (`results/roofline.md`). A program's fixed cost (its
pipeline's start, the 128 x 256 output it stores) weighs most where its list is short. This
counts, on the benchmark's calibrated inputs (:func:`experiments.synthetic.lm_like_inputs`, seed
1, N = 8192), the kept tiles (128 x 128 with a softmax entry >= 2^-12: the exact filter, the
tiles the products multiply) per block, and the share of the tiles in short lists.

``python results/dev/cpu_product_list_lengths.py`` writes ``cpu_product_list_lengths.json``
beside itself.
"""

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

from cpu_kept_tiles_by_position import kept_tiles  # noqa: E402
from cce.vocab_order import vocab_order  # noqa: E402
from experiments.synthetic import lm_like_inputs  # noqa: E402

TOKENS = 8192
SHAPES = {"gemma3": (262144, 640), "phi3_5_mini": (32064, 3072), "llama3_8b": (128256, 4096),
          "gemma2_2b": (256000, 2304)}
SHORT = (1, 2, 4, 8, 16)


def lengths_summary(lengths: torch.Tensor) -> dict:
    """Quantiles of the list lengths, the empty lists, and the share of all listed tiles in lists
    of at most k tiles."""
    lengths = lengths.double()
    tiles = lengths.sum()
    return {"lists": lengths.numel(), "longest": int(lengths.max()),
            "empty": int((lengths == 0).sum()),
            "quantiles (10, 25, 50, 75, 90%)": [
                float(q) for q in torch.quantile(lengths, torch.tensor(
                    [0.1, 0.25, 0.5, 0.75, 0.9], dtype=torch.float64))],
            "lists of at most k tiles": {k: int(((lengths > 0) & (lengths <= k)).sum())
                                         for k in SHORT},
            "share of tiles in lists of at most k": {
                k: float(lengths[lengths <= k].sum() / tiles) for k in SHORT}}


def main() -> None:
    results = {"tokens": TOKENS, "inputs": "lm_like_inputs, seed 1",
               "filter": "exact, 2^-12, 128 x 128 tiles", "shapes": {}}
    for name, (vocab, dim) in SHAPES.items():
        e, c, targets = lm_like_inputs(TOKENS, vocab, dim, seed=1, device="cpu",
                                       requires_grad=False)
        kept = kept_tiles(e, c, vocab_order(e, c, None, targets))
        results["shapes"][name] = {
            "V": vocab, "D": dim, "kept_fraction": float(kept.float().mean()),
            "dC: token blocks per vocabulary block": lengths_summary(kept.sum(0)),
            "dE: vocabulary blocks per token block": lengths_summary(kept.sum(1))}
        print(name, json.dumps(results["shapes"][name]), flush=True)
    Path(__file__).with_suffix(".json").write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
