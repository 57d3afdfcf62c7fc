"""Device functions shared by the forward and backward kernels: one logit tile, computed on-chip.

A tile is ``z = softcap(E[rows] @ C[vocab].T + bias[vocab])`` for BLOCK_TOKENS rows and
BLOCK_VOCAB vocabulary entries, accumulated in float32 over D in BLOCK_DIM slices. ``vocab``
holds vocabulary indices, not positions, so the backward can walk the vocabulary in sorted
order without reordering ``c`` in memory. The kernels take what a tile reads as one argument,
:class:`LogitOperands`.
"""

from typing import NamedTuple, Optional

import torch
import triton
import triton.language as tl

LOG2_E = tl.constexpr(1.4426950408889634)  # exp(x) = exp2(x * LOG2_E)


class LogitOperands(NamedTuple):
    """What a logit tile reads, as the kernels take it (one argument): the tensors, the sizes,
    the strides, and the optional parts, None where absent (a kernel tests for None as it
    compiles: no bias, no sorting, no softcap; :func:`logit_operands`). The strides are
    fields of their own: read in a loop, a nested tuple's element specialized to 1 can read
    None in Triton 3.6."""

    e: torch.Tensor
    c: torch.Tensor
    num_tokens: int
    vocab_size: int
    dim: int
    stride_e_row: int
    stride_e_dim: int
    stride_c_row: int
    stride_c_dim: int
    bias: Optional[torch.Tensor]
    vocab_order: Optional[torch.Tensor]
    softcap: Optional[float]


def logit_operands(e: torch.Tensor, c: torch.Tensor, bias: Optional[torch.Tensor],
                   vocab_order: Optional[torch.Tensor],
                   softcap: Optional[float]) -> LogitOperands:
    """The tiles' view of ``z = softcap(e @ c[vocab_order].T + bias)``."""
    return LogitOperands(e=e, c=c, num_tokens=e.shape[0], vocab_size=c.shape[0], dim=e.shape[1],
                         stride_e_row=e.stride(0), stride_e_dim=e.stride(1),
                         stride_c_row=c.stride(0), stride_c_dim=c.stride(1), bias=bias,
                         vocab_order=vocab_order, softcap=softcap)


# tanh's odd Taylor series, x + x^3 * (T3 + x^2 * (T5 + ...)): -1/3, 2/15, -17/315, ...
TANH_SERIES_BELOW = tl.constexpr(0.4)
T3 = tl.constexpr(-1 / 3)
T5 = tl.constexpr(2 / 15)
T7 = tl.constexpr(-17 / 315)
T9 = tl.constexpr(62 / 2835)
T11 = tl.constexpr(-1382 / 155925)
T13 = tl.constexpr(21844 / 6081075)


@triton.jit
def tanh(x):
    """tanh in float32 to within a few units in the last place for every x, compiled and in
    the interpreter (tl has no tanh that runs in both). From |x| = 0.4 up it is
    1 - 2 / (exp(2|x|) + 1), which saturates cleanly to 1; below, where that difference cancels
    (so did 2 sigmoid(2x) - 1: a softcap of 1e5 cost the loss 8e-4), the series to x^13 is
    within 0.6 units."""
    magnitude = tl.abs(x)
    saturating = 1.0 - 2.0 / (tl.exp(2.0 * magnitude) + 1.0)
    saturating = tl.where(x < 0, -saturating, saturating)
    x2 = x * x
    series = x + x * x2 * (T3 + x2 * (T5 + x2 * (T7 + x2 * (T9 + x2 * (T11 + x2 * T13)))))
    return tl.where(magnitude < TANH_SERIES_BELOW, series, saturating)


@triton.jit
def tile_dot(a, b, acc, DOT_PRECISION: tl.constexpr):
    if DOT_PRECISION == "upcast":
        # The Triton interpreter multiplies bfloat16 bit patterns as integers; float32 products
        # of bfloat16 values are exact, so upcasting gives the compiled kernel's result.
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    return tl.dot(a, b, acc, input_precision=DOT_PRECISION)


@triton.jit
def round_to(x, dtype, DOT_PRECISION: tl.constexpr):
    """``x.to(dtype)``, rounding to nearest even also in the interpreter (DOT_PRECISION
    "upcast"), whose float32 -> bfloat16 conversion truncates."""
    if DOT_PRECISION == "upcast":
        if dtype == tl.bfloat16:  # not for float32 outputs of bfloat16 products
            bits = x.to(tl.uint32, bitcast=True)
            bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
            x = bits.to(tl.float32, bitcast=True)  # exact in bfloat16 now: truncation is exact
    return x.to(dtype)


@triton.jit
def vocab_block_entries(vocab_order_ptr, vocab_block, entries, vocab_size,
                        BLOCK_VOCAB: tl.constexpr, SORTED: tl.constexpr,
                        WHOLE_BLOCKS: tl.constexpr = False):
    """Vocabulary indices of the given ``entries`` (offsets in the block, e.g. all of them:
    ``tl.arange(0, BLOCK_VOCAB)``) of one block of positions (positions of ``vocab_order`` when
    sorting), and the mask of those inside the vocabulary (all true, folded away, when every
    block is whole: ``WHOLE_BLOCKS``)."""
    positions = vocab_block * BLOCK_VOCAB + entries
    vocab_mask = (positions < vocab_size) | WHOLE_BLOCKS
    if SORTED:
        vocab = tl.load(vocab_order_ptr + positions, mask=vocab_mask, other=0)
    else:
        vocab = positions
    return vocab, vocab_mask


@triton.jit
def holds_padding(vocab_block, vocab_size, BLOCK_VOCAB: tl.constexpr):
    """Whether a block of vocabulary positions runs past the vocabulary (only the last can):
    the other blocks skip masking their padding entry by entry."""
    return (vocab_block + 1) * BLOCK_VOCAB > vocab_size


@triton.jit
def logit_tile(operands, rows, row_mask, vocab, vocab_mask, BLOCK_TOKENS: tl.constexpr,
               BLOCK_VOCAB: tl.constexpr, BLOCK_DIM: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Logits of one (tokens x vocabulary) tile in float32 (``operands``:
    :class:`LogitOperands`); masked entries hold garbage-free 0s before the bias/softcap, so
    callers must mask them themselves."""
    logits = tile_product(operands, rows, row_mask, vocab, vocab_mask,
                          BLOCK_TOKENS, BLOCK_VOCAB, BLOCK_DIM, DOT_PRECISION)
    return finish_logits(logits, operands, vocab, vocab_mask)


@triton.jit
def tile_product(operands, rows, row_mask, vocab, vocab_mask, BLOCK_TOKENS: tl.constexpr,
                 BLOCK_VOCAB: tl.constexpr, BLOCK_DIM: tl.constexpr,
                 DOT_PRECISION: tl.constexpr):
    """``E[rows] @ C[vocab].T`` in float32, rows of c gathered through ``vocab``."""
    offsets_dim = tl.arange(0, BLOCK_DIM)
    e_rows = operands.e + rows.to(tl.int64)[:, None] * operands.stride_e_row
    c_rows = operands.c + vocab.to(tl.int64)[:, None] * operands.stride_c_row
    stride_e_dim = operands.stride_e_dim
    stride_c_dim = operands.stride_c_dim
    dim = operands.dim
    logits = tl.zeros((BLOCK_TOKENS, BLOCK_VOCAB), dtype=tl.float32)
    for dim_start in range(0, dim, BLOCK_DIM):
        dims = dim_start + offsets_dim
        dim_mask = dims < dim
        e_block = tl.load(e_rows + dims[None, :] * stride_e_dim,
                          mask=row_mask[:, None] & dim_mask[None, :], other=0.0)
        c_block = tl.load(c_rows + dims[None, :] * stride_c_dim,
                          mask=vocab_mask[:, None] & dim_mask[None, :], other=0.0)
        logits = tile_dot(e_block, tl.trans(c_block), logits, DOT_PRECISION)
    return logits


@triton.jit
def tile_product_by_descriptor(e_desc, c_desc, first_row, first_c_row, dim,
                               BLOCK_DIM: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """The same product from tensor descriptors: a block of rows of e and one of *consecutive*
    rows of c (a sorted copy of c when sorting), each slice one bulk copy (TMA on Hopper), with
    zeros past the tensors' ends."""
    BLOCK_TOKENS: tl.constexpr = e_desc.block_shape[0]
    BLOCK_VOCAB: tl.constexpr = c_desc.block_shape[0]
    logits = tl.zeros((BLOCK_TOKENS, BLOCK_VOCAB), dtype=tl.float32)
    for dim_start in range(0, dim, BLOCK_DIM):
        e_block = e_desc.load([first_row, dim_start])
        c_block = c_desc.load([first_c_row, dim_start])
        logits = tile_dot(e_block, tl.trans(c_block), logits, DOT_PRECISION)
    return logits


@triton.jit
def finish_logits(logits, operands, vocab, vocab_mask):
    """A tile product's logits with ``operands``' bias added and softcap applied."""
    if operands.bias is not None:
        logits += tl.load(operands.bias + vocab, mask=vocab_mask,
                          other=0.0).to(tl.float32)[None, :]
    if operands.softcap is not None:
        logits = operands.softcap * tanh(logits / operands.softcap)
    return logits


@triton.jit
def logit_gradient_tile(
    operands, e_desc, c_desc, first_row, rows, row_mask, vocab_block, vocab, vocab_mask,
    BLOCK_TOKENS: tl.constexpr, BLOCK_VOCAB: tl.constexpr, BLOCK_DIM: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Recompute one tile and return (gradient of the pre-softcap logits in float32, keep, the
    softmax mass of each row's non-target entries in the tile), from ``operands``
    (:class:`cce.backward.gradient_tiles.TileOperands`), reading e and c's rows in position
    order by ``e_desc`` and ``c_desc`` where given (:func:`tile_product_by_descriptor`), else
    gathering c's rows. ``rows``: the tile's (from ``first_row``); ``vocab_block``: its block of
    vocabulary positions (``vocab`` = the entries at them).

    The gradient is ``prob_scale[i] * softmax_ij`` off the target and ``target_entry[i]`` at it
    (:func:`cce.weighting.target_entry`: computed from ``1 - p_t``, which a tile's
    ``exp(z_t - lse) - 1`` would give only to the LSE's last bits), times the softcap
    derivative. ``keep`` is False when gradient filtering proves the tile negligible:
    every entry of ``softmax - onehot`` (on rows with a gradient) is below ``filter_eps``.

    Label smoothing (``operands.uniform``, :mod:`cce.weighting`): the gradient also has the term
    ``uniform.scale[i] * uniform.weight[j]`` (weights 1 without them), times the softcap
    derivative, whose rank-one part the products add in closed form. With a softcap the tile
    holds the rest, ``-uniform.scale[i] * uniform.weight[j] * (tanh^2 -
    uniform.curvature_mean[i])``, which sums to 0 over the row: a skipped tile drops only its
    deviation from the mean.

    The entropy (``operands.entropy``, :class:`cce.weighting.EntropyTerm`): off the target, the
    entry's softmax factor is ``prob_scale[i] + entropy.scale[i] * (z_ij -
    entropy.mean_logit[i])`` (the target's term is in ``target_entry``).
    """
    HAS_SOFTCAP: tl.constexpr = operands.logits.softcap is not None
    ENTROPY: tl.constexpr = operands.entropy.scale is not None
    softcap = operands.logits.softcap
    # The rows' values are loaded before the tile's products, which hide their latency.
    lse = tl.load(operands.lse + rows, mask=row_mask, other=0.0)
    prob_scale = tl.load(operands.prob_scale + rows, mask=row_mask, other=0.0)
    target_entry = tl.load(operands.target_entry + rows, mask=row_mask, other=0.0)
    target_positions = tl.load(operands.target_positions + rows, mask=row_mask, other=-1)
    if c_desc is not None:
        logits = finish_logits(
            tile_product_by_descriptor(e_desc, c_desc, first_row, vocab_block * BLOCK_VOCAB,
                                       operands.logits.dim, BLOCK_DIM, DOT_PRECISION),
            operands.logits, vocab, vocab_mask)
    else:
        logits = logit_tile(operands.logits, rows, row_mask, vocab, vocab_mask,
                            BLOCK_TOKENS, BLOCK_VOCAB, BLOCK_DIM, DOT_PRECISION)

    # Every operation per entry counts here (the tile's products are short at small D): rows
    # without a softmax gradient get an infinite LSE instead of a select per entry, so that
    # their probabilities are 0 (NaN where their logits are, as in PyTorch). A row whose LSE is
    # +inf (an infinite logit) gets NaN probabilities, as torch.softmax gives it.
    row_lse = tl.where(lse == float("inf"), float("nan"), lse)
    has_softmax = prob_scale != 0.0
    if ENTROPY:
        entropy_scale = tl.load(operands.entropy.scale + rows, mask=row_mask, other=0.0)
        mean_logit = tl.load(operands.entropy.mean_logit + rows, mask=row_mask, other=0.0)
        has_softmax |= entropy_scale != 0.0
    scaled_lse = tl.where(has_softmax, row_lse, float("inf")) * LOG2_E
    # exp(z - lse) as exp2(z * log2(e) - lse * log2(e)): one fused multiply-add per entry.
    probs = tl.exp2(logits * LOG2_E - scaled_lse[:, None])
    if holds_padding(vocab_block, operands.logits.vocab_size, BLOCK_VOCAB):
        probs = tl.where(vocab_mask[None, :], probs, 0.0)
    first_position = vocab_block * BLOCK_VOCAB
    holds_target = ((target_positions >= first_position)
                    & (target_positions < first_position + BLOCK_VOCAB))
    keep = True
    if operands.filter_eps is not None:
        # Some entry of S - onehot is at least filter_eps: a softmax entry, or a target (kept
        # even within filter_eps of 1: one test per row instead of one per entry), or any entry
        # of a row whose LSE is not finite (NaN and inf inputs propagate as in PyTorch).
        row_keeps = holds_target | (lse - lse != 0.0)
        keep = (tl.max(probs) >= operands.filter_eps) | (tl.max(row_keeps.to(tl.int32)) > 0)
    if ENTROPY:
        softmax_factor = (prob_scale[:, None]
                          + entropy_scale[:, None] * (logits - mean_logit[:, None]))
    else:
        softmax_factor = prob_scale[:, None]
    grad = probs * softmax_factor
    off_target = probs
    # Most tiles hold no row's target: they skip the two selects per entry.
    if tl.max(holds_target.to(tl.int32)) > 0:
        # Targets are found by position, not by vocabulary index: positions are a range, which
        # the compiler rebuilds from the thread index instead of holding it in registers.
        is_target = ((first_position + tl.arange(0, BLOCK_VOCAB))[None, :]
                     == target_positions[:, None])
        grad = tl.where(is_target, target_entry[:, None], grad)
        off_target = tl.where(is_target, 0.0, probs)
    if HAS_SOFTCAP:
        capped = logits / softcap  # tanh of the pre-cap logit
        grad = grad * (1.0 - capped * capped)
        if operands.uniform.scale is not None:
            uniform = tl.load(operands.uniform.scale + rows, mask=row_mask, other=0.0)
            curvature_mean = tl.load(operands.uniform.curvature_mean + rows, mask=row_mask,
                                     other=0.0)
            curvature = uniform[:, None] * (capped * capped - curvature_mean[:, None])
            if operands.uniform.weight is not None:
                curvature *= tl.load(operands.uniform.weight + vocab, mask=vocab_mask,
                                     other=0.0)[None, :]
            grad -= curvature
    return grad, keep, tl.sum(off_target, axis=1)
