"""The paper's Table 1: memory and time of the loss, its gradient and both, for every method.

Two blocks: Gemma 3 270M's final hidden states and classifier on Alpaca (real data; synthetic
LM-like inputs of its shape when the model is not installed, which the table says), and the
paper's own shape, Gemma 2 2B (N=8192, V=256000, D=2304), on calibrated synthetic inputs
(:mod:`experiments.synthetic`): the paper used Gemma 2 2B's embeddings, which we do not have.
Rows, columns and what they measure: :mod:`experiments.tables`.

``python -m experiments.table1 [--quick] [--out DIR] [--data PATH] [--repeats N]``
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional

from experiments import tables
from experiments.bench import SHAPES
from experiments.harness import WrittenResults

NAME = "table1"


def run(quick: bool, out_dir: Path, data_path: Optional[Path] = None,
        repeats: Optional[int] = None) -> WrittenResults:
    """The registered entry point: see the module docstring."""
    blocks = [tables.Block("Gemma 3 270M", SHAPES["gemma3"], SHAPES["quick"]),
              tables.Block("Gemma 2 2B", SHAPES["gemma2_2b"], SHAPES["quick"])]
    return tables.build_table(NAME, blocks, quick, out_dir, what=__doc__.split("\n\n")[0],
                              data_path=data_path, repeats=repeats)


def main(argv: Optional[list[str]] = None) -> int:
    return tables.main(NAME, run, __doc__.split("\n\n")[0], argv)


if __name__ == "__main__":
    sys.exit(main())
