"""The CCE autograd function: forward = indexed dot + linear-log-sum-exp, backward = Alg. 3."""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from cce.backward import linear_cross_entropy_backward
from cce.config import check_interpreter_usable, interpreting, kernel_configs
from cce.indexed_dot import indexed_dot
from cce.lse_forward import lse_forward
from cce.live_tiles import live_tiles
from cce.vocab_order import target_positions, vocab_order
from cce.weighting import LossWeighting, RankOneTerm


class ForwardResults(NamedTuple):
    """What the forward's kernels produce (:func:`forward_kernels`)."""

    order: Optional[torch.Tensor]  # int32 (V,) vocabulary order
    target_logit: torch.Tensor  # float32 (N,)
    lse: torch.Tensor  # float32 (N,)
    tile_bound: Optional[torch.Tensor]  # float32 live-grid table, see cce.lse_forward


def forward_kernels(e: torch.Tensor, c: torch.Tensor, bias: Optional[torch.Tensor],
                    targets: torch.Tensor, softcap: Optional[float], records_bounds: bool,
                    vocab_sorting: bool, *, logit_sum: Optional[torch.Tensor] = None,
                    class_weight: Optional[torch.Tensor] = None) -> ForwardResults:
    """Run the forward's kernels: vocabulary order, indexed dot, linear-log-sum-exp.
    ``records_bounds``: a filtering backward will follow, so the forward records the bounds of
    the live grid's tiles (else None) and, with ``vocab_sorting``, sorts the vocabulary first
    (else the order is None: sorting only serves the backward's skipping). ``logit_sum``,
    ``class_weight``: see :func:`cce.lse_forward.lse_forward`."""
    order = vocab_order(e, c, bias, targets) if records_bounds and vocab_sorting else None
    target_logit = indexed_dot(e, c, targets, bias, softcap)
    # The target logits double as lower bounds of the LSE for the tile bounds.
    lse, tile_bound = lse_forward(e, c, bias, softcap, targets, order,
                                  target_logit if records_bounds else None,
                                  logit_sum=logit_sum, class_weight=class_weight)
    return ForwardResults(order, target_logit, lse, tile_bound)


def recompute_table(tile_bound: torch.Tensor, lse: torch.Tensor, prob_scale: torch.Tensor,
                    positions: torch.Tensor, dtype: torch.dtype,
                    filter_eps: float) -> torch.Tensor:
    """The table of the live-grid tiles that the backward recomputes (:func:`cce.live_tiles`):
    those the forward's bounds cannot prove negligible. ``positions``: see
    :func:`cce.vocab_order.target_positions`."""
    grid = kernel_configs(dtype).live_grid
    return live_tiles(tile_bound, lse, prob_scale, positions, grid.block_tokens,
                      grid.block_vocab, filter_eps)


class LinearCrossEntropyFunction(torch.autograd.Function):
    """Per-token loss (F.cross_entropy's, with class ``weight`` and ``label_smoothing``) and
    LSE, float32 (N,); targets are canonical (int64, -1 = ignored)."""

    @staticmethod
    def forward(ctx, e: torch.Tensor, c: torch.Tensor, bias: Optional[torch.Tensor],
                targets: torch.Tensor, softcap: Optional[float], filter_eps: Optional[float],
                vocab_sorting: bool, filter_correction: bool, needs_grad: bool,
                weight: Optional[torch.Tensor] = None, label_smoothing: float = 0.0):
        # needs_grad comes from outside: grad mode is always off in here, and
        # ctx.needs_input_grad is True under torch.no_grad too.
        weighting = LossWeighting(weight, label_smoothing)
        smoothing = label_smoothing != 0
        logit_sum = torch.zeros_like(targets, dtype=torch.float32) if smoothing else None
        order, target_logit, lse, tile_bound = forward_kernels(
            e, c, bias, targets, softcap, records_bounds=needs_grad and filter_eps is not None,
            vocab_sorting=vocab_sorting, logit_sum=logit_sum, class_weight=weight)
        # A row with an infinite logit has lse = +inf, and a NaN loss in PyTorch, whose
        # log_softmax subtracts the row's maximum first (inf - inf).
        cross_entropy = torch.where(lse == float("inf"), float("nan"), lse - target_logit)
        loss = weighting.token_loss(cross_entropy, lse, logit_sum, targets, c.shape[0])
        ctx.save_for_backward(e, c, bias, targets, lse, order, weight, tile_bound)
        ctx.softcap = softcap
        ctx.filter_eps = filter_eps
        ctx.mass_correction = filter_correction and filter_eps is not None and softcap is None
        ctx.label_smoothing = label_smoothing
        return loss, lse

    @staticmethod
    def backward(ctx, grad_loss: Optional[torch.Tensor], grad_lse: Optional[torch.Tensor]):
        e, c, bias, targets, lse, order, weight, tile_bound = ctx.saved_tensors
        if grad_loss is None:
            grad_loss = torch.zeros_like(lse)
        prob_scale, target_scale, uniform_scale = LossWeighting(
            weight, ctx.label_smoothing).gradient_scales(grad_loss, targets, c.shape[0])
        if grad_lse is not None:
            prob_scale = prob_scale + grad_lse.float()
        rank_one = RankOneTerm(uniform_scale, weight) if uniform_scale is not None else None
        positions = target_positions(targets, order)
        live = None
        if tile_bound is not None:
            live = recompute_table(tile_bound, lse, prob_scale, positions, e.dtype,
                                   ctx.filter_eps)
        grad_e, grad_c, grad_bias = linear_cross_entropy_backward(
            e, c, positions, bias, ctx.softcap, lse, prob_scale, target_scale, order, live,
            ctx.filter_eps, needs_grad_e=ctx.needs_input_grad[0],
            needs_grad_c=ctx.needs_input_grad[1] or ctx.needs_input_grad[2],
            mass_correction=ctx.mass_correction, rank_one=rank_one)
        return (grad_e, grad_c, grad_bias) + (None,) * 8


def cce_loss(e: torch.Tensor, c: torch.Tensor, targets: torch.Tensor,
             bias: Optional[torch.Tensor], softcap: Optional[float],
             filter_eps: Optional[float], vocab_sorting: bool, filter_correction: bool,
             weighting: LossWeighting = LossWeighting()):
    """Canonical-signature entry point (see :mod:`cce.loss`)."""
    check_interpreter_usable()
    device = e.device
    if device.type == "cpu" and not interpreting():
        # Compiled Triton kernels need CUDA tensors: on a machine with a GPU, CPU inputs run
        # there and the results (and gradients, through autograd) come back to the CPU.
        e, c, targets = e.cuda(), c.cuda(), targets.cuda()
        bias = bias.cuda() if bias is not None else None
        weighting = weighting.to(e.device)
    if e.shape[0] == 0:
        # No tokens: zero-size outputs that still connect every input to the graph.
        connected = e.sum() + c.sum() + (bias.sum() if bias is not None else 0)
        empty = e.new_zeros(0, dtype=torch.float32) + connected * 0
        return empty, empty.clone()
    if bias is not None:
        bias = bias.contiguous()  # the kernels index it with unit stride
    needs_grad = torch.is_grad_enabled() and any(
        tensor is not None and tensor.requires_grad for tensor in (e, c, bias))
    loss, lse = LinearCrossEntropyFunction.apply(e, c, bias, targets.contiguous(), softcap,
                                                 filter_eps, vocab_sorting, filter_correction,
                                                 needs_grad, weighting.weight,
                                                 weighting.label_smoothing)
    return loss.to(device), lse.to(device)
