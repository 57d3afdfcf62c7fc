"""Indexed matrix multiplication (paper Alg. 1): the target logit ``C[x_i] . E_i`` of every token.

Each program takes BLOCK_TOKENS tokens, gathers their target rows of ``c`` slice by slice along D
and reduces the elementwise product on-chip; ``C[x]`` is never built in memory. The loss's forward
has the same launch place each target in the vocabulary order (:mod:`cce.forward.vocab_order`):
before the LSE kernel, every launch is host time that the GPU waits for at small N.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from cce.config import cdiv, kernel_configs
from cce.forward.vocab_order import NO_MARKS, TargetPlacement, place_targets
from cce.logit_tile import logit_operands, tanh


@triton.jit
def indexed_dot_kernel(operands, targets_ptr, out_ptr, placement, BLOCK_TOKENS: tl.constexpr,
                       BLOCK_DIM: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_TOKENS + tl.arange(0, BLOCK_TOKENS)
    row_mask = rows < operands.num_tokens
    targets = tl.load(targets_ptr + rows, mask=row_mask, other=-1)
    if placement.positions is not None:
        place_targets(targets, rows, row_mask, placement)
    gather_mask = row_mask & (targets >= 0)  # ignored tokens (-1) read nothing
    e_rows = operands.e + rows.to(tl.int64)[:, None] * operands.stride_e_row
    c_rows = operands.c + targets.to(tl.int64)[:, None] * operands.stride_c_row
    offsets_dim = tl.arange(0, BLOCK_DIM)
    acc = tl.zeros((BLOCK_TOKENS, BLOCK_DIM), dtype=tl.float32)
    for dim_start in range(0, operands.dim, BLOCK_DIM):
        dims = dim_start + offsets_dim
        mask = gather_mask[:, None] & (dims < operands.dim)[None, :]
        e_block = tl.load(e_rows + dims[None, :] * operands.stride_e_dim, mask=mask, other=0.0)
        c_block = tl.load(c_rows + dims[None, :] * operands.stride_c_dim, mask=mask, other=0.0)
        acc += e_block.to(tl.float32) * c_block.to(tl.float32)
    logit = tl.sum(acc, axis=1)
    if operands.bias is not None:
        logit += tl.load(operands.bias + targets, mask=gather_mask, other=0.0).to(tl.float32)
    if operands.softcap is not None:
        logit = operands.softcap * tanh(logit / operands.softcap)
    tl.store(out_ptr + rows, logit, mask=row_mask)


def indexed_dot(e: torch.Tensor, c: torch.Tensor, targets: torch.Tensor,
                bias: Optional[torch.Tensor], softcap: Optional[float],
                placement: Optional[TargetPlacement] = None) -> torch.Tensor:
    """float32 (N,) target logits; 0 (or the softcapped bias-free 0) where targets is -1. With
    ``placement``, the launch also writes the targets' positions there."""
    out = torch.empty(e.shape[0], dtype=torch.float32, device=e.device)
    config = kernel_configs(e.dtype).indexed_dot
    grid = (cdiv(e.shape[0], config.block_tokens),)
    indexed_dot_kernel[grid](
        logit_operands(e, c, bias, None, softcap), targets, out,
        placement or TargetPlacement(None, None, NO_MARKS),
        BLOCK_TOKENS=config.block_tokens, BLOCK_DIM=config.block_dim,
        num_warps=config.num_warps,
    )
    return out
