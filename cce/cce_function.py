"""The CCE autograd function: forward = indexed dot + linear-log-sum-exp, backward = Alg. 3."""

from __future__ import annotations

from typing import Optional

import torch

from cce.config import interpreting
from cce.indexed_dot import indexed_dot
from cce.lse_backward import lse_backward
from cce.lse_forward import lse_forward


class LinearCrossEntropyFunction(torch.autograd.Function):
    """Per-token loss and LSE, float32 (N,); targets are canonical (int64, -1 = ignored)."""

    @staticmethod
    def forward(ctx, e: torch.Tensor, c: torch.Tensor, bias: Optional[torch.Tensor],
                targets: torch.Tensor, softcap: Optional[float], filter_eps: Optional[float],
                vocab_sorting: bool):
        needs_grad = any(ctx.needs_input_grad[:3])
        target_logit = indexed_dot(e, c, targets, bias, softcap)
        lse, vocab_logit_sum = lse_forward(e, c, targets, bias, softcap,
                                           sum_vocab_logits=needs_grad and vocab_sorting)
        valid = targets >= 0
        loss = torch.where(valid, lse - target_logit, 0.0)
        ctx.save_for_backward(e, c, bias, targets, lse, vocab_logit_sum)
        ctx.softcap = softcap
        ctx.filter_eps = filter_eps
        ctx.mark_non_differentiable(targets)
        return loss, lse

    @staticmethod
    def backward(ctx, grad_loss: Optional[torch.Tensor], grad_lse: Optional[torch.Tensor]):
        e, c, bias, targets, lse, vocab_logit_sum = ctx.saved_tensors
        valid = targets >= 0
        target_scale = (torch.where(valid, grad_loss.float(), 0.0) if grad_loss is not None
                        else torch.zeros_like(lse))
        prob_scale = target_scale + grad_lse.float() if grad_lse is not None else target_scale
        vocab_order = None
        if vocab_logit_sum is not None:
            # Decreasing average logit: likely tokens share tiles, the rest form skippable tiles.
            vocab_order = torch.argsort(vocab_logit_sum, descending=True).to(torch.int32)
        grad_e, grad_c, grad_bias = lse_backward(
            e, c, targets, bias, ctx.softcap, lse, prob_scale, target_scale, vocab_order,
            ctx.filter_eps,
        )
        return grad_e, grad_c, grad_bias, None, None, None, None


def cce_loss(e: torch.Tensor, c: torch.Tensor, targets: torch.Tensor,
             bias: Optional[torch.Tensor], softcap: Optional[float],
             filter_eps: Optional[float], vocab_sorting: bool):
    """Canonical-signature entry point (see :mod:`cce.loss`)."""
    device = e.device
    if device.type == "cpu" and not interpreting():
        # Compiled Triton kernels need CUDA tensors: on a machine with a GPU, CPU inputs run
        # there and the results (and gradients, through autograd) come back to the CPU.
        e, c, targets = e.cuda(), c.cuda(), targets.cuda()
        bias = bias.cuda() if bias is not None else None
    if e.shape[0] == 0:
        # No tokens: zero-size outputs that still connect every input to the graph.
        connected = e.sum() + c.sum() + (bias.sum() if bias is not None else 0)
        empty = e.new_zeros(0, dtype=torch.float32) + connected * 0
        return empty, empty.clone()
    if bias is not None:
        bias = bias.contiguous()  # the kernels index it with unit stride
    loss, lse = LinearCrossEntropyFunction.apply(e, c, bias, targets.contiguous(), softcap,
                                                 filter_eps, vocab_sorting)
    return loss.to(device), lse.to(device)
