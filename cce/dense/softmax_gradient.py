"""The dense path's pass over materialized logits: per row, the log-sum-exp of the non-target
logits and the target's logit (as the indexed dot and the LSE forward give them, so that rows
where the model is sure keep ``1 - p_y`` to float32 precision, :mod:`cce.weighting`), and the
gradient of the logits ``p - onehot`` (NaN on a row with a +inf logit, as in PyTorch), written
in the inputs' 16- or 32-bit dtype.

One program per row reads its logits twice: a running log-sum-exp with the target left out,
then the softmax, whose entry at the target is ``-(1 - p_y) = -exp(O - L)``. The second read
mostly hits L2, where the first left the row. Where G is kept transposed (in dC's memory,
:mod:`cce.dense.loss`), the first read alone, then :func:`transposed_gradient` writes ``G^T`` tile
by tile, so that its stores run along the tokens.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from cce.config import cdiv, dot_precision, kernel_configs
from cce.forward.lse_forward import exp_shift, log_add_exp
from cce.logit_tile import round_to


@triton.jit
def _logit_block(row_logits, bias_ptr, columns, vocab_size):
    """A block of a row's logits plus the bias, -inf past the vocabulary."""
    z = tl.load(row_logits + columns, mask=columns < vocab_size, other=float("-inf"))
    if bias_ptr is not None:
        z += tl.load(bias_ptr + columns, mask=columns < vocab_size, other=0.0).to(tl.float32)
    return z


@triton.jit
def _softmax_minus_onehot(z, is_target, other_lse, target_logit):
    """Entries of ``softmax - onehot`` from a row's logits ``z`` and its two LSE parts (NaN on a
    row with a +inf logit, as PyTorch's log_softmax gives)."""
    lse = log_add_exp(other_lse, target_logit)
    complement = tl.exp(other_lse - lse)
    poison = tl.where(lse == float("inf"), float("nan"), 0.0)
    return tl.where(is_target, -complement, tl.exp(z - lse)) + poison


@triton.jit
def softmax_gradient_kernel(logits_ptr, bias_ptr, targets_ptr, other_lse_ptr, target_logit_ptr,
                            gradient_ptr, vocab_size, stride_logits, stride_gradient,
                            BLOCK_VOCAB: tl.constexpr, DOT_PRECISION: tl.constexpr):
    row = tl.program_id(0)
    target = tl.load(targets_ptr + row)
    row_logits = logits_ptr + row.to(tl.int64) * stride_logits
    offsets = tl.arange(0, BLOCK_VOCAB)
    shift = float("-inf")
    total = 0.0
    target_logit = float("-inf")
    for start in range(0, vocab_size, BLOCK_VOCAB):
        columns = start + offsets
        z = _logit_block(row_logits, bias_ptr, columns, vocab_size)
        is_target = columns == target
        target_logit = tl.maximum(target_logit, tl.max(tl.where(is_target, z, float("-inf"))))
        z = tl.where(is_target, float("-inf"), z)
        new_shift = exp_shift(tl.maximum(shift, tl.max(z)))
        total = total * tl.exp(shift - new_shift) + tl.sum(tl.exp(z - new_shift))
        shift = new_shift
    other_lse = shift + tl.log(total)
    tl.store(other_lse_ptr + row, other_lse)
    tl.store(target_logit_ptr + row, target_logit)
    if gradient_ptr is not None:
        row_gradient = gradient_ptr + row.to(tl.int64) * stride_gradient
        for start in range(0, vocab_size, BLOCK_VOCAB):
            columns = start + offsets
            z = _logit_block(row_logits, bias_ptr, columns, vocab_size)
            g = _softmax_minus_onehot(z, columns == target, other_lse, target_logit)
            tl.store(row_gradient + columns,
                     round_to(g, gradient_ptr.dtype.element_ty, DOT_PRECISION),
                     mask=columns < vocab_size)


def softmax_gradient(logits: torch.Tensor, bias: Optional[torch.Tensor], targets: torch.Tensor,
                     gradient: Optional[torch.Tensor]
                     ) -> "tuple[torch.Tensor, torch.Tensor]":
    """(other_lse, target_logit), float32 (n,), of the float32 ``logits`` (n, V) plus ``bias``
    (targets -1: no target, every logit counts as other); and, into ``gradient`` (n, V) unless it
    is None, ``softmax - onehot``."""
    num_rows, vocab_size = logits.shape
    other_lse = torch.empty(num_rows, dtype=torch.float32, device=logits.device)
    target_logit = torch.empty_like(other_lse)
    if num_rows == 0:
        return other_lse, target_logit
    config = kernel_configs(logits.dtype).dense_rows
    softmax_gradient_kernel[(num_rows,)](
        logits, bias, targets, other_lse, target_logit, gradient, vocab_size, logits.stride(0),
        0 if gradient is None else gradient.stride(0), BLOCK_VOCAB=config.block_vocab,
        DOT_PRECISION=dot_precision(logits.dtype if gradient is None else gradient.dtype),
        num_warps=config.num_warps)
    return other_lse, target_logit


@triton.jit
def transposed_gradient_kernel(logits_ptr, bias_ptr, targets_ptr, other_lse_ptr,
                               target_logit_ptr, gradient_ptr, num_rows, vocab_size,
                               stride_logits, stride_gradient, BLOCK_ROWS: tl.constexpr,
                               BLOCK_VOCAB: tl.constexpr, DOT_PRECISION: tl.constexpr):
    rows = tl.program_id(1) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    columns = tl.program_id(0) * BLOCK_VOCAB + tl.arange(0, BLOCK_VOCAB)
    row_mask = rows < num_rows
    mask = row_mask[:, None] & (columns < vocab_size)[None, :]
    z = tl.load(logits_ptr + rows.to(tl.int64)[:, None] * stride_logits + columns[None, :],
                mask=mask, other=float("-inf"))
    if bias_ptr is not None:
        bias = tl.load(bias_ptr + columns, mask=columns < vocab_size, other=0.0)
        z += bias.to(tl.float32)[None, :]
    targets = tl.load(targets_ptr + rows, mask=row_mask, other=-1)
    other_lse = tl.load(other_lse_ptr + rows, mask=row_mask, other=0.0)
    target_logit = tl.load(target_logit_ptr + rows, mask=row_mask, other=0.0)
    g = _softmax_minus_onehot(z, columns[None, :] == targets[:, None], other_lse[:, None],
                              target_logit[:, None])
    tl.store(gradient_ptr + columns.to(tl.int64)[None, :] * stride_gradient + rows[:, None],
             round_to(g, gradient_ptr.dtype.element_ty, DOT_PRECISION), mask=mask)


def transposed_gradient(logits: torch.Tensor, bias: Optional[torch.Tensor],
                        targets: torch.Tensor, other_lse: torch.Tensor,
                        target_logit: torch.Tensor, gradient_t: torch.Tensor) -> None:
    """Into ``gradient_t`` (V, n), whose rows may be strided but whose columns are not,
    ``(softmax - onehot)^T`` of the float32 ``logits`` (n, V) plus ``bias``, from
    :func:`softmax_gradient`'s two LSE parts of each row."""
    num_rows, vocab_size = logits.shape
    if num_rows == 0:
        return
    config = kernel_configs(logits.dtype).dense_tiles
    grid = (cdiv(vocab_size, config.block_vocab), cdiv(num_rows, config.block_tokens))
    transposed_gradient_kernel[grid](
        logits, bias, targets, other_lse, target_logit, gradient_t, num_rows, vocab_size,
        logits.stride(0), gradient_t.stride(0), BLOCK_ROWS=config.block_tokens,
        BLOCK_VOCAB=config.block_vocab, DOT_PRECISION=dot_precision(gradient_t.dtype),
        num_warps=config.num_warps)
