"""The canonical targets (:mod:`cce.targets`) in one kernel: each target read once, shifted
within its sequence, compared with ``ignore_index`` and the vocabulary's range, written as int64
(-1 where ignored or out of range), and one flag raised where any is out of range."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_BLOCK = 1024


@triton.jit
def canonical_targets_kernel(targets_ptr, out_ptr, flag_ptr, num_targets, sequence_length,
                             ignore_index, shift, vocab_size, BLOCK: tl.constexpr):
    index = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    in_bounds = index < num_targets
    # Position j of a sequence scores against its target j + shift; the last shift have none.
    has_source = in_bounds & (index % sequence_length + shift < sequence_length)
    target = tl.load(targets_ptr + index + shift, mask=has_source, other=0).to(tl.int64)
    valid = has_source & (target != ignore_index)
    kept = valid & (target >= 0) & (target < vocab_size)
    tl.store(out_ptr + index, tl.where(kept, target, -1), mask=in_bounds)
    out_of_range = tl.max((valid & ~kept).to(tl.int32), axis=0)
    tl.store(flag_ptr, 1, mask=out_of_range > 0)  # every writer writes 1: no race


def canonical_targets_by_kernel(targets: torch.Tensor, ignore_index: int, shift: int,
                                vocab_size: int) -> "tuple[torch.Tensor, torch.Tensor]":
    """int64 canonical targets of int32 or int64 ``targets`` (:func:`cce.targets.canonical_targets`)
    and an int32 scalar, 1 where some target is out of range and 0 otherwise."""
    canonical = torch.empty(targets.shape, dtype=torch.int64, device=targets.device)
    flag = torch.zeros((), dtype=torch.int32, device=targets.device)
    if targets.numel():
        canonical_targets_kernel[(triton.cdiv(targets.numel(), _BLOCK),)](
            targets.contiguous(), canonical, flag, targets.numel(), targets.shape[-1],
            ignore_index, shift, vocab_size, BLOCK=_BLOCK)
    return canonical, flag
