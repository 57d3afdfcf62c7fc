"""Public API: argument checking, target shifting, reduction and dispatch to an implementation.

Every implementation (the CCE kernels and the baselines) computes the same thing from the same
canonical inputs: ``e`` as (N, D), ``c`` as (V, D), ``targets`` as (N,) int64 with -1 at ignored
positions. It returns the per-token loss and log-sum-exp as float32 (N,) tensors. Reduction and
the reshaping back to ``targets``' shape happen here, once, for all of them.
"""

from __future__ import annotations

import math
from typing import Callable, Literal, Optional, Union

import torch
from torch import nn

from cce import baselines
from cce.cce_function import cce_loss
from cce.vocab_parallel import (VocabParallelOptions, check_options, check_shards,
                                reject_dtensors, vocab_parallel_loss)

Implementation = Callable[..., "tuple[torch.Tensor, torch.Tensor]"]

IMPLEMENTATIONS: dict[str, Implementation] = {
    "cce": cce_loss,
    "torch": baselines.torch_loss,
    "torch_compile": baselines.torch_compile_loss,
    "chunked": baselines.chunked_loss,
}
REDUCTIONS = ("mean", "sum", "none")
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def default_filter_eps(dtype: torch.dtype) -> float:
    """The paper's threshold: 2^-12 for bfloat16, i.e. the dtype's machine epsilon / 32."""
    return torch.finfo(dtype).eps / 32


def linear_cross_entropy(
    e: torch.Tensor,
    c: torch.Tensor,
    targets: torch.Tensor,
    *,
    bias: Optional[torch.Tensor] = None,
    ignore_index: int = -100,
    softcap: Optional[float] = None,
    reduction: Literal["mean", "sum", "none"] = "mean",
    shift: int = 0,
    filter_eps: Union[float, Literal["auto"], None] = "auto",
    vocab_sorting: bool = True,
    filter_correction: bool = True,
    return_lse: bool = False,
    impl: str = "cce",
    vocab_parallel: Optional[VocabParallelOptions] = None,
) -> Union[torch.Tensor, "tuple[torch.Tensor, torch.Tensor]"]:
    """Cross-entropy of the logits ``e @ c.T + bias`` against ``targets``, without building them.

    Same result as ``F.cross_entropy(e @ c.T + bias, targets, ignore_index=..., reduction=...)``
    (with ``softcap * tanh(logits / softcap)`` first when ``softcap`` is given), computed in
    float32. The loss is float32 whatever the input dtype.

    Args:
        e: embeddings, shape (..., D), float32/float16/bfloat16.
        c: classifier, shape (V, D), same dtype and device as ``e``.
        targets: integer tensor of shape ``e.shape[:-1]``, values in [0, V) or ``ignore_index``
            (else ``ValueError``; under torch.compile or CUDA graph capture, where the host
            cannot read the check, the loss is NaN instead).
        bias: optional (V,) bias added to every logit row.
        ignore_index: target value that contributes neither loss nor gradient.
        softcap: logit soft-capping value (Gemma 2), or None.
        reduction: "mean" over non-ignored tokens, "sum", or "none" (shape of ``targets``,
            0 at ignored positions).
        shift: position i is scored against ``targets[..., i + shift]``; the last ``shift``
            positions count as ignored (next-token prediction without slicing ``e``).
        filter_eps: gradient filtering threshold: skip backward tiles whose softmax entries are
            all below it. "auto" is 2^-12 for bfloat16 (finfo(dtype).eps / 32 in general);
            None disables filtering (exact gradients).
        vocab_sorting: order backward tiles by average logit so that skipped tiles are common.
        filter_correction: with filtering, add what the filter dropped back to the gradient of
            ``e``, as each row's dropped probability mass times the mean row of ``c`` (not in
            the paper: it removes most of the filter's error on language-model data, whose
            classifier rows share a direction). Not applied with ``softcap``, whose derivative
            the dropped entries' sum does not carry. False: the paper's filter.
        return_lse: also return the log-sum-exp of every row, shape of ``targets``.
        impl: "cce" (Triton kernels), "torch" (materialized logits), "torch_compile" or
            "chunked" (8 compiled chunks, torchtune-style).
        vocab_parallel: with a classifier split over the vocabulary across the ranks of a
            process group, this rank's shard (:class:`cce.VocabParallelOptions`): ``c`` (and
            ``bias``) are rows ``[start, stop)`` of the full classifier, ``e`` and ``targets``
            (global ids) the same on every rank. Every rank gets the loss (and lse) of the
            whole vocabulary and the full gradient of ``e``; ``c`` and ``bias`` get their
            shard's. Collective: every rank of the group must call it. impl "cce" or "torch".

    Returns:
        The loss, or ``(loss, lse)`` when ``return_lse`` is True.
    """
    reject_dtensors(e=e, c=c, targets=targets, bias=bias)
    check_options(vocab_parallel, impl)
    vocab_size = c.shape[0] if vocab_parallel is None else check_shards(vocab_parallel, e, c)
    _check_arguments(e, c, targets, bias, ignore_index, softcap, reduction, shift, filter_eps,
                     vocab_sorting, filter_correction, impl)
    eps = default_filter_eps(e.dtype) if filter_eps == "auto" else filter_eps

    canonical_targets, out_of_range = _canonical_targets(targets, ignore_index, shift,
                                                         vocab_size)
    any_out_of_range = out_of_range.any()
    read_any_out_of_range = _start_host_read(any_out_of_range)
    flat_e = e.reshape(-1, e.shape[-1])
    if vocab_parallel is None:
        token_loss, lse = IMPLEMENTATIONS[impl](
            flat_e, c, canonical_targets.reshape(-1), bias, softcap, eps, vocab_sorting,
            filter_correction
        )
    else:
        token_loss, lse = vocab_parallel_loss(
            flat_e, c, canonical_targets.reshape(-1), bias, softcap, eps, vocab_sorting,
            filter_correction, vocab_parallel, impl
        )
    if read_any_out_of_range is None:
        # No host check possible (torch.compile, CUDA graph capture): poison the loss instead.
        token_loss = torch.where(any_out_of_range, float("nan"), token_loss)
    elif read_any_out_of_range():
        raise ValueError(f"targets must be in [0, {vocab_size}) or equal ignore_index="
                         f"{ignore_index}; found {targets[out_of_range][0].item()}")

    valid = canonical_targets >= 0
    if reduction == "none":
        loss = token_loss.reshape(targets.shape)
    elif reduction == "sum":
        loss = token_loss.sum()
    else:  # mean over non-ignored tokens; NaN when every token is ignored, as in PyTorch
        loss = token_loss.sum() / valid.sum()
    if return_lse:
        return loss, lse.reshape(targets.shape)
    return loss


class LinearCrossEntropy(nn.Module):
    """Module form of :func:`linear_cross_entropy`; keyword arguments are fixed at construction."""

    def __init__(
        self,
        *,
        bias: Optional[torch.Tensor] = None,
        ignore_index: int = -100,
        softcap: Optional[float] = None,
        reduction: Literal["mean", "sum", "none"] = "mean",
        shift: int = 0,
        filter_eps: Union[float, Literal["auto"], None] = "auto",
        vocab_sorting: bool = True,
        filter_correction: bool = True,
        return_lse: bool = False,
        impl: str = "cce",
        vocab_parallel: Optional[VocabParallelOptions] = None,
    ) -> None:
        super().__init__()
        _check_options(ignore_index, softcap, reduction, shift, filter_eps, vocab_sorting,
                       filter_correction, impl)
        check_options(vocab_parallel, impl)
        self.bias = bias
        self.options = dict(ignore_index=ignore_index, softcap=softcap, reduction=reduction,
                            shift=shift, filter_eps=filter_eps, vocab_sorting=vocab_sorting,
                            filter_correction=filter_correction, return_lse=return_lse,
                            impl=impl, vocab_parallel=vocab_parallel)

    def forward(self, e: torch.Tensor, c: torch.Tensor, targets: torch.Tensor):
        return linear_cross_entropy(e, c, targets, bias=self.bias, **self.options)

    def extra_repr(self) -> str:
        return ", ".join(f"{name}={value!r}" for name, value in self.options.items())


def _canonical_targets(targets: torch.Tensor, ignore_index: int, shift: int,
                       vocab_size: int) -> "tuple[torch.Tensor, torch.Tensor]":
    """int64 targets with -1 at ignored positions, already shifted, shape of ``targets``; and
    where ``targets`` is out of range (those count as ignored here, so that no kernel indexes
    outside c before the caller raises)."""
    valid = targets != ignore_index
    out_of_range = valid & ((targets < 0) | (targets >= vocab_size))
    canonical = torch.where(valid & ~out_of_range, targets.long(), -1)
    if shift:
        ignored_tail = torch.full_like(canonical[..., :shift], -1)
        canonical = torch.cat([canonical[..., shift:], ignored_tail], dim=-1)
    return canonical, out_of_range


def _start_host_read(flag: torch.Tensor) -> Optional[Callable[[], bool]]:
    """A function that reads the boolean scalar ``flag`` on the host, or None where the host
    cannot read it (torch.compile, CUDA graph capture). On a GPU the flag is copied to pinned
    memory and read only once the loss's kernels are queued behind it: the host waits for the
    work queued before the flag, as a sync would, but the GPU has the loss to run meanwhile."""
    if torch.compiler.is_compiling():
        return None
    if flag.device.type != "cuda":
        return lambda: bool(flag)
    if torch.cuda.is_current_stream_capturing():
        return None
    host_flag = torch.empty((), dtype=torch.bool, pin_memory=True)
    host_flag.copy_(flag, non_blocking=True)
    copied = torch.cuda.Event()
    copied.record()

    def read() -> bool:
        copied.synchronize()
        return bool(host_flag)

    return read


def _check_arguments(e, c, targets, bias, ignore_index, softcap, reduction, shift, filter_eps,
                     vocab_sorting, filter_correction, impl) -> None:
    for name, tensor in (("e", e), ("c", c), ("targets", targets)):
        if not isinstance(tensor, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    if e.dtype not in FLOAT_DTYPES:
        raise ValueError(f"e must be float32, float16 or bfloat16, got {e.dtype}")
    if e.dim() < 1:
        raise ValueError("e must have shape (..., D)")
    if c.dim() != 2:
        raise ValueError(f"c must have shape (V, D), got {tuple(c.shape)}")
    if c.shape[0] == 0:
        raise ValueError("c must have at least one row (vocabulary entry)")
    if c.shape[1] != e.shape[-1]:
        raise ValueError(f"c has D={c.shape[1]} but e has D={e.shape[-1]}: the last dimensions "
                         "must match")
    if c.dtype != e.dtype:
        raise ValueError(f"c has dtype {c.dtype} but e has dtype {e.dtype}: they must match")
    if c.device != e.device:
        raise ValueError(f"c is on {c.device} but e is on {e.device}: they must match")
    if targets.dtype == torch.bool or targets.dtype.is_floating_point or targets.is_complex():
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
    _check_options(ignore_index, softcap, reduction, shift, filter_eps, vocab_sorting,
                   filter_correction, impl)
    if shift and e.dim() < 2:
        raise ValueError("shift needs e with a sequence dimension, shape (..., T, D)")


def _check_options(ignore_index, softcap, reduction, shift, filter_eps, vocab_sorting,
                   filter_correction, impl) -> None:
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, int):
        raise ValueError(f"ignore_index must be an int, got {ignore_index!r}")
    if softcap is not None and not (_is_number(softcap) and math.isfinite(softcap) and softcap > 0):
        raise ValueError(f"softcap must be None or a positive finite number, got {softcap!r}")
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
    if isinstance(shift, bool) or not isinstance(shift, int) or shift < 0:
        raise ValueError(f"shift must be an int >= 0, got {shift!r}")
    if filter_eps not in ("auto", None) and not (
        _is_number(filter_eps) and math.isfinite(filter_eps) and filter_eps > 0
    ):
        raise ValueError(f"filter_eps must be 'auto', None or a positive float, got {filter_eps!r}")
    if not isinstance(vocab_sorting, bool):
        raise ValueError(f"vocab_sorting must be a bool, got {vocab_sorting!r}")
    if not isinstance(filter_correction, bool):
        raise ValueError(f"filter_correction must be a bool, got {filter_correction!r}")
    if impl not in IMPLEMENTATIONS:
        raise ValueError(f"impl must be one of {tuple(IMPLEMENTATIONS)}, got {impl!r}")


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
