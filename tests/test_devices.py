"""CPU tensors compute on the CPU with impl="cce", and importing cce changes no setting.

CPU tensors run the Triton kernels in Triton's interpreter when ``TRITON_INTERPRET=1`` was set
before triton was imported (as ``conftest.py`` does on a CPU-only machine), and the PyTorch path
otherwise (``tests/test_cpu_path.py``); the first test covers whichever this process takes.
Where the interpreter is asked for but cannot run the kernels (triton imported before the
variable was set), the call says why. The other tests run in a subprocess with their own
environment.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Optional

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


def _run(code: str, triton_interpret: Optional[str]) -> subprocess.CompletedProcess:
    """Run ``code`` in a new Python process, with TRITON_INTERPRET set to ``triton_interpret``
    (unset when None)."""
    environment = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    if triton_interpret is not None:
        environment["TRITON_INTERPRET"] = triton_interpret
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=environment, cwd=Path(__file__).resolve().parents[1])


def test_interpreter_asked_for_after_triton_was_imported_is_a_clear_error() -> None:
    """TRITON_INTERPRET=1 set after triton was imported cannot run cce's kernels: the call says
    why and what to do, instead of failing deep in a kernel; impl="cce_torch" still works."""
    code = ("import os, triton\n"
            "os.environ['TRITON_INTERPRET'] = '1'\n"
            "import cce, torch\n"
            "args = torch.zeros(4, 8), torch.zeros(5, 8), torch.zeros(4, dtype=torch.long)\n"
            "print(float(cce.linear_cross_entropy(*args, impl='cce_torch')))\n"
            "cce.linear_cross_entropy(*args)\n")
    output = _run(code, triton_interpret=None)
    assert output.returncode != 0
    assert float(output.stdout) == pytest.approx(1.6094379)  # log(5)
    assert "RuntimeError: TRITON_INTERPRET=1 asks cce to run its kernels" in output.stderr
    assert "Set TRITON_INTERPRET=1 before anything imports triton" in output.stderr


@pytest.mark.parametrize("triton_interpret", [None, "1"], ids=["unset", "interpreting"])
def test_old_triton_warning_only_when_interpreting(triton_interpret: Optional[str]) -> None:
    """The warning about triton<3.7's interpreter (broken by numpy>=2.4) is given when cce's
    kernels run in it, and only then."""
    code = ("import warnings, triton\n"
            "triton.__version__ = '3.6.0'\n"
            "with warnings.catch_warnings(record=True) as caught:\n"
            "    warnings.simplefilter('always')\n"
            "    import cce\n"
            "print(sum('install triton>=3.7' in str(warning.message) for warning in caught))\n")
    output = _run(code, triton_interpret)
    assert output.returncode == 0, output.stderr
    assert int(output.stdout) == (1 if triton_interpret == "1" else 0)
