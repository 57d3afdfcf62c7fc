"""Float64 PyTorch reference for linear cross-entropy, and the error measure the tests use.

The reference takes the *same* tensors as the implementation under test (already rounded to
their dtype) and upcasts them to float64, so it measures only the implementation's own error,
not the rounding of its inputs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F


@dataclass
class Result:
    """Loss, log-sum-exp and the gradients of ``(loss * grad_output).sum()`` (plus
    ``(lse * grad_lse).sum()`` when a ``grad_lse`` is given, and ``(entropy *
    grad_entropy).sum()`` when a ``grad_entropy`` is given) w.r.t. e, c and bias; the entropy
    and argmax of every row's softmax (the reference always computes them; an implementation's
    result holds them when it was asked for them)."""

    loss: torch.Tensor
    lse: torch.Tensor
    grad_e: torch.Tensor
    grad_c: torch.Tensor
    grad_bias: Optional[torch.Tensor] = None
    entropy: Optional[torch.Tensor] = None
    argmax: Optional[torch.Tensor] = None


def reference(
    e: torch.Tensor,
    c: torch.Tensor,
    targets: torch.Tensor,
    *,
    bias: Optional[torch.Tensor] = None,
    ignore_index: int = -100,
    softcap: Optional[float] = None,
    reduction: str = "mean",
    shift: int = 0,
    grad_output: Optional[torch.Tensor] = None,
    grad_lse: Optional[torch.Tensor] = None,
    grad_entropy: Optional[torch.Tensor] = None,
    weight: Optional[torch.Tensor] = None,
    label_smoothing: float = 0.0,
    temperature: float = 1.0,
    z_loss: float = 0.0,
) -> Result:
    """float64 loss, lse, entropy, argmax and gradients, with the semantics of
    ``cce.linear_cross_entropy``.

    ``shift`` is done by slicing: position i is scored against ``targets[..., i + shift]`` and
    the last ``shift`` positions contribute nothing (they are 0 in the "none" loss).
    ``grad_output`` is the upstream gradient of the loss (ones when None); ``grad_lse``, when
    given, that of the lse, so the gradients are those of ``sum(loss * grad_output) +
    sum(lse * grad_lse)``; ``grad_entropy``, when given, that of the entropy (the term
    ``sum(entropy * grad_entropy)`` is added). ``weight`` and ``label_smoothing``:
    F.cross_entropy's (the weights in float64).

    The entropy ``H = -sum_v p_v log p_v`` of the softmax of every position's logits (every
    position of e: ignored ones and the last ``shift`` ones too, shape ``e.shape[:-1]``) is
    summed from ``log_softmax``, with the terms where ``p_v == 0`` taken as 0 (and no
    gradient), so that a logit of -inf gives a finite entropy and gradient. ``argmax`` is
    ``torch.argmax`` of the float64 logits (the first of equal ones; a NaN counts as largest).
    """
    e64 = e.detach().double().requires_grad_()
    c64 = c.detach().double().requires_grad_()
    b64 = None if bias is None else bias.detach().double().requires_grad_()

    logits = e64 @ c64.T
    if b64 is not None:
        logits = logits + b64
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    logits = logits / temperature
    lse = torch.logsumexp(logits, dim=-1)
    entropy = _entropy(logits)
    argmax = logits.detach().argmax(dim=-1)

    targets = targets.long()
    if shift:
        seq_len = targets.shape[-1]
        kept = max(seq_len - shift, 0)
        scored_logits, scored_targets = logits[..., :kept, :], targets[..., shift:]
    else:
        scored_logits, scored_targets = logits, targets
    loss = F.cross_entropy(scored_logits.reshape(-1, c.shape[0]), scored_targets.reshape(-1),
                           weight=None if weight is None else weight.double(),
                           ignore_index=ignore_index, reduction=reduction,
                           label_smoothing=label_smoothing)
    if z_loss:
        scored_lse = torch.logsumexp(scored_logits, dim=-1).reshape(-1)
        flat_targets = scored_targets.reshape(-1)
        valid = flat_targets != ignore_index
        token_weight = (valid.double() if weight is None
                        else torch.where(valid, weight.double()[flat_targets.clamp(min=0)], 0.0))
        z_term = z_loss * token_weight * scored_lse.square()
        if reduction == "none":
            loss = loss + z_term
        elif reduction == "sum":
            loss = loss + z_term.sum()
        else:
            loss = loss + z_term.sum() / token_weight.sum()
    if reduction == "none":
        loss = loss.reshape(scored_targets.shape)
        if shift:
            tail = loss.new_zeros(*targets.shape[:-1], targets.shape[-1] - loss.shape[-1])
            loss = torch.cat([loss, tail], dim=-1)

    if grad_output is None:
        grad_output = torch.ones_like(loss)
    inputs = [e64, c64] + ([b64] if b64 is not None else [])
    outputs, upstream = [loss], [grad_output.double()]
    if grad_lse is not None:
        outputs.append(lse)
        upstream.append(grad_lse.double())
    if grad_entropy is not None:
        outputs.append(entropy)
        upstream.append(grad_entropy.double())
    grads = torch.autograd.grad(outputs, inputs, upstream)
    return Result(loss.detach(), lse.detach(), grads[0], grads[1],
                  grads[2] if b64 is not None else None, entropy.detach(), argmax)


def _entropy(logits: torch.Tensor) -> torch.Tensor:
    """``-sum_v p_v log p_v`` over the last dimension, 0 for the terms with ``p_v == 0``: no
    ``0 * -inf`` (NaN) in the value or in the gradient. ``log p_v`` comes from log_softmax, not
    from ``L - sum p z``, which loses the relative precision of a small entropy."""
    log_p = torch.log_softmax(logits, dim=-1)
    p = log_p.exp()
    zero = p == 0
    return -(p * torch.where(zero, 0.0, log_p)).sum(dim=-1)


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """``||out - ref|| / ||ref||`` in float64 (Frobenius norms).

    Any NaN or inf in ``out`` or ``ref`` is a failure (returns inf). When ``ref`` is exactly zero
    the absolute error ``||out||`` is returned, so zero is expected exactly.
    """
    if out.shape != ref.shape:
        raise AssertionError(f"shape {tuple(out.shape)} != reference shape {tuple(ref.shape)}")
    out64 = out.detach().to("cpu", torch.float64)
    ref64 = ref.detach().to("cpu", torch.float64)
    if not (torch.isfinite(out64).all() and torch.isfinite(ref64).all()):
        return math.inf
    error = torch.linalg.vector_norm(out64 - ref64).item()
    ref_norm = torch.linalg.vector_norm(ref64).item()
    return error / ref_norm if ref_norm > 0 else error
