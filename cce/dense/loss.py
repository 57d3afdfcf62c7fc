"""The dense path as custom ops, ``cce::dense_forward`` and ``cce::dense_backward`` (or, with G
in dC's memory, ``cce::dense_forward_in_grad_c`` and ``cce::dense_backward_in_grad_c``).

Forward, chunk by chunk of tokens: the chunk's float32 logits by cuBLAS (scratch of a bounded
size, :func:`cce.config.dense_chunk_tokens`), then one pass (:mod:`cce.dense.softmax_gradient`)
for the LSE pieces and, when a backward follows, ``G = softmax - onehot`` (N x V, inputs' dtype),
kept for the backward. Backward, with a_i the row's scale of the softmax (the loss's upstream
gradient times its class weight, plus the LSE's upstream gradient g_i), b_i the target's, and
r_i = a_i - b_i (= g_i) at rows with a target:

    dlogits = a G + r onehot,     dE = a (G C) + r C[y],     dC = G^T (a E) + scatter_y(r E).

Three logit-sized GEMMs in all, as ``F.cross_entropy(e @ c.T)`` takes. The path takes the
options whose gradient is that (no softcap, label smoothing or entropy: :func:`dense_layout`).

**G in dC's memory.** Where N <= D / 2 (16-bit e and c of one dtype, dC wanted), G fits in the
memory dC will take. Above :data:`cce.config.DENSE_MAX_VOCAB`, where G kept apart would be
large, the forward allocates dC's buffer and keeps ``G^T`` (V x N) at its tail;
its float32 logits, ``(D - N) / 2`` tokens at a time, use the buffer's head as scratch. dE's
product ``G C`` (float32 N x D) needs no upstream gradient: the forward queues it last, into the
buffer's head, so that the GPU runs it while the host returns the loss and starts the backward
(at small N the host's work between the two is as long as the forward's GEMMs). The backward
scales it into dE, then writes dC over the buffer in segments of increasing vocabulary rows,
each ending where the first G^T row it reads begins:

    rows [s, t) of dC fill elements [s D, t D);  row u of G^T starts at V (D - N) + u N;
    t = V - ceil((V - s) N / D)  keeps t D <= V (D - N) + s N,

so no segment overwrites a row of G^T not yet read; the rows left shrink by N / D per segment,
and the last few MB are copied out first. No memory beyond dE + dC and a few MB for any
vocabulary (the buffer is held from the forward, as the copy of ``c`` is,
:mod:`cce.forward.plan`), but the backward consumes G: a second backward through the same graph
raises.
"""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING, Optional

import torch

from cce.autograd import (differentiable_once, needs_gradient, tokenless_loss,
                          vmap_sample_by_sample, without_autocast)
from cce.config import (DENSE_IN_PLACE_TAIL_BYTES, DENSE_MAX_VOCAB, cdiv,
                        check_interpreter_usable, dense_chunk_tokens)
from cce.dense.softmax_gradient import softmax_gradient, transposed_gradient
from cce.streams import StartedLoss, work_mark
from cce.weighting import LossWeighting, TokenOutputs, lse_and_cross_entropy

if TYPE_CHECKING:
    from cce.options import LossOptions


class GradientLayout(enum.Enum):
    """Where the dense path keeps G from the forward to the backward."""

    APART = "(N, V), a tensor of its own"
    IN_GRAD_C = "G^T at the tail of dC's buffer"


def dense_layout(e: torch.Tensor, c: torch.Tensor, weighting: LossWeighting,
                 options: LossOptions) -> Optional[GradientLayout]:
    """Where the dense path keeps G for this call, or None where it does not compute it. It does
    with memory "fast" and options whose logit gradient is a scaled ``softmax - onehot`` (no
    softcap or label smoothing, no entropy or argmax asked for), on a vocabulary where most tiles
    are live (:data:`cce.config.DENSE_MAX_VOCAB`: G apart), or above it with G in dC's memory
    (:func:`keeps_gradient_in_grad_c`)."""
    if (options.memory != "fast" or options.softcap is not None or weighting.label_smoothing
            or options.return_entropy or options.return_argmax):
        return None
    if c.shape[0] <= DENSE_MAX_VOCAB:
        return GradientLayout.APART
    return GradientLayout.IN_GRAD_C if keeps_gradient_in_grad_c(e, c) else None


def keeps_gradient_in_grad_c(e: torch.Tensor, c: torch.Tensor) -> bool:
    """Whether the dense path keeps G^T in dC's buffer: above :data:`DENSE_MAX_VOCAB` (below,
    G kept apart is small and its backward a few passes shorter), at most D / 2 tokens, 16-bit
    ``e`` and ``c`` of one dtype, ``c`` trained, no torch.func transform (whose per-sample
    calls would each hold a buffer of dC's size) and no torch.compile (whose partitioner does
    not take a backward that writes over a tensor saved by the forward)."""
    num_tokens, dim = e.shape
    return (c.shape[0] > DENSE_MAX_VOCAB and 0 < 2 * num_tokens <= dim
            and _logit_rows_in_head(num_tokens, dim) > 0
            and 2 * num_tokens * dim <= c.shape[0] * (dim - num_tokens)  # G C in the head
            and e.dtype == c.dtype
            and e.dtype in (torch.bfloat16, torch.float16) and needs_gradient(c)
            and not torch.compiler.is_compiling()  # first: Dynamo cannot trace the next one
            and not torch._C._functorch.is_functorch_wrapped_tensor(e))


@torch.library.custom_op("cce::dense_forward", mutates_args=())
@without_autocast
def dense_forward(e: torch.Tensor, c: torch.Tensor, bias: Optional[torch.Tensor],
                  targets: torch.Tensor, weight: Optional[torch.Tensor], needs_grad: bool,
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(per-token loss, lse, G): float32 (N,), float32 (N,), and ``softmax - onehot`` in e's
    dtype, (N, V) when ``needs_grad``, else empty. Targets canonical (int64, -1 = ignored)."""
    return _dense_forward(e, c, bias, targets, weight, needs_grad, None)


@dense_forward.register_fake
def _dense_forward_fake(e, c, bias, targets, weight, needs_grad):
    num_tokens = e.shape[0]
    return (e.new_empty(num_tokens, dtype=torch.float32),
            e.new_empty(num_tokens, dtype=torch.float32),
            e.new_empty((num_tokens, c.shape[0]) if needs_grad else (0,)))


@torch.library.custom_op("cce::dense_forward_in_grad_c", mutates_args=("buffer",))
@without_autocast
def dense_forward_in_grad_c(e: torch.Tensor, c: torch.Tensor, bias: Optional[torch.Tensor],
                            targets: torch.Tensor, weight: Optional[torch.Tensor],
                            buffer: torch.Tensor, needs_grad_e: bool
                            ) -> tuple[torch.Tensor, torch.Tensor]:
    """(per-token loss, lse) as :func:`dense_forward`, with ``G^T`` written to the tail of dC's
    flat ``buffer`` (:func:`_transposed_view`), whose head holds the first chunk's float32
    logits (:func:`queue_first_logits`), then, when ``needs_grad_e``, ``G C`` (float32 (N, D),
    :func:`_float32_in_head`): dE's product before its row scales needs no upstream gradient,
    so it is queued here, and the GPU runs it while the host returns the loss and starts the
    backward. No registered autograd formula (PyTorch takes none for an op that mutates an
    input): :class:`_DenseLinearCrossEntropy` carries it."""
    num_tokens, dim = e.shape
    loss, lse, _ = _dense_forward(e, c, bias, targets, weight, True, buffer)
    if needs_grad_e:
        _float32_product(_transposed_view(buffer, num_tokens, c.shape[0]).T, c,
                         _float32_in_head(buffer, num_tokens, dim))
    return loss, lse


@dense_forward_in_grad_c.register_fake
def _dense_forward_in_grad_c_fake(e, c, bias, targets, weight, buffer, needs_grad_e):
    return (e.new_empty(e.shape[0], dtype=torch.float32),
            e.new_empty(e.shape[0], dtype=torch.float32))


def _dense_forward(e: torch.Tensor, c: torch.Tensor, bias: Optional[torch.Tensor],
                   targets: torch.Tensor, weight: Optional[torch.Tensor], needs_grad: bool,
                   buffer: Optional[torch.Tensor]
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Both ops' forward: G apart when ``buffer`` is None, else G^T at its tail."""
    check_interpreter_usable()
    num_tokens, vocab_size = e.shape[0], c.shape[0]
    gradient = gradient_t = None
    chunk = dense_chunk_tokens(vocab_size)
    if buffer is not None:
        gradient_t = _transposed_view(buffer, num_tokens, vocab_size)
        chunk = _logit_rows_in_head(num_tokens, e.shape[1])
    elif needs_grad:
        gradient = torch.empty(num_tokens, vocab_size, dtype=e.dtype, device=e.device)
    other_lse = torch.empty(num_tokens, dtype=torch.float32, device=e.device)
    target_logit = torch.empty_like(other_lse)
    for start in range(0, num_tokens, chunk):
        stop = min(num_tokens, start + chunk)
        if buffer is None:
            logits = _float32_product(e[start:stop], c.T)
        else:
            logits = _float32_in_head(buffer, stop - start, vocab_size)
            if start:  # the first chunk's are queued before the call
                _float32_product(e[start:stop], c.T, logits)
        other_lse[start:stop], target_logit[start:stop] = softmax_gradient(
            logits, bias, targets[start:stop],
            None if gradient is None else gradient[start:stop])
        if gradient_t is not None:
            transposed_gradient(logits, bias, targets[start:stop], other_lse[start:stop],
                                target_logit[start:stop], gradient_t[:, start:stop])
    lse, cross_entropy = lse_and_cross_entropy(other_lse, target_logit, targets)
    loss = LossWeighting(weight).token_loss(cross_entropy, lse, None, targets, vocab_size)
    return loss, lse, gradient if gradient is not None else e.new_empty(0)


@without_autocast
def queue_first_logits(e: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """dC's flat buffer (V * D elements of c's dtype) for G in dC's memory, with the float32
    logits of the first chunk of tokens queued into its head: the GEMM needs only ``e`` and
    ``c``, so the loss queues it before it makes the targets canonical."""
    num_tokens, dim = e.shape
    vocab_size = c.shape[0]
    buffer = torch.empty(vocab_size * dim, dtype=c.dtype, device=e.device)
    rows = min(num_tokens, _logit_rows_in_head(num_tokens, dim))
    with torch.no_grad():
        _float32_product(e[:rows], c.T, _float32_in_head(buffer, rows, vocab_size))
    return buffer


def _float32_in_head(buffer: torch.Tensor, rows: int, columns: int) -> torch.Tensor:
    """A (rows, columns) float32 matrix at the head of dC's flat 16-bit buffer: a chunk's
    logits in the forward (columns V), then G C (N x D) once they are consumed; dE reads G C
    before the backward's first segment of dC overwrites it."""
    return buffer[:2 * rows * columns].view(torch.float32).view(rows, columns)


def _float32_product(a: torch.Tensor, b: torch.Tensor,
                     out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``a @ b`` in float32 from inputs of any kernel dtype (cuBLAS's float32 output on a GPU),
    into the float32 ``out`` (a.shape[0], b.shape[1]) when given."""
    if a.is_cuda and a.dtype != torch.float32:
        return torch.mm(a, b, out_dtype=torch.float32, out=out)
    if out is None:
        return torch.mm(a.float(), b.float())
    return torch.mm(a.float(), b.float(), out=out)


def _logit_rows_in_head(num_tokens: int, dim: int) -> int:
    """Rows of float32 logits that the head of dC's 16-bit buffer holds beside G^T (V x N) at
    its tail: (D - N) V elements of 16 bits are (D - N) / 2 rows of V float32 logits."""
    return (dim - num_tokens) // 2


def _transposed_view(buffer: torch.Tensor, num_tokens: int, vocab_size: int) -> torch.Tensor:
    """The (V, N) ``G^T`` at the tail of dC's flat buffer."""
    return buffer[buffer.shape[0] - vocab_size * num_tokens:].view(vocab_size, num_tokens)


class _RowScales:
    """What the backward multiplies G's rows and the one-hot by (see the module's formulas):
    ``softmax`` a (float32 (N,)), ``onehot`` r (None without an LSE gradient), and for float16
    ``power``, a power of two near max |a| (else None): dC's product takes the rows of E times
    ``a / power``, rounded once to e's dtype, so that float16 keeps its range; the output is
    scaled back exactly (bfloat16 has float32's range: no pass over dC)."""

    def __init__(self, targets: torch.Tensor, weight: Optional[torch.Tensor],
                 grad_loss: Optional[torch.Tensor], grad_lse: Optional[torch.Tensor],
                 vocab_size: int, dtype: torch.dtype) -> None:
        scales = LossWeighting(weight).gradient_scales(
            grad_loss if grad_loss is not None
            else torch.zeros(targets.shape, device=targets.device), targets, vocab_size)
        self.softmax = scales.softmax
        if grad_lse is not None:
            self.softmax = self.softmax + grad_lse.float()
        # r: the LSE's upstream gradient at rows with a target (None: no such term).
        self.onehot = (torch.where(targets >= 0, self.softmax - scales.target, 0.0)
                       if grad_lse is not None else None)
        self.power = (torch.exp2(torch.frexp(self.softmax.abs().amax())[1].float())
                      if dtype == torch.float16 else None)
        self.multipliers = self.softmax if self.power is None else self.softmax / self.power
        self.safe_targets = targets.clamp(min=0)

    def grad_e(self, product: torch.Tensor, c: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """dE from G C (float32 (N, D), :func:`_float32_product`; scaled in place)."""
        grad_e = product.mul_(self.softmax[:, None])
        if self.onehot is not None:
            grad_e.addcmul_(self.onehot[:, None], c[self.safe_targets].float())
        return grad_e.to(dtype)

    def scaled_e(self, e: torch.Tensor) -> torch.Tensor:
        return (e * self.multipliers[:, None]).to(e.dtype)  # in float32, no float32 copy of e

    def scaled_back(self, product: torch.Tensor) -> torch.Tensor:
        """A product of :meth:`scaled_e` times ``power``, in place."""
        return product if self.power is None else product.mul_(self.power.to(product.dtype))

    def grad_bias(self, gradient_t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """dbias from G^T (V, N). The multipliers as two terms in G's dtype (the second their
        rounding error), so that 16-bit G is their only rounding."""
        high = self.multipliers.to(gradient_t.dtype)
        low = (self.multipliers - high.float()).to(gradient_t.dtype)
        grad_bias = _float32_product(gradient_t, torch.stack([high, low], 1)).sum(1)
        grad_bias = self.scaled_back(grad_bias)
        if self.onehot is not None:
            grad_bias.index_add_(0, self.safe_targets, self.onehot)
        return grad_bias.to(dtype)


@torch.library.custom_op("cce::dense_backward", mutates_args=())
@without_autocast
def dense_backward(e: torch.Tensor, c: torch.Tensor, bias: Optional[torch.Tensor],
                   targets: torch.Tensor, weight: Optional[torch.Tensor],
                   gradient: torch.Tensor, grad_loss: Optional[torch.Tensor],
                   grad_lse: Optional[torch.Tensor], needs_grad_e: bool, needs_grad_c: bool,
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dE, dC, dbias) of ``sum(loss * grad_loss + lse * grad_lse)`` from :func:`dense_forward`'s
    G (a None gradient counts as 0), each empty when not needed."""
    # G C first: it needs no scale, and the host's work on the scales then overlaps it.
    product = _float32_product(gradient, c) if needs_grad_e else None
    scales = _RowScales(targets, weight, grad_loss, grad_lse, c.shape[0], e.dtype)
    grad_e = grad_c = grad_bias = None
    if needs_grad_e:
        grad_e = scales.grad_e(product, c, e.dtype)
    if needs_grad_c:
        scaled_e = scales.scaled_e(e)
        if scales.onehot is None:  # G's product alone: its output in e's dtype
            grad_c = scales.scaled_back(torch.mm(gradient.T, scaled_e))
        else:
            grad_c = scales.scaled_back(_float32_product(gradient.T, scaled_e))
            grad_c.index_add_(0, scales.safe_targets, scales.onehot[:, None] * e.float())
            grad_c = grad_c.to(c.dtype)
        if bias is not None:
            grad_bias = scales.grad_bias(gradient.T, bias.dtype)
    return tuple(grad if grad is not None else e.new_empty(0)
                 for grad in (grad_e, grad_c, grad_bias))


@dense_backward.register_fake
def _dense_backward_fake(e, c, bias, targets, weight, gradient, grad_loss, grad_lse,
                         needs_grad_e, needs_grad_c):
    return (e.new_empty(e.shape if needs_grad_e else (0,)),
            c.new_empty(c.shape if needs_grad_c else (0,)),
            c.new_empty(bias.shape if needs_grad_c and bias is not None else (0,)))


@torch.library.custom_op("cce::dense_backward_in_grad_c", mutates_args=("buffer",))
@without_autocast
def dense_backward_in_grad_c(e: torch.Tensor, c: torch.Tensor, bias: Optional[torch.Tensor],
                             targets: torch.Tensor, weight: Optional[torch.Tensor],
                             buffer: torch.Tensor, needs_grad_e: bool,
                             grad_loss: Optional[torch.Tensor], grad_lse: Optional[torch.Tensor],
                             ) -> tuple[torch.Tensor, torch.Tensor]:
    """(dE, dbias), each empty when not needed, as :func:`dense_backward`, from G^T and (with
    ``needs_grad_e``) G C kept in dC's ``buffer`` by :func:`dense_forward_in_grad_c`, which
    receives dC (V * D, flat): see the module's note for the order that keeps every row of G^T
    and G C until it is read."""
    num_tokens, dim = e.shape
    vocab_size = c.shape[0]
    scales = _RowScales(targets, weight, grad_loss, grad_lse, vocab_size, e.dtype)
    gradient_t = _transposed_view(buffer, num_tokens, vocab_size)
    grad_e = (scales.grad_e(_float32_in_head(buffer, num_tokens, dim), c, e.dtype)
              if needs_grad_e else e.new_empty(0))
    grad_bias = (scales.grad_bias(gradient_t, bias.dtype) if bias is not None
                 else e.new_empty(0))
    scaled_e = scales.scaled_e(e)
    target_rows = None
    if scales.onehot is not None:
        # The targets' rows of dC, G^T's part and scatter_y(r E) added in float32 before the
        # one rounding, as dense_backward does; taken while G^T is whole. Tokens of one target
        # are summed first, so that every write to a row carries the same value.
        valid = targets >= 0
        same_target = (targets[:, None] == targets[None, :]) & valid[None, :]
        target_rows = (scales.scaled_back(_float32_product(gradient_t[scales.safe_targets],
                                                           scaled_e))
                       + torch.mm(same_target.float(), scales.onehot[:, None] * e.float()))
    grad_c = buffer.view(vocab_size, dim)
    start = 0
    while start < vocab_size:
        stop = vocab_size - cdiv((vocab_size - start) * num_tokens, dim)
        left = (vocab_size - start) * num_tokens * buffer.element_size()
        if stop <= start or left <= DENSE_IN_PLACE_TAIL_BYTES:
            torch.mm(gradient_t[start:].clone(), scaled_e, out=grad_c[start:])
            break
        torch.mm(gradient_t[start:stop], scaled_e, out=grad_c[start:stop])
        start = stop
    scales.scaled_back(grad_c)
    if target_rows is not None:
        # Tokens without a target write the row of the first token with one, as it does (with
        # no such token, row 0 as the product wrote it).
        first = torch.argmax(valid.to(torch.int8))
        rows = torch.where(valid, scales.safe_targets, scales.safe_targets[first])
        values = torch.where(valid[:, None], target_rows, target_rows[first]).to(grad_c.dtype)
        grad_c[rows] = torch.where(valid.any(), values, grad_c[rows])
    return grad_e, grad_bias


@dense_backward_in_grad_c.register_fake
def _dense_backward_in_grad_c_fake(e, c, bias, targets, weight, buffer, needs_grad_e,
                                   grad_loss, grad_lse):
    return (e.new_empty(e.shape if needs_grad_e else (0,)),
            c.new_empty(bias.shape if bias is not None else (0,)))


def _setup_context(ctx, inputs, output) -> None:
    # dense_forward's inputs, or the autograd.Function's, which add dC's buffer (or None).
    e, c, bias, targets, weight, _, *buffer = inputs
    buffer = buffer[0] if buffer else None
    ctx.set_materialize_grads(False)
    ctx.in_grad_c = buffer is not None
    if ctx.in_grad_c:
        kept = buffer  # G^T at its tail, G C at its head
    else:
        _, _, kept = output  # G (N, V)
        ctx.mark_non_differentiable(kept)
    ctx.save_for_backward(e, c, bias, targets, weight, kept)
    ctx.consumed = False


def _backward(ctx, grad_loss: Optional[torch.Tensor], grad_lse: Optional[torch.Tensor], *_):
    if ctx.in_grad_c and ctx.consumed:
        raise RuntimeError(
            "memory='fast' at this size kept the logits' gradient in dC's memory and the first "
            "backward wrote dC over it: a second backward through the same graph is not "
            "supported (call the loss again, or use memory='low')")
    e, c, bias, targets, weight, kept = ctx.saved_tensors
    needs_e, needs_c, needs_bias = ctx.needs_input_grad[:3]
    with torch.no_grad():
        if ctx.in_grad_c:
            ctx.consumed = True
            grad_e, grad_bias = dense_backward_in_grad_c(
                e, c, bias, targets, weight, kept, needs_e, grad_loss, grad_lse)
            grad_c = kept.view(c.shape)
        else:
            grad_e, grad_c, grad_bias = dense_backward(
                e, c, bias, targets, weight, kept, grad_loss, grad_lse,
                needs_grad_e=needs_e, needs_grad_c=needs_c or needs_bias)
    # The saved tensors' last reference but dC's: autograd may take dC as c.grad.
    del kept
    gradients = differentiable_once(
        [grad if needed else None
         for grad, needed in ((grad_e, needs_e), (grad_c, needs_c), (grad_bias, needs_bias))],
        (e, c, bias, grad_loss, grad_lse))
    return gradients + (None,) * (len(ctx.needs_input_grad) - 3)


dense_forward.register_autograd(_backward, setup_context=_setup_context)
vmap_sample_by_sample(dense_forward)
vmap_sample_by_sample(dense_backward)


class _DenseLinearCrossEntropy(torch.autograd.Function):
    """:func:`dense_forward` with its autograd formula as an autograd.Function, for torch.func's
    transforms (as :class:`cce.cce_function._LinearCrossEntropy`)."""

    generate_vmap_rule = True

    setup_context = staticmethod(_setup_context)
    backward = staticmethod(_backward)

    @staticmethod
    def forward(e, c, bias, targets, weight, needs_grad, buffer):
        if buffer is None:
            return dense_forward(e, c, bias, targets, weight, needs_grad)
        return dense_forward_in_grad_c(e, c, bias, targets, weight, buffer, e.requires_grad)


def start_dense_loss(e: torch.Tensor, c: torch.Tensor, bias: Optional[torch.Tensor],
                     weighting: LossWeighting, layout: GradientLayout) -> StartedLoss:
    """The dense path's loss as a function of the canonical targets (see :mod:`cce.loss`), G
    kept as ``layout`` (:func:`dense_layout`) says; with G in dC's memory, dC's buffer and the
    first logits are queued now (:func:`queue_first_logits`)."""
    queued_before = buffer = None
    if layout is GradientLayout.IN_GRAD_C:
        queued_before = work_mark(e.device)
        buffer = queue_first_logits(e, c)

    def loss(targets: torch.Tensor) -> TokenOutputs:
        if e.shape[0] == 0:
            return tokenless_loss(e, c, bias)
        needs_grad = needs_gradient(e, c, bias)
        arguments = (e, c, bias if bias is None else bias.contiguous(), targets.contiguous(),
                     weighting.weight, needs_grad)
        loss, lse = (_DenseLinearCrossEntropy.apply(*arguments, buffer) if needs_grad
                     else dense_forward(*arguments))[:2]
        return TokenOutputs(loss, lse)

    return StartedLoss(loss, queued_before)
