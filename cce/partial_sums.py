"""The split dE product's last step: its float32 partial sums added up and written in the output's
dtype, in one launch.

When a chunk of the dE product has too few output blocks to fill the GPU, each block's list is
split among several programs that write float32 partial sums (:mod:`cce.sparse_tile_matmul`).
At D = 640 a chunk takes about 17 splits: summing them with torch took one launch per split
plus a copy, and those ~18 launches per chunk cost more host time than the GPU spent on them,
so the GPU waited. The splits are added in order, from the first, in float32, as torch did.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from cce.config import dot_precision, interpreting
from cce.logit_tile import round_to

_BLOCK = 1024
_INTERPRETER_BLOCK = 4096  # the interpreter wants few, large programs


@triton.jit
def partial_sums_kernel(partial_ptr, out_ptr, out_rows_ptr, splits, elements, columns,
                        stride_split, ROWS_LISTED: tl.constexpr, BLOCK: tl.constexpr,
                        DOT_PRECISION: tl.constexpr):
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < elements
    total = tl.zeros((BLOCK,), dtype=tl.float32)
    for split in range(splits):
        total += tl.load(partial_ptr + split * stride_split + offsets, mask=mask, other=0.0)
    if ROWS_LISTED:
        out_rows = tl.load(out_rows_ptr + offsets // columns, mask=mask, other=0)
        out_offsets = out_rows.to(tl.int64) * columns + offsets % columns
    else:
        out_offsets = offsets
    tl.store(out_ptr + out_offsets, round_to(total, out_ptr.dtype.element_ty, DOT_PRECISION),
             mask=mask)


def sum_partials(partial: torch.Tensor, out: torch.Tensor,
                 out_rows: Optional[torch.Tensor] = None) -> None:
    """``out = partial.sum(0)`` in ``out``'s dtype, rounded once, with no temporary; with
    ``out_rows`` (int32, one per row of ``partial``), ``out[out_rows] = partial.sum(0)``.
    ``partial``: float32 (splits, rows, columns), each split contiguous; ``out``: contiguous
    (rows, columns), or (any, columns) with ``out_rows``."""
    splits, rows, columns = partial.shape
    expected_rows = out.shape[0] if out_rows is not None else rows
    if out.shape != (expected_rows, columns) or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous ({expected_rows}, {columns}) tensor, got "
                         f"{tuple(out.shape)} with strides {out.stride()}")
    if out_rows is not None and out_rows.shape != (rows,):
        raise ValueError(f"out_rows must have shape ({rows},), got {tuple(out_rows.shape)}")
    if not partial[0].is_contiguous():
        raise ValueError("each split of partial must be contiguous")
    elements = rows * columns
    block = _INTERPRETER_BLOCK if interpreting() else _BLOCK
    if elements:
        partial_sums_kernel[(triton.cdiv(elements, block),)](
            partial, out, out_rows, splits, elements, columns, partial.stride(0),
            ROWS_LISTED=out_rows is not None, BLOCK=block,
            DOT_PRECISION=dot_precision(out.dtype))
