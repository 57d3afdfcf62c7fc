"""The forward: each token's log-sum-exp over the vocabulary without the logits in memory.

0. ``plan``: what a call's forward computes and how its kernel reads ``c``, decided on the host.
1. ``vocab_order``: the vocabulary ordered by average logit (``classifier_sums`` gives the mean
   row of ``c``), so that the backward's negligible tiles cluster.
2. ``indexed_dot``: the target logit ``c[x_i] . e_i`` of every token.
3. ``lse_forward``: logit tiles computed on-chip, each program's log-sum-exp merged into the
   global one under a spin lock; with a filter, each tile's bound for the backward.
4. ``row_outputs``: each row's LSE, loss and ``1 - p_y`` from the LSE of its other logits.
"""
