"""Test configuration: device selection, the Triton interpreter on CPU, reproducible seeds.

The same tests run unchanged on a CUDA machine (kernels compiled for the GPU) and on a CPU-only
machine, where the Triton kernels run in Triton's interpreter. ``TRITON_INTERPRET`` must be set
before anything imports triton, hence at the top of this file, which pytest imports first.
"""

from __future__ import annotations

import os
import zlib

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402

DEVICE: str = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture
def device() -> str:
    """The device every test tensor lives on: "cuda" when available, else "cpu"."""
    return DEVICE


@pytest.fixture
def gen(request: pytest.FixtureRequest) -> torch.Generator:
    """A CPU generator seeded from the test's id (name and parameters): reproducible inputs.

    Inputs are drawn on the CPU and then moved to ``device``, so a failing case draws the same
    numbers on every machine.
    """
    seed = zlib.crc32(request.node.nodeid.split("::", 1)[-1].encode())
    return torch.Generator().manual_seed(seed)
