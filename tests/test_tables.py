"""The paper's Tables 1, A1 and A2 (experiments.table1, table_a1, table_a2), in quick mode.

The benchmark (one method) and the three tables run once, on a tiny shape, in one process as
``python -m experiments`` runs them: bench, table1, table_a2, table_a1; the tests read what they
wrote and how often they measured. cce and the experiments are
imported inside the fixtures and tests: conftest.py must have set TRITON_INTERPRET (on a
CPU-only machine) before anything imports triton.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import pytest
import torch

# The module fixture runs the three tables' experiments: its tests run first.
pytestmark = pytest.mark.slow

MIB = 2**20
TINY = dict(n_tokens=64, vocab_size=256, dim=32)
TABLES = ("table1", "table_a2", "table_a1")
MODELS = {"table1": ["Gemma 3 270M", "Gemma 2 2B"], "table_a1": ["Gemma 3 270M", "Gemma 2 2B"],
          "table_a2": ["Gemma 2 9B", "Gemma 2 27B", "Llama 3 8B", "Mistral NeMo",
                       "Phi 3.5 Mini"]}


@dataclass
class Run:
    out_dir: Path
    results: dict[str, dict[str, Any]]  # table name -> its JSON
    measurements: dict[str, int]  # experiment -> calls of measure_loss it made


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Run]:
    from dataclasses import replace

    pytest.importorskip("matplotlib")  # the benchmark draws bench.png

    from experiments import bench, table1, table_a1, table_a2

    out_dir = tmp_path_factory.mktemp("results")
    measurements: dict[str, int] = {}
    calls = 0
    measure_loss = bench.measure_loss

    def counting_measure_loss(*args: Any, **kwargs: Any) -> dict[str, Any]:
        nonlocal calls
        calls += 1
        return measure_loss(*args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(bench, "measure_loss", counting_measure_loss)
        for name in ("quick", "quick_removed"):
            patch.setitem(bench.SHAPES, name, replace(bench.SHAPES[name], **TINY))
        bench.forget_measurements()
        results = {}
        for name, experiment in (("bench", bench), ("table1", table1), ("table_a2", table_a2),
                                 ("table_a1", table_a1)):
            # The benchmark's shape that the tables share, with one method.
            options = {"shapes": ["quick"], "methods": ["torch"]} if experiment is bench else {}
            before = calls
            written = experiment.run(quick=True, out_dir=out_dir, **options)
            measurements[name] = calls - before
            assert written.errors == [], (name, written.errors)
            results[name] = json.loads(written.json_path.read_text())
        yield Run(out_dir, results, measurements)
    bench.forget_measurements()


def blocks_of(results: dict[str, Any]) -> dict[str, list[dict[str, Any]]]:
    """The table's rows by block heading, in order."""
    blocks: dict[str, list[dict[str, Any]]] = {}
    for row in results["rows"]:
        blocks.setdefault(row["block"], []).append(row)
    return blocks


@pytest.mark.parametrize("table", TABLES)
def test_every_block_has_every_row_and_the_papers_three_columns(quick_run: Run, table: str) -> None:
    from experiments.tables import COLUMNS, ROWS

    results = quick_run.results[table]
    markdown = (quick_run.out_dir / f"{table}.md").read_text()
    assert (quick_run.out_dir / f"{table}.png").read_bytes().startswith(b"\x89PNG\r\n\x1a\n")
    assert results["environment"]["torch"] == torch.__version__
    assert results["environment"]["device"] and results["environment"]["date"]
    assert "tiny synthetic shape" in results["meta"]["mode"]

    blocks = blocks_of(results)
    assert list(results["blocks"]) == MODELS[table]
    size = f"N={TINY['n_tokens']}, V={TINY['vocab_size']}, D={TINY['dim']}"
    shape = "quick_removed" if table == "table_a1" else "quick"
    for model, heading in zip(MODELS[table], blocks):
        # Every model's block measures the one tiny shape: its heading names what was run.
        assert heading.startswith(f"{model} shrunk to {size} ({shape} shape), data: ")
        assert f"## {heading}" in markdown
        assert f"| {model} (shrunk) | {shape} |" in markdown
        assert [row["method"] for row in blocks[heading]] == [row.label for row in ROWS]
        for row in blocks[heading]:
            assert set(COLUMNS) <= set(row)
            if "skipped" not in row and row["method"] != "Lower bound":
                assert all(row[column] > 0 for column in COLUMNS if column.endswith("_ms"))
    assert results["blocks"][MODELS[table][0]]["data"].startswith("synthetic")
    if not torch.cuda.is_available():
        assert "NOT GPU TIMINGS" in markdown
        # The rows of cce's kernels name the interpreter that ran them; the JSON keeps the label.
        assert "| CCE (ours, interpreter) |" in markdown
        assert "| CCE (no vocab sorting, interpreter) |" in markdown
        assert "| torch.compile |" in markdown


@pytest.mark.parametrize("table", TABLES)
def test_quick_figures_label_the_shape_run_and_leave_the_papers_numbers_out(
        quick_run: Run, table: str) -> None:
    """A quick run's blocks all measure one tiny shape: the figure draws it once, labelled with
    its sizes rather than a model's name, names the device, and draws none of the paper's
    numbers beside it; on a CPU it has no memory panel."""
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    from experiments.harness import ON_GPU, device_label, environment
    from experiments.tables import table_figure

    results = quick_run.results[table]
    figure = table_figure(results["rows"], results["blocks"], quick=True, name=table)

    title = figure.get_suptitle()
    assert device_label(environment()) in title and "numbers are left out" in title
    assert len(figure.axes) == (2 if ON_GPU else 1)
    time_axis = figure.axes[0]
    labels = [label.get_text() for label in time_axis.get_xticklabels()]
    size = f"N={TINY['n_tokens']}, V={TINY['vocab_size']}, D={TINY['dim']}"
    assert len(labels) == 1 and size in labels[0]
    assert not any(model in labels[0] for model in MODELS[table])
    legend = [text.get_text() for text in figure.axes[-1].get_legend().get_texts()]
    assert "torch.compile" in legend and not any("paper" in entry for entry in legend)
    assert ("CCE (ours, interpreter)" in legend) == (not ON_GPU)
    plt.close(figure)


def test_full_run_figures_label_the_models(quick_run: Run) -> None:
    """Full runs label each block with its model; the paper's numbers are drawn only beside
    GPU timings."""
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    from experiments.harness import ON_GPU
    from experiments.tables import table_figure

    results = quick_run.results["table_a2"]
    figure = table_figure(results["rows"], results["blocks"], quick=False, name="table_a2")

    labels = [label.get_text() for label in figure.axes[0].get_xticklabels()]
    assert labels == MODELS["table_a2"]
    legend = [text.get_text() for text in figure.axes[-1].get_legend().get_texts()]
    assert any(entry.startswith("paper (A100") for entry in legend) == ON_GPU
    plt.close(figure)


@pytest.mark.parametrize("table", TABLES)
def test_the_lower_bound_is_the_size_of_the_output_buffers(quick_run: Run, table: str) -> None:
    n, v, d = TINY["n_tokens"], TINY["vocab_size"], TINY["dim"]
    loss_mb = 4 / MIB  # one float32
    gradients_mb = (n * d + v * d) * torch.bfloat16.itemsize / MIB  # dE and dC in bfloat16

    for rows in blocks_of(quick_run.results[table]).values():
        bound = rows[0]
        assert bound["method"] == "Lower bound"
        assert bound["loss_mb"] == loss_mb
        assert bound["gradient_mb"] == gradients_mb
        assert bound["loss_gradient_mb"] == loss_mb + gradients_mb


@pytest.mark.parametrize("table", TABLES)
def test_the_papers_numbers_sit_beside_ours_for_the_models_it_has(quick_run: Run,
                                                                  table: str) -> None:
    from experiments.paper_numbers import PAPER_TABLES
    from experiments.tables import COLUMNS, ROWS

    assert "A100-SXM4 80GB" in (quick_run.out_dir / f"{table}.md").read_text()
    paper = PAPER_TABLES[table]
    for model, rows in zip(MODELS[table], blocks_of(quick_run.results[table]).values()):
        if model not in paper:  # Gemma 3 270M: the paper does not have it
            assert not any(key.endswith("_paper") for row in rows for key in row)
            continue
        for table_row, row in zip(ROWS, rows):
            expected = paper[model].get(table_row.paper)
            for column in COLUMNS:
                assert row[f"{column}_paper"] == (None if expected is None
                                                  else getattr(expected, column))


def test_the_papers_numbers_are_its_text() -> None:
    """Spot checks of the transcription, one cell per column kind, against the paper's text."""
    from experiments.paper_numbers import PAPER_TABLES, PaperRow

    gemma2 = PAPER_TABLES["table1"]["Gemma 2 2B"]
    assert gemma2["CCE"] == PaperRow(1, 43, 1163, 95, 1164, 135)
    assert gemma2["Liger Kernels"] == PaperRow(1474, 302, None, None, 1474, 303)
    assert PAPER_TABLES["table_a1"]["Gemma 2 2B"]["Baseline"] == PaperRow(8076, 28, 5376, 41,
                                                                         9420, 70)
    assert PAPER_TABLES["table_a2"]["Phi 3.5 Mini"]["torch.compile"] == PaperRow(
        502, 8, 1504, 15, 2006, 23)


def test_the_papers_lower_bounds_are_de_plus_dc_of_our_full_shapes() -> None:
    """The transcribed numbers and our shapes agree: dE + dC at N = 8192 in bfloat16."""
    from experiments import table_a2
    from experiments.bench import SHAPES
    from experiments.paper_numbers import PAPER_TABLES

    shapes = {"Gemma 2 2B": SHAPES["gemma2_2b"],
              **{model: SHAPES[name] for model, name in table_a2.MODELS.items()}}
    for table in PAPER_TABLES.values():
        for model, rows in table.items():
            shape = shapes[model]
            gradients_mb = (shape.n_tokens + shape.vocab_size) * shape.dim * 2 / MIB
            assert rows["Lower bound"].gradient_mb == round(gradients_mb), model


def test_a_pair_measured_once_in_a_process_is_not_measured_again(quick_run: Run) -> None:
    # Methods that need CUDA or are not installed are skipped, which measures nothing.
    first_block = next(iter(blocks_of(quick_run.results["table1"]).values()))
    measurable = [row for row in first_block
                  if row["method"] != "Lower bound" and "skipped" not in row]

    assert quick_run.measurements["bench"] == 1  # the torch baseline, with accuracy
    # table1's two blocks share the tiny shape, and the benchmark's torch row is reused.
    assert quick_run.measurements["table1"] == len(measurable) - 1
    assert quick_run.measurements["table_a2"] == 0  # five blocks, all on the shape table1 measured
    # A new shape: ignored rows removed.
    assert quick_run.measurements["table_a1"] == len(measurable)


@pytest.fixture
def fresh_memo() -> Iterator[None]:
    from experiments import bench

    bench.forget_measurements()
    yield
    bench.forget_measurements()


def test_accuracy_asked_of_a_row_measured_without_it_measures_it_again(
        monkeypatch: pytest.MonkeyPatch, fresh_memo: None) -> None:
    from experiments import bench

    calls = []

    def measure_loss(*args: Any, **kwargs: Any) -> dict[str, Any]:
        calls.append(args)
        return {}

    monkeypatch.setattr(bench, "measure_loss", measure_loss)
    shape = bench.Shape("tiny", "tiny", 16, 256, 16, "lm_like")
    how = bench.timing()

    bench.measure_shape(shape, ["torch"], how, accuracy=False)
    bench.measure_shape(shape, ["torch"], how, accuracy=False)
    assert len(calls) == 1
    bench.measure_shape(shape, ["torch"], how, accuracy=True)
    assert len(calls) == 2
    # With accuracy, the row serves every later request, under any name for the same inputs.
    bench.measure_shape(shape, ["torch"], how, accuracy=False)
    bench.measure_shape(bench.Shape("renamed", "same inputs", 16, 256, 16, "lm_like"),
                        ["torch"], how, accuracy=True)
    assert len(calls) == 2


def test_table_a1_removes_the_ignored_tokens_before_the_loss(quick_run: Run) -> None:
    from experiments.bench import ALPACA_IGNORED_FRACTION

    n = TINY["n_tokens"]
    kept = n - round(ALPACA_IGNORED_FRACTION * n)
    for info in quick_run.results["table_a1"]["blocks"].values():
        assert info["valid_tokens"] == kept
    meta = quick_run.results["table_a1"]["meta"]
    assert "removed before the loss" in meta["ignored tokens"]
    assert meta["ignored fraction (synthetic blocks)"].startswith(
        f"{ALPACA_IGNORED_FRACTION:.1%}")
    for info in quick_run.results["table1"]["blocks"].values():
        assert info["valid_tokens"] == n


def test_removing_ignored_tokens_keeps_the_loss_and_the_full_gradient() -> None:
    import cce
    from experiments.bench import remove_ignored_tokens
    from experiments.harness import float64_reference

    generator = torch.Generator().manual_seed(0)
    e = torch.randn(40, 24, generator=generator, requires_grad=True)
    c = torch.randn(300, 24, generator=generator, requires_grad=True)
    targets = torch.randint(0, 300, (40,), generator=generator)
    targets[::3] = -100

    loss = remove_ignored_tokens(cce.linear_cross_entropy, targets)(e, c, targets)
    grad_e, grad_c = torch.autograd.grad(loss, (e, c))

    expected_loss, expected_e, expected_c = float64_reference(e, c, targets)
    assert grad_e.shape == e.shape and not grad_e[::3].any()
    torch.testing.assert_close(loss.double(), expected_loss, rtol=1e-5, atol=0)
    torch.testing.assert_close(grad_e.double(), expected_e, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(grad_c.double(), expected_c, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("arguments", [["--repeats", "0"], ["--repeats", "many"],
                                       ["--no-such-option"]])
@pytest.mark.parametrize("table", TABLES)
def test_the_command_line_rejects_bad_input(table: str, arguments: list[str],
                                            capsys: pytest.CaptureFixture[str]) -> None:
    import importlib

    module = importlib.import_module(f"experiments.{table}")
    with pytest.raises(SystemExit) as exit_info:
        module.main(arguments)
    assert exit_info.value.code == 2
    assert "error:" in capsys.readouterr().err


def test_table_a2_has_no_real_data_to_point_at() -> None:
    from experiments import table_a2

    with pytest.raises(SystemExit):
        table_a2.main(["--data", "alpaca.json"])


def test_the_tables_are_registered_experiments() -> None:
    from experiments import EXPERIMENTS

    assert {name: EXPERIMENTS[name] for name in TABLES} == {
        name: f"experiments.{name}" for name in TABLES}
