"""Block sizes and launch settings of every kernel, in one place.

``live_grid`` is the tile grid of the backward: the forward records one bound per tile of it
(its own tiles are whole rows of the grid), the backward recomputes, stores and multiplies whole
tiles of it.

The Triton interpreter (CPU) runs one program at a time with numpy: it wants few, large
programs. float32 inputs use exact fp32 dot products (``input_precision="ieee"``), which hold
more registers per element, so their tiles are smaller.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass, replace

import torch


@dataclass(frozen=True)
class KernelConfig:
    """Block sizes and launch settings of one kernel; 0 = not a parameter of that kernel (the
    backward's tiles are the live grid's)."""

    block_tokens: int = 0
    block_vocab: int = 0
    block_dim: int = 0  # D slice of each logit-tile product
    block_out: int = 0  # backward: columns of dE / dC that one program owns
    step_depth: int = 0  # products: entries of the summed dimension per loop step (0: a tile)
    num_warps: int = 4
    num_stages: int = 2


@dataclass(frozen=True)
class KernelConfigs:
    indexed_dot: KernelConfig
    lse_forward: KernelConfig
    live_grid: KernelConfig  # tiles of the live-tile table (block_tokens x block_vocab)
    gradient_tiles: KernelConfig  # block_dim, warps and stages; the tiles are the live grid's
    softcap_listed_gradient_tiles: KernelConfig  # pass 2's recompute (tiles by list), softcap
    sparse_tile_matmul: KernelConfig  # block_out, warps and stages; rows are the live grid's
    # Pass 1's dE product when every token, vocabulary and output block is whole (no masks):
    # step depth, warps and stages (block_out as above). step_depth 0: the product above only.
    whole_block_embeddings_product: KernelConfig
    # The dC product on Hopper GPUs (cce.backward.classifier_product): step depth (0: not used),
    # warps of its consumer and stages.
    classifier_product: KernelConfig
    # The one pass's dE product on Hopper GPUs where c's rows lie in position order
    # (cce.backward.embeddings_product): step depth (0: not used), consumer warps and stages.
    embeddings_product: KernelConfig
    # How tl.dot multiplies the inputs (:func:`dot_precision`); :func:`kernel_configs` sets it.
    dot_precision: str = "tf32"
    # The dense path's pass over a row of float32 logits (cce.dense.softmax_gradient).
    dense_rows: KernelConfig = KernelConfig(block_vocab=2048, num_warps=4)
    # Its tiles of G^T where G is kept in dC's memory (cce.dense.softmax_gradient).
    dense_tiles: KernelConfig = KernelConfig(block_tokens=128, block_vocab=64, num_warps=4)

    def __post_init__(self):
        grid = self.live_grid
        if (self.lse_forward.block_tokens != grid.block_tokens
                or self.lse_forward.block_vocab not in (grid.block_vocab, 2 * grid.block_vocab)):
            raise ValueError("the forward's tiles must be one or two live-grid tiles")


def _small_backward(depth: int, columns: int) -> dict:
    """The backward's settings without the Hopper products: ``depth``-deep recompute slices,
    ``columns`` output columns per product program."""
    return {"gradient_tiles": KernelConfig(block_dim=depth),
            "softcap_listed_gradient_tiles": KernelConfig(block_dim=depth),
            "sparse_tile_matmul": KernelConfig(block_out=columns),
            "classifier_product": KernelConfig(), "embeddings_product": KernelConfig()}


# The interpreter runs each program's operations one by one in numpy: 64-deep slices and 128
# output columns per product program take a third less of the test suite's kernel time than
# 32 and 64 (the GPU's float32 settings).
_INTERPRETER = KernelConfigs(
    indexed_dot=KernelConfig(block_tokens=32, block_vocab=1, block_dim=64),
    lse_forward=KernelConfig(block_tokens=32, block_vocab=256, block_dim=64),
    live_grid=KernelConfig(block_tokens=32, block_vocab=128),
    whole_block_embeddings_product=KernelConfig(step_depth=64),
    **_small_backward(depth=64, columns=128),
)
_GPU_16BIT = KernelConfigs(
    indexed_dot=KernelConfig(block_tokens=32, block_vocab=1, block_dim=128),
    # 128 x 256 forward tiles: 20% faster than 128 x 128 on an H200 (docs/notes/forward.md).
    lse_forward=KernelConfig(block_tokens=128, block_vocab=256, block_dim=64, num_warps=8,
                             num_stages=3),
    live_grid=KernelConfig(block_tokens=128, block_vocab=128),
    # 4 warps: 13-19% faster recomputes than 8 on an H200 (docs/notes/backward.md), probably
    # because two programs then share an SM and one's exp-filter-store overlaps the other's
    # products.
    gradient_tiles=KernelConfig(block_dim=64, num_warps=4, num_stages=3),
    # With a softcap, 4 warps spill 240-300 registers in pass 2's recompute and 8 spill none:
    # 10.4 -> 8.4 ms at the 2B shape; without one 8 warps are 11-35% slower (H100,
    # docs/notes/backward.md).
    softcap_listed_gradient_tiles=KernelConfig(block_dim=64, num_warps=8, num_stages=3),
    # 256 output columns, 2 stages: 14-20% faster than 128 columns with 3 or 4 stages
    # (docs/notes/backward.md).
    sparse_tile_matmul=KernelConfig(block_out=256, num_warps=8, num_stages=2),
    # Two 64-deep steps per tile and 7 stages: faster for this product only, and only without
    # masks (docs/notes/backward.md, "Shallower steps").
    whole_block_embeddings_product=KernelConfig(step_depth=64, num_warps=8, num_stages=7),
    # Rows of e by TMA, 64-deep steps in 4 stages (docs/notes/backward.md, "What feeds the
    # products").
    classifier_product=KernelConfig(step_depth=64, num_warps=8, num_stages=4),
    # Rows of c by TMA, 64-deep steps in 3 stages (results/dev/h200_gluon_de_product.json).
    embeddings_product=KernelConfig(step_depth=64, num_warps=8, num_stages=3),
)
# float32 on a GPU: smaller tiles (exact fp32 products hold more registers).
_GPU_32BIT = KernelConfigs(
    indexed_dot=KernelConfig(block_tokens=32, block_vocab=1, block_dim=64),
    lse_forward=KernelConfig(block_tokens=64, block_vocab=64, block_dim=32),
    live_grid=KernelConfig(block_tokens=64, block_vocab=64),
    whole_block_embeddings_product=KernelConfig(),
    **_small_backward(depth=32, columns=64),
)

# Forward programs per streaming multiprocessor: enough to hide the tail of uneven waves,
# few enough that each program amortizes its one lock acquisition over many tiles.
_FORWARD_PROGRAMS_PER_SM = 8
# The forward copies c into position order (for tile products by tensor descriptor) from this
# many tokens: the copy costs about as much as it saves at 2048 on an H200
# (cce.forward.lse_forward.classifier_by_position).
_COPY_CLASSIFIER_MIN_TOKENS = 4096
# Deterministic mode's bounds read the LSE of the head of the vocabulary order, computed first in
# a launch of its own, instead of other programs' merges: this many forward tiles (8192
# positions), which hold most of the mass; real text needs more of them than synthetic inputs
# (results/dev/h200_deterministic_head_sweep.json).
_DETERMINISTIC_HEAD_BLOCKS = 32
# A forward program's tile bounds rest on the LSE of its own earlier tiles (and on what others
# have merged, which on a small problem is nothing yet): fewer tiles per program, looser bounds.
_MIN_BLOCKS_PER_RECORDING_PROGRAM = 8


# The dense path's float32 logits are computed this many bytes at a time (whole rows).
_DENSE_SCRATCH_BYTES = 256 * 2**20
# Where the dense path keeps G in dC's memory, the last rows of G^T are copied out from this size
# down, rather than written over in ever smaller segments (cce.dense.loss).
DENSE_IN_PLACE_TAIL_BYTES = 8 * 2**20
# memory="fast" takes the dense path up to this vocabulary size: above it enough tiles are
# negligible for the filtering backward with kept tiles to be faster (docs/notes/backward.md,
# "The dense path").
DENSE_MAX_VOCAB = 65536


def dense_chunk_tokens(vocab_size: int) -> int:
    """Tokens per chunk of the dense path's float32 logits."""
    return max(1, _DENSE_SCRATCH_BYTES // (4 * vocab_size))


# Read once, when cce is imported: Triton decides when a kernel is decorated, at import, and the
# question is asked several hundred times per loss call. A constant, which torch.compile reads
# without tracing a cache (a functools.cache here made Dynamo warn on every compile).
_INTERPRETING = os.environ.get("TRITON_INTERPRET", "0") == "1"


def interpreting() -> bool:
    """Whether Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1``, which only
    the user sets, before importing cce and triton)."""
    return _INTERPRETING


# The dtypes the kernels take (float64 goes to the PyTorch paths).
KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def kernels_run_on(device: torch.device) -> bool:
    """Whether cce's Triton kernels can take tensors on ``device``: CUDA tensors, and CPU
    tensors when Triton's interpreter is on."""
    return device.type == "cuda" or (device.type == "cpu" and interpreting())


def kernels_take(e: torch.Tensor) -> bool:
    """Whether cce's Triton kernels take the embeddings ``e``: their device and their dtype."""
    return kernels_run_on(e.device) and e.dtype in KERNEL_DTYPES


def check_interpreter_usable() -> None:
    """Raise when the interpreter is on but cannot run cce's kernels: Triton was imported before
    ``TRITON_INTERPRET=1`` was set, so Triton's own language functions (``tl.max``, ``tl.sum``,
    ...) were built for a GPU, and every kernel would stop on them with an error that does not
    say why."""
    if interpreting() and not _triton_language_interpreted():
        raise RuntimeError(
            "TRITON_INTERPRET=1 asks cce to run its kernels in Triton's CPU interpreter, but "
            "triton was imported before the variable was set, so its language functions "
            "cannot run in the interpreter. Set TRITON_INTERPRET=1 before anything imports "
            "triton (in the environment), or leave it unset: CPU tensors then take the PyTorch "
            "path (impl='cce_torch').")


@functools.cache
def _triton_language_interpreted() -> bool:
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(tl.max, InterpretedFunction)


def kernel_configs(dtype: torch.dtype) -> KernelConfigs:
    """The kernels' settings for inputs of ``dtype`` (those of the kernels' dtypes built once,
    at import: this is asked several times per loss call)."""
    configs = _CONFIGS_BY_DTYPE.get(dtype)
    return configs if configs is not None else _configs_for(dtype)


def _configs_for(dtype: torch.dtype) -> KernelConfigs:
    if interpreting():
        configs = _INTERPRETER
    else:
        configs = _GPU_32BIT if dtype == torch.float32 else _GPU_16BIT
    return replace(configs, dot_precision=dot_precision(dtype))


def copy_classifier_min_tokens() -> int:
    """From how many tokens the forward reads a sorted copy of c (any number in the interpreter,
    so that the tests run that path)."""
    return 0 if interpreting() else _COPY_CLASSIFIER_MIN_TOKENS


def deterministic_head_blocks(num_vocab_blocks: int) -> int:
    """Forward tiles of the head launch in deterministic mode (one in the interpreter, so that
    the tests' small vocabularies run both launches)."""
    return min(1 if interpreting() else _DETERMINISTIC_HEAD_BLOCKS, num_vocab_blocks)


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` of host integers. (``triton.cdiv`` is a constexpr function: each host
    call costs microseconds, and the backward plans dozens of them while the GPU waits.)"""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The least power of 2 at least ``n`` (0 for 0), as ``triton.next_power_of_2``."""
    return 1 << (n - 1).bit_length() if n > 0 else 0


@functools.lru_cache(maxsize=None)
def multiprocessor_count(device: torch.device) -> int:
    """The SMs of a CUDA device (looked up once per device)."""
    return torch.cuda.get_device_properties(device).multi_processor_count


def forward_vocab_splits(num_token_blocks: int, num_vocab_blocks: int, device: torch.device,
                         records_bounds: bool) -> int:
    """How many programs share one token block's vocabulary in the forward."""
    if interpreting():
        return min(2, num_vocab_blocks)  # still exercises the cross-program LSE merge
    sm_count = multiprocessor_count(device)
    wanted = cdiv(_FORWARD_PROGRAMS_PER_SM * sm_count, num_token_blocks)
    splits = max(1, min(num_vocab_blocks, wanted))
    if records_bounds:
        splits = min(splits, cdiv(num_vocab_blocks, _MIN_BLOCKS_PER_RECORDING_PROGRAM))
    return splits


# Split a product's lists among more programs while it has fewer than this many per SM, within
# a memory budget for the float32 partial sums (part of the backward's 16 MB of slack), or
# within memory the backward owns anyway when it has some to spare (``room_bytes``).
_PRODUCT_PROGRAMS_PER_SM = 2
_PARTIAL_SUM_BYTES = 8 * 2**20


def split_count(programs: int, bytes_per_split: int, device: torch.device,
                room_bytes: int = 0) -> int:
    """How many programs share each output block of a backward product (split-K)."""
    if interpreting():
        return 2 if programs < 4 else 1  # still exercises the partial sums
    sm_count = multiprocessor_count(device)
    wanted = _PRODUCT_PROGRAMS_PER_SM * sm_count // programs
    return max(1, min(wanted, max(_PARTIAL_SUM_BYTES, room_bytes) // bytes_per_split))


def sm_utilization(programs: int, device: torch.device) -> float:
    """Fraction of the SMs busy over the waves of a launch of ``programs`` equal programs, one
    per SM at a time (the products hold a whole SM's shared memory)."""
    if interpreting():
        return 1.0
    sm_count = multiprocessor_count(device)
    return programs / (cdiv(programs, sm_count) * sm_count)


# Pass 2 of the backward stores its chunks in the free rows of dC; once fewer rows are free
# than this buffer holds, the rest of the vocabulary goes through it (part of the 16 MB slack).
SPARE_SCRATCH_BYTES = 8 * 2**20
# Pass 1 stores its chunks in dC's memory; without dC (or with too little of it) it gets a buffer
# of its own, of about this size.
DEDICATED_SCRATCH_BYTES = 64 * 2**20
# Pass 1 stores live tiles in slots where chunks of whole rows of the grid would hold fewer
# tokens than this (cce.backward.plan._live_tiles_in_slots): faster at 512 (D = 640), slower
# from 2176 (D = 2304) on; the sizes between were not measured.
SLOT_CHUNK_TOKENS = 1024


def whole_waves(blocks: int, programs_per_block: int, device: torch.device) -> int:
    """At most ``blocks`` output blocks, as many as fill whole waves of programs over the SMs
    when there is more than one wave (a last, partial wave runs at a fraction of the GPU)."""
    if interpreting():
        return blocks
    sm_count = multiprocessor_count(device)
    waves = blocks * programs_per_block // sm_count
    return max(1, waves * sm_count // programs_per_block) if waves else blocks


def tma_copies_rows(x: torch.Tensor) -> bool:
    """Whether the tensor memory accelerator (TMA) can copy blocks of rows of the matrix ``x``:
    unit stride along a row, a 16-byte aligned start and row stride."""
    return (x.stride(1) == 1 and (x.stride(0) * x.element_size()) % 16 == 0
            and x.data_ptr() % 16 == 0)


def dot_precision(dtype: torch.dtype) -> str:
    """How tl.dot multiplies: exact fp32 products for fp32 inputs (tf32 would cost ~1e-3
    relative error); "upcast" works around the interpreter's bfloat16 dot."""
    if dtype == torch.float32:
        return "ieee"
    if dtype == torch.bfloat16 and interpreting():
        return "upcast"
    return "tf32"  # ignored by tl.dot for 16-bit inputs


_CONFIGS_BY_DTYPE = {dtype: _configs_for(dtype)
                     for dtype in (torch.float32, torch.bfloat16, torch.float16)}
