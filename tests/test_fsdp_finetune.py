"""The FSDP2 fine-tuning experiment (experiments.fsdp_finetune), launched as documented: torchrun
with two processes, at its quick size: on two GPUs over NCCL where there are two, on the CPU over
gloo on a machine without a GPU (the experiment needs a GPU per rank); skipped with one GPU. The
launch has a time limit, so a hang fails.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.distributed import run_torchrun

pytest.importorskip("transformers")

TIMEOUT_S = 600


@pytest.mark.slow
def test_sharded_training_follows_the_single_device_run(tmp_path: Path) -> None:
    if torch.cuda.device_count() == 1:
        # Its ranks would run on the CPU in Triton's interpreter, which in Triton 3.6 stops on
        # a scalar conversion (H100, 2026-11-25); the CPU-only suite runs it in the newer one.
        pytest.skip("needs two GPUs, or a machine without one")
    run_torchrun("experiments.fsdp_finetune", ["--quick", "--out", str(tmp_path)], nproc=2,
                 timeout_s=TIMEOUT_S)

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


def test_every_line_of_the_committed_figure_is_in_its_legend(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """fsdp_finetune.png from results/fsdp: each panel's legend has an entry (color and style)
    for every line drawn, the single-GPU repeats included."""
    pytest.importorskip("matplotlib")
    from matplotlib.figure import Figure

    from experiments import fsdp_finetune
    from experiments.harness import REPOSITORY

    figures: list[Figure] = []
    monkeypatch.setattr(Figure, "savefig", lambda figure, *args, **kwargs: figures.append(figure))
    fsdp_finetune.plot(REPOSITORY / "results" / "fsdp" / "fsdp_finetune.json")

    (figure,) = figures
    for axis in figure.axes:
        legend = axis.get_legend()
        entries = {(handle.get_color(), handle.get_linestyle()) for handle in legend.legend_handles}
        # Every line but the zero line of panel (b), which is black.
        drawn = {(line.get_color(), line.get_linestyle()) for line in axis.lines
                 if line.get_color() != "black"}
        assert drawn == entries and len(entries) == 6, (drawn, entries)
        labels = [text.get_text() for text in legend.get_texts()]
        assert sum(label.startswith("one GPU") for label in labels) == 3
