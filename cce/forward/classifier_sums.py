"""Two sums over the classifier from one read of it: each row's product with a vector, and the
sum of the rows.

A training call needs both, and each reads all of ``c`` (V x D, the largest input): the
vocabulary order ranks rows by ``c_v . mean(e)`` (:mod:`cce.forward.vocab_order`), and the
backward's mass correction adds back what the filter dropped along the mean row of ``c``
(:class:`cce.backward.sparse_tile_matmul.FilterCorrection`). One pass gives both.

The programs form a grid of row chunks x D slices. Each walks its chunk's row blocks within its
slice: the column sums accumulate in registers and are written once, to the chunk's row of a
float32 table; each row's product over the slice goes to the slice's row of another. Adding both
tables over their first axis afterwards gives the sums, in an order that does not depend on the
schedule, so the same inputs give the same bits.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
import triton
import triton.language as tl

from cce.config import cdiv, interpreting, multiprocessor_count

# 64 x 256 tiles, two programs per SM: 2.1-2.6 TB/s of c on an H100 where narrower tiles or more
# programs read slower (results/dev/h100_classifier_sums_tuning.json).
_BLOCK_ROWS, _BLOCK_DIM, _NUM_WARPS, _NUM_STAGES, _PROGRAMS_PER_SM = 64, 256, 8, 3, 2
# The interpreter's time grows with programs x steps: few, large steps, still several chunks and
# slices at the test's sizes.
_INTERPRETER_BLOCK_ROWS, _INTERPRETER_BLOCK_DIM, _INTERPRETER_PROGRAMS = 256, 128, 4
_TORCH_ROWS = 4096


@triton.jit
def classifier_sums_kernel(c_ptr, vector_ptr, dots_ptr, column_partial_ptr, num_rows, dim,
                           stride_row, stride_dim, blocks_per_program, HAS_VECTOR: tl.constexpr,
                           BLOCK_ROWS: tl.constexpr, BLOCK_DIM: tl.constexpr):
    chunk = tl.program_id(0)
    dim_slice = tl.program_id(1)
    dims = dim_slice * BLOCK_DIM + tl.arange(0, BLOCK_DIM)
    dim_mask = dims < dim
    if HAS_VECTOR:
        vector = tl.load(vector_ptr + dims, mask=dim_mask, other=0.0).to(tl.float32)
    column_sum = tl.zeros((BLOCK_ROWS, BLOCK_DIM), dtype=tl.float32)
    for block in range(chunk * blocks_per_program, (chunk + 1) * blocks_per_program):
        rows = block * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
        row_mask = rows < num_rows
        tile = tl.load(c_ptr + rows.to(tl.int64)[:, None] * stride_row
                       + dims[None, :] * stride_dim,
                       mask=row_mask[:, None] & dim_mask[None, :], other=0.0).to(tl.float32)
        column_sum += tile
        if HAS_VECTOR:
            tl.store(dots_ptr + dim_slice.to(tl.int64) * num_rows + rows,
                     tl.sum(tile * vector[None, :], axis=1), mask=row_mask)
    tl.store(column_partial_ptr + chunk * dim + dims, tl.sum(column_sum, axis=0), mask=dim_mask)


class ClassifierSums(NamedTuple):
    dots: Optional[torch.Tensor]  # float32 (V,): c @ vector; None without a vector
    row_sum: torch.Tensor  # float32 (D,): the sum of the rows of c


def classifier_sums(c: torch.Tensor, vector: Optional[torch.Tensor] = None) -> ClassifierSums:
    """``c @ vector`` (when given) and ``c.sum(0)``, both float32, from one read of ``c``
    (V, D). Deterministic: the same inputs on the same device give the same bits. On a GPU, the
    kernel; on the CPU, PyTorch (in Triton's interpreter the kernel takes seconds per call: its
    test runs it there through :func:`classifier_sums_by_kernel`)."""
    if c.device.type != "cuda":
        return classifier_sums_by_torch(c, vector)
    return classifier_sums_by_kernel(c, vector)


def classifier_sums_by_kernel(c: torch.Tensor,
                              vector: Optional[torch.Tensor] = None) -> ClassifierSums:
    """:func:`classifier_sums` by the kernel, on a GPU or in Triton's interpreter."""
    num_rows, dim = c.shape
    if num_rows == 0 or dim == 0:
        return ClassifierSums(c.new_zeros(num_rows, dtype=torch.float32)
                              if vector is not None else None,
                              c.new_zeros(dim, dtype=torch.float32))
    if interpreting():
        block_rows, block_dim, programs = (_INTERPRETER_BLOCK_ROWS, _INTERPRETER_BLOCK_DIM,
                                           _INTERPRETER_PROGRAMS)
    else:
        block_rows, block_dim = _BLOCK_ROWS, _BLOCK_DIM
        programs = (_PROGRAMS_PER_SM
                    * multiprocessor_count(c.device))
    slices = cdiv(dim, block_dim)
    num_blocks = cdiv(num_rows, block_rows)
    blocks_per_program = cdiv(num_blocks, max(1, min(num_blocks, programs // slices)))
    chunks = cdiv(num_blocks, blocks_per_program)
    dots = (torch.empty((slices, num_rows), dtype=torch.float32, device=c.device)
            if vector is not None else None)
    column_partial = torch.empty((chunks, dim), dtype=torch.float32, device=c.device)
    classifier_sums_kernel[(chunks, slices)](
        c, vector, dots, column_partial, num_rows, dim, c.stride(0), c.stride(1),
        blocks_per_program,
        HAS_VECTOR=vector is not None, BLOCK_ROWS=block_rows, BLOCK_DIM=block_dim,
        num_warps=_NUM_WARPS, num_stages=_NUM_STAGES)
    return ClassifierSums(dots.sum(0) if dots is not None else None, column_partial.sum(0))


def classifier_sums_by_torch(c: torch.Tensor, vector: Optional[torch.Tensor] = None,
                             block_rows: int = _TORCH_ROWS) -> ClassifierSums:
    """:func:`classifier_sums` by PyTorch (the CPU's), in float32, ``block_rows`` rows at a time
    so that no float32 copy of ``c`` is made. Outside autocast, which would round the products
    to 16 bits."""
    with torch.autocast(c.device.type, enabled=False):
        row_sum = c.sum(0, dtype=torch.float32)
        if vector is None:
            return ClassifierSums(None, row_sum)
        vector = vector.float()
        return ClassifierSums(
            torch.cat([rows.float() @ vector for rows in c.split(block_rows)]), row_sum)
