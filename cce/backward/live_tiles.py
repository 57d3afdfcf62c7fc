"""The table of tiles the backward cannot skip without looking, from the forward's bounds.

One program per token block writes its row of the table: a tile is live unless the forward's
log-probability bound of the tile is below log(filter_eps), and the tiles holding the block's
targets are live whatever their bound. One launch in place of the twenty or so elementwise
operations it takes in PyTorch: at a few thousand tokens the backward's time is mostly the
host's time to queue its kernels.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

# Table entries written per step of a program's row.
_BLOCK_COLUMNS = 1024
# The bounds come from the forward's logits, the backward's exact filter from recomputed ones,
# which can differ in their last bits: a tile within this margin (natural log) of the threshold
# is left for the exact filter to judge, so skipping tiles unseen never changes the result.
_ROUNDING_MARGIN = 2.0**-7


@triton.jit
def live_tiles_kernel(tile_bound_ptr, lse_ptr, prob_scale_ptr, target_positions_ptr, live_ptr,
                      num_tokens, num_vocab_blocks, log_filter_eps,
                      BLOCK_TOKENS: tl.constexpr, BLOCK_VOCAB: tl.constexpr,
                      BLOCK_COLUMNS: tl.constexpr):
    token_block = tl.program_id(0)
    rows = token_block * BLOCK_TOKENS + tl.arange(0, BLOCK_TOKENS)
    row_mask = rows < num_tokens
    positions = tl.load(target_positions_ptr + rows, mask=row_mask, other=-1)
    prob_scale = tl.load(prob_scale_ptr + rows, mask=row_mask, other=0.0)
    lse = tl.load(lse_ptr + rows, mask=row_mask, other=0.0)
    # Rows the bounds do not cover keep the block's whole row live: ignored tokens whose
    # probabilities carry a gradient (through the returned LSE), and LSEs that are not finite.
    uncovered = ((positions < 0) & (prob_scale != 0)) | (lse - lse != 0)
    any_uncovered = tl.max(uncovered.to(tl.int32), axis=0) != 0

    table_row = live_ptr + token_block.to(tl.int64) * num_vocab_blocks
    bound_row = tile_bound_ptr + token_block.to(tl.int64) * num_vocab_blocks
    for start in range(0, num_vocab_blocks, BLOCK_COLUMNS):
        columns = start + tl.arange(0, BLOCK_COLUMNS)
        mask = columns < num_vocab_blocks
        bound = tl.load(bound_row + columns, mask=mask, other=0.0)
        # A NaN bound keeps its tile live.
        live = (bound >= log_filter_eps) | (bound != bound) | any_uncovered
        tl.store(table_row + columns, live.to(tl.int32), mask=mask)
    # The targets' tiles are set after the bounds' verdicts on them, by other threads.
    tl.debug_barrier()
    tl.store(table_row + positions // BLOCK_VOCAB, 1, mask=row_mask & (positions >= 0))


def live_tiles(tile_bound: torch.Tensor, lse: torch.Tensor, prob_scale: torch.Tensor,
               target_positions: torch.Tensor, block_tokens: int, block_vocab: int,
               filter_eps: float) -> torch.Tensor:
    """int32 (token blocks, vocabulary blocks) table, 1 where a tile may hold a softmax entry of
    at least ``filter_eps`` and 0 where the forward's log-probability bound of the tile proves
    it cannot.

    ``tile_bound`` covers the non-ignored tokens only (see
    :func:`cce.forward.lse_forward.lse_forward`), so ignored tokens (a masked prompt) do not keep
    tiles live. An ignored token whose probabilities do carry a gradient (through the returned LSE,
    ``prob_scale != 0``) is not covered: its whole token block stays live. Tiles that hold a token's
    target are always live (their gradient has the -1 of the target). A NaN bound, or an LSE that is
    not finite, keeps the tile live, so NaN and infinite inputs still reach the gradients.
    ``target_positions``: from :func:`cce.forward.vocab_order.target_positions`.
    """
    num_token_blocks, num_vocab_blocks = tile_bound.shape
    live = torch.empty((num_token_blocks, num_vocab_blocks), dtype=torch.int32,
                       device=tile_bound.device)
    if num_token_blocks:
        # The kernel walks rows with unit strides (no copy for the backward's own tensors).
        live_tiles_kernel[(num_token_blocks,)](
            tile_bound.contiguous(), lse.contiguous(), prob_scale.float().contiguous(),
            target_positions.contiguous(), live, lse.shape[0],
            num_vocab_blocks, math.log(filter_eps) - _ROUNDING_MARGIN, BLOCK_TOKENS=block_tokens,
            BLOCK_VOCAB=block_vocab, BLOCK_COLUMNS=_BLOCK_COLUMNS)
    return live
