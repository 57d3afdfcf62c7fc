"""Every implementation and the CCE ablations on one problem: time, peak memory, accuracy.

For each variant: forward, backward and forward+backward time (the backward alone is timed
after an untimed forward), peak memory of forward and of forward+backward, and the relative
error ``||out - ref|| / ||ref||`` of the loss, dE and dC against a float64 PyTorch reference
computed from the same (already rounded) inputs.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch

import cce
from experiments import harness
from experiments.harness import (IGNORE_INDEX, ON_GPU, WrittenResults, make_inputs,
                                 float64_reference, measure_loss, progress, write_results)

NAME = "compare_impls"


@dataclass(frozen=True)
class ProblemSize:
    n_tokens: int
    vocab_size: int
    dim: int


# The benchmark's quick shape: under 20 s per CCE variant in Triton's CPU interpreter (2 cores),
# whose backward skips no tile of these random inputs' dense softmax.
QUICK_SIZE = ProblemSize(n_tokens=128, vocab_size=2048, dim=64)
# A few seconds on one GPU; the torch baseline's float32 logits take 1 GiB.
FULL_SIZE = ProblemSize(n_tokens=8192, vocab_size=32768, dim=1024)


@dataclass(frozen=True)
class Variant:
    name: str
    impl: str
    options: dict[str, Any] = field(default_factory=dict)


def variants() -> list[Variant]:
    """Each implementation with its defaults, then CCE without each backward optimization, with
    the paper's filter (no correction of the mass it drops), with each live tile recomputed
    once (``keep_tiles``), with memory spent for speed (``memory="fast"``) and with a
    deterministic forward."""
    return [Variant(impl, impl) for impl in cce.IMPLEMENTATIONS] + [
        Variant("cce (filter_eps=None)", "cce", {"filter_eps": None}),
        Variant("cce (vocab_sorting=False)", "cce", {"vocab_sorting": False}),
        Variant("cce (filter_correction=False)", "cce", {"filter_correction": False}),
        Variant("cce (keep_tiles=True)", "cce", {"keep_tiles": True}),
        Variant("cce (memory='fast')", "cce", {"memory": "fast"}),
        Variant("cce (deterministic=True)", "cce", {"deterministic": True}),
    ]


def run(quick: bool, out_dir: Path) -> WrittenResults:
    """The registered entry point: bfloat16 on GPU, float32 on CPU (the interpreter's case)."""
    size = QUICK_SIZE if quick else FULL_SIZE
    return compare(size, torch.bfloat16 if ON_GPU else torch.float32, out_dir)


def compare(size: ProblemSize, dtype: torch.dtype, out_dir: Path) -> WrittenResults:
    """Measure every variant on one random problem of ``size`` and write the result files."""
    e, c, targets = make_inputs(size.n_tokens, size.vocab_size, size.dim, dtype)
    reference = float64_reference(e, c, targets)
    rows = [_measure(variant, e, c, targets, reference)
            for variant in progress(variants(), NAME, leave=False)]
    meta = {
        "n_tokens": size.n_tokens,
        "vocab_size": size.vocab_size,
        "dim": size.dim,
        "dtype": str(dtype).removeprefix("torch."),
        "inputs": "e ~ N(0,1), c ~ N(0,1)/sqrt(D), uniform targets, reduction='mean'",
        "times": "median ms; bwd is the backward alone, after an untimed forward",
        "memory": "peak MB above the inputs, outputs included (dE, dC for fwd_bwd); GPU only",
        "errors": "||out - ref|| / ||ref|| against float64 PyTorch on the same inputs",
    }
    return write_results(NAME, rows, meta, out_dir, kernel_methods={
        "variant": [variant.name for variant in variants() if variant.impl == "cce"]})


def _measure(variant: Variant, e: torch.Tensor, c: torch.Tensor, targets: torch.Tensor,
             reference: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> dict[str, Any]:
    def loss_fn(e: torch.Tensor, c: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return cce.linear_cross_entropy(e, c, targets, ignore_index=IGNORE_INDEX,
                                        impl=variant.impl, **variant.options)

    return {"variant": variant.name, "impl": variant.impl,
            **measure_loss(loss_fn, e, c, targets, reference)}


def main(argv: Optional[list[str]] = None) -> int:
    return harness.main(NAME, run, __doc__.split("\n\n")[0], argv,
                        files=f"{NAME}.json and {NAME}.md")


if __name__ == "__main__":
    sys.exit(main())
