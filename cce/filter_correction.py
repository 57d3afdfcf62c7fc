"""Filter correction: dE gets back, exactly, what gradient filtering drops along a few directions.

The filter drops many small entries of each row of ``G``. Their share of ``dE_i = sum_v G_iv c_v``
is not noise: a language model's classifier rows share a direction (their mean) and vary
mostly in a few others, so the dropped parts of a row add up along those directions instead of
averaging out (docs/notes/filtering-accuracy.md). cce puts that component back exactly:

- **directions** ``U`` (D x r, orthonormal, r = 16): the mean classifier row and the top
  principal directions of the classifier, from a randomized range finder on a sample of its
  rows (a few small products; no state between calls);
- **projections** ``c U``: each classifier row's r coordinates, in position order (the
  vocabulary order), in c's dtype;
- the forward sums each row's ``softmax @ (c U)`` along with its LSE (:mod:`cce.lse_forward`),
  so ``G_i C U = s_i (softmax_i @ c U) - t_i (c U)[x_i]`` is known exactly for every row. The
  target's term is left out of the sum and added in float32 as ``(s_i p_i - t_i) (c U)[x_i]``
  (``p_i``: the target's probability), where the stored tile rounds ``s_i p_i - t_i`` too:
  rounding ``p_i`` alone would not cancel;
- the dE product (:mod:`cce.sparse_tile_matmul`) multiplies the kept tiles by ``c U`` too, and
  adds ``(exact - kept) U^T``: dE's component in the span of ``U`` becomes the exact one,
  whatever the filter dropped, and the rest of dE is the kept tiles' product.

A classifier whose rows span at most r dimensions thus gets its exact dE from a filtered
backward. Off with a softcap, whose derivative the forward's sums do not carry.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

RANK = 16  # directions, as columns of U; a tl.dot needs 16
_SAMPLE_ROWS = 4096  # classifier rows the range finder reads, evenly spaced
_POWER_STEPS = 2  # products by the sample's covariance


def correction_directions(c: torch.Tensor) -> torch.Tensor:
    """float32 (D, RANK): orthonormal directions of ``c``'s rows, its mean row first, then
    its top principal directions as far as a randomized range finder on ``_SAMPLE_ROWS`` rows
    finds them (any orthonormal directions would be exact; these are where the filter's
    error lies). The same for the same ``c``; no host sync."""
    with torch.autocast(c.device.type, enabled=False):  # also under autocast, as specified
        vocab_size, dim = c.shape
        sample = c[::max(1, vocab_size // _SAMPLE_ROWS)]
        mean = torch.mv(sample.T, sample.new_ones(sample.shape[0])).float() / sample.shape[0]
        # The start: cosines of increasing frequency (a DCT basis: orthogonal, no generator).
        features = torch.arange(dim, dtype=torch.float32, device=c.device) + 0.5
        frequencies = torch.arange(1, RANK, dtype=torch.float32, device=c.device)
        sketch = torch.cos(features[:, None] * frequencies * (math.pi / dim))
        for _ in range(_POWER_STEPS):
            # (sample - mean)^T (sample - mean) sketch, without the centred copy
            centred = torch.mm(sample, sketch.to(c.dtype)).float() - mean @ sketch
            sketch = torch.mm(sample.T, centred.to(c.dtype)).float()
            sketch = sketch / sketch.norm(dim=0).clamp_min(1e-30)
        directions = torch.linalg.qr(torch.cat([mean[:, None], sketch], dim=1)).Q
        if directions.shape[1] < RANK:  # D < RANK
            directions = torch.nn.functional.pad(directions, (0, RANK - directions.shape[1]))
        return directions.contiguous()  # QR's factor comes column-major; the kernels read rows


class FilterCorrection(NamedTuple):
    """What the dE product needs to make dE's component along the directions exact."""

    directions: torch.Tensor  # float32 (D, RANK)
    projected_classifier: torch.Tensor  # (V, RANK) in c's dtype, position order
    exact_projection: torch.Tensor  # float32 (N, RANK): each row's G_i C U

    @staticmethod
    def forward_sums(num_tokens: int, device: torch.device) -> torch.Tensor:
        """The forward's output for :meth:`of` (``projected_sums``), to be filled."""
        return torch.empty((num_tokens, RANK + 1), dtype=torch.float32, device=device)

    @staticmethod
    def add_target_probability(projected_sums: torch.Tensor, target_logit: torch.Tensor,
                               lse: torch.Tensor, has_target: torch.Tensor) -> None:
        """The last column of ``projected_sums``: each row's target probability."""
        projected_sums[:, RANK] = torch.where(has_target, torch.exp(target_logit - lse), 0.0)

    @classmethod
    def of(cls, directions: torch.Tensor, projected_classifier: torch.Tensor,
           projected_sums: torch.Tensor, prob_scale: torch.Tensor, target_scale: torch.Tensor,
           target_positions: torch.Tensor) -> "FilterCorrection":
        """``projected_sums``: float32 (N, RANK + 1) from the forward: each row's ``softmax @
        (c U)`` without the target's term, then the target's probability (0 where the row's
        target is ignored or in another shard; both over the whole vocabulary when c is one
        shard of it). ``target_positions``: see :func:`cce.vocab_order.target_positions`."""
        sums, target_probability = projected_sums[:, :RANK], projected_sums[:, RANK]
        has_target = target_positions >= 0
        target_rows = projected_classifier.index_select(0, target_positions.clamp(min=0).long())
        target_entry = (torch.where(prob_scale != 0, prob_scale * target_probability, 0.0)
                        - target_scale)
        target_term = torch.where(has_target[:, None], target_entry[:, None] * target_rows.float(),
                                  0.0)
        # Rows without a softmax gradient contribute nothing, even where their sums are NaN.
        softmax_term = torch.where(prob_scale[:, None] != 0, prob_scale[:, None] * sums, 0.0)
        return cls(directions, projected_classifier, softmax_term + target_term)
