"""What the A/B scripts of this folder share: variants of cce alternated over rounds, each
timed as ``experiments.bench`` times a call, with its kernels' times from the profiler and its
results against the first variant's.

A script names its shapes ``{name: (N, V, D)}`` (lm_like inputs, seed 1) and its variants
``{label: context manager factory}`` (each sets cce up as the variant wants while it is
entered); each call is :func:`training_step`, and ``{"environment", "rows"}`` go to one JSON
file.
"""

from __future__ import annotations

import functools
import json
from collections import defaultdict
from pathlib import Path
from typing import Any, Callable, ContextManager, Optional

import torch

import cce
from experiments.harness import environment, time_fn
from experiments.synthetic import lm_like_inputs

WARMUP, REPEATS = 5, 20


def training_step(e: torch.Tensor, c: torch.Tensor, targets: torch.Tensor
                  ) -> "tuple[torch.Tensor, ...]":
    """Forward and backward; returns (dE, dC)."""
    cce.linear_cross_entropy(e, c, targets).backward()
    grads = e.grad, c.grad
    e.grad = c.grad = None
    return grads


def kernel_ms(call: Callable[[], Any]) -> "dict[str, float]":
    """The GPU time of each kernel of one call (names cut to 40 characters), the largest 8."""
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        call()
        torch.cuda.synchronize()
    totals: "dict[str, float]" = defaultdict(float)
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            totals[event.name[:40]] += event.time_range.elapsed_us() / 1000
    return {name: round(ms, 4) for name, ms in sorted(totals.items(), key=lambda kv: -kv[1])[:8]}


def relative(x: torch.Tensor, reference: torch.Tensor) -> float:
    return float((x.float() - reference.float()).norm() / reference.float().norm())


def alternate(shapes: "dict[str, tuple[int, int, int]]",
              variants: "dict[str, Callable[[], ContextManager]]", rounds: int, out_file: Path,
              watched_kernel: str,
              inputs: Optional[Callable[[str], "tuple[torch.Tensor, ...]"]] = None) -> None:
    """Every shape: every variant in turn, ``rounds`` times; one row per call. A variant that
    raises (does not compile) gets its error instead of times. ``inputs(shape)``: ``(e, c,
    targets)`` instead of the lm_like ones."""
    results: "dict[str, Any]" = {"environment": environment(), "rows": []}
    for shape, (n, v, d) in shapes.items():
        e, c, targets = (inputs(shape) if inputs is not None else
                         lm_like_inputs(n, v, d, seed=1, device="cuda"))
        call = functools.partial(training_step, e, c, targets)
        reference: Optional[tuple] = None
        for round_index in range(rounds):
            for label, variant in variants.items():
                row: "dict[str, Any]" = {"shape": shape, "variant": label, "round": round_index}
                try:
                    with variant():
                        row["fwd_bwd_ms"] = time_fn(call, warmup=WARMUP, repeats=REPEATS)
                        row["kernels_ms"] = kernel_ms(call)
                        outputs = call()
                except Exception as failure:  # noqa: BLE001 - recorded, the others go on
                    row["error"] = repr(failure)[:300]
                    results["rows"].append(row)
                    print(row, flush=True)
                    continue
                reference = reference or outputs
                for name, output, first in zip(("dE", "dC"), outputs, reference):
                    row[f"{name}_vs_first"] = relative(output, first)
                row["bitwise_equal"] = all(torch.equal(output, first)
                                           for output, first in zip(outputs, reference))
                results["rows"].append(row)
                print(shape, label, round_index, round(row["fwd_bwd_ms"], 3),
                      row["kernels_ms"].get(watched_kernel), row["bitwise_equal"], flush=True)
        del e, c, targets, reference, call
        torch.cuda.empty_cache()
    out_file.parent.mkdir(parents=True, exist_ok=True)
    out_file.write_text(json.dumps(results, indent=1) + "\n")
