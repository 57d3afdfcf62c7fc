"""Autograd plumbing shared by the paths: whether a backward follows, outputs of no tokens,
gradients that are differentiable once and say so, functions that autocast must not touch, and
the vmap rule of the custom ops and of the chunked PyTorch path's functions.

A custom autograd function whose backward records no graph returns gradients without a
``grad_fn`` under ``create_graph=True``; a term built on them (a gradient penalty) would then
silently lose its part through the loss. These gradients get a ``grad_fn`` that raises instead.
"""

from __future__ import annotations

import functools
from typing import Callable, Optional, Sequence, TypeVar

import torch

from cce.weighting import TokenOutputs

Function = TypeVar("Function", bound=Callable)


def needs_gradient(*tensors: Optional[torch.Tensor]) -> bool:
    """Whether a backward will follow: grad mode on and some input requiring grad."""
    return torch.is_grad_enabled() and any(
        tensor is not None and tensor.requires_grad for tensor in tensors)


def without_autocast(function: Function) -> Function:
    """``function`` run with autocast off on its first tensor argument's device: the paths that
    multiply in PyTorch (float32 copies, float32 outputs) ask for their dtypes, which a caller's
    autocast would round back to 16 bits; the loss casts e, c and bias once, as F.linear would
    (:func:`cce.loss._cast_as_linear_would`)."""

    @functools.wraps(function)
    def wrapped(*args, **kwargs):
        first = next((arg for arg in args if isinstance(arg, torch.Tensor)), None)
        if first is None or first.device.type not in ("cpu", "cuda"):
            return function(*args, **kwargs)  # no autocast there (meta tensors: shapes only)
        with torch.autocast(first.device.type, enabled=False):
            return function(*args, **kwargs)

    return wrapped


def tokenless_loss(e: torch.Tensor, c: torch.Tensor,
                   bias: Optional[torch.Tensor]) -> TokenOutputs:
    """The per-token outputs of no tokens: zero-size tensors that still connect every input to
    the graph."""
    connected = e.sum() + c.sum() + (bias.sum() if bias is not None else 0)
    empty = e.new_zeros(0, dtype=torch.promote_types(e.dtype, torch.float32)) + connected * 0
    return TokenOutputs(empty, empty.clone(), empty.clone(),
                        torch.empty(0, dtype=torch.int64, device=e.device))


def differentiable_once(gradients: "Sequence[Optional[torch.Tensor]]",
                        depends_on: "tuple[Optional[torch.Tensor], ...]"
                        ) -> "tuple[Optional[torch.Tensor], ...]":
    """``gradients`` (None where not needed, kept None), which under create_graph=True (grad
    mode on, some of ``depends_on`` requiring grad) get a grad_fn that raises when
    differentiated. (torch's ``once_differentiable`` looks only at the upstream gradients, not
    at e and c.)"""
    present = [grad for grad in gradients if grad is not None]
    tracked = [tensor for tensor in depends_on if tensor is not None and tensor.requires_grad]
    if not (present and tracked and torch.is_grad_enabled()):
        return tuple(gradients)
    guarded = iter(_RaiseWhenDifferentiated.apply(len(present), *present, *tracked))
    return tuple(None if grad is None else next(guarded) for grad in gradients)


class _RaiseWhenDifferentiated(torch.autograd.Function):
    """The identity on its first ``count`` tensors, whose backward raises; the other inputs
    (e, c, ...) connect it to the graph, so that differentiating them through it raises too."""

    generate_vmap_rule = True

    @staticmethod
    def forward(count: int, *tensors: torch.Tensor) -> "tuple[torch.Tensor, ...]":
        return tuple(tensor.view_as(tensor) for tensor in tensors[:count])

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        pass

    @staticmethod
    def backward(ctx, *grads):
        raise RuntimeError(
            "cce.linear_cross_entropy is differentiable once: its gradients have no gradient "
            "of their own, so double backward (create_graph=True, e.g. a gradient penalty) is "
            "not supported")


def stacked_samples(function: Callable, batch_size: int, in_dims: "Sequence[Optional[int]]",
                    args: Sequence, kwargs: Optional[dict] = None):
    """``function`` on each sample in turn (each argument with a vmap dimension, per
    ``in_dims``, selected at the sample), its outputs stacked along a new first dimension and
    None outputs kept None: ``(outputs, out_dims)``, as a vmap rule returns them. The kernels
    and the chunked PyTorch path take one batch of tokens, so this is what PyTorch's fallback
    does, without its warning."""
    # A non-tensor argument's dimension is None, or a tuple of Nones for a tuple.
    samples = [function(*(arg.select(dim, index) if isinstance(dim, int) else arg
                          for arg, dim in zip(args, in_dims)), **(kwargs or {}))
               for index in range(batch_size)]
    outputs = tuple(None if parts[0] is None else torch.stack(parts) for parts in zip(*samples))
    return outputs, tuple(None if output is None else 0 for output in outputs)


def vmap_sample_by_sample(op: torch._library.custom_ops.CustomOpDef) -> None:
    """Give the custom op ``op`` (which returns a tuple of tensors) a vmap rule: the op on each
    sample in turn (:func:`stacked_samples`)."""
    op.register_vmap(lambda info, in_dims, *args, **kwargs: stacked_samples(
        op, info.batch_size, in_dims, args, kwargs))
