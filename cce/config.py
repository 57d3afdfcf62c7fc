"""Block sizes and launch settings of every kernel, in one place.

``live_grid`` is the grid of the live-tile table that the forward records and the backward
kernels read: the forward's tiles are whole rows of it and the backward's blocks divide it. Each
backward program accumulates a (block_tokens or block_vocab) x block_out float32 slice of dE or
dC in registers and recomputes a logit tile for every block_out columns, so a wider block_out
means less recompute but more registers.

The Triton interpreter (CPU) runs one program at a time with numpy: it wants few, large
programs. float32 inputs use exact fp32 dot products (``input_precision="ieee"``), which hold
more registers per element, so their tiles are smaller.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class KernelConfig:
    block_tokens: int
    block_vocab: int
    block_dim: int  # D slice of each logit-tile product
    block_out: int = 0  # backward: columns of dE / dC that one program owns
    num_warps: int = 4
    num_stages: int = 2


@dataclass(frozen=True)
class KernelConfigs:
    indexed_dot: KernelConfig
    lse_forward: KernelConfig
    live_grid: KernelConfig  # tiles of the live-tile table (block_tokens x block_vocab)
    backward_embeddings: KernelConfig
    backward_classifier: KernelConfig

    def __post_init__(self):
        grid = self.live_grid
        if (self.lse_forward.block_tokens != grid.block_tokens
                or self.lse_forward.block_vocab % grid.block_vocab):
            raise ValueError("the forward's tiles must be whole rows of live-grid tiles")
        for name in ("backward_embeddings", "backward_classifier"):
            config = getattr(self, name)
            if grid.block_tokens % config.block_tokens or grid.block_vocab % config.block_vocab:
                raise ValueError(f"{name} blocks must divide the live-tile grid")


_INTERPRETER = KernelConfigs(
    indexed_dot=KernelConfig(block_tokens=32, block_vocab=1, block_dim=32),
    lse_forward=KernelConfig(block_tokens=32, block_vocab=256, block_dim=32),
    live_grid=KernelConfig(block_tokens=32, block_vocab=128, block_dim=0),
    backward_embeddings=KernelConfig(block_tokens=32, block_vocab=128, block_dim=32,
                                     block_out=64),
    backward_classifier=KernelConfig(block_tokens=32, block_vocab=64, block_dim=32,
                                     block_out=64),
)
_GPU_16BIT = KernelConfigs(
    indexed_dot=KernelConfig(block_tokens=32, block_vocab=1, block_dim=128),
    # 128 x 256 forward tiles: 20% faster than 128 x 128 on an H200 (NOTES.md).
    lse_forward=KernelConfig(block_tokens=128, block_vocab=256, block_dim=64, num_warps=8,
                             num_stages=3),
    live_grid=KernelConfig(block_tokens=128, block_vocab=128, block_dim=0),
    backward_embeddings=KernelConfig(block_tokens=64, block_vocab=128, block_dim=64,
                                     block_out=256, num_warps=8, num_stages=3),
    backward_classifier=KernelConfig(block_tokens=128, block_vocab=64, block_dim=64,
                                     block_out=256, num_warps=8, num_stages=3),
)
_GPU_32BIT = KernelConfigs(
    indexed_dot=KernelConfig(block_tokens=32, block_vocab=1, block_dim=64),
    lse_forward=KernelConfig(block_tokens=64, block_vocab=64, block_dim=32),
    live_grid=KernelConfig(block_tokens=64, block_vocab=64, block_dim=0),
    backward_embeddings=KernelConfig(block_tokens=64, block_vocab=64, block_dim=32,
                                     block_out=64),
    backward_classifier=KernelConfig(block_tokens=64, block_vocab=64, block_dim=32,
                                     block_out=64),
)

# Forward programs per streaming multiprocessor: enough to hide the tail of uneven waves,
# few enough that each program amortizes its one lock acquisition over many tiles.
_FORWARD_PROGRAMS_PER_SM = 8


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def kernel_configs(dtype: torch.dtype) -> KernelConfigs:
    if interpreting():
        return _INTERPRETER
    return _GPU_32BIT if dtype == torch.float32 else _GPU_16BIT


def forward_vocab_splits(num_token_blocks: int, num_vocab_blocks: int,
                         device: torch.device) -> int:
    """How many programs share one token block's vocabulary in the forward."""
    if interpreting():
        return min(2, num_vocab_blocks)  # still exercises the cross-program LSE merge
    sm_count = torch.cuda.get_device_properties(device).multi_processor_count
    wanted = -(-_FORWARD_PROGRAMS_PER_SM * sm_count // num_token_blocks)  # ceiling division
    return max(1, min(num_vocab_blocks, wanted))


def dot_precision(dtype: torch.dtype) -> str:
    """How tl.dot multiplies: exact fp32 products for fp32 inputs (tf32 would cost ~1e-3
    relative error); "upcast" works around the interpreter's bfloat16 dot."""
    if dtype == torch.float32:
        return "ieee"
    if dtype == torch.bfloat16 and interpreting():
        return "upcast"
    return "tf32"  # ignored by tl.dot for 16-bit inputs
