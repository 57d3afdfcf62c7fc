"""The backward (paper Alg. 3): dE and dC from logit-gradient tiles recomputed on-chip.

In the order a call runs them:

- ``live_tiles``: the live table, from the forward's bounds: which tiles may hold a softmax
  entry above ``filter_eps``.
- ``plan``: the host decides the path, the chunks, the scratch and the launch settings, once.
- ``run``: launches the plan's kernels in order (the algorithm's narrative is there):
  - ``gradient_tiles``: recompute a chunk's live tiles, filter them exactly, store them in
    ``scratch`` (dC's own memory or a small spare buffer);
  - ``tile_lists``: the stored tiles of each block, as lists;
  - ``sparse_tile_matmul`` (and ``classifier_product``, its Hopper dC product): the
    block-sparse products ``dE = G C`` and ``dC = G^T E``, with ``weighted_sum`` and
    ``partial_sums`` for their split programs and rank-one terms.
"""
