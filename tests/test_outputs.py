"""Temperature and z-loss: the logits divided by a temperature, the squared log-normalizer added
to the loss; per-token log-probabilities for RL; the entropy and argmax of every row
(``return_entropy``, ``return_argmax``). Every computing implementation against the float64
reference (tests/reference.py), on sizes that are not multiples of the kernels' blocks.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch

import cce
from cce.backward.plan import BackwardPlan, forced
from tests.helpers import (INTERPRETER_NON_FINITE_WARNINGS, V, Inputs, assert_matches,
                           confident_inputs, make_grad_output, make_inputs, peaked_inputs,
                           relative_error, run, run_reference, tolerances)
from tests.reference import reference

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
                         temperature=0.8, weight=torch.rand(V, generator=gen).to(device))
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
    ("z_loss", -1e-4), ("z_loss", math.inf), ("z_loss", math.nan), ("z_loss", None),
    *((flag, value) for flag in ("return_entropy", "return_argmax") for value in (1, "yes", None))])
def test_bad_values_of_the_new_options_raise_naming_them(option: str, value, device: str) -> None:
    e = torch.randn(4, 8, device=device)
    c = torch.randn(10, 8, device=device)
    targets = torch.zeros(4, dtype=torch.long, device=device)
    with pytest.raises(ValueError, match=option):
        cce.linear_cross_entropy(e, c, targets, **{option: value})
    with pytest.raises(ValueError, match=option):
        cce.LinearCrossEntropy(**{option: value})


# --- Entropy and argmax (return_entropy, return_argmax) ----------------------------------------
#
# ``H_i = sum_v p_iv (L_i - z_iv)`` of the softmax of the logits ``z = softcap(e @ c.T + bias) /
# temperature`` (L the row's lse), for every position of e (ignored ones and the last ``shift``
# ones too: it does not depend on the targets), in the loss's dtype and differentiable; the
# index of every row's largest logit, int64 (the first of equal ones and a NaN as the largest,
# as torch.argmax). Both have the shape of ``targets``.


def record(what: str, **errors: float) -> None:
    """Print measured errors: shown with ``pytest -s`` (and in a failing test's report)."""
    print(f"{what}: " + ", ".join(f"{name} {value:.2e}" for name, value in errors.items()))


@pytest.mark.parametrize("softcap", [None, 20.0], ids=["no-cap", "cap"])
@pytest.mark.parametrize("impl", COMPUTE_IMPLS)
def test_entropy_and_its_gradient_match_float64(impl: str, softcap, device: str,
                                                gen: torch.Generator) -> None:
    """float32, exact gradients (filter_eps=None): the entropy of every position and the
    gradients of ``sum(loss * g) + sum(lse * g_lse) + sum(entropy * g_entropy)`` with random
    upstream gradients, with bias, temperature, shift and ignored targets; the argmax too.
    (3 x 15 tokens, V = 700, D = 40: multiples of no block.)"""
    inputs = make_inputs(gen, device, torch.float32, shape=(3, 15), vocab=700, dim=40,
                         bias=True, softcap=softcap, temperature=0.7, shift=2)
    grad_output = make_grad_output(gen, inputs, "none")
    grad_lse = torch.randn(inputs.targets.shape, generator=gen).to(device)
    grad_entropy = torch.randn(inputs.targets.shape, generator=gen).to(device)
    ours = run(impl, inputs, grad_output, grad_lse, grad_entropy, reduction="none",
               filter_eps=None, return_argmax=True)
    ref = run_reference(inputs, grad_output, grad_lse, grad_entropy, reduction="none")
    assert_matches(ours, ref, impl, torch.float32, inputs.targets, "none")
    # Positions that are not scored (an ignored target two further, the last two) have theirs.
    unscored = torch.ones_like(inputs.targets, dtype=torch.bool)
    unscored[:, :-2] = inputs.targets[:, 2:] == -100
    assert unscored.sum() > 6
    assert relative_error(ours.entropy[unscored], ref.entropy[unscored]) <= 1e-5
    # The entropy's term weighs in the gradients: without it they are far from these.
    without = run_reference(inputs, grad_output, grad_lse, reduction="none")
    assert relative_error(without.grad_e, ref.grad_e) > 1e-2


def test_deterministic_entropy_and_argmax_repeat_bit_for_bit(device: str,
                                                             gen: torch.Generator) -> None:
    """deterministic=True: entropy, argmax and the entropy's gradients are the same bits in
    every call (the partial entropies merge in a fixed order), and match float64."""
    inputs = make_inputs(gen, device, torch.float32, shape=(40,), vocab=900, dim=24, bias=True)
    grad_output = make_grad_output(gen, inputs, "none")
    grad_entropy = torch.randn(inputs.targets.shape, generator=gen).to(device)
    runs = [run("cce", inputs, grad_output, None, grad_entropy, reduction="none",
                return_argmax=True, deterministic=True) for _ in range(2)]
    for name in ("loss", "entropy", "argmax", "grad_e", "grad_c", "grad_bias"):
        assert torch.equal(getattr(runs[0], name), getattr(runs[1], name)), name
    ref = run_reference(inputs, grad_output, None, grad_entropy, reduction="none")
    assert_matches(runs[0], ref, "cce", torch.float32, inputs.targets, "none")


def test_16_bit_entropy_gradient_with_the_default_filter_is_as_accurate_as_the_loss_gradient(
        device: str, gen: torch.Generator) -> None:
    """bfloat16, default filter, on language-model-like rows (a peaked, Zipf-like softmax whose
    targets are its likeliest tokens) where the filter skips tiles: the gradient of
    ``sum(entropy * g_entropy)`` alone is within the loss gradient's tolerance for the kernels
    in bfloat16, as the loss's own gradient is (errors against float64, printed with -s; on
    CPU: live tiles 0.19, loss dE/dC 2.5e-3/2.4e-3, entropy dE/dC 2.7e-3/3.3e-3 against 4e-3,
    of which 2.4e-3/3.2e-3 without the filter: mostly the bfloat16 rounding of dE and dC)."""
    e, c, targets = peaked_inputs(gen, device, 48, 900, 40)
    targets = torch.where(targets >= 0, (e @ c.T).argmax(dim=1), -1)
    inputs = Inputs(e.bfloat16(), c.bfloat16(), targets, options=dict(ignore_index=-1))
    grad_tol = tolerances("cce", torch.bfloat16)[1]

    grad_output = torch.tensor(1.0, device=device)
    no_loss = torch.tensor(0.0, device=device)
    # An entropy bonus over the scored tokens (padding's rows have an entropy, but no bonus).
    grad_entropy = torch.where(targets >= 0, torch.randn(targets.shape, generator=gen).to(device),
                               0.0)
    # The plans record each backward's live table: below 1 where the filter skips tiles.
    with forced() as plans:
        loss_only = run("cce", inputs, grad_output)
        entropy_only = run("cce", inputs, no_loss, grad_entropy=grad_entropy)
    live_fractions = [plan.live_tiles.float().mean().item() for plan in plans
                      if isinstance(plan, BackwardPlan)]
    loss_ref = run_reference(inputs, grad_output)
    entropy_ref = run_reference(inputs, no_loss, grad_entropy=grad_entropy)

    errors = {"loss dE": relative_error(loss_only.grad_e, loss_ref.grad_e),
              "loss dC": relative_error(loss_only.grad_c, loss_ref.grad_c),
              "entropy dE": relative_error(entropy_only.grad_e, entropy_ref.grad_e),
              "entropy dC": relative_error(entropy_only.grad_c, entropy_ref.grad_c),
              "entropy": relative_error(entropy_only.entropy, entropy_ref.entropy)}
    record(f"bf16 default filter, live tiles {live_fractions}", **errors)
    assert len(live_fractions) == 2 and max(live_fractions) < 1, (
        f"the filter skipped no tile: live fractions {live_fractions}")
    assert errors["entropy"] <= tolerances("cce", torch.bfloat16)[0]
    failed = {name: error for name, error in errors.items()
              if name != "entropy" and not error <= grad_tol}
    assert not failed, f"relative errors above the loss gradient's {grad_tol:.0e}: {failed}"


# A float32 implementation that sums H as ``p_y (L - z_y) + (1 - p_y)(L - mean_p of the other
# logits)``, with ``L - z_y`` and ``1 - p_y`` from the other logits' sum, keeps H's relative
# precision when p_y -> 1 (measured on these inputs: 6e-6 for cce and cce_torch, 5e-6 for that
# formula in float32 PyTorch operations, 2e-8 for impl "torch" on float64 inputs, and 1.8, i.e.
# nothing, for float32 materialized logits, whose ``L - z_y`` cancels): a bound of 1e-4.
CONFIDENT_ENTROPY_BOUND = 1e-4


@pytest.mark.parametrize("impl", ["cce", "cce_torch"])
def test_entropy_of_confident_rows_keeps_its_relative_precision(impl: str, device: str,
                                                                gen: torch.Generator) -> None:
    """float32 rows where ``1 - p_target`` is about 1e-7 (entropies 2e-6 to 5e-5): every row's
    entropy within CONFIDENT_ENTROPY_BOUND of float64, relatively."""
    e, c, targets = confident_inputs(gen, device, torch.float32, 40, 500, 40, 1e-7)
    expected = reference(e, c, targets).entropy

    def worst_row_error(entropy: torch.Tensor) -> float:
        return ((entropy.double() - expected) / expected).abs().max().item()

    _, entropy = cce.linear_cross_entropy(e, c, targets, impl=impl, filter_eps=None,
                                          return_entropy=True)
    _, float64_entropy = cce.linear_cross_entropy(e.double(), c.double(), targets, impl="torch",
                                                  return_entropy=True)
    error = worst_row_error(entropy)
    record(f"confident rows, {impl}", float32=error, torch_float64=worst_row_error(
        float64_entropy))
    assert worst_row_error(float64_entropy) <= 1e-6  # the bound is not the reference's error
    assert error <= CONFIDENT_ENTROPY_BOUND, (
        f"{impl}: worst relative error of a row's entropy {error:.1e}")


ARGMAX_CASES = [("cce", torch.float32, True), ("cce", torch.float32, False),
                ("cce", torch.bfloat16, True), ("cce_torch", torch.float32, True),
                ("torch", torch.float32, True)]
ARGMAX_IDS = ["cce-fp32-sorted", "cce-fp32-unsorted", "cce-bf16-sorted", "cce_torch", "torch"]


def _argmax(impl: str, e: torch.Tensor, c: torch.Tensor, targets: torch.Tensor,
            vocab_sorting: bool = True, **options) -> torch.Tensor:
    """The argmax of a call made as in training: inputs that require grad and the default
    filter, under which the kernels' forward sorts the vocabulary (``vocab_sorting``)."""
    e = e.detach().requires_grad_()
    c = c.detach().requires_grad_()
    _, argmax = cce.linear_cross_entropy(e, c, targets, impl=impl, return_argmax=True,
                                         vocab_sorting=vocab_sorting, **options)
    assert argmax.dtype == torch.int64 and argmax.shape == targets.shape
    return argmax


@pytest.mark.parametrize("impl, dtype, vocab_sorting", ARGMAX_CASES, ids=ARGMAX_IDS)
def test_argmax_is_the_float64_logits_argmax(impl: str, dtype: torch.dtype,
                                             vocab_sorting: bool, device: str,
                                             gen: torch.Generator) -> None:
    """Random inputs (no near ties) with bias, softcap and a batch dimension."""
    inputs = make_inputs(gen, device, dtype, shape=(2, 23), vocab=600, dim=36, bias=True)
    argmax = _argmax(impl, inputs.e, inputs.c, inputs.targets, vocab_sorting,
                     bias=inputs.bias.detach().requires_grad_(), softcap=20.0)
    expected = reference(inputs.e, inputs.c, inputs.targets, bias=inputs.bias,
                         softcap=20.0).argmax
    assert torch.equal(argmax.cpu(), expected.cpu())


@pytest.mark.parametrize("impl, dtype, vocab_sorting", ARGMAX_CASES, ids=ARGMAX_IDS)
def test_argmax_of_equal_logits_is_the_first(impl: str, dtype: torch.dtype, vocab_sorting: bool,
                                             device: str, gen: torch.Generator) -> None:
    """Ties, as torch.argmax: the smaller index. The inputs are small integers and eighths, so
    that every logit is exact in float32 (and every input in bfloat16) whatever the order of
    the sums: ties are exact. Rows of c are duplicated (in one vocabulary block, across blocks,
    the copy before or after its original) and given a large component along e's rows, so
    that the duplicated pair holds the largest logit of those rows."""
    num_tokens, vocab, dim = 40, 600, 36
    e = torch.randint(-3, 4, (num_tokens, dim), generator=gen).float()
    c = torch.randint(-4, 5, (vocab, dim), generator=gen).float() / 8
    pairs = ((3, 7), (200, 130), (20, 450), (599, 5))  # (original, copy)
    for index, (original, copy) in enumerate(pairs):
        rows = slice(index * 8, (index + 1) * 8)
        c[original, index] = 16.0  # a logit of 48 + ... where e[i, index] is 3: the largest
        c[copy] = c[original]
        e[rows, :len(pairs)] = 0.0  # no other pair's large component
        e[rows, index] = 3.0
    targets = torch.randint(0, vocab, (num_tokens,), generator=gen)
    e, c, targets = e.to(device, dtype), c.to(device, dtype), targets.to(device)
    logits = e.double() @ c.double().T
    expected = logits.argmax(dim=1)
    for index, (original, copy) in enumerate(pairs):
        assert (expected[index * 8:(index + 1) * 8] == min(original, copy)).all()  # the setup
    argmax = _argmax(impl, e, c, targets, vocab_sorting)
    assert torch.equal(argmax.cpu(), expected.cpu()), (
        f"rows {(argmax.cpu() != expected.cpu()).nonzero().flatten().tolist()}")


@INTERPRETER_NON_FINITE_WARNINGS
@pytest.mark.parametrize("impl", COMPUTE_IMPLS)
def test_argmax_of_all_minus_inf_logits_is_0(impl: str, device: str,
                                             gen: torch.Generator) -> None:
    """float32, a bias of -inf everywhere: every logit is -inf, and torch.argmax gives 0."""
    inputs = make_inputs(gen, device, torch.float32, shape=(30,), vocab=500, dim=32,
                         ignored_fraction=1.0)
    bias = torch.full((500,), -torch.inf, device=device)
    argmax = _argmax(impl, inputs.e, inputs.c, inputs.targets, bias=bias, reduction="none")
    assert torch.equal(argmax.cpu(), torch.zeros(30, dtype=torch.int64))


@INTERPRETER_NON_FINITE_WARNINGS
@pytest.mark.parametrize("impl", COMPUTE_IMPLS)
def test_argmax_of_a_row_with_nan_logits_is_the_first_nan_or_minus_1(
        impl: str, device: str, gen: torch.Generator) -> None:
    """float32: the materializing paths count a NaN as larger than any logit, +inf included,
    as torch.argmax does; the kernels, which do not look for it, give -1 for such a row (its
    LSE is NaN). An inf in e gives ``inf * 0 = NaN`` logits where c's column is 0 (at 300 and
    450), and +inf or -inf elsewhere; a NaN in e makes the whole row NaN (argmax 0)."""
    inputs = make_inputs(gen, device, torch.float32, shape=(30,), vocab=500, dim=32,
                         ignored_fraction=1.0)
    e, c = inputs.e.clone(), inputs.c.clone()
    c[[300, 450], 0] = 0.0
    e[2, 0] = torch.inf
    e[9, 0] = -torch.inf
    e[5, 1] = torch.nan
    expected = (e @ c.T).argmax(dim=1)
    assert expected[2] == 300 and expected[9] == 300 and expected[5] == 0  # the setup
    if impl == "cce":
        expected[[2, 5, 9]] = -1
    argmax = _argmax(impl, e, c, inputs.targets, reduction="none")
    assert torch.equal(argmax.cpu(), expected.cpu()), (
        f"rows {(argmax.cpu() != expected.cpu()).nonzero().flatten().tolist()}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64],
                         ids=["fp32", "bf16", "fp64"])
@pytest.mark.parametrize("impl", ["cce", "torch"])
def test_outputs_come_in_order_loss_lse_entropy_argmax(impl: str, dtype: torch.dtype,
                                                       device: str,
                                                       gen: torch.Generator) -> None:
    """Every combination of return_lse, return_entropy and return_argmax, from the function
    and from ``cce.LinearCrossEntropy``, with reduction "none" and "mean": the loss alone
    without a flag, else a tuple of the loss and, in this order, the lse, entropy and argmax of
    the flags set; each with the shape of targets, the entropy in the loss's dtype (float32,
    float64 for float64 inputs), the argmax int64; the same values in every combination (the
    argmax exactly, the others to 1e-6)."""
    inputs = make_inputs(gen, device, dtype, shape=(2, 5), vocab=50, dim=16)
    loss_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    for reduction in ("none", "mean"):
        options = dict(impl=impl, reduction=reduction)
        everything = cce.linear_cross_entropy(inputs.e, inputs.c, inputs.targets,
                                              return_lse=True, return_entropy=True,
                                              return_argmax=True, **options)
        loss_shape = inputs.targets.shape if reduction == "none" else torch.Size([])
        for flags in itertools.product([False, True], repeat=3):
            named = dict(zip(("return_lse", "return_entropy", "return_argmax"), flags))
            calls = {"function": cce.linear_cross_entropy(inputs.e, inputs.c, inputs.targets,
                                                          **named, **options),
                     "module": cce.LinearCrossEntropy(**named, **options)(
                         inputs.e, inputs.c, inputs.targets)}
            for how, outputs in calls.items():
                what = f"{how}, {reduction}, {named}"
                if not any(flags):
                    assert isinstance(outputs, torch.Tensor), what
                    outputs = (outputs,)
                assert isinstance(outputs, tuple) and len(outputs) == 1 + sum(flags), what
                wanted = [0] + [1 + index for index, flag in enumerate(flags) if flag]
                for position, output in zip(wanted, outputs):
                    name = ("loss", "lse", "entropy", "argmax")[position]
                    shape = loss_shape if name == "loss" else inputs.targets.shape
                    out_dtype = torch.int64 if name == "argmax" else loss_dtype
                    assert output.shape == shape and output.dtype == out_dtype, (what, name)
                    if name == "argmax":
                        assert torch.equal(output, everything[position]), what
                    else:
                        assert relative_error(output, everything[position]) <= 1e-6, (what,
                                                                                       name)


@pytest.mark.parametrize("impl", ["cce", "cce_torch"])
def test_rl_log_probs_and_entropy_bonus_from_one_call(impl: str, device: str,
                                                      gen: torch.Generator) -> None:
    """An RL step's recipe: the per-token log-probabilities of the sampled tokens (``-loss``,
    reduction "none") and the policy's entropy under the sampling temperature 0.7, from one
    call with ``return_entropy=True``; ``(advantages * logp).sum() + 0.01 * entropy.sum()``
    has the float64 value and gradients of ``log_softmax(logits / T)`` and the entropy of
    ``softmax(logits / T)``."""
    temperature, bonus = 0.7, 0.01
    inputs = make_inputs(gen, device, torch.float32, shape=(2, 19), vocab=600, dim=40,
                         ignored_fraction=0.0)
    e = inputs.e.detach().requires_grad_()
    c = inputs.c.detach().requires_grad_()
    loss, entropy = cce.linear_cross_entropy(e, c, inputs.targets, reduction="none",
                                             temperature=temperature, return_entropy=True,
                                             impl=impl, filter_eps=None)
    log_probs = -loss
    advantages = torch.randn(inputs.targets.shape, generator=gen).to(device)
    objective = (advantages * log_probs).sum() + bonus * entropy.sum()
    (-objective).backward()

    e64 = inputs.e.double().requires_grad_()
    c64 = inputs.c.double().requires_grad_()
    log_softmax = torch.log_softmax((e64 @ c64.T) / temperature, dim=-1)
    expected_log_probs = log_softmax.gather(-1, inputs.targets.unsqueeze(-1)).squeeze(-1)
    expected_entropy = -(log_softmax.exp() * log_softmax).sum(-1)
    expected = (advantages.double() * expected_log_probs).sum() + bonus * expected_entropy.sum()
    (-expected).backward()
    assert relative_error(log_probs, expected_log_probs) <= 1e-5
    assert relative_error(entropy, expected_entropy) <= 1e-5
    assert relative_error(objective, expected) <= 1e-5
    assert relative_error(e.grad, e64.grad) <= 1e-5
    assert relative_error(c.grad, c64.grad) <= 1e-5
