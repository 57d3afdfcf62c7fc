"""``python -m experiments [--quick] [--out DIR] [--data PATH] [--only NAME ...] [--repeats N]``:
run the benchmarks and paper reproductions, from the repository root.

Full runs (on a GPU) write to results/; --quick runs, the default without a GPU, to
scratch/quick/, which git ignores. Ends with one line per experiment (seconds, status, files
written); the reports are the Markdown files. Exits 1 when any experiment failed or recorded a
failing row, so that a broken implementation cannot pass for a finished benchmark.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import inspect
import sys
from pathlib import Path
from typing import Any, Optional

# Importing the package turns Triton's interpreter on where there is no CUDA device, before
# anything imports triton.
from experiments import EXPERIMENTS
from experiments.alpaca_data import add_data_argument
from experiments.harness import (WrittenResults, add_run_arguments, finish, log, progress,
                                 run_experiment, run_mode, summary)


def run_registered(name: str, quick: bool, out_dir: Path, options: dict[str, Any]
                   ) -> WrittenResults:
    """Import experiment ``name`` and run it with the ``options`` (not None) that its ``run``
    takes: only the timing experiments take repeats (the same value lets the tables reuse the
    benchmark's rows), only those with real data a data path."""
    run = importlib.import_module(EXPERIMENTS[name]).run
    accepted = inspect.signature(run).parameters
    return run(quick=quick, out_dir=out_dir, **{key: value for key, value in options.items()
                                                if value is not None and key in accepted})


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m experiments", description=__doc__)
    add_run_arguments(parser, "<name>.json, <name>.md and the figures")
    add_data_argument(parser)
    parser.add_argument("--only", nargs="+", choices=list(EXPERIMENTS), metavar="NAME",
                        help="run these experiments, in this order, in one process (so that "
                             "they share measurements and loaded models): "
                             + ", ".join(EXPERIMENTS))
    parser.add_argument("--repeats", type=int,
                        help="timed calls per median in the benchmark and tables (default: "
                             "theirs, 20 on a GPU; at least 10 there)")
    args = parser.parse_args(argv)
    quick, out_dir = run_mode(args)
    options = {"repeats": args.repeats, "data_path": args.data}

    outcomes, errors = [], []
    for name in progress(args.only or list(EXPERIMENTS), "experiments"):
        outcome, failures = run_experiment(name, out_dir, functools.partial(
            run_registered, name, quick, out_dir, options))
        outcomes.append(outcome)
        errors += failures
        log(summary([outcome]))  # as each finishes: the only progress where bars are off
    return finish(outcomes, errors, out_dir)


if __name__ == "__main__":
    sys.exit(main())
