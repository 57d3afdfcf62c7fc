"""The sorted copy of ``c`` that the forward's descriptors read: ``c.index_select(0, order)``
against advanced indexing ``c[order]`` (PyTorch's vectorized gather) and a plain copy of ``c``
(the bandwidth bound), CUDA events, median of 20 after 5 warm-up, at the benchmark's shapes.

``PYTHONPATH=. python results/dev/sorted_copy_kernels.py OUT_DIR``; writes
``sorted_copy_kernels.json``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from experiments.harness import environment, time_fn

SHAPES = {"gemma3": (262144, 640), "gemma2_2b": (256000, 2304), "llama3_8b": (128256, 4096),
          "phi3_5_mini": (32064, 3072)}

if __name__ == "__main__":
    results = {"environment": environment(), "rows": []}
    for shape, (v, d) in SHAPES.items():
        c = torch.randn(v, d, device="cuda", dtype=torch.bfloat16)
        order = torch.randperm(v, device="cuda").to(torch.int32)
        assert torch.equal(c.index_select(0, order), c[order.long()])
        row = {"shape": shape, "GB moved": 2 * c.numel() * 2 / 1e9,
               "index_select_ms": time_fn(lambda: c.index_select(0, order)),
               "index_select_int64_ms": time_fn(lambda: c.index_select(0, order.long())),
               "advanced_indexing_ms": time_fn(lambda: c[order]),
               "clone_ms": time_fn(c.clone)}
        results["rows"].append(row)
        print(row, flush=True)
        del c, order
    (Path(sys.argv[1]) / "sorted_copy_kernels.json").write_text(json.dumps(results, indent=1))
