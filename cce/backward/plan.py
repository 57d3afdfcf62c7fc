"""The backward's plan: what the host decides before the backward's kernels run
(:mod:`cce.backward` runs it).

Made once per backward call, from the shapes, the request and the live table: the path (the one
pass, or two passes with pass 1 in whole rows of the grid or in slots), each pass's chunks, where
each chunk's scratch lives and how large it is, the buffers (the gradients, pass 1's flags, the
slot maps, the filter correction's kept mass), whether the tiles' products read c's rows in
position order, and every product's launch settings, from the kernel settings looked up once.

Deciding needs one number that only the GPU has: the live tiles per vocabulary block (whether
the one pass fits) or per token block (pass 1's slot chunks). Their copy to the host is queued
behind the lists that count them (:mod:`cce.host_copy`); what the first recompute does not need
(the one pass's slot map, the filter correction's terms, the rank-one updates) the run queues
after that recompute, so that the host's time between the read and its launch is the least
planning can take. Pass 2's chunks follow pass 1's kept
tiles, which only pass 1's filter knows: the plan holds what sizes them (:class:`PassTwoSizing`),
and the run lists the kept tiles before pass 1's last product and hands them to
:func:`plan_pass_two`, which reads their lengths while the GPU runs that product.

Tests force a choice (:class:`PlanChoices`) and read the plans made through :func:`forced`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ContextManager, NamedTuple, Optional, Union

import numpy as np
import torch

from cce.backward import classifier_product, embeddings_product
from cce.choices import Seam
from cce.config import (DEDICATED_SCRATCH_BYTES, SLOT_CHUNK_TOKENS, SPARE_SCRATCH_BYTES,
                        KernelConfig, KernelConfigs, cdiv, next_power_of_2,
                        sm_utilization, split_count, whole_waves)
from cce.backward.gradient_tiles import RecomputeInputs
from cce.host_copy import start_host_copy
from cce.backward.scratch import Scratch, rows_can_hold_segments
from cce.backward.epilogue_terms import PendingCorrection
from cce.backward.product_arguments import ProductSettings
from cce.backward.tile_lists import ListedTiles, TileLists
from cce.forward.lse_forward import classifier_by_position


class CorrectionInputs(NamedTuple):
    """What ``filter_correction`` reads besides the recompute's inputs
    (:class:`cce.backward.epilogue_terms.FilterCorrection`): ``counted_mass``, float32 (N,),
    each row's softmax mass in the entries the tiles add up, those of ``c`` off its target (None:
    all of them); ``classifier_row_sum``, float32 (D,) ``c.sum(0)`` where the forward has it (None:
    the backward reads ``c`` for it)."""

    counted_mass: Optional[torch.Tensor] = None
    classifier_row_sum: Optional[torch.Tensor] = None


class BackwardRequest(NamedTuple):
    """What a backward computes, besides the recomputed tiles' inputs.

    ``live_tiles``: the live-grid table of tiles that may hold a significant entry (None: every
    tile may); ``needs_grad_e``, ``needs_grad_c``: the gradients wanted (dbias comes with dC);
    ``correction``: dE gets back what the filter dropped, estimated along the mean classifier
    row (``filter_correction``; needs ``filter_eps`` and no softcap), or None;
    ``keep_tiles``: when both gradients are needed and the host may wait, run the one-pass
    backward with its tiles in a buffer of their own even where they do not fit in dC;
    ``grad_e_dtype``: dE's dtype (None: e's; float32 for a dE summed over shards)."""

    live_tiles: Optional[torch.Tensor]
    needs_grad_e: bool
    needs_grad_c: bool
    correction: Optional[CorrectionInputs] = None
    keep_tiles: bool = False
    grad_e_dtype: Optional[torch.dtype] = None


@dataclass(frozen=True)
class PlanChoices:
    """Choices a plan takes as given instead of deciding them; None: decided.

    ``one_pass``: True, the one pass wherever dC's rows can hold tiles (still only where its
    tiles fit, or with ``keep_tiles``), however few waves its dE product fills; False, two
    passes unless ``keep_tiles``. ``slots``: True, pass 1's live tiles in slots wherever whole
    rows take several chunks, however many tokens they hold; False, whole rows.
    ``spare_bytes``: the spare buffer's size (it holds one vocabulary block's tiles at least).
    ``splits``: programs per output block of every dE product. ``triton_classifier_product``:
    the Triton dC product even where :mod:`cce.backward.classifier_product` runs;
    ``triton_embeddings_product``: the Triton dE product even where
    :mod:`cce.backward.embeddings_product` runs. ``gathered_rows``: the tile products gather
    c's rows through the order even where they could read them in position order."""

    one_pass: Optional[bool] = None
    slots: Optional[bool] = None
    spare_bytes: Optional[int] = None
    splits: Optional[int] = None
    triton_classifier_product: bool = False
    triton_embeddings_product: bool = False
    gathered_rows: bool = False


_SEAM: Seam[PlanChoices] = Seam(PlanChoices())


def forced(**choices: Optional[Union[bool, int]]
           ) -> "ContextManager[list[Union[BackwardPlan, ClassifierPlan]]]":
    """Within the block, every backward is planned with ``choices`` (:class:`PlanChoices`'
    fields; an enclosing block's too) as given, and the plans made are appended to the list
    yielded: each backward's :class:`BackwardPlan`, then its pass 2's :class:`ClassifierPlan`
    when pass 2 is planned during the run. The tests' seam."""
    return _SEAM.forced(**choices)


class PassOneChunk(NamedTuple):
    """A chunk of pass 1: its rows of the grid; in slots, the first slot its scratch holds
    (int32, first element); the scratch's segments its tiles take (the rest is room for its
    product's partial sums); its dE product's settings."""

    token_blocks: range
    first_slot: Optional[torch.Tensor]
    used_segments: int
    product: ProductSettings


class PassOnePlan(NamedTuple):
    """Pass 1 (dE) in chunks of grid rows."""

    flags: torch.Tensor  # int32 grid: 1 where the filter kept the tile and it was stored
    buffer_segments: int  # 0: the scratch is dC's rows, in order; else a buffer of its own
    slot_map: Optional[torch.Tensor]  # live tiles in slots: grid tile -> slot; None: whole rows
    chunks: "list[PassOneChunk]"


class ClassifierChunk(NamedTuple):
    """A chunk of dC's vocabulary blocks: ``in_spare``, its tiles are in the spare buffer;
    ``recomputes``: its tiles are recomputed into its scratch, from slot 0 (False: they are the
    one pass's, in their slots); ``longest_list``: its recompute's programs per block."""

    vocab_blocks: range
    in_spare: bool
    recomputes: bool
    longest_list: int


class ClassifierPlan(NamedTuple):
    """dC in chunks of vocabulary blocks: pass 2, or the end of the one pass. Pass 2 stores a
    chunk's tiles in the rows of dC of later positions (``position_rows``: the row at each
    position), the one pass's chunks that do not recompute read its ``slots``."""

    tile_lists: TileLists  # each vocabulary block's tiles, slots numbered over all blocks
    spare_tiles: int  # the spare buffer's tiles
    chunks: "list[ClassifierChunk]"
    product: ProductSettings
    filters: bool  # its recompute applies the filter (False: pass 1 filtered these tiles)
    position_rows: Optional[torch.Tensor] = None
    slots: Optional[Scratch] = None

    def scratch(self, chunk: ClassifierChunk, grad_c: torch.Tensor,
                block_vocab: int) -> Optional[Scratch]:
        """Where ``chunk``'s tiles are, None for the spare buffer. A view made as the chunk is
        launched: made for every chunk before the first launch, the views were host time that
        the GPU waited for after the host's read (docs/notes/host-work.md)."""
        if chunk.in_spare:
            return None
        if not chunk.recomputes:
            return self.slots
        return Scratch.in_rows(grad_c, self.position_rows[chunk.vocab_blocks.stop * block_vocab:],
                               block_vocab)


class OnePassPlan(NamedTuple):
    """The one pass: every live tile (``live_tiles``, the table listed) recomputed once into its
    slot (``scratch``), the dE product reading them all through the lists' slot map
    (:meth:`cce.backward.tile_lists.TileLists.slot_map`, transposed), then dC."""

    live_tiles: torch.Tensor
    tile_lists: TileLists
    longest_list: int
    scratch: Scratch
    product: ProductSettings
    classifier: ClassifierPlan


class PassTwoSizing(NamedTuple):
    """What sizes pass 2's chunks once its lists' lengths are known (:func:`plan_pass_two`)."""

    configs: KernelConfigs
    grad_c: torch.Tensor
    vocab_order: Optional[torch.Tensor]
    spare_bytes: int
    product: ProductSettings
    filters: bool


class Gradients(NamedTuple):
    """What a backward writes, allocated by its plan: dE, dC and dbias, each None when not
    needed."""

    grad_e: Optional[torch.Tensor]
    grad_c: Optional[torch.Tensor]
    grad_bias: Optional[torch.Tensor]


class BackwardPlan(NamedTuple):
    """A backward call's plan (module docstring). ``classifier``: dC's plan where it is known
    before the run (the one pass, or dC without dE); ``pass_two``: what plans it after pass 1;
    ``classifier_by_position``: c's rows in position order (c unsorted, or the forward's sorted
    copy), which the recomputes and the one pass's Hopper dE product read by descriptor, or
    None: they gather the rows through the order."""

    configs: KernelConfigs
    host_may_sync: bool
    live_tiles: Optional[torch.Tensor]
    gradients: Gradients
    correction: Optional[PendingCorrection]
    one_pass: Optional[OnePassPlan]
    pass_one: Optional[PassOnePlan]
    classifier: Optional[ClassifierPlan]
    pass_two: Optional[PassTwoSizing]
    classifier_by_position: Optional[torch.Tensor] = None

    @property
    def path(self) -> str:
        """The path in words, for reports: "one pass", "two passes" (pass 1 "in slots" or "in
        whole rows"), "dE alone" (a frozen classifier) or "dC alone"; then ", c by position"
        where the tile products read c's rows in position order."""
        by_position = ", c by position" if self.classifier_by_position is not None else ""
        if self.one_pass is not None:
            return "one pass" + by_position
        if self.pass_one is None:
            return "dC alone" + by_position
        rows = "in slots" if self.pass_one.slot_map is not None else "in whole rows"
        if self.pass_two is None and self.classifier is None:
            return f"dE alone, {rows}{by_position}"
        return f"two passes, pass 1 {rows}{by_position}"


class _Problem(NamedTuple):
    """What every decision reads: the call's inputs, its kernel settings and the choices."""

    recompute: RecomputeInputs
    request: BackwardRequest
    configs: KernelConfigs
    choices: PlanChoices
    host_may_sync: bool
    classifier_by_position: Optional[torch.Tensor]  # as BackwardPlan's

    @property
    def grid_shape(self) -> "tuple[int, int]":
        grid = self.configs.live_grid
        return (cdiv(self.recompute.e.shape[0], grid.block_tokens),
                cdiv(self.recompute.c.shape[0], grid.block_vocab))

    def live_table(self) -> torch.Tensor:
        """The live-tile table, or every tile live when there is none (no filter)."""
        if self.request.live_tiles is not None:
            return self.request.live_tiles
        return torch.ones(self.grid_shape, dtype=torch.int32, device=self.recompute.e.device)

    @property
    def spare_bytes(self) -> int:
        spare = self.choices.spare_bytes
        return SPARE_SCRATCH_BYTES if spare is None else spare


def plan_backward(recompute: RecomputeInputs, request: BackwardRequest,
                  configs: KernelConfigs) -> BackwardPlan:
    """The plan of the backward of ``recompute`` for ``request`` with the kernel settings
    ``configs`` (:func:`cce.config.kernel_configs` of e's dtype; module docstring); allocates
    the gradients and queues the work of the one host sync."""
    e, c = recompute.e, recompute.c
    choices = _SEAM.choices
    rows = (None if choices.gathered_rows else classifier_by_position(
        e, c, recompute.vocab_order, recompute.sorted_classifier))
    problem = _Problem(recompute, request, configs, choices, host_may_sync(e.device), rows)
    grad_c = (torch.empty(c.shape, dtype=c.dtype, device=c.device)
              if request.needs_grad_c else None)
    grad_bias = (torch.empty_like(recompute.bias)
                 if request.needs_grad_c and recompute.bias is not None else None)
    grad_e = (torch.empty(e.shape, dtype=request.grad_e_dtype or e.dtype, device=e.device)
              if request.needs_grad_e else None)
    # Each host sync below is planned around: what does not depend on the lengths it reads is
    # decided before it, while the GPU still has work; after it, the GPU waits for the host.
    correction = _correction(recompute, request)
    one_pass = None
    if (request.needs_grad_e and request.needs_grad_c and problem.host_may_sync
            and (request.keep_tiles or _one_pass_may_pay(problem, grad_c))):
        table = problem.live_table()
        one_pass = _one_pass_plan(problem, ListedTiles.of(table, problem.host_may_sync), table,
                                  grad_c)
    pass_one = classifier = pass_two = None
    if one_pass is not None:
        classifier = one_pass.classifier
    elif request.needs_grad_c:
        pass_two = PassTwoSizing(problem.configs, grad_c, recompute.vocab_order,
                                 problem.spare_bytes, _classifier_product(
                                     problem, grad_c if rows_can_hold_segments(
                                         grad_c, problem.configs.live_grid.block_vocab)
                                     else None),
                                 filters=not request.needs_grad_e)
    if one_pass is None and request.needs_grad_e:
        pass_one = _pass_one_plan(problem, grad_c)
    if pass_two is not None:
        if pass_one is None:  # no pass 1: the live tiles, filtered in pass 2
            classifier = _pass_two_plan(pass_two, ListedTiles.of(problem.live_table(),
                                                                 problem.host_may_sync))
            pass_two = None
    plan = BackwardPlan(problem.configs, problem.host_may_sync, request.live_tiles,
                        Gradients(grad_e, grad_c, grad_bias), correction, one_pass, pass_one,
                        classifier, pass_two, rows)
    _SEAM.record(plan)
    return plan


def plan_pass_two(sizing: PassTwoSizing, listed: ListedTiles) -> ClassifierPlan:
    """Pass 2's plan, once pass 1 has listed the tiles it kept (``listed``)."""
    plan = _pass_two_plan(sizing, listed)
    _SEAM.record(plan)
    return plan


def _pass_two_plan(sizing: PassTwoSizing, listed: ListedTiles) -> ClassifierPlan:
    """Pass 2's chunks of the listed tiles (:func:`_classifier_chunks`), each in the rows of dC
    of later positions or in the spare buffer. Reads the lists' lengths on the host."""
    grid = sizing.configs.live_grid
    grad_c = sizing.grad_c
    tile_lists, read_lengths = listed
    tiles_per_block = read_lengths()
    spare_tiles = _spare_tiles(tiles_per_block, grad_c, grid, sizing.spare_bytes)
    # Vocabulary positions -> rows of dC: the free rows are those of later positions.
    position_rows = _position_rows(sizing.vocab_order, grad_c.shape[0], grad_c.device)
    placed = _classifier_chunks(tiles_per_block, grad_c.shape[0], grad_c.shape[1],
                                grid.block_tokens, grid.block_vocab,
                                rows_can_hold_segments(grad_c, grid.block_vocab), spare_tiles)
    chunks = [ClassifierChunk(vocab_blocks, in_spare, True,
                              _longest_list(tiles_per_block, vocab_blocks))
              for vocab_blocks, in_spare in placed]
    return ClassifierPlan(tile_lists, spare_tiles, chunks, sizing.product, sizing.filters,
                          position_rows=position_rows)


def host_may_sync(device: torch.device) -> bool:
    """Whether the host may wait for the GPU here: not while a CUDA graph is being captured,
    not inside torch.compile's tracing, and not when the caller asked torch to flag every sync
    (``torch.cuda.set_sync_debug_mode``)."""
    if device.type != "cuda":
        return True
    return not (torch.cuda.is_current_stream_capturing() or torch.compiler.is_compiling()
                or torch.cuda.get_sync_debug_mode() != 0)


def _correction(recompute: RecomputeInputs,
                request: BackwardRequest) -> Optional[PendingCorrection]:
    """The filter correction's kept mass, or None without it."""
    if request.correction is None:
        return None
    return PendingCorrection.of(recompute.c, recompute.prob_scale, *request.correction)


# ---- The one pass ------------------------------------------------------------------------------

# The one pass's dE product must keep the SMs at least this busy over its waves.
_ONE_PASS_MIN_UTILIZATION = 0.9


def _one_pass_may_pay(problem: _Problem, grad_c: torch.Tensor) -> bool:
    """Whether to look for room for the one pass in dC (a host sync): when dC's rows can hold
    tiles, when they would hold half the grid's tiles (a sync that finds too many costs the
    backward its lead over the GPU: 0.8-1.2 ms at N = 8192, H100), and when the dE product,
    which multiplies every tile in one launch without splits, fills whole waves of the GPU
    (with 144 programs for 132 SMs, 2B shape at N = 2048, the one pass was 16% slower)."""
    grid = problem.configs.live_grid
    vocab_size, dim = grad_c.shape
    if not rows_can_hold_segments(grad_c, grid.block_vocab):
        return False
    if problem.choices.one_pass is not None:
        return problem.choices.one_pass
    num_token_blocks, num_vocab_blocks = problem.grid_shape
    half_grid_segments = num_token_blocks * num_vocab_blocks * grid.block_tokens // 2
    programs = num_token_blocks * cdiv(dim, _block_out(problem.configs, dim))
    return (half_grid_segments <= vocab_size * (dim // grid.block_vocab)
            and sm_utilization(programs, grad_c.device) >= _ONE_PASS_MIN_UTILIZATION)


def _one_pass_plan(problem: _Problem, listed: ListedTiles, table: torch.Tensor,
                   grad_c: torch.Tensor) -> Optional[OnePassPlan]:
    """The one pass's plan for the live tiles (``listed``, from ``table``): with
    ``keep_tiles``, every live tile in a buffer of its own; otherwise when every live tile fits
    in dC's memory (the tiles of the later chunks in the rows of later positions), None when
    they do not. Reads the lists' lengths on the host."""
    grid = problem.configs.live_grid
    vocab_size, dim = grad_c.shape
    tile_lists, read_lengths = listed
    num_token_blocks, num_vocab_blocks = problem.grid_shape
    keep_tiles = problem.request.keep_tiles
    pages = None if keep_tiles else grad_c
    embeddings_product = _one_pass_embeddings_product(problem, num_token_blocks, pages)
    classifier_product = _classifier_product(problem, pages)
    tiles_per_block = read_lengths()
    spare_tiles = _spare_tiles(tiles_per_block, grad_c, grid, problem.spare_bytes)
    if keep_tiles:
        scratch = Scratch.dedicated(max(int(tiles_per_block.sum()), 1) * grid.block_tokens,
                                    grid.block_vocab, grad_c.dtype, grad_c.device)
        chunks = [(range(num_vocab_blocks), False)]
    else:
        placed = _one_pass_chunks(tiles_per_block, vocab_size, dim, grid.block_tokens,
                                  grid.block_vocab, spare_tiles)
        if placed is None:
            return None
        first_position, chunks = placed
        # The slots fill the rows of dC from first_position on, in position order.
        rows = _position_rows(problem.recompute.vocab_order, vocab_size,
                              grad_c.device)[first_position:]
        scratch = Scratch.in_rows(grad_c, rows, grid.block_vocab)
    all_vocab_blocks = range(num_vocab_blocks)
    classifier = ClassifierPlan(
        tile_lists, spare_tiles,
        [ClassifierChunk(vocab_blocks, in_spare, in_spare,
                         _longest_list(tiles_per_block, vocab_blocks))
         for vocab_blocks, in_spare in chunks],
        classifier_product, filters=True, slots=scratch)
    return OnePassPlan(table, tile_lists, _longest_list(tiles_per_block, all_vocab_blocks), scratch,
                       embeddings_product, classifier)


def _one_pass_chunks(tiles_per_block: np.ndarray, vocab_size: int, dim: int,
                     block_tokens: int, block_vocab: int, spare_tiles: int
                     ) -> "Optional[tuple[int, list[tuple[range, bool]]]]":
    """Where the one-pass backward's slots go in dC, and its chunks of dC: ``(first position,
    chunks)``, or None when the tiles do not fit in dC's memory.

    The slots fill dC's rows in position order, up to the last row, from the first position on.
    A chunk of vocabulary blocks writes the rows of its positions, so it may only write rows
    that hold no tile of its blocks or of later ones: rows before the first position, and rows
    of tiles already multiplied. Each chunk is the widest that writes only those. Sorting puts
    the blocks with many tiles first, so the chunks widen; at the end of the vocabulary, once a
    block's own tiles lie in its rows, the remaining blocks are recomputed again into the spare
    buffer (``spare_tiles``), as pass 2's last chunks are."""
    segments_per_row = dim // block_vocab
    num_blocks = len(tiles_per_block)
    tiles_before = _tiles_before(tiles_per_block)
    slot_rows = cdiv(int(tiles_before[-1]) * block_tokens, segments_per_row)
    first_position = vocab_size - slot_rows
    if first_position < 0:
        return None
    chunks = []
    first = 0
    while first < num_blocks:
        # The rows before this one hold no slot of block `first` or of a later block.
        writable = (vocab_size if tiles_before[first] == tiles_before[-1] else
                    first_position + tiles_before[first] * block_tokens // segments_per_row)
        end = num_blocks if writable >= vocab_size else min(num_blocks, writable // block_vocab)
        if end <= first:
            break
        chunks.append((range(first, end), False))
        first = end
    while first < num_blocks:
        end = _spare_chunk_end(tiles_before, first, spare_tiles)
        chunks.append((range(first, end), True))
        first = end
    return first_position, chunks


# ---- Pass 1 ------------------------------------------------------------------------------------

def _pass_one_plan(problem: _Problem, grad_c: Optional[torch.Tensor]) -> PassOnePlan:
    """Pass 1's plan."""
    recompute, request = problem.recompute, problem.request
    e = recompute.e
    grid = problem.configs.live_grid
    num_token_blocks, num_vocab_blocks = problem.grid_shape
    # Pass 1's record: 1 where the tile survived the filter and was stored.
    flags = torch.zeros((num_token_blocks, num_vocab_blocks), dtype=torch.int32,
                        device=e.device)
    row_segments = grid.block_tokens * num_vocab_blocks  # one token block, every vocab block
    buffer_segments = _pass_one_buffer(problem, grad_c, row_segments)
    scratch_segments, segment_bytes = (
        (grad_c.shape[0] * (grad_c.shape[1] // grid.block_vocab),
         grid.block_vocab * grad_c.element_size()) if not buffer_segments
        else (buffer_segments, grid.block_vocab * e.element_size()))
    whole_rows_chunk = _whole_rows_chunk(problem, scratch_segments, segment_bytes, row_segments)
    slot_map = None
    if _live_tiles_in_slots(problem, whole_rows_chunk):
        live_rows = TileLists.of(request.live_tiles)
        read_tiles_per_row = start_host_copy(live_rows.counts)
        slot_map = live_rows.slot_map()
    if slot_map is not None:
        tiles_per_row = read_tiles_per_row()
        chunks = [(token_blocks, live_rows.first_slots[token_blocks.start:],
                   int(tiles_per_row[token_blocks.start:token_blocks.stop].sum())
                   * grid.block_tokens)
                  for token_blocks in _slot_chunks(tiles_per_row,
                                                   scratch_segments // grid.block_tokens)]
    else:
        chunks = [(token_blocks, None, len(token_blocks) * row_segments)
                  for token_blocks in (range(first, min(first + whole_rows_chunk,
                                                        num_token_blocks))
                                       for first in range(0, num_token_blocks,
                                                          whole_rows_chunk))]
    planned = [PassOneChunk(token_blocks, first_slot, used, _embeddings_product(
        problem, len(token_blocks), slot_map is not None,
        (scratch_segments - used) * segment_bytes))
        for token_blocks, first_slot, used in chunks]
    return PassOnePlan(flags, buffer_segments, slot_map, planned)


def _pass_one_buffer(problem: _Problem, grad_c: Optional[torch.Tensor],
                     row_segments: int) -> int:
    """0 when pass 1's scratch is dC's memory (it can hold at least one token block of tiles),
    else the segments of a buffer of its own (dC not needed, or too small). Without dC (a
    frozen classifier) that buffer may take the memory dC would have taken, so the dE-only
    backward gets chunks as wide as the full one's."""
    e, c = problem.recompute.e, problem.recompute.c
    block_vocab = problem.configs.live_grid.block_vocab
    if (grad_c is not None and rows_can_hold_segments(grad_c, block_vocab)
            and grad_c.shape[0] * (grad_c.shape[1] // block_vocab) >= row_segments):
        return 0
    budget = DEDICATED_SCRATCH_BYTES if grad_c is not None else max(
        DEDICATED_SCRATCH_BYTES, c.numel() * c.element_size())
    segments = max(row_segments,
                   budget // (block_vocab * e.element_size()) // row_segments * row_segments)
    return min(segments, problem.grid_shape[0] * row_segments)


def _live_tiles_in_slots(problem: _Problem, whole_rows_chunk: int) -> bool:
    """Whether pass 1 stores only the live tiles, each in a slot, rather than whole rows of the
    grid (``whole_rows_chunk`` token blocks per chunk). Each chunk's recompute and dE product
    read all of c, so whole rows at small D (dC holds about D tokens of them) take many chunks
    that wait on memory; slots let a chunk hold about 1 / (live fraction) times more. Slots
    cost the dE product its whole-block loop, more than they save where whole rows already
    hold many tokens (:data:`cce.config.SLOT_CHUNK_TOKENS`). The host reads the rows' live
    counts, so not where it must not wait. Slot chunks follow the live tiles, and with them the
    product's splits and the order of its float32 sums: in deterministic mode the live tiles
    are a function of the inputs (:func:`cce.forward.lse_forward.lse_forward`)."""
    if (problem.request.live_tiles is None or whole_rows_chunk >= problem.grid_shape[0]
            or not problem.host_may_sync):
        return False
    if problem.choices.slots is not None:
        return problem.choices.slots
    return whole_rows_chunk * problem.configs.live_grid.block_tokens < SLOT_CHUNK_TOKENS


def _whole_rows_chunk(problem: _Problem, scratch_segments: int, segment_bytes: int,
                      row_segments: int) -> int:
    """Token blocks per chunk of pass 1 in whole rows: as many as the scratch holds, trimmed to
    whole waves of the product; or one less, when the room that frees in the scratch lets a
    split product fill the SMs better (small D: dC then holds few token blocks, and their
    product few programs)."""
    dim = problem.recompute.e.shape[1]
    device = problem.recompute.e.device
    block_out = _embeddings_block_out(problem, slot_map=False)
    most = whole_waves(min(problem.grid_shape[0], scratch_segments // row_segments),
                       cdiv(dim, block_out), device)
    if most == 1:
        return most

    def utilization(blocks: int) -> float:
        room_bytes = (scratch_segments - blocks * row_segments) * segment_bytes
        splits = _embeddings_splits(problem, blocks, block_out, room_bytes)
        return sm_utilization(blocks * cdiv(dim, block_out) * splits, device)

    return most - 1 if utilization(most - 1) > utilization(most) else most


def _slot_chunks(tiles_per_row: np.ndarray, slots: int) -> "list[range]":
    """Pass 1's chunks of token blocks when each live tile has a slot: consecutive rows of the
    grid whose ``tiles_per_row`` fit in ``slots``, as few chunks as the greedy cut gives, with
    their tiles shared out about equally (room is left for the dE product's partial sums).
    A row fits whatever its tiles: the scratch holds a whole row of the grid."""
    num_rows = len(tiles_per_row)
    tiles_before = _tiles_before(tiles_per_row)
    count, first = 0, 0
    while first < num_rows:
        first = max(first + 1,
                    int(np.searchsorted(tiles_before, tiles_before[first] + slots,
                                        side="right")) - 1)
        count += 1
    for parts in range(count, num_rows + 1):
        shares = tiles_before[-1] * np.arange(1, parts) / parts
        cuts = [0, *np.searchsorted(tiles_before, shares, side="left").tolist(), num_rows]
        chunks = [range(a, b) for a, b in zip(cuts, cuts[1:])]
        if all(len(chunk) and tiles_before[chunk.stop] - tiles_before[chunk.start] <= slots
               for chunk in chunks):
            return chunks
    return [range(row, row + 1) for row in range(num_rows)]


# ---- Pass 2 ------------------------------------------------------------------------------------

def _classifier_chunks(tiles_per_block: np.ndarray, vocab_size: int, dim: int,
                       block_tokens: int, block_vocab: int, rows_hold_segments: bool,
                       spare_tiles: int) -> "list[tuple[range, bool]]":
    """Pass 2's chunks of vocabulary blocks, in order, and whether each is stored in the spare
    buffer. A chunk's tiles (``tiles_per_block`` of each block, ``block_tokens`` segments each)
    go to the rows of dC of later positions (``dim / block_vocab`` segments per row): each chunk
    is the widest whose tiles fit there. The free rows run out as dC fills up, so the chunks
    narrow, each taking about half the blocks left; once the spare buffer would take more
    blocks (as many as its ``spare_tiles`` hold, one at least), every later chunk goes there,
    rather than many small chunks that run at the host's pace.

    Runs on the host after the list lengths arrive, while the GPU has only pass 1's last
    product left, so each chunk's end is a binary search rather than a Python loop over the
    blocks (2048 of them at V = 262144)."""
    num_blocks = len(tiles_per_block)
    tiles_before = _tiles_before(tiles_per_block)
    # Blocks [first, end) fit in the free rows when their segments, plus the segments of the
    # rows up to the end of block `end`, are at most all of dC's:
    #   (tiles_before[end] - tiles_before[first]) * block_tokens
    #       <= (vocab_size - end * block_vocab) * segments_per_row,
    # and the left-hand side minus the right one grows with `end`.
    segments_per_row = dim // block_vocab
    footprint = (tiles_before * block_tokens
                 + np.arange(num_blocks + 1, dtype=np.int64) * block_vocab * segments_per_row)

    chunks = []
    first = 0
    in_spare = not rows_hold_segments
    while first < num_blocks:
        spare_end = _spare_chunk_end(tiles_before, first, spare_tiles)
        if not in_spare:
            room = vocab_size * segments_per_row + tiles_before[first] * block_tokens
            rows_end = int(np.searchsorted(footprint, room, side="right")) - 1
            in_spare = rows_end < spare_end
        end = spare_end if in_spare else rows_end
        chunks.append((range(first, end), in_spare))
        first = end
    return chunks


# ---- Shared ------------------------------------------------------------------------------------

def _block_out(configs: KernelConfigs, dim: int) -> int:
    """Output columns per program of a product: the configured width, or less for a narrow
    output."""
    return min(configs.sparse_tile_matmul.block_out, next_power_of_2(dim))


def _embeddings_block_out(problem: _Problem, slot_map: bool) -> int:
    """Output columns per program of the dE product: :func:`_block_out`'s, or half of it where
    only the half divides D and the product then runs on its whole-block loop. D = 640: five
    blocks of 128 instead of two of 256 and a half-empty one, 14% faster at the Gemma 3 shape;
    not through a slot map or with a rank-one term, where it was slower
    (docs/notes/backward.md)."""
    dim = problem.recompute.e.shape[1]
    width = _block_out(problem.configs, dim)
    if (dim % width and dim % (width // 2) == 0 and not slot_map
            and problem.recompute.rank_one is None and _whole_rows(problem)):
        return width // 2
    return width


def _whole_rows(problem: _Problem) -> bool:
    """Whether every token and vocabulary block is whole and the configuration has a
    whole-block loop for the dE product."""
    grid = problem.configs.live_grid
    return (problem.configs.whole_block_embeddings_product.step_depth > 0
            and problem.recompute.e.shape[0] % grid.block_tokens == 0
            and problem.recompute.c.shape[0] % grid.block_vocab == 0)


def _embeddings_splits(problem: _Problem, token_blocks: int, block_out: int,
                       room_bytes: int) -> int:
    """Programs per output block of the dE product of ``token_blocks`` (split-K), with float32
    partial sums of every row of the chunk for each split."""
    if problem.choices.splits is not None:
        return problem.choices.splits
    dim = problem.recompute.e.shape[1]
    programs = token_blocks * cdiv(dim, block_out)
    rows = token_blocks * problem.configs.live_grid.block_tokens
    return split_count(programs, rows * dim * 4, problem.recompute.e.device, room_bytes)


def _embeddings_product(problem: _Problem, token_blocks: int, slot_map: bool,
                        room_bytes: int) -> ProductSettings:
    """The settings of a dE product of ``token_blocks`` rows of the grid, with ``room_bytes`` of
    the scratch free for its partial sums. Whole token, vocabulary and output blocks: measured
    faster at those shapes only."""
    configs = problem.configs
    block_out = _embeddings_block_out(problem, slot_map)
    whole_blocks = (not slot_map and _whole_rows(problem)
                    and problem.recompute.e.shape[1] % block_out == 0)
    return ProductSettings(
        configs.live_grid,
        configs.whole_block_embeddings_product if whole_blocks else configs.sparse_tile_matmul,
        block_out, configs.dot_precision,
        splits=_embeddings_splits(problem, token_blocks, block_out, room_bytes),
        whole_blocks=whole_blocks)


def _one_pass_embeddings_product(problem: _Problem, token_blocks: int,
                                 pages: Optional[torch.Tensor]) -> ProductSettings:
    """The settings of the one pass's dE product, whose tiles lie in the rows of ``pages`` (dC)
    or in a buffer of their own (None): on Hopper GPUs :mod:`cce.backward.embeddings_product`'s
    where it applies and the tile products read c's rows in position order
    (:attr:`BackwardPlan.classifier_by_position`)."""
    settings = _embeddings_product(problem, token_blocks, True, 0)
    recompute, configs, rows = problem.recompute, problem.configs, problem.classifier_by_position
    if (rows is not None and not problem.choices.triton_embeddings_product
            and embeddings_product.usable(rows, configs.embeddings_product,
                                          recompute.rank_one is not None, settings.splits,
                                          pages)):
        return settings._replace(config=configs.embeddings_product, by_tma=True)
    return settings


def _classifier_product(problem: _Problem, pages: Optional[torch.Tensor]) -> ProductSettings:
    """The settings of the dC products, whose tiles lie in the rows of ``pages`` (dC) or in
    buffers of their own (None); on Hopper GPUs :mod:`cce.backward.classifier_product`'s where it
    applies. It pays at every benchmark shape and batch size measured."""
    configs, recompute = problem.configs, problem.recompute
    by_tma = (not problem.choices.triton_classifier_product and classifier_product.usable(
        recompute.e, configs.classifier_product, recompute.bias, recompute.rank_one is not None,
        pages))
    return ProductSettings(
        configs.live_grid, configs.classifier_product if by_tma else configs.sparse_tile_matmul,
        _block_out(configs, recompute.e.shape[1]), configs.dot_precision, by_tma=by_tma)


def _spare_tiles(tiles_per_block: np.ndarray, like: torch.Tensor, grid: KernelConfig,
                 spare_bytes: int) -> int:
    """Tiles the spare buffer holds: ``spare_bytes``' worth of tiles of ``like``'s dtype, or
    one vocabulary block's tiles if more."""
    tile_bytes = grid.block_tokens * grid.block_vocab * like.element_size()
    return max(spare_bytes // tile_bytes, int(tiles_per_block.max()))


def _longest_list(tiles_per_block: np.ndarray, vocab_blocks: range) -> int:
    """The most tiles of one block of ``vocab_blocks``: a listed recompute's programs per
    block."""
    return int(tiles_per_block[vocab_blocks.start:vocab_blocks.stop].max())


def _tiles_before(tiles_per_block: np.ndarray) -> np.ndarray:
    """int64 (blocks + 1,): the tiles of the blocks before each block (and of all, last)."""
    tiles_before = np.zeros(len(tiles_per_block) + 1, dtype=np.int64)
    np.cumsum(tiles_per_block, out=tiles_before[1:])
    return tiles_before


def _spare_chunk_end(tiles_before: np.ndarray, first: int, spare_tiles: int) -> int:
    """The end of the widest chunk of blocks from ``first`` on whose tiles the spare buffer
    holds (``tiles_before[k]``: the tiles of the blocks before k; one block at least)."""
    end = int(np.searchsorted(tiles_before, tiles_before[first] + spare_tiles, side="right")) - 1
    return max(end, first + 1)


def _position_rows(vocab_order: Optional[torch.Tensor], vocab_size: int,
                   device: torch.device) -> torch.Tensor:
    """The row of dC (the vocabulary entry) at each vocabulary position."""
    if vocab_order is not None:
        return vocab_order
    return torch.arange(vocab_size, dtype=torch.int32, device=device)
