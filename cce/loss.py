"""Public API: argument checking, target shifting, reduction and dispatch to an implementation.

Every implementation (the CCE kernels and the baselines) computes the same thing from the same
canonical inputs: ``e`` as (N, D), ``c`` as (V, D), ``targets`` as (N,) int64 with -1 at ignored
positions, and the class weights and label smoothing as a :class:`cce.weighting.LossWeighting`
(weights in the compute dtype: float32, float64 for float64 inputs). It returns a
:class:`cce.weighting.TokenOutputs`: F.cross_entropy's per-token loss (``reduction="none"``),
the log-sum-exp and, when the options ask, the entropy, as (N,) tensors of the compute dtype,
and the int64 argmax. Reduction and the reshaping back to ``targets``' shape happen here, once, for
all of them.
"""

from __future__ import annotations

import dataclasses
import operator
from typing import Any, Callable, Literal, Optional, Union

import torch
from torch import nn
from torch._subclasses.fake_tensor import is_fake

from cce.reference import baselines
from cce.reference.chunked_torch import chunked_torch_loss
from cce.config import KERNEL_DTYPES, kernels_take
from cce.host_copy import start_host_copy
from cce.options import IMPLEMENTATION_NAMES, LossOptions
from cce.streams import StartedLoss, beside
from cce.weighting import LossWeighting, TokenOutputs
from cce.vocab_parallel import (VocabParallelOptions, check_shards, local_tensors,
                                vocab_parallel_loss)

Implementation = Callable[..., TokenOutputs]


def kernels_or_chunked_torch(e: torch.Tensor, c: torch.Tensor, targets: torch.Tensor,
                             bias: Optional[torch.Tensor], weighting: LossWeighting,
                             options: LossOptions) -> TokenOutputs:
    """impl="cce": the Triton kernels where they run (:func:`cce.config.kernels_take`) and
    take the dtype (16 and 32 bits), else the same loss with exact gradients in chunked PyTorch
    operations, on the inputs' device (deterministic, recomputing once: the filter and kernel
    options do not apply)."""
    return _start_kernels_or_chunked_torch(e, c, bias, weighting, options).loss_of_targets(
        targets)


def _start_kernels_or_chunked_torch(e: torch.Tensor, c: torch.Tensor,
                                    bias: Optional[torch.Tensor], weighting: LossWeighting,
                                    options: LossOptions) -> StartedLoss:
    """:func:`kernels_or_chunked_torch`'s path for this call, chosen, as a function of the
    targets (the dense path queues its first logits, :func:`cce.dense.loss.start_dense_loss`)."""
    if kernels_take(e):
        # Triton is needed only where kernels run
        from cce.cce_function import cce_loss
        from cce.dense.loss import dense_layout, start_dense_loss

        layout = dense_layout(e, c, weighting, options)
        if layout is not None:
            return start_dense_loss(e, c, bias, weighting, layout)
        return StartedLoss(lambda targets: cce_loss(e, c, targets, bias, weighting, options))
    return StartedLoss(lambda targets: chunked_torch_loss(e, c, targets, bias, weighting,
                                                          options))


def _start(e: torch.Tensor, c: torch.Tensor, bias: Optional[torch.Tensor],
           weighting: LossWeighting, options: LossOptions) -> StartedLoss:
    """The call's implementation as a function of the canonical targets, with the work that
    needs only ``e`` and ``c`` queued (:mod:`cce.streams`)."""
    if options.vocab_parallel is not None:
        return StartedLoss(lambda targets: vocab_parallel_loss(e, c, targets, bias, options))
    if options.impl == "cce":
        return _start_kernels_or_chunked_torch(e, c, bias, weighting, options)
    implementation = IMPLEMENTATIONS[options.impl]
    return StartedLoss(lambda targets: implementation(e, c, targets, bias, weighting, options))


IMPLEMENTATIONS: dict[str, Implementation] = {
    "cce": kernels_or_chunked_torch,
    "cce_torch": chunked_torch_loss,
    "torch": baselines.torch_loss,
    "torch_compile": baselines.torch_compile_loss,
    "chunked": baselines.chunked_loss,
}
assert tuple(IMPLEMENTATIONS) == IMPLEMENTATION_NAMES
# The kernels' dtypes are also those autocast casts (never float64).
FLOAT_DTYPES = KERNEL_DTYPES + (torch.float64,)
TARGET_DTYPES = (torch.int8, torch.int16, torch.int32, torch.int64,
                 torch.uint8, torch.uint16, torch.uint32, torch.uint64)


def linear_cross_entropy(
    e: torch.Tensor,
    c: torch.Tensor,
    targets: torch.Tensor,
    *,
    bias: Optional[torch.Tensor] = None,
    ignore_index: int = -100,
    softcap: Optional[float] = None,
    temperature: float = 1.0,
    reduction: Literal["mean", "sum", "none"] = "mean",
    shift: int = 0,
    filter_eps: Union[float, Literal["auto"], None] = "auto",
    vocab_sorting: bool = True,
    filter_correction: bool = True,
    return_lse: bool = False,
    return_entropy: bool = False,
    return_argmax: bool = False,
    impl: str = "cce",
    weight: Optional[torch.Tensor] = None,
    label_smoothing: float = 0.0,
    z_loss: float = 0.0,
    deterministic: Optional[bool] = None,
    keep_tiles: bool = False,
    memory: Literal["low", "fast"] = "low",
    vocab_parallel: Optional[VocabParallelOptions] = None,
) -> Union[torch.Tensor, "tuple[torch.Tensor, ...]"]:
    """Cross-entropy of the logits ``e @ c.T + bias`` against ``targets``, without building them.

    Same result as ``F.cross_entropy(e @ c.T + bias, targets, weight=..., ignore_index=...,
    reduction=..., label_smoothing=...)`` (with ``softcap * tanh(logits / softcap)`` first when
    ``softcap`` is given, then divided by ``temperature``), computed in float32: the loss and
    lse are float32 for 16- and 32-bit inputs. float64 inputs are computed in float64, and give
    a float64 loss and lse, as in F.cross_entropy.

    Args:
        e: embeddings, shape (..., D), float32/float16/bfloat16, or float64 (which impl "cce"
            computes on the chunked PyTorch path: the kernels are 16/32-bit). D = 0 gives the
            logits ``bias``, or 0, as ``e @ c.T`` does.
        c: classifier, shape (V, D), same dtype and device as ``e``: a tensor (for an
            ``nn.Linear``, its ``.weight``). Under torch.autocast on their device, e, c and bias
            are first cast to the autocast dtype, as F.linear would cast them (float64 stays
            float64); each still gets its gradient in its own dtype.
        targets: integer tensor (any signed or unsigned integer dtype) of shape
            ``e.shape[:-1]``, values in [0, V) or ``ignore_index``
            (else ``ValueError``; under torch.compile or CUDA graph capture, where the host
            cannot read the check, the loss is NaN instead).
        bias: optional (V,) bias added to every logit row.
        ignore_index: target value that contributes neither loss nor gradient (an int or a
            numpy integer).
        softcap: logit soft-capping value (Gemma 2), or None.
        temperature: a positive number that divides the (capped) logits: a sampling
            temperature (RL), or a logit scale (Cohere's ``logit_scale`` is ``1 / temperature``,
            Granite's ``logits_scaling`` is ``temperature``). The kernels compute it as the
            logits of ``e / temperature`` (and ``bias / temperature``, capped at
            ``softcap / temperature``), which are the same: for 16-bit ``e`` the quotient is
            rounded to e's dtype, as a model that scales its hidden states or logits in 16 bits
            rounds them.
        reduction: "mean" over non-ignored tokens (with ``weight``: the sum divided by the
            summed weights of their targets), "sum", or "none" (shape of ``targets``, 0 at
            ignored positions).
        shift: position i is scored against ``targets[..., i + shift]``; the last ``shift``
            positions count as ignored (next-token prediction without slicing ``e``), and the
            first ``shift`` targets are not used (nor range-checked).
        filter_eps: gradient filtering threshold in (0, 1): skip backward tiles whose softmax
            entries are all below it. "auto" is 2^-12 for bfloat16 (finfo(dtype).eps / 32 in
            general); None disables filtering (exact gradients). Only the kernels' tiles
            filter: the chunked PyTorch path, the dense path of ``memory="fast"`` and the
            baselines compute exact gradients and ignore it.
        vocab_sorting: order backward tiles by average logit so that skipped tiles are common.
        filter_correction: with filtering, add what the filter dropped back to the gradient of
            ``e``, as each row's dropped probability mass times the mean row of ``c`` (not in
            the paper: it removes most of the filter's error on language-model data, whose
            classifier rows share a direction). Not applied with ``softcap``, whose derivative
            the dropped entries' sum does not carry. False: the paper's filter.
        return_lse: also return the log-sum-exp of every row, shape of ``targets`` (of the
            logits alone, after ``temperature``: ``weight`` and ``label_smoothing`` do not enter
            it).
        return_entropy: also return the entropy of every row's softmax, ``sum_v p_v (L - z_v)``
            (after ``softcap`` and ``temperature``), shape of ``targets``, in the loss's dtype,
            differentiable (an entropy bonus trains through it; with the kernels' filter its
            gradient has the loss gradient's accuracy, README). Every row has one, ignored or
            not.
        return_argmax: also return the index of every row's largest logit, int64, shape of
            ``targets`` (the first of equal ones, as ``torch.argmax``; a NaN logit counts as
            the largest), e.g. for token accuracy.
        impl: "cce" (Triton kernels on CUDA tensors; on CPU tensors too when
            ``TRITON_INTERPRET=1`` runs them in Triton's interpreter, else "cce_torch"),
            "cce_torch" (chunked PyTorch operations on any device, exact gradients: the filter
            options do not apply), "torch" (materialized logits), "torch_compile" or "chunked"
            (8 compiled chunks, torchtune-style).
        weight: class weights, shape (V,), as in F.cross_entropy: each token's loss is scaled
            by its target's weight, and with label smoothing the uniform part is weighted too.
            Any floating-point dtype, whatever the dtype of ``e`` (the loss uses it in the
            compute dtype, float32 or float64); on the device of ``e``; not differentiable
            (must not require grad).
        label_smoothing: in [0, 1], as in F.cross_entropy: the target distribution is
            ``(1 - label_smoothing) * onehot + label_smoothing / V``. Its gradient reaches every
            classifier row, but in closed form: the filter still skips the tiles it would skip
            without it. With ``softcap`` that holds up to the cap's curvature, of which the
            skipped tiles drop only the deviation from each row's mean:
            ``label_smoothing * weight[v] / V * (tanh^2 - mean_i)`` per unit of the token's
            upstream gradient (``tanh^2`` of the capped logit, ``mean_i`` its weighted mean over
            the row). ``filter_eps=None`` keeps it.
        z_loss: adds ``z_loss * lse**2`` to each token's loss (PaLM's auxiliary loss, which keeps
            the log-normalizer near 0), weighted by its target's class weight and reduced as the
            cross-entropy; 0 at ignored tokens. Its gradient reaches every logit through the lse.
        deterministic: True makes the loss, lse and gradients bitwise identical across calls
            on one device (the forward merges its partial log-sum-exps in a fixed order instead
            of under a spin lock); None (default) follows
            ``torch.are_deterministic_algorithms_enabled()``. The backward is deterministic
            either way. Kernels only: the other implementations ignore it.
        keep_tiles: recompute each live tile of the backward once and keep it for both
            gradient products, in memory of its own (about 32 KB per live 128 x 128 tile in
            16-bit, e.g. +0.9-1.2 GB at N = 8192 on a 128k-256k vocabulary), for a faster
            backward; on Hopper GPUs with 16-bit inputs and no label smoothing, also a copy of
            ``c`` in the sorted order, kept from the forward to the backward (as large as dC),
            whose rows the kernels read as whole blocks. False (default) keeps the peak at dE
            + dC + a few MB, recomputing each live tile twice. Kernels only.
        memory: "low" (default): the peak above the inputs and gradients is a few MB. "fast":
            spend memory for speed. Up to a vocabulary of 65,536 (where most backward tiles
            are live), without softcap, label smoothing, entropy or argmax, the dense path:
            float32 logits a 256 MB chunk at a time, and the gradient of the logits kept
            from the forward to the backward (N x V in e's dtype, as much as the logits),
            three GEMMs in all, exact gradients. On larger vocabularies at N <= D / 2 (16-bit
            ``e`` and ``c`` of one dtype, ``c`` trained), the same with that gradient kept in
            the memory dC will take (dC's buffer from the forward on; the backward writes dC
            over it, so a second backward through the graph raises). Otherwise
            ``keep_tiles``. On the chunked PyTorch path (CPU tensors, ``impl="cce_torch"``),
            without softcap or entropy: the softmax kept from the forward (N x V float32),
            not recomputed; the same results.
        vocab_parallel: with a classifier split over the vocabulary across the ranks of a
            process group, this rank's shard (:class:`cce.VocabParallelOptions`): ``c`` (and
            ``bias``) are rows ``[start, stop)`` of the full classifier, ``e`` and ``targets``
            (global ids) the same on every rank. Every rank gets the loss (and lse) of the
            whole vocabulary and the full gradient of ``e``; ``c`` and ``bias`` get their
            shard's. Collective: every rank of the group must call it. impl "cce" or "torch"
            (float64, or CPU tensors without the interpreter: "torch" for both); not with
            ``weight``, ``label_smoothing``, ``keep_tiles`` or ``deterministic``. A ``c`` that is
            a DTensor sharded by rows (``Shard(0)``) on a 1-D mesh, with ``e`` a DTensor of the
            same mesh (tensor parallelism), is this call with the shard its placement gives:
            no options needed; ``c.grad`` is then a DTensor placed as ``c``.

    Returns:
        The loss alone, or a tuple of the loss and, in this order, the lse, the entropy and the
        argmax for the ``return_*`` flags set.
    """
    options = LossOptions(
        ignore_index=ignore_index, softcap=softcap, reduction=reduction, shift=shift,
        filter_eps=filter_eps, vocab_sorting=vocab_sorting, filter_correction=filter_correction,
        return_lse=return_lse, return_entropy=return_entropy, return_argmax=return_argmax,
        impl=impl, label_smoothing=label_smoothing,
        deterministic=deterministic, keep_tiles=keep_tiles, memory=memory,
        vocab_parallel=vocab_parallel,
        temperature=temperature, z_loss=z_loss)
    return _loss(e, c, targets, bias, weight, options)


def _loss(e: torch.Tensor, c: torch.Tensor, targets: torch.Tensor,
          bias: Optional[torch.Tensor], weight: Optional[torch.Tensor], options: LossOptions):
    """:func:`linear_cross_entropy` with its options validated."""
    e, c, targets, bias, vocab_parallel = local_tensors(e, c, targets, bias,
                                                        options.vocab_parallel)
    if vocab_parallel is not options.vocab_parallel:  # a DTensor classifier's shard
        options = dataclasses.replace(options, vocab_parallel=vocab_parallel)
    if options.vocab_parallel is not None:
        _check_vocab_parallel_call(weight, options)
        vocab_size = check_shards(options.vocab_parallel, e, c)  # first: every rank raises alike
    e, c, bias = _cast_as_linear_would(e, c, bias)
    _check_arguments(e, c, targets, bias, weight, options.shift)
    if options.vocab_parallel is None:
        vocab_size = c.shape[0]
        if vocab_size == 0:  # a shard may hold no rows, but the vocabulary holds some
            raise ValueError("c must have at least one row (vocabulary entry)")
    options = options.resolved(e.dtype)
    e, bias, options = _tempered(e, bias, options)
    compute_dtype = torch.promote_types(e.dtype, torch.float32)
    weighting = LossWeighting(None if weight is None else weight.to(compute_dtype).contiguous(),
                              options.label_smoothing)

    ignore_index = operator.index(options.ignore_index)
    flat_e = e.reshape(targets.numel(), e.shape[-1])  # not -1: D may be 0
    started = _start(flat_e, c, bias, weighting, options)
    with beside(started.queued_before, e.device) as hand_over:
        canonical_targets, out_of_range = _canonical_targets(targets, ignore_index,
                                                             options.shift, vocab_size)
        any_out_of_range = out_of_range.any()
        read_any_out_of_range = _start_host_read(any_out_of_range)
        hand_over(canonical_targets, out_of_range, any_out_of_range)
    flat_targets = canonical_targets.reshape(-1)
    outputs = started.loss_of_targets(flat_targets)
    token_loss, lse = outputs.loss, outputs.lse
    if options.z_loss:
        valid = flat_targets >= 0
        token_weight = weighting.target_weight(flat_targets).to(lse.dtype)
        z_term = options.z_loss * token_weight * lse.square()
        # where, not the weight's 0 alone: an ignored row's lse may be inf (0 * inf is NaN).
        token_loss = token_loss + torch.where(valid, z_term, 0.0)
    if read_any_out_of_range is None:
        # No host check possible (torch.compile, CUDA graph capture): poison the loss instead.
        token_loss = torch.where(any_out_of_range, float("nan"), token_loss)
    elif read_any_out_of_range():
        raise ValueError(f"targets must be in [0, {vocab_size}) or equal ignore_index="
                         f"{ignore_index}; found {_first_out_of_range(targets, out_of_range)}")

    if options.reduction == "none":
        loss = token_loss.reshape(targets.shape)
    elif options.reduction == "sum":
        loss = token_loss.sum()
    else:  # over the targets' summed weights; NaN when every token is ignored, as in PyTorch
        loss = token_loss.sum() / weighting.target_weight_sum(canonical_targets)
    extras = [output.reshape(targets.shape) for output, wanted in (
        (lse, options.return_lse), (outputs.entropy, options.return_entropy),
        (outputs.argmax, options.return_argmax)) if wanted]
    return (loss, *extras) if extras else loss


class LinearCrossEntropy(nn.Module):
    """Module form of :func:`linear_cross_entropy`: ``bias``, ``weight`` and the keyword
    options (:class:`cce.options.LossOptions`, validated here) are fixed at construction."""

    def __init__(self, *, bias: Optional[torch.Tensor] = None,
                 weight: Optional[torch.Tensor] = None, **options: Any) -> None:
        super().__init__()
        self.options = LossOptions(**options)
        _check_weight(weight)
        self.bias = bias
        # A buffer, as in nn.CrossEntropyLoss: it follows the module's .to() and state_dict.
        self.register_buffer("weight", weight)

    def forward(self, e: torch.Tensor, c: torch.Tensor, targets: torch.Tensor):
        return _loss(e, c, targets, self.bias, self.weight, self.options)

    def extra_repr(self) -> str:
        return ", ".join(f"{field.name}={getattr(self.options, field.name)!r}"
                         for field in dataclasses.fields(self.options))


def _tempered(e: torch.Tensor, bias: Optional[torch.Tensor], options: LossOptions,
              ) -> "tuple[torch.Tensor, Optional[torch.Tensor], LossOptions]":
    """The logits ``softcap(e @ c.T + bias) / T`` are those of ``e / T`` and ``bias / T``
    capped at ``softcap / T``: every implementation computes them so, and autograd carries the
    scale to the gradients of ``e`` and ``bias`` (one pass over e and dE, not over logits)."""
    temperature = options.temperature
    if temperature == 1.0:
        return e, bias, options
    softcap = None if options.softcap is None else options.softcap / temperature
    return (e / temperature, None if bias is None else bias / temperature,
            dataclasses.replace(options, softcap=softcap, temperature=1.0))


def _first_out_of_range(targets: torch.Tensor, out_of_range: torch.Tensor) -> int:
    """For the error message: on the CPU, where every integer dtype can be indexed."""
    return targets.cpu()[out_of_range.cpu()][0].item()


def _check_vocab_parallel_call(weight: Optional[torch.Tensor], options: LossOptions) -> None:
    """What vocab_parallel does not support, known only at the call."""
    if weight is not None:
        raise ValueError("vocab_parallel does not support weight or label_smoothing")
    if options.resolved_deterministic():
        # As torch does for an operation without a deterministic implementation.
        raise RuntimeError("vocab_parallel has no deterministic implementation (the shards' "
                           "log-sum-exps are merged under a spin lock): pass deterministic=False "
                           "or turn torch.use_deterministic_algorithms off")


def _canonical_targets(targets: torch.Tensor, ignore_index: int, shift: int,
                       vocab_size: int) -> "tuple[torch.Tensor, torch.Tensor]":
    """int64 targets with -1 at ignored positions, already shifted, shape of ``targets``; and
    where ``targets`` is out of range (those count as ignored here, so that no kernel indexes
    outside c before the caller raises). The first ``shift`` targets, which no position is
    scored against, are not checked."""
    # In int64 whatever the dtype: comparisons in the targets' own dtype would wrap
    # ignore_index around (-100 is 156 in uint8), and torch has none for uint16/32/64.
    as_int64 = targets.long()
    valid = as_int64 != ignore_index
    if targets.dtype == torch.uint64:
        # From 2^63 up, wrapped around to negative: out of range, never ignore_index.
        valid = valid | (as_int64 < 0)
    if shift:
        valid = valid & (torch.arange(targets.shape[-1], device=targets.device) >= shift)
    # Few operations: before the loss's kernels are queued, the host's time is the GPU's wait.
    kept = valid & (as_int64.clamp(0, vocab_size - 1) == as_int64)
    out_of_range = valid ^ kept
    canonical = torch.where(kept, as_int64, -1)
    if shift:
        ignored_tail = torch.full_like(canonical[..., :shift], -1)
        canonical = torch.cat([canonical[..., shift:], ignored_tail], dim=-1)
    return canonical, out_of_range


def _start_host_read(flag: torch.Tensor) -> Optional[Callable[[], bool]]:
    """A function that reads the boolean scalar ``flag`` on the host, or None where the host
    cannot read it (torch.compile, CUDA graph capture). On a GPU the flag is copied to pinned
    memory and read only once the loss's kernels are queued behind it: the host waits for the
    work queued before the flag, as a sync would, but the GPU has the loss to run meanwhile."""
    if torch.compiler.is_compiling() or _holds_no_data(flag):
        return None
    if flag.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return None
    read = start_host_copy(flag)
    return lambda: bool(read())


_AUTOCAST_DEVICE_TYPES = ("cuda", "cpu", "xpu", "mps", "hpu", "xla", "mtia")


def _cast_as_linear_would(e, c, bias):
    """Under torch.autocast on e's device, e, c and bias in the autocast dtype, as F.linear
    would multiply them (autocast casts a matmul's float16/bfloat16/float32 inputs on its
    device, never float64 ones); else unchanged. The casts are differentiable: each leaf gets
    its gradient in its own dtype."""
    if not isinstance(e, torch.Tensor):
        return e, c, bias  # the argument checks say why
    device_type = e.device.type
    # Autocast exists for these device types only (torch.amp.is_autocast_available, which
    # torch.compile cannot trace in torch 2.11).
    if device_type not in _AUTOCAST_DEVICE_TYPES or not torch.is_autocast_enabled(device_type):
        return e, c, bias
    dtype = torch.get_autocast_dtype(device_type)

    def cast(tensor):
        eligible = (isinstance(tensor, torch.Tensor) and tensor.dtype in KERNEL_DTYPES
                    and tensor.device.type == device_type)
        return tensor.to(dtype) if eligible else tensor

    return cast(e), cast(c), cast(bias)


def _holds_no_data(tensor: torch.Tensor) -> bool:
    """Whether ``tensor``'s value cannot be read here: a meta or fake tensor (shape
    propagation), or a tensor batched by torch.func.vmap, whose values differ per sample."""
    return (tensor.device.type == "meta" or is_fake(tensor)
            or torch._C._functorch.is_functorch_wrapped_tensor(tensor))


def _check_arguments(e, c, targets, bias, weight, shift: int) -> None:
    """The tensors, against each other (the options are checked by LossOptions)."""
    if isinstance(c, nn.Module):
        raise ValueError(f"c must be a tensor, got the module {type(c).__name__}: pass its "
                         "weight, c=module.weight (and bias=module.bias if it has one)")
    for name, tensor in (("e", e), ("c", c), ("targets", targets)):
        if not isinstance(tensor, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    if e.dtype not in FLOAT_DTYPES:
        raise ValueError(f"e must be float32, float16, bfloat16 or float64, got {e.dtype}")
    if e.dim() < 1:
        raise ValueError("e must have shape (..., D)")
    if c.dim() != 2:
        raise ValueError(f"c must have shape (V, D), got {tuple(c.shape)}")
    if c.shape[1] != e.shape[-1]:
        raise ValueError(f"c has D={c.shape[1]} but e has D={e.shape[-1]}: the last dimensions "
                         "must match")
    if c.dtype != e.dtype:
        raise ValueError(f"c has dtype {c.dtype} but e has dtype {e.dtype}: they must match")
    if c.device != e.device:
        raise ValueError(f"c is on {c.device} but e is on {e.device}: they must match")
    if targets.dtype not in TARGET_DTYPES:
        raise ValueError(f"targets must be an integer tensor, got {targets.dtype}")
    if targets.shape != e.shape[:-1]:
        raise ValueError(f"targets has shape {tuple(targets.shape)} but must have e.shape[:-1] = "
                         f"{tuple(e.shape[:-1])}")
    if targets.device != e.device:
        raise ValueError(f"targets is on {targets.device} but e is on {e.device}: they must match")
    if bias is not None:
        if not isinstance(bias, torch.Tensor) or bias.shape != (c.shape[0],):
            raise ValueError(f"bias must be a tensor of shape ({c.shape[0]},)")
        if bias.dtype != e.dtype or bias.device != e.device:
            raise ValueError("bias must have the dtype and device of e")
    _check_weight(weight, c.shape[0], e.device)
    if shift and e.dim() < 2:
        raise ValueError("shift needs e with a sequence dimension, shape (..., T, D)")


def _check_weight(weight, vocab_size: Optional[int] = None,
                  device: Optional[torch.device] = None) -> None:
    """The class weights, against the vocabulary size and device when they are known."""
    if weight is None:
        return
    if not isinstance(weight, torch.Tensor):
        raise ValueError(f"weight must be None or a tensor, got {type(weight).__name__}")
    if weight.dim() != 1 or (vocab_size is not None and weight.shape[0] != vocab_size):
        expected = "V" if vocab_size is None else vocab_size
        raise ValueError(f"weight must have shape ({expected},) (one weight per class), got "
                         f"{tuple(weight.shape)}")
    if not weight.dtype.is_floating_point:
        raise ValueError(f"weight must have a floating-point dtype, got {weight.dtype}")
    if device is not None and weight.device != device:
        raise ValueError(f"weight is on {weight.device} but e is on {device}: they must match")
    if weight.requires_grad:
        raise ValueError("weight must not require grad: the loss is not differentiable with "
                         "respect to the class weights (nor is F.cross_entropy)")
