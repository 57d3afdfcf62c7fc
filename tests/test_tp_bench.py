"""The tensor-parallel benchmark (experiments.tp_bench), launched as documented: torchrun with two
processes over gloo, at its quick size (on the CPU, or on the GPUs there are). The launch has a
time limit, so a hang fails.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest

from tests.distributed import run_torchrun

TIMEOUT_S = 600


def test_two_ranks_at_quick_size_write_agreeing_results(tmp_path: Path) -> None:
    run_torchrun("experiments.tp_bench", ["--quick", "--backend", "gloo", "--out", str(tmp_path)],
                 nproc=2, timeout_s=TIMEOUT_S)

    results = json.loads((tmp_path / "tp_bench_tp2.json").read_text())
    assert results["meta"]["tp_size"] == 2 and results["meta"]["backend"] == "gloo"
    assert results["environment"]["date"]
    rows = results["rows"]
    assert [(row["tokens"], row["method"]) for row in rows] == [
        (48, "cce"), (48, "loss_parallel"), (96, "cce"), (96, "loss_parallel")]
    for row in rows:
        assert row["ms"] > 0, row
    for row in rows[::2]:
        # loss_parallel rounds the logits to bfloat16 first, cce does not.
        assert row["diff_loss"] < 1e-2 and row["diff_de"] < 3e-2 and row["diff_dc"] < 3e-2, row
    agreement = results["agreement"]
    assert [check["dtype"] for check in agreement] == ["bfloat16", "float32"]
    for check in agreement:
        assert 0 < check["ignored"] < check["tokens"], check
        limit = 1e-5 if check["dtype"] == "float32" else 4e-3
        for name in ("loss", "lse", "de", "dc"):
            assert math.isfinite(check[name]) and check[name] <= limit, (name, check)
    assert "## Agreement with the unsharded call" in (tmp_path / "tp_bench_tp2.md").read_text()
    assert (tmp_path / "tp_bench.png").stat().st_size > 0


def test_the_committed_figure_gives_memory_in_gb_with_plain_ticks(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """tp_bench.png from results/tp: memory in GB (10^9 bytes, the README's unit; the JSON holds
    MiB), log axes ticked with plain numbers, the token counts on the x axis."""
    pytest.importorskip("matplotlib")
    from matplotlib.figure import Figure

    from experiments import tp_bench
    from experiments.harness import REPOSITORY

    for path in (REPOSITORY / "results" / "tp").glob("tp_bench_tp*.json"):
        shutil.copy(path, tmp_path)
    figures: list[Figure] = []
    monkeypatch.setattr(Figure, "savefig", lambda figure, *args, **kwargs: figures.append(figure))
    tp_bench.plot(tmp_path)

    (figure,) = figures
    figure.canvas.draw()
    memory = [axis for axis in figure.axes if "GB" in axis.get_ylabel()]
    assert len(memory) == 2 and not any("GiB" in axis.get_ylabel() for axis in figure.axes)
    rows = json.loads((tmp_path / "tp_bench_tp2.json").read_text())["rows"]
    first = next(row for row in rows if row["method"] == "cce")
    line = next(line for line in memory[0].lines if line.get_label() == "cce, TP 2")
    assert line.get_ydata()[0] == first["peak_mib_max"] * 2**20 / 1e9
    for axis in figure.axes:
        labels = [label.get_text() for label in axis.get_yticklabels()]
        assert len(labels) >= 4 and all(float(label) > 0 for label in labels), labels
        assert [label.get_text() for label in axis.get_xticklabels()] == [
            "8192", "16384", "32768", "65536"]
