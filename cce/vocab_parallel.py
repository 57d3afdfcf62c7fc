"""Vocabulary parallelism: the loss of a classifier whose rows are split over the ranks of a group.

Each rank holds rows ``[start, stop)`` of the (V, D) classifier, the same embeddings ``e`` and the
same targets (global vocabulary ids). The loss of the whole vocabulary needs, per token, only its
log-sum-exp and its target's logit, so the ranks exchange per-token values, never logits:

- forward: each rank computes on its shard, with the single-GPU kernels, its target logits (0
  where the target is another shard's) and the log-sum-exp of its logits off the target; one
  all-reduce SUM gives the target logits, an all-reduce MAX and a SUM of ``exp(local - max)``
  the log-sum-exp of every row's non-target logits, and with the target logit its LSE
  (:mod:`cce.weighting`). Every rank then has the loss (and lse) of the unsharded call, the
  same on every rank. The target logits are summed first: they are a lower bound of the whole
  vocabulary's log-sum-exp, which the shard's forward uses for its tile bounds. The entropy
  merges the shards' as the LSE does (one more SUM), the argmax by value, then by index (a MAX
  and a MIN).
- backward: each rank runs the single-GPU backward on its shard with the global log-sum-exp (its
  softmax entries are ``exp(z - global lse)``) and the target's entry only where the target is
  in its shard. Filtering and vocabulary sorting work per shard, with the global log-sum-exp.
  A rank may hold no rows: it adds nothing to the sums, and its dC is empty.
  ``dC`` and ``dbias`` are the shard's; ``dE``, a sum over the shards, is computed in float32 on
  each rank and summed by one all-reduce.

Before any of that, the ranks all-gather their ``(start, stop, rows of c)`` so that every rank
checks the same list: inconsistent ranges raise the same ValueError on every rank, not a hang
(the one host sync of a call, to read the list).
"""

from __future__ import annotations

import sys
from typing import Optional

import torch
import torch.distributed as dist

from cce.reference.baselines import materialized_logits
from cce.autograd import differentiable_once, needs_gradient, tokenless_loss
from cce.config import cdiv, check_interpreter_usable, kernels_take
from cce.options import LossOptions, VocabParallelOptions
from cce.weighting import (EntropyTerm, GradientScales, TokenOutputs, argmax_or_none,
                           entropy_and_gradient_terms, entropy_of_parts, lse_and_cross_entropy,
                           target_complement, target_entry)

# The kernels' modules (which import Triton) are imported where the kernels run: the options,
# the checks and impl="torch" need no Triton.

# The implementations that run vocabulary-parallel: the kernels, and materialized local logits
# (a reference whose backward is autograd's).
_NO_INDEX = torch.iinfo(torch.int64).max  # a shard's argmax where it holds no rows


def local_tensors(e, c, targets, bias, vocab_parallel: Optional[VocabParallelOptions]):
    """The loss's arguments as local tensors, and this rank's shard. A classifier that is a
    DTensor on a 1-D mesh, sharded by vocabulary rows (``Shard(0)``, as tensor parallelism puts
    an output layer's weight) with ``e`` a DTensor on the same mesh, is a vocabulary-parallel
    call: ``e`` (and ``targets``) are made replicated, ``c`` (and ``bias``) their local rows,
    whose range and the mesh's group become the ``VocabParallelOptions``; gradients return to
    the DTensors through ``to_local``. A replicated classifier is the plain call. Any other
    DTensor raises: a classifier sharded with a plain ``e`` is FSDP's shard of the weight,
    whose ranks hold different tokens."""
    # No DTensor can exist unless its module was imported: importing it here would cost time.
    module = sys.modules.get("torch.distributed.tensor")
    if module is None:
        return e, c, targets, bias, vocab_parallel
    dtensor = module.DTensor
    if not isinstance(c, dtensor) or not isinstance(e, dtensor) or e.device_mesh != c.device_mesh:
        _reject_dtensors(e=e, c=c, targets=targets, bias=bias)
        return e, c, targets, bias, vocab_parallel
    mesh = c.device_mesh
    if mesh.ndim != 1:
        raise ValueError(f"c is a DTensor on a {mesh.ndim}-D device mesh: cce takes a classifier "
                         "sharded over a 1-D mesh (the tensor-parallel one)")
    if vocab_parallel is not None:
        raise ValueError("vocab_parallel must be None when c is a DTensor: its placement gives "
                         "the shard")
    placement = c.placements[0]
    if not (placement.is_replicate() or (placement.is_shard() and placement.dim == 0)):
        raise ValueError(f"c is a DTensor placed as {placement!r}: cce takes Shard(0) (rows of "
                         "the vocabulary) or Replicate()")
    replicated = [module.Replicate()]

    def local(tensor):
        if isinstance(tensor, dtensor):
            if tensor.device_mesh != mesh:
                raise ValueError("e, c, targets and bias must be DTensors of one device mesh")
            if tensor is c or tensor is bias:
                if tuple(tensor.placements) != tuple(c.placements):
                    raise ValueError(f"bias is placed as {tensor.placements[0]!r} but c as "
                                     f"{placement!r}: they must match")
                return tensor.to_local()
            return tensor.redistribute(mesh, replicated).to_local()
        return tensor

    e_local, c_local, targets_local, bias_local = (local(x) for x in (e, c, targets, bias))
    if placement.is_replicate():
        return e_local, c_local, targets_local, bias_local, None
    if bias is not None and not isinstance(bias, dtensor):
        raise ValueError("bias must be a DTensor placed as c (Shard(0)) when c is one")
    # Shard(0) splits as torch.chunk does: ceil(V / ranks) rows each, the last ones fewer or
    # none (check_shards verifies the ranges on every rank).
    vocab_size, ranks = c.shape[0], mesh.size()
    start = min(mesh.get_local_rank() * cdiv(vocab_size, ranks), vocab_size)
    shard = VocabParallelOptions(start, start + c_local.shape[0], mesh.get_group())
    return e_local, c_local, targets_local, bias_local, shard


def _reject_dtensors(**tensors: Optional[torch.Tensor]) -> None:
    """Raise on a DTensor argument that :func:`local_tensors` does not take."""
    dtensor = sys.modules["torch.distributed.tensor"].DTensor
    for name, tensor in tensors.items():
        if isinstance(tensor, dtensor):
            raise ValueError(
                f"{name} is a DTensor that cce cannot read as a vocabulary shard: pass local "
                f"tensors, or, for tensor parallelism, c sharded as Shard(0) with e a DTensor "
                f"of the same 1-D mesh. For a classifier sharded over the vocabulary, you may "
                f"also pass {name}.to_local() with vocab_parallel=cce.VocabParallelOptions"
                f"(start, stop, group); for a replicated one, {name}.full_tensor(). Under FSDP2, "
                f"compute the loss inside the module's forward, where the weight is gathered "
                f"(as cce.integrations.transformers.patch does)")


def check_shards(vocab_parallel: VocabParallelOptions, e: torch.Tensor, c: torch.Tensor) -> int:
    """The size of the whole vocabulary, after checking every rank's range against the others'
    (one all-gather of three integers per rank, on e's device). Raises the same ValueError on
    every rank when the ranges do not partition [0, V) in rank order or a rank's c does not have
    stop - start rows. Runs before any other check of the arguments: one that raised on some
    ranks only would leave the others waiting here."""
    group = vocab_parallel.group
    rows = c.shape[0] if isinstance(c, torch.Tensor) and c.dim() == 2 else -1
    device = e.device if isinstance(e, torch.Tensor) else torch.device("cpu")
    table = torch.zeros((dist.get_world_size(group), 3), dtype=torch.int64, device=device)
    table[dist.get_rank(group)] = torch.tensor([vocab_parallel.start, vocab_parallel.stop, rows])
    # A SUM of rows that only their own rank fills: an all-gather that NCCL and gloo (CPU and
    # CUDA tensors alike) all support.
    dist.all_reduce(table, group=group)
    ranges = table.tolist()
    previous: Optional[tuple[int, int]] = None  # the range of the rank before
    for rank, (start, stop, rank_rows) in enumerate(ranges):
        if stop < start:
            raise ValueError(f"vocab_parallel: rank {rank} holds rows [{start}, {stop}) of the "
                             f"classifier: stop must not be less than start")
        if previous is None and start != 0:
            raise ValueError(f"vocab_parallel: rank 0's rows [{start}, {stop}) must start at 0 "
                             f"(the ranks' ranges partition [0, V) in rank order)")
        if previous is not None and start != previous[1]:
            problem = "leave a gap after" if start > previous[1] else "overlap"
            raise ValueError(f"vocab_parallel: rank {rank}'s rows [{start}, {stop}) {problem} "
                             f"rank {rank - 1}'s [{previous[0]}, {previous[1]}) (the ranks' "
                             f"ranges partition [0, V) in rank order)")
        if rank_rows != stop - start:
            raise ValueError(f"vocab_parallel: rank {rank}'s c has {rank_rows} rows (a (rows, D) "
                             f"tensor expected) for its range [{start}, {stop}) of "
                             f"{stop - start} rows")
        previous = (start, stop)
    if ranges[-1][1] == 0:
        raise ValueError("vocab_parallel: the ranks hold no rows of the classifier between them "
                         "(the vocabulary must have at least one entry)")
    return ranges[-1][1]


def vocab_parallel_loss(e: torch.Tensor, c: torch.Tensor, targets: torch.Tensor,
                        bias: Optional[torch.Tensor], options: LossOptions,
                        ) -> "tuple[torch.Tensor, torch.Tensor]":
    """Per-token loss and log-sum-exp of the whole vocabulary, float32 (N,), the same on every
    rank; the canonical signature of :mod:`cce.loss` (``targets``: global ids, -1 = ignored),
    with ``c`` and ``bias`` this rank's shard (``options.vocab_parallel``; options resolved)."""
    vocab_parallel = options.vocab_parallel
    group = vocab_parallel.group
    in_shard = (targets >= vocab_parallel.start) & (targets < vocab_parallel.stop)
    local_targets = torch.where(in_shard, targets - vocab_parallel.start, -1)
    if e.shape[0] == 0:
        return tokenless_loss(e, c, bias)  # on every rank (e is the same): no exchange
    # Where the kernels do not run (CPU tensors without Triton's interpreter; float64, as the
    # kernels are 16/32-bit), impl "cce" takes the materialized shard's path, as one GPU's
    # takes the chunked PyTorch path.
    if options.impl == "torch" or not kernels_take(e):
        return _materialized_loss(e, c, targets, local_targets, bias, options, group)
    check_interpreter_usable()
    if bias is not None:
        bias = bias.contiguous()  # the kernels index it with unit stride
    needs_grad = needs_gradient(e, c, bias)
    loss, lse, entropy, argmax = VocabParallelFunction.apply(
        e, c, bias, targets.contiguous(), local_targets.contiguous(), options, needs_grad)
    return TokenOutputs(loss, lse, entropy if options.return_entropy else None,
                        argmax if options.return_argmax else None)


class VocabParallelFunction(torch.autograd.Function):
    """Per-token loss and LSE of the whole vocabulary from this rank's shard (module docstring).
    ``targets``: global ids; ``local_targets``: rows of the shard, -1 where the target is
    ignored or another shard's."""

    @staticmethod
    def forward(ctx, e: torch.Tensor, c: torch.Tensor, bias: Optional[torch.Tensor],
                targets: torch.Tensor, local_targets: torch.Tensor, options: LossOptions,
                needs_grad: bool):
        from cce.cce_function import uses_filter_correction
        from cce.forward.indexed_dot import indexed_dot
        from cce.forward.lse_forward import leave_out_targets, lse_forward
        from cce.forward.plan import forward_outputs
        from cce.forward.vocab_order import sort_vocabulary

        group, softcap, filter_eps = (options.vocab_parallel.group, options.softcap,
                                      options.filter_eps)
        start = options.vocab_parallel.start
        holds_rows = c.shape[0] > 0  # a rank may hold none: it adds nothing to the sums
        # What the unsharded forward would decide; a rank without rows has nothing to bound.
        plan = forward_outputs(filter_eps=filter_eps, vocab_sorting=options.vocab_sorting,
                               softcap=softcap, label_smoothing=options.label_smoothing,
                               needs_grad=needs_grad and holds_rows)
        # The order and the bounds are over the rows with a loss, wherever their target is:
        # sort_vocabulary and lse_forward only read which targets are ignored (-1).
        order = position_of = row_sum = None
        if plan.sorts:
            order, position_of, row_sum = sort_vocabulary(e, c, bias, targets)
        left_out = leave_out_targets(local_targets, position_of, e.dtype, c.shape[0])
        positions = left_out.positions
        if holds_rows:  # the target logit is 0 off the shard
            target_logit = indexed_dot(e, c, local_targets, bias, softcap, placement=left_out)
        else:
            target_logit = torch.zeros(e.shape[0], dtype=torch.float32, device=e.device)
            positions.fill_(-1)
        dist.all_reduce(target_logit, op=dist.ReduceOp.SUM, group=group)
        # The LSE of the shard's logits off the target (cce.weighting): the sum over the
        # shards is the row's other logits' LSE. A shard of no rows has an LSE of -inf, an
        # entropy of 0 and no argmax.
        local_entropy = (torch.zeros_like(target_logit) if options.return_entropy else None)
        local_argmax = local_max = None
        if options.return_argmax:
            local_argmax = torch.full_like(target_logit, _NO_INDEX, dtype=torch.int64)
            local_max = torch.full_like(target_logit, float("-inf"))
        local_other_lse, tile_bound = (
            lse_forward(e, c, bias, softcap, targets, order,
                        target_logit if plan.records_bounds else None, left_out=left_out,
                        entropy=local_entropy, argmax=local_argmax, argmax_value=local_max)
            if holds_rows else (torch.full_like(target_logit, float("-inf")), None))
        other_lse = _global_lse(local_other_lse, group)
        lse, cross_entropy = lse_and_cross_entropy(other_lse, target_logit, targets)
        loss = torch.where(targets >= 0, cross_entropy, 0.0)
        complement = target_complement(other_lse, lse)
        entropy = entropy_terms = argmax = None
        if options.return_entropy:
            other_entropy = _global_entropy(local_entropy, local_other_lse, other_lse, group)
            entropy, mean, target_term = entropy_and_gradient_terms(
                other_entropy, other_lse, target_logit, lse, cross_entropy, complement, targets)
            entropy_terms = torch.stack([mean, target_term])
        if options.return_argmax:
            argmax = argmax_or_none(
                _global_argmax(local_max, _global_index(local_argmax, start), group), lse)
            ctx.mark_non_differentiable(argmax)
        corrects = uses_filter_correction(options.filter_correction, filter_eps, softcap)
        # The mass that the shard's tiles add up, which the mass correction starts from.
        counted_mass = (torch.exp(local_other_lse - lse) if corrects and needs_grad
                        else None)
        ctx.save_for_backward(e, c, bias, targets, positions, lse, complement, order, tile_bound,
                              counted_mass, row_sum, entropy_terms)
        ctx.group = group
        ctx.softcap = softcap
        ctx.filter_eps = filter_eps
        ctx.corrects = corrects
        return loss, lse, entropy, argmax

    @staticmethod
    def backward(ctx, grad_loss: Optional[torch.Tensor], grad_lse: Optional[torch.Tensor],
                 grad_entropy: Optional[torch.Tensor], _grad_argmax):
        from cce.backward.run import (BackwardRequest, CorrectionInputs,
                                  linear_cross_entropy_backward)
        from cce.backward.gradient_tiles import RecomputeInputs
        from cce.cce_function import recompute_table

        (e, c, bias, targets, positions, lse, complement, order, tile_bound, counted_mass,
         row_sum, entropy_terms) = ctx.saved_tensors
        # The softmax part of the gradient is every row's with a loss or an lse gradient; the
        # target part only the shard's targets' (positions -1 elsewhere).
        target_scale = (torch.where(targets >= 0, grad_loss.float(), 0.0)
                        if grad_loss is not None else torch.zeros_like(lse))
        prob_scale = target_scale + grad_lse.float() if grad_lse is not None else target_scale
        entropy = None
        softmax_rows = prob_scale  # rows with a softmax term: for the live table, only != 0
        if grad_entropy is not None and entropy_terms is not None:
            entropy = EntropyTerm(-grad_entropy.float(), entropy_terms[0])
            softmax_rows = prob_scale.abs() + entropy.scale.abs()
        needs_grad_e = ctx.needs_input_grad[0]
        needs_grad_c = ctx.needs_input_grad[1] or ctx.needs_input_grad[2]
        if c.shape[0] == 0:
            grad_e = (torch.zeros(e.shape, dtype=torch.float32, device=e.device)
                      if needs_grad_e else None)
            grad_c = torch.zeros_like(c) if needs_grad_c else None
            grad_bias = torch.zeros_like(bias) if needs_grad_c and bias is not None else None
        else:
            live = None
            if tile_bound is not None:
                # live_tiles keeps the whole token block of a row with no target position and
                # a softmax gradient, taking it for an ignored row that the bounds leave out.
                # Rows whose target is another shard's are in the bounds: a zero scale says so.
                covered = torch.where((targets >= 0) & (positions < 0), 0.0, softmax_rows)
                live = recompute_table(tile_bound, lse, covered, positions, e.dtype,
                                       ctx.filter_eps)
            entry = target_entry(GradientScales(prob_scale, target_scale, None), complement)
            if entropy is not None:  # read only where the target is the shard's
                entry = entry + entropy.scale * entropy_terms[1]
            recompute = RecomputeInputs(e, c, positions, bias, ctx.softcap, lse, prob_scale,
                                        entry, order, ctx.filter_eps, None, entropy)
            correction = (CorrectionInputs(counted_mass, row_sum) if ctx.corrects
                          else None)
            grad_e, grad_c, grad_bias = linear_cross_entropy_backward(recompute, BackwardRequest(
                live, needs_grad_e, needs_grad_c, correction,
                grad_e_dtype=torch.float32 if needs_grad_e else None))
        if grad_e is not None:
            dist.all_reduce(grad_e, op=dist.ReduceOp.SUM, group=ctx.group)
            grad_e = grad_e.to(e.dtype)
        return differentiable_once([grad_e, grad_c, grad_bias],
                                   (e, c, bias, grad_loss, grad_lse, grad_entropy)) + (None,) * 4


def _materialized_loss(e: torch.Tensor, c: torch.Tensor, targets: torch.Tensor,
                       local_targets: torch.Tensor, bias: Optional[torch.Tensor],
                       options: LossOptions, group: Optional[dist.ProcessGroup]
                       ) -> TokenOutputs:
    """impl="torch": the shard's logits materialized, and autograd for the backward. As in the
    kernels, the shards' LSEs are of the logits off the target (cce.weighting), so that autograd
    differentiates ``1 - p_target`` to its own precision."""
    logits = materialized_logits(_SumGradientOverRanks.apply(e, group), c, bias, options.softcap)
    in_shard = local_targets >= 0
    index = local_targets.clamp(min=0)[:, None]
    if c.shape[0]:
        gathered = logits.gather(1, index)[:, 0]
        at_target = torch.zeros_like(logits, dtype=torch.bool).scatter_(1, index, in_shard[:, None])
        local_other_lse = torch.logsumexp(logits.masked_fill(at_target, float("-inf")), dim=-1)
    else:  # a shard of no rows holds no target
        gathered = local_other_lse = logits.sum(dim=-1) + float("-inf")
    other_lse, target_logit = _CombineShards.apply(local_other_lse,
                                                   torch.where(in_shard, gathered, 0.0), group)
    lse, cross_entropy = lse_and_cross_entropy(other_lse, target_logit, targets)
    entropy = argmax = None
    if options.return_entropy:
        # log(sum_v exp z_v) - sum_v exp(z_v) z_v / sum_v exp(z_v), from sums over the shards
        # shifted by the largest logit (a constant: the sums alone carry the gradient; -inf
        # logits, whose exponential is 0, add 0).
        with torch.no_grad():
            shift = logits.amax(dim=-1) if c.shape[0] else torch.full_like(lse, float("-inf"))
            dist.all_reduce(shift, op=dist.ReduceOp.MAX, group=group)
            shift = torch.where(shift.abs() == float("inf"), 0.0, shift)
        exponentials = torch.exp(logits - shift[:, None])
        finite_low = logits.clamp(min=torch.finfo(logits.dtype).min)
        total, moment = _SumOverRanks.apply(
            torch.stack([exponentials.sum(dim=-1), (exponentials * finite_low).sum(dim=-1)]),
            group)
        entropy = shift + torch.log(total) - moment / total
    if options.return_argmax:
        with torch.no_grad():
            local_max, local_argmax = (logits.max(dim=-1) if c.shape[0] else
                                       (torch.full_like(lse, float("-inf")),
                                        torch.full_like(targets, _NO_INDEX)))
            argmax = argmax_or_none(_global_argmax(
                local_max.float(), _global_index(local_argmax, options.vocab_parallel.start),
                group), lse)
    return TokenOutputs(torch.where(targets >= 0, cross_entropy, 0.0), lse, entropy, argmax)


def _global_index(local_index: torch.Tensor, start: int) -> torch.Tensor:
    """A shard's row indices as vocabulary ids (none stays none)."""
    return torch.where(local_index == _NO_INDEX, _NO_INDEX, local_index + start)


def _global_argmax(local_max: torch.Tensor, index: torch.Tensor,
                   group: Optional[dist.ProcessGroup]) -> torch.Tensor:
    """The whole vocabulary's argmax from every shard's (largest logit, its vocabulary id): the
    largest value, then the smallest id (:func:`cce.weighting.first_largest`; rows with a NaN
    are the caller's)."""
    largest = local_max.clone()
    dist.all_reduce(largest, op=dist.ReduceOp.MAX, group=group)
    argmax = torch.where(local_max == largest, index, _NO_INDEX)
    dist.all_reduce(argmax, op=dist.ReduceOp.MIN, group=group)
    return argmax


def _global_entropy(local_entropy: torch.Tensor, local_lse: torch.Tensor, lse: torch.Tensor,
                    group: Optional[dist.ProcessGroup]) -> torch.Tensor:
    """The entropy of the softmax of the logits the shards' LSEs add up (``lse``: of all of
    them) from each shard's (:func:`cce.weighting.entropy_of_parts`): one SUM of positive
    terms."""
    total = entropy_of_parts(local_entropy[None], local_lse[None], lse)
    dist.all_reduce(total, op=dist.ReduceOp.SUM, group=group)
    return total


class _SumOverRanks(torch.autograd.Function):
    """The sum over the ranks of a tensor from which every rank computes the same loss: each
    rank's part gets that loss's gradient as it is."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, group: Optional[dist.ProcessGroup]) -> torch.Tensor:
        total = tensor.clone()
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=group)
        return total

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


class _SumGradientOverRanks(torch.autograd.Function):
    """The identity, whose gradient is summed over the ranks (in float32): every rank's shard
    of the logits depends on the same input."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, group: Optional[dist.ProcessGroup]) -> torch.Tensor:
        ctx.group = group
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        # A copy: the incoming gradient may be another node's too, never reduce it in place.
        total = grad.to(torch.promote_types(grad.dtype, torch.float32),
                        memory_format=torch.contiguous_format, copy=True)
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=ctx.group)
        return total.to(grad.dtype), None


class _CombineShards(torch.autograd.Function):
    """(log-sum-exp, target logit) of the whole vocabulary from every rank's shard's (of the
    logits off the target, as the caller gives them)."""

    @staticmethod
    def forward(ctx, local_lse: torch.Tensor, local_target_logit: torch.Tensor,
                group: Optional[dist.ProcessGroup]):
        lse = _global_lse(local_lse, group)
        target_logit = local_target_logit.clone()
        dist.all_reduce(target_logit, op=dist.ReduceOp.SUM, group=group)
        ctx.save_for_backward(local_lse, lse)
        return lse, target_logit

    @staticmethod
    def backward(ctx, grad_lse: torch.Tensor, grad_target_logit: torch.Tensor):
        local_lse, lse = ctx.saved_tensors
        # d lse / d local_lse = exp(local_lse - lse), the shard's share of the softmax mass.
        return grad_lse * torch.exp(local_lse - lse), grad_target_logit, None


def _global_lse(local_lse: torch.Tensor, group: Optional[dist.ProcessGroup]) -> torch.Tensor:
    """The log-sum-exp over the ranks of their float32 (N,) ``local_lse``: an all-reduce MAX,
    then a SUM of exponentials shifted by it (by 0 where it is infinite, as the kernels do)."""
    maximum = local_lse.clone()
    dist.all_reduce(maximum, op=dist.ReduceOp.MAX, group=group)
    shift = torch.where(maximum.abs() == float("inf"), 0.0, maximum)
    total = torch.exp(local_lse - shift)
    # NaN propagates through this SUM whatever the MAX made of it.
    dist.all_reduce(total, op=dist.ReduceOp.SUM, group=group)
    return shift + torch.log(total)
