"""Where a small call's host time goes: forward + backward at N = 1024 (and Phi at N = 8192 for
contrast), CUDA-event medians against the host's time per call, then the host's own profile
(cProfile over 20 calls after warm-up: each function's time inside, waits on the GPU included).

``PYTHONPATH=. python results/dev/small_n_host_profile.py OUT_DIR``; writes
``small_n_host_profile.json`` (times) and ``small_n_host_profile_<shape>.txt`` (profiles).
"""

from __future__ import annotations

import cProfile
import functools
import io
import json
import pstats
import statistics
import sys
import time
from pathlib import Path

import torch

import cce
from experiments.harness import environment, time_fn
from experiments.synthetic import lm_like_inputs

SHAPES = {"phi3_5_mini_n1024": (1024, 32064, 3072), "llama3_8b_n1024": (1024, 128256, 4096),
          "phi3_5_mini": (8192, 32064, 3072)}
CALLS = 20


def step(e, c, targets) -> None:
    cce.linear_cross_entropy(e, c, targets).backward()
    e.grad = c.grad = None


def host_ms(e, c, targets) -> "list[float]":
    times = []
    for _ in range(CALLS):
        torch.cuda.synchronize()
        start = time.perf_counter()
        step(e, c, targets)
        times.append((time.perf_counter() - start) * 1e3)
    torch.cuda.synchronize()
    return times


def main(out_dir: Path) -> None:
    results = {"environment": environment(), "shapes": {}}
    for name, (n, v, d) in SHAPES.items():
        e, c, targets = lm_like_inputs(n, v, d, seed=1, device="cuda")
        events_ms = time_fn(functools.partial(step, e, c, targets))
        host = host_ms(e, c, targets)
        profiler = cProfile.Profile()
        torch.cuda.synchronize()
        profiler.enable()
        for _ in range(CALLS):
            step(e, c, targets)
        torch.cuda.synchronize()
        profiler.disable()
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(40)
        (out_dir / f"small_n_host_profile_{name}.txt").write_text(text.getvalue())
        results["shapes"][name] = {"events_ms": events_ms,
                                   "host_ms_median": statistics.median(host),
                                   "host_ms": host}
        print(name, round(events_ms, 3), round(statistics.median(host), 3), flush=True)
        print("\n".join(text.getvalue().splitlines()[:45]), flush=True)
        del e, c, targets
    (out_dir / "small_n_host_profile.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
