"""Where the backward keeps logit-gradient tiles between computing them and using them.

The backward computes each tile of ``G`` (the gradient of the logits) once per pass, stores it,
and two block-sparse products read it back: ``dE = G C`` and ``dC = G^T E``. Storing all of
``G`` would cost the N x V matrix that CCE exists to avoid, so each pass works on a chunk of it,
and the chunk lives in memory the backward owns anyway: rows of dC that are not written yet.

A chunk is stored as *segments*: the BLOCK_VOCAB entries of one token row in one vocabulary
block. Segment ``s`` goes to page ``pages[s // segments_per_page]`` at place ``s %
segments_per_page``; a page is ``page_stride`` elements. With pages = rows of dC
(``segments_per_page = D / BLOCK_VOCAB``), the pages can be any rows, in any order: the dC pass
writes dC through the vocabulary order, so the rows still free are scattered. Which segments a
tile takes depends on the pass: pass 1 stores whole rows of the tile grid, segment ``row *
chunk_vocab_blocks + vocab_block``; pass 2 stores only the tiles it lists, the k-th in slot k,
segments ``k * BLOCK_TOKENS + row in the tile``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Optional

import torch
import triton
import triton.language as tl


class ScratchView(NamedTuple):
    """A scratch as the kernels take it: the buffer, the page indices (None: the segments lie
    in order) and the page length."""

    buffer: torch.Tensor
    pages: Optional[torch.Tensor]
    page_stride: int


@triton.jit
def segment_offsets(scratch, segments, columns, mask, SEGMENTS_PER_PAGE: tl.constexpr,
                    BLOCK_VOCAB: tl.constexpr):
    """Element offsets in ``scratch`` (a :class:`ScratchView`) of the (segments x columns) piece
    that holds the given segments (int64); ``columns`` are offsets in a segment (all of it:
    ``tl.arange(0, BLOCK_VOCAB)``). Segments in order need neither the page table nor a
    division. ``SEGMENTS_PER_PAGE`` is a compile-time constant: dividing by it is a multiply,
    not a 64-bit division."""
    if scratch.pages is None:
        start = segments * BLOCK_VOCAB
    else:
        page = tl.load(scratch.pages + segments // SEGMENTS_PER_PAGE, mask=mask, other=0)
        start = (page.to(tl.int64) * scratch.page_stride
                 + (segments % SEGMENTS_PER_PAGE) * BLOCK_VOCAB)
    return start[:, None] + columns[None, :]


@dataclass(frozen=True)
class Scratch:
    """Storage for chunks of G: ``buffer`` (flat), its pages and their layout."""

    buffer: torch.Tensor
    # int32 page indices, in the order segments fill them; None when the pages are the
    # buffer's, in order (segment s starts at element s * segment_elements).
    pages: Optional[torch.Tensor]
    num_pages: int
    segments_per_page: int
    page_stride: int
    segment_elements: int  # BLOCK_VOCAB

    @property
    def in_order(self) -> bool:
        return self.pages is None

    @property
    def view(self) -> ScratchView:
        return ScratchView(self.buffer, self.pages, self.page_stride)

    @property
    def segments(self) -> int:
        return self.num_pages * self.segments_per_page

    @property
    def segment_bytes(self) -> int:
        return self.segment_elements * self.buffer.element_size()

    @staticmethod
    def in_rows(matrix: torch.Tensor, rows: torch.Tensor, block_vocab: int) -> "Scratch":
        """Pages = the given rows of ``matrix`` (e.g. rows of dC not written yet)."""
        return Scratch(matrix.view(-1), rows, rows.shape[0], matrix.shape[1] // block_vocab,
                       matrix.shape[1], block_vocab)

    @staticmethod
    def in_all_rows(matrix: torch.Tensor, block_vocab: int) -> "Scratch":
        """Pages = every row of ``matrix``, in order."""
        return Scratch(matrix.view(-1), None, matrix.shape[0], matrix.shape[1] // block_vocab,
                       matrix.shape[1], block_vocab)

    @staticmethod
    def dedicated(segments: int, block_vocab: int, dtype: torch.dtype,
                  device: torch.device) -> "Scratch":
        """A buffer of its own, one segment per page."""
        buffer = torch.empty(segments * block_vocab, dtype=dtype, device=device)
        return Scratch(buffer, None, segments, 1, block_vocab, block_vocab)


def rows_can_hold_segments(matrix: torch.Tensor, block_vocab: int) -> bool:
    """Rows of ``matrix`` are whole pages when they are a whole number of segments."""
    return matrix.shape[1] % block_vocab == 0 and matrix.is_contiguous()
