"""The tensor-parallel benchmark (experiments.tp_bench), launched as documented: torchrun with two
processes over gloo, at its quick size (on the CPU, or on the GPUs there are), its three methods
(cce's local shard, cce's DTensor classifier, loss_parallel). The launch has a time limit, so a
hang fails. The documented two-GPU command parses.
"""

from __future__ import annotations

import json
import math
import shlex
import shutil
from pathlib import Path

import pytest
import torch

from tests.distributed import run_torchrun

TIMEOUT_S = 600


@pytest.mark.slow
def test_two_ranks_at_quick_size_write_agreeing_results(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # One timed call, no warm-up (each method's first call, which gives its results, warms it):
    # the interpreter's calls are what the test's time goes to.
    run_torchrun("experiments.tp_bench", ["--quick", "--backend", "gloo", "--warmup", "0",
                                          "--repeats", "1", "--out", str(tmp_path)],
                 nproc=2, timeout_s=TIMEOUT_S)

    results = json.loads((tmp_path / "tp_bench_tp2.json").read_text())
    assert results["meta"]["tp_size"] == 2 and results["meta"]["backend"] == "gloo"
    assert results["environment"]["date"]
    rows = results["rows"]
    assert [(row["tokens"], row["method"]) for row in rows] == [
        (tokens, method) for tokens in (48, 96)
        for method in ("cce", "cce_dtensor", "loss_parallel")]
    for row in rows:
        assert math.isfinite(row["ms"]) and row["ms"] > 0, row
    for row in rows:
        if row["method"] == "loss_parallel":
            continue
        # loss_parallel rounds the logits to bfloat16 first, cce does not.
        assert row["diff_loss"] < 1e-2 and row["diff_de"] < 3e-2 and row["diff_dc"] < 3e-2, row
        assert math.isfinite(row["speedup"]) and row["speedup"] > 0, row
    for cce_row, dtensor_row in zip(rows[::3], rows[1::3]):
        # The DTensor classifier runs cce's call: the same kernels on the same local tensors,
        # bit for bit in Triton's interpreter (a GPU's forward may differ in the last bits).
        limit = 1e-6 if torch.cuda.is_available() else 0.0
        assert dtensor_row["diff_cce"] <= limit, dtensor_row
        for name in ("diff_loss", "diff_de", "diff_dc"):
            assert dtensor_row[name] == pytest.approx(cce_row[name], rel=1e-3, abs=limit), name
    agreement = results["agreement"]
    assert [(check["dtype"], check["call"], check["against"]) for check in agreement] == [
        (dtype, call, against) for dtype in ("bfloat16", "float32")
        for call, against in (("vocab_parallel", "unsharded"), ("dtensor", "vocab_parallel"))]
    for check in agreement:
        assert 0 < check["ignored"] < check["tokens"], check
        if check["call"] == "dtensor":  # cce's call underneath: the same bits on the CPU
            limit = 1e-6 if torch.cuda.is_available() else 0.0
        else:
            limit = 1e-5 if check["dtype"] == "float32" else 4e-3
        for name in ("loss", "lse", "de", "dc"):
            assert math.isfinite(check[name]) and check[name] <= limit, (name, check)
    markdown = (tmp_path / "tp_bench_tp2.md").read_text()
    assert "## Agreement with the unsharded call" in markdown
    assert "| cce_dtensor |" in markdown and "diff_cce" in markdown
    assert (tmp_path / "tp_bench.png").stat().st_size > 0

    # The figure: a line per method in its own style.
    from matplotlib.figure import Figure

    from experiments import tp_bench

    figures: list[Figure] = []
    monkeypatch.setattr(Figure, "savefig", lambda figure, *args, **kwargs: figures.append(figure))
    tp_bench.plot(tmp_path)
    (figure,) = figures
    time_axis = next(axis for axis in figure.axes if axis.get_ylabel() == "ms (median)")
    styles = {line.get_label().split(" ")[0].rstrip(","): line.get_linestyle()
              for line in time_axis.lines}
    assert set(styles) == {"cce", "cce_dtensor", "loss_parallel"}, styles
    assert len(set(styles.values())) == 3, styles


def test_the_documented_two_gpu_command_parses() -> None:
    """The module's docstring gives the later two-GPU run: a command whose arguments its parser
    takes, the methods the default three."""
    from experiments import tp_bench

    documented = " ".join(tp_bench.__doc__.replace("\\\n", " ").split())
    assert tp_bench.TP_RUN in documented
    words = shlex.split(tp_bench.TP_RUN)
    assert words[:5] == ["torchrun", "--nproc-per-node", "2", "-m", "experiments.tp_bench"]
    args = tp_bench.parser().parse_args(words[5:])
    assert args.shapes == ["gemma2_2b", "llama3_8b"] and args.out == Path("results/tp")
    assert args.methods == ["cce", "cce_dtensor", "loss_parallel"] and not args.quick


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
