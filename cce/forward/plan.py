"""The forward's plan: what a call's forward computes and how its kernel reads ``c``, decided on
the host once per call (:func:`plan_forward`), then run by
:func:`cce.cce_function.forward_kernels`.

- The tile bounds are recorded only when a filtering backward follows, and the vocabulary is
  sorted only then (sorting serves the backward's skipping alone); the sum of ``c``'s rows, the
  filter correction's mean row, is read with the order (:mod:`cce.forward.vocab_order`).
- The kernel reads a copy of ``c`` in position order, by tensor descriptor, only where the
  backward that follows takes as much memory anyway and the forward is long enough to repay
  the copy (:func:`cce.forward.lse_forward.classifier_by_position`); otherwise, with sorting, it
  gathers the rows through the order. Where the backward reads such a copy too (its Hopper dE
  product with the tiles kept, :mod:`cce.backward.embeddings_product`), the forward makes it
  whatever the size and keeps it for the backward.

Tests force a choice (:class:`ForwardChoices`) and read the plans made through :func:`forced`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import ContextManager, Optional

from cce.choices import Seam
from cce.config import copy_classifier_min_tokens


@dataclass(frozen=True)
class ForwardChoices:
    """Choices a plan takes as given instead of deciding them; None: decided.

    ``copy_min_tokens``: the fewest tokens from which the forward copies ``c`` (where the
    memory allows it). ``copies_classifier``: copy ``c`` (True) or not (False), whatever the
    size and the memory."""

    copy_min_tokens: Optional[int] = None
    copies_classifier: Optional[bool] = None


@dataclass(frozen=True)
class ForwardPlan:
    """``records_bounds``: the LSE kernel records the live grid's tile bounds
    (:func:`cce.forward.lse_forward.lse_forward`); ``sorts``: the vocabulary is ordered first;
    ``sums_curvature``: the kernel sums each row's tanh^2 (only the backward's split of label
    smoothing under a softcap needs it: :meth:`cce.weighting.LossWeighting.rank_one_term`);
    ``copies_classifier``: the kernel reads a sorted copy of ``c`` where descriptors can;
    ``keeps_classifier_copy``: the forward makes that copy and keeps it for the backward;
    ``entropy``, ``argmax``, ``deterministic``: see :func:`cce.forward.lse_forward.lse_forward`."""

    records_bounds: bool
    sorts: bool
    sums_curvature: bool
    copies_classifier: bool
    keeps_classifier_copy: bool = False
    entropy: bool = False
    argmax: bool = False
    deterministic: bool = False


_SEAM: Seam[ForwardChoices] = Seam(ForwardChoices())


def forced(**choices: Optional[object]) -> "ContextManager[list[ForwardPlan]]":
    """Within the block, every forward is planned with ``choices`` (:class:`ForwardChoices`'
    fields; an enclosing block's too) as given, and the plans made are appended to the list
    yielded. The tests' seam."""
    return _SEAM.forced(**choices)


def plan_forward(num_tokens: int, dim: int, *, filter_eps: Optional[float], vocab_sorting: bool,
                 softcap: Optional[float], label_smoothing: float, needs_grad: bool,
                 grad_c_follows: bool, entropy: bool = False, argmax: bool = False,
                 deterministic: bool = False, backward_reads_copy: bool = False) -> ForwardPlan:
    """The plan of a forward over ``num_tokens`` rows of ``dim`` dimensions. ``needs_grad``: a
    backward follows; ``grad_c_follows``: it computes dC; ``backward_reads_copy``: a sorting
    backward would read a copy of ``c`` in position order
    (:func:`cce.backward.embeddings_product.reads_sorted_copy`). The other keywords are the
    loss's options (:class:`cce.options.LossOptions`)."""
    choices = _SEAM.choices
    copies = choices.copies_classifier
    if copies is None:
        min_tokens = (copy_classifier_min_tokens() if choices.copy_min_tokens is None
                      else choices.copy_min_tokens)
        # dC, or without it the dE-only backward's buffer, as large as c from D tokens on
        # (cce.backward.plan), takes as much memory as the copy.
        copies = (needs_grad and (grad_c_follows or num_tokens >= dim)
                  and num_tokens >= min_tokens)
    outputs = forward_outputs(filter_eps=filter_eps, vocab_sorting=vocab_sorting,
                              softcap=softcap, label_smoothing=label_smoothing,
                              needs_grad=needs_grad, entropy=entropy, argmax=argmax,
                              deterministic=deterministic,
                              backward_reads_copy=backward_reads_copy)
    plan = replace(outputs, copies_classifier=copies or outputs.keeps_classifier_copy)
    _SEAM.record(plan)
    return plan


def forward_outputs(*, filter_eps: Optional[float], vocab_sorting: bool,
                    softcap: Optional[float], label_smoothing: float, needs_grad: bool,
                    entropy: bool = False, argmax: bool = False,
                    deterministic: bool = False, backward_reads_copy: bool = False
                    ) -> ForwardPlan:
    """The part of the plan that the options alone decide (what the forward computes: the
    outputs' shapes follow from it), reading no size; ``copies_classifier`` False.
    ``backward_reads_copy``: a sorting backward would read a sorted copy of ``c``."""
    records_bounds = needs_grad and filter_eps is not None
    sorts = records_bounds and vocab_sorting
    return ForwardPlan(records_bounds=records_bounds, sorts=sorts,
                       sums_curvature=bool(label_smoothing) and softcap is not None and needs_grad,
                       copies_classifier=False, keeps_classifier_copy=sorts and backward_reads_copy,
                       entropy=entropy, argmax=argmax, deterministic=deterministic)
