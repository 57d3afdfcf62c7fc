"""A weighted sum of the rows of a matrix, ``sum_m weights[m] * matrix[m]``, in float32.

The products of the label-smoothing gradient's rank-one term (:mod:`cce.weighting`) need two of
them: ``w^T C`` over the vocabulary and ``u^T E`` over the tokens. ``torch.mv`` would round them
to the inputs' 16-bit dtype, and a float32 copy of the matrix would cost as much memory as the
gradient it serves. Here each program sums a range of rows in float32 registers and writes a
float32 partial sum; the partial sums are added up in order (:mod:`cce.backward.partial_sums`), so
the result is deterministic.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from cce.config import cdiv, dot_precision, next_power_of_2, split_count
from cce.backward.partial_sums import sum_partials

_BLOCK_ROWS = 64
_BLOCK_DIM = 128


@triton.jit
def weighted_sum_kernel(matrix_ptr, weights_ptr, partial_ptr, num_rows, dim, rows_per_program,
                        stride_row, stride_dim, HAS_WEIGHTS: tl.constexpr,
                        BLOCK_ROWS: tl.constexpr, BLOCK_DIM: tl.constexpr):
    num_dim_blocks = tl.cdiv(dim, BLOCK_DIM)
    dims = (tl.program_id(0) % num_dim_blocks) * BLOCK_DIM + tl.arange(0, BLOCK_DIM)
    dim_mask = dims < dim
    split = tl.program_id(0) // num_dim_blocks
    first_row = split * rows_per_program
    last_row = tl.minimum(first_row + rows_per_program, num_rows)
    acc = tl.zeros((BLOCK_ROWS, BLOCK_DIM), dtype=tl.float32)
    for start in range(first_row, last_row, BLOCK_ROWS):
        rows = start + tl.arange(0, BLOCK_ROWS)
        row_mask = rows < last_row
        block = tl.load(matrix_ptr + rows.to(tl.int64)[:, None] * stride_row
                        + dims[None, :] * stride_dim,
                        mask=row_mask[:, None] & dim_mask[None, :], other=0.0).to(tl.float32)
        if HAS_WEIGHTS:
            block *= tl.load(weights_ptr + rows, mask=row_mask, other=0.0)[:, None]
        acc += block
    tl.store(partial_ptr + split * dim + dims, tl.sum(acc, axis=0), mask=dim_mask)


def weighted_sum(matrix: torch.Tensor, weights: Optional[torch.Tensor] = None) -> torch.Tensor:
    """float32 (D,) ``sum_m weights[m] * matrix[m]`` of a (M, D) matrix (any strides);
    ``weights``: float32 (M,), None for all 1."""
    num_rows, dim = matrix.shape
    block_dim = min(_BLOCK_DIM, next_power_of_2(max(dim, 1)))
    dim_blocks = cdiv(dim, block_dim)
    row_blocks = max(1, cdiv(num_rows, _BLOCK_ROWS))
    splits = min(row_blocks, split_count(dim_blocks, dim * 4, matrix.device))
    # Whole blocks of rows per program; every program gets some.
    rows_per_program = cdiv(row_blocks, splits) * _BLOCK_ROWS
    splits = cdiv(row_blocks * _BLOCK_ROWS, rows_per_program)
    partial = torch.empty((splits, 1, dim), dtype=torch.float32, device=matrix.device)
    if dim:
        weighted_sum_kernel[(dim_blocks * splits,)](
            matrix, weights, partial, num_rows, dim, rows_per_program,
            matrix.stride(0), matrix.stride(1), HAS_WEIGHTS=weights is not None,
            BLOCK_ROWS=_BLOCK_ROWS, BLOCK_DIM=block_dim)
    out = torch.empty((1, dim), dtype=torch.float32, device=matrix.device)
    sum_partials(partial, out, dot_precision(out.dtype))
    return out[0]
