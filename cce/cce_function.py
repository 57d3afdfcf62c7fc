"""The CCE loss as two PyTorch custom ops: ``cce::loss_forward`` (indexed dot + linear-log-sum-exp)
and ``cce::loss_backward`` (Alg. 3).

Both are registered with ``torch.library``, with fake implementations (FakeTensor, meta tensors,
torch.compile), and the forward with its autograd formula, which calls the backward op: so
torch.compile sees one opaque op per pass instead of tracing into the kernels' launch code
(which, in Triton's CPU interpreter, it cannot). Custom ops take and return tensors only: an absent
output (the vocabulary order without sorting, the tile bounds without a filtering backward, the
curvature sum without a softcap, smoothing and a backward, a gradient nobody needs) is an empty
tensor. The gradients are differentiable once: differentiating them raises
(:func:`cce.autograd.differentiable_once`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple, Optional

import torch

from cce.backward.run import BackwardRequest, CorrectionInputs, linear_cross_entropy_backward
from cce.config import cdiv, check_interpreter_usable, kernel_configs
from cce.backward.embeddings_product import reads_sorted_copy
from cce.backward.gradient_tiles import RecomputeInputs
from cce.forward.indexed_dot import indexed_dot
from cce.forward.lse_forward import descriptors_ready, leave_out_targets, lse_forward
from cce.forward.plan import ForwardPlan, forward_outputs, plan_forward
from cce.forward.row_outputs import row_outputs
from cce.autograd import (differentiable_once, needs_gradient, tokenless_loss,
                          vmap_sample_by_sample)
from cce.backward.live_tiles import live_tiles
from cce.forward.vocab_order import sort_vocabulary
from cce.weighting import (EntropyTerm, LossWeighting, RankOneTerm, TokenOutputs,
                           argmax_or_none, entropy_and_gradient_terms, target_entry)

if TYPE_CHECKING:
    from cce.options import LossOptions


class ForwardResults(NamedTuple):
    """What the forward's kernels produce (:func:`forward_kernels`)."""

    order: Optional[torch.Tensor]  # int32 (V,) vocabulary order
    target_positions: torch.Tensor  # int32 (N,), see cce.forward.vocab_order.target_positions
    lse: torch.Tensor  # float32 (N,)
    cross_entropy: torch.Tensor  # float32 (N,): L - z_y (cce.forward.row_outputs)
    target_complement: torch.Tensor  # float32 (N,): 1 - p_y (cce.forward.row_outputs)
    tile_bound: Optional[torch.Tensor]  # float32 live-grid table, see cce.forward.lse_forward
    classifier_row_sum: Optional[torch.Tensor]  # float32 (D,) c.sum(0), read with the order
    entropy: Optional[torch.Tensor] = None  # float32 (N,)
    # float32 (2, N): the mean logit mu and p_y (z_y - mu) (0 without a target), for the
    # entropy's gradient (cce.weighting.entropy_and_gradient_terms)
    entropy_terms: Optional[torch.Tensor] = None
    argmax: Optional[torch.Tensor] = None  # int64 (N,)
    # c's rows in position order, kept for the backward (ForwardPlan.keeps_classifier_copy)
    classifier_copy: Optional[torch.Tensor] = None


def forward_kernels(e: torch.Tensor, c: torch.Tensor, bias: Optional[torch.Tensor],
                    targets: torch.Tensor, softcap: Optional[float], plan: ForwardPlan, *,
                    logit_sum: Optional[torch.Tensor] = None,
                    curvature_sum: Optional[torch.Tensor] = None,
                    class_weight: Optional[torch.Tensor] = None) -> ForwardResults:
    """Run the forward's kernels as ``plan`` says (:mod:`cce.forward.plan`): vocabulary order,
    indexed dot, linear-log-sum-exp. Without recorded bounds, ``tile_bound`` is None; without
    sorting, the order and the row sum of ``c`` are. ``logit_sum``, ``curvature_sum``,
    ``class_weight``: see :func:`cce.forward.lse_forward.lse_forward`."""
    order = position_of = row_sum = sorted_classifier = None
    if plan.sorts:
        order, position_of, row_sum = sort_vocabulary(e, c, bias, targets)
        if plan.copies_classifier and (plan.keeps_classifier_copy or descriptors_ready(e, c)):
            sorted_classifier = c.index_select(0, order)
    left_out = leave_out_targets(targets, position_of, e.dtype, c.shape[0])
    target_logit = indexed_dot(e, c, targets, bias, softcap, placement=left_out)
    other_entropy = torch.zeros_like(target_logit) if plan.entropy else None
    row_argmax = (torch.empty(targets.shape, dtype=torch.int64, device=e.device)
                  if plan.argmax else None)
    # The target logits double as lower bounds of the LSE for the tile bounds.
    other_lse, tile_bound = lse_forward(e, c, bias, softcap, targets, order,
                                        target_logit if plan.records_bounds else None,
                                        left_out=left_out, logit_sum=logit_sum,
                                        curvature_sum=curvature_sum, class_weight=class_weight,
                                        entropy=other_entropy, argmax=row_argmax,
                                        deterministic=plan.deterministic,
                                        sorted_classifier=sorted_classifier)
    lse, cross_entropy, complement = row_outputs(other_lse, target_logit, targets)
    row_entropy = entropy_terms = None
    if plan.entropy:
        row_entropy, mean, target_term = entropy_and_gradient_terms(
            other_entropy, other_lse, target_logit, lse, cross_entropy, complement, targets)
        entropy_terms = torch.stack([mean, target_term])
    if plan.argmax:
        row_argmax = argmax_or_none(row_argmax, lse)
    return ForwardResults(order, left_out.positions, lse, cross_entropy, complement, tile_bound,
                          row_sum, row_entropy, entropy_terms, row_argmax,
                          sorted_classifier if plan.keeps_classifier_copy else None)


def recompute_table(tile_bound: torch.Tensor, lse: torch.Tensor, prob_scale: torch.Tensor,
                    positions: torch.Tensor, dtype: torch.dtype,
                    filter_eps: float) -> torch.Tensor:
    """The table of the live-grid tiles that the backward recomputes
    (:func:`cce.backward.live_tiles`): those the forward's bounds cannot prove negligible.
    ``positions``: see :func:`cce.forward.vocab_order.target_positions`."""
    grid = kernel_configs(dtype).live_grid
    return live_tiles(tile_bound, lse, prob_scale, positions, grid.block_tokens,
                      grid.block_vocab, filter_eps)


def uses_filter_correction(filter_correction: bool, filter_eps: Optional[float],
                         softcap: Optional[float]) -> bool:
    """Whether dE gets back what the filter dropped: with filtering and no softcap, whose
    derivative the dropped entries' mass does not carry (:mod:`cce.backward.sparse_tile_matmul`)."""
    return filter_correction and filter_eps is not None and softcap is None


# --- The ops ---------------------------------------------------------------------------------


@torch.library.custom_op("cce::loss_forward", mutates_args=())
def loss_forward(e: torch.Tensor, c: torch.Tensor, bias: Optional[torch.Tensor],
                 targets: torch.Tensor, weight: Optional[torch.Tensor], softcap: Optional[float],
                 filter_eps: Optional[float], vocab_sorting: bool, filter_correction: bool,
                 label_smoothing: float, deterministic: bool, keep_tiles: bool,
                 return_entropy: bool, return_argmax: bool, needs_grad: bool,
                 grad_c_follows: bool,
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                            torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                            torch.Tensor, torch.Tensor]:
    """(per-token loss, lse, entropy, argmax, target complement, target positions, vocabulary
    order, tile bounds, curvature sum, classifier row sum, entropy terms, classifier copy):
    float32 (N,), float32 (N,), float32 (N,) with ``return_entropy`` or empty, int64 (N,) with
    ``return_argmax`` or empty, float32 (N,) ``1 - p_y``
    (:func:`cce.weighting.target_complement`), int32 (N,), int32 (V,) or empty, float32
    live-grid table or empty, float32 (N,) with a softcap, label smoothing and ``needs_grad``
    (:meth:`cce.weighting.LossWeighting.rank_one_term`) or empty, float32 (D,) with the order or
    empty, float32 (2, N) with the entropy and ``needs_grad``
    (:attr:`ForwardResults.entropy_terms`) or empty, ``c``'s rows in position order where the
    backward reads the forward's copy (:func:`cce.backward.embeddings_product.reads_sorted_copy`)
    or empty. Targets are canonical (int64, -1 = ignored); ``weight`` (float32 (V,)) and
    ``label_smoothing`` as in :mod:`cce.weighting`.
    ``needs_grad``: a backward will follow, so the forward prepares the filter's skipping;
    ``grad_c_follows``: that backward computes dC (:func:`cce.forward.plan.plan_forward`);
    ``filter_correction`` and ``keep_tiles`` are the backward's (see :func:`loss_backward`);
    ``deterministic``: see :func:`cce.forward.lse_forward.lse_forward`."""
    check_interpreter_usable()
    plan = plan_forward(e.shape[0], e.shape[1], filter_eps=filter_eps,
                        vocab_sorting=vocab_sorting, softcap=softcap,
                        label_smoothing=label_smoothing, needs_grad=needs_grad,
                        grad_c_follows=grad_c_follows, entropy=return_entropy,
                        argmax=return_argmax, deterministic=deterministic,
                        backward_reads_copy=reads_sorted_copy(c, keep_tiles, label_smoothing,
                                                              grad_c_follows))
    logit_sum = (torch.zeros(targets.shape, dtype=torch.float32, device=e.device)
                 if label_smoothing else None)
    curvature_sum = torch.zeros_like(logit_sum) if plan.sums_curvature else None
    forward = forward_kernels(e, c, bias, targets, softcap, plan, logit_sum=logit_sum,
                              curvature_sum=curvature_sum, class_weight=weight)
    loss = LossWeighting(weight, label_smoothing).token_loss(
        forward.cross_entropy, forward.lse, logit_sum, targets, c.shape[0])
    return (loss, forward.lse, _or_empty(forward.entropy, torch.float32, e.device),
            _or_empty(forward.argmax, torch.int64, e.device), forward.target_complement,
            forward.target_positions, _or_empty(forward.order, torch.int32, e.device),
            _or_empty(forward.tile_bound, torch.float32, e.device),
            _or_empty(curvature_sum, torch.float32, e.device),
            _or_empty(forward.classifier_row_sum, torch.float32, e.device),
            _or_empty(forward.entropy_terms if needs_grad else None, torch.float32, e.device),
            _or_empty(forward.classifier_copy, c.dtype, e.device))


@loss_forward.register_fake
def _loss_forward_fake(e, c, bias, targets, weight, softcap, filter_eps, vocab_sorting,
                       filter_correction, label_smoothing, deterministic, keep_tiles,
                       return_entropy, return_argmax, needs_grad, grad_c_follows):
    num_tokens, vocab_size = e.shape[0], c.shape[0]
    plan = forward_outputs(filter_eps=filter_eps, vocab_sorting=vocab_sorting, softcap=softcap,
                           label_smoothing=label_smoothing, needs_grad=needs_grad,
                           backward_reads_copy=reads_sorted_copy(c, keep_tiles, label_smoothing,
                                                                 grad_c_follows))
    grid = kernel_configs(e.dtype).live_grid  # lse_forward's table: one row per token block
    bound_shape = ((cdiv(num_tokens, grid.block_tokens),
                    cdiv(vocab_size, grid.block_vocab)) if plan.records_bounds
                   else (0,))
    return (e.new_empty(num_tokens, dtype=torch.float32),
            e.new_empty(num_tokens, dtype=torch.float32),
            e.new_empty(num_tokens if return_entropy else 0, dtype=torch.float32),
            e.new_empty(num_tokens if return_argmax else 0, dtype=torch.int64),
            e.new_empty(num_tokens, dtype=torch.float32),
            e.new_empty(num_tokens, dtype=torch.int32),
            e.new_empty(vocab_size if plan.sorts else 0, dtype=torch.int32),
            e.new_empty(bound_shape, dtype=torch.float32),
            e.new_empty(num_tokens if plan.sums_curvature else 0, dtype=torch.float32),
            e.new_empty(e.shape[1] if plan.sorts else 0, dtype=torch.float32),
            e.new_empty((2, num_tokens) if return_entropy and needs_grad else (0,),
                        dtype=torch.float32),
            c.new_empty(c.shape if plan.keeps_classifier_copy else (0,)))


@torch.library.custom_op("cce::loss_backward", mutates_args=())
def loss_backward(e: torch.Tensor, c: torch.Tensor, bias: Optional[torch.Tensor],
                  targets: torch.Tensor, weight: Optional[torch.Tensor], lse: torch.Tensor,
                  target_complement: torch.Tensor, positions: torch.Tensor,
                  order: torch.Tensor, tile_bound: torch.Tensor, curvature_sum: torch.Tensor,
                  classifier_row_sum: torch.Tensor, entropy_terms: torch.Tensor,
                  classifier_copy: torch.Tensor, grad_loss: Optional[torch.Tensor],
                  grad_lse: Optional[torch.Tensor], grad_entropy: Optional[torch.Tensor],
                  softcap: Optional[float], filter_eps: Optional[float],
                  filter_correction: bool, label_smoothing: float, keep_tiles: bool,
                  needs_grad_e: bool, needs_grad_c: bool,
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dE, dC, dbias) of ``sum(loss * grad_loss + lse * grad_lse + entropy * grad_entropy)``
    (a None gradient counts as 0), each empty when not needed (dC and dbias both come with
    ``needs_grad_c``). ``target_complement``, ``positions``, ``order``, ``tile_bound``,
    ``curvature_sum``, ``classifier_row_sum``, ``entropy_terms`` and ``classifier_copy``: from
    :func:`loss_forward`.
    ``filter_correction``: with filtering and no softcap, dE gets back what the filter dropped
    (:mod:`cce.backward.sparse_tile_matmul`).
    ``keep_tiles``: recompute each live tile once, into memory of its own
    (:func:`cce.backward.run.linear_cross_entropy_backward`)."""
    order = order if order.numel() else None
    curvature_sum = curvature_sum if curvature_sum.numel() else None
    classifier_row_sum = classifier_row_sum if classifier_row_sum.numel() else None
    classifier_copy = classifier_copy if classifier_copy.numel() else None
    if grad_loss is None:
        grad_loss = torch.zeros_like(lse)
    weighting = LossWeighting(weight, label_smoothing)
    scales = weighting.gradient_scales(grad_loss, targets, c.shape[0])
    if grad_lse is not None:
        scales = scales._replace(softmax=scales.softmax + grad_lse.float())
    rank_one = (weighting.rank_one_term(scales.uniform, curvature_sum, c.shape[0])
                if scales.uniform is not None else None)
    entry = target_entry(scales, target_complement)
    entropy = None
    # The rows with a softmax term in their gradient: for the live table, only != 0 counts.
    softmax_rows = scales.softmax
    if grad_entropy is not None and entropy_terms.numel():  # (compile passes zeros unasked)
        entropy = EntropyTerm(-grad_entropy.float(), entropy_terms[0])
        entry = entry + entropy.scale * entropy_terms[1]
        softmax_rows = scales.softmax.abs() + entropy.scale.abs()
    if e.shape[1] == 0:
        grad_bias = (_bias_gradient_without_dimensions(bias, targets, softcap, scales.softmax,
                                                       scales.target, rank_one, entropy)
                     if needs_grad_c and bias is not None else None)
        return (e.new_zeros(e.shape if needs_grad_e else (0,)),
                c.new_zeros(c.shape if needs_grad_c else (0,)),
                _or_empty(grad_bias, c.dtype, c.device))
    live = None
    if tile_bound.numel():
        live = recompute_table(tile_bound, lse, softmax_rows, positions, e.dtype, filter_eps)
    # The tiles add up the softmax mass off the targets, 1 - p_y (cce.backward.sparse_tile_matmul).
    recompute = RecomputeInputs(e, c, positions, bias, softcap, lse, scales.softmax, entry,
                                order, filter_eps, rank_one, entropy, classifier_copy)
    correction = (CorrectionInputs(target_complement, classifier_row_sum)
                  if uses_filter_correction(filter_correction, filter_eps, softcap) else None)
    grad_e, grad_c, grad_bias = linear_cross_entropy_backward(recompute, BackwardRequest(
        live, needs_grad_e, needs_grad_c, correction, keep_tiles))
    return (_or_empty(grad_e, e.dtype, e.device), _or_empty(grad_c, c.dtype, c.device),
            _or_empty(grad_bias, c.dtype, c.device))


def _bias_gradient_without_dimensions(bias: torch.Tensor, targets: torch.Tensor,
                                      softcap: Optional[float], prob_scale: torch.Tensor,
                                      target_scale: torch.Tensor,
                                      rank_one: Optional[RankOneTerm],
                                      entropy: Optional[EntropyTerm]) -> torch.Tensor:
    """dbias when D = 0 (the kernels' tiles need D > 0): every row's logits are the (capped)
    bias, so every row has the same softmax."""
    logits = bias.float()
    if softcap is not None:
        capped = torch.tanh(logits / softcap)
        logits = softcap * capped
    target_sums = torch.zeros_like(logits).index_add_(0, targets.clamp(min=0), target_scale)
    softmax = torch.softmax(logits, dim=0)
    grad = softmax * prob_scale.sum() - target_sums
    if entropy is not None:  # every row's mean logit is the same too
        mean = (softmax * logits.clamp(min=torch.finfo(logits.dtype).min)).sum()
        grad = grad + softmax * (logits - mean) * entropy.scale.sum()
    if rank_one is not None:
        class_weight = rank_one.weight if rank_one.weight is not None else 1.0
        grad = grad + class_weight * rank_one.scale.sum()
    if softcap is not None:
        grad = grad * (1.0 - capped * capped)
    return grad.to(bias.dtype)


@loss_backward.register_fake
def _loss_backward_fake(e, c, bias, targets, weight, lse, target_complement, positions, order,
                        tile_bound, curvature_sum, classifier_row_sum, entropy_terms,
                        classifier_copy, grad_loss,
                        grad_lse, grad_entropy, softcap, filter_eps, filter_correction,
                        label_smoothing, keep_tiles, needs_grad_e, needs_grad_c):
    return (e.new_empty(e.shape if needs_grad_e else (0,)),
            c.new_empty(c.shape if needs_grad_c else (0,)),
            c.new_empty(bias.shape if needs_grad_c and bias is not None else (0,)))


# --- Autograd ----------------------------------------------------------------------------------


def _loss_forward_setup_context(ctx, inputs, output) -> None:
    (e, c, bias, targets, weight, softcap, filter_eps, _, filter_correction, label_smoothing, _,
     keep_tiles, *_) = inputs
    (_, lse, _, argmax, complement, positions, order, tile_bound, curvature_sum, row_sum,
     entropy_terms, classifier_copy) = output
    ctx.mark_non_differentiable(argmax, complement, positions, order, tile_bound, curvature_sum,
                                row_sum, entropy_terms, classifier_copy)
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(e, c, bias, targets, weight, lse, complement, positions, order,
                          tile_bound, curvature_sum, row_sum, entropy_terms, classifier_copy)
    ctx.options = (softcap, filter_eps, filter_correction, label_smoothing, keep_tiles)


def _loss_forward_backward(ctx, grad_loss: Optional[torch.Tensor],
                           grad_lse: Optional[torch.Tensor], grad_entropy: Optional[torch.Tensor],
                           *_grad_non_differentiable):
    """Gradients of e, c and bias (None for the targets and the options)."""
    (e, c, bias, targets, weight, lse, complement, positions, order, tile_bound, curvature_sum,
     row_sum, entropy_terms, classifier_copy) = ctx.saved_tensors
    needs_e, needs_c, needs_bias = ctx.needs_input_grad[:3]
    with torch.no_grad():  # under create_graph=True too: see differentiable_once
        grad_e, grad_c, grad_bias = loss_backward(
            e, c, bias, targets, weight, lse, complement, positions, order, tile_bound,
            curvature_sum, row_sum, entropy_terms, classifier_copy, grad_loss, grad_lse,
            grad_entropy,
            *ctx.options, needs_grad_e=needs_e, needs_grad_c=needs_c or needs_bias)
    gradients = differentiable_once(
        [grad if needed else None
         for grad, needed in ((grad_e, needs_e), (grad_c, needs_c), (grad_bias, needs_bias))],
        (e, c, bias, grad_loss, grad_lse, grad_entropy))
    return gradients + (None,) * (len(ctx.needs_input_grad) - 3)


loss_forward.register_autograd(_loss_forward_backward, setup_context=_loss_forward_setup_context)


vmap_sample_by_sample(loss_forward)
vmap_sample_by_sample(loss_backward)


class _LinearCrossEntropy(torch.autograd.Function):
    """:func:`loss_forward` with its registered autograd formula, as an autograd.Function: the
    public path when gradients are needed, since torch.func's transforms cannot yet
    differentiate a custom op through its registered formula (pytorch/pytorch#170834), but can
    this. (Without gradients the op is called directly: Dynamo fails on this Function when no
    input requires grad.)"""

    generate_vmap_rule = True

    setup_context = staticmethod(_loss_forward_setup_context)
    backward = staticmethod(_loss_forward_backward)

    @staticmethod
    def forward(*inputs):
        return loss_forward(*inputs)  # the op itself is no function Dynamo can wrap


def _or_empty(tensor: Optional[torch.Tensor], dtype: torch.dtype,
              device: torch.device) -> torch.Tensor:
    """``tensor``, or an empty one for None (custom ops return tensors only)."""
    return tensor if tensor is not None else torch.empty(0, dtype=dtype, device=device)


def cce_loss(e: torch.Tensor, c: torch.Tensor, targets: torch.Tensor,
             bias: Optional[torch.Tensor], weighting: LossWeighting, options: LossOptions):
    """Canonical-signature entry point of the Triton kernels (see :mod:`cce.loss`): CUDA
    tensors, or CPU tensors in Triton's interpreter; ``options`` resolved."""
    if e.shape[0] == 0:
        return tokenless_loss(e, c, bias)
    if bias is not None:
        bias = bias.contiguous()  # the kernels index it with unit stride
    # Grad mode is off inside the op, where the forward must know whether a backward follows.
    needs_grad = needs_gradient(e, c, bias)
    # The custom op's schema takes tensors and scalars: the options go flat here.
    arguments = (e, c, bias, targets.contiguous(), weighting.weight, options.softcap,
                 options.filter_eps, options.vocab_sorting, options.filter_correction,
                 weighting.label_smoothing, options.deterministic, options.keeps_tiles,
                 options.return_entropy, options.return_argmax, needs_grad,
                 needs_grad and c.requires_grad)
    loss, lse, entropy, argmax, *_ = (_LinearCrossEntropy.apply(*arguments) if needs_grad
                                      else loss_forward(*arguments))
    return TokenOutputs(loss, lse, entropy if options.return_entropy else None,
                        argmax if options.return_argmax else None)
