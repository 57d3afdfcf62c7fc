"""The forward's log-sum-exp kernel with operands by tensor descriptor (TMA) against rows of c
gathered through the vocabulary order (H200 study; writes h200_forward_descriptors.json).

For each shape (N = 8192 unless stated, bf16, lm-like inputs, bounds recorded, sorted order):
the kernel as it gathers rows of c, the same kernel reading a sorted copy of c by descriptor at
several pipeline settings (with and without Triton's automatic warp specialization), the copy
itself (``c.index_select(0, order)``), and cuBLAS ``e @ c.T`` on the same work. CUDA events,
median of REPEATS after WARMUP, variants alternating over ROUNDS rounds.

It ran with study-only arguments of ``lse_forward`` (``c_in_order``, the sorted copy, and
``_knobs``: stages, D slice, ``tl.range(warp_specialize=...)``), removed afterwards; ``tma_s3`` is
what the forward now does (``cce.lse_forward.classifier_by_position``).

Run from the repository root: ``python results/dev/h200_forward_descriptors.py OUT_DIR``.
"""

from __future__ import annotations

import json
import sys
import traceback
from pathlib import Path

import torch

from cce.indexed_dot import indexed_dot
from cce.lse_forward import lse_forward
from cce.vocab_order import vocab_order
from experiments.harness import environment, time_fn
from experiments.synthetic import lm_like_inputs

WARMUP, REPEATS, ROUNDS = 3, 10, 3
SHAPES = {"gemma3": (8192, 262144, 640), "2b": (8192, 256000, 2304),
          "llama": (8192, 128256, 4096), "phi": (8192, 32064, 3072),
          "llama_n1024": (1024, 128256, 4096)}
VARIANTS = {
    "gather": None,
    "tma_s3": dict(num_stages=3),
    "tma_s4": dict(num_stages=4),
    "tma_s3_ws": dict(num_stages=3, WARP_SPECIALIZE=True),
    "tma_s4_ws": dict(num_stages=4, WARP_SPECIALIZE=True),
    "tma_s2_bd128": dict(num_stages=2, BLOCK_DIM=128),
}


def main(out_dir: Path) -> None:
    results = {"environment": environment(), "shapes": {}}
    for name, (n, v, d) in SHAPES.items():
        e, c, targets = lm_like_inputs(n, v, d, seed=1, requires_grad=False)
        order = vocab_order(e, c, None, targets)
        target_logit = indexed_dot(e, c, targets, None, None)
        c_sorted = c.index_select(0, order)
        reference, reference_bound = lse_forward(e, c, None, None, targets, order, target_logit)
        calls = {"cublas": lambda: e @ c.T, "copy": lambda: c.index_select(0, order)}
        shape = {"errors": {}, "lse_max_diff": {}, "bound_max_diff": {}}
        for variant, knobs in VARIANTS.items():
            def call(knobs=knobs):
                if knobs is None:
                    return lse_forward(e, c, None, None, targets, order, target_logit)
                return lse_forward(e, c, None, None, targets, order, target_logit,
                                   c_in_order=c_sorted, _knobs=knobs)
            try:
                lse, bound = call()
                torch.cuda.synchronize()
                shape["lse_max_diff"][variant] = (lse - reference).abs().max().item()
                finite = torch.isfinite(reference_bound)
                shape["bound_max_diff"][variant] = (
                    (bound - reference_bound)[finite].abs().max().item())
                calls[variant] = call
            except Exception:
                shape["errors"][variant] = traceback.format_exc()[-1500:]
        times = {key: [] for key in calls}
        for _ in range(ROUNDS):
            for key, fn in calls.items():
                times[key].append(time_fn(fn, warmup=WARMUP, repeats=REPEATS))
        shape["ms"] = times
        shape["gemm_tflops"] = 2 * n * v * d / min(times["cublas"]) / 1e9
        results["shapes"][name] = shape
        print(name, {k: [round(t, 3) for t in ts] for k, ts in times.items()},
              shape["errors"].keys(), shape["lse_max_diff"], flush=True)
        del e, c, c_sorted
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "h200_forward_descriptors.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
