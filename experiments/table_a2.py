"""The paper's Table A2: Table 1 for five more models, on calibrated synthetic inputs.

Gemma 2 9B (V=256000, D=3584), Gemma 2 27B (V=256000, D=4608), Llama 3 8B (V=128256, D=4096),
Mistral NeMo (V=131072, D=5120) and Phi 3.5 Mini (V=32064, D=3072), N=8192 tokens, inputs from
:func:`experiments.synthetic.lm_like_inputs` (the paper used each model's embeddings on Alpaca).
Rows, columns and what they measure: :mod:`experiments.tables`.

``python -m experiments.table_a2 [--quick] [--out DIR] [--repeats N]``
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional

from experiments import tables
from experiments.bench import SHAPES
from experiments.harness import WrittenResults

NAME = "table_a2"

MODELS = {"Gemma 2 9B": "gemma2_9b", "Gemma 2 27B": "gemma2_27b", "Llama 3 8B": "llama3_8b",
          "Mistral NeMo": "mistral_nemo", "Phi 3.5 Mini": "phi3_5_mini"}


def run(quick: bool, out_dir: Path, repeats: Optional[int] = None) -> WrittenResults:
    """The registered entry point: see the module docstring."""
    blocks = [tables.Block(model, SHAPES[shape], SHAPES["quick"])
              for model, shape in MODELS.items()]
    return tables.build_table(NAME, blocks, quick, out_dir, what=__doc__.split("\n\n")[0],
                              repeats=repeats)


def main(argv: Optional[list[str]] = None) -> int:
    return tables.main(NAME, run, __doc__.split("\n\n")[0], argv, real_data=False)


if __name__ == "__main__":
    sys.exit(main())
