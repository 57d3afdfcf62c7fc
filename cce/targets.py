"""The targets as every implementation takes them: int64, shifted, -1 where ignored.

:func:`canonical_targets` also flags targets out of ``[0, V)`` that are not ``ignore_index``
(they count as ignored, so that no kernel indexes outside ``c`` before the caller raises). The
first ``shift`` targets of each sequence, which no position is scored against, are not checked.

Where cce's kernels run, int32 and int64 targets take one kernel (:mod:`cce.target_kernel`):
PyTorch takes seven operations and a reduction, about 0.3 ms of host time at the start of every
call (H200 machine), while the GPU has nothing queued. Other dtypes, torch.compile, torch.func
transforms and CPU tensors outside Triton's interpreter take those operations
(:func:`_canonical_targets_by_torch`).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from cce.config import holds_no_data, interpreter_usable, kernels_run_on

_KERNEL_DTYPES = (torch.int64, torch.int32)


class CanonicalTargets(NamedTuple):
    targets: torch.Tensor  # int64, the shape of the targets given
    any_out_of_range: torch.Tensor  # a scalar, nonzero where some target is out of range


def canonical_targets(targets: torch.Tensor, ignore_index: int, shift: int,
                      vocab_size: int) -> CanonicalTargets:
    """``targets`` (any integer dtype, sequences along the last dimension) as int64 with -1 at
    ignored positions, shifted left by ``shift`` within each sequence, and whether any is out
    of range (module docstring)."""
    if (torch.compiler.is_compiling() or torch._C._are_functorch_transforms_active()
            or targets.dtype not in _KERNEL_DTYPES or targets.dim() == 0
            or holds_no_data(targets) or not kernels_run_on(targets.device)
            or not interpreter_usable() or not -2**63 <= ignore_index < 2**63):
        canonical, out_of_range = _canonical_targets_by_torch(targets, ignore_index, shift,
                                                              vocab_size)
        return CanonicalTargets(canonical, out_of_range.any())
    from cce.target_kernel import canonical_targets_by_kernel  # Triton: not on the CPU path
    return CanonicalTargets(*canonical_targets_by_kernel(targets, ignore_index, shift,
                                                         vocab_size))


def first_out_of_range(targets: torch.Tensor, ignore_index: int, shift: int,
                       vocab_size: int) -> int:
    """For the error message: the first target out of range, found on the CPU, where every
    integer dtype can be indexed."""
    _, out_of_range = _canonical_targets_by_torch(targets, ignore_index, shift, vocab_size)
    return targets.cpu()[out_of_range.cpu()][0].item()


def _canonical_targets_by_torch(targets: torch.Tensor, ignore_index: int, shift: int,
                                vocab_size: int) -> "tuple[torch.Tensor, torch.Tensor]":
    """:func:`canonical_targets` by PyTorch, with the mask of the targets out of range."""
    # In int64 whatever the dtype: comparisons in the targets' own dtype would wrap
    # ignore_index around (-100 is 156 in uint8), and torch has none for uint16/32/64.
    as_int64 = targets.long()
    valid = as_int64 != ignore_index
    if targets.dtype == torch.uint64:
        # From 2^63 up, wrapped around to negative: out of range, never ignore_index.
        valid = valid | (as_int64 < 0)
    if shift:
        valid = valid & (torch.arange(targets.shape[-1], device=targets.device) >= shift)
    kept = valid & (as_int64.clamp(0, vocab_size - 1) == as_int64)
    out_of_range = valid ^ kept
    canonical = torch.where(kept, as_int64, -1)
    if shift:
        ignored_tail = torch.full_like(canonical[..., :shift], -1)
        canonical = torch.cat([canonical[..., shift:], ignored_tail], dim=-1)
    return canonical, out_of_range
