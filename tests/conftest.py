"""Test configuration: device selection, the Triton interpreter on CPU, reproducible seeds, and
parallel workers on CPU-only machines.

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
# Workers for a CPU-only run when the command line names none: the interpreter runs one core.
MAX_CPU_WORKERS = 4


def pytest_configure(config: pytest.Config) -> None:
    """Without a GPU, run the tests on every core (at most ``MAX_CPU_WORKERS``) through
    pytest-xdist, when it is installed and the command line chose no ``-n``: the interpreter
    keeps a single core busy. (On a GPU machine, ``-n`` is for the caller to choose.) This runs
    before xdist's own configure hook, which starts the workers."""
    config.addinivalue_line("markers", "slow: one of the suite's longest tests (tens of seconds "
                            "on two cores), collected first so that workers start it early")
    if (DEVICE == "cuda" or not config.pluginmanager.has_plugin("xdist")
            or hasattr(config, "workerinput") or config.getoption("numprocesses") is not None
            or config.getoption("dist") != "no" or config.getoption("collectonly")):
        return
    workers = min(os.cpu_count() or 1, MAX_CPU_WORKERS)
    if workers > 1:
        config.option.numprocesses = workers
        config.option.dist = "load"
        config.option.tx = ["popen"] * workers


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Tests marked slow first, each group in collection order: started last, one of them would
    run alone on one core at the end of a parallel run."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)


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
