"""Baselines that materialize the logits, with the canonical signature of :mod:`cce.loss`.

``torch_loss`` is the paper's Baseline: the loss written directly in PyTorch, logits upcast to
float32 as Hugging Face transformers does. ``torch_compile_loss`` is the same function under
torch.compile; ``chunked_loss`` is torchtune's scheme: the tokens in 8 chunks, each chunk's
logits and loss computed by one compiled function, so only one chunk's float32 logits exist.
Class weights and label smoothing go to ``F.cross_entropy`` as they are.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Optional

import torch
import torch.nn.functional as F

from cce.weighting import LossWeighting, TokenOutputs

if TYPE_CHECKING:
    from cce.options import LossOptions

NUM_CHUNKS = 8


def materialized_logits(e: torch.Tensor, c: torch.Tensor, bias: Optional[torch.Tensor],
                        softcap: Optional[float]) -> torch.Tensor:
    """float32 (N, V) logits, rounded to the input dtype first as Hugging Face's are (float64
    ones for float64 inputs)."""
    logits = e @ c.T
    if bias is not None:
        logits = logits + bias
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    return logits


def _logits_loss_lse(e: torch.Tensor, c: torch.Tensor, targets: torch.Tensor,
                     bias: Optional[torch.Tensor], softcap: Optional[float],
                     weighting: LossWeighting, entropy: bool = False, argmax: bool = False):
    """(loss, lse, entropy or None, argmax or None) of the materialized logits."""
    logits = materialized_logits(e, c, bias, softcap)
    loss = F.cross_entropy(logits, targets, weight=weighting.weight, ignore_index=-1,
                           reduction="none", label_smoothing=weighting.label_smoothing)
    lse = torch.logsumexp(logits, dim=-1)
    row_entropy = None
    if entropy:
        # L - sum_v p_v z_v (verl's entropy_from_logits); -inf logits, whose p is 0, count as
        # the dtype's lowest number, so that 0 * -inf adds 0, not NaN.
        finite_low = logits.clamp(min=torch.finfo(logits.dtype).min)
        row_entropy = lse - (torch.softmax(logits, dim=-1) * finite_low).sum(dim=-1)
    return loss, lse, row_entropy, logits.argmax(dim=-1) if argmax else None


@functools.cache
def _compiled():
    # dynamic=False: the benchmarks run fixed shapes; a recompile per new shape is expected.
    return torch.compile(_logits_loss_lse, dynamic=False)


def _compile_settings():
    """Scoped Dynamo settings: experiments sweep many shapes, and past the default 8
    recompiles Dynamo would silently run eager code under the torch_compile label."""
    return torch._dynamo.config.patch(recompile_limit=64, fail_on_recompile_limit_hit=True)


# The baselines compute exact gradients: of the options, only softcap applies.


def _arguments(options: LossOptions) -> tuple:
    """What :func:`_logits_loss_lse` takes from the options."""
    return options.softcap, options.return_entropy, options.return_argmax


def torch_loss(e: torch.Tensor, c: torch.Tensor, targets: torch.Tensor,
               bias: Optional[torch.Tensor], weighting: LossWeighting,
               options: LossOptions) -> TokenOutputs:
    """Materialize the logits."""
    softcap, entropy, argmax = _arguments(options)
    return TokenOutputs(*_logits_loss_lse(e, c, targets, bias, softcap, weighting, entropy,
                                          argmax))


def torch_compile_loss(e: torch.Tensor, c: torch.Tensor, targets: torch.Tensor,
                       bias: Optional[torch.Tensor], weighting: LossWeighting,
                       options: LossOptions) -> TokenOutputs:
    softcap, entropy, argmax = _arguments(options)
    with _compile_settings():
        return TokenOutputs(*_compiled()(e, c, targets, bias, softcap, weighting, entropy,
                                         argmax))


def chunked_loss(e: torch.Tensor, c: torch.Tensor, targets: torch.Tensor,
                 bias: Optional[torch.Tensor], weighting: LossWeighting,
                 options: LossOptions) -> TokenOutputs:
    softcap, entropy, argmax = _arguments(options)
    compiled = _compiled()
    with _compile_settings():
        chunks = [compiled(e_chunk, c, target_chunk, bias, softcap, weighting, entropy, argmax)
                  for e_chunk, target_chunk
                  in zip(e.chunk(NUM_CHUNKS), targets.chunk(NUM_CHUNKS))]
    if not chunks:  # no tokens at all
        return torch_loss(e, c, targets, bias, weighting, options)
    return TokenOutputs(*(None if parts[0] is None else torch.cat(parts)
                          for parts in zip(*chunks)))
