"""The README's examples run as written: the CPU one everywhere, the CUDA one on a GPU, the
tensor-parallel one after the CPU one, as one rank started by torchrun.

Each runs in a fresh interpreter without ``TRITON_INTERPRET`` (which this suite sets), as a
user runs it: on CPU tensors the default path is then the chunked PyTorch one.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

README = Path(__file__).resolve().parents[1] / "README.md"


def _python_blocks() -> "list[str]":
    return re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.DOTALL)


def _run(code: str, **environment: str) -> None:
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    env.update(environment)
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                            text=True, timeout=300, cwd=README.parent)
    assert result.returncode == 0, result.stderr[-3000:]


def test_the_cpu_example_runs_as_written() -> None:
    cpu_example = _python_blocks()[0]
    assert 'device="cuda"' not in cpu_example
    _run(cpu_example + "\nassert loss.isfinite() and hidden.grad is not None\n")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the CUDA example needs a GPU")
def test_the_cuda_example_runs_as_written() -> None:
    cpu_example, cuda_example = _python_blocks()[:2]
    assert 'device="cuda"' in cuda_example
    # The CUDA example continues the CPU one (its imports).
    _run(cpu_example + cuda_example + "\nassert loss.isfinite() and hidden.grad is not None\n")


def test_every_example_is_run_here() -> None:
    """A new example needs a test of its own above."""
    assert len(_python_blocks()) == 3


def test_the_tensor_parallel_example_runs_as_written() -> None:
    """Its tensors come from the CPU example; its process group from the environment that
    torchrun gives each rank, here of a group of one, with no GPU visible (the default group of
    a GPU machine would be NCCL's, which takes no CPU tensors)."""
    cpu_example, _, parallel_example = _python_blocks()
    with socket.socket() as probe:  # a free port for the group's rendezvous
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    unsharded = "cce.linear_cross_entropy(hidden, lm_head.weight, tokens, shift=1)"
    _run(cpu_example + parallel_example
         + f"\nassert torch.allclose(loss, {unsharded})\ndist.destroy_process_group()\n",
         MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", LOCAL_RANK="0",
         WORLD_SIZE="1", CUDA_VISIBLE_DEVICES="")
