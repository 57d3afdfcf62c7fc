"""Block sizes and launch settings of every kernel, in one place.

The Triton interpreter (CPU) runs one program at a time with numpy, so it wants few, large
programs; compiled kernels want tiles that fill the tensor cores (128-wide bf16 tiles on Hopper).
float32 inputs use exact fp32 dot products (``input_precision="ieee"``), which hold more
registers per element, so their tiles are smaller.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TileConfig:
    block_tokens: int
    block_vocab: int
    block_dim: int
    num_warps: int = 4
    num_stages: int = 2


@dataclass(frozen=True)
class KernelConfigs:
    indexed_dot: TileConfig
    lse_forward: TileConfig
    lse_backward: TileConfig


_INTERPRETER = KernelConfigs(
    indexed_dot=TileConfig(block_tokens=32, block_vocab=1, block_dim=32),
    lse_forward=TileConfig(block_tokens=32, block_vocab=128, block_dim=32),
    lse_backward=TileConfig(block_tokens=32, block_vocab=128, block_dim=32),
)
_GPU_16BIT = KernelConfigs(
    indexed_dot=TileConfig(block_tokens=32, block_vocab=1, block_dim=128),
    lse_forward=TileConfig(block_tokens=128, block_vocab=128, block_dim=64, num_warps=8,
                           num_stages=3),
    lse_backward=TileConfig(block_tokens=128, block_vocab=128, block_dim=64, num_warps=8,
                            num_stages=2),
)
_GPU_32BIT = KernelConfigs(
    indexed_dot=TileConfig(block_tokens=32, block_vocab=1, block_dim=64),
    lse_forward=TileConfig(block_tokens=64, block_vocab=64, block_dim=32, num_warps=4,
                           num_stages=2),
    lse_backward=TileConfig(block_tokens=64, block_vocab=64, block_dim=32, num_warps=4,
                            num_stages=2),
)


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def kernel_configs(dtype: torch.dtype) -> KernelConfigs:
    if interpreting():
        return _INTERPRETER
    return _GPU_32BIT if dtype == torch.float32 else _GPU_16BIT


def dot_precision(dtype: torch.dtype) -> str:
    """How tl.dot multiplies: exact fp32 products for fp32 inputs (tf32 would cost ~1e-3
    relative error); "upcast" works around the interpreter's bfloat16 dot."""
    if dtype == torch.float32:
        return "ieee"
    if dtype == torch.bfloat16 and interpreting():
        return "upcast"
    return "tf32"  # ignored by tl.dot for 16-bit inputs
