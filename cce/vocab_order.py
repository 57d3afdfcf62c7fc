"""Vocabulary sorting: the order of the vocabulary and where each target lands in it.

The paper orders the vocabulary by average logit, accumulated in the forward with an atomic
add. The average of ``e_i . c_v + b_v`` over tokens is exactly ``mean(e) . c_v + b_v``: one
matrix-vector product, cheap enough to run *before* the forward, so that the forward walks the
sorted vocabulary too and its per-tile bounds describe the backward's tiles. (With a softcap
the order is that of the pre-cap average: the cap is monotone, and the order only changes speed.)

The filter correction (:mod:`cce.filter_correction`) needs ``c`` times a few directions too;
:func:`sort_and_project` gets both from one read of ``c``, whose size sets the cost.
"""

from __future__ import annotations

from typing import Optional

import torch

_COLUMN_MULTIPLE = 8  # a product whose columns are a multiple of 8 takes the tensor cores' path


def vocab_order(e: torch.Tensor, c: torch.Tensor, bias: Optional[torch.Tensor],
                targets: torch.Tensor) -> torch.Tensor:
    """int32 (V,) vocabulary indices by decreasing average logit over non-ignored tokens."""
    return sort_and_project(e, c, bias, targets, sorts=True)[0]


def sort_and_project(e: torch.Tensor, c: torch.Tensor, bias: Optional[torch.Tensor],
                     targets: torch.Tensor, sorts: bool,
                     directions: Optional[torch.Tensor] = None,
                     ) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    """(order, projections): the order of :func:`vocab_order` when ``sorts`` (else None), and,
    given ``directions`` (float32 (D, r)), ``c @ directions`` in c's dtype with its rows in
    position order (vocabulary order if ``sorts``), else None. One product reads ``c`` for both."""
    if not sorts and directions is None:
        return None, None
    if sorts:
        valid = (targets >= 0).to(e.dtype)
        # e.T @ valid avoids an (N, D) temporary; the scale of the mean does not change the order.
        mean_embedding = torch.mv(e.T, valid).to(c.dtype)
    with torch.autocast(c.device.type, enabled=False):
        if directions is None:
            average_logit = torch.mv(c, mean_embedding)
        else:
            columns = ([mean_embedding[:, None]] if sorts else []) + [directions.to(c.dtype)]
            weights = torch.cat(columns, dim=1)
            products = torch.mm(c, torch.nn.functional.pad(
                weights, (0, -weights.shape[1] % _COLUMN_MULTIPLE)))
            average_logit = products[:, 0]
    order = None
    if sorts:
        if bias is not None:
            average_logit = average_logit + bias * valid.sum()
        # Stable: equal average logits (tied or repeated classifier rows) keep one order every
        # call.
        order = torch.argsort(average_logit.float(), descending=True, stable=True).to(torch.int32)
    projections = None
    if directions is not None:
        projections = products[:, int(sorts):int(sorts) + directions.shape[1]]
        projections = (projections.contiguous() if order is None
                       else projections.index_select(0, order))
    return order, projections


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
