"""Second-order derivatives: cce's gradients are differentiable once, and say so.

A custom autograd function whose backward records no graph returns gradients without a
``grad_fn`` under ``create_graph=True``; a term built on them (a gradient penalty) would then
silently lose its part through the loss. These gradients get a ``grad_fn`` that raises instead.
"""

from __future__ import annotations

from typing import Optional

import torch


def differentiable_once(gradients: "list[torch.Tensor]",
                        depends_on: "tuple[Optional[torch.Tensor], ...]") -> "list[torch.Tensor]":
    """``gradients``, which under create_graph=True (grad mode on, some of ``depends_on``
    requiring grad) get a grad_fn that raises when differentiated. (torch's
    ``once_differentiable`` looks only at the upstream gradients, not at e and c.)"""
    tracked = [tensor for tensor in depends_on if tensor is not None and tensor.requires_grad]
    if not (gradients and tracked and torch.is_grad_enabled()):
        return gradients
    return list(_RaiseWhenDifferentiated.apply(len(gradients), *gradients, *tracked))


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
