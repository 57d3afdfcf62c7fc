"""What the paper's Tables 1, A1 and A2 share: their rows, columns, measurement and rendering.

A table is a list of blocks, one per model shape, each with the same rows (the lower bound,
CCE and its two ablations, Apple's reference CCE, Liger, chunked, torch.compile, Baseline) and
the paper's columns, each in memory (MB = MiB) and time (ms), for bfloat16 inputs:

- Loss: the forward with autograd on, as in a training step. Memory: its peak above the
  inputs, the state saved for the backward and the loss included (harness ``fwd_grad_peak_mb``).
  The paper's Loss column reads the same way: its CCE rows hold the 1 MB vocabulary-sorting
  buffer (0.09 MB without sorting), which only a forward that prepares a backward needs.
- Gradient: the backward alone, after an untimed forward. Memory: its peak above what is in
  use after the forward, whose saved state and loss count as in use (``bwd_peak_mb``).
- Loss+Gradient: the forward then the backward (``fwd_bwd_peak_mb``, ``fwd_bwd_ms``).

The measurements come from :func:`experiments.bench.measure_shape` without the float64
accuracy reference (``python -m experiments.bench`` reports accuracy), and rows the benchmark
already measured in this process are reused. Each row carries the paper's numbers for the same
method and model beside ours (``*_paper`` columns, :mod:`experiments.paper_numbers`).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from experiments.bench import (DTYPE, KERNEL_METHODS, MIB, Shape, add_repeats_argument,
                               describe_timing, measure_shape, timing)
from experiments.alpaca_data import add_data_argument
from experiments import harness
from experiments.harness import (ON_GPU, WrittenResults, add_sections, device_label,
                                 environment, log, markdown_table, progress, shown_method,
                                 write_results)
from experiments.paper_numbers import PAPER_SETUP, PAPER_TABLES, PaperRow

LOSS_BYTES = 4  # the loss's output buffer: one float32 (reduction="mean")


@dataclass(frozen=True)
class Row:
    """One row of every block: our label, the method measured and the paper's row."""

    label: str
    method: Optional[str]  # experiments.bench.METHODS name; None: the lower bound
    paper: Optional[str]  # the paper's row label in PAPER_TABLES; None: the paper has none


ROWS: tuple[Row, ...] = (
    Row("Lower bound", None, "Lower bound"),
    Row("CCE (ours)", "cce", "CCE"),
    Row("CCE (no vocab sorting)", "cce (vocab_sorting=False)", "CCE (No Vocab Sorting)"),
    Row("CCE (no gradient filter)", "cce (filter_eps=None)", "CCE (No Grad. Filter)"),
    # The paper's CCE rows are this implementation, on the paper's GPU.
    Row("reference CCE (cut_cross_entropy)", "cut_cross_entropy", "CCE"),
    Row("Liger", "liger", "Liger Kernels"),
    Row("chunked (8 chunks)", "chunked", "Torch Tune"),
    Row("torch.compile", "torch_compile", "torch.compile"),
    Row("Baseline", "torch", "Baseline"),
)
METHODS = tuple(row.method for row in ROWS if row.method is not None)
# The rows of cce's Triton kernels, which run in Triton's interpreter on a CPU.
KERNEL_ROWS = tuple(row.label for row in ROWS if row.method in KERNEL_METHODS)

# The paper's columns (PaperRow's fields) and the harness.measure_loss key behind each.
COLUMNS: dict[str, str] = {
    "loss_mb": "fwd_grad_peak_mb",
    "loss_ms": "fwd_ms",
    "gradient_mb": "bwd_peak_mb",
    "gradient_ms": "bwd_ms",
    "loss_gradient_mb": "fwd_bwd_peak_mb",
    "loss_gradient_ms": "fwd_bwd_ms",
}


@dataclass(frozen=True)
class Block:
    """One model of a table: its shape, a tiny stand-in for --quick, and its name.

    ``model`` is also the key of the paper's numbers for it in :data:`PAPER_TABLES`, when the
    paper has that model in that table.
    """

    model: str
    shape: Shape
    quick_shape: Shape


def lower_bound(gradients_mb: float) -> dict[str, Optional[float]]:
    """The output buffers, the least memory any method needs: the loss, dE and dC."""
    loss_mb = LOSS_BYTES / MIB
    return {"loss_mb": loss_mb, "loss_ms": None, "gradient_mb": gradients_mb,
            "gradient_ms": None, "loss_gradient_mb": loss_mb + gradients_mb,
            "loss_gradient_ms": None}


def build_table(name: str, blocks: Sequence[Block], quick: bool, out_dir: Path, *, what: str,
                notes: Optional[dict[str, str]] = None, data_path: Optional[Path] = None,
                repeats: Optional[int] = None) -> WrittenResults:
    """Measure every block's rows and write ``<out_dir>/<name>.{json,md,png}``.

    ``name`` selects the paper's numbers (:data:`PAPER_TABLES`); ``what`` and ``notes`` go to
    the results' meta. ``data_path`` is the Alpaca file of real-data shapes, ``repeats`` the
    timed calls per median (:func:`experiments.bench.timing`).
    """
    how = timing(repeats)
    paper = PAPER_TABLES[name]
    rows: list[dict[str, Any]] = []
    block_info: dict[str, dict[str, Any]] = {}
    for block in progress(blocks, name, leave=False):
        shape = block.quick_shape if quick else block.shape
        info, measured = measure_shape(shape, METHODS, how, accuracy=False,
                                       data_path=data_path)
        # "real" or "synthetic LM-like ...", without the details and reasons after it.
        data = info["data"].split(":")[0].split(" (")[0]
        sizes = f"N={info['n_tokens']}, V={info['vocab_size']}, D={info['dim']}"
        # A quick run measures one tiny shape for every model: the heading says so.
        heading = (f"{block.model} shrunk to {sizes} ({shape.name} shape), data: {data}"
                   if quick else f"{block.model}: {shape.name} ({sizes}), data: {data}")
        block_info[block.model] = {"heading": heading, "shape": shape.name, **info}
        by_method = {row["method"]: row for row in measured}
        rows += [_table_row(heading, row, by_method.get(row.method, {}), info["gradients_mb"],
                            paper.get(block.model)) for row in ROWS]

    meta = {
        "what": what,
        "mode": ("--quick: every block measures the tiny synthetic shape in its heading, a "
                 "smoke test of the pipeline, not the paper's sizes" if quick
                 else "full sizes, the paper's N = 8192 tokens"),
        "dtype": str(DTYPE).removeprefix("torch."),
        "paper": f"the *_paper columns are the paper's numbers, measured on an {PAPER_SETUP}; "
                 "ours were measured on the Device above",
        "columns": "Loss = forward with autograd on (a training step's forward, as the "
                   "paper's); Gradient = the backward alone after an untimed forward; "
                   "Loss+Gradient = both. *_mb: peak MB (MiB) allocated above what was in "
                   "use before (Gradient: above the inputs plus the forward's saved state and "
                   "loss), GPU only; *_ms: " + describe_timing(how),
        "lower bound": f"the output buffers: the loss (one float32, {LOSS_BYTES} bytes; the "
                       "paper prints 0.004 MB) and dE + dC (the inputs' size)",
        "Liger": "computes the gradient during its forward: its Loss column holds the whole "
                 "work and its Gradient column almost none (the paper prints no Gradient "
                 "column for it)",
        "CCE (ours), Loss memory": "with the vocabulary sorted and dC to follow (N >= 4096), "
                                   "the forward reads a copy of c in position order, freed "
                                   "before the backward allocates dC: about dC's size in the "
                                   "Loss column, nothing in Loss+Gradient's peak",
        "reference CCE": "Apple's cut_cross_entropy, the paper's own code; its *_paper "
                         "columns repeat the paper's CCE row",
        "accuracy": "not measured here (python -m experiments.bench reports it); rows the "
                    "benchmark measured in the same process are reused",
        **(notes or {}),
    }
    written = write_results(name, rows, meta, out_dir, group_by="block",
                            kernel_methods={"method": KERNEL_ROWS})
    written = add_sections(written, {"blocks": block_info}, _inputs_section(block_info, quick))
    _plot(rows, block_info, quick, out_dir / f"{name}.png", name)
    return written


def _table_row(heading: str, row: Row, measured: dict[str, Any], gradients_mb: float,
               paper_block: Optional[dict[str, PaperRow]]) -> dict[str, Any]:
    """One row of a block: ours beside the paper's, column by column."""
    ours = (lower_bound(gradients_mb) if row.method is None
            else {column: measured.get(key) for column, key in COLUMNS.items()})
    paper_row = None if paper_block is None else paper_block.get(row.paper)
    result: dict[str, Any] = {"block": heading, "method": row.label}
    for column, value in ours.items():
        result[column] = value
        if paper_block is not None:  # blocks the paper does not have get no paper columns
            result[f"{column}_paper"] = None if paper_row is None else getattr(paper_row, column)
    result.update({key: measured[key] for key in ("skipped", "error") if key in measured})
    return result


def _inputs_section(block_info: dict[str, dict[str, Any]], quick: bool) -> list[str]:
    return ["## Inputs", "", *markdown_table([
        {"model": f"{model} (shrunk)" if quick else model, "shape": info["shape"],
         "N x V x D": f"{info['n_tokens']} x {info['vocab_size']} x {info['dim']}",
         "rows in the loss": info["valid_tokens"], "data": info["data"],
         "live 128 x 128 tiles, sorted": f"{info['sparsity']['tiles_nonempty_sorted']:.1%}"}
        for model, info in block_info.items()])]


def _plot(rows: list[dict[str, Any]], block_info: dict[str, dict[str, Any]], quick: bool,
          path: Path, name: str) -> None:
    """:func:`table_figure`, saved to ``path`` (nothing without matplotlib)."""
    try:
        import matplotlib
    except ImportError:  # an optional dependency: the tables do not need it
        log(f"{name}: matplotlib is not installed, no {path.name}")
        return
    matplotlib.use("Agg")  # no display on a benchmark machine
    import matplotlib.pyplot as plt

    figure = table_figure(rows, block_info, quick, name)
    figure.savefig(path, dpi=120)
    plt.close(figure)


def table_figure(rows: list[dict[str, Any]], block_info: dict[str, dict[str, Any]],
                 quick: bool, name: str) -> Any:
    """Grouped bars of Loss+Gradient time and memory (log scale) per block: a matplotlib Figure.

    Full runs on a GPU: a group per model, the paper's numbers as ticks. Quick runs measure a
    tiny shape that is not the paper's: a group per shape measured (the blocks that share one
    measured the same rows), labelled with its sizes, and no paper numbers. On a CPU there is
    no memory panel (nothing to measure), and the paper's A100 times never share an axis with
    interpreter timings. ``rows`` and ``block_info`` are the results' rows and blocks.
    """
    import matplotlib.pyplot as plt

    with_paper = ON_GPU and not quick
    groups = _plot_groups(block_info, quick)
    by_key = {(row["block"], row["method"]): row for row in rows}
    methods = [row.label for row in ROWS if row.method is not None]
    shown = {label: shown_method(label) for label in KERNEL_ROWS}
    width = 0.8 / len(methods)
    colors = plt.get_cmap("tab10").colors
    panels = [("loss_gradient_ms", "ms")] + ([("loss_gradient_mb", "MB")] if ON_GPU else [])
    figure, axes = plt.subplots(1, len(panels), squeeze=False, figsize=(
        max(7.0, 2 + (1 + 1.1 * len(groups)) * len(panels)), 5))
    axes = axes[0]
    for axis, (column, unit) in zip(axes, panels):
        paper_label: Optional[str] = f"paper ({PAPER_SETUP.split(',')[0]})"
        for index, method in enumerate(methods):
            for position, heading in enumerate(groups):
                row = by_key[heading, method]
                x = position - 0.4 + width * (index + 0.5)
                if row.get(column) is not None:
                    axis.bar(x, row[column], width, color=colors[index % len(colors)],
                             label=shown.get(method, method) if position == 0 else None)
                if with_paper and row.get(f"{column}_paper") is not None:
                    axis.plot(x, row[f"{column}_paper"], marker="_", markersize=10,
                              color="black", linestyle="none", label=paper_label)
                    paper_label = None  # one legend entry
        axis.set_ylabel(f"Loss+Gradient, {unit}")
        axis.set_xticks(range(len(groups)), list(groups.values()), fontsize=8)
    if ON_GPU:  # from the lower bound to the Baseline: orders of magnitude
        for position, heading in enumerate(groups):
            axes[1].hlines(by_key[heading, "Lower bound"]["loss_gradient_mb"], position - 0.42,
                           position + 0.42, colors="gray", linestyles="--",
                           label="lower bound" if position == 0 else None)
        axes[1].set_yscale("log")
        axes[1].set_ylabel("Loss+Gradient, MB (log scale)")
    legend = {label: handle for axis in axes
              for handle, label in zip(*axis.get_legend_handles_labels())}
    axes[-1].legend(legend.values(), legend.keys(), fontsize=7, loc="upper left",
                    bbox_to_anchor=(1.01, 1.0))
    notes = []
    if quick:
        notes.append("--quick: a tiny shape, not the paper's")
    if not with_paper:
        notes.append(f"the paper's {PAPER_SETUP.split(',')[0]} numbers are left out")
    if not ON_GPU:
        notes.append("memory: GPU only")
    title = f"{name}: linear cross-entropy, bfloat16 ({device_label(environment())})"
    figure.suptitle("\n".join([title, *notes]), fontsize=10)
    figure.tight_layout()
    return figure


def _plot_groups(block_info: dict[str, dict[str, Any]], quick: bool) -> dict[str, str]:
    """The block headings to draw and their x labels: every model in a full run; in a quick
    run, one block per shape measured, labelled with the shape (its blocks' rows are the same
    measurements)."""
    if not quick:
        return {info["heading"]: model for model, info in block_info.items()}
    groups: dict[str, str] = {}
    for info in block_info.values():
        label = (f"{info['shape']} shape\nN={info['n_tokens']}, V={info['vocab_size']}, "
                 f"D={info['dim']}\n{info['valid_tokens']} rows in the loss")
        if label not in groups.values():
            groups[info["heading"]] = label
    return groups


def main(name: str, run: Callable[..., WrittenResults], description: str,
         argv: Optional[list[str]], real_data: bool = True) -> int:
    """``python -m experiments.<name> [--quick] [--out DIR] [--data PATH] [--repeats N]``.

    ``real_data``: whether the table has a real-data block (and so a ``--data`` option).
    """
    def options(parser: argparse.ArgumentParser
                ) -> Callable[[argparse.Namespace], dict[str, Any]]:
        if real_data:
            add_data_argument(parser)
        add_repeats_argument(parser)
        return lambda args: {"repeats": args.repeats,
                             **({"data_path": args.data} if real_data else {})}

    return harness.main(name, run, description, argv, options)
