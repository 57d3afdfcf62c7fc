"""Kernel time against the roofline's step time: how much of each step is the GPU computing
(H100 study; writes h100_kernel_breakdown.json).

``experiments.roofline`` times each step with CUDA events around its launcher, so a step's time
also counts the GPU waiting for the host to queue it. Here one forward + backward per shape runs
under torch.profiler (CUDA activity only, after warm-up calls): each kernel's name, launches and
total time, the call's span from its first kernel's start to its last one's end, and the GPU's
idle time between kernels by the pair of kernels around it; beside
them, the roofline's event times of the steps for calls of the same process.

Run from the repository root: ``python results/dev/h100_kernel_breakdown.py OUT_DIR``.
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict
from pathlib import Path

import torch

import cce
from experiments.harness import environment
from experiments.roofline import StepTimer, traced_steps
from experiments.synthetic import lm_like_inputs

SHAPES = {"gemma3": (8192, 262144, 640), "gemma2_2b": (8192, 256000, 2304),
          "llama3_8b": (8192, 128256, 4096), "phi3_5_mini": (8192, 32064, 3072),
          "llama3_8b_n1024": (1024, 128256, 4096)}
WARMUP, PROFILED = 3, 3
GAP_US = 10  # gaps shorter than this are counted in the span only


def step(e, c, targets):
    cce.linear_cross_entropy(e, c, targets).backward()
    e.grad = c.grad = None


def profiled_call(e, c, targets):
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        step(e, c, targets)
        torch.cuda.synchronize()
    kernels = [event for event in prof.events()
               if event.device_type == torch.autograd.DeviceType.CUDA]
    by_name = defaultdict(lambda: [0, 0.0])
    for event in kernels:
        by_name[event.name][0] += 1
        by_name[event.name][1] += event.time_range.elapsed_us() / 1000
    kernels.sort(key=lambda event: event.time_range.start)
    start = kernels[0].time_range.start
    end = max(event.time_range.end for event in kernels)
    # The GPU's idle time between kernels, by the pair of kernels around each gap.
    gaps = defaultdict(lambda: [0, 0.0])
    finished = 0
    for before, after in zip(kernels, kernels[1:]):
        finished = max(finished, before.time_range.end)
        idle = after.time_range.start - finished
        if idle > GAP_US:
            key = f"{before.name[:40]} -> {after.name[:40]}"
            gaps[key][0] += 1
            gaps[key][1] += idle / 1000
    return {"span_ms": (end - start) / 1000,
            "gaps": {pair: {"count": count, "ms": round(total, 4)}
                     for pair, (count, total) in sorted(gaps.items(), key=lambda item: -item[1][1])},
            "kernel_ms": sum(total for _, total in by_name.values()),
            "kernels": {name: {"launches": count, "ms": round(total, 4)}
                        for name, (count, total) in sorted(by_name.items(),
                                                           key=lambda item: -item[1][1])}}


def step_event_ms(e, c, targets):
    timer = StepTimer()
    with traced_steps(timer):
        step(e, c, targets)
    return {name: round(ms, 4) for name, ms in timer.elapsed_ms().items()}


def main(out_dir: Path) -> None:
    results = {"environment": environment(), "warmup": WARMUP, "shapes": {}}
    for name, (n, v, d) in SHAPES.items():
        e, c, targets = lm_like_inputs(n, v, d, seed=1, device="cuda")
        for _ in range(WARMUP):
            step(e, c, targets)
        calls = [profiled_call(e, c, targets) for _ in range(PROFILED)]
        steps = [step_event_ms(e, c, targets) for _ in range(PROFILED)]
        results["shapes"][name] = {"profiled_calls": calls, "step_event_ms": steps}
        print("   steps", steps[-1], flush=True)
        print(name, [(round(call["span_ms"], 2), round(call["kernel_ms"], 2)) for call in calls],
              flush=True)
        for kernel, info in list(calls[-1]["kernels"].items())[:8]:
            print("   ", info["launches"], round(info["ms"], 3), kernel[:90], flush=True)
        for pair, info in list(calls[-1]["gaps"].items())[:10]:
            print("    gap", info["count"], round(info["ms"], 3), pair, flush=True)
        del e, c, targets
        torch.cuda.empty_cache()
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "h100_kernel_breakdown.json").write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
