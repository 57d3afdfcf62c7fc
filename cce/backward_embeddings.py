"""Backward for the embeddings (paper Alg. 3, dE half): ``dE = G C`` without atomics.

``G`` is the gradient of the logits (softmax scaled per row, minus the target's gradient; see
:func:`cce.logit_tile.logit_gradient_tile`). Each program owns BLOCK_TOKENS rows and BLOCK_OUT
columns of dE and walks every vocabulary block (in sorted order when sorting), recomputing each
logit tile and accumulating ``G_tile @ C_tile`` in float32 registers; dE is written once, in the
input dtype. Tiles that the forward's maxima prove negligible are skipped before any recompute;
the others are recomputed and skipped if every entry is below ``filter_eps`` (gradient
filtering).
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from cce.backward_launch import launch_backward
from cce.config import kernel_configs
from cce.logit_tile import logit_gradient_tile, round_to, tile_dot, vocab_block_entries


@triton.jit
def backward_embeddings_kernel(
    e_ptr, c_ptr, bias_ptr, targets_ptr, lse_ptr, prob_scale_ptr, target_scale_ptr,
    vocab_order_ptr, live_tiles_ptr, grad_e_ptr,
    num_tokens, vocab_size, dim, num_grid_vocab_blocks,
    stride_e_row, stride_e_dim, stride_c_row, stride_c_dim, softcap, filter_eps,
    HAS_BIAS: tl.constexpr, HAS_SOFTCAP: tl.constexpr, FILTER: tl.constexpr,
    SORTED: tl.constexpr, SKIP_DEAD_TILES: tl.constexpr,
    BLOCK_TOKENS: tl.constexpr, BLOCK_VOCAB: tl.constexpr, BLOCK_DIM: tl.constexpr,
    BLOCK_OUT: tl.constexpr, GRID_BLOCK_TOKENS: tl.constexpr, GRID_BLOCK_VOCAB: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    # Token blocks vary fastest: programs in flight walk the same tiles of c together.
    num_token_blocks = tl.cdiv(num_tokens, BLOCK_TOKENS)
    token_block = tl.program_id(0) % num_token_blocks
    out_chunk = tl.program_id(0) // num_token_blocks

    rows = token_block * BLOCK_TOKENS + tl.arange(0, BLOCK_TOKENS)
    row_mask = rows < num_tokens
    out_dims = out_chunk * BLOCK_OUT + tl.arange(0, BLOCK_OUT)
    out_mask = out_dims < dim
    grid_row = token_block * BLOCK_TOKENS // GRID_BLOCK_TOKENS

    acc = tl.zeros((BLOCK_TOKENS, BLOCK_OUT), dtype=tl.float32)
    for vocab_block in range(tl.cdiv(vocab_size, BLOCK_VOCAB)):
        live = True
        if SKIP_DEAD_TILES:
            grid_column = vocab_block * BLOCK_VOCAB // GRID_BLOCK_VOCAB
            live = tl.load(live_tiles_ptr + grid_row * num_grid_vocab_blocks + grid_column) != 0
        if live:
            vocab, vocab_mask = vocab_block_entries(
                vocab_order_ptr, vocab_block, vocab_size, BLOCK_VOCAB, SORTED)
            grad, keep = logit_gradient_tile(
                e_ptr, c_ptr, bias_ptr, targets_ptr, lse_ptr, prob_scale_ptr, target_scale_ptr,
                rows, row_mask, vocab, vocab_mask, dim,
                stride_e_row, stride_e_dim, stride_c_row, stride_c_dim, softcap, filter_eps,
                HAS_BIAS, HAS_SOFTCAP, FILTER, BLOCK_TOKENS, BLOCK_VOCAB, BLOCK_DIM,
                DOT_PRECISION,
            )
            if keep:
                c_block = tl.load(
                    c_ptr + vocab.to(tl.int64)[:, None] * stride_c_row
                    + out_dims[None, :] * stride_c_dim,
                    mask=vocab_mask[:, None] & out_mask[None, :], other=0.0)
                operand = round_to(grad, c_ptr.dtype.element_ty, DOT_PRECISION)
                acc = tile_dot(operand, c_block, acc, DOT_PRECISION)
    tl.store(grad_e_ptr + rows.to(tl.int64)[:, None] * dim + out_dims[None, :],
             round_to(acc, grad_e_ptr.dtype.element_ty, DOT_PRECISION),
             mask=row_mask[:, None] & out_mask[None, :])


def backward_embeddings(e: torch.Tensor, c: torch.Tensor, targets: torch.Tensor,
                        bias: Optional[torch.Tensor], softcap: Optional[float],
                        lse: torch.Tensor, prob_scale: torch.Tensor, target_scale: torch.Tensor,
                        vocab_order: Optional[torch.Tensor], live_tiles: Optional[torch.Tensor],
                        filter_eps: Optional[float]) -> torch.Tensor:
    """dE, (N, D) in e's dtype. ``live_tiles`` is the live-grid table of tiles that may hold a
    significant entry (None: recompute every tile)."""
    num_tokens, dim = e.shape
    config = kernel_configs(e.dtype).backward_embeddings
    block_out = min(config.block_out, triton.next_power_of_2(dim))
    grad_e = torch.empty((num_tokens, dim), dtype=e.dtype, device=e.device)
    grid = (triton.cdiv(num_tokens, config.block_tokens) * triton.cdiv(dim, block_out),)
    launch_backward(backward_embeddings_kernel, config, block_out, grid, (grad_e,), e, c, targets,
                    bias, softcap, lse, prob_scale, target_scale, vocab_order, live_tiles,
                    filter_eps)
    return grad_e
