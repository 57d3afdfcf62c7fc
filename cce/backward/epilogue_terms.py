"""What the products add in their epilogues besides the stored tiles: the rank-one term of label
smoothing and the filter correction, each built on the host before the products run
(:mod:`cce.backward.sparse_tile_matmul` adds them).

With label smoothing, G has a rank-one term ``u w^T`` (:mod:`cce.weighting`) that the stored
tiles leave out, as it would keep every tile live: a ``RankOneUpdate`` adds its product in the
epilogue, in float32 before the output is rounded: ``u (w^T C)`` to dE, ``w (u^T E)`` to dC and
``w sum(u)`` to the bias gradient.

Gradient filtering drops entries of G. With a ``FilterCorrection`` (dE only), the product adds
them back as an estimate: each row's dropped probability mass (one minus the kept mass, which
pass 1 sums, :mod:`cce.backward.gradient_tiles`) times the mean classifier row. The dropped entries
are many small ones, and language models' classifier rows share a direction, so this removes most
of the filter's dE error (docs/notes/filtering-accuracy.md).
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from cce.backward.gradient_tiles import KEPT_MASS_ONE
from cce.backward.weighted_sum import weighted_sum
from cce.forward import classifier_sums
from cce.weighting import RankOneTerm


class FilterCorrection(NamedTuple):
    """What the dE product needs to add back what the filter dropped (module docstring)."""

    mean_row: torch.Tensor  # float32 (D,): the mean row of c
    prob_scale: torch.Tensor  # float32 (N,), as in cce.logit_tile.logit_gradient_tile
    kept_mass: torch.Tensor  # int64 (N,): fixed point, see cce.backward.gradient_tiles


class PendingCorrection(NamedTuple):
    """The filter correction before the first recompute, which adds to ``kept_mass`` (from
    zero): :meth:`complete` adds the rest behind that recompute, so the recompute waits for
    none of it. ``counted_mass``: float32 (N,), each row's softmax mass in the entries that the
    tiles add up: off the row's target, and only the shard's when c is one shard of the
    vocabulary (None: all of it, 1). ``row_sum``: float32 (D,) ``c.sum(0)`` where the forward
    has it (None: read c for it)."""

    kept_mass: torch.Tensor  # int64 (N,)
    c: torch.Tensor
    prob_scale: torch.Tensor
    counted_mass: Optional[torch.Tensor]
    row_sum: Optional[torch.Tensor]

    @classmethod
    def of(cls, c: torch.Tensor, prob_scale: torch.Tensor,
           counted_mass: Optional[torch.Tensor] = None,
           row_sum: Optional[torch.Tensor] = None) -> "PendingCorrection":
        kept_mass = torch.zeros(prob_scale.shape, dtype=torch.int64, device=c.device)
        return cls(kept_mass, c, prob_scale, counted_mass, row_sum)

    def complete(self) -> FilterCorrection:
        """The correction, once the first recompute is queued (before the first product)."""
        row_sum = self.row_sum
        if row_sum is None:
            # Not torch.sum: on a GPU, its reduction over the rows stages partial sums in
            # buffers of 120-270 MB at these shapes (H200, measured).
            row_sum = classifier_sums.classifier_sums(self.c).row_sum
        if self.counted_mass is not None:
            # The mass the tiles do not add up (the target's, the other shards'): 1 - kept mass
            # is then what the filter dropped, exactly, in fixed point, however close to 1 the
            # target's probability is. Integers: the same sum whatever the order of the adds.
            # (A NaN row's gradient is NaN through its tiles anyway.)
            outside = (1 - self.counted_mass.double().clamp(0, 1)).nan_to_num(0)
            self.kept_mass.add_((outside * KEPT_MASS_ONE.value).long())
        return FilterCorrection(row_sum / self.c.shape[0], self.prob_scale, self.kept_mass)


class RankOneUpdate(NamedTuple):
    """``row_factor[row] * column_vector`` added to each output row of a product (and, for dC,
    ``row_factor * bias_factor`` to the bias gradient): the rank-one term of G (module
    docstring)."""

    row_factor: Optional[torch.Tensor]  # float32, indexed like the output's rows; None: ones
    column_vector: torch.Tensor  # float32 (D,)
    bias_factor: Optional[torch.Tensor]  # float32 scalar (dC only)

    @classmethod
    def for_embeddings(cls, term: RankOneTerm, c: torch.Tensor) -> "RankOneUpdate":
        """dE's: ``u (w^T C)`` (u: :meth:`RankOneTerm.closed_form_scale`)."""
        return cls(term.closed_form_scale(), weighted_sum(c, term.weight), None)

    @classmethod
    def for_classifier(cls, term: RankOneTerm, e: torch.Tensor) -> "RankOneUpdate":
        """dC's and the bias gradient's: ``w (u^T E)`` and ``w sum(u)``."""
        scale = term.closed_form_scale()
        return cls(term.weight, weighted_sum(e, scale), scale.sum())
