"""Backward (paper Alg. 3): dE and dC from logit-gradient tiles recomputed once per pass.

Planned, then run: :mod:`cce.backward.plan` decides the path, the chunks, the scratch and the
launch settings on the host, once per call; :func:`launches` turns the plan into its launches, per
chunk a recompute (:class:`cce.backward.gradient_tiles.TileStore`) then a product
(:class:`cce.backward.sparse_tile_matmul.Product`), and :func:`run_backward` runs them in one
loop. What follows is the plan's schedule.

Two passes over the tile grid, each in chunks. A chunk's surviving tiles of ``G`` (the gradient
of the logits) are recomputed once and stored (:mod:`cce.backward.gradient_tiles`), then multiplied
by block-sparse products that own their outputs (:mod:`cce.backward.sparse_tile_matmul`):

1. dE, chunks of token blocks x the whole vocabulary: ``dE[chunk] = G[chunk] C``. The chunk is
   stored in dC's memory, which is not written yet, so a chunk of whole rows of the grid holds
   about D tokens. Where that is few (small D), only the live tiles are stored, each in a slot,
   and a chunk holds about 1 / (live fraction) times more tokens (one more host sync: the live
   tiles per token block).
2. dC, chunks of vocabulary blocks x all tokens: ``dC[chunk] = G[:, chunk]^T E``. Only the
   tiles pass 1 stored are recomputed, and each gets a slot of its own in the rows of dC that
   are still free (those of later vocabulary positions). A chunk is as wide as its tiles fit
   there: wide where sorting left few live tiles (the tail of the vocabulary), narrower as dC
   fills up; once a small spare buffer would take more blocks than the free rows, the rest of
   the vocabulary goes through it. Sizing the chunks takes one host sync (the tiles per
   vocabulary block); the lists of every chunk's tiles are built in one launch before pass 1's
   last product, and their lengths copied to the host behind it, so the host plans pass 2
   while the GPU runs that product (:mod:`cce.host_copy`). Where the host must not wait (CUDA
   graph capture, torch.compile, ``torch.cuda.set_sync_debug_mode``), the chunks are sized for
   every tile being stored instead: no sync, narrower chunks.

**One pass** instead, when both gradients are needed, the host may wait, and every live tile
fits in dC's memory (few tokens, or a classifier wide for its vocabulary: about kept tiles <= D
/ N): each live tile is recomputed once into a slot in dC's last rows, in position order, the dE
product reads every slot, then dC is written in chunks of vocabulary blocks, each the widest
whose rows hold no slot still to be read; the last blocks, whose tiles lie in their own rows, are
recomputed again into the spare buffer. ``keep_tiles=True`` runs it in a buffer of its own
wherever the tiles do not fit. Deciding takes one host sync (the live tiles per vocabulary
block), during which the GPU computes the filter correction's mean classifier row.

Peak memory is dE + dC + a few MB of tables, partial sums and the spare buffer; every gradient
is accumulated in float32 on-chip and written once, without atomics, so the result is
deterministic (the filter correction's kept mass is added up atomically, but in integers).
Label smoothing's rank-one term of G, which has an entry in every tile, is added by the products
in closed form (:mod:`cce.backward.epilogue_terms`), so it keeps no tile live.
Tiles that the forward's bounds prove negligible (``live_tiles``) are never recomputed; pass 1
records which tiles survive the exact filter, so pass 2 only recomputes those.
"""

from __future__ import annotations

import functools
from typing import Iterator, Optional, Union

import torch

from cce.config import kernel_configs
from cce.backward.epilogue_terms import FilterCorrection, RankOneUpdate
from cce.backward.plan import (BackwardPlan, BackwardRequest, CorrectionInputs, Gradients,
                               plan_backward, plan_pass_two)
from cce.backward.gradient_tiles import RecomputeInputs, TileStore, store_gradient_tiles
from cce.backward.scratch import Scratch
from cce.backward.sparse_tile_matmul import Product, multiply
from cce.backward.tile_lists import ListedTiles, build_tile_lists

__all__ = ["BackwardRequest", "CorrectionInputs", "linear_cross_entropy_backward",
           "run_backward"]


def linear_cross_entropy_backward(recompute: RecomputeInputs,
                                  request: BackwardRequest) -> Gradients:
    """(dE, dC, dbias), each None when not needed, of the tiles ``recompute`` describes
    (:class:`cce.backward.gradient_tiles.RecomputeInputs`). When ``c`` is one shard of the
    vocabulary (:mod:`cce.vocab_parallel`), ``recompute.lse`` is the whole vocabulary's."""
    plan = plan_backward(recompute, request, kernel_configs(recompute.e.dtype))
    return run_backward(plan, recompute)


def run_backward(plan: BackwardPlan, recompute: RecomputeInputs) -> Gradients:
    """Run the launches of ``plan`` (:func:`cce.backward.plan.plan_backward`) in order
    (:func:`launches`): each chunk's recompute, then its product. Decides nothing."""
    for launch in launches(plan, recompute):
        if isinstance(launch, TileStore):
            store_gradient_tiles(recompute, launch, plan.configs, plan.classifier_by_position)
        else:
            multiply(launch)
        del launch  # the next launch may allocate what this one's scratch frees
    return plan.gradients


def launches(plan: BackwardPlan, recompute: RecomputeInputs
             ) -> Iterator[Union[TileStore, Product]]:
    """The kernels of ``plan`` in launch order, a recompute then its product per chunk: the one
    pass's, or pass 1's chunks; then dC's chunks. Each is made once the one before it is
    launched, so what only the products read is queued behind the first recompute
    (:class:`_ProductTerms`), and pass 1 lists its kept tiles behind its last recompute; pass 2
    is planned (:func:`cce.backward.plan.plan_pass_two`) while the GPU runs the last product."""
    e, c, vocab_order = recompute.e, recompute.c, recompute.vocab_order
    configs, classifier = plan.configs, plan.classifier
    grad_e, grad_c, grad_bias = plan.gradients
    grid = configs.live_grid
    kept_mass = plan.correction.kept_mass if plan.correction is not None else None
    one_pass, pass_one = plan.one_pass, plan.pass_one
    terms = _ProductTerms(plan, recompute)
    if one_pass is not None:
        table = one_pass.live_tiles
        yield TileStore(one_pass.scratch, range(table.shape[1]), tile_lists=one_pass.tile_lists,
                        longest_list=one_pass.longest_list, kept_mass=kept_mass)
        # The Hopper dE product reads c's rows in position order, not through the order.
        by_position = one_pass.product.by_tma
        yield Product(False, one_pass.scratch, range(table.shape[0]), *build_tile_lists(table),
                      plan.classifier_by_position if by_position else c,
                      None if by_position else vocab_order, grad_e, one_pass.product,
                      slot_map=one_pass.tile_lists.slot_map(transposed=True),
                      correction=terms.correction, rank_one=terms.embeddings)
    if pass_one is not None:
        flags = pass_one.flags
        scratch = (Scratch.dedicated(pass_one.buffer_segments, grid.block_vocab, e.dtype,
                                     e.device) if pass_one.buffer_segments
                   else Scratch.in_all_rows(grad_c, grid.block_vocab))
        listed = None
        for chunk in pass_one.chunks:
            rows = chunk.token_blocks
            yield TileStore(scratch, range(flags.shape[1]), rows, flags, plan.live_tiles,
                            pass_one.slot_map, chunk.first_slot, kept_mass=kept_mass)
            if plan.pass_two is not None and rows.stop == flags.shape[0]:
                # Pass 1 filtered every tile exactly: its final flags are the tiles pass 2
                # stores. Listed before the last product, which the GPU runs while the host
                # reads the lists' lengths and plans pass 2.
                listed = ListedTiles.of(flags, plan.host_may_sync)
            yield Product(False, scratch, rows, *build_tile_lists(flags[rows.start:rows.stop]),
                          c, vocab_order, grad_e, chunk.product, chunk.first_slot,
                          chunk_slots=chunk.first_slot is not None, slot_map=pass_one.slot_map,
                          room=_room_after(scratch, chunk.used_segments),
                          correction=terms.correction, rank_one=terms.embeddings)
        del scratch
        if plan.pass_two is not None:
            classifier = plan_pass_two(plan.pass_two, listed)
    if classifier is not None:
        spare = None
        for chunk in classifier.chunks:
            scratch = classifier.scratch(chunk, grad_c, grid.block_vocab)
            if scratch is None:
                spare = spare or Scratch.dedicated(classifier.spare_tiles * grid.block_tokens,
                                                   grid.block_vocab, c.dtype, c.device)
                scratch = spare
            tile_lists = classifier.tile_lists.rows(chunk.vocab_blocks)
            if chunk.recomputes:
                # filters: False where pass 1's filter kept these tiles already.
                yield TileStore(scratch, chunk.vocab_blocks, tile_lists=tile_lists,
                                longest_list=chunk.longest_list, filters=classifier.filters)
            yield Product(True, scratch, chunk.vocab_blocks, tile_lists.lists, tile_lists.counts,
                          e, vocab_order, grad_c, classifier.product, tile_lists.first_slots,
                          chunk_slots=chunk.recomputes, grad_bias=grad_bias,
                          rank_one=terms.classifier)


class _ProductTerms:
    """What the products add besides the stored tiles (:mod:`cce.backward.epilogue_terms`),
    built when the first product reads it: behind the first recompute, which needs none of it."""

    def __init__(self, plan: BackwardPlan, recompute: RecomputeInputs) -> None:
        self._plan, self._recompute = plan, recompute

    @functools.cached_property
    def correction(self) -> Optional[FilterCorrection]:
        pending = self._plan.correction
        return pending.complete() if pending is not None else None

    @functools.cached_property
    def embeddings(self) -> Optional[RankOneUpdate]:
        term = self._recompute.rank_one
        return RankOneUpdate.for_embeddings(term, self._recompute.c) if term is not None else None

    @functools.cached_property
    def classifier(self) -> Optional[RankOneUpdate]:
        term = self._recompute.rank_one
        return RankOneUpdate.for_classifier(term, self._recompute.e) if term is not None else None


def _room_after(scratch: Scratch, used_segments: int) -> Optional[torch.Tensor]:
    """The scratch after its first ``used_segments``, as float32, when its segments lie in order
    in its buffer (None otherwise)."""
    if not scratch.in_order:
        return None
    start = used_segments * scratch.segment_elements
    end = scratch.segments * scratch.segment_elements
    end -= (end - start) % 2  # whole float32 words
    return scratch.buffer[start:end].view(torch.float32) if end > start else None
