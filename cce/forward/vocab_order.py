"""Vocabulary sorting: the order of the vocabulary and where each target lands in it.

The paper orders the vocabulary by average logit, accumulated in the forward with an atomic
add. The average of ``e_i . c_v + b_v`` over tokens is exactly ``mean(e) . c_v + b_v``: one
matrix-vector product, cheap enough to run *before* the forward, so that the forward walks the
sorted vocabulary too and its per-tile bounds describe the backward's tiles. (With a softcap
the order is that of the pre-cap average: the cap is monotone, and the order only changes speed.)
The same read of ``c`` sums its rows, which the backward's mass correction needs
(:mod:`cce.forward.classifier_sums`).
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from cce.forward import classifier_sums


class SortedVocabulary(NamedTuple):
    order: torch.Tensor  # int32 (V,)
    classifier_row_sum: torch.Tensor  # float32 (D,): c.sum(0), from the same read of c


def sort_vocabulary(e: torch.Tensor, c: torch.Tensor, bias: Optional[torch.Tensor],
                    targets: torch.Tensor) -> SortedVocabulary:
    """The vocabulary order (:func:`vocab_order`) and the sum of the rows of ``c``."""
    valid = (targets >= 0).to(e.dtype)
    # e.T @ valid avoids an (N, D) temporary; the scale of the mean does not change the order.
    mean_embedding = torch.mv(e.T, valid)
    average_logit, row_sum = classifier_sums.classifier_sums(c, mean_embedding)
    if bias is not None:
        average_logit = average_logit + bias.float() * valid.sum()
    # Stable: equal average logits (tied or repeated classifier rows) keep one order every call.
    order = torch.argsort(average_logit, descending=True, stable=True).to(torch.int32)
    return SortedVocabulary(order, row_sum)


def vocab_order(e: torch.Tensor, c: torch.Tensor, bias: Optional[torch.Tensor],
                targets: torch.Tensor) -> torch.Tensor:
    """int32 (V,) vocabulary indices by decreasing average logit over non-ignored tokens."""
    return sort_vocabulary(e, c, bias, targets).order


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
