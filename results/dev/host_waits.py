"""Which CUDA runtime calls make the host wait in a forward + backward, and from where: one
profiled call (torch.profiler, CPU and CUDA activity, Python stacks) after warm-up; the runtime
calls (``cuda*``, ``cu*``) and the CPU operations longer than 100 us, each with its time and the
innermost frames of cce (or torch) that issued it.

``PYTHONPATH=. python results/dev/host_waits.py OUT_DIR``; writes ``host_waits.json``.
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict
from pathlib import Path

import torch

import cce
from experiments.harness import environment
from experiments.synthetic import lm_like_inputs

SHAPES = {"phi3_5_mini_n1024": (1024, 32064, 3072), "phi3_5_mini": (8192, 32064, 3072)}


def step(e, c, targets) -> None:
    cce.linear_cross_entropy(e, c, targets).backward()
    e.grad = c.grad = None


def frames(event) -> "list[str]":
    stack = [frame for frame in (event.stack or []) if "cce/" in frame or "torch/" in frame]
    return stack[:4]


def main(out_dir: Path) -> None:
    results = {"environment": environment(), "shapes": {}}
    for name, (n, v, d) in SHAPES.items():
        e, c, targets = lm_like_inputs(n, v, d, seed=1, device="cuda")
        for _ in range(5):
            step(e, c, targets)
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                torch.profiler.ProfilerActivity.CUDA],
                                    with_stack=True) as prof:
            step(e, c, targets)
            torch.cuda.synchronize()
        totals = defaultdict(lambda: [0, 0.0])
        long_calls = []
        for event in prof.events():
            if event.device_type != torch.autograd.DeviceType.CPU:
                continue
            us = event.time_range.elapsed_us()
            if event.name.startswith("cu"):
                totals[event.name][0] += 1
                totals[event.name][1] += us
            if us > 100 and (event.name.startswith("cu") or not event.cpu_children):
                long_calls.append({"name": event.name, "us": round(us, 1),
                                   "frames": frames(event)})
        results["shapes"][name] = {
            "runtime_calls": {key: {"count": count, "us": round(total, 1)}
                              for key, (count, total) in sorted(totals.items(),
                                                                key=lambda item: -item[1][1])},
            "long_calls": sorted(long_calls, key=lambda call: -call["us"])[:25]}
        print(name, flush=True)
        for key, value in list(results["shapes"][name]["runtime_calls"].items())[:8]:
            print("  ", key, value, flush=True)
        for call in results["shapes"][name]["long_calls"][:12]:
            print("  long", call["name"], call["us"], call["frames"][:3], flush=True)
        del e, c, targets
    (out_dir / "host_waits.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
