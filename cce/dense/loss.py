"""The dense path as two custom ops, ``cce::dense_forward`` and ``cce::dense_backward``.

Forward, chunk by chunk of tokens: the chunk's float32 logits by cuBLAS (scratch of a bounded
size, :func:`cce.config.dense_chunk_tokens`), then one pass (:mod:`cce.dense.softmax_gradient`)
for the LSE pieces and, when a backward follows, ``G = softmax - onehot`` (N x V, inputs' dtype),
kept for the backward. Backward, with a_i the row's scale of the softmax (the loss's upstream
gradient times its class weight, plus the LSE's upstream gradient g_i), b_i the target's, and
r_i = a_i - b_i (= g_i) at rows with a target:

    dlogits = a G + r onehot,     dE = a (G C) + r C[y],     dC = G^T (a E) + scatter_y(r E).

Three logit-sized GEMMs in all, as ``F.cross_entropy(e @ c.T)`` takes. The path takes the
options whose gradient is that (no softcap, label smoothing or entropy: :func:`dense_takes`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import torch

from cce.autograd import (differentiable_once, needs_gradient, tokenless_loss,
                          vmap_sample_by_sample, without_autocast)
from cce.config import DENSE_MAX_VOCAB, check_interpreter_usable, dense_chunk_tokens
from cce.dense.softmax_gradient import softmax_gradient
from cce.weighting import LossWeighting, TokenOutputs, lse_and_cross_entropy

if TYPE_CHECKING:
    from cce.options import LossOptions


def dense_takes(vocab_size: int, weighting: LossWeighting, options: LossOptions) -> bool:
    """Whether the dense path computes this call: memory "fast", a vocabulary where most tiles
    are live (:data:`cce.config.DENSE_MAX_VOCAB`), and options whose logit gradient is a scaled
    ``softmax - onehot`` (no softcap or label smoothing, no entropy or argmax asked for)."""
    return (options.memory == "fast" and vocab_size <= DENSE_MAX_VOCAB
            and options.softcap is None and not weighting.label_smoothing
            and not options.return_entropy and not options.return_argmax)


def _float32_product(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` in float32 from inputs of any kernel dtype: cuBLAS's float32 output on a GPU."""
    if a.is_cuda and a.dtype != torch.float32:
        return torch.mm(a, b, out_dtype=torch.float32)
    return torch.mm(a.float(), b.float())


@torch.library.custom_op("cce::dense_forward", mutates_args=())
@without_autocast
def dense_forward(e: torch.Tensor, c: torch.Tensor, bias: Optional[torch.Tensor],
                  targets: torch.Tensor, weight: Optional[torch.Tensor], needs_grad: bool,
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(per-token loss, lse, G): float32 (N,), float32 (N,), and ``softmax - onehot`` in e's
    dtype, (N, V) when ``needs_grad``, else empty. Targets canonical (int64, -1 = ignored)."""
    check_interpreter_usable()
    num_tokens, vocab_size = e.shape[0], c.shape[0]
    gradient = (torch.empty(num_tokens, vocab_size, dtype=e.dtype, device=e.device)
                if needs_grad else None)
    other_lse = torch.empty(num_tokens, dtype=torch.float32, device=e.device)
    target_logit = torch.empty_like(other_lse)
    chunk = dense_chunk_tokens(vocab_size)
    for start in range(0, num_tokens, chunk):
        stop = min(num_tokens, start + chunk)
        logits = _float32_product(e[start:stop], c.T)
        other_lse[start:stop], target_logit[start:stop] = softmax_gradient(
            logits, bias, targets[start:stop],
            None if gradient is None else gradient[start:stop])
    lse, cross_entropy = lse_and_cross_entropy(other_lse, target_logit, targets)
    loss = LossWeighting(weight).token_loss(cross_entropy, lse, None, targets, vocab_size)
    return loss, lse, gradient if gradient is not None else e.new_empty(0)


@dense_forward.register_fake
def _dense_forward_fake(e, c, bias, targets, weight, needs_grad):
    num_tokens = e.shape[0]
    return (e.new_empty(num_tokens, dtype=torch.float32),
            e.new_empty(num_tokens, dtype=torch.float32),
            e.new_empty((num_tokens, c.shape[0]) if needs_grad else (0,)))


@torch.library.custom_op("cce::dense_backward", mutates_args=())
@without_autocast
def dense_backward(e: torch.Tensor, c: torch.Tensor, bias: Optional[torch.Tensor],
                   targets: torch.Tensor, weight: Optional[torch.Tensor],
                   gradient: torch.Tensor, grad_loss: Optional[torch.Tensor],
                   grad_lse: Optional[torch.Tensor], needs_grad_e: bool, needs_grad_c: bool,
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dE, dC, dbias) of ``sum(loss * grad_loss + lse * grad_lse)`` from :func:`dense_forward`'s
    G (a None gradient counts as 0), each empty when not needed."""
    scales = LossWeighting(weight).gradient_scales(
        grad_loss if grad_loss is not None else torch.zeros(targets.shape, device=e.device),
        targets, c.shape[0])
    softmax_scale, target_scale = scales.softmax, scales.target
    if grad_lse is not None:
        softmax_scale = softmax_scale + grad_lse.float()
    # r: the LSE's upstream gradient at rows with a target (None: no such term).
    onehot_scale = (torch.where(targets >= 0, softmax_scale - target_scale, 0.0)
                    if grad_lse is not None else None)
    # dC's product takes the rows of E times their scales, rounded once to e's dtype, a power of
    # two apart so that 16-bit e keeps its range; the output is scaled back exactly.
    power = torch.exp2(torch.frexp(softmax_scale.abs().amax())[1].float())
    multipliers = softmax_scale / power
    safe_targets = targets.clamp(min=0)
    grad_e = grad_c = grad_bias = None
    if needs_grad_e:
        grad_e = _float32_product(gradient, c) * softmax_scale[:, None]
        if onehot_scale is not None:
            grad_e += onehot_scale[:, None] * c[safe_targets].float()
        grad_e = grad_e.to(e.dtype)
    if needs_grad_c:
        scaled_e = (e.float() * multipliers[:, None]).to(e.dtype)
        if onehot_scale is None:  # G's product alone: its output in e's dtype
            grad_c = torch.mm(gradient.T, scaled_e).mul_(power.to(e.dtype))
        else:
            grad_c = _float32_product(gradient.T, scaled_e).mul_(power)
            grad_c.index_add_(0, safe_targets, onehot_scale[:, None] * e.float())
            grad_c = grad_c.to(c.dtype)
        if bias is not None:
            grad_bias = _float32_product(gradient.T, multipliers[:, None].to(e.dtype)).squeeze(1)
            grad_bias *= power
            if onehot_scale is not None:
                grad_bias.index_add_(0, safe_targets, onehot_scale)
            grad_bias = grad_bias.to(bias.dtype)
    return tuple(grad if grad is not None else e.new_empty(0)
                 for grad in (grad_e, grad_c, grad_bias))


@dense_backward.register_fake
def _dense_backward_fake(e, c, bias, targets, weight, gradient, grad_loss, grad_lse,
                         needs_grad_e, needs_grad_c):
    return (e.new_empty(e.shape if needs_grad_e else (0,)),
            c.new_empty(c.shape if needs_grad_c else (0,)),
            c.new_empty(bias.shape if needs_grad_c and bias is not None else (0,)))


def _setup_context(ctx, inputs, output) -> None:
    e, c, bias, targets, weight, _ = inputs
    _, _, gradient = output
    ctx.mark_non_differentiable(gradient)
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(e, c, bias, targets, weight, gradient)


def _backward(ctx, grad_loss: Optional[torch.Tensor], grad_lse: Optional[torch.Tensor], _):
    e, c, bias, targets, weight, gradient = ctx.saved_tensors
    needs_e, needs_c, needs_bias = ctx.needs_input_grad[:3]
    with torch.no_grad():
        grad_e, grad_c, grad_bias = dense_backward(
            e, c, bias, targets, weight, gradient, grad_loss, grad_lse,
            needs_grad_e=needs_e, needs_grad_c=needs_c or needs_bias)
    gradients = differentiable_once(
        [grad if needed else None
         for grad, needed in ((grad_e, needs_e), (grad_c, needs_c), (grad_bias, needs_bias))],
        (e, c, bias, grad_loss, grad_lse))
    return gradients + (None,) * (len(ctx.needs_input_grad) - 3)


dense_forward.register_autograd(_backward, setup_context=_setup_context)
vmap_sample_by_sample(dense_forward)
vmap_sample_by_sample(dense_backward)


class _DenseLinearCrossEntropy(torch.autograd.Function):
    """:func:`dense_forward` with its autograd formula as an autograd.Function, for torch.func's
    transforms (as :class:`cce.cce_function._LinearCrossEntropy`)."""

    generate_vmap_rule = True

    setup_context = staticmethod(_setup_context)
    backward = staticmethod(_backward)

    @staticmethod
    def forward(*inputs):
        return dense_forward(*inputs)


def dense_loss(e: torch.Tensor, c: torch.Tensor, targets: torch.Tensor,
               bias: Optional[torch.Tensor], weighting: LossWeighting,
               options: LossOptions) -> TokenOutputs:
    """Canonical-signature entry point of the dense path (see :mod:`cce.loss`), for the calls
    :func:`dense_takes`."""
    if e.shape[0] == 0:
        return tokenless_loss(e, c, bias)
    needs_grad = needs_gradient(e, c, bias)
    arguments = (e, c, bias if bias is None else bias.contiguous(), targets.contiguous(),
                 weighting.weight, needs_grad)
    loss, lse, _ = (_DenseLinearCrossEntropy.apply(*arguments) if needs_grad
                    else dense_forward(*arguments))
    return TokenOutputs(loss, lse)
