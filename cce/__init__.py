"""Cut Cross-Entropy: linear + cross-entropy loss without materializing the logit matrix."""

import os

import torch

# Triton kernels cannot run on CPU tensors unless they were built for the interpreter, and
# triton.jit picks the interpreter when the kernel is decorated. On a machine with no CUDA
# device, turn it on before any kernel module is imported so that CPU tensors just work.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from cce.loss import IMPLEMENTATIONS, LinearCrossEntropy, linear_cross_entropy  # noqa: E402

__all__ = ["IMPLEMENTATIONS", "LinearCrossEntropy", "linear_cross_entropy"]
__version__ = "0.1.0"
