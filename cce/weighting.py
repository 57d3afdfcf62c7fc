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
(:func:`lse_and_cross_entropy`, :func:`target_complement`).

Every implementation gets a :class:`LossWeighting` and returns F.cross_entropy's per-token loss
(``reduction="none"``); :mod:`cce.loss` reduces it. Those that build no logits compute the plain
pieces (L, z_iy, m) and use :meth:`LossWeighting.token_loss` and
:meth:`LossWeighting.gradient_scales` for the rest.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch


class GradientScales(NamedTuple):
    """Per-token float32 (N,) factors of the gradient of the logits (module docstring)."""

    softmax: torch.Tensor  # of p_iv; the LSE's own upstream gradient is not included
    target: torch.Tensor  # of [v = y_i]
    uniform: Optional[torch.Tensor]  # u_i, of w_v; None without label smoothing


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


def target_entry(scales: GradientScales, complement: torch.Tensor) -> torch.Tensor:
    """Each row's gradient of the logits at its target, ``softmax * p_y - target``, written as
    ``(softmax - target) - softmax (1 - p_y)`` (``scales``: :meth:`LossWeighting.gradient_scales`
    with the LSE's upstream gradient in ``softmax``; ``complement``:
    :func:`target_complement`): exact where p_y is near 1."""
    return (scales.softmax - scales.target) - scales.softmax * complement
