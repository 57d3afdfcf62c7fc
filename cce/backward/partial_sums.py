"""The split dE product's last step: its float32 partial sums added up and written in the output's
dtype, in one launch.

When a chunk of the dE product has too few output blocks to fill the GPU, each block's list is
split among several programs that write float32 partial sums
(:mod:`cce.backward.sparse_tile_matmul`). At D = 640 a chunk takes about 17 splits: summing them
with torch took one launch per split plus a copy, and those ~18 launches per chunk cost more host
time than the GPU spent on them, so the GPU waited. The splits are added in order, from the
first, in float32, as torch did.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from cce.config import cdiv, interpreting
from cce.logit_tile import round_to

_BLOCK = 1024
_INTERPRETER_BLOCK = 4096  # the interpreter wants few, large programs


@triton.jit
def partial_sums_kernel(partial_ptr, out_ptr, splits, elements, stride_split,
                        BLOCK: tl.constexpr, DOT_PRECISION: tl.constexpr):
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < elements
    total = tl.zeros((BLOCK,), dtype=tl.float32)
    for split in range(splits):
        total += tl.load(partial_ptr + split * stride_split + offsets, mask=mask, other=0.0)
    tl.store(out_ptr + offsets, round_to(total, out_ptr.dtype.element_ty, DOT_PRECISION),
             mask=mask)


def sum_partials(partial: torch.Tensor, out: torch.Tensor, dot_precision: str) -> None:
    """``out = partial.sum(0)`` in ``out``'s dtype, rounded once, with no temporary.
    ``partial``: float32 (splits, rows, columns), each split contiguous; ``out``: contiguous
    (rows, columns); ``dot_precision``: the launch settings' (:func:`cce.config.dot_precision`),
    which say how to round."""
    splits, rows, columns = partial.shape
    if out.shape != (rows, columns) or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous ({rows}, {columns}) tensor, got "
                         f"{tuple(out.shape)} with strides {out.stride()}")
    if not partial[0].is_contiguous():
        raise ValueError("each split of partial must be contiguous")
    elements = rows * columns
    block = _INTERPRETER_BLOCK if interpreting() else _BLOCK
    if elements:
        partial_sums_kernel[(cdiv(elements, block),)](
            partial, out, splits, elements, partial.stride(0),
            BLOCK=block, DOT_PRECISION=dot_precision)
