"""The launch both backward kernels share: same inputs, same flags, same live-tile grid."""

from __future__ import annotations

from typing import Optional

import torch
import triton

from cce.config import KernelConfig, dot_precision, kernel_configs


def launch_backward(kernel, config: KernelConfig, block_out: int, grid: "tuple[int]",
                    outputs: "tuple[torch.Tensor, ...]", e: torch.Tensor, c: torch.Tensor,
                    targets: torch.Tensor, bias: Optional[torch.Tensor],
                    softcap: Optional[float], lse: torch.Tensor, prob_scale: torch.Tensor,
                    target_scale: torch.Tensor, vocab_order: Optional[torch.Tensor],
                    live_tiles: Optional[torch.Tensor], filter_eps: Optional[float]) -> None:
    """Launch a backward kernel whose arguments are the shared inputs, then ``outputs``."""
    live_grid = kernel_configs(e.dtype).live_grid
    num_tokens, dim = e.shape
    vocab_size = c.shape[0]
    kernel[grid](
        e, c, bias, targets, lse, prob_scale, target_scale, vocab_order, live_tiles, *outputs,
        num_tokens, vocab_size, dim, triton.cdiv(vocab_size, live_grid.block_vocab),
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
