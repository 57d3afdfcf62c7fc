"""Specification of ``cce.linear_cross_entropy`` by comparison with a float64 reference.

Every implementation computes ``F.cross_entropy(softcap(e @ c.T + bias), targets)`` and its
gradients. Each test builds random inputs (seeded from the test id), runs an implementation and
the float64 reference on the same rounded values, and compares loss, lse, dE, dC and dbias by
relative error (see ``tests.helpers.tolerances``). The upstream gradient is random, so gradient
scaling is always checked too.

Sizes are deliberately not multiples of the kernels' block sizes: N=37 tokens, V=600, D=72.
"torch_compile" and "chunked" compile on first use (slow on CPU), so they appear only in the
main grid and in two torch_compile tests; the option tests run "cce" and "torch".
"""

from __future__ import annotations

import math
from typing import Optional

import pytest
import torch
from torch import nn

import cce
from tests.helpers import (D, DTYPE_IDS, DTYPES, INTERPRETER_NON_FINITE_WARNINGS, N, V, Inputs,
                           assert_matches, check, confident_inputs, make_grad_output,
                           make_inputs, pytorch_errors, run, run_reference, same_non_finite,
                           tolerances)
from tests.reference import Result, reference, relative_error

IMPLS = ("cce", "torch", "chunked")
OPTION_IMPLS = ("cce", "torch")  # implementations exercised by the per-option tests
REDUCTIONS = ("mean", "sum", "none")

dtypes = pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)


# --- The main case: every implementation, dtype and reduction --------------------------------


@pytest.mark.parametrize("reduction", REDUCTIONS)
@dtypes
@pytest.mark.parametrize("impl", IMPLS)
def test_matches_reference(impl: str, dtype: torch.dtype, reduction: str, device: str,
                           gen: torch.Generator) -> None:
    """Loss, lse, dE and dC match the reference; 10% of the targets are ignore_index=-100."""
    check(impl, make_inputs(gen, device, dtype), gen, reduction)


@pytest.mark.parametrize(
    "n, vocab, dim, dtype",
    [(1, 7, 5, torch.float32),         # far smaller than one block
     (33, 129, 33, torch.bfloat16),    # one past a block in every dimension
     (64, 256, 64, torch.float16),     # exact multiples of the blocks
     (37, 300, 272, torch.bfloat16)],  # D = 256 + 16: the products' last columns mostly pad
    ids=["tiny", "block+1", "block-multiple", "output-columns+16"],
)
@pytest.mark.parametrize("impl", OPTION_IMPLS)
def test_block_edge_shapes(impl: str, n: int, vocab: int, dim: int, dtype: torch.dtype,
                           device: str, gen: torch.Generator) -> None:
    """Shapes below, one past, and exactly at the block sizes are handled (masking)."""
    inputs = make_inputs(gen, device, dtype, shape=(n,), vocab=vocab, dim=dim)
    check(impl, inputs, gen, "sum")


# --- Options --------------------------------------------------------------------------------


@dtypes
@pytest.mark.parametrize("impl", OPTION_IMPLS)
def test_custom_ignore_index(impl: str, dtype: torch.dtype, device: str,
                             gen: torch.Generator) -> None:
    """ignore_index=7, a valid vocabulary index: those tokens give 0 loss and no gradient."""
    inputs = make_inputs(gen, device, dtype, ignore_index=7, ignored_fraction=0.25)
    ignored = inputs.targets == 7
    assert ignored.any() and not ignored.all()
    result = check(impl, inputs, gen, "none")
    assert torch.all(result.loss[ignored] == 0)
    assert torch.all(result.loss[~ignored] > 0)
    check(impl, inputs, gen, "mean")


@pytest.mark.parametrize(
    "shift, reduction, dtype, ignore_index",
    [(0, "mean", torch.float32, -100),
     (1, "mean", torch.bfloat16, -100),
     (1, "sum", torch.float16, 7),
     (3, "none", torch.float32, -100),
     (3, "none", torch.bfloat16, 7)],
    ids=["shift0-mean-fp32", "shift1-mean-bf16", "shift1-sum-fp16-ignore7",
         "shift3-none-fp32", "shift3-none-bf16-ignore7"],
)
@pytest.mark.parametrize("impl", OPTION_IMPLS)
def test_shift_with_3d_embeddings(impl: str, shift: int, reduction: str, dtype: torch.dtype,
                                  ignore_index: int, device: str, gen: torch.Generator) -> None:
    """e of shape (B, T, D): position t is scored against targets[:, t + shift]."""
    inputs = make_inputs(gen, device, dtype, shape=(2, 19), ignore_index=ignore_index,
                         shift=shift)
    result = check(impl, inputs, gen, reduction)
    if reduction == "none" and shift:
        assert torch.all(result.loss[:, -shift:] == 0), "the last `shift` positions are ignored"


@pytest.mark.parametrize("impl", OPTION_IMPLS)
def test_shift_equals_slicing(impl: str, device: str, gen: torch.Generator) -> None:
    """shift=1 is next-token prediction: the same as slicing e[:, :-1] and targets[:, 1:]."""
    inputs = make_inputs(gen, device, torch.float32, shape=(2, 19))
    shifted = cce.linear_cross_entropy(inputs.e, inputs.c, inputs.targets, shift=1,
                                       reduction="sum", impl=impl)
    sliced = cce.linear_cross_entropy(inputs.e[:, :-1], inputs.c, inputs.targets[:, 1:],
                                      reduction="sum", impl=impl)
    assert relative_error(shifted, sliced.double()) <= 1e-6


@dtypes
@pytest.mark.parametrize("impl", OPTION_IMPLS)
def test_softcap(impl: str, dtype: torch.dtype, device: str, gen: torch.Generator) -> None:
    """softcap * tanh(logits / softcap) is applied before the softmax (large logits, cap 30)."""
    inputs = make_inputs(gen, device, dtype, scale=40.0, softcap=30.0)
    grad_output = make_grad_output(gen, inputs, "none")
    uncapped = reference(inputs.e, inputs.c, inputs.targets, reduction="none",
                         grad_output=grad_output)
    capped = run_reference(inputs, grad_output, reduction="none")
    assert relative_error(uncapped.loss, capped.loss) > 0.1, "the cap must matter in this test"
    check(impl, inputs, gen, "none")


@dtypes
@pytest.mark.parametrize("impl", OPTION_IMPLS)
def test_bias(impl: str, dtype: torch.dtype, device: str, gen: torch.Generator) -> None:
    """A (V,) bias is added to every logit row and receives a gradient."""
    inputs = make_inputs(gen, device, dtype, bias=True)
    check(impl, inputs, gen, "mean")


@dtypes
@pytest.mark.parametrize("impl", OPTION_IMPLS)
def test_all_options_together(impl: str, dtype: torch.dtype, device: str,
                              gen: torch.Generator) -> None:
    """bias + softcap + shift + custom ignore_index + 3-D e, with reduction "none"."""
    inputs = make_inputs(gen, device, dtype, shape=(2, 19), scale=20.0, bias=True,
                         ignore_index=7, softcap=30.0, shift=2)
    check(impl, inputs, gen, "none")


@pytest.mark.parametrize("layout", ["transposed", "sliced"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("impl", OPTION_IMPLS)
def test_non_contiguous_inputs(impl: str, dtype: torch.dtype, layout: str, device: str,
                               gen: torch.Generator) -> None:
    """e, c and bias may be strided views: transposed storage, or slices of larger tensors."""
    inputs = make_inputs(gen, device, dtype, shape=(2, 19), bias=True)
    if layout == "transposed":  # (2, 19, D) stored as (19, 2, D); c stored as (D, V)
        e = inputs.e.transpose(0, 1).contiguous().transpose(0, 1)
        c = inputs.c.T.contiguous().T
        bias = inputs.bias
    else:  # slices of larger tensors whose other entries are poison (1e3): strides must be used
        e = torch.cat([inputs.e, torch.full_like(inputs.e[..., :8], 1e3)], dim=-1)[..., :D]
        c = torch.stack([inputs.c, torch.full_like(inputs.c, 1e3)], dim=1).reshape(2 * V, D)[::2]
        bias = torch.stack([torch.full_like(inputs.bias, 1e3), inputs.bias], dim=1).reshape(-1)
        bias = bias[1::2]
        assert not bias.is_contiguous() and torch.equal(bias, inputs.bias)
    assert not e.is_contiguous() and not c.is_contiguous()
    assert torch.equal(e, inputs.e) and torch.equal(c, inputs.c)
    inputs.e, inputs.c, inputs.bias = e, c, bias
    check(impl, inputs, gen, "mean")


# Without a filter nothing is sorted (the order only serves the backward's skipping), so
# vocab_sorting=False without a filter would repeat the sorted case.
@pytest.mark.parametrize("filter_eps, vocab_sorting", [("auto", True), ("auto", False),
                                                       (None, True)],
                         ids=["filter-sorted", "filter-unsorted", "nofilter-sorted"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("impl", OPTION_IMPLS)
def test_filter_and_sorting_toggles(impl: str, dtype: torch.dtype, filter_eps: Optional[str],
                                    vocab_sorting: bool, device: str,
                                    gen: torch.Generator) -> None:
    """Gradient filtering and vocabulary sorting are ablations: accuracy holds either way."""
    inputs = make_inputs(gen, device, dtype, bias=True)
    check(impl, inputs, gen, "mean", filter_eps=filter_eps, vocab_sorting=vocab_sorting)


@pytest.mark.parametrize("impl", OPTION_IMPLS)
def test_return_lse_false_returns_only_the_loss(impl: str, device: str,
                                                gen: torch.Generator) -> None:
    """Without return_lse the result is the loss tensor alone, equal to the first of the pair."""
    inputs = make_inputs(gen, device, torch.float32)
    loss = cce.linear_cross_entropy(inputs.e, inputs.c, inputs.targets, impl=impl)
    pair = cce.linear_cross_entropy(inputs.e, inputs.c, inputs.targets, return_lse=True,
                                    impl=impl)
    assert isinstance(loss, torch.Tensor) and isinstance(pair, tuple) and len(pair) == 2
    assert relative_error(loss, pair[0].double()) <= 1e-6


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("impl", OPTION_IMPLS)
def test_gradient_through_lse(impl: str, dtype: torch.dtype, device: str,
                              gen: torch.Generator) -> None:
    """The returned lse is differentiable too (e.g. for a z-loss), including at ignored and
    shifted-out positions, whose loss is constant 0 but whose lse is not."""
    inputs = make_inputs(gen, device, dtype, shape=(2, 19), bias=True, softcap=30.0,
                         scale=20.0, shift=1)
    check(impl, inputs, gen, "mean", lse_gradient=True)


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("impl", OPTION_IMPLS)
def test_all_targets_ignored(impl: str, reduction: str, device: str,
                             gen: torch.Generator) -> None:
    """Nothing to score: mean is NaN (as in PyTorch), sum is 0, "none" is all zeros; lse is
    still computed and every gradient is exactly zero."""
    inputs = make_inputs(gen, device, torch.bfloat16, shape=(2, 19), bias=True,
                         ignored_fraction=1.0)
    grad_output = make_grad_output(gen, inputs, reduction)
    result = run(impl, inputs, grad_output, reduction=reduction)
    ref = run_reference(inputs, grad_output, reduction=reduction)
    if reduction == "mean":
        assert torch.isnan(result.loss)
    else:
        assert torch.all(result.loss == 0) and result.loss.dtype == torch.float32
    assert relative_error(result.lse, ref.lse) <= tolerances(impl, torch.bfloat16)[0]
    for name in ("grad_e", "grad_c", "grad_bias"):
        grad = getattr(result, name)
        assert torch.all(grad == 0), f"{name} must be zero, max |{name}| = {grad.abs().max()}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("impl", OPTION_IMPLS)
def test_module_form(impl: str, dtype: torch.dtype, device: str, gen: torch.Generator) -> None:
    """LinearCrossEntropy(**options)(e, c, targets) is linear_cross_entropy with those options."""
    inputs = make_inputs(gen, device, dtype, shape=(2, 19), bias=True, ignore_index=7)
    e = inputs.e.detach().requires_grad_()
    c = inputs.c.detach().requires_grad_()
    bias = inputs.bias.detach().requires_grad_()
    module = cce.LinearCrossEntropy(bias=bias, ignore_index=7, softcap=30.0, reduction="sum",
                                    shift=1, return_lse=True, impl=impl)
    assert isinstance(module, nn.Module)
    assert "softcap=30.0" in repr(module) and "shift=1" in repr(module)
    loss, lse = module(e, c, inputs.targets)
    grad_output = make_grad_output(gen, inputs, "sum")
    grads = torch.autograd.grad(loss, [e, c, bias], grad_output)
    ref = reference(inputs.e, inputs.c, inputs.targets, bias=inputs.bias, ignore_index=7,
                    softcap=30.0, reduction="sum", shift=1, grad_output=grad_output)
    assert_matches(Result(loss.detach(), lse.detach(), *grads), ref, impl, dtype,
                   inputs.targets, "sum")


# --- Gradient filtering on peaked logits (the regime it is designed for) --------------------

PEAKED_V = 1000  # the filter's regime: whole tiles of negligible entries after sorting
FREQUENT = 200  # vocabulary entries that are plausible at all; the other 800 are negligible


def make_peaked_inputs(gen: torch.Generator, device: str, dtype: torch.dtype) -> Inputs:
    """Peaked, LM-like logits: most softmax entries are far below 2^-12.

    e has a constant feature (e[:, 0] = 1) whose classifier weight is a log-prior: 0 for 200
    random "frequent" entries, in [-20, -10] for the rest; the other features give logits of
    standard deviation 6. Targets are frequent entries. After sorting the vocabulary by average
    logit, whole 128-wide tiles of the softmax are below 2^-12 and the filter can skip them.
    """
    inputs = make_inputs(gen, "cpu", torch.float32, vocab=PEAKED_V, scale=6.0)
    prior = -10.0 - 10.0 * torch.rand(PEAKED_V, generator=gen)
    frequent = torch.randperm(PEAKED_V, generator=gen)[:FREQUENT]
    prior[frequent] = 0.0
    inputs.e[:, 0] = 1.0
    inputs.c[:, 0] = prior
    keep = inputs.targets != -100
    inputs.targets[keep] = frequent[torch.randint(0, FREQUENT, (int(keep.sum()),), generator=gen)]
    return Inputs(inputs.e.to(device, dtype), inputs.c.to(device, dtype),
                  inputs.targets.to(device))


def negligible_tile_fraction(inputs: Inputs, eps: float, block_n: int = 32,
                             block_v: int = 128) -> float:
    """Fraction of (block_n x block_v) tiles of the softmax, vocabulary sorted by average logit,
    whose entries are all below ``eps``: the tiles a block-level filter can skip."""
    logits = inputs.e.double() @ inputs.c.double().T
    probs = torch.softmax(logits, dim=-1)
    probs = probs[:, torch.argsort(logits.mean(dim=0), descending=True)].cpu()
    negligible = total = 0
    for row in range(0, probs.shape[0], block_n):
        for col in range(0, probs.shape[1], block_v):
            total += 1
            negligible += bool(probs[row:row + block_n, col:col + block_v].max() < eps)
    return negligible / total


@pytest.mark.parametrize("vocab_sorting", [True, False], ids=["sorted", "unsorted"])
def test_peaked_logits_filtered_gradients_within_tolerance(vocab_sorting: bool, device: str,
                                                           gen: torch.Generator) -> None:
    """bf16, filter on ("auto" = 2^-12), peaked logits: gradient error stays within 4e-3."""
    inputs = make_peaked_inputs(gen, device, torch.bfloat16)
    logits = inputs.e.double() @ inputs.c.double().T
    assert (torch.softmax(logits, -1) < 2.0 ** -12).double().mean() > 0.9
    assert negligible_tile_fraction(inputs, 2.0 ** -12) >= 0.5
    check("cce", inputs, gen, "mean", filter_eps="auto", vocab_sorting=vocab_sorting)


def test_filter_is_active_on_peaked_logits(device: str, gen: torch.Generator) -> None:
    """With filtering, negligible tiles are really skipped: the gradients differ from the
    unfiltered ones (not bit-identical), and both are within tolerance of the reference."""
    inputs = make_peaked_inputs(gen, device, torch.bfloat16)
    grad_output = make_grad_output(gen, inputs, "mean")
    ref = run_reference(inputs, grad_output, reduction="mean")
    filtered = run("cce", inputs, grad_output, filter_eps="auto")
    exact = run("cce", inputs, grad_output, filter_eps=None)
    assert_matches(filtered, ref, "cce", torch.bfloat16, inputs.targets, "mean")
    assert_matches(exact, ref, "cce", torch.bfloat16, inputs.targets, "mean")
    assert not (torch.equal(filtered.grad_e, exact.grad_e)
                and torch.equal(filtered.grad_c, exact.grad_c)), "the filter skipped nothing"


@pytest.mark.parametrize("grad_through_lse", [False, True], ids=["loss", "loss+lse"])
def test_filter_correction_adds_back_the_dropped_mass(grad_through_lse: bool, device: str,
                                                      gen: torch.Generator) -> None:
    """A vector w added to every classifier row changes no softmax, so the exact dE moves by
    (sum of the row of the logits' gradient) * w: 0 for the loss, the upstream gradient of the
    lse for the lse. The paper's filter (filter_correction=False) misses the dropped entries'
    share of that move, each row's dropped mass times w; filter_correction (the default) adds
    that mass back along the mean classifier row, which moves by w too, so its dE moves
    like the exact one. w is along a feature that every e leaves at 0, so that not even the
    logits' rounding changes; float32, so that rounding does not hide the rest."""
    inputs = make_peaked_inputs(gen, device, torch.float32)
    inputs.e[:, -1] = 0.0
    shift = torch.zeros(D, device=device)
    shift[-1] = 8.0 * inputs.c.norm(dim=1).mean()
    shifted = Inputs(inputs.e, inputs.c + shift, inputs.targets)
    grad_output = make_grad_output(gen, inputs, "mean")
    grad_lse = (torch.randn(N, generator=gen).to(device) * 0.1) if grad_through_lse else None
    ref = run_reference(inputs, grad_output, grad_lse)
    exact_move = run_reference(shifted, grad_output, grad_lse).grad_e - ref.grad_e

    def drift(**options) -> float:
        """How far dE's move under the shift is from the exact move, relative to dE."""
        move = (run("cce", shifted, grad_output, grad_lse, **options).grad_e
                - run("cce", inputs, grad_output, grad_lse, **options).grad_e)
        return float((move.double() - exact_move).norm() / ref.grad_e.norm())

    paper_drift = drift(filter_eps=2.0**-12, filter_correction=False)
    corrected_drift = drift(filter_eps=2.0**-12)
    assert paper_drift > 1e-4, "the paper's filter dropped too little for the test to tell"
    # What is left is float32's precision of the kept mass, times w.
    assert corrected_drift < paper_drift / 20, (corrected_drift, paper_drift)
    # dC and the loss are the paper filter's.
    paper = run("cce", shifted, grad_output, grad_lse, filter_eps=2.0**-12,
                filter_correction=False)
    corrected = run("cce", shifted, grad_output, grad_lse, filter_eps=2.0**-12)
    assert torch.equal(corrected.grad_c, paper.grad_c)
    assert torch.equal(corrected.loss, paper.loss)


def test_filter_correction_is_off_with_softcap(device: str, gen: torch.Generator) -> None:
    """With a softcap the gradient rows carry its derivative, so their sums say nothing about
    the dropped mass: filter_correction changes nothing there."""
    inputs = make_peaked_inputs(gen, device, torch.bfloat16)
    grad_output = make_grad_output(gen, inputs, "mean")
    default = run("cce", inputs, grad_output, softcap=30.0)
    paper = run("cce", inputs, grad_output, softcap=30.0, filter_correction=False)
    assert torch.equal(default.grad_e, paper.grad_e)


# --- Rows where the model is sure of its target -------------------------------------------------

# (tokens, vocabulary, D): the interpreter's sizes on CPU, a real vocabulary on a GPU.
CONFIDENT_SHAPE = (4096, 131072, 256) if torch.cuda.is_available() else (64, 700, 64)


@pytest.mark.parametrize("complement", [1e-3, 1e-6, 1e-9], ids=["1e-3", "1e-6", "1e-9"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("impl, options", [("cce", {}), ("cce", {"deterministic": True}),
                                           ("cce_torch", {})],
                         ids=["kernels", "kernels-deterministic", "chunked-torch"])
def test_confident_rows_are_as_accurate_as_pytorch(impl: str, options: dict, dtype: torch.dtype,
                                                   complement: float, device: str,
                                                   gen: torch.Generator) -> None:
    """Where the model is sure of the target (1 - p_target = ``complement``), the loss is about
    1 - p_target and the gradient at the target is -(1 - p_target): neither may come from a
    difference of two logit-sized numbers. Loss, dE and dC are at least as accurate as
    PyTorch's on logits in the inputs' dtype, without filtering (whose error is its own)."""
    num_tokens, vocab, dim = CONFIDENT_SHAPE
    e, c, targets = confident_inputs(gen, device, dtype, num_tokens, vocab, dim, complement)
    inputs = Inputs(e, c, targets)
    grad_output = make_grad_output(gen, inputs, "none")
    ref = run_reference(inputs, grad_output, reduction="none")
    achieved = 1 - torch.exp(-ref.loss).median().item()
    assert complement / 4 < achieved < complement * 4  # the inputs are what the test says
    ours = run(impl, inputs, grad_output, reduction="none", filter_eps=None, **options)
    theirs = pytorch_errors(inputs, grad_output, ref)
    # As in the other tests: float32 sums at 1e-5, 16-bit gradients rounded to their dtype.
    grad_floor = tolerances("cce", dtype)[1]
    floor = {"loss": 1e-5, "grad_e": grad_floor, "grad_c": grad_floor}
    errors = {"loss": relative_error(ours.loss, ref.loss),
              "grad_e": relative_error(ours.grad_e, ref.grad_e),
              "grad_c": relative_error(ours.grad_c, ref.grad_c)}
    worse = {name: f"{error:.1e} > PyTorch's {theirs[name]:.1e}" for name, error in errors.items()
             if not error <= max(theirs[name], floor[name])}
    assert not worse, worse


# --- Non-finite inputs ------------------------------------------------------------------------


@INTERPRETER_NON_FINITE_WARNINGS
@pytest.mark.parametrize("dtype, bad_value",
                         [(torch.float32, math.nan), (torch.bfloat16, math.inf),
                          (torch.float32, -math.inf)],
                         ids=["fp32-nan", "bf16-inf", "fp32-minus-inf"])
@pytest.mark.parametrize("impl", OPTION_IMPLS)
def test_non_finite_rows_propagate_like_pytorch(impl: str, dtype: torch.dtype,
                                                bad_value: float, device: str,
                                                gen: torch.Generator) -> None:
    """A NaN or infinite entry in one row of e: the loss, lse and gradients are NaN or infinite
    exactly where PyTorch's are (an infinite logit: lse +inf, loss NaN; the row's NaN gradient
    reaches every row of dC), and the other rows' loss, lse and dE are unaffected."""
    inputs = make_inputs(gen, device, dtype, ignored_fraction=0.0)
    bad_row = 5
    inputs.e[bad_row, 3] = bad_value
    grad_output = make_grad_output(gen, inputs, "none")
    result = run(impl, inputs, grad_output, reduction="none")
    torch_result = run("torch", inputs, grad_output, reduction="none")  # what PyTorch does

    bad = torch.zeros(N, dtype=torch.bool, device=device)
    bad[bad_row] = True
    assert torch.equal(torch.isnan(torch_result.loss), bad)
    for name in ("loss", "lse", "grad_e", "grad_c"):
        assert same_non_finite(getattr(result, name), getattr(torch_result, name)), name

    good_inputs = Inputs(inputs.e[~bad], inputs.c, inputs.targets[~bad])
    ref = run_reference(good_inputs, grad_output[~bad], reduction="none")
    forward_tol, grad_tol = tolerances(impl, dtype)
    assert relative_error(result.loss[~bad], ref.loss) <= forward_tol
    assert relative_error(result.lse[~bad], ref.lse) <= forward_tol
    assert relative_error(result.grad_e[~bad], ref.grad_e) <= grad_tol


@INTERPRETER_NON_FINITE_WARNINGS
@pytest.mark.parametrize("impl", OPTION_IMPLS)
def test_non_finite_ignored_row_propagates_like_pytorch(impl: str, device: str,
                                                        gen: torch.Generator) -> None:
    """An ignored token with a NaN hidden state adds nothing to the loss and leaves the other
    rows' dE alone, but its NaN logits reach its own dE row (and dC), as in PyTorch."""
    inputs = make_inputs(gen, device, torch.float32, ignored_fraction=0.0)
    bad_row = 5
    inputs.targets[bad_row] = -100
    inputs.e[bad_row, 3] = math.nan
    good = torch.ones(N, dtype=torch.bool, device=device)
    good[bad_row] = False
    outcomes = {}
    for name in ("torch", impl):  # what PyTorch does, then impl
        e = inputs.e.detach().requires_grad_()
        c = inputs.c.detach().requires_grad_()
        loss = cce.linear_cross_entropy(e, c, inputs.targets, reduction="sum", impl=name)
        grad_e, grad_c = torch.autograd.grad(loss, (e, c))
        assert torch.isfinite(loss)
        assert torch.isnan(grad_e[bad_row]).any() and torch.isnan(grad_c).any()
        outcomes[name] = grad_e[good]
    assert relative_error(outcomes[impl], outcomes["torch"]) <= 1e-5


@INTERPRETER_NON_FINITE_WARNINGS
def test_row_outputs_kernel_follows_the_pytorch_formulas(device: str,
                                                         gen: torch.Generator) -> None:
    """The forward's row outputs kernel computes what ``lse_and_cross_entropy`` and
    ``target_complement`` define: from float64 to float32 precision on finite rows, sure ones
    (O - z_y down to -25) included, and non-finite exactly where they are."""
    from cce.forward.row_outputs import row_outputs
    from cce.weighting import lse_and_cross_entropy, target_complement
    inf, nan = math.inf, math.nan
    gap = torch.cat([torch.randn(3000, generator=gen) * 6, -torch.rand(3000, generator=gen) * 25])
    other = torch.randn(6000, generator=gen) * 5 + 10
    target_logit = other - gap
    targets = torch.randint(0, 9, (6000,), generator=gen)
    targets[::5] = -1
    edges = [(-inf, -inf), (inf, inf), (-inf, 2.0), (inf, -inf), (nan, 1.0), (1.0, nan),
             (3.0, inf), (-30.0, 0.0), (0.0, -inf), (5.0, -100.0)]
    other = torch.cat([other, torch.tensor([o for o, _ in edges] * 2)])
    target_logit = torch.cat([target_logit, torch.tensor([z for _, z in edges] * 2)])
    targets = torch.cat([targets, torch.tensor([0] * len(edges) + [-1] * len(edges))])
    outputs = row_outputs(other.to(device), target_logit.to(device), targets.to(device))
    lse, cross_entropy = lse_and_cross_entropy(other.double(), target_logit.double(), targets)
    expected = (lse, cross_entropy, target_complement(other.double(), lse))
    for name, value, exact in zip(("lse", "cross_entropy", "complement"), outputs, expected):
        value = value.cpu()
        assert value.dtype == torch.float32, name
        assert same_non_finite(value, exact.float()), name
        finite = torch.isfinite(exact)
        # an LSE near 0 has cancelled: its error is the inputs' rounding (about 1e-6 here)
        scale = exact[finite].abs().clamp_min(1.0 if name == "lse" else 1e-300)
        assert ((value[finite].double() - exact[finite]).abs() / scale).max() <= 1e-5, name


# --- torch.compile (slow to compile on CPU: two cases only) ---------------------------------


@pytest.mark.parametrize(
    "dtype, reduction, with_options",
    [(torch.float32, "mean", False), (torch.bfloat16, "none", True)],
    ids=["fp32-plain", "bf16-bias-softcap"],
)
def test_torch_compile_matches_reference(dtype: torch.dtype, reduction: str, with_options: bool,
                                         device: str, gen: torch.Generator) -> None:
    """impl="torch_compile" is the torch baseline under torch.compile: same results."""
    if with_options:
        inputs = make_inputs(gen, device, dtype, scale=20.0, bias=True, softcap=30.0)
    else:
        inputs = make_inputs(gen, device, dtype)
    check("torch_compile", inputs, gen, reduction)
