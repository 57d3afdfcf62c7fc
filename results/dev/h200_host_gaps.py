"""How much of a timed cce call the GPU spends waiting for the host (H200 study; writes
h200_host_gaps.json).

Per shape, the median of forward+backward as the benchmarks time it (harness.time_fn: the GPU
idle when the call starts, so it waits for every launch the host has not yet made), and
"queued": the same events and call, recorded behind a 10 ms ``torch.cuda._sleep``, during
which the host queues the call's forward (its host read of the targets' check waits for the
sleep; the backward's launches then overlap the forward's kernel). The difference is the
time the host's launches cost a call that starts on an idle GPU, as in the benchmarks; in a
training step the model's own work queued before the loss hides most of it.

``--with-compile``: cce and torch.compile on three shapes instead (h200_host_gaps_compile.json),
to tell host launches apart from the GPU's state after a busy or an idle moment.

Run from the repository root: ``python results/dev/h200_host_gaps.py OUT_DIR [--with-compile]``.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

import torch

import cce
from experiments.harness import environment, time_fn
from experiments.synthetic import lm_like_inputs

SHAPES = {"gemma3": (8192, 262144, 640, True), "gemma2_2b": (8192, 256000, 2304, True),
          "gemma2_2b_frozen": (8192, 256000, 2304, False),
          "llama3_8b": (8192, 128256, 4096, True), "llama3_8b_n1024": (1024, 128256, 4096, True),
          "phi3_5_mini": (8192, 32064, 3072, True)}
SLEEP_CYCLES = 20_000_000  # about 10 ms at the H200's clock
WARMUP, REPEATS = 3, 15


def queued_ms(fn) -> float:
    times = []
    for index in range(WARMUP + REPEATS):
        torch.cuda._sleep(SLEEP_CYCLES)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        if index >= WARMUP:
            times.append(start.elapsed_time(end))
    return statistics.median(times)


def main(out_dir: Path, with_compile: bool) -> None:
    results = {"environment": environment(), "shapes": {}}
    cases = ([(name, impl) for name in ("gemma2_2b_frozen", "llama3_8b_n1024", "phi3_5_mini")
              for impl in ("cce", "torch_compile")] if with_compile
             else [(name, "cce") for name in SHAPES])
    for name, impl in cases:
        n, v, d, trains_c = SHAPES[name]
        e, c, targets = lm_like_inputs(n, v, d, seed=1)
        c.requires_grad_(trains_c)

        def step():
            cce.linear_cross_entropy(e, c, targets, impl=impl).backward()
            e.grad = c.grad = None

        row = {}
        for round_index in range(2):
            row[f"idle start, round {round_index}"] = time_fn(step, warmup=WARMUP, repeats=REPEATS)
            row[f"queued, round {round_index}"] = queued_ms(step)
        results["shapes"][name if not with_compile else f"{name} {impl}"] = row
        print(name, impl, row, flush=True)
    (out_dir / f"h200_host_gaps{'_compile' if with_compile else ''}.json").write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main(Path(sys.argv[1]), "--with-compile" in sys.argv[2:])
