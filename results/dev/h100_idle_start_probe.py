"""Does a kernel run slower right after the GPU idled? (H100 study; writes
h100_idle_start_probe.json.)

In ``results/roofline.md`` the log-sum-exp step takes up to about 1 ms longer inside a call than
with its kernels queued ahead of the GPU, more than the profiler shows of idle time around it.
One candidate: the GPU lowers its clocks while it waits for the host, and the next kernel starts
slow. Here one launcher (the log-sum-exp step, sorted copy of ``c`` included, as in a training
call; or the cuBLAS product ``e @ c.T``) is timed with CUDA events after three kinds of start,
alternating over REPEATS rounds:

- ``busy``: the GPU spins (``torch.cuda._sleep``) until the launch is queued;
- ``idle 2 ms`` / ``idle 50 ms``: the host sleeps that long with nothing queued, then queues it.

Run from the repository root: ``python results/dev/h100_idle_start_probe.py OUT_DIR``.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

import torch

from cce.indexed_dot import indexed_dot
from cce.lse_forward import lse_forward
from cce.vocab_order import sort_vocabulary
from experiments.harness import environment
from experiments.synthetic import lm_like_inputs

SHAPES = {"gemma3": (8192, 262144, 640), "gemma2_2b": (8192, 256000, 2304),
          "llama3_8b": (8192, 128256, 4096), "llama3_8b_n1024": (1024, 128256, 4096)}
REPEATS, SPIN_CYCLES = 15, 5_000_000
STARTS = ("busy", "idle 2 ms", "idle 50 ms")


def timed(fn, start_kind: str) -> float:
    torch.cuda.synchronize()
    if start_kind == "busy":
        torch.cuda._sleep(SPIN_CYCLES)
    else:
        time.sleep(0.002 if start_kind == "idle 2 ms" else 0.05)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def measure_shape(name: str, n: int, v: int, d: int) -> dict:
    """Each launcher's times after each kind of start, at one shape."""
    e, c, targets = lm_like_inputs(n, v, d, seed=1, device="cuda", requires_grad=False)
    targets = torch.where(targets >= 0, targets, -1)  # the kernels' ignored tokens
    order = sort_vocabulary(e, c, None, targets).order
    target_logit = indexed_dot(e, c, targets, None, None)
    steps = {
        "log-sum-exp step": lambda: lse_forward(e, c, None, None, targets, order,
                                                target_logit, may_copy_classifier=True),
        "cuBLAS e @ c.T": lambda: e @ c.T,
    }
    shape_results = {}
    for step, fn in steps.items():
        for _ in range(3):
            timed(fn, "busy")
        times = {kind: [] for kind in STARTS}
        for _ in range(REPEATS):
            for kind in STARTS:
                times[kind].append(timed(fn, kind))
        shape_results[step] = {kind: {"median_ms": statistics.median(ms), "ms": ms}
                               for kind, ms in times.items()}
        print(name, step, {kind: round(statistics.median(ms), 3)
                           for kind, ms in times.items()}, flush=True)
    return shape_results


def main(out_dir: Path) -> None:
    results = {"environment": environment(), "repeats": REPEATS, "shapes": {}}
    for name, (n, v, d) in SHAPES.items():
        results["shapes"][name] = measure_shape(name, n, v, d)
        torch.cuda.empty_cache()  # the shape's inputs, freed on return
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "h100_idle_start_probe.json").write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
