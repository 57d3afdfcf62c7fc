"""Integrations of :func:`cce.linear_cross_entropy` with training libraries.

Each integration is its own module and imports its library only when imported itself, so that
``import cce`` never needs them: ``cce.integrations.transformers`` for Hugging Face models,
imported on first use.
"""

import importlib
from types import ModuleType

_INTEGRATIONS = ("transformers",)


def __getattr__(name: str) -> ModuleType:
    if name in _INTEGRATIONS:
        return importlib.import_module(f"cce.integrations.{name}")
    raise AttributeError(f"module 'cce.integrations' has no attribute {name!r}")
