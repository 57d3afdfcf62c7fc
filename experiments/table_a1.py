"""The paper's Table A1: Table 1 with the ignored tokens removed before the loss.

Prompt tokens are ignored (ignore_index), as in instruction fine-tuning, and every method gets
only the rows whose target is not ignored (:func:`experiments.bench.remove_ignored_tokens`):
the rows to keep are found once from the targets, outside the measurements, as a data loader
could; gathering them from ``e`` happens inside the measured forward and inside autograd, so the
gradient of ``e`` is the full (N, D) tensor that training needs (the paper's lower bound, dE + dC
at full N, says the same) and its scatter is part of the measured backward. Two blocks: Gemma 3
270M on Alpaca with its prompt tokens ignored (real data when the model is installed), and the
Gemma 2 2B shape on synthetic inputs with the same fraction of tokens ignored, at random rows.

``python -m experiments.table_a1 [--quick] [--out DIR] [--data PATH] [--repeats N]``
"""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path
from typing import Optional

from experiments import tables
from experiments.bench import ALPACA_IGNORED_FRACTION, SHAPES, alpaca_ignored_fraction
from experiments.harness import WrittenResults

NAME = "table_a1"


def run(quick: bool, out_dir: Path, data_path: Optional[Path] = None,
        repeats: Optional[int] = None) -> WrittenResults:
    """The registered entry point: see the module docstring."""
    real_gemma3 = SHAPES["gemma3_removed"]
    # The real data's share of ignored tokens, when the real model can measure it (not in
    # --quick mode, where nothing loads the model).
    measured = None if quick else alpaca_ignored_fraction(real_gemma3.n_tokens, data_path)
    ignored_fraction = ALPACA_IGNORED_FRACTION if measured is None else measured
    synthetic_gemma2 = replace(SHAPES["gemma2_2b_removed"], ignored_fraction=ignored_fraction)
    blocks = [tables.Block("Gemma 3 270M", real_gemma3, SHAPES["quick_removed"]),
              tables.Block("Gemma 2 2B", synthetic_gemma2, SHAPES["quick_removed"])]
    source = ("measured on the prompt-masked Alpaca batch of the real model"
              if measured is not None
              else "experiments.bench.ALPACA_IGNORED_FRACTION, measured on the first 4096 "
                   "Alpaca tokens")
    notes = {
        "ignored tokens": "removed before the loss; the kept rows are found outside the "
                          "measurements, the gather from e and its backward are measured, "
                          "and dE is the full (N, D) gradient",
        "ignored fraction (synthetic blocks)": f"{ignored_fraction:.1%}, {source}",
    }
    return tables.build_table(NAME, blocks, quick, out_dir, what=__doc__.split("\n\n")[0],
                              notes=notes, data_path=data_path, repeats=repeats)


def main(argv: Optional[list[str]] = None) -> int:
    return tables.main(NAME, run, __doc__.split("\n\n")[0], argv)


if __name__ == "__main__":
    sys.exit(main())
