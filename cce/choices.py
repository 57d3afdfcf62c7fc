"""The tests' seam into the host's plans (:mod:`cce.forward.plan`, :mod:`cce.backward.plan`):
within a ``forced`` block, a planner takes some of its choices as given instead of deciding them,
and records every plan it makes."""

from __future__ import annotations

import contextlib
from dataclasses import replace
from typing import Any, Generic, Iterator, Optional, TypeVar

Choices = TypeVar("Choices")


class Seam(Generic[Choices]):
    """One planner's forced choices (a frozen dataclass whose None fields are decided) and the
    plans it made while they were forced."""

    def __init__(self, defaults: Choices) -> None:
        self._defaults = defaults
        # Held by the object, not a context variable: autograd runs a CUDA backward on a thread
        # of its own.
        self._active: Optional[tuple[Choices, list[Any]]] = None

    @contextlib.contextmanager
    def forced(self, **choices: Any) -> Iterator[list[Any]]:
        """Within the block, ``choices`` (and an enclosing block's) are given; the plans made
        are appended to the list yielded."""
        previous = self._active
        base = previous[0] if previous is not None else self._defaults
        self._active = (replace(base, **choices), [])
        try:
            yield self._active[1]
        finally:
            self._active = previous

    @property
    def choices(self) -> Choices:
        return self._active[0] if self._active is not None else self._defaults

    def record(self, plan: Any) -> None:
        if self._active is not None:
            self._active[1].append(plan)
