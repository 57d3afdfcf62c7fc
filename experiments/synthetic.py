"""Synthetic inputs whose softmax is as sparse as a real language model's, and the statistics
that say how sparse a softmax is.

Gradient filtering and vocabulary sorting make CCE's backward as fast as its inputs are sparse,
so random Gaussian embeddings (a near-uniform softmax: every tile live) mislead. A real model's
softmax puts its mass on the frequent tokens that every row shares plus a few tokens of its own;
:func:`lm_like_inputs` builds logits of exactly that form, as a rank-``dim`` product:

    logit(i, v) = zipf_exponent * log_freq(v) + candidate_boost * sum_j s_ij <r_j, r_v>

- ``log_freq(v) = -log(rank of v)``, a Zipf(1) unigram frequency, carried by a shared unit
  direction ``u``: ``c_v`` has ``log_freq(v) u``, every ``e_i`` has ``zipf_exponent u``.
  Token ids follow frequency up to noise: ranks are sorted by ``log(rank) + id_shuffle * N(0,1)``
  (0: ids in frequency order, as in a BPE vocabulary's first merges; large: random ids).
- Each row has ``candidates`` tokens of its own (its next-token guesses), drawn with
  probability proportional to ``rank^-candidate_exponent`` (frequent words more often, but
  spread over the whole vocabulary), each boosted by ``candidate_boost * s_ij``, ``s_ij``
  uniform in [0, 1]. ``c_v`` carries ``sqrt(candidate_boost) r_v`` with ``r_v`` a random unit
  vector orthogonal to ``u`` and ``e_i`` the ``s_ij``-weighted sum of its candidates' ``r_j``,
  so a candidate gets its boost exactly and every other token a cross-talk of standard
  deviation about ``candidate_boost * sqrt(candidates / 3 / dim)`` (0.5 at dim 2304).
- Targets are sampled from each row's own softmax, so the loss is the model's entropy.

:func:`calibrate` fits the three free parameters so that :func:`sparsity_statistics` matches
the real model's (:data:`REAL_DATA_STATISTICS`), and :data:`CALIBRATED` is its result.
"""

from __future__ import annotations

import argparse
import math
import time
from dataclasses import dataclass, replace
from typing import Callable, Optional, Union

import torch

from cce.vocab_order import vocab_order
from experiments.harness import DEVICE

STATISTICS = ("entries_per_row", "tiles_nonempty", "tiles_nonempty_sorted")

# Gemma 3 270M on Alpaca, 8192 tokens, measured on an H200 (shared/DEVICE.md): softmax entries
# >= 2^-12 per row, and fractions of 128 x 128 tiles holding one or more of them in vocabulary
# order and after sorting the vocabulary by average logit. sparsity_statistics on this
# repository's experiments.real_model inputs (CPU, first 4096 tokens) gives 125, 43.9%, 26.1%:
# the same tiles, fewer entries per row (DEVICE.md does not say how its rows were counted).
REAL_DATA_STATISTICS: dict[str, float] = {
    "entries_per_row": 182.0,
    "tiles_nonempty": 0.44,
    "tiles_nonempty_sorted": 0.23,
}


@dataclass(frozen=True)
class LMLikeParameters:
    """The generator's knobs (see the module docstring); the first three are calibrated."""

    zipf_exponent: float
    candidate_boost: float
    id_shuffle: float
    candidates: int = 10
    candidate_exponent: float = 0.5

    def calibrated_values(self) -> list[float]:
        return [self.zipf_exponent, self.candidate_boost, self.id_shuffle]

    def with_calibrated_values(self, values: list[float]) -> LMLikeParameters:
        zipf_exponent, candidate_boost, id_shuffle = values
        return replace(self, zipf_exponent=zipf_exponent, candidate_boost=candidate_boost,
                       id_shuffle=id_shuffle)


# Obtained with `python -m experiments.synthetic`: calibrate() on the CPU (9 evaluations, 4 min)
# at N=1024 tokens, V=262144 (the real data's vocabulary), D=2304 (Gemma 2 2B's hidden size),
# seed 0, from (1.0, 12.8, 5.0); N is reduced since the statistics are averages over 128-token
# blocks. It found (1.0288, 12.631, 5.2526): 184.9 entries/row, 44.2% / 23.2% of tiles. The
# rounded values below give, at that size, 182.1 entries/row, 43.9% and 22.7% of tiles (real
# data: 182, 44%, 23%). Other shapes give other numbers (N=1024, same seed): V=256000 D=2304:
# 181, 46.0%, 23.9%; V=128256 D=4096: 156, 66.9%, 42.1%; V=32064 D=3072: 87, 97.7%, 84.7%
# (the same tokens per row over fewer tiles). The benchmark prints them for every shape.
CALIBRATED = LMLikeParameters(zipf_exponent=1.029, candidate_boost=12.63, id_shuffle=5.25)


def lm_like_inputs(n_tokens: int, vocab_size: int, dim: int, seed: int = 0,
                   dtype: torch.dtype = torch.bfloat16,
                   device: Union[str, torch.device] = DEVICE, *,
                   parameters: LMLikeParameters = CALIBRATED, requires_grad: bool = True
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(e, c, targets)`` with a language model's softmax sparsity (module docstring).

    ``e`` is (n_tokens, dim), ``c`` (vocab_size, dim), both ``dtype``; targets (n_tokens,)
    int64 are drawn from each row's softmax (computed from the rounded inputs).
    """
    generator = torch.Generator(device=device).manual_seed(seed)
    e, c = _embeddings(n_tokens, vocab_size, dim, parameters, generator, device)
    e, c = e.to(dtype), c.to(dtype)
    targets = _sample_targets(e, c, generator)
    return e.requires_grad_(requires_grad), c.requires_grad_(requires_grad), targets


def sparsity_statistics(e: torch.Tensor, c: torch.Tensor, targets: torch.Tensor,
                        eps: float = 2.0**-12, tile: int = 128,
                        chunk_bytes: int = 2**30) -> dict[str, float]:
    """How sparse the softmax of ``e @ c.T`` is, over the rows whose target is not ignored.

    - ``entries_per_row``: mean number of softmax entries >= ``eps`` per row;
    - ``tiles_nonempty``: fraction of ``tile`` x ``tile`` blocks of the softmax (rows in order,
      ignored rows left out; vocabulary in id order) that hold one or more such entries;
    - ``tiles_nonempty_sorted``: the same with the vocabulary in :func:`cce.vocab_order.vocab_order`
      order, the order CCE's backward walks; a tile with no entry >= eps is one it can skip.

    Also ``rows``, the number of rows counted. Computed in float32, ``chunk_bytes`` of logits at
    a time, so that it fits next to a benchmark's inputs.
    """
    if tile < 1:
        raise ValueError(f"tile must be >= 1, got {tile}")
    e2 = e.detach().reshape(-1, e.shape[-1])
    c = c.detach()
    flat_targets = targets.reshape(-1)
    rows = e2[flat_targets >= 0]
    if rows.shape[0] == 0:
        raise ValueError("every target is ignored: no row to take statistics of")
    order = vocab_order(e2, c, None, flat_targets).long()
    vocab_size = c.shape[0]
    vocab_tiles = -(-vocab_size // tile)
    c32 = c.float()
    chunk_rows = max(tile, chunk_bytes // (4 * vocab_size) // tile * tile)
    threshold = math.log(eps)
    entries = nonempty = nonempty_sorted = token_tiles = 0
    for start in range(0, rows.shape[0], chunk_rows):
        logits = rows[start:start + chunk_rows].float() @ c32.T
        above = logits - torch.logsumexp(logits, dim=1, keepdim=True) >= threshold
        del logits
        entries += int(above.sum())
        # Chunks are whole token tiles, so one token tile's columns: any entry of its rows.
        padded_rows = -(-above.shape[0] // tile) * tile
        above = torch.nn.functional.pad(above, (0, 0, 0, padded_rows - above.shape[0]))
        columns = above.view(-1, tile, vocab_size).any(dim=1)
        nonempty += _nonempty_tiles(columns, tile)
        nonempty_sorted += _nonempty_tiles(columns[:, order], tile)
        token_tiles += columns.shape[0]
    return {"rows": rows.shape[0], "entries_per_row": entries / rows.shape[0],
            "tiles_nonempty": nonempty / (token_tiles * vocab_tiles),
            "tiles_nonempty_sorted": nonempty_sorted / (token_tiles * vocab_tiles)}


def calibrate(targets: Optional[dict[str, float]] = None, n_tokens: int = 1024,
              vocab_size: int = 262144, dim: int = 2304, seed: int = 0,
              start: LMLikeParameters = CALIBRATED, device: Union[str, torch.device] = "cpu",
              tolerance: float = 0.02, max_evaluations: int = 16,
              log: Callable[[str], None] = print
              ) -> tuple[LMLikeParameters, dict[str, float]]:
    """Fit the generator's three calibrated parameters so that its statistics hit ``targets``.

    Newton's method on log(parameters) -> log(statistic / target) with a finite-difference
    Jacobian taken afresh at every step (the statistics are too curved for Broyden's updates),
    steps halved until they improve. Every evaluation draws the inputs with the same ``seed``,
    so that the statistics are a smooth function of the parameters. Stops when every statistic
    is within ``tolerance`` (relative) or before exceeding ``max_evaluations``; returns the best
    parameters seen and their statistics. Statistics are taken with every target valid: the
    generator's targets do not change them, and sampling them would double the cost.
    """
    targets = REAL_DATA_STATISTICS if targets is None else targets
    goal = torch.tensor([math.log(targets[name]) for name in STATISTICS], dtype=torch.float64)
    evaluations = 0
    best: tuple[float, LMLikeParameters, dict[str, float]] = (math.inf, start, {})

    def residual(log_values: torch.Tensor) -> torch.Tensor:
        nonlocal evaluations, best
        parameters = start.with_calibrated_values(log_values.exp().tolist())
        generator = torch.Generator(device=device).manual_seed(seed)
        e, c = _embeddings(n_tokens, vocab_size, dim, parameters, generator, device)
        all_valid = torch.zeros(n_tokens, dtype=torch.long, device=device)
        statistics = sparsity_statistics(e.bfloat16(), c.bfloat16(), all_valid)
        evaluations += 1
        # A statistic of 0 (nothing above eps) is far off, not infinitely: keep the log finite.
        result = torch.tensor([math.log(max(statistics[name], 1e-6)) for name in STATISTICS],
                              dtype=torch.float64) - goal
        if _worst(result) < best[0]:
            best = (_worst(result), parameters, statistics)
        log(f"calibrate {evaluations}: {parameters} -> "
            + ", ".join(f"{name}={statistics[name]:.4g}" for name in STATISTICS))
        return result

    step = 0.05  # of the finite differences, in log(parameter)
    done = math.log1p(tolerance)
    x = torch.tensor(start.calibrated_values(), dtype=torch.float64).log()
    f = residual(x)
    while _worst(f) > done and evaluations + len(x) + 1 <= max_evaluations:
        jacobian = torch.stack([(residual(x + step * unit) - f) / step
                                for unit in torch.eye(len(x), dtype=torch.float64)], dim=1)
        dx = -torch.linalg.lstsq(jacobian, f[:, None]).solution[:, 0]
        dx *= min(1.0, 0.5 / float(dx.abs().max()))  # a tile either holds an entry or not
        improved = False
        for _ in range(3):  # halvings of a step that does not improve
            if evaluations >= max_evaluations:
                break
            f_new = residual(x + dx)
            if _worst(f_new) < _worst(f):
                x, f, improved = x + dx, f_new, True
                break
            dx /= 2
        if not improved:
            break
    return best[1], best[2]


def _worst(residual: torch.Tensor) -> float:
    return float(residual.abs().max())


def _embeddings(n_tokens: int, vocab_size: int, dim: int, parameters: LMLikeParameters,
                generator: torch.Generator, device: Union[str, torch.device]
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Float32 ``(e, c)`` of the model in the module docstring."""
    if dim < 2:
        raise ValueError(f"dim must be >= 2 (a frequency direction and the rest), got {dim}")
    u = torch.randn(dim, generator=generator, device=device)
    u /= u.norm()
    directions = torch.randn(vocab_size, dim, generator=generator, device=device)
    # addr_ rather than broadcasting: 10x faster on CPU at this size, where calibrate runs.
    directions.addr_(directions @ u, u, alpha=-1)
    directions /= directions.norm(dim=1, keepdim=True)

    log_rank = torch.arange(1, vocab_size + 1, device=device).float().log()
    noise = torch.randn(vocab_size, generator=generator, device=device)
    token_of_rank = torch.argsort(log_rank + parameters.id_shuffle * noise)
    log_freq = torch.empty_like(log_rank)
    log_freq[token_of_rank] = -log_rank
    scale = math.sqrt(parameters.candidate_boost)
    c = torch.addr(directions, log_freq, u, beta=scale)

    candidate_weight = torch.empty_like(log_rank)
    candidate_weight[token_of_rank] = torch.exp(-parameters.candidate_exponent * log_rank)
    candidates = torch.multinomial(candidate_weight, n_tokens * parameters.candidates,
                                   replacement=True, generator=generator)
    candidates = candidates.view(n_tokens, parameters.candidates)
    strength = torch.rand(n_tokens, parameters.candidates, generator=generator, device=device)
    e = parameters.zipf_exponent * u.expand(n_tokens, dim).clone()
    for j in range(parameters.candidates):  # one (N, D) gather at a time, not (N, k, D)
        e += scale * strength[:, j, None] * directions[candidates[:, j]]
    return e, c


def _sample_targets(e: torch.Tensor, c: torch.Tensor, generator: torch.Generator,
                    chunk_bytes: int = 2**30) -> torch.Tensor:
    """One token per row drawn from softmax(e @ c.T), ``chunk_bytes`` of logits at a time."""
    chunk_rows = max(1, chunk_bytes // (4 * c.shape[0]))
    c32 = c.float()
    samples = [torch.multinomial(torch.softmax(e_chunk.float() @ c32.T, dim=1), 1,
                                 generator=generator).squeeze(1)
               for e_chunk in e.split(chunk_rows)]
    return torch.cat(samples) if samples else torch.zeros(0, dtype=torch.long, device=e.device)


def _nonempty_tiles(columns: torch.Tensor, tile: int) -> int:
    """Tiles of ``tile`` columns (zero-padded at the end) with any True, summed over rows."""
    padding = (-columns.shape[1]) % tile
    padded = torch.nn.functional.pad(columns, (0, padding))
    return int(padded.view(columns.shape[0], -1, tile).any(dim=2).sum())


def main(argv: Optional[list[str]] = None) -> None:
    """``python -m experiments.synthetic``: rerun the calibration behind :data:`CALIBRATED`."""
    parser = argparse.ArgumentParser(prog="python -m experiments.synthetic",
                                     description=main.__doc__)
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=262144)
    parser.add_argument("--dim", type=int, default=2304)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args(argv)
    start_s = time.perf_counter()
    parameters, statistics = calibrate(n_tokens=args.tokens, vocab_size=args.vocab,
                                       dim=args.dim, device=args.device)
    print(f"{parameters}\n{statistics}\n({time.perf_counter() - start_s:.0f} s)")


if __name__ == "__main__":
    main()
