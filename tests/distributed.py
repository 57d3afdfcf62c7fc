"""Running a test's worker in several processes joined in a gloo group, or a module under
torchrun, with a time limit.

A worker that raises fails the test with its traceback; workers that are not all done in time
(a collective that some rank never reaches) are killed and fail it too, so a hang cannot block
the test run.
"""

from __future__ import annotations

import datetime
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Optional

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from experiments.harness import exit_rank

# A collective that waits longer than this raises in the ranks that wait.
COLLECTIVE_TIMEOUT_S = 120
ROOT = Path(__file__).resolve().parent.parent


def run_ranks(worker: Callable[..., None], world_size: int, tmp_path: Path, *args: Any,
              timeout_s: float) -> None:
    """Run ``worker(rank, world_size, *args)`` in ``world_size`` spawned processes, each in the
    default process group (gloo, rendezvous in a file of ``tmp_path``) with its
    :func:`rank_device` as the current CUDA device, if any. ``worker`` must be a module-level
    function (spawned processes import it)."""
    init_method = f"file://{tmp_path / 'rendezvous'}"
    context = mp.start_processes(_rank_main, args=(world_size, init_method, worker, args),
                                 nprocs=world_size, join=False, start_method="spawn")
    deadline = time.monotonic() + timeout_s
    try:
        # join() raises, with the worker's traceback, as soon as one process fails.
        while not context.join(timeout=max(0.0, deadline - time.monotonic())):
            if time.monotonic() >= deadline:
                pytest.fail(f"{worker.__name__} in {world_size} processes was not done after "
                            f"{timeout_s} s: killed")
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()
                process.join()


def rank_device(rank: int) -> torch.device:
    """Rank ``rank``'s device: a GPU when there is one (shared by several ranks when there are
    fewer GPUs than ranks: gloo takes CUDA tensors too), else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", rank % torch.cuda.device_count())
    return torch.device("cpu")


def _rank_main(rank: int, world_size: int, init_method: str, worker: Callable[..., None],
               args: tuple) -> None:
    if torch.cuda.is_available():
        torch.cuda.set_device(rank_device(rank))
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S))
    try:
        worker(rank, world_size, *args)
    finally:
        dist.destroy_process_group()
    exit_rank(0)  # the worker passed


def run_torchrun(module: str, arguments: list[str], nproc: int, timeout_s: float,
                 env: Optional[dict[str, str]] = None) -> str:
    """``torchrun --standalone --nproc-per-node nproc -m module *arguments`` from the repository
    root, with ``env`` added to the environment; fails the test when it exits with an error or
    is not done in time. Returns its output."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc-per-node", str(nproc), "-m", module, *arguments]
    env = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}
    # A session of its own: on a timeout, torchrun's workers are killed with it.
    process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        output, _ = process.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.communicate()
        pytest.fail(f"{module} was not done after {timeout_s} s: killed")
    assert process.returncode == 0, output[-4000:]
    return output
