"""Work queued beside what the loss has already queued.

The dense path of ``memory="fast"`` at small N queues its first logits' GEMM before the targets
are made canonical: the GEMM needs only ``e`` and ``c``, and until the first long kernel is
queued, the host's time is the GPU's wait. The canonical targets and their range flag then run
on a second stream that waits only for the work queued before the GEMM (:func:`beside`), so
that the host reads the flag without waiting for the GEMM; the loss's stream waits for that
second stream before it reads the targets.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Callable, Iterator, NamedTuple, Optional

import torch

from cce.weighting import TokenOutputs


class StartedLoss(NamedTuple):
    """A loss whose work that needs only ``e`` and ``c`` is queued: a function of the canonical
    targets, and the mark of what was queued before that work (:func:`work_mark`; None when
    nothing was queued)."""

    loss_of_targets: Callable[[torch.Tensor], TokenOutputs]
    queued_before: Optional[torch.cuda.Event] = None


def work_mark(device: torch.device) -> Optional[torch.cuda.Event]:
    """An event recorded now on ``device``'s current stream: a CUDA device, not while a CUDA
    graph is captured or torch.compile traces (None otherwise: no second stream there)."""
    if (device.type != "cuda" or torch.compiler.is_compiling()
            or torch.cuda.is_current_stream_capturing()):
        return None
    mark = torch.cuda.Event()
    mark.record(torch.cuda.current_stream(device))
    return mark


@contextlib.contextmanager
def beside(mark: Optional[torch.cuda.Event], device: torch.device
           ) -> Iterator[Callable[..., None]]:
    """Run the block on a second stream of ``device`` that waits for ``mark`` only; after the
    block, the current stream waits for it. The block hands the tensors it made for later work
    to the function it gets (their memory is then kept until the current stream's work queued
    when they are freed is done). Without a mark, all on the current stream."""
    if mark is None:
        yield lambda *tensors: None
        return
    current = torch.cuda.current_stream(device)
    side = _second_stream(device)
    side.wait_event(mark)

    def hand_over(*tensors: torch.Tensor) -> None:
        for tensor in tensors:
            tensor.record_stream(current)

    with torch.cuda.stream(side):
        yield hand_over
    current.wait_stream(side)


@functools.lru_cache(maxsize=None)
def _second_stream(device: torch.device) -> torch.cuda.Stream:
    return torch.cuda.Stream(device)
