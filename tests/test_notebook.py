"""notebooks/softmax_sparsity.ipynb: committed with the outputs of a full run, and still runs
top to bottom (in fast mode: 256 tokens of the real model, most of its time the model's loading).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tests.helpers import real_model_path

NOTEBOOK = Path(__file__).resolve().parents[1] / "notebooks" / "softmax_sparsity.ipynb"


def test_committed_notebook_holds_the_outputs_of_a_full_run() -> None:
    notebook = json.loads(NOTEBOOK.read_text())
    code_cells = [cell for cell in notebook["cells"] if cell["cell_type"] == "code"]
    assert code_cells and all(cell["outputs"] for cell in code_cells)
    assert [cell["execution_count"] for cell in code_cells] == list(range(1, len(code_cells) + 1))
    outputs = json.dumps([cell["outputs"] for cell in code_cells])
    assert "fast mode" not in outputs and '"output_type": "error"' not in outputs
    assert '"image/png"' in outputs


@pytest.mark.slow
def test_notebook_runs_top_to_bottom_in_fast_mode(monkeypatch: pytest.MonkeyPatch) -> None:
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    pytest.importorskip("ipykernel")
    pytest.importorskip("matplotlib")
    pytest.importorskip("accelerate", reason="transformers needs accelerate to load the model")
    real_model_path()
    # The kernel inherits the environment (and TRITON_INTERPRET from conftest.py on CPU).
    monkeypatch.setenv("CCE_NOTEBOOK_FAST", "1")
    notebook = nbformat.read(NOTEBOOK, as_version=4)

    # Raises CellExecutionError, with the cell and its traceback, if any cell fails.
    nbclient.NotebookClient(notebook, timeout=600,
                            resources={"metadata": {"path": str(NOTEBOOK.parent)}}).execute()

    first_output = notebook.cells[1].outputs[0]
    assert "(fast mode)" in first_output["text"]
    # The fast mode's 256 tokens reach into the responses: every group has rows to measure.
    rows = re.search(r"(\d+) prompt, (\d+) response", notebook.cells[4].outputs[0]["text"])
    assert rows and int(rows[1]) > 0 and int(rows[2]) > 0, notebook.cells[4].outputs[0]["text"]
    images = [output for cell in notebook.cells if cell.cell_type == "code"
              for output in cell.outputs if "image/png" in output.get("data", {})]
    assert len(images) >= 5
