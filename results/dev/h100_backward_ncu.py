"""Profile target for Nsight Compute: one forward+backward of cce at a benchmark shape (bf16,
defaults, lm_like inputs seed 1, as ``experiments.roofline``), after three warm-up calls, between
cudaProfilerStart and Stop so that ``ncu --profile-from-start off`` sees only that call.

``python results/dev/h100_backward_ncu.py SHAPE`` with SHAPE one of roofline's shape names;
h100_backward_ncu.sh runs ncu on it.
"""
import sys

import torch

import cce
from experiments.roofline import SHAPES
from experiments.synthetic import lm_like_inputs

shape = {name: (n, v, d) for name, _, n, v, d in SHAPES}[sys.argv[1]]
e, c, targets = lm_like_inputs(*shape, seed=1, device="cuda")


def forward_backward() -> None:
    e.grad = c.grad = None
    cce.linear_cross_entropy(e, c, targets).backward()


for _ in range(3):
    forward_backward()
torch.cuda.synchronize()
torch.cuda.cudart().cudaProfilerStart()
forward_backward()
torch.cuda.synchronize()
torch.cuda.cudart().cudaProfilerStop()
