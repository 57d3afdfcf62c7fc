"""Options together, on the GPU, at a shape where every backward path runs.

At N 3001, V 50257, D 512 (bf16) the backward takes two passes, stores pass 2's tiles in the
rows of dC that are still free and ends in the spare buffer; the products' epilogues add the
filter correction and label smoothing's rank-one term, and the Triton and the Gluon dC products
both run. Each combination of options below must give the float64 reference's loss and
gradients, with a random upstream gradient per token, to within what bf16 and the default filter
cost (the errors measured are 2-4e-3). A product compiled wrong by Triton gave 0.2 here
(docs/notes/backward.md, "The bias gradient"): the bound is far below that.
"""

from __future__ import annotations

import pytest
import torch

import cce
from tests.helpers import backward_paths_inputs
from tests.reference import reference, relative_error

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

GRADIENT_TOLERANCE = 1e-2
LOSS_TOLERANCE = 1e-3

# (id, options; "weight" and "bias" switch on random class weights and a bias)
COMBINATIONS = [
    ("default", dict()),
    ("bias", dict(bias=True)),
    ("bias-smoothing", dict(bias=True, label_smoothing=0.1)),
    ("bias-weight-smoothing-deterministic",
     dict(bias=True, weight=True, label_smoothing=0.1, deterministic=True)),
    ("softcap-smoothing", dict(softcap=30.0, label_smoothing=0.1)),
    ("softcap-bias-weight", dict(softcap=30.0, bias=True, weight=True)),
    ("unsorted-bias-smoothing", dict(vocab_sorting=False, bias=True, label_smoothing=0.1)),
    ("unfiltered-bias-weight-smoothing",
     dict(filter_eps=None, bias=True, weight=True, label_smoothing=0.1)),
    ("keep_tiles-bias-smoothing", dict(keep_tiles=True, bias=True, label_smoothing=0.1)),
    ("z_loss-bias", dict(z_loss=1e-4, bias=True)),
    ("temperature-bias-smoothing", dict(temperature=0.7, bias=True, label_smoothing=0.1)),
    ("entropy-bias-smoothing-deterministic",
     dict(return_entropy=True, bias=True, label_smoothing=0.1, deterministic=True)),
    ("shift-bias-smoothing", dict(shift=1, bias=True, label_smoothing=0.1)),
    ("no_correction-bias", dict(filter_correction=False, bias=True)),
    # memory="fast": the dense path (V <= 65536), and kept tiles where the options need them.
    ("fast-bias-weight-z_loss", dict(memory="fast", bias=True, weight=True, z_loss=1e-4)),
    ("fast-temperature-shift", dict(memory="fast", temperature=0.7, shift=1)),
    ("fast-softcap-smoothing", dict(memory="fast", softcap=30.0, label_smoothing=0.1)),
]


@needs_cuda
@pytest.mark.parametrize("options", [case[1] for case in COMBINATIONS],
                         ids=[case[0] for case in COMBINATIONS])
def test_combination_matches_float64(options: dict, gen: torch.Generator) -> None:
    options = dict(options)
    e, c, bias, weight, targets = backward_paths_inputs(gen)
    bias = bias if options.pop("bias", False) else None
    if options.pop("weight", False):
        options["weight"] = weight
    n = targets.shape[0]
    grad_loss = torch.rand(n, generator=gen).to("cuda")
    entropy = options.get("return_entropy", False)
    grad_entropy = torch.randn(n, generator=gen).to("cuda") * 0.01 if entropy else None

    leaves = [x.clone().requires_grad_() for x in (e, c) + ((bias,) if bias is not None else ())]
    out = cce.linear_cross_entropy(leaves[0], leaves[1], targets,
                                   bias=leaves[2] if bias is not None else None,
                                   reduction="none", **options)
    loss = out[0] if entropy else out
    objective = (loss * grad_loss).sum()
    if entropy:
        objective = objective + (out[1] * grad_entropy).sum()
    objective.backward()

    semantics = {k: v for k, v in options.items()
                 if k in ("softcap", "shift", "weight", "label_smoothing", "temperature",
                          "z_loss")}
    if "weight" in semantics:
        semantics["weight"] = semantics["weight"].double()
    ref = reference(e, c, targets, bias=bias, reduction="none", grad_output=grad_loss.double(),
                    grad_entropy=None if grad_entropy is None else grad_entropy.double(),
                    **semantics)
    assert relative_error(loss, ref.loss) < LOSS_TOLERANCE
    for name, leaf in zip(("grad_e", "grad_c", "grad_bias"), leaves):
        assert relative_error(leaf.grad, getattr(ref, name)) < GRADIENT_TOLERANCE, name
