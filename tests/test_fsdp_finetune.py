"""The FSDP2 fine-tuning experiment (experiments.fsdp_finetune), launched as documented: torchrun
with two processes, at its quick size (on the CPU over gloo, or on two GPUs). The launch has a
time limit, so a hang fails.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parent.parent
TIMEOUT_S = 600


def test_sharded_training_follows_the_single_device_run(tmp_path: Path) -> None:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc-per-node", "2", "-m", "experiments.fsdp_finetune", "--quick",
               "--out", str(tmp_path)]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        output, _ = process.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.communicate()
        pytest.fail(f"fsdp_finetune was not done after {TIMEOUT_S} s: killed")
    assert process.returncode == 0, output[-4000:]

    results = json.loads((tmp_path / "fsdp_finetune.json").read_text())
    assert results["meta"]["ranks"] == 2
    single, fsdp = results["rows"]
    assert (single["mode"], single["runs"], fsdp["mode"], fsdp["runs"]) == ("single", 2, "fsdp", 1)
    runs = results["details"]["runs"]
    assert sorted((run["mode"], run["repeat"]) for run in runs) == [
        ("fsdp", 0), ("single", 0), ("single", 1)]
    for run in runs:
        assert len(run["losses"]) == 3 and len(run["grad_norms"]) == 3, run
    # The loss moves, and the sharded run follows it: the same first loss (same weights and
    # batch) and the same curve up to float32 rounding of the sums over the ranks.
    first = next(run for run in runs if run["mode"] == "single" and run["repeat"] == 0)
    assert first["losses"][0] != first["losses"][-1]
    assert fsdp["max_abs_diff_vs_single_run_0"] < 1e-4, fsdp
    assert (tmp_path / "fsdp_finetune.png").stat().st_size > 0
