"""Deterministic mode under a concurrent GPU load: results and live table against an idle call.

A second process runs 8192^3 bf16 matmuls on the same GPU while this one makes 20 calls per
mode (bf16, lm_like inputs, forward + backward with the LSE returned). Per call: how many
elements of loss, LSE, dE and dC differ from the mode's idle call, and the live table's tile
count and whether the table is equal to the idle call's (in deterministic mode the bounds read
only the head launch's LSE, so the table, and the backward's plan, must not move either).
The default mode is the contrast: its merge order under the lock, and the bounds' reads of the
merged LSE, follow the schedule.

``PYTHONPATH=. python results/dev/determinism_under_load.py OUT_DIR``; writes
``determinism_under_load.json``.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from unittest import mock

import torch

import cce
import cce.cce_function
from experiments.harness import environment
from experiments.synthetic import lm_like_inputs

SHAPES = {"gemma3 (pass 1 in slots)": (8192, 262144, 640),
          "8192 x 64000 x 1024 (two passes)": (8192, 64000, 1024),
          "llama3_8b N = 4096 (one pass)": (4096, 128256, 4096)}
CALLS = 20
LOAD = ("import torch\n"
        "a = torch.randn(8192, 8192, device='cuda', dtype=torch.bfloat16)\n"
        "while True:\n"
        "    a = (a @ a).clamp_(-1, 1)\n")


def call(e, c, targets, deterministic: bool, tables: list):
    original = cce.cce_function.live_tiles

    def recorded(*args, **kwargs):
        table = original(*args, **kwargs)
        tables.append(table.clone())
        return table

    with mock.patch.object(cce.cce_function, "live_tiles", recorded):
        loss, lse = cce.linear_cross_entropy(e, c, targets, deterministic=deterministic,
                                             return_lse=True)
        loss.backward()
    outputs = [loss.detach().clone(), lse.detach().clone(), e.grad.clone(), c.grad.clone()]
    e.grad = c.grad = None
    return outputs


def differing(a: torch.Tensor, b: torch.Tensor) -> int:
    return int((a.view(-1) != b.view(-1)).sum())


def run_mode(e, c, targets, deterministic: bool, reference, reference_table):
    rows = []
    for _ in range(CALLS):
        tables: list = []
        outputs = call(e, c, targets, deterministic, tables)
        table = tables[0]
        rows.append({"differing_loss_lse_de_dc": [differing(x, y)
                                                   for x, y in zip(outputs, reference)],
                     "live_tiles": int((table != 0).sum()),
                     "table_equal": bool(torch.equal(table, reference_table))})
    return rows


def main(out_dir: Path) -> None:
    results = {"environment": environment(), "calls": CALLS, "shapes": {}}
    references = {}
    for shape, (n, v, d) in SHAPES.items():
        e, c, targets = lm_like_inputs(n, v, d, seed=1, device="cuda")
        e.requires_grad_(True)
        c.requires_grad_(True)
        for deterministic in (True, False):
            tables: list = []
            call(e, c, targets, deterministic, tables)  # warm-up
            tables = []
            outputs = call(e, c, targets, deterministic, tables)
            torch.cuda.synchronize()
            references[(shape, deterministic)] = (outputs, tables[0])
        del e, c, targets
    load = subprocess.Popen([sys.executable, "-c", LOAD])
    try:
        time.sleep(5)  # the load's first matmuls are running
        for shape, (n, v, d) in SHAPES.items():
            e, c, targets = lm_like_inputs(n, v, d, seed=1, device="cuda")
            e.requires_grad_(True)
            c.requires_grad_(True)
            entry = {}
            for deterministic in (True, False):
                reference, reference_table = references[(shape, deterministic)]
                rows = run_mode(e, c, targets, deterministic, reference, reference_table)
                entry["deterministic" if deterministic else "default"] = {
                    "idle_live_tiles": int((reference_table != 0).sum()),
                    "calls_bitwise_equal": sum(not any(row["differing_loss_lse_de_dc"])
                                               for row in rows),
                    "calls_table_equal": sum(row["table_equal"] for row in rows),
                    "rows": rows}
                summary = entry["deterministic" if deterministic else "default"]
                print(shape, "deterministic" if deterministic else "default",
                      summary["calls_bitwise_equal"], summary["calls_table_equal"],
                      summary["idle_live_tiles"],
                      sorted({row["live_tiles"] for row in rows})[:5], flush=True)
            results["shapes"][shape] = entry
            del e, c, targets
    finally:
        load.kill()
    (out_dir / "determinism_under_load.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
