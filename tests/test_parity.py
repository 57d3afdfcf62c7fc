"""Class weights and label smoothing, exactly as ``F.cross_entropy`` defines them.

``weight`` (V,) scales each token's loss by its target's weight (and, with smoothing, each class's
share of the uniform part by its own); "mean" divides by the summed weights of the non-ignored
targets. ``label_smoothing`` mixes the one-hot target with the uniform distribution. Every
implementation is compared with the float64 reference (``F.cross_entropy`` on float64 logits,
:mod:`tests.reference`) on loss, lse, dE, dC and dbias, with every other option; on the same
float32 inputs, also with torch's own ``F.linear_cross_entropy``.

Small sizes, not multiples of any block (the kernels run in Triton's interpreter on CPU).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import cce
from cce.backward.plan import BackwardPlan, forced
from tests.helpers import (DTYPE_IDS, DTYPES, Inputs, check, make_grad_output, make_inputs,
                           peaked_inputs, run, run_reference)
from tests.reference import relative_error

N, V, D = 37, 300, 40
SMOOTHING = 0.1
OPTION_IMPLS = ("cce", "torch")
REDUCTIONS = ("mean", "sum", "none")
WEIGHTINGS = ("weight", "smoothing", "both")

dtypes = pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
weightings = pytest.mark.parametrize("weighting", WEIGHTINGS)


def class_weights(gen: torch.Generator, vocab: int = V) -> torch.Tensor:
    """float32 weights in [0, 2), a tenth of them exactly 0 (a class that must not count)."""
    weight = 2 * torch.rand(vocab, generator=gen)
    weight[torch.randperm(vocab, generator=gen)[:vocab // 10]] = 0.0
    return weight


def weighting_options(weighting: str, gen: torch.Generator, device: str,
                      vocab: int = V) -> dict:
    """The keyword arguments of one weighting case: class weights, smoothing, or both."""
    options = {}
    if weighting in ("weight", "both"):
        options["weight"] = class_weights(gen, vocab).to(device)
    if weighting in ("smoothing", "both"):
        options["label_smoothing"] = SMOOTHING
    return options


def small_inputs(gen: torch.Generator, device: str, dtype: torch.dtype, **options) -> Inputs:
    """N tokens (or ``shape``), V classes, D dimensions."""
    return make_inputs(gen, device, dtype, vocab=V, dim=D, **options)


# --- Against the float64 reference ----------------------------------------------------------


@weightings
@dtypes
@pytest.mark.parametrize("impl", tuple(cce.IMPLEMENTATIONS))
def test_matches_reference(impl: str, dtype: torch.dtype, weighting: str, device: str,
                           gen: torch.Generator) -> None:
    """Every implementation: the weighted mean (over the targets' summed weights) with a bias,
    loss, lse and every gradient within the usual tolerances."""
    inputs = small_inputs(gen, device, dtype, bias=True)
    check(impl, inputs, gen, "mean", **weighting_options(weighting, gen, device))


@pytest.mark.parametrize("reduction", REDUCTIONS)
@weightings
@pytest.mark.parametrize("impl", OPTION_IMPLS)
def test_every_reduction(impl: str, weighting: str, reduction: str, device: str,
                         gen: torch.Generator) -> None:
    """"none" gives F.cross_entropy's per-token values (0 at ignored tokens), "sum" their sum."""
    inputs = small_inputs(gen, device, torch.bfloat16, ignore_index=7, ignored_fraction=0.25)
    result = check(impl, inputs, gen, reduction, **weighting_options(weighting, gen, device))
    if reduction == "none":
        assert torch.all(result.loss[inputs.targets == 7] == 0)


@pytest.mark.parametrize("option", ["shift", "softcap", "lse_gradient", "no_filter",
                                    "unsorted", "paper_filter"])
@dtypes
@pytest.mark.parametrize("impl", OPTION_IMPLS)
def test_with_every_other_option(impl: str, dtype: torch.dtype, option: str, device: str,
                                 gen: torch.Generator) -> None:
    """Weights and smoothing together with each other option: shift with 3-D e and a custom
    ignore_index; softcap (large logits); a gradient through the returned lse (which stays the
    plain log-sum-exp); and the filter ablations."""
    weighting = weighting_options("both", gen, device)
    if option == "shift":
        inputs = small_inputs(gen, device, dtype, shape=(2, 19), bias=True, ignore_index=7,
                              shift=2)
        result = check(impl, inputs, gen, "none", **weighting)
        assert torch.all(result.loss[:, -2:] == 0)
    elif option == "softcap":
        inputs = small_inputs(gen, device, dtype, scale=20.0, bias=True, softcap=30.0)
        check(impl, inputs, gen, "sum", **weighting)
    elif option == "lse_gradient":
        inputs = small_inputs(gen, device, dtype, shape=(2, 19), bias=True, softcap=30.0,
                              scale=20.0, shift=1)
        check(impl, inputs, gen, "mean", lse_gradient=True, **weighting)
    else:
        inputs = small_inputs(gen, device, dtype, bias=True)
        ablation = {"no_filter": dict(filter_eps=None), "unsorted": dict(vocab_sorting=False),
                    "paper_filter": dict(filter_correction=False)}[option]
        check(impl, inputs, gen, "mean", **ablation, **weighting)


@pytest.mark.parametrize("impl", OPTION_IMPLS)
def test_full_smoothing_and_zero_weights(impl: str, device: str, gen: torch.Generator) -> None:
    """label_smoothing=1: the target's own term vanishes, the uniform one remains; targets of
    weight 0 count for nothing in the mean."""
    inputs = small_inputs(gen, device, torch.float32, bias=True)
    weight = class_weights(gen).to(device)
    assert (weight[inputs.targets[inputs.targets >= 0]] == 0).any()
    check(impl, inputs, gen, "mean", weight=weight, label_smoothing=1.0)


@pytest.mark.parametrize("impl", OPTION_IMPLS)
def test_all_weights_zero(impl: str, device: str, gen: torch.Generator) -> None:
    """Every class of weight 0, with smoothing and a softcap: the sum and every gradient are
    exactly 0, as in F.cross_entropy (not NaN: the weights' mean of tanh^2 is 0 / 0)."""
    inputs = small_inputs(gen, device, torch.float32, scale=20.0, softcap=30.0)
    weight = torch.zeros(V, device=device)
    result = check(impl, inputs, gen, "sum", weight=weight, label_smoothing=SMOOTHING)
    assert result.loss == 0 and not result.grad_e.any() and not result.grad_c.any()


@pytest.mark.parametrize("impl", OPTION_IMPLS)
def test_half_precision_weights_count_as_their_float32_values(impl: str, device: str,
                                                              gen: torch.Generator) -> None:
    """A bfloat16 weight serves float32 inputs (and any float weight any inputs): it is used in
    float32, so the result is that of the same values as a float32 weight (bitwise, in the
    deterministic mode: by default the GPU's LSE merge order may change its last bits)."""
    inputs = small_inputs(gen, device, torch.float32)
    weight = class_weights(gen).to(device, torch.bfloat16)
    check(impl, inputs, gen, "mean", weight=weight, label_smoothing=SMOOTHING)
    as_bfloat16 = cce.linear_cross_entropy(inputs.e, inputs.c, inputs.targets, weight=weight,
                                           label_smoothing=SMOOTHING, deterministic=True,
                                           impl=impl)
    as_float32 = cce.linear_cross_entropy(inputs.e, inputs.c, inputs.targets,
                                          weight=weight.float(), label_smoothing=SMOOTHING,
                                          deterministic=True, impl=impl)
    assert torch.equal(as_bfloat16, as_float32)


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("impl", OPTION_IMPLS)
def test_all_targets_ignored(impl: str, reduction: str, device: str,
                             gen: torch.Generator) -> None:
    """As in F.cross_entropy: the mean is NaN (0 / 0), the rest 0, and no gradient."""
    inputs = small_inputs(gen, device, torch.float32, ignored_fraction=1.0)
    weighting = weighting_options("both", gen, device)
    grad_output = make_grad_output(gen, inputs, reduction)
    result = run(impl, inputs, grad_output, reduction=reduction, **weighting)
    expected = run_reference(inputs, grad_output, reduction=reduction, **weighting)
    assert torch.equal(result.loss.isnan(), expected.loss.isnan())
    assert torch.all(result.loss.nan_to_num() == 0)
    assert torch.all(result.grad_e == 0) and torch.all(result.grad_c == 0)


# --- Against torch's own F.linear_cross_entropy ---------------------------------------------


@pytest.mark.parametrize("reduction", REDUCTIONS)
@weightings
@pytest.mark.parametrize("impl", OPTION_IMPLS)
def test_matches_torch_linear_cross_entropy(impl: str, weighting: str, reduction: str,
                                            device: str, gen: torch.Generator) -> None:
    """Switching from F.linear_cross_entropy: the same arguments (``linear_bias`` is ``bias``)
    give the same loss and gradients on the same float32 inputs."""
    if not hasattr(F, "linear_cross_entropy"):
        pytest.skip(f"torch {torch.__version__} has no F.linear_cross_entropy")
    inputs = small_inputs(gen, device, torch.float32, bias=True)
    options = dict(reduction=reduction, **weighting_options(weighting, gen, device))
    grad_output = make_grad_output(gen, inputs, reduction)
    leaves = [tensor.detach().requires_grad_() for tensor in (inputs.e, inputs.c, inputs.bias)]
    expected = F.linear_cross_entropy(leaves[0], leaves[1], inputs.targets,
                                      linear_bias=leaves[2], **options)
    expected_grads = torch.autograd.grad(expected, leaves, grad_output)
    loss = cce.linear_cross_entropy(leaves[0], leaves[1], inputs.targets, bias=leaves[2],
                                    impl=impl, **options)
    grads = torch.autograd.grad(loss, leaves, grad_output)
    assert relative_error(loss, expected) <= 1e-5
    for name, grad, expected_grad in zip(("dE", "dC", "dbias"), grads, expected_grads):
        assert relative_error(grad, expected_grad) <= 1e-5, name


# --- The filter still skips ------------------------------------------------------------------


def test_smoothing_keeps_no_tile_live_and_reaches_the_skipped_ones(
        device: str, gen: torch.Generator) -> None:
    """The backward recomputes the same tiles with label smoothing as without (its rank-one
    term is added in closed form), whole vocabulary blocks of them are skipped, and the
    gradients still match the reference: the smoothing's gradient reaches the classifier rows
    whose tiles were all skipped."""
    e, c, targets = peaked_inputs(gen, device, 45, 1500, D)
    # Likely targets, as a language model's are: the tail of the vocabulary holds none.
    targets = torch.where(targets >= 0, (e @ c.T).argmax(dim=1), -1)
    inputs = Inputs(e.bfloat16(), c.bfloat16(), targets, options=dict(ignore_index=-1))
    grad_output = make_grad_output(gen, inputs, "mean")
    weight = class_weights(gen, 1500).to(device)
    with forced() as plans:  # they record each backward's live table
        run("cce", inputs, grad_output, weight=weight)
        check("cce", inputs, gen, "mean", weight=weight, label_smoothing=SMOOTHING)

    plain, smoothed = [plan.live_tiles for plan in plans if isinstance(plan, BackwardPlan)]
    assert torch.equal(smoothed, plain)
    assert bool((smoothed.sum(dim=0) == 0).any()), "the test needs wholly skipped blocks"


@pytest.mark.parametrize("kernel_options", [{}, dict(keep_tiles=True), dict(deterministic=True)],
                         ids=["default", "keep_tiles", "deterministic"])
def test_with_softcap_skipped_tiles_drop_only_the_curvature_deviation(
        kernel_options: dict, device: str, gen: torch.Generator) -> None:
    """With a softcap the smoothing's gradient is rank-one only up to the cap's curvature; the
    skipped tiles drop that curvature's deviation from each row's mean, not the mean. On peaked
    logits that the cap saturates, the error stays moderate (dropping the curvature whole:
    0.5-0.6 on dE), and without the filter the gradients are exact."""
    e, c, targets = peaked_inputs(gen, device, 64, 3000, 64)
    targets = torch.where(targets >= 0, (e @ c.T).argmax(dim=1), -1)
    inputs = Inputs(e.bfloat16(), c.bfloat16(), targets,
                    options=dict(ignore_index=-1, softcap=30.0, label_smoothing=SMOOTHING,
                                 **kernel_options))
    grad_output = make_grad_output(gen, inputs, "mean")
    expected = run_reference(inputs, grad_output)
    filtered = run("cce", inputs, grad_output)
    assert relative_error(filtered.grad_e, expected.grad_e) <= 0.05
    assert relative_error(filtered.grad_c, expected.grad_c) <= 0.01
    check("cce", inputs, gen, "mean", filter_eps=None)


# --- The module, the Hugging Face patch, bad values ------------------------------------------


def test_module_form(device: str, gen: torch.Generator) -> None:
    """LinearCrossEntropy(weight=..., label_smoothing=...) is the function with those options;
    the weight is a buffer, as in nn.CrossEntropyLoss. Deterministic on both sides: the default
    GPU forward merges tiles in arrival order, so two calls may differ in the last bits."""
    inputs = small_inputs(gen, device, torch.float32)
    weight = class_weights(gen).to(device)
    module = cce.LinearCrossEntropy(weight=weight, label_smoothing=SMOOTHING, reduction="sum",
                                    deterministic=True)
    assert "label_smoothing=0.1" in repr(module)
    assert torch.equal(module.state_dict()["weight"], weight)
    expected = cce.linear_cross_entropy(inputs.e, inputs.c, inputs.targets, weight=weight,
                                        label_smoothing=SMOOTHING, reduction="sum",
                                        deterministic=True)
    assert torch.equal(module(inputs.e, inputs.c, inputs.targets), expected)


@pytest.mark.parametrize("impl", OPTION_IMPLS)
def test_patched_model_smooths_and_weighs_its_loss(impl: str, device: str,
                                                   gen: torch.Generator) -> None:
    """patch(model, weight=..., label_smoothing=...) gives the loss and gradients of
    F.cross_entropy with them on the unpatched model's logits (next-token shift)."""
    pytest.importorskip("transformers")
    import copy

    from cce.integrations.transformers import patch
    from tests.test_integration_transformers import VOCAB, make_batch, tiny_model

    reference = tiny_model("llama", device)
    weight = class_weights(gen, VOCAB).to(device)
    model = patch(copy.deepcopy(reference), impl=impl, weight=weight,
                  label_smoothing=SMOOTHING)
    inputs = make_batch(gen, device)
    labels = inputs.pop("labels")
    logits = reference(**inputs).logits
    expected = F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(),
                               weight=weight, label_smoothing=SMOOTHING)
    loss = model(**inputs, labels=labels).loss
    expected.backward()
    loss.backward()

    assert relative_error(loss, expected) <= 1e-5
    assert relative_error(model.lm_head.weight.grad, reference.lm_head.weight.grad) <= 1e-5


BAD_VALUES = {  # id: (arguments on a device, the argument the error must name)
    "smoothing<0": (lambda device: dict(label_smoothing=-0.1), "label_smoothing"),
    "smoothing>1": (lambda device: dict(label_smoothing=1.5), "label_smoothing"),
    "smoothing-nan": (lambda device: dict(label_smoothing=math.nan), "label_smoothing"),
    "smoothing-bool": (lambda device: dict(label_smoothing=True), "label_smoothing"),
    "smoothing-str": (lambda device: dict(label_smoothing="0.1"), "label_smoothing"),
    "smoothing-None": (lambda device: dict(label_smoothing=None), "label_smoothing"),
    "weight-list": (lambda device: dict(weight=[1.0] * V), "weight"),
    "weight-short": (lambda device: dict(weight=torch.ones(V - 1, device=device)), "weight"),
    "weight-2d": (lambda device: dict(weight=torch.ones(1, V, device=device)), "weight"),
    "weight-int": (lambda device: dict(weight=torch.ones(V, dtype=torch.int64, device=device)),
                   "weight"),
    "weight-device": (lambda device: dict(weight=torch.ones(V, device="meta")), "weight"),
    "weight-requires-grad": (
        lambda device: dict(weight=torch.ones(V, device=device, requires_grad=True)), "weight"),
}


@pytest.mark.parametrize("bad, name", BAD_VALUES.values(), ids=BAD_VALUES.keys())
def test_bad_values_raise_value_error_naming_the_argument(bad, name: str, device: str) -> None:
    e, c = torch.randn(N, D, device=device), torch.randn(V, D, device=device)
    targets = torch.zeros(N, dtype=torch.int64, device=device)
    with pytest.raises(ValueError, match=name):
        cce.linear_cross_entropy(e, c, targets, **bad(device))


@pytest.mark.parametrize("bad, name", [(dict(label_smoothing=2.0), "label_smoothing"),
                                       (dict(weight=torch.ones(2, 3)), "weight")],
                         ids=["smoothing", "weight"])
def test_module_checks_them_when_constructed(bad: dict, name: str) -> None:
    with pytest.raises(ValueError, match=name):
        cce.LinearCrossEntropy(**bad)


# --- The benchmark's reference ---------------------------------------------------------------


def test_bench_reference_with_label_smoothing_matches_autograd() -> None:
    """The benchmark's chunked float64 reference, which its label-smoothing row is measured
    against, is F.cross_entropy's with label_smoothing."""
    from experiments.harness import float64_reference

    generator = torch.Generator().manual_seed(0)
    e = torch.randn(37, 12, generator=generator)
    c = torch.randn(V, 12, generator=generator)
    targets = torch.randint(0, V, (37,), generator=generator)
    targets[::4] = -100
    # 5 rows of logits per chunk: 8 chunks, the last one short.
    loss, grad_e, grad_c = float64_reference(e, c, targets, chunk_bytes=8 * V * 5,
                                             label_smoothing=SMOOTHING)

    e64 = e.double().requires_grad_()
    c64 = c.double().requires_grad_()
    expected = F.cross_entropy(e64 @ c64.T, targets, label_smoothing=SMOOTHING)
    expected_e, expected_c = torch.autograd.grad(expected, (e64, c64))
    torch.testing.assert_close(loss, expected.detach(), rtol=1e-12, atol=0)
    torch.testing.assert_close(grad_e, expected_e, rtol=1e-12, atol=1e-15)
    torch.testing.assert_close(grad_c, expected_c, rtol=1e-12, atol=1e-15)
