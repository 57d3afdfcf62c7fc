"""Where the vocabulary order's time goes, and what cheaper sort keys would cost
(H200 study; writes h200_vocab_order_parts.json).

Per shape (bfloat16, lm_like_inputs, N = 8192 and Llama 3 8B at N = 1024), the median time
(harness.time_fn) of:

- ``order``: ``cce.vocab_order.vocab_order`` as it is, and ``order+positions`` with
  ``target_positions`` after it (what the forward's prologue runs);
- its parts: the two matrix-vector products, the stable descending float32 argsort, and the
  int32 cast;
- alternative sorts of the same average logits: a plain (not stable) float32 argsort, and
  stable ascending argsorts of 16-bit integer keys that order like -average (from the float16
  and bfloat16 roundings of the mean), with the share of entries whose position moves by more
  than one 256-entry tile against the float32 order.

Run from the repository root: ``python results/dev/h200_vocab_order_parts.py OUT_DIR``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from cce.vocab_order import target_positions, vocab_order
from experiments.harness import environment, time_fn
from experiments.synthetic import lm_like_inputs

SHAPES = {"gemma3": (8192, 262144, 640), "gemma2_2b": (8192, 256000, 2304),
          "llama3_8b": (8192, 128256, 4096), "llama3_8b_n1024": (1024, 128256, 4096),
          "phi3_5_mini": (8192, 32064, 3072)}
TILE = 256


def sortable_int16(x: torch.Tensor) -> torch.Tensor:
    """int16 keys whose signed order is the order of the 16-bit floats ``x``."""
    bits = x.view(torch.int16)
    return bits ^ ((bits >> 15) & 0x7FFF)


def main(out_dir: Path) -> None:
    results = {"environment": environment(), "tile": TILE, "shapes": {}}
    for name, (n, v, d) in SHAPES.items():
        e, c, targets = lm_like_inputs(n, v, d, seed=1, requires_grad=False)
        valid = (targets >= 0).to(e.dtype)
        mean_embedding = torch.mv(e.T, valid)
        average = torch.mv(c, mean_embedding).float()
        reference = torch.argsort(average, descending=True, stable=True)
        rank_of = torch.empty_like(reference)
        rank_of[reference] = torch.arange(v, device=e.device)
        mean = -average / valid.sum().float()
        keys = {"float16": sortable_int16(mean.half()), "bfloat16": sortable_int16(mean.bfloat16())}
        order = vocab_order(e, c, None, targets)
        row = {
            "order": time_fn(lambda: vocab_order(e, c, None, targets)),
            "order+positions": time_fn(
                lambda: target_positions(targets, vocab_order(e, c, None, targets))),
            "positions": time_fn(lambda: target_positions(targets, order)),
            "mv e.T valid": time_fn(lambda: torch.mv(e.T, valid)),
            "mv c mean": time_fn(lambda: torch.mv(c, mean_embedding)),
            "argsort float32 stable": time_fn(
                lambda: torch.argsort(average, descending=True, stable=True)),
            "argsort float32": time_fn(lambda: torch.argsort(average, descending=True)),
            "int32 cast": time_fn(lambda: reference.to(torch.int32)),
        }
        for label, key in keys.items():
            row[f"argsort {label} keys stable"] = time_fn(
                lambda key=key: torch.argsort(key, stable=True))
            moved = (rank_of[torch.argsort(key, stable=True)]
                     - torch.arange(v, device=e.device)).abs() > TILE
            row[f"{label} keys: share moved > tile"] = moved.float().mean().item()
        results["shapes"][name] = row
        print(name, json.dumps(row, indent=1), flush=True)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "h200_vocab_order_parts.json").write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
