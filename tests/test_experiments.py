"""The benchmark entry point runs end to end on tiny sizes and writes sane result files.

cce and the experiments are imported inside the tests: conftest.py must have set
TRITON_INTERPRET (on a CPU-only machine) before anything imports triton.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

TINY_SIZE = dict(n_tokens=64, vocab_size=512, dim=32)
ERROR_COLUMNS = ("loss_rel_err", "de_rel_err", "dc_rel_err")


def test_compare_impls_writes_a_finite_accurate_row_for_every_variant(tmp_path: Path) -> None:
    import cce
    from experiments import compare_impls

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
    for row in rows:
        assert "error" not in row, row
        assert f"| {row['variant']} |" in markdown
        for column in ERROR_COLUMNS:
            assert math.isfinite(row[column]) and row[column] < tolerance, (row["variant"], column)
        for column in ("fwd_ms", "bwd_ms", "fwd_bwd_ms"):
            assert row[column] > 0, (row["variant"], column)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU warning is for CPU runs")
def test_cpu_results_say_loudly_that_they_are_not_gpu_timings(tmp_path: Path) -> None:
    from experiments.harness import write_results

    written = write_results("smoke", [{"variant": "x", "fwd_ms": 1.5, "error": "Boom: a|b"}],
                            {"n_tokens": 1}, tmp_path)

    assert "NOT GPU TIMINGS" in written.markdown
    assert "| x | 1.5 | Boom: a\\|b |" in written.markdown
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
