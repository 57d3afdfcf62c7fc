"""Linear cross-entropy in PyTorch operations, a chunk of tokens at a time (the CPU default).

Same canonical signature and outputs as the other implementations (:mod:`cce.loss`), and exact
gradients: the filter arguments are accepted and ignored. At most one chunk of float32 logits,
about ``CHUNK_LOGIT_BYTES``, exists at a time. The forward keeps only its inputs and the
log-sum-exp (LSE); the backward recomputes each chunk's logits and turns them into that chunk's
logit gradient, which it multiplies into dE, dC and dbias at once.

Asked for, each row's entropy and argmax come from the forward's chunks of logits too (no
extra pass; the entropy needs a second chunk-sized buffer, the softmax weights), and the
backward adds the entropy's gradient to the same chunks (likewise with the probabilities).

With ``memory="fast"`` (no softcap or entropy), the forward keeps each chunk's softmax, N x V in
float32, and the backward scales it instead of recomputing the logits: three logit-sized
matrix products instead of four, and the same results to the bit.

The logits are products of float32 copies of the inputs (float64 for float64 inputs, whose
loss and LSE are float64 too): a product of two 16-bit numbers is exact in float32, so only
float32 accumulation error remains, as in the Triton kernels. A
16-bit matmul would round every logit to the input dtype (and on a CPU it cannot return float32).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, NamedTuple, Optional

import torch

from cce.autograd import (differentiable_once, needs_gradient, stacked_samples,
                          without_autocast)
from cce.weighting import (LossWeighting, TokenOutputs, entropy_and_gradient_terms,
                           lse_and_cross_entropy, target_complement, target_entry)

if TYPE_CHECKING:
    from cce.options import LossOptions

# Bytes of float32 logits per chunk of tokens (at least one token per chunk).
CHUNK_LOGIT_BYTES = 32 * 2**20


def chunked_torch_loss(e: torch.Tensor, c: torch.Tensor, targets: torch.Tensor,
                       bias: Optional[torch.Tensor], weighting: LossWeighting,
                       options: LossOptions) -> TokenOutputs:
    """Per-token loss (F.cross_entropy's with ``weighting``, 0 at ignored tokens) and LSE,
    float32 (N,) (float64 for float64 inputs), on the device of the inputs, and with
    ``return_entropy`` / ``return_argmax`` each row's softmax entropy (same dtype) and int64
    argmax. Exact gradients, the entropy's included: of the other options, only ``softcap``
    applies, and ``memory`` (see the module's note)."""
    extras = Extras(options.return_entropy, options.return_argmax,
                    keeps_softmax=(options.memory == "fast" and options.softcap is None
                                   and not options.return_entropy
                                   and needs_gradient(e, c, bias)))
    loss, lse, entropy, argmax, *_ = ChunkedLinearCrossEntropy.apply(
        e, c, bias, targets, options.softcap, weighting.weight, weighting.label_smoothing,
        extras)
    return TokenOutputs(loss, lse, entropy, argmax)


class Extras(NamedTuple):
    """What :class:`ChunkedLinearCrossEntropy` computes beyond the loss and the LSE: each
    row's entropy, its argmax, and the softmax kept for the backward (``memory="fast"``)."""

    entropy: bool = False
    argmax: bool = False
    keeps_softmax: bool = False


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


def _softmax_shift(lse: torch.Tensor) -> torch.Tensor:
    """(n, 1): what the softmax subtracts from each row's logits, its LSE; NaN where the LSE is
    +inf, where PyTorch's softmax is NaN on the whole row (every logit minus an infinite
    maximum), not only at the +inf logits."""
    return lse.masked_fill(lse == math.inf, math.nan).unsqueeze(1)


def _softmax_entropy(logits: torch.Tensor, lse: torch.Tensor,
                     has_target: torch.Tensor) -> torch.Tensor:
    """The entropy of each row's softmax, ``sum_v w_v (lse - z_v)`` with ``w = exp(z - lse)``,
    from its logits (``logits``, which it overwrites; a row's target at -inf where
    ``has_target``) and their LSE. Every term is positive. The LSE's rounding scales every
    weight alike: dividing by their sum S and adding log S removes it. A row with a target whose
    other logits are all -inf (V = 1) has entropy 0 (and weight 1 - p_y = 0); an ignored row of
    -inf logits is NaN, as PyTorch's softmax of it. -inf logits weigh 0 and count as the lowest
    finite number (0 * inf is NaN)."""
    shift = lse.masked_fill((lse == -math.inf) & has_target, 0.0).unsqueeze(1)
    weights = (logits - shift).exp()
    weight_sum = weights.sum(dim=1)
    spread = logits.clamp_(min=torch.finfo(logits.dtype).min).neg_().add_(shift)
    entropy = weights.mul_(spread).sum(dim=1).div_(weight_sum).add_(weight_sum.log())
    return torch.where(weight_sum == 0, 0.0, entropy)


class ChunkedLinearCrossEntropy(torch.autograd.Function):
    """Per-token loss and LSE, float32 (N,); with ``extras.entropy`` each row's softmax
    entropy, else None; with ``extras.argmax`` each row's int64 argmax, else None; each row's
    ``1 - p_y`` (:func:`cce.weighting.target_complement`); with ``extras.entropy`` a float32
    (2, N) of each row's mean logit mu and the entropy's gradient at its target,
    ``p_y (z_y - mu)`` (0 without a target; :func:`cce.weighting.entropy_and_gradient_terms`),
    else None; and with ``extras.keeps_softmax`` the softmax, (N, V) in float32 (0 at the
    targets), else None (the last three for the backward). Targets are canonical (int64, -1 =
    ignored). With ``setup_context``, so that torch.func's transforms can differentiate it.
    """

    @staticmethod
    @without_autocast
    def forward(e: torch.Tensor, c: torch.Tensor, bias: Optional[torch.Tensor],
                targets: torch.Tensor, softcap: Optional[float], weight: Optional[torch.Tensor],
                label_smoothing: float, extras: Extras = Extras()):
        compute = compute_dtype(e)
        c32, bias32 = c.to(compute), None if bias is None else bias.to(compute)
        num_tokens = e.shape[0]
        # The LSE of each row's non-target logits, for 1 - p_y to full precision
        # (cce.weighting).
        other_lse = torch.empty(num_tokens, dtype=compute, device=e.device)
        target_logit = torch.empty_like(other_lse)
        # sum_v weight[v] * logit[v] of every row, for label smoothing (cce.weighting).
        logit_sum = torch.empty_like(other_lse) if label_smoothing else None
        # The entropy of each row's non-target logits under their own softmax.
        other_entropy = torch.empty_like(other_lse) if extras.entropy else None
        row_argmax = torch.empty(num_tokens, dtype=torch.int64, device=e.device) \
            if extras.argmax else None
        softmax = torch.empty(num_tokens, c.shape[0], dtype=compute, device=e.device) \
            if extras.keeps_softmax else None
        gather_index = targets.clamp(min=0).unsqueeze(1)  # ignored rows read column 0, unused
        has_target = (targets >= 0).unsqueeze(1)
        rows = chunk_rows(c.shape[0])
        for start in range(0, num_tokens, rows):
            chunk = slice(start, start + rows)
            logits, _ = _chunk_logits(e[chunk].to(compute), c32, bias32, softcap)
            if logit_sum is not None:
                logit_sum[chunk] = (logits.sum(dim=1) if weight is None
                                    else logits @ weight)
            if row_argmax is not None:  # of the logits themselves, before the target's -inf
                row_argmax[chunk] = logits.argmax(dim=1)
            chunk_target_logit = logits.gather(1, gather_index[chunk])
            target_logit[chunk] = chunk_target_logit.squeeze(1)
            # -inf at the targets; ignored rows keep their column 0.
            logits.scatter_(1, gather_index[chunk],
                            chunk_target_logit.masked_fill(has_target[chunk], -math.inf))
            chunk_other_lse = torch.logsumexp(logits, dim=1)
            other_lse[chunk] = chunk_other_lse
            if softmax is not None:  # as the backward would recompute it (its target entry 0)
                chunk_lse, _ = lse_and_cross_entropy(chunk_other_lse, target_logit[chunk],
                                                     targets[chunk])
                torch.sub(logits, _softmax_shift(chunk_lse), out=softmax[chunk]).exp_()
            if other_entropy is not None:
                other_entropy[chunk] = _softmax_entropy(logits, chunk_other_lse,
                                                        has_target[chunk].squeeze(1))
        lse, cross_entropy = lse_and_cross_entropy(other_lse, target_logit, targets)
        weighting = LossWeighting(weight, label_smoothing)
        loss = weighting.token_loss(cross_entropy, lse, logit_sum, targets, c.shape[0])
        complement = target_complement(other_lse, lse)
        row_entropy = entropy_terms = None
        if other_entropy is not None:
            row_entropy, mean, target_term = entropy_and_gradient_terms(
                other_entropy, other_lse, target_logit, lse, cross_entropy, complement, targets)
            entropy_terms = torch.stack([mean, target_term])
        return loss, lse, row_entropy, row_argmax, complement, entropy_terms, softmax

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        e, c, bias, targets, softcap, weight, label_smoothing, _ = inputs
        _, lse, _, row_argmax, complement, entropy_terms, softmax = output
        ctx.mark_non_differentiable(*(tensor for tensor in (row_argmax, complement, entropy_terms,
                                                            softmax) if tensor is not None))
        # Unused outputs' gradients stay None: an entropy nobody differentiates costs nothing.
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(e, c, bias, targets, lse, complement, weight, entropy_terms,
                              softmax)
        ctx.softcap = softcap
        ctx.label_smoothing = label_smoothing

    @staticmethod
    def vmap(info, in_dims, *args):
        return stacked_samples(ChunkedLinearCrossEntropy.apply, info.batch_size, in_dims, args)

    @staticmethod
    def backward(ctx, grad_loss: Optional[torch.Tensor], grad_lse: Optional[torch.Tensor],
                 grad_entropy: Optional[torch.Tensor], *_):
        e, c, bias = ctx.saved_tensors[:3]
        request = GradientRequest(tuple(ctx.needs_input_grad[:3]), ctx.softcap,
                                  ctx.label_smoothing)
        gradients = ChunkedGradients.apply(request, grad_loss, grad_lse, grad_entropy,
                                           *ctx.saved_tensors)
        # Under create_graph=True, a gradient with no grad_fn would silently drop its part of a
        # term built on it (a gradient penalty): differentiating it raises instead.
        return differentiable_once(
            gradients, (e, c, bias, grad_loss, grad_lse, grad_entropy)) + (None,) * 5


class GradientRequest(NamedTuple):
    """What :class:`ChunkedGradients` computes: which of dE, dC, dbias, and the loss's
    softcap and label smoothing."""

    needs: "tuple[bool, bool, bool]"
    softcap: Optional[float]
    label_smoothing: float


class ChunkedGradients(torch.autograd.Function):
    """:class:`ChunkedLinearCrossEntropy`'s gradients (dE, dC, dbias; None where not needed;
    a None upstream gradient is 0), from the upstream gradients and what its forward saved. A
    function of its own so that torch.func.vmap over a backward (per-sample gradients) runs
    it sample by sample: its chunks are written in place."""

    @staticmethod
    @without_autocast
    def forward(request: GradientRequest, grad_loss: Optional[torch.Tensor],
                grad_lse: Optional[torch.Tensor], grad_entropy: Optional[torch.Tensor],
                e: torch.Tensor, c: torch.Tensor, bias: Optional[torch.Tensor],
                targets: torch.Tensor, lse: torch.Tensor, complement: torch.Tensor,
                weight: Optional[torch.Tensor], entropy_terms: Optional[torch.Tensor],
                softmax: Optional[torch.Tensor]):
        needs_grad_e, needs_grad_c, needs_grad_bias = request.needs
        compute = compute_dtype(e)
        if grad_loss is None:
            grad_loss = torch.zeros_like(lse)
        if grad_lse is None:
            grad_lse = torch.zeros_like(lse)
        softcap = request.softcap
        # d(loss * grad_loss + lse * grad_lse)/d(logits) = softmax * prob_scale off the target,
        # the target's entry at it, + uniform_scale * weight (cce.weighting); ignored rows only
        # have the lse's term. With the entropy's upstream gradient g, every entry adds
        # -g p_v (z_v - mu) (mu: the row's mean logit), the target's -g p_y (z_y - mu) from the
        # forward's exact form (cce.weighting.entropy_and_gradient_terms).
        scales = LossWeighting(weight, request.label_smoothing).gradient_scales(
            grad_loss, targets, c.shape[0])
        scales = scales._replace(softmax=scales.softmax + grad_lse.to(compute))
        prob_scale = scales.softmax.unsqueeze(1)
        # Ignored rows keep their column 0's softmax entry.
        has_target = (targets >= 0).unsqueeze(1)
        entry = target_entry(scales, complement)
        entropy_scale = mean = None
        if grad_entropy is not None:
            entropy_scale = grad_entropy.to(compute).neg()
            mean, target_term = entropy_terms
            entry = entry + entropy_scale * target_term
            entropy_scale, mean = entropy_scale.unsqueeze(1), mean.unsqueeze(1)
            lowest = torch.finfo(compute).min
        entry = entry.unsqueeze(1)
        uniform_scale = scales.uniform
        uniform_weight = None
        if uniform_scale is not None:
            uniform_scale = uniform_scale.unsqueeze(1)
            uniform_weight = (torch.ones(c.shape[0], dtype=compute, device=c.device)
                              if weight is None else weight)
        # The logits' shift, where the softmax is recomputed rather than kept.
        softmax_shift = _softmax_shift(lse) if softmax is None else None
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
            capped = None
            if softmax is not None:  # kept by the forward (no softcap, no entropy)
                grad_logits = softmax[chunk] * prob_scale[chunk]
            else:
                logits, capped = _chunk_logits(e32, c32, bias32, softcap)
                if entropy_scale is None:
                    grad_logits = (logits.sub_(softmax_shift[chunk]).exp_()
                                   .mul_(prob_scale[chunk]))
                else:
                    probs = (logits - softmax_shift[chunk]).exp_()
                    # p_v (z_v - mu) first: 0 where p_v is 0, whatever the scale (-inf logits
                    # count as the lowest finite number, 0 * -inf being NaN).
                    grad_logits = logits.clamp_(min=lowest).sub_(mean[chunk]).mul_(probs)
                    grad_logits.mul_(entropy_scale[chunk]).addcmul_(probs, prob_scale[chunk])
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

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        # Not differentiable (the caller's differentiable_once says so where it is asked).
        ctx.mark_non_differentiable(*(grad for grad in output if grad is not None))

    @staticmethod
    def vmap(info, in_dims, *args):
        return stacked_samples(ChunkedGradients.apply, info.batch_size, in_dims, args)
