"""How evenly the backward's product launches fill the SMs, and what one step of a program costs.

Every launch of ``sparse_tile_matmul_kernel`` in one forward+backward call (bf16, defaults,
``lm_like_inputs`` seed 1, N = 8192) is timed with CUDA events, and its programs' work (the
128-deep steps each walks: its list's length, divided among its splits) is replayed through a
model of the block scheduler: programs taken in id order by the first free SM, one per SM (a
product program holds 192 KB of shared memory). Per launch:

- ``sched_eff``: steps / (SMs x the model's makespan), the share of SM time that has work;
- ``us_per_step``: measured time / makespan, the time one program spends on one step
  (2 x 128 x 128 x 256 FLOP). cuBLAS on the same work takes about 1.5 us per step per SM
  (results/roofline.md: its time for the products' FLOPs x 132 SMs / steps).

usage: PYTHONPATH=. python results/dev/h100_product_balance.py SHAPE... (writes $OUT/balance.json)
"""
import heapq
import json
import os
import sys

import torch

import cce
import cce.sparse_tile_matmul as stm
from experiments.harness import environment
from experiments.synthetic import lm_like_inputs

SHAPES = {"gemma3": (8192, 262144, 640), "gemma2_2b": (8192, 256000, 2304),
          "llama3_8b": (8192, 128256, 4096), "phi3_5_mini": (8192, 32064, 3072)}
SMS = torch.cuda.get_device_properties(0).multi_processor_count
KERNEL = stm.sparse_tile_matmul_kernel
COUNTS, DIM, NUM_OUT_BLOCKS = 3, 19, 23  # positions of these launch arguments
launches = []


class TimedKernel:
    """Stands in for the kernel: records each launch's lists and times it."""

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            start, stop = torch.cuda.Event(True), torch.cuda.Event(True)
            counts = args[COUNTS].clone()
            start.record()
            KERNEL[grid](*args, **kwargs)
            stop.record()
            launches.append(dict(programs=grid[0], counts=counts, dim=args[DIM],
                                 num_out_blocks=args[NUM_OUT_BLOCKS], kwargs=kwargs,
                                 events=(start, stop)))
        return launch


def makespan(counts, num_out_blocks, chunks, splits):
    """Steps of all programs and the model's makespan in steps (module docstring)."""
    work = []
    for pid in range(num_out_blocks * chunks * splits):
        count = counts[pid % num_out_blocks]
        split = pid // (num_out_blocks * chunks)
        work.append(count * (split + 1) // splits - count * split // splits)
    free = [0] * SMS
    end = 0
    for steps in work:
        finish = heapq.heappop(free) + steps
        end = max(end, finish)
        heapq.heappush(free, finish)
    return sum(work), end


def main(names):
    stm.sparse_tile_matmul_kernel = TimedKernel()
    rows = []
    for name in names:
        e, c, targets = lm_like_inputs(*SHAPES[name], seed=1)
        for _ in range(3):  # the last call is the one kept
            launches.clear()
            e.grad = c.grad = None
            cce.linear_cross_entropy(e, c, targets).backward()
            torch.cuda.synchronize()
        for launch in launches:
            kw = launch["kwargs"]
            ms = launch["events"][0].elapsed_time(launch["events"][1])
            chunks = -(-launch["dim"] // kw["BLOCK_OUT"])
            steps, span = makespan(launch["counts"].tolist(), launch["num_out_blocks"], chunks,
                                   kw["SPLITS"])
            rows.append(dict(
                shape=name, product="dC" if kw["TRANSPOSED"] else "dE",
                slot_map=kw["SLOT_MAP"], programs=launch["programs"], splits=kw["SPLITS"],
                steps=steps, ms=ms, tflops=2.0 * 128 * 128 * kw["BLOCK_OUT"] * steps / ms / 1e9,
                sched_eff=steps / (SMS * span) if span else 0.0,
                us_per_step=1000 * ms / span if span else 0.0))
            print({k: round(v, 3) if isinstance(v, float) else v for k, v in rows[-1].items()})
    out = os.environ.get("OUT", ".")
    with open(os.path.join(out, "balance.json"), "w") as f:
        json.dump(dict(environment=environment(), rows=rows), f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1:])
