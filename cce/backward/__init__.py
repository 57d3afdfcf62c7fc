"""The backward (paper Alg. 3): dE and dC from logit-gradient tiles recomputed on-chip.

In the order a call runs them:

- ``live_tiles``: the live table, from the forward's bounds: which tiles may hold a softmax
  entry above ``filter_eps``.
- ``plan``: the host decides the path, the chunks, the scratch and the launch settings, once.
- ``run``: the plan's launches in order, in one loop (the algorithm's narrative is there); per
  chunk:
  - ``gradient_tiles``: the recompute (``TileStore``): a chunk's live tiles, filtered exactly,
    stored in ``scratch`` (dC's own memory or a small spare buffer);
  - ``tile_lists``: the stored tiles of each block, as lists;
  - ``sparse_tile_matmul`` (and ``classifier_product``, its Hopper dC product): the product
    (``Product``), block-sparse ``dE = G C`` or ``dC = G^T E``, with ``weighted_sum`` and
    ``partial_sums`` for their split programs and rank-one terms.
"""
