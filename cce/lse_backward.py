"""Linear-log-sum-exp backward (paper Alg. 3), fused with the indexed-matmul backward.

Each program recomputes one logit tile, forms the softmax tile ``S = exp(z - LSE)``, scales it
by each row's incoming gradient and subtracts the gradient at each row's target. A tile whose
entries are all below ``filter_eps`` contributes nothing at the dtype's precision and is skipped
(gradient filtering). Otherwise ``dE += G C`` and ``dC += G^T E`` are added into float32
buffers; float32 accumulation avoids the bf16 rounding of thousands of partial sums.

With vocabulary sorting, program ``j`` takes the ``j``-th block of ``vocab_order`` (vocabulary
entries by decreasing average logit) instead of the ``j``-th block of the vocabulary.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from cce.config import dot_precision, kernel_configs
from cce.logit_tile import logit_tile, tile_dot, to_dot_operand


@triton.jit
def lse_backward_kernel(
    e_ptr, c_ptr, bias_ptr, targets_ptr, lse_ptr, prob_scale_ptr, target_scale_ptr,
    vocab_order_ptr, grad_e_ptr, grad_c_ptr, grad_bias_ptr,
    num_tokens, vocab_size, dim,
    stride_e_row, stride_e_dim, stride_c_row, stride_c_dim, softcap, filter_eps,
    HAS_BIAS: tl.constexpr, HAS_SOFTCAP: tl.constexpr, FILTER: tl.constexpr,
    SORTED: tl.constexpr,
    BLOCK_TOKENS: tl.constexpr, BLOCK_VOCAB: tl.constexpr, BLOCK_DIM: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    num_token_blocks = tl.cdiv(num_tokens, BLOCK_TOKENS)
    token_block = tl.program_id(0) % num_token_blocks
    vocab_block = tl.program_id(0) // num_token_blocks

    rows = token_block * BLOCK_TOKENS + tl.arange(0, BLOCK_TOKENS)
    positions = vocab_block * BLOCK_VOCAB + tl.arange(0, BLOCK_VOCAB)
    row_mask = rows < num_tokens
    vocab_mask = positions < vocab_size
    if SORTED:
        vocab = tl.load(vocab_order_ptr + positions, mask=vocab_mask, other=0)
    else:
        vocab = positions

    logits = logit_tile(
        e_ptr, c_ptr, bias_ptr, rows, row_mask, vocab, vocab_mask, dim,
        stride_e_row, stride_e_dim, stride_c_row, stride_c_dim, softcap,
        HAS_BIAS, HAS_SOFTCAP, BLOCK_TOKENS, BLOCK_VOCAB, BLOCK_DIM, DOT_PRECISION,
    )
    lse = tl.load(lse_ptr + rows, mask=row_mask, other=0.0)
    prob_scale = tl.load(prob_scale_ptr + rows, mask=row_mask, other=0.0)
    target_scale = tl.load(target_scale_ptr + rows, mask=row_mask, other=0.0)
    targets = tl.load(targets_ptr + rows, mask=row_mask, other=-1)

    live = (prob_scale != 0.0)[:, None] & vocab_mask[None, :]
    probs = tl.where(live, tl.exp(logits - lse[:, None]), 0.0)
    is_target = (vocab[None, :] == targets[:, None]) & vocab_mask[None, :]

    keep = True
    if FILTER:
        # Entries of S - onehot; the NaN test keeps NaN inputs propagating as in PyTorch.
        magnitude = tl.abs(probs - is_target.to(tl.float32))
        significant = (magnitude >= filter_eps) | (magnitude != magnitude)
        keep = tl.max(significant.to(tl.int32)) > 0
    if keep:
        grad = probs * prob_scale[:, None] - tl.where(is_target, target_scale[:, None], 0.0)
        if HAS_SOFTCAP:
            capped = logits / softcap
            grad = grad * (1.0 - capped * capped)
        if HAS_BIAS:
            tl.atomic_add(grad_bias_ptr + vocab, tl.sum(grad, axis=0), mask=vocab_mask)
        grad = to_dot_operand(grad, e_ptr.dtype.element_ty, DOT_PRECISION)

        offsets_dim = tl.arange(0, BLOCK_DIM)
        row_offsets = rows.to(tl.int64)[:, None]
        vocab_offsets = vocab.to(tl.int64)[:, None]
        for dim_start in range(0, dim, BLOCK_DIM):
            dims = dim_start + offsets_dim
            dim_mask = dims < dim
            token_tile_mask = row_mask[:, None] & dim_mask[None, :]
            vocab_tile_mask = vocab_mask[:, None] & dim_mask[None, :]

            c_block = tl.load(c_ptr + vocab_offsets * stride_c_row + dims[None, :] * stride_c_dim,
                              mask=vocab_tile_mask, other=0.0)
            grad_e = tile_dot(grad, c_block, None, DOT_PRECISION)
            tl.atomic_add(grad_e_ptr + row_offsets * dim + dims[None, :], grad_e,
                          mask=token_tile_mask)

            e_block = tl.load(e_ptr + row_offsets * stride_e_row + dims[None, :] * stride_e_dim,
                              mask=token_tile_mask, other=0.0)
            grad_c = tile_dot(tl.trans(grad), e_block, None, DOT_PRECISION)
            tl.atomic_add(grad_c_ptr + vocab_offsets * dim + dims[None, :], grad_c,
                          mask=vocab_tile_mask)


def lse_backward(e: torch.Tensor, c: torch.Tensor, targets: torch.Tensor,
                 bias: Optional[torch.Tensor], softcap: Optional[float], lse: torch.Tensor,
                 prob_scale: torch.Tensor, target_scale: torch.Tensor,
                 vocab_order: Optional[torch.Tensor], filter_eps: Optional[float],
                 ) -> "tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]":
    """Gradients (dE, dC, dbias) in the inputs' dtype.

    The gradient of the logits is ``prob_scale[i] * softmax_ij - target_scale[i] * [j == x_i]``:
    ``prob_scale`` collects the incoming gradients of the loss and of the LSE per token,
    ``target_scale`` that of the loss alone.
    """
    num_tokens, dim = e.shape
    vocab_size = c.shape[0]
    config = kernel_configs(e.dtype).lse_backward
    grad_e = torch.zeros((num_tokens, dim), dtype=torch.float32, device=e.device)
    grad_c = torch.zeros((vocab_size, dim), dtype=torch.float32, device=e.device)
    grad_bias = (torch.zeros(vocab_size, dtype=torch.float32, device=e.device)
                 if bias is not None else None)
    grid = (triton.cdiv(num_tokens, config.block_tokens)
            * triton.cdiv(vocab_size, config.block_vocab),)
    lse_backward_kernel[grid](
        e, c, bias, targets, lse, prob_scale, target_scale, vocab_order,
        grad_e, grad_c, grad_bias, num_tokens, vocab_size, dim,
        e.stride(0), e.stride(1), c.stride(0), c.stride(1), softcap or 1.0,
        filter_eps or 0.0,
        HAS_BIAS=bias is not None, HAS_SOFTCAP=softcap is not None,
        FILTER=filter_eps is not None, SORTED=vocab_order is not None,
        BLOCK_TOKENS=config.block_tokens, BLOCK_VOCAB=config.block_vocab,
        BLOCK_DIM=config.block_dim, DOT_PRECISION=dot_precision(e.dtype),
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
    return (grad_e.to(e.dtype), grad_c.to(c.dtype),
            grad_bias.to(bias.dtype) if grad_bias is not None else None)
