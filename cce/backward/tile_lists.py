"""Backward, between the recompute and the products: which stored tiles each output block reads.

A product program walks a list of the tiles stored for its row of the grid instead of testing
every tile, so that its loop has no branch and its loads pipeline. This kernel builds those
lists from the recompute's flags, one program per row: a running prefix sum of the flags gives
every stored tile its place. One launch per chunk; a sort would take several, and each costs
host time that the backward's small chunks cannot hide.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, NamedTuple

import numpy as np
import torch
import triton
import triton.language as tl

from cce.config import interpreting
from cce.host_copy import start_host_copy

# Flags read per step of a row's scan.
_BLOCK_COLUMNS = 1024
_INTERPRETER_BLOCK_COLUMNS = 64


@triton.jit
def build_tile_lists_kernel(flags_ptr, lists_ptr, counts_ptr, num_columns, stride_row,
                            stride_column, BLOCK_COLUMNS: tl.constexpr):
    row = tl.program_id(0)
    flags_row = flags_ptr + row.to(tl.int64) * stride_row
    list_row = lists_ptr + row.to(tl.int64) * num_columns
    count = 0
    for start in range(0, num_columns, BLOCK_COLUMNS):
        columns = start + tl.arange(0, BLOCK_COLUMNS)
        stored = tl.load(flags_row + columns * stride_column, mask=columns < num_columns,
                         other=0) != 0
        places = count + tl.cumsum(stored.to(tl.int32), axis=0) - 1
        tl.store(list_row + places, columns, mask=stored)
        count += tl.sum(stored.to(tl.int32), axis=0)
    tl.store(counts_ptr + row, count)


def build_tile_lists(flags: torch.Tensor) -> "tuple[torch.Tensor, torch.Tensor]":
    """Per row of ``flags`` (int32, any strides; nonzero = stored tile): the indices of its
    columns with a stored tile, in increasing order, at the start of that row of ``lists``
    (int32, rows x columns, contiguous; the rest of the row is not written), and ``counts``
    (int32, how many there are)."""
    rows, columns = flags.shape
    lists = torch.empty((rows, columns), dtype=torch.int32, device=flags.device)
    counts = torch.empty(rows, dtype=torch.int32, device=flags.device)
    if rows:
        block = _INTERPRETER_BLOCK_COLUMNS if interpreting() else _BLOCK_COLUMNS
        build_tile_lists_kernel[(rows,)](flags, lists, counts, columns, flags.stride(0),
                                   flags.stride(1), BLOCK_COLUMNS=block)
    return lists, counts


@dataclass(frozen=True)
class TileLists:
    """Pass 2's tiles, per vocabulary block (row): the token blocks of its tiles (``lists``,
    ``counts`` of them, see :func:`build_tile_lists`) and the place of its first tile among the
    tiles of all blocks (``first_slots``, int32). A chunk of rows stores the k-th tile of its row r
    in slot ``first_slots[r] - first_slots[0] + k`` of its scratch (:meth:`rows`: ``first_slots[0]``
    is the chunk's first tile)."""

    lists: torch.Tensor
    counts: torch.Tensor
    first_slots: torch.Tensor

    @staticmethod
    def of(flags: torch.Tensor) -> "TileLists":
        """The lists of ``flags`` (rows = vocabulary blocks), built once for every chunk."""
        lists, counts = build_tile_lists(flags)
        first_slots = torch.cumsum(counts, dim=0, dtype=torch.int32) - counts
        return TileLists(lists, counts, first_slots)

    def slot_map(self, transposed: bool = False) -> torch.Tensor:
        """int32 (rows, columns) of the flags listed, or (columns, rows) when ``transposed``:
        the slot of each listed tile (the k-th of row r's list is in slot first_slots[r] + k;
        unlisted tiles: 0). Built by indexing rather than by a boolean mask, which would make
        the host wait for the GPU."""
        num_rows, num_columns = self.lists.shape
        device = self.counts.device
        entries = torch.arange(num_columns, device=device, dtype=torch.int32)
        listed = entries[None, :] < self.counts[:, None]
        rows = torch.arange(num_rows, device=device, dtype=torch.int64)[:, None]
        places = (self.lists * num_rows + rows if transposed
                  else rows * num_columns + self.lists)
        # Entries past a list's end go to an extra element, dropped at the end.
        places = torch.where(listed, places, num_rows * num_columns)
        slot_map = torch.zeros(num_rows * num_columns + 1, dtype=torch.int32, device=device)
        slot_map[places.flatten()] = (self.first_slots[:, None] + entries).flatten()
        shape = (num_columns, num_rows) if transposed else (num_rows, num_columns)
        return slot_map[:-1].view(shape)

    def rows(self, rows: range) -> "TileLists":
        """The lists of a chunk of rows (views)."""
        return TileLists(self.lists[rows.start:rows.stop], self.counts[rows.start:rows.stop],
                         self.first_slots[rows.start:rows.stop])


class ListedTiles(NamedTuple):
    """The tiles of each vocabulary block (``TileLists``), and a function that returns their
    number per block on the host (:meth:`of`)."""

    tile_lists: TileLists
    read_lengths: Callable[[], np.ndarray]

    @staticmethod
    def of(table: torch.Tensor, host_may_sync: bool) -> "ListedTiles":
        """The lists of the tiles flagged in ``table`` (token blocks x vocabulary blocks), by
        vocabulary block. Their lengths set the chunks' widths. When the host may wait, their
        copy to the host is queued now and read later (one sync, :mod:`cce.host_copy`), so the
        GPU runs what is queued in between while the host plans. Otherwise the lengths are the
        bound known in advance, every token block, so that the schedule needs nothing from the
        GPU (CUDA graphs), at the cost of narrower chunks and idle programs."""
        tile_lists = TileLists.of(table.T)
        if host_may_sync:
            return ListedTiles(tile_lists, start_host_copy(tile_lists.counts))
        bound = np.full(table.shape[1], table.shape[0], dtype=np.int64)
        return ListedTiles(tile_lists, lambda: bound)
