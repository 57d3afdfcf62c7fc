"""The benchmark entry point runs end to end on tiny sizes and writes sane result files.

cce and the experiments are imported inside the tests: conftest.py must have set
TRITON_INTERPRET (on a CPU-only machine) before anything imports triton.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Optional

import pytest
import torch

TINY_SIZE = dict(n_tokens=64, vocab_size=256, dim=32)
ERROR_COLUMNS = ("loss_rel_err", "de_rel_err", "dc_rel_err")


@pytest.mark.slow
def test_compare_impls_writes_a_finite_accurate_row_for_every_variant(tmp_path: Path) -> None:
    import cce
    from experiments import compare_impls
    from experiments.harness import shown_method

    written = compare_impls.compare(compare_impls.ProblemSize(**TINY_SIZE), torch.float32,
                                    tmp_path)

    assert written.json_path == tmp_path / "compare_impls.json"
    assert written.markdown_path == tmp_path / "compare_impls.md"
    assert written.errors == []
    results = json.loads(written.json_path.read_text())
    markdown = written.markdown_path.read_text()
    assert results["environment"]["torch"] == torch.__version__
    assert results["meta"]["n_tokens"] == TINY_SIZE["n_tokens"]

    rows = results["rows"]
    assert {row["impl"] for row in rows} == set(cce.IMPLEMENTATIONS)
    assert [row["variant"] for row in rows] == [v.name for v in compare_impls.variants()]
    # float32 against float64: only rounding. On a GPU the kernels' dots may use TF32.
    tolerance = 5e-3 if torch.cuda.is_available() else 1e-5
    if not torch.cuda.is_available():  # the report names the interpreter, the JSON the variant
        assert "| cce (interpreter) |" in markdown
        assert "| cce (filter_eps=None, interpreter) |" in markdown
        assert "| cce_torch |" in markdown and "| torch |" in markdown
    for row in rows:
        assert "error" not in row, row
        shown = shown_method(row["variant"]) if row["impl"] == "cce" else row["variant"]
        assert f"| {shown} |" in markdown
        for column in ERROR_COLUMNS:
            assert math.isfinite(row[column]) and row[column] < tolerance, (row["variant"], column)
        for column in ("fwd_ms", "bwd_ms", "fwd_bwd_ms"):
            assert row[column] > 0, (row["variant"], column)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU warning is for CPU runs")
def test_cpu_results_say_loudly_that_they_are_not_gpu_timings(tmp_path: Path) -> None:
    from experiments.harness import write_results

    written = write_results("smoke", [{"variant": "x", "fwd_ms": 1.5, "error": "Boom: a|b"},
                                      {"variant": "y", "fwd_ms": 2.5}],
                            {"n_tokens": 1}, tmp_path, kernel_methods={"variant": ["y"]})

    assert "NOT GPU TIMINGS" in written.markdown
    assert "| x | 1.5 | Boom: a\\|b |" in written.markdown
    # A method of cce's kernels is named with the interpreter in the report, not in the JSON.
    assert "| y (interpreter) | 2.5 |" in written.markdown
    assert [row["variant"] for row in json.loads(written.json_path.read_text())["rows"]] == [
        "x", "y"]
    assert written.errors == ["Boom: a|b"]


def test_results_record_the_transformers_that_tokenized_real_data(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Real data depends on the tokenizer's transformers version: a process that imported
    transformers records the version it imported; one that did not records None."""
    import sys
    import types

    from experiments.harness import environment, write_results

    monkeypatch.setitem(sys.modules, "transformers", types.SimpleNamespace(__version__="9.8.7"))
    written = write_results("smoke", [{"variant": "x"}], {}, tmp_path)
    assert json.loads(written.json_path.read_text())["environment"]["transformers"] == "9.8.7"
    assert "transformers 9.8.7" in written.markdown

    monkeypatch.delitem(sys.modules, "transformers")
    assert environment()["transformers"] is None


def test_main_rejects_an_unknown_experiment() -> None:
    from experiments.__main__ import main

    with pytest.raises(SystemExit) as exit_info:
        main(["--only", "no_such_experiment"])
    assert exit_info.value.code == 2


# The registry only: importing the experiments package imports torch, not triton.
@pytest.mark.parametrize("name", list(__import__("experiments").EXPERIMENTS))
def test_every_experiment_has_a_command_line_of_its_own(
        name: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """``python -m experiments.NAME`` runs that experiment's command line, as ``python -m
    experiments --only NAME`` does (not a silent import that writes nothing)."""
    import runpy
    import warnings

    from experiments import EXPERIMENTS

    monkeypatch.setattr(sys, "argv", [name, "--help"])
    with pytest.raises(SystemExit) as exit_info, warnings.catch_warnings():
        # runpy warns that the module was imported already (by other tests): harmless here.
        warnings.simplefilter("ignore", RuntimeWarning)
        runpy.run_module(EXPERIMENTS[name], run_name="__main__")
    assert exit_info.value.code == 0
    assert f"usage: python -m experiments.{name}" in capsys.readouterr().out


def test_an_experiments_own_command_line_writes_its_results(tmp_path: Path) -> None:
    from experiments.fig1_memory import main

    assert main(["--out", str(tmp_path)]) == 0
    assert {"fig1_memory.json", "fig1_memory.md", "fig1_memory.png"} <= {
        path.name for path in tmp_path.iterdir()}


def test_main_rejects_a_data_file_that_does_not_exist(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from experiments.__main__ import main

    with pytest.raises(SystemExit) as exit_info:
        main(["--data", str(tmp_path / "missing.json"), "--only", "fig1_memory"])
    assert exit_info.value.code == 2
    assert "--data" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter runs on CPU-only machines")
def test_importing_the_experiments_turns_on_the_triton_interpreter_before_triton() -> None:
    """``python -m experiments[.NAME]`` measures cce's kernels in Triton's interpreter on a CPU:
    importing the package sets TRITON_INTERPRET=1 before triton is imported, and keeps a value
    that the caller set."""
    import os
    import subprocess
    import sys

    code = ("import os, sys, experiments; "
            "print(os.environ.get('TRITON_INTERPRET'), 'triton' in sys.modules)")
    repository = Path(__file__).resolve().parents[1]
    environment = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}

    def run(**variables: str) -> str:
        return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                              check=True, cwd=repository,
                              env={**environment, **variables}).stdout.strip()

    assert run() == "1 False"
    assert run(TRITON_INTERPRET="0") == "0 False"


@pytest.mark.parametrize("name", ["smoke", "fig1_memory"])
def test_the_interpreter_caveat_comes_first_where_an_experiment_times_kernels(
        name: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """On a CPU, an experiment that times anything starts by saying what its timings are not;
    one that only computes (COMPUTED_ONLY) says nothing of timings."""
    from experiments import COMPUTED_ONLY, harness

    assert "fig1_memory" in COMPUTED_ONLY and "smoke" not in COMPUTED_ONLY
    said = []

    def run() -> harness.WrittenResults:
        said.append(capsys.readouterr().err)  # what was logged before the experiment ran
        return harness.write_results(name, [{"variant": "x", "fwd_ms": 1.0}], {}, tmp_path)

    outcome, errors = harness.run_experiment(name, tmp_path, run)
    assert outcome.status == "ok" and errors == []
    caveat = f"{name}: {harness.INTERPRETER_CAVEAT}"
    assert (caveat in said[0]) == (name not in COMPUTED_ONLY and not harness.ON_GPU)
    assert "thousands of times slower than a GPU" in harness.INTERPRETER_CAVEAT


def test_quick_runs_write_to_a_scratch_folder_and_end_with_a_summary(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """Without --out a quick run writes to QUICK_RESULTS_DIR, never to the committed results, and
    prints one line per experiment (name, seconds, status, files), not the reports."""
    from experiments import harness
    from experiments.__main__ import main

    monkeypatch.setattr(harness, "QUICK_RESULTS_DIR", tmp_path / "quick")
    monkeypatch.setattr(harness, "RESULTS_DIR", tmp_path / "results")

    assert main(["--quick", "--only", "fig1_memory"]) == 0

    assert sorted(path.name for path in (tmp_path / "quick").iterdir()) == [
        "fig1_memory.json", "fig1_memory.md", "fig1_memory.png"]
    assert not (tmp_path / "results").exists()
    output = capsys.readouterr()
    # fig1_memory times nothing: no interpreter caveat (test_the_interpreter_caveat_...).
    assert harness.INTERPRETER_CAVEAT not in output.err
    lines = output.out.splitlines()
    assert len(lines) == 2
    name, seconds, unit, status, *files = lines[0].split()
    assert (name, unit, status) == ("fig1_memory", "s", "ok") and float(seconds) >= 0
    assert files == ["fig1_memory.json", "fig1_memory.md", "fig1_memory.png"]
    assert lines[1].startswith("Files in ") and lines[1].endswith("quick")


def test_the_default_output_folders_are_results_for_full_runs_and_ignored_for_quick() -> None:
    import shutil
    import subprocess

    from experiments.harness import QUICK_RESULTS_DIR, REPOSITORY, RESULTS_DIR, default_out_dir

    assert default_out_dir(quick=False) == RESULTS_DIR == REPOSITORY / "results"
    assert default_out_dir(quick=True) == QUICK_RESULTS_DIR
    if shutil.which("git") is None or not (REPOSITORY / ".git").exists():
        pytest.skip("not a git checkout")
    ignored = subprocess.run(["git", "check-ignore", "-q", str(QUICK_RESULTS_DIR / "bench.png")],
                             cwd=REPOSITORY)
    assert ignored.returncode == 0, f"git does not ignore {QUICK_RESULTS_DIR}"


def test_a_failing_experiment_is_reported_and_the_others_still_run(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    import experiments
    from experiments.__main__ import main

    monkeypatch.setitem(experiments.EXPERIMENTS, "broken", "no_such_module_of_experiments")

    status = main(["--out", str(tmp_path), "--only", "broken", "fig1_memory"])

    assert status == 1
    output = capsys.readouterr()
    broken, working = output.out.splitlines()[:2]
    assert broken.startswith("broken") and "FAILED (ModuleNotFoundError" in broken
    assert broken.endswith("no files")
    assert working.startswith("fig1_memory") and " ok " in working
    assert "FAILED broken: ModuleNotFoundError" in output.err


def test_the_data_path_reaches_the_experiments_that_read_data(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """--data goes to every experiment whose run() takes a data path, and only to those."""
    import types

    import experiments
    from experiments.__main__ import main
    from experiments.harness import write_results

    calls = []

    def reads_data(quick: bool, out_dir: Path, data_path: Optional[Path] = None):
        calls.append(("reads_data", data_path))
        return write_results("reads_data", [], {}, out_dir)

    def reads_no_data(quick: bool, out_dir: Path):
        calls.append(("reads_no_data", None))
        return write_results("reads_no_data", [], {}, out_dir)

    for run in (reads_data, reads_no_data):
        module = types.ModuleType(f"fake_{run.__name__}")
        module.run = run
        monkeypatch.setitem(sys.modules, module.__name__, module)
        monkeypatch.setitem(experiments.EXPERIMENTS, run.__name__, module.__name__)
    data = tmp_path / "alpaca.json"
    data.write_text("[]")

    assert main(["--out", str(tmp_path), "--data", str(data),
                 "--only", "reads_data", "reads_no_data"]) == 0
    assert calls == [("reads_data", data), ("reads_no_data", None)]


def test_timing_figures_name_the_device_that_measured() -> None:
    from experiments.harness import ON_GPU, device_label, environment

    if ON_GPU:
        assert device_label(environment()) == torch.cuda.get_device_name()
    else:
        assert device_label(environment()) == "CPU (Triton interpreter): not GPU timings"
    # A report merged or redrawn on another machine names the device of its measurements.
    assert device_label({**environment(), "device": "a GPU"}) == "a GPU"


def test_methods_of_cces_kernels_are_named_with_the_interpreter_where_it_ran_them() -> None:
    from experiments.harness import environment, shown_method

    interpreted = {**environment(), "device": "cpu", "triton_interpret": True}
    assert shown_method("cce", interpreted) == "cce (interpreter)"
    assert shown_method("cce (filter_eps=None)",
                        interpreted) == "cce (filter_eps=None, interpreter)"
    assert shown_method("CCE (ours)", interpreted) == "CCE (ours, interpreter)"
    for elsewhere in ({**interpreted, "device": "a GPU"},
                      {**interpreted, "triton_interpret": False}):
        assert shown_method("cce", elsewhere) == "cce"


def test_log_axes_are_labelled_with_plain_numbers() -> None:
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    from experiments.harness import label_log_axis

    figure, axis = plt.subplots()
    axis.plot([1, 2], [0.7, 75])
    axis.set_yscale("log")
    axis.set_ylim(0.6, 80)
    label_log_axis(axis)
    figure.canvas.draw()
    assert [label.get_text() for label in axis.get_yticklabels()] == [
        "1", "2", "5", "10", "20", "50"]
    assert not any(label.get_text() for label in axis.get_yticklabels(minor=True))
    axis.set_ylim(24, 400)  # under two decades: finer steps
    label_log_axis(axis)
    figure.canvas.draw()
    assert [label.get_text() for label in axis.get_yticklabels()] == [
        "30", "50", "70", "100", "150", "200", "300"]
    plt.close(figure)


@pytest.mark.slow
@pytest.mark.skipif(not (Path(__file__).resolve().parents[1] / ".git").exists(),
                    reason="compares git revisions: needs a git checkout")
def test_ab_compares_a_revision_with_the_tree_in_one_process(
        capsys: pytest.CaptureFixture[str]) -> None:
    """``python -m experiments.ab HEAD --kernels 3``: HEAD's package and a copy of the tree's,
    imported beside the tree's under names of their own, give the tree's loss and gradients bit
    for bit (the copy always; HEAD where the tree is committed), and each gets its median time,
    its ratio to the tree, the host time of its forward call and its time per kernel, the
    copies' custom ops named as the tree's."""
    from experiments import ab, harness

    comparison = ab.main(["HEAD", "--shapes", "quick", "--rounds", "1", "--steps", "1",
                          "--kernels", "3"])["quick"]
    assert set(comparison.bit_for_bit) == {"HEAD", ab.TREE_COPY}
    assert comparison.bit_for_bit[ab.TREE_COPY] == [True, True, True]
    assert set(comparison.medians) == {ab.TREE, "HEAD", ab.TREE_COPY}
    assert all(median["ms"] > 0 and median["forward_host_ms"] > 0
               for median in comparison.medians.values())
    assert set(comparison.kernels) == set(comparison.medians)
    busiest = max(comparison.kernels[ab.TREE], key=comparison.kernels[ab.TREE].get)
    assert comparison.kernels[ab.TREE_COPY].get(busiest, 0.0) > 0
    said = capsys.readouterr().err
    assert "of the tree" in said and "bit for bit in deterministic mode" in said
    assert busiest[:70] in said
    assert (harness.INTERPRETER_CAVEAT in said) == (not harness.ON_GPU)


def test_the_tools_take_loss_options_as_key_equals_value() -> None:
    """``--option KEY=VALUE`` of ``experiments.ab`` and ``experiments.roofline``: the value as a
    Python literal where it is one, else as a string; anything but KEY=VALUE is refused with
    argparse's message (exit status 2)."""
    import argparse

    from experiments import roofline
    from experiments.harness import ON_GPU, loss_option

    assert loss_option("keep_tiles=True") == ("keep_tiles", True)
    assert loss_option("filter_eps=None") == ("filter_eps", None)
    assert loss_option("filter_eps=2**-10") == ("filter_eps", "2**-10")  # not a literal
    assert loss_option("label_smoothing=0.1") == ("label_smoothing", 0.1)
    assert loss_option("memory=fast") == ("memory", "fast")
    for text in ("memory", "=fast", "no such=1"):
        with pytest.raises(argparse.ArgumentTypeError, match="KEY=VALUE"):
            loss_option(text)
    with pytest.raises(SystemExit) as refused:
        roofline.main(["--option", "memory"])
    assert refused.value.code == 2
    if not ON_GPU:
        with pytest.raises(SystemExit, match="needs a CUDA device"):
            roofline.main(["--option", "memory=fast", "--shapes", "llama3_8b"])
