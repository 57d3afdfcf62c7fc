"""Specification of ``cce.linear_cross_entropy`` as training code uses a loss.

- A registered op (``cce::loss_forward``, ``cce::loss_backward``): torch.compile(fullgraph=True)
  runs it, FakeTensor and meta inputs give shapes and dtypes, torch.func transforms work, and a
  double backward raises instead of silently dropping the second-order term.
- PyTorch's semantics at the edges: losses are never negative, softcap keeps float32 accuracy at
  any cap, and under torch.autocast e and c are cast as F.linear would cast them.
  (Target dtypes, numpy ``ignore_index``, ``shift`` and D = 0: tests/test_validation.py.)
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import cce
from cce.cce_function import loss_backward, loss_forward
from cce.config import forward_vocab_splits, kernel_configs
from tests import helpers
from tests.conftest import DEVICE
from tests.helpers import Inputs, check, make_grad_output, run, run_reference
from tests.reference import relative_error

# Sizes that are multiples of no block (32 tokens x 128 vocab x 32 dims in Triton's interpreter),
# smaller than tests/helpers.py's 600 x 72 (5 x 3 blocks a token block): 3 x 2 blocks, for a
# fraction of the time of each test here that runs the kernels.
V, D = 300, 40


def make_inputs(gen: torch.Generator, device: str, dtype: torch.dtype, **options) -> Inputs:
    """:func:`tests.helpers.make_inputs` of this file's vocabulary and dimension by default."""
    return helpers.make_inputs(gen, device, dtype, **{"vocab": V, "dim": D, **options})

BATCH, SEQ = 3, 11  # (BATCH, SEQ) tokens for the tests that want a batch dimension


def _leaves(*tensors: torch.Tensor) -> "list[torch.Tensor]":
    return [tensor.detach().requires_grad_() for tensor in tensors]


# --- torch.compile -----------------------------------------------------------------------------


def _loss_and_lse(e, c, targets, bias):
    return cce.linear_cross_entropy(e, c, targets, bias=bias, shift=1, return_lse=True,
                                    reduction="sum")


def test_fullgraph_compile_matches_eager(device: str, gen: torch.Generator) -> None:
    """A function calling the loss compiles without graph breaks (default filter, bias, shift,
    lse), and gives eager's loss, lse and gradients."""
    inputs = make_inputs(gen, device, torch.float32, shape=(BATCH, SEQ), bias=True)
    compiled = torch.compile(_loss_and_lse, fullgraph=True)

    results = []
    for function in (_loss_and_lse, compiled):
        e, c, bias = _leaves(inputs.e, inputs.c, inputs.bias)
        loss, lse = function(e, c, inputs.targets, bias)
        grads = torch.autograd.grad(loss + lse.sum(), [e, c, bias])
        results.append((loss, lse, *grads))
    for eager, compiled_result in zip(*results):
        assert relative_error(compiled_result, eager) <= 1e-6


def _all_outputs(e, c, targets, bias):
    return cce.linear_cross_entropy(e, c, targets, bias=bias, shift=1, return_lse=True,
                                    return_entropy=True, return_argmax=True, reduction="sum",
                                    z_loss=1e-3, temperature=0.7)


def test_fullgraph_compile_with_entropy_and_argmax_matches_eager(device: str,
                                                                  gen: torch.Generator) -> None:
    """The same with every output (lse, entropy, argmax), z_loss and a temperature: eager's
    loss, lse, entropy and argmax, and the gradients of ``loss + sum(lse) + sum(entropy * w)``
    (w random)."""
    inputs = make_inputs(gen, device, torch.float32, shape=(BATCH, SEQ), bias=True)
    entropy_weight = torch.randn(BATCH, SEQ, generator=gen).to(device)
    compiled = torch.compile(_all_outputs, fullgraph=True)

    results = []
    for function in (_all_outputs, compiled):
        e, c, bias = _leaves(inputs.e, inputs.c, inputs.bias)
        loss, lse, entropy, argmax = function(e, c, inputs.targets, bias)
        grads = torch.autograd.grad(loss + lse.sum() + (entropy * entropy_weight).sum(),
                                    [e, c, bias])
        results.append((argmax, loss, lse, entropy, *grads))
    (eager_argmax, *eager), (compiled_argmax, *compiled_results) = results
    assert compiled_argmax.dtype == torch.int64 and torch.equal(compiled_argmax, eager_argmax)
    for name, eager_value, compiled_value in zip(("loss", "lse", "entropy", "dE", "dC", "dbias"),
                                                 eager, compiled_results):
        assert relative_error(compiled_value, eager_value) <= 1e-6, name


def test_out_of_range_target_under_compile_gives_nan(device: str, gen: torch.Generator) -> None:
    """Under torch.compile the host cannot read the range check: the loss is NaN instead."""
    inputs = make_inputs(gen, device, torch.float32, shape=(BATCH, SEQ))
    compiled = torch.compile(cce.linear_cross_entropy, fullgraph=True)
    assert torch.isfinite(compiled(inputs.e, inputs.c, inputs.targets))
    inputs.targets[1, 2] = V
    assert torch.isnan(compiled(inputs.e, inputs.c, inputs.targets))


# --- Fake and meta tensors -----------------------------------------------------------------


def _shapes_and_dtypes(e, c, targets, bias) -> dict:
    e, c, bias = _leaves(e, c, bias)
    loss, lse = cce.linear_cross_entropy(e, c, targets, bias=bias, reduction="none",
                                         return_lse=True)
    grads = torch.autograd.grad(loss.sum() + lse.sum(), [e, c, bias])
    return {name: (tuple(tensor.shape), tensor.dtype)
            for name, tensor in zip(("loss", "lse", "grad_e", "grad_c", "grad_bias"),
                                    (loss, lse, *grads))}


def _expected_shapes_and_dtypes(dtype: torch.dtype) -> dict:
    return {"loss": ((BATCH, SEQ), torch.float32), "lse": ((BATCH, SEQ), torch.float32),
            "grad_e": ((BATCH, SEQ, D), dtype), "grad_c": ((V, D), dtype),
            "grad_bias": ((V,), dtype)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_meta_tensors_give_shapes_and_dtypes(dtype: torch.dtype) -> None:
    e = torch.empty(BATCH, SEQ, D, dtype=dtype, device="meta")
    c = torch.empty(V, D, dtype=dtype, device="meta")
    bias = torch.empty(V, dtype=dtype, device="meta")
    targets = torch.empty(BATCH, SEQ, dtype=torch.long, device="meta")
    assert _shapes_and_dtypes(e, c, targets, bias) == _expected_shapes_and_dtypes(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_fake_tensors_give_shapes_and_dtypes(dtype: torch.dtype, device: str) -> None:
    with FakeTensorMode():
        e = torch.empty(BATCH, SEQ, D, dtype=dtype, device=device)
        c = torch.empty(V, D, dtype=dtype, device=device)
        bias = torch.empty(V, dtype=dtype, device=device)
        targets = torch.zeros(BATCH, SEQ, dtype=torch.long, device=device)
        shapes = _shapes_and_dtypes(e, c, targets, bias)
    assert shapes == _expected_shapes_and_dtypes(dtype)


# atol: an entry of dC sums hundreds of tokens' terms, which can nearly cancel, so another
# (sync-free) pass plan moves it by a few 1e-6 in float32 (2.5e-6 seen once on an H100).
TOLERANCES = {"rtol": 1e-4, "atol": 1e-5}
OPCHECK_VOCAB = V  # one forward program's vocabulary on a GPU, two on CPU (256 each)


@pytest.mark.parametrize("filter_eps, softcap, smoothing",
                         [(None, None, 0.0), (2.0**-12, 30.0, 0.1)],
                         ids=["nofilter", "filter_softcap_smoothing"])
def test_ops_pass_torch_library_opcheck(filter_eps, softcap, smoothing, device: str,
                                        gen: torch.Generator) -> None:
    """torch.library.opcheck: schemas, fake implementations against the real ones, autograd
    registration, and tracing by AOTAutograd, for both ops: without the filter (and its tile
    bounds) and the forward's curvature sum, then with both (the filter, and a softcap and
    smoothing, which together need the curvature sum). Eager and traced gradients are compared
    at 1e-4: the locked LSE merge and the pass plans (the traced one is sync-free) may change
    their last bits, a wrong registration changes them entirely.

    opcheck compares every output, the tile bounds too, which read the LSE that other programs
    of the same token block are merging: exact only with one forward program per token block,
    hence a vocabulary that one program covers on a GPU (the interpreter runs two, in turn)."""
    inputs = make_inputs(gen, device, torch.float32, bias=True, ignored_fraction=0.2,
                         vocab=OPCHECK_VOCAB)
    if device == "cuda":
        grid = kernel_configs(torch.float32).lse_forward
        assert forward_vocab_splits(-(-inputs.e.shape[0] // grid.block_tokens),
                                    -(-OPCHECK_VOCAB // grid.block_vocab),
                                    inputs.e.device, records_bounds=True) == 1
    targets = torch.where(inputs.targets >= 0, inputs.targets, -1)
    e, c, bias = _leaves(inputs.e, inputs.c, inputs.bias)
    forward_args = (e, c, bias, targets, None, softcap, filter_eps, True, True, smoothing, False,
                    False, True, True, True, True)
    torch.library.opcheck(loss_forward, forward_args, **TOLERANCES)
    _, lse, _entropy, _argmax, *forward_outputs = loss_forward(*forward_args)
    grad_loss = make_grad_output(gen, inputs, "none")
    backward_args = (inputs.e, inputs.c, inputs.bias, targets, None, lse.detach(),
                     *forward_outputs, grad_loss, torch.zeros_like(grad_loss),
                     torch.randn_like(grad_loss), softcap, filter_eps, True, smoothing, False,
                     True, True)
    torch.library.opcheck(loss_backward, backward_args, **TOLERANCES)


# --- torch.func --------------------------------------------------------------------------------


def test_torch_func_grad_matches_autograd(device: str, gen: torch.Generator) -> None:
    inputs = make_inputs(gen, device, torch.float32)

    def loss(e, c):
        return cce.linear_cross_entropy(e, c, inputs.targets, filter_eps=None)

    grad_e, grad_c = torch.func.grad(loss, argnums=(0, 1))(inputs.e, inputs.c)
    e, c = _leaves(inputs.e, inputs.c)
    expected = torch.autograd.grad(loss(e, c), [e, c])
    assert relative_error(grad_e, expected[0]) <= 1e-6
    assert relative_error(grad_c, expected[1]) <= 1e-6


@pytest.mark.parametrize("impl,memory", [("cce", "low"), ("cce_torch", "low"),
                                         ("cce_torch", "fast")])
def test_vmap_of_grad_gives_per_sample_gradients(device: str, gen: torch.Generator, impl: str,
                                                 memory: str) -> None:
    """torch.func.vmap over a batch of sequences, here of per-sample gradients: the same as a
    loop over the samples (the vmap rules run them sample by sample), without PyTorch's
    warning about a missing batching rule; on the kernels' path and on the chunked PyTorch
    path (the CPU's), whose forward and backward write their chunks in place."""
    inputs = make_inputs(gen, device, torch.float32, shape=(BATCH, SEQ))

    def loss(e, c, targets):
        return cce.linear_cross_entropy(e, c, targets, filter_eps=None, impl=impl,
                                        memory=memory)

    per_sample = torch.func.vmap(torch.func.grad(loss, argnums=(0, 1)), in_dims=(0, None, 0))
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*batching rule")
        grad_e, grad_c = per_sample(inputs.e, inputs.c, inputs.targets)
    for sample in range(BATCH):
        e, c = _leaves(inputs.e[sample], inputs.c)
        expected = torch.autograd.grad(loss(e, c, inputs.targets[sample]), [e, c])
        assert relative_error(grad_e[sample], expected[0]) <= 1e-6
        assert relative_error(grad_c[sample], expected[1]) <= 1e-6


# --- Double backward ---------------------------------------------------------------------------


@pytest.mark.parametrize("impl", ["cce", "cce_torch"])
def test_double_backward_raises_instead_of_dropping_the_second_order_term(
        device: str, gen: torch.Generator, impl: str) -> None:
    """With create_graph=True the gradients are the right ones, but a term built on them (a
    gradient penalty) cannot be differentiated through the loss: it raises, naming why, on the
    kernels' path and on the chunked PyTorch path alike."""
    inputs = make_inputs(gen, device, torch.float32)
    e, c = _leaves(inputs.e, inputs.c)
    grad_e, grad_c = torch.autograd.grad(
        cce.linear_cross_entropy(e, c, inputs.targets, impl=impl), [e, c], create_graph=True)
    e_once, c_once = _leaves(inputs.e, inputs.c)
    expected = torch.autograd.grad(
        cce.linear_cross_entropy(e_once, c_once, inputs.targets, impl=impl), [e_once, c_once])
    assert torch.equal(grad_e, expected[0]) and torch.equal(grad_c, expected[1])

    penalty = grad_e.square().sum() + grad_c.square().sum()
    for wrt in (e, c):
        with pytest.raises(RuntimeError, match="differentiable once"):
            torch.autograd.grad(penalty, [wrt], retain_graph=True)
    # The README's gradient penalty: backward() through it raises too, never a c.grad that
    # silently lacks the penalty's part.
    e, c = _leaves(inputs.e, inputs.c)
    loss = cce.linear_cross_entropy(e, c, inputs.targets, impl=impl)
    (grad_e,) = torch.autograd.grad(loss, [e], create_graph=True)
    with pytest.raises(RuntimeError, match="differentiable once"):
        (loss + grad_e.square().sum()).backward()

    def loss(e):
        return cce.linear_cross_entropy(e, inputs.c, inputs.targets, impl=impl)

    with pytest.raises(RuntimeError, match="differentiable once"):
        torch.func.grad(lambda e: torch.func.grad(loss)(e).square().sum())(inputs.e)


# --- Edge cases --------------------------------------------------------------------------------


def test_per_token_losses_are_never_negative(device: str, gen: torch.Generator) -> None:
    """On rows whose softmax is one-hot to float32 precision, lse and the target logit (which
    come from different kernels) round to values whose difference can be below 0; PyTorch's
    loss never is. Every other row here is one of those (its target logit about 30 above the
    others); loss and gradients stay as accurate as on the ordinary rows."""
    inputs = make_inputs(gen, device, torch.float32, ignored_fraction=0)
    target_rows = inputs.c[inputs.targets[::2]]
    inputs.e[::2] += 30 * target_rows / target_rows.square().sum(dim=1, keepdim=True)

    result = check("cce", inputs, gen, reduction="none", filter_eps=None)
    assert (result.loss >= 0).all(), f"most negative loss {result.loss.min().item():.2e}"


@pytest.mark.parametrize("softcap", [1e5, 1e3, 30.0])
def test_softcap_keeps_float32_accuracy_at_any_cap(softcap: float, device: str,
                                                   gen: torch.Generator) -> None:
    """A large cap makes tanh's argument small, where computing it from exp or sigmoid cancels:
    loss, lse and gradients stay within float32's tolerance of the float64 reference."""
    inputs = make_inputs(gen, device, torch.float32, scale=10.0, bias=True)
    check("cce", inputs, gen, softcap=softcap, filter_eps=None)


# --- torch.autocast ----------------------------------------------------------------------------


AUTOCAST_CASES = [("cpu", torch.bfloat16)] + [
    pytest.param("cuda", dtype, marks=pytest.mark.skipif(DEVICE != "cuda", reason="no GPU"))
    for dtype in (torch.float16, torch.bfloat16)]


@pytest.mark.parametrize("memory", ["low", "fast"])
@pytest.mark.parametrize("e_dtype", [torch.float32, torch.bfloat16], ids=["e-fp32", "e-bf16"])
@pytest.mark.parametrize("device_type, autocast_dtype", AUTOCAST_CASES,
                         ids=["cpu-bf16", "cuda-fp16", "cuda-bf16"])
def test_autocast_casts_e_and_c_as_f_linear_would(device_type: str, autocast_dtype: torch.dtype,
                                                  e_dtype: torch.dtype, memory: str,
                                                  gen: torch.Generator) -> None:
    """Mixed precision: float32 weights (c, bias) and float32 or bfloat16 hidden states under
    autocast. The loss is that of e, c and bias in the autocast dtype, float32; each leaf gets
    its gradient in its own dtype (the fp32 lm_head weight an fp32 one). The same for the dense
    path (``memory="fast"``), whose products autocast must not touch."""
    inputs = make_inputs(gen, device_type, torch.float32, bias=True)
    e, c, bias = _leaves(inputs.e.to(e_dtype), inputs.c, inputs.bias)
    grad_output = make_grad_output(gen, inputs, "mean")
    with torch.autocast(device_type, dtype=autocast_dtype):
        assert torch.nn.functional.linear(e, c, bias).dtype == autocast_dtype
        loss = cce.linear_cross_entropy(e, c, inputs.targets, bias=bias, memory=memory)
        grads = torch.autograd.grad(loss, [e, c, bias], grad_output)

    cast = Inputs(inputs.e.to(e_dtype).to(autocast_dtype), inputs.c.to(autocast_dtype),
                  inputs.targets, inputs.bias.to(autocast_dtype))
    expected = run("cce", cast, grad_output, memory=memory)
    assert loss.dtype == torch.float32 and torch.equal(loss, expected.loss)
    assert [grad.dtype for grad in grads] == [e_dtype, torch.float32, torch.float32]
    for grad, expected_grad in zip(grads, (expected.grad_e, expected.grad_c,
                                           expected.grad_bias)):
        assert torch.equal(grad, expected_grad.to(grad.dtype))
    reference = run_reference(cast, grad_output)
    assert relative_error(loss, reference.loss) <= 1e-4
