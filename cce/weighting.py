"""Class weights and label smoothing, as ``F.cross_entropy`` defines them, from the plain loss.

For a non-ignored token i with target y, logits z_i over V classes, LSE L_i, class weights w
(all 1 without weights), W = sum_v w_v and label smoothing s, F.cross_entropy's per-token loss is

    loss_i = (1 - s) w_y (L_i - z_iy) + (s / V) sum_v w_v (L_i - z_iv)
           = (1 - s) w_y (L_i - z_iy) + (s / V) (W L_i - m_i),    m_i = sum_v w_v z_iv,

and 0 for an ignored token; "mean" divides the sum of the losses by the summed weights of the
non-ignored targets. The gradient of g_i * loss_i with respect to z_iv is

    g_i ((1 - s) w_y + s W / V) p_iv  -  g_i (1 - s) w_y [v = y]  +  u_i w_v,   u_i = -g_i s / V,

the plain loss's softmax and target terms with other scales, plus a rank-one term ``u w^T``.
An implementation that does not build the logits adds that term's products in closed form:
``dE += u (w^T C)``, ``dC += w (u^T E)``, ``dbias += w sum(u)``.

With a softcap z = cap tanh(x / cap), the gradient with respect to the pre-cap logit x is that
times ``1 - t^2`` (t = tanh(x / cap)), and the smoothing's term ``u_i w_v (1 - t_iv^2)`` is no
longer rank-one. The products add its rank-one part ``u_i (1 - kappa_i) w_v``, kappa_i =
``sum_v w_v t_iv^2 / W`` the row's weighted mean of t^2 (summed by the forward), and the tiles
hold the rest, ``-u_i w_v (t_iv^2 - kappa_i)``, which sums to 0 over each row: the tiles that
gradient filtering skips drop only its deviation from the row's mean, not the mean itself.

Rows where the model is sure of its target (p_y near 1) need ``1 - p_y`` with its own relative
precision: the loss is about ``1 - p_y`` and the gradient at the target is ``-g (1 - p_y)``. From
the LSE L and the target logit, ``L - z_y`` and ``exp(z_y - L) - 1`` keep only what is left of
their last bits. The implementations that build no logits compute instead the LSE of each row's
other logits, ``O_i = log sum_{v != y} exp(z_iv)``; then ``1 - p_y = exp(O_i - L_i)`` and the
cross-entropy is ``log(1 + exp(O_i - z_iy))``, both exact to float32 rounding
(:func:`lse_and_cross_entropy`, :func:`target_complement`; on the kernels' path one kernel,
:mod:`cce.forward.row_outputs`).

Every implementation gets a :class:`LossWeighting` and returns F.cross_entropy's per-token loss
(``reduction="none"``); :mod:`cce.loss` reduces it. Those that build no logits compute the plain
pieces (L, z_iy, m) and use :meth:`LossWeighting.token_loss` and
:meth:`LossWeighting.gradient_scales` for the rest.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch


class TokenOutputs(NamedTuple):
    """What every implementation returns (:mod:`cce.loss`): compute-dtype (N,) tensors, the
    entropy (of each row's softmax) and int64 argmax (of each row's logits) None unless the
    options ask for them."""

    loss: torch.Tensor
    lse: torch.Tensor
    entropy: Optional[torch.Tensor] = None
    argmax: Optional[torch.Tensor] = None


class GradientScales(NamedTuple):
    """Per-token float32 (N,) factors of the gradient of the logits (module docstring)."""

    softmax: torch.Tensor  # of p_iv; the LSE's own upstream gradient is not included
    target: torch.Tensor  # of [v = y_i]
    uniform: Optional[torch.Tensor]  # u_i, of w_v; None without label smoothing


class EntropyTerm(NamedTuple):
    """The entropy's part of the logits' gradient, ``scale[i] * p_iv * (z_iv - mean_logit[i])``
    (scale = minus the entropy's upstream gradient; :func:`entropy_and_gradient_terms`), off
    the target: ``scale * p_y (z_y - mu)`` is added to the row's target entry, from
    :func:`entropy_and_gradient_terms`, where it does not cancel."""

    scale: torch.Tensor  # float32 (N,)
    mean_logit: torch.Tensor  # float32 (N,)


class RankOneTerm(NamedTuple):
    """The label smoothing's term of the logits' gradient, ``scale[i] * weight[v]``, with a
    softcap times ``1 - tanh^2``: its products add ``closed_form_scale()[i] * weight[v]``, the
    tiles hold the rest (module docstring)."""

    scale: Optional[torch.Tensor]  # float32 (N,): u
    weight: Optional[torch.Tensor]  # float32 (V,); None: every class weighs 1
    curvature_mean: Optional[torch.Tensor] = None  # float32 (N,): kappa; None without softcap

    def closed_form_scale(self) -> torch.Tensor:
        """u, or with a softcap u (1 - kappa): the row factor of what the products add."""
        if self.curvature_mean is None:
            return self.scale
        return self.scale * (1 - self.curvature_mean)


class LossWeighting(NamedTuple):
    """F.cross_entropy's ``weight`` and ``label_smoothing`` (already checked by cce.loss)."""

    weight: Optional[torch.Tensor] = None  # (V,), compute dtype; None: every class weighs 1
    label_smoothing: float = 0.0

    def to(self, device: torch.device) -> "LossWeighting":
        """The same, with the weights on ``device``."""
        return self._replace(weight=None if self.weight is None else self.weight.to(device))

    def target_weight(self, targets: torch.Tensor) -> torch.Tensor:
        """float32 (N,) weight of each token's target, 0 where ``targets`` is -1 (ignored)."""
        valid = targets >= 0
        if self.weight is None:
            return valid.float()
        return torch.where(valid, self.weight[targets.clamp(min=0)], 0.0)

    def target_weight_sum(self, targets: torch.Tensor) -> torch.Tensor:
        """What "mean" divides by: the summed weights of the non-ignored targets (their count,
        exact, without weights)."""
        if self.weight is None:
            return (targets >= 0).sum()
        return self.target_weight(targets).sum()

    def weight_sum(self, vocab_size: int) -> float | torch.Tensor:
        """W, the sum of the class weights."""
        return vocab_size if self.weight is None else self.weight.sum()

    def token_loss(self, cross_entropy: torch.Tensor, lse: torch.Tensor,
                   logit_sum: Optional[torch.Tensor], targets: torch.Tensor,
                   vocab_size: int) -> torch.Tensor:
        """F.cross_entropy's per-token loss from the plain one (``cross_entropy``, L - z_y),
        ``lse`` and ``logit_sum`` (m; needed with label smoothing only): float32 (N,), 0 at
        ignored tokens (``targets`` -1)."""
        smoothing = self.label_smoothing
        if not smoothing and self.weight is None:  # the plain loss: two operations, not six
            return torch.where(targets >= 0, cross_entropy, 0.0)
        loss = (1 - smoothing) * self.target_weight(targets) * cross_entropy
        if smoothing:
            loss = loss + smoothing / vocab_size * (self.weight_sum(vocab_size) * lse - logit_sum)
        return torch.where(targets >= 0, loss, 0.0)

    def rank_one_term(self, uniform: torch.Tensor, curvature_sum: Optional[torch.Tensor],
                      vocab_size: int) -> RankOneTerm:
        """The smoothing's term of the gradient from ``uniform`` (u, :meth:`gradient_scales`)
        and, with a softcap, ``curvature_sum`` (each row's ``sum_v w_v t_iv^2``)."""
        if curvature_sum is None:
            return RankOneTerm(uniform, self.weight)
        # Any kappa splits the term exactly: 0 where the weights sum to 0, not NaN.
        weight_sum = self.weight_sum(vocab_size)
        kappa = (curvature_sum / weight_sum if self.weight is None
                 else torch.where(weight_sum != 0, curvature_sum / weight_sum, 0.0))
        return RankOneTerm(uniform, self.weight, kappa)

    def gradient_scales(self, grad_loss: torch.Tensor, targets: torch.Tensor,
                        vocab_size: int) -> GradientScales:
        """The factors of the gradient of ``sum(grad_loss * loss)`` with respect to the logits
        (module docstring); 0 at ignored tokens (``targets`` -1)."""
        grad = torch.where(targets >= 0,
                           grad_loss.to(torch.promote_types(grad_loss.dtype, torch.float32)), 0.0)
        smoothing = self.label_smoothing
        target = grad * ((1 - smoothing) * self.target_weight(targets))
        if not smoothing:
            return GradientScales(target, target, None)
        softmax = target + grad * (smoothing * self.weight_sum(vocab_size) / vocab_size)
        return GradientScales(softmax, target, grad * (-smoothing / vocab_size))


def lse_and_cross_entropy(other_lse: torch.Tensor, target_logit: torch.Tensor,
                          targets: torch.Tensor) -> "tuple[torch.Tensor, torch.Tensor]":
    """Each row's LSE and its plain cross-entropy ``L - z_y`` (float32 (N,)) from the LSE of its
    non-target logits (``other_lse``; of all of them where ``targets`` is -1) and its target's
    logit (module docstring). A row with a +inf logit has a NaN loss, as in PyTorch, whose
    log_softmax subtracts the row's maximum first (inf - inf)."""
    lse = torch.where(targets >= 0, torch.logaddexp(other_lse, target_logit), other_lse)
    # log(1 + exp(O - z_y)): the cross-entropy to its last bit where p_y is near 1 (and, past
    # softplus's default threshold of 20, where it is float64).
    cross_entropy = torch.nn.functional.softplus(other_lse - target_logit, threshold=40)
    return lse, torch.where(lse == float("inf"), float("nan"), cross_entropy)


def target_complement(other_lse: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """``1 - p_y`` of each row, float32 (N,): the softmax mass of its non-target entries (all of
    them where the row has no target), NaN where the LSE is +inf (PyTorch's softmax there)."""
    return torch.where(lse == float("inf"), float("nan"), torch.exp(other_lse - lse))


def entropy_and_gradient_terms(other_entropy: torch.Tensor, other_lse: torch.Tensor,
                               target_logit: torch.Tensor, lse: torch.Tensor,
                               cross_entropy: torch.Tensor, complement: torch.Tensor,
                               targets: torch.Tensor
                               ) -> "tuple[torch.Tensor, torch.Tensor, torch.Tensor]":
    """Each row's softmax entropy ``H = sum_v p_v (L - z_v)``, its mean logit ``mu = L - H``
    and the entropy's gradient at its target, ``p_y (z_y - mu)`` (0 without a target), float32
    (N,), from the entropy ``H_o`` and LSE ``O`` of its non-target logits (of all of them where
    ``targets`` is -1), its target's logit, its LSE, plain cross-entropy ``L - z_y`` and
    ``1 - p_y`` (``complement``, q):

        H = p_y (L - z_y) + q (softplus(z_y - O) + H_o),   z_y - mu = q (z_y - O + H_o).

    Every term of H is positive, so H keeps its relative precision where the model is sure
    (``L - sum_v p_v z_v`` would cancel to the LSE's last bits), and p_y is ``exp(-(L - z_y))``,
    precise where it is small too (``1 - q`` is 0 where p_y is below L's last bit). The
    entropy's gradient with respect to ``z_v`` is ``-p_v (z_v - mu)``."""
    has_target = targets >= 0
    gap = target_logit - other_lse
    target_probability = torch.exp(-cross_entropy)
    # A part of no mass adds 0, also where its factor is infinite (a target of the only logit,
    # or of a -inf logit): == 0 rather than > 0, so that NaN still propagates.
    target_part = torch.where(target_probability == 0, 0.0, target_probability * cross_entropy)
    other_part = torch.where(complement == 0, 0.0,
                             complement * (torch.nn.functional.softplus(gap, threshold=40)
                                           + other_entropy))
    entropy = torch.where(has_target, target_part + other_part, other_entropy)
    target_term = torch.where(has_target & (target_probability != 0) & (complement != 0),
                              target_probability * complement * (gap + other_entropy), 0.0)
    return entropy, lse - entropy, target_term


def target_entry(scales: GradientScales, complement: torch.Tensor) -> torch.Tensor:
    """Each row's gradient of the logits at its target, ``softmax * p_y - target``, written as
    ``(softmax - target) - softmax (1 - p_y)`` (``scales``: :meth:`LossWeighting.gradient_scales`
    with the LSE's upstream gradient in ``softmax``; ``complement``:
    :func:`target_complement`): exact where p_y is near 1."""
    return (scales.softmax - scales.target) - scales.softmax * complement


def first_largest(values: torch.Tensor, indices: torch.Tensor
                  ) -> "tuple[torch.Tensor, torch.Tensor]":
    """Of candidates ``(values[k, i], indices[k, i])`` for the argmax of row i (partials over
    parts of its vocabulary), the largest value and, of equal ones, the smallest index."""
    largest = values.max(dim=0).values
    return largest, torch.where(values == largest, indices,
                                torch.iinfo(indices.dtype).max).min(dim=0).values


def argmax_or_none(argmax: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """-1 for the rows whose LSE is NaN: their logits hold a NaN, whose index the kernels do not
    look for (torch.argmax would give it)."""
    return torch.where(lse.isnan(), -1, argmax)


def entropy_of_parts(entropies: torch.Tensor, lses: torch.Tensor,
                     lse: torch.Tensor) -> torch.Tensor:
    """A row's softmax entropy from those of disjoint parts of its entries (``entropies[k, i]``,
    each of its part's softmax, of LSE ``lses[k, i]``; ``lse``: of their union):
    ``sum_k w_k (H_k + L - L_k)``, w_k = exp(L_k - L) the part's share of the mass. Every term
    is positive (0 for a part of no mass)."""
    weights = torch.exp(lses - torch.where(lse.abs() == float("inf"), 0.0, lse))
    return torch.where(weights > 0, weights * (entropies + (lse - lses)), 0.0).sum(dim=0)
