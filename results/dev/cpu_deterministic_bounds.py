"""What a timing-free live table would cost: the forward's tile bounds without the merged LSE
(study, CPU, no timing).

The forward bounds each tile's log-probabilities by ``max_i(max_j z_ij - L_i)``, with ``L_i`` a
lower bound of row i's LSE: the target's logit, the LSE of the program's own tiles so far, and
the merged LSE of the programs that finished before (read without the lock). That last term
depends on when the programs ran, so the live table does too, also in deterministic mode; the
backward's results do not, but its one pass / two passes choice reads the table's counts
(``docs/notes/semantics.md``). Leaving the merged LSE out makes the table a function of the
inputs alone. This counts, on the benchmark's calibrated inputs
(:func:`experiments.synthetic.lm_like_inputs`, seed 1), the live fraction of 128 x 128 tiles:

- ``exact``: tiles with a softmax entry >= 2^-12 (what the backward's exact filter keeps);
- ``merged``: the forward's bound with the full LSE known to every program past the first two
  splits (programs run in split order, one per SM: by the third split's wave the head of the
  order, most of the mass, is merged), own LSE and target otherwise;
- ``own``: the bound from the target's logit and the program's own tiles only;
- ``head_H``: a first launch covers the first H forward tiles of the order (the head, most of
  the mass), one program per tile (``own`` bounds from that tile alone), so that it fills the
  GPU at any N; the rest, in the forward's splits, adds the head's LSE to ``own``
  (``head_split``: H = one split's tiles).

Splits as the forward's at N = 8192 on 132 SMs (``config.forward_vocab_splits``), 256-wide
forward tiles (two live-grid tiles), the live table's rounding margin (2^-7). The GPU's table
(``cce_table`` in the benchmark's input notes) lies between ``exact`` and ``merged``.

``python results/dev/cpu_deterministic_bounds.py`` writes ``cpu_deterministic_bounds.json``
beside itself.
"""

import json
import math
from pathlib import Path

import torch

from cce.vocab_order import vocab_order
from experiments.synthetic import lm_like_inputs

SHAPES = {"gemma3": (262144, 640), "gemma2_2b": (256000, 2304), "llama3_8b": (128256, 4096),
          "phi3_5_mini": (32064, 3072)}
TOKENS = 1024
TILE = 128
FORWARD_TILE = 256
EPS = 2.0**-12
MARGIN = 2.0**-7
PROGRAMS = 8 * 132  # forward programs at N = 8192: 8 per SM on an H100
TOKEN_BLOCKS_AT_8192 = 8192 // TILE
MIN_BLOCKS_PER_PROGRAM = 8
HEADS = (2, 4, 8, 16)  # forward tiles in the head's launch


def splits(num_forward_blocks: int) -> int:
    wanted = -(-PROGRAMS // TOKEN_BLOCKS_AT_8192)
    return min(max(1, min(num_forward_blocks, wanted)),
               -(-num_forward_blocks // MIN_BLOCKS_PER_PROGRAM))


def own_lower_bounds(forward_lse: torch.Tensor, target_logit: torch.Tensor, first: int,
                     last: int) -> torch.Tensor:
    """Each forward tile's LSE lower bound from the target and a program's own tiles so far."""
    own = torch.logcumsumexp(forward_lse[:, first:last], dim=1)  # incl. the current tile
    return torch.maximum(own, target_logit[:, None])


def head_bounds(tile_max: torch.Tensor, forward_lse: torch.Tensor, target_logit: torch.Tensor,
                head: int, num_splits: int) -> torch.Tensor:
    """Live-grid tile bounds with the first ``head`` forward tiles in a launch of their own,
    whose LSE bounds the rest, split in ``num_splits`` programs per token block."""
    num_forward = forward_lse.shape[1]
    head_lse = torch.logsumexp(forward_lse[:, :head], dim=1)
    lowers = [torch.maximum(forward_lse[:, :head], target_logit[:, None])]
    per_program = math.ceil((num_forward - head) / num_splits)
    for first in range(head, num_forward, per_program):
        last = min(first + per_program, num_forward)
        lowers.append(torch.maximum(own_lower_bounds(forward_lse, target_logit, first, last),
                                    head_lse[:, None]))
    lower = torch.cat(lowers, dim=1).repeat_interleave(2, dim=1)
    return (tile_max - lower).amax(0)


def live_fractions(e: torch.Tensor, c: torch.Tensor, targets: torch.Tensor,
                   order: torch.Tensor) -> dict:
    vocab = c.shape[0]
    num_forward = math.ceil(vocab / FORWARD_TILE)
    num_splits = splits(num_forward)
    per_program = math.ceil(num_forward / num_splits)
    padded = num_forward * FORWARD_TILE
    positions = torch.empty(vocab, dtype=torch.long)
    positions[order.long()] = torch.arange(vocab)
    sorted_c = c[order.long()].float()
    log_eps = math.log(EPS)
    heads = {f"head_{h}": h for h in HEADS if h < per_program}
    heads["head_split"] = per_program
    counts = {"exact": 0, "merged": 0, "own": 0, **{name: 0 for name in heads}}
    tiles = 0
    for rows, row_targets in zip(e.float().split(TILE), targets.split(TILE)):
        logits = torch.nn.functional.pad(rows @ sorted_c.T, (0, padded - vocab),
                                         value=float("-inf"))
        lse = torch.logsumexp(logits, dim=1)
        target_logit = logits.gather(1, positions[row_targets][:, None])[:, 0]
        # Row maxima per live-grid tile, and each forward tile's log-sum-exp.
        tile_max = logits.view(len(rows), -1, TILE).amax(2)  # (rows, live tiles)
        forward_lse = torch.logsumexp(logits.view(len(rows), num_forward, FORWARD_TILE), dim=2)
        exact = (tile_max - lse[:, None]).amax(0) >= log_eps
        merged_bound, own_bound = [], []
        for split in range(num_splits):
            first, last = split * per_program, min((split + 1) * per_program, num_forward)
            if first >= last:
                continue
            own_lower = own_lower_bounds(forward_lse, target_logit, first, last)
            merged_lower = lse[:, None].expand_as(own_lower) if split >= 2 else own_lower
            for lower, out in ((own_lower, own_bound), (merged_lower, merged_bound)):
                per_forward_tile = lower.repeat_interleave(2, dim=1)
                out.append((tile_max[:, 2 * first:2 * last] - per_forward_tile).amax(0))
        # Each block's targets' tiles are live whatever their bound.
        target_tiles = torch.zeros(num_forward * 2, dtype=torch.bool)
        target_tiles[positions[row_targets] // TILE] = True
        for name, verdict in (("exact", exact),
                              ("merged", torch.cat(merged_bound) >= log_eps - MARGIN),
                              ("own", torch.cat(own_bound) >= log_eps - MARGIN),
                              *((name, head_bounds(tile_max, forward_lse, target_logit, h,
                                                   num_splits) >= log_eps - MARGIN)
                                for name, h in heads.items())):
            counts[name] += int((verdict | target_tiles)[:math.ceil(vocab / TILE)].sum())
        tiles += math.ceil(vocab / TILE)
    return {"splits": num_splits, "forward_blocks_per_program": per_program,
            **{name: count / tiles for name, count in counts.items()}}


def main() -> None:
    results = {"tokens": TOKENS, "tile": TILE, "eps": EPS, "margin": MARGIN,
               "inputs": "lm_like_inputs, seed 1", "shapes": {}}
    for name, (vocab, dim) in SHAPES.items():
        e, c, targets = lm_like_inputs(TOKENS, vocab, dim, seed=1, device="cpu",
                                       requires_grad=False)
        order = vocab_order(e, c, None, targets)
        results["shapes"][name] = live_fractions(e, c, targets, order)
        print(name, results["shapes"][name], flush=True)
    Path(__file__).with_suffix(".json").write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
