"""The paper's Tables 1, A1 and A2, transcribed from its text as data.

Wijmans et al., "Cut Your Losses in Large-Vocabulary Language Models" (2024): 8192 tokens in
bfloat16, measured on an A100-SXM4 80GB with PyTorch 2.4.1 and CUDA 12.4. Memory in MB (the
lower bounds show that the paper's MB are MiB), times in ms; None where the paper prints
nothing. Liger's loss and gradient come out of one fused pass (the paper's footnote), so the
paper prints two pairs for it: we read them as the Loss and Loss+Gradient columns, the Gradient
column blank.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

PAPER_SETUP = "A100-SXM4 80GB, PyTorch 2.4.1, CUDA 12.4"


class PaperRow(NamedTuple):
    """One row of the paper's tables: memory (MB) and time (ms) of each column."""

    loss_mb: Optional[float]
    loss_ms: Optional[float]
    gradient_mb: Optional[float]
    gradient_ms: Optional[float]
    loss_gradient_mb: Optional[float]
    loss_gradient_ms: Optional[float]


def _lower_bound(gradient_mb: float) -> PaperRow:
    return PaperRow(0.004, None, gradient_mb, None, gradient_mb, None)


def _fused(loss_mb: float, loss_ms: float, loss_gradient_mb: float,
           loss_gradient_ms: float) -> PaperRow:
    """Liger: the Loss and Loss+Gradient pairs (see the module docstring)."""
    return PaperRow(loss_mb, loss_ms, None, None, loss_gradient_mb, loss_gradient_ms)


# table -> model -> the paper's row label -> numbers. Labels as the paper prints them, except
# "CCE" for "CCE (Ours)" (Apple's cut_cross_entropy) and "Torch Tune" for "Torch Tune Team
# (2024) (8 chunks)".
PAPER_TABLES: dict[str, dict[str, dict[str, PaperRow]]] = {
    # Table 1: Gemma 2 2B's embeddings and classifier, Alpaca.
    "table1": {"Gemma 2 2B": {
        "Lower bound": _lower_bound(1161),
        "CCE": PaperRow(1, 43, 1163, 95, 1164, 135),
        "Liger Kernels": _fused(1474, 302, 1474, 303),
        "Torch Tune": PaperRow(8000, 55, 1630, 115, 9631, 170),
        "torch.compile": PaperRow(4000, 49, 12000, 92, 16000, 143),
        "Baseline": PaperRow(24000, 82, 16000, 121, 28000, 207),
        "CCE (No Vocab Sorting)": PaperRow(0.09, 42, 1162, 104, 1162, 143),
        "CCE (No Grad. Filter)": PaperRow(0.09, 42, 1162, 324, 1162, 362),
    }},
    # Table A1: Table 1 with the ignored tokens removed before the loss.
    "table_a1": {"Gemma 2 2B": {
        "Lower bound": _lower_bound(1161),
        "CCE": PaperRow(1, 15, 1163, 40, 1164, 52),
        "Liger Kernels": _fused(1230, 313, 1228, 315),
        "Torch Tune": PaperRow(2700, 22, 2709, 52, 5410, 73),
        "torch.compile": PaperRow(1356, 18, 4032, 32, 5388, 50),
        "Baseline": PaperRow(8076, 28, 5376, 41, 9420, 70),
        "CCE (No Vocab Sorting)": PaperRow(0.05, 15, 1162, 46, 1162, 58),
        "CCE (No Grad. Filter)": PaperRow(0.05, 15, 1162, 156, 1162, 170),
    }},
    # Table A2: more models, in the setting of Table 1; no ablation rows.
    "table_a2": {
        "Gemma 2 9B": {
            "Lower bound": _lower_bound(1806),
            "CCE": PaperRow(1, 65, 1808, 140, 1809, 202),
            "Liger Kernels": _fused(2119, 419, 2119, 420),
            "Torch Tune": PaperRow(8000, 75, 3264, 168, 11264, 243),
            "torch.compile": PaperRow(4000, 70, 12000, 133, 16000, 205),
            "Baseline": PaperRow(24000, 102, 16000, 164, 28000, 270),
        },
        "Gemma 2 27B": {
            "Lower bound": _lower_bound(2322),
            "CCE": PaperRow(1, 82, 2324, 194, 2325, 273),
            "Liger Kernels": _fused(2948, 365, 2948, 365),
            "Torch Tune": PaperRow(8000, 93, 4768, 205, 12768, 297),
            "torch.compile": PaperRow(4000, 87, 12000, 168, 16000, 256),
            "Baseline": PaperRow(24000, 119, 16000, 197, 28000, 320),
        },
        "Llama 3 8B": {
            "Lower bound": _lower_bound(1066),
            "CCE": PaperRow(0.6, 36, 1067, 99, 1068, 131),
            "Liger Kernels": _fused(1317, 164, 1317, 164),
            "Torch Tune": PaperRow(2004, 40, 2521, 91, 4525, 131),
            "torch.compile": PaperRow(2004, 39, 6012, 75, 8016, 114),
            "Baseline": PaperRow(10020, 49, 8016, 80, 12024, 131),
        },
        "Mistral NeMo": {
            "Lower bound": _lower_bound(1360),
            "CCE": PaperRow(0.6, 45, 1361, 126, 1362, 168),
            "Liger Kernels": _fused(1872, 167, 1872, 168),
            "Torch Tune": PaperRow(2048, 49, 3348, 113, 5396, 162),
            "torch.compile": PaperRow(2048, 48, 6144, 94, 8192, 142),
            "Baseline": PaperRow(10240, 58, 8192, 99, 12288, 160),
        },
        "Phi 3.5 Mini": {
            "Lower bound": _lower_bound(236),
            "CCE": PaperRow(0.2, 7, 236, 25, 236, 31),
            "Liger Kernels": _fused(488, 26, 487, 26),
            "Torch Tune": PaperRow(502, 8, 451, 18, 953, 26),
            "torch.compile": PaperRow(502, 8, 1504, 15, 2006, 23),
            "Baseline": PaperRow(2506, 11, 2004, 16, 3006, 27),
        },
    },
}
