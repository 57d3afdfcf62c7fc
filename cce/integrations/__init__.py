"""Integrations of :func:`cce.linear_cross_entropy` with training libraries.

Each integration is its own module and imports its library only when imported itself, so that
``import cce`` never needs them: ``import cce.integrations.transformers`` for Hugging Face models.
"""
