"""The CCE autograd function: forward = indexed dot + linear-log-sum-exp, backward = Alg. 3."""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from cce.backward import linear_cross_entropy_backward
from cce.config import check_interpreter_usable, kernel_configs
from cce.indexed_dot import indexed_dot
from cce.lse_forward import lse_forward
from cce.live_tiles import live_tiles
from cce.vocab_order import target_positions, vocab_order


class ForwardResults(NamedTuple):
    """What the forward's kernels produce (:func:`forward_kernels`)."""

    order: Optional[torch.Tensor]  # int32 (V,) vocabulary order
    target_logit: torch.Tensor  # float32 (N,)
    lse: torch.Tensor  # float32 (N,)
    tile_bound: Optional[torch.Tensor]  # float32 live-grid table, see cce.lse_forward


def forward_kernels(e: torch.Tensor, c: torch.Tensor, bias: Optional[torch.Tensor],
                    targets: torch.Tensor, softcap: Optional[float], records_bounds: bool,
                    vocab_sorting: bool) -> ForwardResults:
    """Run the forward's kernels: vocabulary order, indexed dot, linear-log-sum-exp.
    ``records_bounds``: a filtering backward will follow, so the forward records the bounds of
    the live grid's tiles (else None) and, with ``vocab_sorting``, sorts the vocabulary first
    (else the order is None: sorting only serves the backward's skipping)."""
    order = vocab_order(e, c, bias, targets) if records_bounds and vocab_sorting else None
    target_logit = indexed_dot(e, c, targets, bias, softcap)
    # The target logits double as lower bounds of the LSE for the tile bounds.
    lse, tile_bound = lse_forward(e, c, bias, softcap, targets, order,
                                  target_logit if records_bounds else None)
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
    """Per-token loss and LSE, float32 (N,); targets are canonical (int64, -1 = ignored)."""

    @staticmethod
    def forward(ctx, e: torch.Tensor, c: torch.Tensor, bias: Optional[torch.Tensor],
                targets: torch.Tensor, softcap: Optional[float], filter_eps: Optional[float],
                vocab_sorting: bool, filter_correction: bool, needs_grad: bool):
        # needs_grad comes from outside: grad mode is always off in here, and
        # ctx.needs_input_grad is True under torch.no_grad too.
        order, target_logit, lse, tile_bound = forward_kernels(
            e, c, bias, targets, softcap, records_bounds=needs_grad and filter_eps is not None,
            vocab_sorting=vocab_sorting)
        # A row with an infinite logit has lse = +inf, and a NaN loss in PyTorch, whose
        # log_softmax subtracts the row's maximum first (inf - inf).
        token_loss = torch.where(lse == float("inf"), float("nan"), lse - target_logit)
        loss = torch.where(targets >= 0, token_loss, 0.0)
        ctx.save_for_backward(e, c, bias, targets, lse, order, tile_bound)
        ctx.softcap = softcap
        ctx.filter_eps = filter_eps
        ctx.mass_correction = filter_correction and filter_eps is not None and softcap is None
        return loss, lse

    @staticmethod
    def backward(ctx, grad_loss: Optional[torch.Tensor], grad_lse: Optional[torch.Tensor]):
        e, c, bias, targets, lse, order, tile_bound = ctx.saved_tensors
        target_scale = (torch.where(targets >= 0, grad_loss.float(), 0.0)
                        if grad_loss is not None else torch.zeros_like(lse))
        prob_scale = target_scale + grad_lse.float() if grad_lse is not None else target_scale
        positions = target_positions(targets, order)
        live = None
        if tile_bound is not None:
            live = recompute_table(tile_bound, lse, prob_scale, positions, e.dtype,
                                   ctx.filter_eps)
        grad_e, grad_c, grad_bias = linear_cross_entropy_backward(
            e, c, positions, bias, ctx.softcap, lse, prob_scale, target_scale, order, live,
            ctx.filter_eps, needs_grad_e=ctx.needs_input_grad[0],
            needs_grad_c=ctx.needs_input_grad[1] or ctx.needs_input_grad[2],
            mass_correction=ctx.mass_correction)
        return grad_e, grad_c, grad_bias, None, None, None, None, None, None


def cce_loss(e: torch.Tensor, c: torch.Tensor, targets: torch.Tensor,
             bias: Optional[torch.Tensor], softcap: Optional[float],
             filter_eps: Optional[float], vocab_sorting: bool, filter_correction: bool):
    """Canonical-signature entry point of the Triton kernels (see :mod:`cce.loss`): CUDA
    tensors, or CPU tensors in Triton's interpreter."""
    check_interpreter_usable()
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
                                                 needs_grad)
    return loss, lse
