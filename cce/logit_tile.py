"""Device functions shared by the forward and backward kernels: one logit tile, computed on-chip.

A tile is ``z = softcap(E[rows] @ C[vocab].T + bias[vocab])`` for BLOCK_TOKENS rows and
BLOCK_VOCAB vocabulary entries, accumulated in float32 over D in BLOCK_DIM slices. ``vocab``
holds vocabulary indices, not positions, so the backward can walk the vocabulary in sorted
order without reordering ``c`` in memory.
"""

import triton
import triton.language as tl

LOG2_E = tl.constexpr(1.4426950408889634)  # exp(x) = exp2(x * LOG2_E)


@triton.jit
def tanh(x):
    # tl has no tanh that also runs in the interpreter; 2*sigmoid(2x)-1 saturates cleanly to +-1.
    return 2.0 * tl.sigmoid(2.0 * x) - 1.0


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
def vocab_block_entries(vocab_order_ptr, vocab_block, vocab_size, BLOCK_VOCAB: tl.constexpr,
                        SORTED: tl.constexpr):
    """Vocabulary indices of one block of positions (positions of ``vocab_order`` when sorting)
    and the mask of those inside the vocabulary."""
    positions = vocab_block * BLOCK_VOCAB + tl.arange(0, BLOCK_VOCAB)
    vocab_mask = positions < vocab_size
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
def logit_tile(
    e_ptr, c_ptr, bias_ptr, rows, row_mask, vocab, vocab_mask, dim,
    stride_e_row, stride_e_dim, stride_c_row, stride_c_dim, softcap,
    HAS_BIAS: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
    BLOCK_TOKENS: tl.constexpr, BLOCK_VOCAB: tl.constexpr, BLOCK_DIM: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Logits of one (tokens x vocabulary) tile in float32; masked entries hold garbage-free 0s
    before the bias/softcap, so callers must mask them themselves."""
    offsets_dim = tl.arange(0, BLOCK_DIM)
    e_rows = e_ptr + rows.to(tl.int64)[:, None] * stride_e_row
    c_rows = c_ptr + vocab.to(tl.int64)[:, None] * stride_c_row
    logits = tl.zeros((BLOCK_TOKENS, BLOCK_VOCAB), dtype=tl.float32)
    for dim_start in range(0, dim, BLOCK_DIM):
        dims = dim_start + offsets_dim
        dim_mask = dims < dim
        e_block = tl.load(e_rows + dims[None, :] * stride_e_dim,
                          mask=row_mask[:, None] & dim_mask[None, :], other=0.0)
        c_block = tl.load(c_rows + dims[None, :] * stride_c_dim,
                          mask=vocab_mask[:, None] & dim_mask[None, :], other=0.0)
        logits = tile_dot(e_block, tl.trans(c_block), logits, DOT_PRECISION)
    if HAS_BIAS:
        logits += tl.load(bias_ptr + vocab, mask=vocab_mask, other=0.0).to(tl.float32)[None, :]
    if HAS_SOFTCAP:
        logits = softcap * tanh(logits / softcap)
    return logits


@triton.jit
def logit_gradient_tile(
    e_ptr, c_ptr, bias_ptr, target_positions_ptr, lse_ptr, prob_scale_ptr, target_scale_ptr,
    rows, row_mask, vocab_block, vocab, vocab_mask, vocab_size, dim,
    stride_e_row, stride_e_dim, stride_c_row, stride_c_dim, softcap, filter_eps,
    HAS_BIAS: tl.constexpr, HAS_SOFTCAP: tl.constexpr, FILTER: tl.constexpr,
    BLOCK_TOKENS: tl.constexpr, BLOCK_VOCAB: tl.constexpr, BLOCK_DIM: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Recompute one tile and return (gradient of the pre-softcap logits in float32, keep, the
    softmax mass of each row in the tile).
    ``vocab_block``: the tile's block of vocabulary positions (``vocab`` = the entries at them).

    The gradient is ``prob_scale[i] * softmax_ij - target_scale[i] * [j == x_i]``, times the
    softcap derivative. ``keep`` is False when gradient filtering proves the tile negligible:
    every entry of ``softmax - onehot`` (on rows with a gradient) is below ``filter_eps``.
    """
    # The rows' values are loaded before the tile's products, which hide their latency.
    lse = tl.load(lse_ptr + rows, mask=row_mask, other=0.0)
    prob_scale = tl.load(prob_scale_ptr + rows, mask=row_mask, other=0.0)
    target_scale = tl.load(target_scale_ptr + rows, mask=row_mask, other=0.0)
    target_positions = tl.load(target_positions_ptr + rows, mask=row_mask, other=-1)
    logits = logit_tile(
        e_ptr, c_ptr, bias_ptr, rows, row_mask, vocab, vocab_mask, dim,
        stride_e_row, stride_e_dim, stride_c_row, stride_c_dim, softcap,
        HAS_BIAS, HAS_SOFTCAP, BLOCK_TOKENS, BLOCK_VOCAB, BLOCK_DIM, DOT_PRECISION,
    )

    # Every operation per entry counts here (the tile's products are short at small D): rows
    # without a softmax gradient get an infinite LSE instead of a select per entry, so that
    # their probabilities are 0 (NaN where their logits are, as in PyTorch). A row whose LSE is
    # +inf (an infinite logit) gets NaN probabilities, as torch.softmax gives it.
    row_lse = tl.where(lse == float("inf"), float("nan"), lse)
    scaled_lse = tl.where(prob_scale != 0.0, row_lse, float("inf")) * LOG2_E
    # exp(z - lse) as exp2(z * log2(e) - lse * log2(e)): one fused multiply-add per entry.
    probs = tl.exp2(logits * LOG2_E - scaled_lse[:, None])
    if holds_padding(vocab_block, vocab_size, BLOCK_VOCAB):
        probs = tl.where(vocab_mask[None, :], probs, 0.0)
    # Targets are found by position, not by vocabulary index: positions are a range, which
    # the compiler rebuilds from the thread index instead of holding it in registers.
    first_position = vocab_block * BLOCK_VOCAB
    is_target = (first_position + tl.arange(0, BLOCK_VOCAB))[None, :] == target_positions[:, None]
    keep = True
    if FILTER:
        # Some entry of S - onehot is at least filter_eps: a softmax entry, or a target (kept
        # even within filter_eps of 1: one test per row instead of one per entry), or any entry
        # of a row whose LSE is not finite (NaN and inf inputs propagate as in PyTorch).
        row_keeps = (((target_positions >= first_position)
                      & (target_positions < first_position + BLOCK_VOCAB))
                     | (lse - lse != 0.0))
        keep = (tl.max(probs) >= filter_eps) | (tl.max(row_keeps.to(tl.int32)) > 0)
    grad = probs * prob_scale[:, None] - tl.where(is_target, target_scale[:, None], 0.0)
    if HAS_SOFTCAP:
        capped = logits / softcap
        grad = grad * (1.0 - capped * capped)
    return grad, keep, tl.sum(probs, axis=1)
