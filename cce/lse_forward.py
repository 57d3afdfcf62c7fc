"""Linear-log-sum-exp forward (paper Alg. 2): ``LSE_i = logsumexp_j(C_j . E_i)`` without logits.

Each program computes one (tokens x vocabulary) logit tile on-chip, reduces it to a per-row
log-sum-exp and merges that into the global LSE under a spin lock (one lock per token block),
so the N x V logits never reach global memory. When gradients will follow, it also adds the
tile's column sums into a per-vocabulary logit sum (atomic add): the backward sorts the
vocabulary by it so that negligible tiles cluster and gradient filtering skips them.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from cce.config import dot_precision, kernel_configs
from cce.logit_tile import logit_tile


@triton.jit
def log_add_exp(a, b):
    top = tl.maximum(a, b)
    # -inf on both sides would give -inf - -inf = nan; NaN inputs still propagate through the sum.
    safe_top = tl.where(top == float("-inf"), 0.0, top)
    return safe_top + tl.log(tl.exp(a - safe_top) + tl.exp(b - safe_top))


@triton.jit
def lse_forward_kernel(
    e_ptr, c_ptr, bias_ptr, targets_ptr, lse_ptr, locks_ptr, vocab_logit_sum_ptr,
    num_tokens, vocab_size, dim,
    stride_e_row, stride_e_dim, stride_c_row, stride_c_dim, softcap,
    HAS_BIAS: tl.constexpr, HAS_SOFTCAP: tl.constexpr, SUM_VOCAB_LOGITS: tl.constexpr,
    BLOCK_TOKENS: tl.constexpr, BLOCK_VOCAB: tl.constexpr, BLOCK_DIM: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    # Token blocks vary fastest: the programs in flight share one slice of c (read once from
    # memory) while the much smaller e stays in L2.
    num_token_blocks = tl.cdiv(num_tokens, BLOCK_TOKENS)
    token_block = tl.program_id(0) % num_token_blocks
    vocab_block = tl.program_id(0) // num_token_blocks

    rows = token_block * BLOCK_TOKENS + tl.arange(0, BLOCK_TOKENS)
    vocab = vocab_block * BLOCK_VOCAB + tl.arange(0, BLOCK_VOCAB)
    row_mask = rows < num_tokens
    vocab_mask = vocab < vocab_size

    logits = logit_tile(
        e_ptr, c_ptr, bias_ptr, rows, row_mask, vocab, vocab_mask, dim,
        stride_e_row, stride_e_dim, stride_c_row, stride_c_dim, softcap,
        HAS_BIAS, HAS_SOFTCAP, BLOCK_TOKENS, BLOCK_VOCAB, BLOCK_DIM, DOT_PRECISION,
    )
    # Padding columns get -inf after the softcap (a capped 0 would still carry exp(0) of mass).
    logits = tl.where(vocab_mask[None, :], logits, float("-inf"))

    if SUM_VOCAB_LOGITS:
        targets = tl.load(targets_ptr + rows, mask=row_mask, other=-1)
        counted = (targets >= 0)[:, None] & vocab_mask[None, :]
        column_sums = tl.sum(tl.where(counted, logits, 0.0), axis=0)
        tl.atomic_add(vocab_logit_sum_ptr + vocab, column_sums, mask=vocab_mask)

    tile_max = tl.max(logits, axis=1)
    tile_lse = tile_max + tl.log(tl.sum(tl.exp(logits - tile_max[:, None]), axis=1))

    lock = locks_ptr + token_block
    while tl.atomic_cas(lock, 0, 1) == 1:
        pass
    # .cg: read the merged value from L2, never a stale L1 line of another program's update.
    current = tl.load(lse_ptr + rows, mask=row_mask, cache_modifier=".cg")
    tl.store(lse_ptr + rows, log_add_exp(current, tile_lse), mask=row_mask)
    tl.debug_barrier()  # every thread's store is issued before the lock is released
    tl.atomic_xchg(lock, 0)


def lse_forward(e: torch.Tensor, c: torch.Tensor, targets: torch.Tensor,
                bias: Optional[torch.Tensor], softcap: Optional[float],
                sum_vocab_logits: bool) -> "tuple[torch.Tensor, Optional[torch.Tensor]]":
    """float32 (N,) log-sum-exp of every row, and the (V,) sum of each vocabulary entry's logit
    over non-ignored tokens when ``sum_vocab_logits`` (else None)."""
    num_tokens, dim = e.shape
    vocab_size = c.shape[0]
    config = kernel_configs(e.dtype).lse_forward
    num_token_blocks = triton.cdiv(num_tokens, config.block_tokens)
    lse = torch.full((num_tokens,), float("-inf"), dtype=torch.float32, device=e.device)
    locks = torch.zeros(num_token_blocks, dtype=torch.int32, device=e.device)
    vocab_logit_sum = (torch.zeros(vocab_size, dtype=torch.float32, device=e.device)
                       if sum_vocab_logits else None)
    grid = (num_token_blocks * triton.cdiv(vocab_size, config.block_vocab),)
    lse_forward_kernel[grid](
        e, c, bias, targets, lse, locks, vocab_logit_sum, num_tokens, vocab_size, dim,
        e.stride(0), e.stride(1), c.stride(0), c.stride(1), softcap or 1.0,
        HAS_BIAS=bias is not None, HAS_SOFTCAP=softcap is not None,
        SUM_VOCAB_LOGITS=sum_vocab_logits,
        BLOCK_TOKENS=config.block_tokens, BLOCK_VOCAB=config.block_vocab,
        BLOCK_DIM=config.block_dim, DOT_PRECISION=dot_precision(e.dtype),
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
    return lse, vocab_logit_sum
