"""Vocabulary sorting and the table of tiles the backward cannot skip without looking.

The paper orders the vocabulary by average logit, accumulated in the forward with an atomic
add. The average of ``e_i . c_v + b_v`` over tokens is exactly ``mean(e) . c_v + b_v``: one
matrix-vector product, cheap enough to run *before* the forward, so that the forward walks the
sorted vocabulary too and its per-tile bounds describe the backward's tiles. (With a softcap
the order is that of the pre-cap average: the cap is monotone, and the order only changes speed.)
"""

from __future__ import annotations

import math
from typing import Optional

import torch


def vocab_order(e: torch.Tensor, c: torch.Tensor, bias: Optional[torch.Tensor],
                targets: torch.Tensor) -> torch.Tensor:
    """int32 (V,) vocabulary indices by decreasing average logit over non-ignored tokens."""
    valid = (targets >= 0).to(e.dtype)
    # e.T @ valid avoids an (N, D) temporary; the scale of the mean does not change the order.
    mean_embedding = torch.mv(e.T, valid)
    average_logit = torch.mv(c, mean_embedding)
    if bias is not None:
        average_logit = average_logit + bias * valid.sum()
    return torch.argsort(average_logit.float(), descending=True).to(torch.int32)


def target_positions(targets: torch.Tensor, vocab_order: Optional[torch.Tensor]) -> torch.Tensor:
    """int32 (N,) position of each token's target in the vocabulary order (the target itself
    without sorting), -1 for ignored tokens."""
    valid = targets >= 0
    positions = targets.clamp(min=0)
    if vocab_order is not None:
        position_of = torch.empty_like(vocab_order)
        position_of[vocab_order.long()] = torch.arange(vocab_order.shape[0], dtype=torch.int32,
                                                       device=vocab_order.device)
        positions = position_of[positions]
    return torch.where(valid, positions, -1).to(torch.int32)


def live_tiles(tile_bound: torch.Tensor, lse: torch.Tensor, prob_scale: torch.Tensor,
               target_positions: torch.Tensor, block_tokens: int, block_vocab: int,
               filter_eps: float) -> torch.Tensor:
    """int32 (token blocks, vocabulary blocks) table, 0 where no softmax entry can reach
    ``filter_eps``: the forward's log-probability bound of the tile is below log(filter_eps).

    ``tile_bound`` covers the non-ignored tokens only (see :func:`cce.lse_forward.lse_forward`),
    so ignored tokens (a masked prompt) do not keep tiles live. An ignored token whose
    probabilities do carry a gradient (through the returned LSE, ``prob_scale != 0``) is not
    covered: its whole token block stays live. Tiles that hold a token's target are always live
    (their gradient has the -1 of the target). A NaN bound or LSE keeps the tile live, so NaN
    inputs still reach the gradients. ``target_positions``: from :func:`target_positions`.
    """
    num_token_blocks = tile_bound.shape[0]
    padding = num_token_blocks * block_tokens - lse.shape[0]

    def any_per_block(rows: torch.Tensor) -> torch.Tensor:
        padded = torch.nn.functional.pad(rows.float(), (0, padding))
        return padded.view(num_token_blocks, block_tokens).amax(dim=1) > 0

    live = ~(tile_bound < math.log(filter_eps))
    valid = target_positions >= 0
    uncovered = any_per_block((~valid & (prob_scale != 0)) | lse.isnan())
    live |= uncovered[:, None]

    target_block = target_positions.clamp(min=0).long() // block_vocab
    token_block = torch.arange(valid.shape[0], device=valid.device) // block_tokens
    live = live.to(torch.int32)  # counts: a scatter of booleans would race on duplicates
    live.index_put_((token_block, target_block), valid.to(torch.int32), accumulate=True)
    return live
