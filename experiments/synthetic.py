"""Synthetic inputs whose softmax is as sparse as a real language model's, and the statistics
that say how sparse a softmax is.

Gradient filtering and vocabulary sorting make CCE's backward as fast as its inputs are sparse,
and filtering as accurate as the mass it drops is small, so random Gaussian embeddings (a
near-uniform softmax: every tile live) mislead. A real model's softmax puts its mass on the
frequent tokens that every row shares plus tokens of its own, with a light tail;
:func:`lm_like_inputs` builds logits of that form, as a rank-``dim`` product:

    logit(i, v) = zipf_exponent * log_freq(v) + candidate_boost * sum_j s_ij <r_j, r_v>

- ``log_freq(v) = -log(rank of v + zipf_offset)``, a Zipf-Mandelbrot unigram frequency, carried
  by a shared unit direction ``u``: ``c_v`` has ``log_freq(v) u``, every ``e_i`` has
  ``zipf_exponent u``. The offset flattens the head and a steep exponent thins the tail, so
  that a row's entries >= 2^-12 can hold 96% of its mass, as a real model's do, and still be
  a hundred or more (a pure Zipf law cannot do both: fitted to the other three statistics
  alone, it held 72.5% of the mass, so filtering dropped 7 times too much).
- Token ids follow frequency up to noise: ranks are sorted by ``log(rank) + id_shuffle * N(0,1)``
  (0: ids in frequency order, as in a BPE vocabulary's first merges; large: random ids). The
  model is built in rank order and the ids only renumber it, so ``id_shuffle`` moves entries
  between tiles in id order and changes nothing else, but for the order of ties in
  :func:`cce.forward.vocab_order.vocab_order`'s bfloat16 average logits.
- Each row has ``candidates`` tokens of its own (its next-token guesses), drawn with
  probability proportional to ``rank^-candidate_exponent`` (frequent words more often, but
  spread over the whole vocabulary), each boosted by ``candidate_boost * s_ij``, ``s_ij``
  uniform in [0, 1]. ``c_v`` carries ``sqrt(candidate_boost) r_v`` with ``r_v`` a random unit
  vector orthogonal to ``u`` and ``e_i`` the ``s_ij``-weighted sum of its candidates' ``r_j``,
  so a candidate gets its boost exactly and every other token a cross-talk of standard
  deviation about ``candidate_boost * sqrt(candidates / 3 / dim)`` (0.9 at dim 2304).
- Targets are sampled from each row's own softmax, so the loss is the model's entropy.

:func:`calibrate` fits the four calibrated parameters (the Zipf exponent and offset, the
candidate boost and the id shuffle) so that the four statistics of :func:`sparsity_statistics`
match the real model's (:data:`REAL_DATA_STATISTICS`), and :data:`CALIBRATED` is its result.
"""

from __future__ import annotations

import argparse
import math
import time
from dataclasses import dataclass, replace
from typing import Callable, Optional, Union

import torch

from cce.forward.vocab_order import vocab_order
from experiments.harness import DEVICE

STATISTICS = ("entries_per_row", "tiles_nonempty", "tiles_nonempty_sorted", "mass_above_eps")

# Gemma 3 270M on Alpaca: sparsity_statistics (CPU, float32) on this repository's
# experiments.real_model inputs, the first 4096 tokens (4055 rows with a target): 124.8 softmax
# entries >= 2^-12 per row; 43.9% and 26.1% of 128 x 128 tiles hold one or more in vocabulary
# order and after sorting the vocabulary by average logit; those entries hold 95.9% of each
# row's probability mass (the first 8192 tokens: 119.7, 42.9%, 25.3%, 96.2%). Tokenized by
# transformers 5.23: older versions cut words into pieces and drop the BOS
# (experiments.real_model.check_tokenizer), a flatter softmax (5.17: 203 entries per row, 91.9%
# of the mass).
REAL_DATA_STATISTICS: dict[str, float] = {
    "entries_per_row": 125.0,
    "tiles_nonempty": 0.44,
    "tiles_nonempty_sorted": 0.26,
    "mass_above_eps": 0.959,
}


@dataclass(frozen=True)
class LMLikeParameters:
    """The generator's knobs (see the module docstring); the first four are calibrated."""

    zipf_exponent: float
    zipf_offset: float
    candidate_boost: float
    id_shuffle: float
    candidates: int = 20
    candidate_exponent: float = 0.4

    def calibrated_values(self) -> list[float]:
        return [self.zipf_exponent, self.zipf_offset, self.candidate_boost, self.id_shuffle]

    def with_calibrated_values(self, values: list[float]) -> LMLikeParameters:
        zipf_exponent, zipf_offset, candidate_boost, id_shuffle = values
        return replace(self, zipf_exponent=zipf_exponent, zipf_offset=zipf_offset,
                       candidate_boost=candidate_boost, id_shuffle=id_shuffle)


# Obtained with `python -m experiments.synthetic`: calibrate() on the CPU (12 evaluations,
# 7 min at one thread) at N=1024 tokens, V=262144 (the real data's vocabulary), D=2304 (Gemma 2
# 2B's hidden size), seed 0, from (1.80, 19.8, 16.85, 3.45); N is reduced since the statistics
# are averages over 128-token blocks. It found (1.8255, 25.424, 16.997, 3.6975): 124.3
# entries/row, 44.1% / 25.8% of tiles, 95.86% of the mass. The rounded values below give, at
# that size, 124.3 entries/row, 44.2% and 25.8% of tiles, 95.86% of the mass (real data: 125,
# 44%, 26%, 95.9%). Without the offset, or with 10 candidates per row, Newton fits of a cheaper
# stand-in of this generator (the cross-talk drawn as independent Gaussians) did not reach the
# four statistics together; with 20 candidates, candidate_exponent 0.4 and the offset they did.
# Other shapes give other numbers (N=1024, same seed; only V=262144 is calibrated):
# V=256000 D=2304: 125.5, 45.0%, 26.3%, 95.8%; V=128256 D=4096: 83.8, 66.6%, 45.5%, 97.1%;
# V=32064 D=3072: 29.3, 97.1%, 87.7%, 98.9%. The benchmark prints them for every shape.
CALIBRATED = LMLikeParameters(zipf_exponent=1.826, zipf_offset=25.4, candidate_boost=17.0,
                              id_shuffle=3.70)


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
    - ``tiles_nonempty_sorted``: the same with the vocabulary in
      :func:`cce.forward.vocab_order.vocab_order` order, the order CCE's backward walks; a tile
      with no entry >= eps is one it can skip;
    - ``mass_above_eps``: mean over rows of the softmax probability that the row's entries
      >= ``eps`` hold; the rest is what skipping the tiles without such entries can drop.

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
    mass = 0.0
    for start in range(0, rows.shape[0], chunk_rows):
        logits = rows[start:start + chunk_rows].float() @ c32.T
        log_probs = logits - torch.logsumexp(logits, dim=1, keepdim=True)
        del logits
        above = log_probs >= threshold
        # In place: the chunk's probabilities reuse the log-probabilities' memory.
        mass += float(log_probs.exp_().mul_(above).sum(dtype=torch.float64))
        del log_probs
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
            "tiles_nonempty_sorted": nonempty_sorted / (token_tiles * vocab_tiles),
            "mass_above_eps": mass / rows.shape[0]}


def calibrate(targets: Optional[dict[str, float]] = None, n_tokens: int = 1024,
              vocab_size: int = 262144, dim: int = 2304, seed: int = 0,
              start: LMLikeParameters = CALIBRATED, device: Union[str, torch.device] = "cpu",
              tolerance: float = 0.02, max_evaluations: int = 30,
              log: Callable[[str], None] = print
              ) -> tuple[LMLikeParameters, dict[str, float]]:
    """Fit the generator's four calibrated parameters so that its statistics hit ``targets``.

    Newton's method on log(parameters) -> log(statistic / target) with a finite-difference
    Jacobian taken afresh at every step (the statistics are too curved for Broyden's updates),
    steps halved until they improve; ``mass_above_eps`` is matched through the mass below eps,
    what filtering drops (2% of a mass of 0.96 is half of it). Every evaluation draws the inputs
    with the same ``seed``, so that the statistics are a smooth function of the parameters.
    Stops when every statistic is within ``tolerance`` (relative, the mass below eps for
    ``mass_above_eps``) or before exceeding ``max_evaluations``; returns the best parameters
    seen and their statistics. Statistics are taken with every target valid: the generator's
    targets do not change them, and sampling them would double the cost.
    """
    targets = REAL_DATA_STATISTICS if targets is None else targets
    goal = torch.tensor([_log_scale(name, targets[name]) for name in STATISTICS],
                        dtype=torch.float64)
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
        result = torch.tensor([_log_scale(name, statistics[name]) for name in STATISTICS],
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


def _log_scale(name: str, value: float) -> float:
    """The log of what calibrate matches: the statistic, or the mass below eps."""
    if name == "mass_above_eps":
        value = 1 - value
    # A statistic of 0 (nothing above or below eps) is far off, not infinitely: keep it finite.
    return math.log(max(value, 1e-6))


def _worst(residual: torch.Tensor) -> float:
    return float(residual.abs().max())


def _embeddings(n_tokens: int, vocab_size: int, dim: int, parameters: LMLikeParameters,
                generator: torch.Generator, device: Union[str, torch.device]
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Float32 ``(e, c)`` of the model in the module docstring."""
    if dim < 2:
        raise ValueError(f"dim must be >= 2 (a frequency direction and the rest), got {dim}")
    # Built in frequency-rank order (row r of `directions` is rank r + 1's): id_shuffle only
    # permutes c's rows at the end, and every draw is the same whatever its value.
    u = torch.randn(dim, generator=generator, device=device)
    u /= u.norm()
    directions = torch.randn(vocab_size, dim, generator=generator, device=device)
    # addr_ rather than broadcasting: 10x faster on CPU at this size, where calibrate runs.
    directions.addr_(directions @ u, u, alpha=-1)
    directions /= directions.norm(dim=1, keepdim=True)

    rank = torch.arange(1, vocab_size + 1, device=device).float()
    noise = torch.randn(vocab_size, generator=generator, device=device)
    token_of_rank = torch.argsort(rank.log() + parameters.id_shuffle * noise)
    candidates = _draw(rank.pow(-parameters.candidate_exponent),
                       (n_tokens, parameters.candidates), generator)
    strength = torch.rand(n_tokens, parameters.candidates, generator=generator, device=device)
    scale = math.sqrt(parameters.candidate_boost)
    e = parameters.zipf_exponent * u.expand(n_tokens, dim).clone()
    for j in range(parameters.candidates):  # one (N, D) gather at a time, not (N, k, D)
        e += scale * strength[:, j, None] * directions[candidates[:, j]]

    log_freq = -torch.log(rank + parameters.zipf_offset)
    directions.mul_(scale).addr_(log_freq, u)  # in place: c's rows, in rank order
    c = torch.empty_like(directions)
    c[token_of_rank] = directions
    return e, c


def _draw(weights: torch.Tensor, shape: tuple[int, ...],
          generator: torch.Generator) -> torch.Tensor:
    """Indices drawn with replacement with probability proportional to ``weights`` (1-D), by
    inverting the cumulative distribution, which is summed on the CPU: the same draws on every
    call for one generator state (torch.multinomial on a GPU can differ)."""
    cumulative = torch.cumsum(weights.double().cpu(), dim=0)
    cumulative = (cumulative / cumulative[-1]).to(weights.device)
    uniform = torch.rand(shape, generator=generator, device=weights.device, dtype=torch.float64)
    return torch.searchsorted(cumulative, uniform).clamp_(max=len(weights) - 1)


def _sample_targets(e: torch.Tensor, c: torch.Tensor, generator: torch.Generator,
                    chunk_bytes: int = 2**30) -> torch.Tensor:
    """One token per row drawn from softmax(e @ c.T), ``chunk_bytes`` of logits at a time."""
    chunk_rows = max(1, chunk_bytes // (4 * c.shape[0]))
    c32 = c.float()
    # Gumbel-max: the argmax of log-probabilities plus Gumbel noise is a sample of the softmax.
    # Unlike torch.multinomial on a GPU, which can draw differently from the same generator
    # state, it gives the same targets on every call.
    samples = []
    for e_chunk in e.split(chunk_rows):
        logits = e_chunk.float() @ c32.T
        uniform = torch.rand(logits.shape, generator=generator, device=logits.device)
        samples.append(torch.argmax(logits - torch.log(-torch.log(uniform)), dim=1))
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
    parser.add_argument("--max-evaluations", type=int, default=30,
                        help="generator runs at most (about 30 s each at the default size, "
                             "one CPU thread)")
    args = parser.parse_args(argv)
    start_s = time.perf_counter()
    parameters, statistics = calibrate(n_tokens=args.tokens, vocab_size=args.vocab,
                                       dim=args.dim, device=args.device,
                                       max_evaluations=args.max_evaluations)
    print(f"{parameters}\n{statistics}\n({time.perf_counter() - start_s:.0f} s)")


if __name__ == "__main__":
    main()
