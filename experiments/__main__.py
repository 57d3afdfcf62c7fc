"""``python -m experiments [--quick] [--out results] [--only NAME ...]``: run the benchmarks.

Exits 1 when any experiment recorded a failing row, so that a broken implementation cannot
pass for a finished benchmark.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import sys
import time
from pathlib import Path
from typing import Optional

from experiments import EXPERIMENTS


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m experiments", description=__doc__)
    parser.add_argument("--quick", action="store_true",
                        help="small sizes that run in minutes on a CPU (the default when no "
                             "CUDA device is available)")
    parser.add_argument("--out", type=Path, default=Path("results"),
                        help="folder for <name>.json and <name>.md (default: results)")
    parser.add_argument("--only", nargs="+", choices=list(EXPERIMENTS), metavar="NAME",
                        help="run these experiments, in this order, in one process (so that "
                             f"they share measurements and loaded models): {', '.join(EXPERIMENTS)}")
    parser.add_argument("--repeats", type=int,
                        help="timed calls per median in the benchmark and tables (default: "
                             "theirs, 20 on a GPU; at least 10 there)")
    args = parser.parse_args(argv)

    # Imported after argument parsing so that --help answers without loading torch.
    from experiments.harness import ON_GPU, progress

    quick = args.quick or not ON_GPU
    if not args.quick and quick:
        print("No CUDA device: running in --quick mode (CPU timings, Triton interpreter).",
              file=sys.stderr)

    names = args.only or list(EXPERIMENTS)
    reports, errors = [], []
    for name in progress(names, "experiments"):
        start_s = time.perf_counter()
        run = importlib.import_module(EXPERIMENTS[name]).run
        # Only the timing experiments take repeats; the same value lets tables reuse bench rows.
        options = ({"repeats": args.repeats}
                   if args.repeats and "repeats" in inspect.signature(run).parameters else {})
        written = run(quick=quick, out_dir=args.out, **options)
        print(f"{name}: {time.perf_counter() - start_s:.0f} s, wrote {written.json_path} and "
              f"{written.markdown_path}", file=sys.stderr)
        reports.append(written.markdown)
        errors += [f"{name}: {error}" for error in written.errors]

    # Printed after the loop so that the tables do not interleave with the progress bar.
    print("\n".join(reports))
    for error in errors:
        print(f"FAILED {error}", file=sys.stderr)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
