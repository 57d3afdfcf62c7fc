"""The rows' outputs after the LSE kernel, in one launch: each row's LSE, its plain
cross-entropy ``L - z_y`` and ``1 - p_y``, from the LSE ``O`` of its other logits and its
target's logit, as :func:`cce.weighting.lse_and_cross_entropy` and
:func:`cce.weighting.target_complement` define them (which stay the PyTorch paths' way):

    L = log(exp(O) + exp(z_y)),   L - z_y = softplus(O - z_y),   1 - p_y = exp(O - L),

L = O on a row without a target, and NaN for the last two where L is +inf. PyTorch takes nine
operations on (N,) vectors for them: about 0.3 ms of host time per call, which at small N is
the GPU's wait.

Both the softplus and the log-add-exp are ``m + log(1 + w)`` with ``0 <= w <= 1``; below
w = 1/16 the logarithm is a series, so that the result does not rest on the precision of a
GPU's fast logarithm near 1, where a sure model's losses are.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from cce.config import cdiv

_BLOCK = 1024


@triton.jit
def log_one_plus(w):
    """log(1 + w) for 0 <= w <= 1 to float32 precision: below 1/16 the series to w^6 (the
    first term left out is under 1e-8 of w), above it the logarithm of u = 1 + w times
    w / (u - 1), which undoes the rounding of u (u - 1 is exact)."""
    series = w * (1.0 + w * (-1.0 / 2 + w * (1.0 / 3 + w * (-1.0 / 4 + w * (
        1.0 / 5 + w * (-1.0 / 6))))))
    u = 1.0 + w
    return tl.where(w < 0.0625, series, tl.log(u) * (w / (u - 1.0)))


@triton.jit
def row_outputs_kernel(other_lse_ptr, target_logit_ptr, targets_ptr, lse_ptr, cross_entropy_ptr,
                       complement_ptr, num_tokens, BLOCK: tl.constexpr):
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = rows < num_tokens
    other = tl.load(other_lse_ptr + rows, mask=mask, other=0.0)
    target_logit = tl.load(target_logit_ptr + rows, mask=mask, other=0.0)
    has_target = tl.load(targets_ptr + rows, mask=mask, other=-1) >= 0
    gap = other - target_logit
    # Both are a maximum plus log(1 + e^-|O - z|): the softplus max(O - z, 0) + ..., exact where
    # O - z is very negative (a sure row's loss), and log(e^O + e^z) = max(O, z) + ...; NaN
    # propagates. Of two equal infinities the LSE is that infinity (their difference is NaN).
    tail = log_one_plus(tl.exp(-tl.abs(gap)))
    cross_entropy = tl.maximum(gap, 0.0) + tail
    both_infinite = (other == target_logit) & (tl.abs(other) == float("inf"))
    lse = tl.where(both_infinite, other, tl.maximum(other, target_logit) + tail)
    lse = tl.where(has_target, lse, other)
    infinite = lse == float("inf")  # a +inf logit: PyTorch's softmax and loss are NaN there
    tl.store(lse_ptr + rows, lse, mask=mask)
    tl.store(cross_entropy_ptr + rows, tl.where(infinite, float("nan"), cross_entropy), mask=mask)
    tl.store(complement_ptr + rows, tl.where(infinite, float("nan"), tl.exp(other - lse)),
             mask=mask)


def row_outputs(other_lse: torch.Tensor, target_logit: torch.Tensor,
                targets: torch.Tensor) -> "tuple[torch.Tensor, torch.Tensor, torch.Tensor]":
    """float32 (N,) each: the LSE, the plain cross-entropy ``L - z_y`` and ``1 - p_y`` of every
    row (module docstring), from ``other_lse`` and ``target_logit`` (float32 (N,)) and the
    canonical ``targets`` (-1: no target)."""
    num_tokens = other_lse.shape[0]
    # Three tensors, not views of one: the custom op's outputs must not alias each other.
    lse, cross_entropy, complement = (torch.empty_like(other_lse) for _ in range(3))
    if num_tokens:
        row_outputs_kernel[(cdiv(num_tokens, _BLOCK),)](
            other_lse, target_logit, targets, lse, cross_entropy, complement, num_tokens,
            BLOCK=_BLOCK)
    return lse, cross_entropy, complement
