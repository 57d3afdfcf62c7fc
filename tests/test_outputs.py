"""Temperature and z-loss: the logits divided by a temperature, the squared log-normalizer added
to the loss; per-token log-probabilities for RL. Every computing implementation against the
float64 reference (tests/reference.py), on sizes that are not multiples of the kernels' blocks.
"""

from __future__ import annotations

import math

import pytest
import torch

import cce
from tests.helpers import (assert_matches, make_grad_output, make_inputs, relative_error, run,
                           run_reference, tolerances)

COMPUTE_IMPLS = ("cce", "cce_torch", "torch")


@pytest.mark.parametrize("softcap", [None, 20.0], ids=["no-cap", "cap"])
@pytest.mark.parametrize("temperature", [0.7, 1.6])
@pytest.mark.parametrize("impl", COMPUTE_IMPLS)
def test_temperature_divides_the_capped_logits(impl: str, temperature: float, softcap,
                                               device: str, gen: torch.Generator) -> None:
    """float32: loss, lse and gradients of ``softcap(e @ c.T + bias) / temperature``."""
    inputs = make_inputs(gen, device, torch.float32, bias=True, softcap=softcap,
                         temperature=temperature)
    grad_output = make_grad_output(gen, inputs, "none")
    grad_lse = torch.randn(inputs.targets.shape, generator=gen).to(device)
    ours = run(impl, inputs, grad_output, grad_lse, reduction="none", filter_eps=None)
    ref = run_reference(inputs, grad_output, grad_lse, reduction="none")
    assert_matches(ours, ref, impl, torch.float32, inputs.targets, "none")


@pytest.mark.parametrize("temperature", [0.5, 0.7])
def test_16_bit_temperature_is_as_accurate_as_16_bit_logits(temperature: float, device: str,
                                                            gen: torch.Generator) -> None:
    """bfloat16: ``e / temperature`` is rounded to bfloat16 (exact for a power of two), so the
    kernels are within the materialized 16-bit logits' tolerance at any temperature, and
    within their own at 0.5."""
    inputs = make_inputs(gen, device, torch.bfloat16, temperature=temperature)
    grad_output = make_grad_output(gen, inputs, "mean")
    ours = run("cce", inputs, grad_output, filter_eps=None)
    ref = run_reference(inputs, grad_output)
    impl_of_tolerance = "cce" if temperature == 0.5 else "torch"
    assert_matches(ours, ref, impl_of_tolerance, torch.bfloat16, inputs.targets, "mean")


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("impl", COMPUTE_IMPLS)
def test_z_loss_adds_the_weighted_squared_lse(impl: str, reduction: str, device: str,
                                              gen: torch.Generator) -> None:
    """``z_loss * lse^2`` per scored token, times its target's class weight, reduced as the
    cross-entropy (``mean`` over the summed weights), 0 at ignored tokens; with shift and a
    temperature."""
    inputs = make_inputs(gen, device, torch.float32, shape=(3, 13), z_loss=1e-2, shift=1,
                         temperature=0.8, weight=torch.rand(1000, generator=gen).to(device))
    grad_output = make_grad_output(gen, inputs, reduction)
    ours = run(impl, inputs, grad_output, reduction=reduction, filter_eps=None)
    ref = run_reference(inputs, grad_output, reduction=reduction)
    assert_matches(ours, ref, impl, torch.float32, inputs.targets, reduction)
    without = run(impl, inputs, grad_output, reduction=reduction, filter_eps=None, z_loss=0.0)
    assert relative_error(without.loss, ref.loss) > 1e-3  # the term is there


def test_z_loss_with_the_default_filter_stays_within_the_loss_tolerance(
        device: str, gen: torch.Generator) -> None:
    """The lse's gradient is dense (softmax): the filter's tiles and correction carry it as the
    loss's own (bfloat16, default filter, against the same call without z_loss)."""
    inputs = make_inputs(gen, device, torch.bfloat16, z_loss=1e-3)
    grad_output = make_grad_output(gen, inputs, "mean")
    ours = run("cce", inputs, grad_output)
    ref = run_reference(inputs, grad_output)
    assert relative_error(ours.loss, ref.loss) <= tolerances("cce", torch.bfloat16)[0]
    assert relative_error(ours.grad_e, ref.grad_e) <= 2e-2  # the filter's error, bf16


def test_rl_log_probs_and_their_gradient_under_a_temperature(device: str,
                                                             gen: torch.Generator) -> None:
    """The README's recipe: per-token log-probabilities of the sampled tokens under a sampling
    temperature are ``-loss`` with ``reduction="none"``; a policy-gradient loss built from them
    has the float64 gradient."""
    temperature = 0.9
    inputs = make_inputs(gen, device, torch.float32, shape=(2, 19), ignored_fraction=0.0)
    e = inputs.e.detach().requires_grad_()
    c = inputs.c.detach().requires_grad_()
    log_probs = -cce.linear_cross_entropy(e, c, inputs.targets, reduction="none",
                                          temperature=temperature, filter_eps=None)
    advantages = torch.randn(inputs.targets.shape, generator=gen).to(device)
    (-(advantages * log_probs).sum()).backward()

    e64 = inputs.e.double().requires_grad_()
    c64 = inputs.c.double().requires_grad_()
    expected = torch.log_softmax((e64 @ c64.T) / temperature, dim=-1).gather(
        -1, inputs.targets.unsqueeze(-1)).squeeze(-1)
    (-(advantages.double() * expected).sum()).backward()
    assert relative_error(log_probs, expected) <= 1e-5
    assert relative_error(e.grad, e64.grad) <= 1e-5
    assert relative_error(c.grad, c64.grad) <= 1e-5


@pytest.mark.parametrize("option, value", [
    ("temperature", 0.0), ("temperature", -1.0), ("temperature", math.inf),
    ("temperature", math.nan), ("temperature", "1"), ("temperature", True),
    ("z_loss", -1e-4), ("z_loss", math.inf), ("z_loss", math.nan), ("z_loss", None)])
def test_bad_temperature_or_z_loss_raise_naming_it(option: str, value, device: str) -> None:
    e = torch.randn(4, 8, device=device)
    c = torch.randn(10, 8, device=device)
    targets = torch.zeros(4, dtype=torch.long, device=device)
    with pytest.raises(ValueError, match=option):
        cce.linear_cross_entropy(e, c, targets, **{option: value})
    with pytest.raises(ValueError, match=option):
        cce.LinearCrossEntropy(**{option: value})
