"""Where a training step's forward waits: the forward with gradients enabled (what the
benchmark's ``fwd_ms`` times) against the same call under ``torch.no_grad`` and against its
kernels' time.

Per shape: CUDA-event medians of both forwards (20 calls after 5 warm-up, each from an idle
GPU, as ``experiments.harness.time_fn``), the host's time to return from the call
(``perf_counter``, GPU idle at the start), and one profiled forward with gradients (CPU and CUDA
activity) as a timeline: each kernel's start and end and each marked host step's start and end,
in microseconds from the call's start. Host steps are marked by wrapping the forward's
functions in ``torch.profiler.record_function``.

``PYTHONPATH=. python results/dev/forward_host_gaps.py OUT_DIR`` from the repository root;
writes ``forward_host_gaps.json``.
"""

from __future__ import annotations

import contextlib
import functools
import json
import statistics
import sys
import time
from pathlib import Path
from unittest import mock

import torch

import cce
import cce.cce_function
import cce.loss
import cce.lse_forward
from experiments.harness import environment, time_fn
from experiments.synthetic import lm_like_inputs

SHAPES = {"gemma3": (8192, 262144, 640), "gemma2_2b": (8192, 256000, 2304),
          "llama3_8b": (8192, 128256, 4096), "phi3_5_mini": (8192, 32064, 3072),
          "llama3_8b_n1024": (1024, 128256, 4096)}
MARKED = [(cce.cce_function, "sort_vocabulary"), (cce.cce_function, "indexed_dot"),
          (cce.cce_function, "lse_forward"), (cce.lse_forward, "classifier_by_position"),
          (cce.cce_function, "forward_kernels")]


def marked(name: str, function):
    @functools.wraps(function)
    def wrapper(*args, **kwargs):
        with torch.profiler.record_function(f"host:{name}"):
            return function(*args, **kwargs)
    return wrapper


def forward(e, c, targets, grad: bool):
    with contextlib.nullcontext() if grad else torch.no_grad():
        return cce.linear_cross_entropy(e, c, targets)


def host_ms(e, c, targets) -> float:
    """The host's time to return from a forward with gradients, the GPU idle at its start."""
    times = []
    for _ in range(10):
        torch.cuda.synchronize()
        start = time.perf_counter()
        forward(e, c, targets, True)
        times.append((time.perf_counter() - start) * 1e3)
    torch.cuda.synchronize()
    return statistics.median(times)


def timeline(e, c, targets) -> "dict[str, list]":
    with contextlib.ExitStack() as stack:
        for module, name in MARKED:
            stack.enter_context(mock.patch.object(module, name,
                                                  marked(name, getattr(module, name))))
        forward(e, c, targets, True)
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                torch.profiler.ProfilerActivity.CUDA]) as prof:
            with torch.profiler.record_function("host:call"):
                forward(e, c, targets, True)
            torch.cuda.synchronize()
    events = prof.events()
    call = next(event for event in events if event.name == "host:call")
    origin = call.time_range.start

    def span(event):
        return [round(event.time_range.start - origin, 1), round(event.time_range.end - origin, 1)]

    kernels = sorted(([event.name[:60], *span(event)] for event in events
                      if event.device_type == torch.autograd.DeviceType.CUDA),
                     key=lambda row: row[1])
    host = sorted(([event.name, *span(event)] for event in events
                   if event.device_type == torch.autograd.DeviceType.CPU
                   and event.name.startswith("host:")), key=lambda row: row[1])
    # The host's top-level operations (no parent), to see what the host did between steps.
    top = sorted(([event.name[:50], *span(event)] for event in events
                  if event.device_type == torch.autograd.DeviceType.CPU
                  and event.cpu_parent is not None and event.cpu_parent.name == "host:call"),
                 key=lambda row: row[1])
    return {"kernels": kernels, "host_steps": host, "host_ops": top}


def main(out_dir: Path) -> None:
    results = {"environment": environment(), "shapes": {}}
    for shape, (n, v, d) in SHAPES.items():
        e, c, targets = lm_like_inputs(n, v, d, seed=1, device="cuda")
        row = {
            "fwd_grad_ms": time_fn(functools.partial(forward, e, c, targets, True)),
            "fwd_no_grad_ms": time_fn(functools.partial(forward, e, c, targets, False)),
            "host_return_ms": host_ms(e, c, targets),
            **timeline(e, c, targets),
        }
        kernels = row["kernels"]
        row["kernel_sum_ms"] = sum(end - start for _, start, end in kernels) / 1e3
        row["first_kernel_us"], row["last_kernel_end_us"] = kernels[0][1], kernels[-1][2]
        results["shapes"][shape] = row
        print(shape, {key: round(value, 3) for key, value in row.items()
                      if isinstance(value, float)}, flush=True)
        for name, start, end in row["host_steps"]:
            print(f"  host {name:32s} {start:9.1f} {end:9.1f}")
        for name, start, end in kernels:
            print(f"  gpu  {name:60s} {start:9.1f} {end:9.1f}")
        del e, c, targets
        torch.cuda.empty_cache()
    (out_dir / "forward_host_gaps.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
