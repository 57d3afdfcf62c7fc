"""Linear cross-entropy in PyTorch operations, a chunk of tokens at a time (the CPU default).

Same canonical signature and outputs as the other implementations (:mod:`cce.loss`), and exact
gradients: the filter arguments are accepted and ignored. At most one chunk of float32 logits,
about ``CHUNK_LOGIT_BYTES``, exists at a time. The forward keeps only its inputs and the
log-sum-exp (LSE); the backward recomputes each chunk's logits and turns them into that chunk's
logit gradient, which it multiplies into dE, dC and dbias at once.

The logits are products of float32 copies of the inputs (float64 for float64 inputs, whose
loss and LSE are float64 too): a product of two 16-bit numbers is exact in float32, so only
float32 accumulation error remains, as in the Triton kernels. A
16-bit matmul would round every logit to the input dtype (and on a CPU it cannot return float32).
"""

from __future__ import annotations

import functools
import math
from typing import TYPE_CHECKING, Optional

import torch

from cce.autograd import differentiable_once
from cce.weighting import (LossWeighting, lse_and_cross_entropy, target_complement,
                           target_entry)

if TYPE_CHECKING:
    from cce.options import LossOptions

# Bytes of float32 logits per chunk of tokens (at least one token per chunk).
CHUNK_LOGIT_BYTES = 32 * 2**20


def chunked_torch_loss(e: torch.Tensor, c: torch.Tensor, targets: torch.Tensor,
                       bias: Optional[torch.Tensor], weighting: LossWeighting,
                       options: LossOptions) -> "tuple[torch.Tensor, torch.Tensor]":
    """Per-token loss (F.cross_entropy's with ``weighting``, 0 at ignored tokens) and LSE,
    float32 (N,) (float64 for float64 inputs), on the device of the inputs. Exact gradients:
    of the options, only ``softcap`` applies."""
    loss, lse, _ = ChunkedLinearCrossEntropy.apply(e, c, bias, targets, options.softcap,
                                                   weighting.weight, weighting.label_smoothing)
    return loss, lse


def compute_dtype(e: torch.Tensor) -> torch.dtype:
    """float32, or float64 for float64 inputs."""
    return torch.promote_types(e.dtype, torch.float32)


def chunk_rows(vocab_size: int) -> int:
    """Tokens per chunk: as many as fit ``CHUNK_LOGIT_BYTES`` of float32 logits, at least 1."""
    return max(1, CHUNK_LOGIT_BYTES // (4 * vocab_size))


def _chunk_logits(e32: torch.Tensor, c32: torch.Tensor, bias32: Optional[torch.Tensor],
                  softcap: Optional[float]) -> "tuple[torch.Tensor, Optional[torch.Tensor]]":
    """float32 logits of a chunk of tokens, soft-capped, and ``tanh(raw logits / softcap)``
    (whose square the softcap's derivative needs), None without a softcap."""
    logits = e32 @ c32.T if bias32 is None else torch.addmm(bias32, e32, c32.T)
    if softcap is None:
        return logits, None
    capped = logits.div_(softcap).tanh_()
    return capped * softcap, capped


def _without_autocast(method):
    """Runs ``method`` with autocast off on its tensors' device: the chunks multiply float32
    copies, which a caller's autocast would round back to 16 bits."""

    @functools.wraps(method)
    def wrapped(*args):
        first = next((arg for arg in args if isinstance(arg, torch.Tensor)), None)
        if first is None or first.device.type not in ("cpu", "cuda"):
            return method(*args)  # no autocast there (meta tensors: shapes only)
        with torch.autocast(first.device.type, enabled=False):
            return method(*args)

    return wrapped


class ChunkedLinearCrossEntropy(torch.autograd.Function):
    """Per-token loss and LSE, float32 (N,), and each row's ``1 - p_y``
    (:func:`cce.weighting.target_complement`, for the backward); targets are canonical (int64,
    -1 = ignored). With ``setup_context``, so that torch.func's transforms can differentiate it.
    """

    @staticmethod
    @_without_autocast
    def forward(e: torch.Tensor, c: torch.Tensor, bias: Optional[torch.Tensor],
                targets: torch.Tensor, softcap: Optional[float], weight: Optional[torch.Tensor],
                label_smoothing: float):
        compute = compute_dtype(e)
        c32, bias32 = c.to(compute), None if bias is None else bias.to(compute)
        num_tokens = e.shape[0]
        # The LSE of each row's non-target logits, for 1 - p_y to full precision
        # (cce.weighting).
        other_lse = torch.empty(num_tokens, dtype=compute, device=e.device)
        target_logit = torch.empty_like(other_lse)
        # sum_v weight[v] * logit[v] of every row, for label smoothing (cce.weighting).
        logit_sum = torch.empty_like(other_lse) if label_smoothing else None
        gather_index = targets.clamp(min=0).unsqueeze(1)  # ignored rows read column 0, unused
        has_target = (targets >= 0).unsqueeze(1)
        rows = chunk_rows(c.shape[0])
        for start in range(0, num_tokens, rows):
            chunk = slice(start, start + rows)
            logits, _ = _chunk_logits(e[chunk].to(compute), c32, bias32, softcap)
            if logit_sum is not None:
                logit_sum[chunk] = (logits.sum(dim=1) if weight is None
                                    else logits @ weight)
            chunk_target_logit = logits.gather(1, gather_index[chunk])
            target_logit[chunk] = chunk_target_logit.squeeze(1)
            # -inf at the targets; ignored rows keep their column 0.
            logits.scatter_(1, gather_index[chunk],
                            chunk_target_logit.masked_fill(has_target[chunk], -math.inf))
            other_lse[chunk] = torch.logsumexp(logits, dim=1)
        lse, cross_entropy = lse_and_cross_entropy(other_lse, target_logit, targets)
        weighting = LossWeighting(weight, label_smoothing)
        loss = weighting.token_loss(cross_entropy, lse, logit_sum, targets, c.shape[0])
        return loss, lse, target_complement(other_lse, lse)

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        e, c, bias, targets, softcap, weight, label_smoothing = inputs
        _, lse, complement = output
        ctx.mark_non_differentiable(complement)
        ctx.save_for_backward(e, c, bias, targets, lse, complement, weight)
        ctx.softcap = softcap
        ctx.label_smoothing = label_smoothing

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor, grad_lse: torch.Tensor, _grad_complement):
        e, c, bias = ctx.saved_tensors[:3]
        with torch.no_grad():  # the in-place chunk arithmetic records no graph
            gradients = ChunkedLinearCrossEntropy._gradients(ctx, grad_loss, grad_lse)
        # Under create_graph=True, a gradient with no grad_fn would silently drop its part of a
        # term built on it (a gradient penalty): differentiating it raises instead.
        return differentiable_once(gradients, (e, c, bias, grad_loss, grad_lse)) + (None,) * 4

    @staticmethod
    @_without_autocast
    def _gradients(ctx, grad_loss: torch.Tensor, grad_lse: torch.Tensor):
        """(dE, dC, dbias), None where not needed."""
        e, c, bias, targets, lse, complement, weight = ctx.saved_tensors
        needs_grad_e, needs_grad_c, needs_grad_bias = ctx.needs_input_grad[:3]
        softcap = ctx.softcap
        # d(loss * grad_loss + lse * grad_lse)/d(logits) = softmax * prob_scale off the target,
        # the target's entry at it, + uniform_scale * weight (cce.weighting); ignored rows only
        # have the lse's term.
        scales = LossWeighting(weight, ctx.label_smoothing).gradient_scales(
            grad_loss, targets, c.shape[0])
        compute = compute_dtype(e)
        scales = scales._replace(softmax=scales.softmax + grad_lse.to(compute))
        prob_scale = scales.softmax.unsqueeze(1)
        # Ignored rows keep their column 0's softmax entry.
        has_target = (targets >= 0).unsqueeze(1)
        entry = target_entry(scales, complement).unsqueeze(1)
        uniform_scale = scales.uniform
        uniform_weight = None
        if uniform_scale is not None:
            uniform_scale = uniform_scale.unsqueeze(1)
            uniform_weight = (torch.ones(c.shape[0], dtype=compute, device=c.device)
                              if weight is None else weight)
        # The softmax is exp(logits - lse); where the lse is +inf, PyTorch's softmax is NaN on
        # the whole row (every logit minus an infinite maximum), not only at the +inf logits.
        softmax_shift = lse.masked_fill(lse == math.inf, math.nan).unsqueeze(1)
        scatter_index = targets.clamp(min=0).unsqueeze(1)

        c32, bias32 = c.to(compute), None if bias is None else bias.to(compute)
        grad_e = torch.empty(e.shape, dtype=e.dtype, device=e.device) if needs_grad_e else None
        grad_c32 = torch.zeros(c.shape, dtype=compute, device=c.device) if needs_grad_c \
            else None
        grad_bias32 = torch.zeros(c.shape[0], dtype=compute, device=c.device) \
            if needs_grad_bias else None
        rows = chunk_rows(c.shape[0])
        for start in range(0, e.shape[0], rows):
            chunk = slice(start, start + rows)
            e32 = e[chunk].to(compute)
            logits, capped = _chunk_logits(e32, c32, bias32, softcap)
            grad_logits = logits.sub_(softmax_shift[chunk]).exp_().mul_(prob_scale[chunk])
            at_target = grad_logits.gather(1, scatter_index[chunk])
            grad_logits.scatter_(1, scatter_index[chunk],
                                 torch.where(has_target[chunk], entry[chunk], at_target))
            if uniform_weight is not None:
                grad_logits.addcmul_(uniform_scale[chunk], uniform_weight)
            if capped is not None:  # d(s * tanh(z / s))/dz = 1 - tanh(z / s)^2
                grad_logits.mul_(capped.square_().neg_().add_(1.0))
            if needs_grad_e:
                grad_e[chunk] = grad_logits @ c32
            if needs_grad_c:
                grad_c32.addmm_(grad_logits.T, e32)
            if needs_grad_bias:
                grad_bias32 += grad_logits.sum(dim=0)
        grad_c = grad_c32.to(c.dtype) if needs_grad_c else None
        grad_bias = grad_bias32.to(bias.dtype) if needs_grad_bias else None
        return grad_e, grad_c, grad_bias
