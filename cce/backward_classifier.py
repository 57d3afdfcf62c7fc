"""dC without stored tiles, for the end of the vocabulary (see :mod:`cce.backward`).

``dC = G^T E`` for a range of vocabulary blocks, without atomics and without scratch: each
program owns BLOCK_VOCAB vocabulary entries (a block of the sorted order when sorting) and
BLOCK_OUT columns of dC, walks every token block, recomputes each logit tile and accumulates
``G_tile^T @ E_tile`` (and the bias gradient, ``G``'s column sums) in float32 registers. dC is
written once, in the input dtype, through the vocabulary order. Tiles dead in ``live_tiles``
are skipped before any recompute, the others are filtered exactly. The price is one recompute
of every live tile per BLOCK_OUT columns of D.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from cce.config import dot_precision, kernel_configs
from cce.logit_tile import logit_gradient_tile, round_to, tile_dot, vocab_block_entries


@triton.jit
def backward_classifier_kernel(
    e_ptr, c_ptr, bias_ptr, targets_ptr, lse_ptr, prob_scale_ptr, target_scale_ptr,
    vocab_order_ptr, live_tiles_ptr, grad_c_ptr, grad_bias_ptr,
    num_tokens, vocab_size, dim, num_grid_vocab_blocks, first_vocab_block, num_vocab_blocks,
    stride_e_row, stride_e_dim, stride_c_row, stride_c_dim, softcap, filter_eps,
    HAS_BIAS: tl.constexpr, HAS_SOFTCAP: tl.constexpr, FILTER: tl.constexpr,
    SORTED: tl.constexpr, SKIP_DEAD_TILES: tl.constexpr,
    BLOCK_TOKENS: tl.constexpr, BLOCK_VOCAB: tl.constexpr, BLOCK_DIM: tl.constexpr,
    BLOCK_OUT: tl.constexpr, GRID_BLOCK_TOKENS: tl.constexpr, GRID_BLOCK_VOCAB: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    # Vocabulary blocks vary fastest: programs in flight walk the same tiles of e together.
    vocab_block = first_vocab_block + tl.program_id(0) % num_vocab_blocks
    out_chunk = tl.program_id(0) // num_vocab_blocks

    vocab, vocab_mask = vocab_block_entries(
        vocab_order_ptr, vocab_block, vocab_size, BLOCK_VOCAB, SORTED)
    out_dims = out_chunk * BLOCK_OUT + tl.arange(0, BLOCK_OUT)
    out_mask = out_dims < dim
    grid_column = vocab_block * BLOCK_VOCAB // GRID_BLOCK_VOCAB

    acc = tl.zeros((BLOCK_VOCAB, BLOCK_OUT), dtype=tl.float32)
    grad_bias = tl.zeros((BLOCK_VOCAB,), dtype=tl.float32)
    for token_block in range(tl.cdiv(num_tokens, BLOCK_TOKENS)):
        live = True
        if SKIP_DEAD_TILES:
            grid_row = token_block * BLOCK_TOKENS // GRID_BLOCK_TOKENS
            live = tl.load(live_tiles_ptr + grid_row * num_grid_vocab_blocks + grid_column) != 0
        if live:
            rows = token_block * BLOCK_TOKENS + tl.arange(0, BLOCK_TOKENS)
            row_mask = rows < num_tokens
            grad, keep = logit_gradient_tile(
                e_ptr, c_ptr, bias_ptr, targets_ptr, lse_ptr, prob_scale_ptr, target_scale_ptr,
                rows, row_mask, vocab, vocab_mask, dim,
                stride_e_row, stride_e_dim, stride_c_row, stride_c_dim, softcap, filter_eps,
                HAS_BIAS, HAS_SOFTCAP, FILTER, BLOCK_TOKENS, BLOCK_VOCAB, BLOCK_DIM,
                DOT_PRECISION,
            )
            if keep:
                if HAS_BIAS:
                    grad_bias += tl.sum(grad, axis=0)
                e_block = tl.load(
                    e_ptr + rows.to(tl.int64)[:, None] * stride_e_row
                    + out_dims[None, :] * stride_e_dim,
                    mask=row_mask[:, None] & out_mask[None, :], other=0.0)
                operand = round_to(grad, e_ptr.dtype.element_ty, DOT_PRECISION)
                acc = tile_dot(tl.trans(operand), e_block, acc, DOT_PRECISION)
    tl.store(grad_c_ptr + vocab.to(tl.int64)[:, None] * dim + out_dims[None, :],
             round_to(acc, grad_c_ptr.dtype.element_ty, DOT_PRECISION),
             mask=vocab_mask[:, None] & out_mask[None, :])
    if HAS_BIAS:
        if out_chunk == 0:
            tl.store(grad_bias_ptr + vocab,
                     round_to(grad_bias, grad_bias_ptr.dtype.element_ty, DOT_PRECISION),
                     mask=vocab_mask)


def backward_classifier(e: torch.Tensor, c: torch.Tensor, targets: torch.Tensor,
                        bias: Optional[torch.Tensor], softcap: Optional[float],
                        lse: torch.Tensor, prob_scale: torch.Tensor, target_scale: torch.Tensor,
                        vocab_order: Optional[torch.Tensor], live_tiles: Optional[torch.Tensor],
                        filter_eps: Optional[float], grad_c: torch.Tensor,
                        grad_bias: Optional[torch.Tensor], first_position: int) -> None:
    """Write the rows of dC (and dbias) of vocabulary positions ``first_position`` onwards;
    ``first_position`` is a multiple of the live grid's block_vocab."""
    num_tokens, dim = e.shape
    vocab_size = c.shape[0]
    configs = kernel_configs(e.dtype)
    config, live_grid = configs.backward_classifier, configs.live_grid
    block_out = min(config.block_out, triton.next_power_of_2(dim))
    num_vocab_blocks = triton.cdiv(vocab_size - first_position, config.block_vocab)
    backward_classifier_kernel[(num_vocab_blocks * triton.cdiv(dim, block_out),)](
        e, c, bias, targets, lse, prob_scale, target_scale, vocab_order, live_tiles, grad_c,
        grad_bias, num_tokens, vocab_size, dim, triton.cdiv(vocab_size, live_grid.block_vocab),
        first_position // config.block_vocab, num_vocab_blocks,
        e.stride(0), e.stride(1), c.stride(0), c.stride(1), softcap or 1.0, filter_eps or 0.0,
        HAS_BIAS=bias is not None, HAS_SOFTCAP=softcap is not None,
        FILTER=filter_eps is not None, SORTED=vocab_order is not None,
        SKIP_DEAD_TILES=live_tiles is not None,
        BLOCK_TOKENS=config.block_tokens, BLOCK_VOCAB=config.block_vocab,
        BLOCK_DIM=config.block_dim, BLOCK_OUT=block_out,
        GRID_BLOCK_TOKENS=live_grid.block_tokens, GRID_BLOCK_VOCAB=live_grid.block_vocab,
        DOT_PRECISION=dot_precision(e.dtype),
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
