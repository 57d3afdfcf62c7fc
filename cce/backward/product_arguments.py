"""What a product launch takes (:mod:`cce.backward.sparse_tile_matmul`): its settings, decided
by the backward's plan, and the kernel's two grouped arguments, the tiles and the operand with the
outputs. The Triton kernel and the Hopper dC kernel (:mod:`cce.backward.classifier_product`)
take the same ones."""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from cce.backward.scratch import ScratchView
from cce.config import KernelConfig


class ProductTiles(NamedTuple):
    """The tiles a product launch multiplies, as the kernel takes them: the scratch holding
    them; per output block (``num_out_blocks`` of them from ``first_block``), the list of the
    other blocks whose tiles it sums (``counts`` long, rows ``list_stride`` apart); where the
    tiles are (``first_slots`` and ``slot_map``, or None: see
    :class:`cce.backward.sparse_tile_matmul.Product`)."""

    scratch: ScratchView
    lists: torch.Tensor
    counts: torch.Tensor
    list_stride: int
    first_slots: Optional[torch.Tensor]
    slot_map: Optional[torch.Tensor]
    chunk_vocab_blocks: int
    first_block: int
    num_out_blocks: int


class ProductIO(NamedTuple):
    """The operand a product launch multiplies the tiles with (c or e, read through
    ``vocab_order`` where sorted), what it writes (the output, float32 partial sums when
    split, the bias gradient) and the sizes."""

    operand: torch.Tensor
    operand_strides: "tuple[int, int]"
    vocab_order: Optional[torch.Tensor]
    out: torch.Tensor
    partial: Optional[torch.Tensor]
    grad_bias: Optional[torch.Tensor]
    num_tokens: int
    vocab_size: int
    dim: int


class ProductSettings(NamedTuple):
    """How one product launch runs, as the backward's plan decided it (:mod:`cce.backward.plan`):
    the live grid's tiles, the configuration its warps, stages and step depth come from, the
    output columns per program, the programs per output block (``splits``, dE only), whether
    every token, vocabulary and output block is whole (no masks, shallower steps), and whether
    a Hopper kernel runs it (:mod:`cce.backward.classifier_product` for dC,
    :mod:`cce.backward.embeddings_product` for the one pass's dE); how tl.dot multiplies
    (:func:`cce.config.dot_precision`)."""

    grid: KernelConfig
    config: KernelConfig
    block_out: int
    dot_precision: str
    splits: int = 1
    whole_blocks: bool = False
    by_tma: bool = False
