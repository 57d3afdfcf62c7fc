"""Cut Cross-Entropy: linear + cross-entropy loss without materializing the logit matrix."""

import importlib
import warnings
from types import ModuleType

from cce.config import interpreting
from cce.loss import IMPLEMENTATIONS, LinearCrossEntropy, linear_cross_entropy

if interpreting():
    import triton

    if tuple(int(part) for part in triton.__version__.split(".")[:2]) < (3, 7):
        warnings.warn(
            f"TRITON_INTERPRET=1 runs cce's kernels in Triton's interpreter, and the interpreter "
            f"of triton {triton.__version__} fails with numpy>=2.4: install triton>=3.7, or "
            f"unset TRITON_INTERPRET (CPU tensors then take the PyTorch path)",
            stacklevel=2,
        )

from cce.options import VocabParallelOptions

__all__ = ["IMPLEMENTATIONS", "LinearCrossEntropy", "VocabParallelOptions",
           "linear_cross_entropy"]
__version__ = "0.1.0"


def __getattr__(name: str) -> ModuleType:
    # cce.integrations (and through it cce.integrations.transformers) after a bare `import cce`,
    # imported on first use: transformers stays unimported until then.
    if name == "integrations":
        return importlib.import_module("cce.integrations")
    raise AttributeError(f"module 'cce' has no attribute {name!r}")
