"""The options of a loss call, listed, defaulted and validated in one place.

:func:`cce.linear_cross_entropy` and :class:`cce.LinearCrossEntropy` build one frozen
:class:`LossOptions` from their keywords (the tensors ``bias`` and ``weight`` travel apart);
its construction raises ``ValueError`` naming a bad option. :meth:`LossOptions.resolved` then
fixes what depends on the inputs and the global state (``filter_eps="auto"``,
``deterministic=None``), once per call, and every implementation reads the resolved options.
They become separate scalars only at the custom-op boundary (:mod:`cce.cce_function`), whose
schema takes no Python objects.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Literal, Optional, Union

import numpy as np
import torch
import torch.distributed as dist

VOCAB_PARALLEL_IMPLS = ("cce", "torch")
IMPLEMENTATION_NAMES = ("cce", "cce_torch", "torch", "torch_compile", "chunked")
REDUCTIONS = ("mean", "sum", "none")
MEMORY_MODES = ("low", "fast")
_INTEGERS = (int, np.integer)  # numpy integer scalars too, as F.cross_entropy accepts
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1


@dataclass(frozen=True)
class VocabParallelOptions:
    """This rank's shard of a vocabulary-parallel classifier, for
    :func:`cce.linear_cross_entropy`'s ``vocab_parallel``.

    Args:
        start, stop: the rank holds rows ``[start, stop)`` of the full classifier (and bias).
            The ranks' ranges must partition ``[0, V)`` in rank order; sizes may differ.
        group: the process group of the ranks that hold the shards (None: the default group).
    """

    start: int
    stop: int
    group: Optional[dist.ProcessGroup] = None

    def __post_init__(self) -> None:
        # Only types here: ranges are checked against every rank's (check_shards), so that
        # every rank raises.
        for name in ("start", "stop"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"VocabParallelOptions.{name} must be an int, got {value!r}")


def check_vocab_parallel(vocab_parallel: Optional[VocabParallelOptions], impl: str) -> None:
    """The checks that need no other rank: the type of ``vocab_parallel`` and the impl."""
    if vocab_parallel is None:
        return
    if not isinstance(vocab_parallel, VocabParallelOptions):
        raise ValueError(f"vocab_parallel must be None or a cce.VocabParallelOptions, got "
                         f"{type(vocab_parallel).__name__}")
    if impl not in VOCAB_PARALLEL_IMPLS:
        raise ValueError(f"impl must be one of {VOCAB_PARALLEL_IMPLS} with vocab_parallel, got "
                         f"{impl!r}")
    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError("vocab_parallel needs torch.distributed to be initialized "
                         "(torch.distributed.init_process_group)")


@dataclass(frozen=True)
class LossOptions:
    """Every keyword option of :func:`cce.linear_cross_entropy` but the tensors ``bias`` and
    ``weight``, with the same names, defaults and meanings (documented there)."""

    ignore_index: int = -100
    softcap: Optional[float] = None
    temperature: float = 1.0
    reduction: Literal["mean", "sum", "none"] = "mean"
    shift: int = 0
    filter_eps: Union[float, Literal["auto"], None] = "auto"
    vocab_sorting: bool = True
    filter_correction: bool = True
    return_lse: bool = False
    return_entropy: bool = False
    return_argmax: bool = False
    impl: str = "cce"
    label_smoothing: float = 0.0
    z_loss: float = 0.0
    deterministic: Optional[bool] = None
    keep_tiles: bool = False
    memory: Literal["low", "fast"] = "low"
    vocab_parallel: Optional[VocabParallelOptions] = None

    def __post_init__(self) -> None:
        _check(self)

    def resolved(self, dtype: torch.dtype) -> "LossOptions":
        """The options of a call on inputs of ``dtype``: ``filter_eps`` a number or None (the
        paper's threshold for "auto"), ``deterministic`` a bool (None follows
        ``torch.are_deterministic_algorithms_enabled()``)."""
        filter_eps = default_filter_eps(dtype) if self.filter_eps == "auto" else self.filter_eps
        return dataclasses.replace(self, filter_eps=filter_eps,
                                   deterministic=self.resolved_deterministic(),
                                   label_smoothing=float(self.label_smoothing),
                                   temperature=float(self.temperature),
                                   z_loss=float(self.z_loss))

    @property
    def keeps_tiles(self) -> bool:
        """Whether the tile backward keeps its live tiles: ``keep_tiles`` or memory "fast"."""
        return self.keep_tiles or self.memory == "fast"

    def resolved_deterministic(self) -> bool:
        """``deterministic``; None follows ``torch.are_deterministic_algorithms_enabled()``."""
        if self.deterministic is None:
            return torch.are_deterministic_algorithms_enabled()
        return self.deterministic


def default_filter_eps(dtype: torch.dtype) -> float:
    """The paper's threshold: 2^-12 for bfloat16, i.e. the dtype's machine epsilon / 32."""
    return torch.finfo(dtype).eps / 32


def _check(options: LossOptions) -> None:
    ignore_index = options.ignore_index
    if (isinstance(ignore_index, bool) or not isinstance(ignore_index, _INTEGERS)
            or not _INT64_MIN <= ignore_index <= _INT64_MAX):
        raise ValueError(f"ignore_index must be an int (int64), got {ignore_index!r}")
    softcap = options.softcap
    if softcap is not None and not (_is_number(softcap) and math.isfinite(softcap)
                                    and softcap > 0):
        raise ValueError(f"softcap must be None or a positive finite number, got {softcap!r}")
    temperature = options.temperature
    if not (_is_number(temperature) and math.isfinite(temperature) and temperature > 0):
        raise ValueError(f"temperature must be a positive finite number, got {temperature!r}")
    z_loss = options.z_loss
    if not (_is_number(z_loss) and math.isfinite(z_loss) and z_loss >= 0):
        raise ValueError(f"z_loss must be a finite number >= 0, got {z_loss!r}")
    if options.reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {options.reduction!r}")
    shift = options.shift
    if isinstance(shift, bool) or not isinstance(shift, int) or shift < 0:
        raise ValueError(f"shift must be an int >= 0, got {shift!r}")
    # A softmax entry is at most 1: a threshold of 1 or more would filter every tile.
    filter_eps = options.filter_eps
    if filter_eps not in ("auto", None) and not (_is_number(filter_eps) and 0 < filter_eps < 1):
        raise ValueError(f"filter_eps must be 'auto', None or a float in (0, 1), got "
                         f"{filter_eps!r}")
    for name in ("vocab_sorting", "filter_correction", "return_lse", "return_entropy",
                 "return_argmax", "keep_tiles"):
        if not isinstance(getattr(options, name), bool):
            raise ValueError(f"{name} must be a bool, got {getattr(options, name)!r}")
    if options.deterministic is not None and not isinstance(options.deterministic, bool):
        raise ValueError(f"deterministic must be None or a bool, got {options.deterministic!r}")
    if options.memory not in MEMORY_MODES:
        raise ValueError(f"memory must be one of {MEMORY_MODES}, got {options.memory!r}")
    if options.impl not in IMPLEMENTATION_NAMES:
        raise ValueError(f"impl must be one of {IMPLEMENTATION_NAMES}, got {options.impl!r}")
    label_smoothing = options.label_smoothing
    if not (_is_number(label_smoothing) and 0 <= label_smoothing <= 1):  # False for NaN
        raise ValueError(f"label_smoothing must be a number in [0, 1], got {label_smoothing!r}")
    check_vocab_parallel(options.vocab_parallel, options.impl)
    if options.vocab_parallel is not None:
        if label_smoothing:
            raise ValueError("vocab_parallel does not support weight or label_smoothing")
        if options.keep_tiles or options.memory != "low":
            raise ValueError("vocab_parallel does not support keep_tiles or memory='fast'")


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
