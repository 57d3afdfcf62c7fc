"""Paths that compute the same loss without the kernels: ``chunked_torch`` (exact, in token
chunks, the CPU default) and ``baselines`` (the logits materialized: torch, torch.compile and
torchtune-style chunks)."""
