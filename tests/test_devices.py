"""CPU tensors work with impl="cce" on every machine.

On a machine without CUDA the kernels run in Triton's interpreter; on a machine with a GPU the
inputs are computed there and the loss and gradients come back to the CPU. The same test covers
whichever path the machine takes. Where the interpreter cannot run the kernels (Triton imported
before cce), the call says why.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import cce
from tests.helpers import make_inputs
from tests.reference import reference, relative_error


def test_cpu_tensors_give_cpu_results_and_gradients(gen: torch.Generator) -> None:
    inputs = make_inputs(gen, "cpu", torch.float32, bias=True)
    e = inputs.e.clone().requires_grad_()
    c = inputs.c.clone().requires_grad_()
    bias = inputs.bias.clone().requires_grad_()
    loss, lse = cce.linear_cross_entropy(e, c, inputs.targets, bias=bias, return_lse=True)
    loss.backward()

    expected = reference(inputs.e, inputs.c, inputs.targets, bias=inputs.bias)
    for name, tensor in {"loss": loss, "lse": lse, "e.grad": e.grad, "c.grad": c.grad,
                         "bias.grad": bias.grad}.items():
        assert tensor.device.type == "cpu", f"{name} is on {tensor.device}"
    assert relative_error(loss, expected.loss) <= 1e-5
    assert relative_error(lse, expected.lse) <= 1e-5
    assert relative_error(e.grad, expected.grad_e) <= 1e-5
    assert relative_error(c.grad, expected.grad_c) <= 1e-5
    assert relative_error(bias.grad, expected.grad_bias) <= 1e-5


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter runs on CPU-only machines")
def test_triton_imported_before_cce_is_a_clear_error() -> None:
    """Triton imported before cce turns its interpreter on cannot run cce's kernels: the call
    says why and what to do, instead of failing deep in a kernel; impl="torch" still works."""
    code = ("import triton, cce, torch\n"
            "args = torch.zeros(4, 8), torch.zeros(5, 8), torch.zeros(4, dtype=torch.long)\n"
            "print(float(cce.linear_cross_entropy(*args, impl='torch')))\n"
            "cce.linear_cross_entropy(*args)\n")
    environment = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    output = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            env=environment, cwd=Path(__file__).resolve().parents[1])
    assert output.returncode != 0
    assert float(output.stdout) == pytest.approx(1.6094379)  # log(5)
    assert "RuntimeError: cce runs its kernels in Triton's CPU interpreter" in output.stderr
    assert "Import cce before anything that imports triton" in output.stderr
