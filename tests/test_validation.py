"""Specification of argument checking and of degenerate-but-valid inputs.

Bad input raises ``ValueError`` whose message names the offending argument (checked as a whole
word, so "c" does not match the "c" inside another word). Degenerate input that is valid (a
shift longer than the sequence, no tokens at all) gives PyTorch's results for an empty loss:
"mean" is NaN, "sum" is 0, "none" is all zeros, and every gradient is zero.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import re
from typing import Callable

import numpy as np
import pytest
import torch
from torch import nn

import cce
from cce.options import LossOptions
from tests.reference import reference, relative_error

V, D = 10, 16
IMPLS = ("cce", "cce_torch", "torch", "torch_compile", "chunked")
COMPUTE_IMPLS = ("cce", "cce_torch", "torch")  # impls run by the tests that compute something


def names(*arguments: str) -> str:
    """A regex matching a message that names every one of ``arguments`` as a whole word."""
    return "".join(rf"(?=.*(?<![\w.]){re.escape(arg)}(?![\w(]))" for arg in arguments)


def valid_arguments(device: str) -> dict:
    """A valid call: e (4, 6, D), c (V, D), targets (4, 6) with one ignored position."""
    gen = torch.Generator().manual_seed(0)
    targets = torch.randint(0, V, (4, 6), generator=gen)
    targets[0, 0] = -100
    return dict(e=torch.randn(4, 6, D, generator=gen).to(device),
                c=torch.randn(V, D, generator=gen).to(device),
                targets=targets.to(device))


def call(arguments: dict, **options):
    return cce.linear_cross_entropy(arguments.pop("e"), arguments.pop("c"),
                                    arguments.pop("targets"), **arguments, **options)


def test_valid_arguments_are_accepted(device: str) -> None:
    """The baseline call of this file works, so the failures below are due to the change."""
    loss = call(valid_arguments(device), impl="torch")
    assert loss.shape == () and torch.isfinite(loss)


# Each case: (id, change to the valid arguments, argument names the message must contain).
Change = Callable[[dict], None]
BAD_ARGUMENTS: "list[tuple[str, Change, tuple[str, ...]]]" = [
    ("D-mismatch", lambda a: a.update(c=torch.randn(V, D + 1, device=a["e"].device)),
     ("c", "e")),
    ("dtype-mismatch", lambda a: a.update(c=a["c"].half()), ("c", "e")),
    ("e-integer", lambda a: a.update(e=a["e"].long(), c=a["c"].long()), ("e",)),
    ("c-device", lambda a: a.update(c=a["c"].to("meta")), ("c", "e")),
    ("targets-device", lambda a: a.update(targets=a["targets"].to("meta")), ("targets",)),
    ("c-not-2d", lambda a: a.update(c=a["c"][None]), ("c",)),
    ("c-module", lambda a: a.update(c=nn.Linear(D, V, device=a["e"].device)), ("c",)),
    ("c-list", lambda a: a.update(c=a["c"].tolist()), ("c",)),
    ("e-numpy", lambda a: a.update(e=a["e"].cpu().numpy()), ("e",)),
    ("targets-list", lambda a: a.update(targets=a["targets"].tolist()), ("targets",)),
    ("targets-float", lambda a: a.update(targets=a["targets"].float()), ("targets",)),
    ("targets-bool", lambda a: a.update(targets=a["targets"] > 0), ("targets",)),
    ("targets-complex", lambda a: a.update(targets=a["targets"].to(torch.complex64)),
     ("targets",)),
    ("targets-shape", lambda a: a.update(targets=a["targets"][:, :5]), ("targets",)),
    ("targets-flattened", lambda a: a.update(targets=a["targets"].reshape(-1)), ("targets",)),
    ("target-equals-V", lambda a: a["targets"].__setitem__((1, 2), V), ("targets",)),
    ("target-negative", lambda a: a["targets"].__setitem__((1, 2), -1), ("targets",)),
    ("target-default-ignore-index-not-ignored",
     lambda a: a.update(ignore_index=7), ("targets",)),  # targets[0, 0] == -100 != 7
    ("reduction", lambda a: a.update(reduction="avg"), ("reduction",)),
    ("impl", lambda a: a.update(impl="triton"), ("impl",)),
    ("shift-negative", lambda a: a.update(shift=-1), ("shift",)),
    ("filter_eps-zero", lambda a: a.update(filter_eps=0.0), ("filter_eps",)),
    ("filter_eps-negative", lambda a: a.update(filter_eps=-1e-3), ("filter_eps",)),
    ("filter_eps-nan", lambda a: a.update(filter_eps=math.nan), ("filter_eps",)),
    ("filter_eps-string", lambda a: a.update(filter_eps="none"), ("filter_eps",)),
    # A softmax entry is at most 1: a threshold of 1 or more would filter everything.
    ("filter_eps-one", lambda a: a.update(filter_eps=1.0), ("filter_eps",)),
    ("filter_eps-huge", lambda a: a.update(filter_eps=1e9), ("filter_eps",)),
    ("filter_eps-inf", lambda a: a.update(filter_eps=math.inf), ("filter_eps",)),
    ("bias-too-long", lambda a: a.update(bias=torch.zeros(V + 1, device=a["e"].device)),
     ("bias",)),
    ("bias-2d", lambda a: a.update(bias=torch.zeros(1, V, device=a["e"].device)), ("bias",)),
    ("bias-dtype", lambda a: a.update(bias=torch.zeros(V, device=a["e"].device).half()),
     ("bias",)),
    ("bias-device", lambda a: a.update(bias=torch.zeros(V, device="meta")), ("bias",)),
    ("bias-module", lambda a: a.update(bias=nn.Linear(D, V, device=a["e"].device)), ("bias",)),
    ("softcap-zero", lambda a: a.update(softcap=0.0), ("softcap",)),
    ("softcap-negative", lambda a: a.update(softcap=-30.0), ("softcap",)),
    ("ignore_index-float", lambda a: a.update(ignore_index=-100.0), ("ignore_index",)),
    ("ignore_index-numpy-float", lambda a: a.update(ignore_index=np.float64(-100)),
     ("ignore_index",)),
    ("ignore_index-beyond-int64",  # as F.cross_entropy; no target equal to -100 left
     lambda a: (a["targets"].__setitem__((0, 0), 1), a.update(ignore_index=2**63)),
     ("ignore_index",)),
    ("vocab_sorting-string", lambda a: a.update(vocab_sorting="yes"), ("vocab_sorting",)),
    ("filter_correction-int", lambda a: a.update(filter_correction=1), ("filter_correction",)),
]


@pytest.mark.parametrize("change, arguments_named", [case[1:] for case in BAD_ARGUMENTS],
                         ids=[case[0] for case in BAD_ARGUMENTS])
def test_bad_argument_raises_value_error_naming_it(change: Change, arguments_named: tuple,
                                                   device: str) -> None:
    """Every bad argument is rejected before any computation, with a message naming it."""
    arguments = valid_arguments(device)
    change(arguments)
    with pytest.raises(ValueError, match=names(*arguments_named)):
        call(arguments)


def test_module_as_classifier_says_to_pass_its_weight(device: str) -> None:
    """An nn.Linear is not its weight: the message says what to pass instead."""
    arguments = valid_arguments(device)
    arguments["c"] = nn.Linear(D, V, device=device)
    with pytest.raises(ValueError, match=names("c")) as error:
        call(arguments)
    assert ".weight" in str(error.value)


@pytest.mark.parametrize("filter_eps", [1e-9, 0.5, 1 - 1e-9])
def test_filter_eps_below_one_is_accepted(filter_eps: float, device: str) -> None:
    assert torch.isfinite(call(valid_arguments(device), filter_eps=filter_eps))


@pytest.mark.parametrize("impl", IMPLS)
def test_out_of_range_target_rejected_by_every_impl(impl: str, device: str) -> None:
    """Range checking is part of the API, not of one implementation."""
    arguments = valid_arguments(device)
    arguments["targets"][2, 3] = V
    with pytest.raises(ValueError, match=names("targets")):
        call(arguments, impl=impl)


@pytest.mark.parametrize("impl", COMPUTE_IMPLS)
def test_out_of_range_target_poisons_the_loss_where_the_host_cannot_check(
        impl: str, device: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Under torch.compile (and CUDA graph capture) no ValueError can be raised from the data:
    the loss is NaN instead, and no kernel reads outside c."""
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    arguments = valid_arguments(device)
    arguments["targets"][2, 3] = V
    assert torch.isnan(call(arguments, impl=impl))
    arguments = valid_arguments(device)
    assert torch.isfinite(call(arguments, impl=impl))


TARGET_DTYPES = (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8, torch.uint16,
                 torch.uint32, torch.uint64)


@pytest.mark.parametrize("impl", COMPUTE_IMPLS)
@pytest.mark.parametrize("dtype", TARGET_DTYPES, ids=lambda dtype: str(dtype)[6:])
def test_every_integer_target_dtype_is_accepted(dtype: torch.dtype, impl: str,
                                                device: str) -> None:
    """Targets of any integer dtype score as their int64 values; a negative ignore_index, which
    no unsigned target can equal, ignores nothing (uint8's 156 is not -100)."""
    arguments = valid_arguments(device)
    targets = arguments.pop("targets")
    targets[0, 0] = 7  # no -100: not every dtype holds it
    expected = call(dict(arguments, targets=targets), impl=impl, reduction="none")
    loss = call(dict(arguments, targets=targets.to(dtype)), impl=impl, reduction="none")
    assert torch.equal(loss, expected)


def test_unsigned_targets_are_compared_to_ignore_index_as_integers(device: str) -> None:
    arguments = valid_arguments(device)
    targets = arguments.pop("targets")
    targets[0, 0] = 156  # -100 in uint8 arithmetic
    arguments["c"] = torch.randn(200, D, device=device)
    expected = call(dict(arguments, targets=targets), reduction="none", impl="torch")
    loss = call(dict(arguments, targets=targets.to(torch.uint8)), reduction="none")
    assert loss[0, 0] > 0 and torch.allclose(loss, expected)


def test_uint64_target_beyond_int64_is_out_of_range(device: str) -> None:
    """2^64 - 100 is -100 as an int64, but it is no ignore_index: it is out of range."""
    arguments = valid_arguments(device)
    targets = arguments.pop("targets").to(torch.uint64)
    targets[1, 2] = torch.tensor(2**64 - 100, dtype=torch.uint64)
    with pytest.raises(ValueError, match=names("targets")):
        call(dict(arguments, targets=targets))


@pytest.mark.parametrize("ignore_index", [np.int64(-100), np.int32(-100), np.int16(-100)],
                         ids=["int64", "int32", "int16"])
def test_numpy_integer_ignore_index_is_accepted(ignore_index, device: str) -> None:
    """As F.cross_entropy accepts it."""
    arguments = valid_arguments(device)
    expected = call(dict(arguments), reduction="none")
    assert torch.equal(call(arguments, ignore_index=ignore_index, reduction="none"), expected)


@pytest.mark.parametrize("impl", COMPUTE_IMPLS)
def test_targets_that_shift_drops_are_not_checked(impl: str, device: str) -> None:
    """With shift=1 no position is scored against targets[..., 0]: an out-of-range value there
    changes nothing, while one at the last position, which is scored, still raises."""
    arguments = valid_arguments(device)
    expected = call(dict(arguments), impl=impl, shift=1, reduction="none")
    arguments["targets"][:, 0] = V
    assert torch.equal(call(dict(arguments), impl=impl, shift=1, reduction="none"), expected)
    arguments["targets"][2, -1] = V
    with pytest.raises(ValueError, match=names("targets")):
        call(arguments, impl=impl, shift=1)


@pytest.mark.parametrize("option, value", [("reduction", "avg"), ("impl", "triton"),
                                           ("shift", -1), ("filter_eps", 0.0),
                                           ("filter_eps", 1.0), ("filter_eps", 1e9),
                                           ("filter_correction", None)])
def test_module_checks_options_when_constructed(option: str, value) -> None:
    """LinearCrossEntropy rejects a bad option at construction, naming it."""
    with pytest.raises(ValueError, match=names(option)):
        cce.LinearCrossEntropy(**{option: value})


def test_the_function_and_the_module_take_the_options_that_loss_options_lists() -> None:
    """One list of options (cce.options.LossOptions): the function's keywords besides the
    tensors bias and weight are its fields, with the same defaults, and the module takes the
    same names; an unknown one is a TypeError, as for any Python function."""
    keywords = {name: parameter.default for name, parameter
                in inspect.signature(cce.linear_cross_entropy).parameters.items()
                if parameter.kind is inspect.Parameter.KEYWORD_ONLY
                and name not in ("bias", "weight")}
    fields = {field.name: field.default for field in dataclasses.fields(LossOptions)}
    assert keywords == fields
    module = cce.LinearCrossEntropy(**{name: default for name, default in fields.items()})
    assert module.options == LossOptions()
    with pytest.raises(TypeError, match="temperatur"):
        cce.LinearCrossEntropy(temperatur=2.0)


# --- Degenerate but valid inputs -------------------------------------------------------------


def _loss_and_grads(impl: str, e: torch.Tensor, c: torch.Tensor, targets: torch.Tensor,
                    reduction: str, **options):
    e = e.detach().requires_grad_()
    c = c.detach().requires_grad_()
    bias = torch.zeros(c.shape[0], device=c.device, dtype=c.dtype, requires_grad=True)
    loss, lse = cce.linear_cross_entropy(e, c, targets, bias=bias, reduction=reduction,
                                         return_lse=True, impl=impl, **options)
    grad_output = torch.full_like(loss, 0.5)
    grads = torch.autograd.grad(loss, [e, c, bias], grad_output)
    return loss, lse, grads


def _assert_empty_loss(loss: torch.Tensor, reduction: str, targets: torch.Tensor) -> None:
    assert loss.dtype == torch.float32
    if reduction == "mean":
        assert loss.shape == () and torch.isnan(loss), "mean over no tokens is NaN, as in PyTorch"
    elif reduction == "sum":
        assert loss.shape == () and loss.item() == 0.0
    else:
        assert loss.shape == targets.shape and torch.all(loss == 0)


@pytest.mark.parametrize("shift", [5, 8], ids=["shift=T", "shift>T"])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("impl", COMPUTE_IMPLS)
def test_shift_not_shorter_than_sequence_ignores_everything(impl: str, reduction: str,
                                                             shift: int, device: str) -> None:
    """shift >= sequence length is valid: no position has a target, so nothing is scored."""
    arguments = valid_arguments(device)
    e, c, targets = arguments["e"][:, :5], arguments["c"], arguments["targets"][:, :5]
    loss, lse, grads = _loss_and_grads(impl, e, c, targets, reduction, shift=shift)
    _assert_empty_loss(loss, reduction, targets)
    assert lse.shape == targets.shape and torch.isfinite(lse).all()
    for grad in grads:
        assert torch.all(grad == 0)


@pytest.mark.parametrize("batch_shape", [(0,), (3, 0)], ids=["N=0", "B=3,T=0"])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("impl", COMPUTE_IMPLS)
def test_empty_batch(impl: str, reduction: str, batch_shape: tuple, device: str) -> None:
    """No tokens at all: sum is 0, mean is NaN, "none" and lse are empty; gradients are zero
    tensors of the inputs' shapes."""
    c = torch.randn(V, D, device=device)
    e = torch.randn(*batch_shape, D, device=device)
    targets = torch.zeros(batch_shape, dtype=torch.long, device=device)
    loss, lse, (grad_e, grad_c, grad_bias) = _loss_and_grads(impl, e, c, targets, reduction)
    _assert_empty_loss(loss, reduction, targets)
    assert lse.shape == targets.shape and lse.dtype == torch.float32
    assert grad_e.shape == e.shape and grad_c.shape == c.shape and grad_bias.shape == (V,)
    assert torch.all(grad_c == 0) and torch.all(grad_bias == 0)


@pytest.mark.parametrize("softcap", [None, 2.0], ids=["plain", "softcap"])
@pytest.mark.parametrize("impl", COMPUTE_IMPLS)
def test_zero_dimensions_score_the_bias_alone(impl: str, softcap, device: str) -> None:
    """D = 0, as in F.cross_entropy(e @ c.T + bias): every row's logits are the bias (log V
    without one); dE and dC are zero-size, dbias is the bias's own gradient."""
    gen = torch.Generator().manual_seed(0)
    e = torch.empty(4, 6, 0, device=device)
    c = torch.empty(V, 0, device=device)
    bias = torch.randn(V, generator=gen).to(device)
    targets = valid_arguments(device)["targets"]
    grad_output = torch.rand(targets.shape, generator=gen).to(device)
    expected = reference(e, c, targets, bias=bias, softcap=softcap, reduction="none",
                         grad_output=grad_output)
    e, c, bias = (tensor.requires_grad_() for tensor in (e, c, bias))
    loss, lse = cce.linear_cross_entropy(e, c, targets, bias=bias, softcap=softcap,
                                         reduction="none", return_lse=True, impl=impl)
    grad_e, grad_c, grad_bias = torch.autograd.grad(loss, [e, c, bias], grad_output)
    assert grad_e.shape == e.shape and grad_c.shape == c.shape
    for result, wanted in ((loss, expected.loss), (lse, expected.lse),
                           (grad_bias, expected.grad_bias)):
        assert relative_error(result, wanted) <= 1e-6

    loss = cce.linear_cross_entropy(e, c, targets, impl=impl, reduction="none")
    assert torch.allclose(loss[targets != -100], torch.tensor(math.log(V), device=device))
