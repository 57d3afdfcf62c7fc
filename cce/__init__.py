"""Cut Cross-Entropy: linear + cross-entropy loss without materializing the logit matrix."""

import os
import warnings

import torch

# Triton kernels cannot run on CPU tensors unless they were built for the interpreter, and
# triton.jit picks the interpreter when the kernel is decorated. On a machine with no CUDA
# device, turn it on before any kernel module is imported so that CPU tensors just work.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

if os.environ.get("TRITON_INTERPRET") == "1":
    import triton

    if tuple(int(part) for part in triton.__version__.split(".")[:2]) < (3, 7):
        warnings.warn(
            f"cce runs its kernels in Triton's interpreter here (no CUDA device), and the "
            f"interpreter of triton {triton.__version__} fails with numpy>=2.4: install "
            f"triton>=3.7 for CPU use",
            stacklevel=2,
        )

from cce.loss import IMPLEMENTATIONS, LinearCrossEntropy, linear_cross_entropy  # noqa: E402
from cce.vocab_parallel import VocabParallelOptions  # noqa: E402

__all__ = ["IMPLEMENTATIONS", "LinearCrossEntropy", "VocabParallelOptions",
           "linear_cross_entropy"]
__version__ = "0.1.0"
