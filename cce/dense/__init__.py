"""The dense path of ``memory="fast"``: where most of the backward's tiles are live (small
vocabularies) or the batch is small, filtering cannot pay and the backward is cheaper as three
cuBLAS GEMMs.

- ``softmax_gradient``: one pass over a chunk of float32 logits (from cuBLAS) gives each row's
  log-sum-exp pieces and writes its logit gradient ``p - onehot`` in the inputs' dtype.
- ``loss``: the custom ops: the forward keeps that gradient (N x V, as much memory as the
  logits), the backward scales it by the upstream gradients and multiplies it by ``c`` and ``e``.
  At small batches (N <= D / 2) on larger vocabularies the gradient is kept, transposed, in the
  memory dC will take, and dC is written over it (``softmax_gradient.transposed_gradient``).
"""
