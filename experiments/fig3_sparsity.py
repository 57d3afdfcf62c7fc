"""fig3_sparsity: how sparse a real model's softmax is, and what gradient filtering and
vocabulary sorting make of it (paper Sections 4.3 and 5.2, Fig. 3).

Inputs: Gemma 3 270M's classifier inputs on the first Alpaca examples (``experiments.real_model``),
rounded to bfloat16, the dtype whose precision sets the filter threshold eps = 2^-12. Only rows
with a target count (the last position of each sequence predicts nothing). Probabilities are
``exp(logit - LSE)`` in float32, from float32 logits of the bfloat16 inputs (as cce's kernels
compute them), ``ROW_CHUNK`` rows at a time: the full N x 262144 matrix is never built.

Measured:

1. Fig. 3: the average probability of the i-th most likely token against i, and the rank where
   it falls below eps.
2. The fraction of softmax entries >= eps, and their number per row.
3. The fraction of live tiles (tiles holding an entry >= eps, which the backward must compute)
   for square tiles of 16 to 256 tokens x as many vocabulary entries, in the natural vocabulary
   order and sorted by average logit (``cce.forward.vocab_order.vocab_order``). Square tiles: the
   paper's Alg. 3 tiles both dimensions, and 128 x 128 is exactly the live-tile grid of cce's
   backward for 16-bit inputs on GPU (``cce.config``); the sweep shows how quickly sparsity is lost
   as tiles grow. At 128 x 128 also cce's own table (``cce.backward.live_tiles.live_tiles``: the
   forward's per-row bound on each tile's largest probability, plus every tile holding a target).
4. All of it for the prompt and the response tokens apart (the row's target is a prompt or a
   response token), each group's rows taken consecutively, as if only they were in the batch;
   and the response rows in place among ignored prompt rows, as prompt-masked training has them.

Quick mode (CPU): 4,096 tokens, a few minutes with the model load. Full mode: 16,384 tokens.
The numbers do not depend on the device, only on the token count (in the results' meta).
"""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from cce.backward.live_tiles import live_tiles
from cce.forward.vocab_order import target_positions, vocab_order
from experiments.alpaca_data import IGNORE_INDEX, add_data_argument
from experiments import harness
from experiments.harness import DEVICE, WrittenResults, device_name, write_results
from experiments.real_model import AlpacaBatch, alpaca_batch, load_model

NAME = "fig3_sparsity"
EPS = 2.0**-12  # cce's filter_eps for bfloat16: finfo(bfloat16).eps / 32
BLOCK = 16  # vocabulary granularity of the stored per-row maxima: the smallest tile width
TILE_SIZES = (16, 32, 64, 128, 256)
CCE_TILE = 128  # cce.config's live_grid for 16-bit inputs on GPU: 128 tokens x 128 vocabulary
CCE_FORWARD_TILE_VOCAB = 256  # its forward tiles (128 x 256): two live-grid tiles each
ROW_CHUNK = 256  # rows of float32 logits at a time: 256 x 262144 x 4 B = 256 MiB
QUICK_TOKENS = 4096
FULL_TOKENS = 16384
ORDERS = ("natural", "sorted")
GROUPS = ("all", "prompt", "response")


@dataclass(frozen=True)
class SoftmaxSparsity:
    """What one pass over the softmax rows leaves: enough for every count, tile and curve.

    Every tensor is on the CPU. ``block_max[order][i, j]`` is the largest logit of row ``i`` in
    the ``j``-th run of ``BLOCK`` vocabulary entries taken in that order (the last run padded
    with -inf): a tile holds an entry >= eps exactly when one of its rows has
    ``exp(block_max - lse) >= eps`` in one of its blocks. ``block_lse`` is the log-sum-exp of
    the same runs (what the forward's running LSE adds up).
    """

    eps: float
    vocab_size: int
    lse: torch.Tensor  # (N,) float32
    counts: torch.Tensor  # (N,) int64: softmax entries >= eps per row
    kept_mass: torch.Tensor  # (N,) float32: sum of the row's entries >= eps
    block_max: dict[str, torch.Tensor]  # order -> (N, ceil(V / BLOCK)) float32
    block_lse: dict[str, torch.Tensor]  # order -> (N, ceil(V / BLOCK)) float32
    target_logit: torch.Tensor  # (N,) float32, -inf where ignored
    sorted_probability_sum: dict[str, torch.Tensor]  # group -> (V,) float64, decreasing rank
    groups: dict[str, torch.Tensor]  # name -> (N,) bool
    targets: torch.Tensor  # (N,) int64, -100 where ignored
    order: torch.Tensor  # (V,) int32: the "sorted" vocabulary order

    def rows(self, group: str) -> int:
        return int(self.groups[group].sum())

    def mean_sorted_probability(self, group: str = "all") -> torch.Tensor:
        """Fig. 3's curve: average probability of the i-th most likely token, i = 1..V."""
        return self.sorted_probability_sum[group] / max(self.rows(group), 1)

    def crossing_rank(self, group: str = "all") -> int:
        """The first rank whose average probability is below eps (the curve decreases)."""
        return int((self.mean_sorted_probability(group) >= self.eps).sum()) + 1

    def entry_fraction(self, group: str = "all") -> float:
        """Fraction of the group's softmax entries that are >= eps."""
        return float(self.counts[self.groups[group]].sum()) / (self.rows(group) * self.vocab_size)

    def dropped_mass(self, group: str = "all") -> float:
        """Average probability mass per row in entries below eps: what filtering ignores."""
        return 1 - float(self.kept_mass[self.groups[group]].double().mean())

    def live_tile_grid(self, tile: int, order: str, group: str = "all",
                       compact: bool = True) -> torch.Tensor:
        """(token tiles, vocabulary tiles) bool: the ``tile`` x ``tile`` tiles holding a softmax
        entry >= eps of a row of ``group``.

        ``compact``: the group's rows are tiled consecutively, as if they were the whole batch.
        Otherwise every row stays in place and the rows outside the group have no gradient, as
        the prompt rows of prompt-masked training (targets -100).
        """
        rows, member = self._tiled_rows(group, compact)
        probability_max = (torch.exp(self.block_max[order][rows] - self.lse[rows, None])
                           * member[:, None])
        return _tile_max(probability_max, tile, _blocks_per_tile(tile)).ge(self.eps)

    def live_tile_fraction(self, tile: int, order: str, group: str = "all",
                           compact: bool = True) -> float:
        """Fraction of ``tile`` x ``tile`` tiles holding a softmax entry >= eps (exact)."""
        return float(self.live_tile_grid(tile, order, group, compact).float().mean())

    def cce_live_grid(self, order: str, group: str = "all", tile: int = CCE_TILE,
                      compact: bool = True,
                      forward_tile_vocab: int = CCE_FORWARD_TILE_VOCAB) -> torch.Tensor:
        """The tiles that cce's backward computes: its live-tile table
        (``cce.backward.live_tiles.live_tiles``), built as cce builds it for a loss over the group's
        rows. Its bound on the probabilities of a tile is the largest, over the tile's rows, of
        exp(the row's largest logit in the tile - a lower bound of its LSE): the larger of its
        target's logit and the log-sum-exp of its logits up to the end of the forward tile
        (``tile`` x ``forward_tile_vocab``) that holds the tile, as one forward program per token
        block would have them (on a GPU several programs share a block's vocabulary and each also
        reads what the others have merged: a bound of about the same tightness). It keeps every
        tile with an entry >= eps live, and more; tiles holding a target are live too. Rows
        outside the group (``compact=False``) are ignored tokens: cce leaves them out of the
        bounds."""
        rows, member = self._tiled_rows(group, compact)
        in_group = member.bool()
        per_tile, per_forward_tile = _blocks_per_tile(tile), _blocks_per_tile(forward_tile_vocab)
        block_max, block_lse = self.block_max[order][rows], self.block_lse[order][rows]
        row_max = _tile_max(block_max, 1, per_tile)
        blocks = block_lse.shape[1]
        tile_starts = torch.arange(row_max.shape[1]) * per_tile
        forward_ends = (tile_starts // per_forward_tile + 1) * per_forward_tile - 1
        lse_so_far = torch.logcumsumexp(block_lse, dim=1)[:, forward_ends.clamp(max=blocks - 1)]
        lse_lower = torch.maximum(lse_so_far, self.target_logit[rows][:, None])
        row_bound = (row_max - lse_lower).masked_fill(~in_group[:, None], -math.inf)
        tile_bound = _tile_max(row_bound, tile, 1)
        targets = torch.where(in_group, self.targets[rows], IGNORE_INDEX)
        positions = target_positions(targets, self.order if order == "sorted" else None)
        # cce's own table kernel, on the GPU when there is one (it runs on CPU only when Triton
        # interprets); the statistics stay on the CPU.
        table = live_tiles(*(x.to(DEVICE) for x in (tile_bound, self.lse[rows], member,
                                                     positions)), tile, tile, self.eps)
        return table.ne(0).cpu()

    def cce_live_fraction(self, order: str, group: str = "all", tile: int = CCE_TILE,
                          compact: bool = True) -> float:
        """Fraction of the tiles of :meth:`cce_live_grid` that are live."""
        return float(self.cce_live_grid(order, group, tile, compact).float().mean())

    def _tiled_rows(self, group: str, compact: bool
                    ) -> tuple[torch.Tensor | slice, torch.Tensor]:
        """(which rows to tile, as an index; 1.0 for the group's rows among them, else 0.0): the
        group's rows alone when ``compact`` (a boolean mask), else every row (a slice, so that
        the per-row tables are views, not copies)."""
        if compact:
            rows = self.groups[group]
            return rows, torch.ones(int(rows.sum()))
        return slice(None), self.groups[group].float()

    def live_rows_by_block(self, order: str, group: str = "all") -> torch.Tensor:
        """(ceil(V / BLOCK),) fraction of the group's rows with an entry >= eps in each block."""
        rows = self.groups[group]
        probability_max = torch.exp(self.block_max[order][rows] - self.lse[rows, None])
        return probability_max.ge(self.eps).float().mean(dim=0)


def analyze(e: torch.Tensor, c: torch.Tensor, targets: torch.Tensor,
            groups: dict[str, torch.Tensor] | None = None, eps: float = EPS,
            row_chunk: int = ROW_CHUNK) -> SoftmaxSparsity:
    """One chunked pass over ``softmax(e @ c.T)`` in float32; every row of ``e`` counts.

    ``targets`` (-100 = ignored) give the sorted vocabulary order, as cce computes it, and the
    target tiles of cce's table. ``groups`` are named boolean row masks; "all" is added.
    """
    num_rows, vocab_size = e.shape[0], c.shape[0]
    groups = {"all": torch.ones(num_rows, dtype=torch.bool), **(groups or {})}
    groups = {name: mask.cpu() for name, mask in groups.items()}
    order = vocab_order(e, c, None, targets)
    c32 = c.float()
    lse, counts, kept_mass = [], [], []
    block_max: dict[str, list[torch.Tensor]] = {name: [] for name in ORDERS}
    block_lse: dict[str, list[torch.Tensor]] = {name: [] for name in ORDERS}
    target_logit = []
    curve_sum = {name: torch.zeros(vocab_size, dtype=torch.float64) for name in groups}
    with torch.no_grad():
        for start in range(0, num_rows, row_chunk):
            logits = e[start:start + row_chunk].float() @ c32.T
            row_lse = torch.logsumexp(logits, dim=1)
            for name, ordered in (("natural", logits), ("sorted", logits[:, order.long()])):
                block_max[name].append(_block_max(ordered).cpu())
                block_lse[name].append(_block_lse(ordered).cpu())
            chunk_targets = targets[start:start + row_chunk].to(logits.device)
            target_logit.append(torch.where(
                chunk_targets >= 0, logits.gather(1, chunk_targets.clamp(min=0)[:, None])[:, 0],
                -math.inf).cpu())
            # exp is monotone: sorting logits sorts probabilities, in the same float32 values.
            probabilities = torch.exp(_sort_ascending(logits) - row_lse[:, None])
            del logits  # one fewer (chunk, V) float32 buffer alive at a time
            kept = probabilities.ge(eps)
            counts.append(kept.sum(dim=1).cpu())
            kept_mass.append(torch.where(kept, probabilities, 0.0).sum(dim=1).cpu())
            lse.append(row_lse.cpu())
            for name, mask in groups.items():
                chunk_mask = mask[start:start + row_chunk].to(probabilities.device)
                curve_sum[name] += probabilities[chunk_mask].sum(dim=0).double().cpu().flip(0)
    return SoftmaxSparsity(eps=eps, vocab_size=vocab_size, lse=torch.cat(lse),
                           counts=torch.cat(counts), kept_mass=torch.cat(kept_mass),
                           block_max={name: torch.cat(parts) for name, parts in block_max.items()},
                           block_lse={name: torch.cat(parts) for name, parts in block_lse.items()},
                           target_logit=torch.cat(target_logit),
                           sorted_probability_sum=curve_sum, groups=groups,
                           targets=targets.cpu().long(), order=order.cpu())


def average_logit(e: torch.Tensor, c: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """(V,) float32 average logit over the rows with a target: what vocabulary sorting sorts."""
    valid = targets >= 0
    return c.float() @ e[valid].float().mean(dim=0)


def load_inputs(num_tokens: int, *, data_path: Path | None = None, model: Any = None,
                tokenizer: Any = None) -> AlpacaBatch:
    """Gemma 3 270M's classifier inputs for ``num_tokens`` Alpaca tokens, in bfloat16.

    The model runs in float32 (transformers computes a GGUF model in float32 and, asked for
    bfloat16, casts around every matmul); e and c are then rounded to bfloat16, the dtype of
    the training that the threshold is for.
    """
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if model is None or tokenizer is None:
        model, tokenizer = load_model(device, torch.float32)
    return alpaca_batch(num_tokens, device=device, dtype=torch.bfloat16, data_path=data_path,
                        model=model, tokenizer=tokenizer)


def analyze_batch(batch: AlpacaBatch) -> SoftmaxSparsity:
    """:func:`analyze` on the rows with a target, split into prompt and response rows."""
    valid = batch.targets >= 0
    response = batch.response[valid]
    return analyze(batch.e[valid], batch.c, batch.targets[valid],
                   groups={"prompt": ~response, "response": response})


def summary(sparsity: SoftmaxSparsity, group: str = "all") -> dict[str, Any]:
    """The headline numbers of one group: entries >= eps, crossing rank, cce's 128 x 128 table."""
    counts = sparsity.counts[sparsity.groups[group]].double()
    return {
        "rows": sparsity.rows(group),
        "entries_ge_eps_pct": 100 * sparsity.entry_fraction(group),
        "mean_per_row": float(counts.mean()),
        "median_per_row": float(counts.median()),
        "max_per_row": int(counts.max()),
        "dropped_mass_pct": 100 * sparsity.dropped_mass(group),
        "crossing_rank": sparsity.crossing_rank(group),
        **{f"live_{CCE_TILE}_{order}_pct": 100 * sparsity.live_tile_fraction(CCE_TILE, order, group)
           for order in ORDERS},
        **{f"cce_table_{order}_pct": 100 * sparsity.cce_live_fraction(order, group)
           for order in ORDERS},
    }


def run(quick: bool, out_dir: Path, data_path: Path | None = None,
        num_tokens: int | None = None) -> WrittenResults:
    """The registered entry point: 4,096 tokens in quick mode, 16,384 otherwise."""
    num_tokens = num_tokens or (QUICK_TOKENS if quick else FULL_TOKENS)
    batch = load_inputs(num_tokens, data_path=data_path)
    sparsity = analyze_batch(batch)

    rows = []
    for group in GROUPS:
        for tile in TILE_SIZES:
            natural = 100 * sparsity.live_tile_fraction(tile, "natural", group)
            sorted_ = 100 * sparsity.live_tile_fraction(tile, "sorted", group)
            rows.append({"tokens": group, "rows": sparsity.rows(group), "tile": f"{tile}x{tile}",
                         "live_natural_pct": round(natural, 3),
                         "live_sorted_pct": round(sorted_, 3),
                         "sorted_over_natural": round(sorted_ / natural, 3)})
    meta: dict[str, Any] = {
        "what": "softmax sparsity of Gemma 3 270M (Q4_K_M GGUF) on Alpaca; no timing",
        "tokens": f"{num_tokens} ({'quick' if quick else 'full'} mode): the first "
                  f"{batch.num_sequences} Alpaca examples, {sparsity.rows('all')} rows with a "
                  f"target ({sparsity.rows('prompt')} prompt, {sparsity.rows('response')} "
                  "response); the numbers depend on the token count, not on the device",
        "eps": "2^-12 (cce's filter_eps for bfloat16); e and c in bfloat16, probabilities in "
               "float32",
        "tiles": "square: tile tokens = tile vocabulary entries, consecutive rows of each group; "
                 "live = holds a softmax entry >= eps; sorted = vocabulary by decreasing average "
                 f"logit (cce.forward.vocab_order.vocab_order); {CCE_TILE}x{CCE_TILE} is cce's "
                 "live grid on GPU",
        **{f"{group} tokens": _describe(summary(sparsity, group)) for group in GROUPS},
        "prompt-masked batch": _describe_masked(sparsity),
        "figure": f"{NAME}.png",
    }
    written = write_results(NAME, rows, meta, out_dir, device_dependent=False)
    plot(sparsity, out_dir / f"{NAME}.png",
         title=f"Gemma 3 270M on Alpaca, {num_tokens} tokens (computed on {device_name()}; "
               "the numbers do not depend on the device)")
    return written


def plot(sparsity: SoftmaxSparsity, path: Path, title: str) -> None:
    """The three panels: Fig. 3, entries >= eps per row, live tiles against tile size."""
    import matplotlib

    matplotlib.use("Agg")  # no display: the figure only goes to a file
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, 3, figsize=(18, 5.5))
    plot_rank_curve(axes[0], sparsity)
    plot_counts(axes[1], sparsity)
    plot_tile_sweep(axes[2], sparsity)
    figure.suptitle(title, fontsize=13)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


GROUP_COLORS = {"all": "black", "prompt": "#1f77b4", "response": "#d62728"}
PERCENT_TICKS = (1, 2, 5, 10, 20, 50, 100)


def plot_rank_curve(axis: Any, sparsity: SoftmaxSparsity) -> None:
    """Fig. 3: average probability of the i-th most likely token, log-log, eps and crossing."""
    ranks = torch.arange(1, sparsity.vocab_size + 1)
    for group in GROUPS:
        curve = sparsity.mean_sorted_probability(group)
        crossing = sparsity.crossing_rank(group)
        axis.loglog(ranks, curve.clamp(min=1e-30), color=GROUP_COLORS[group],
                    label=f"{group} ({sparsity.rows(group)} tokens): below eps from rank "
                          f"{crossing}")
        axis.axvline(crossing, color=GROUP_COLORS[group], linestyle=":", linewidth=1)
    axis.axhline(sparsity.eps, color="gray", linestyle="--", label="eps = 2^-12")
    axis.set_xlabel("rank i of the token in its row's softmax")
    axis.set_ylabel("average probability of the i-th most likely token")
    axis.set_ylim(bottom=1e-12, top=1.5)
    axis.set_title("(a) Fig. 3: probabilities vanish below eps")
    axis.legend(fontsize=9, loc="lower left")  # a fixed place: "best" is slow on 262,144 points
    axis.grid(True, which="major", alpha=0.3)


def plot_counts(axis: Any, sparsity: SoftmaxSparsity) -> None:
    """Cumulative distribution of the number of softmax entries >= eps per row, by group."""
    for group in GROUPS:
        counts = sparsity.counts[sparsity.groups[group]].sort().values.double()
        share = torch.arange(1, len(counts) + 1) / len(counts)
        axis.step(counts.tolist(), share.tolist(), where="post", color=GROUP_COLORS[group],
                  label=f"{group}: mean {float(counts.mean()):.1f}, "
                        f"median {float(counts.median()):.0f}")
    axis.set_xscale("log")
    axis.set_xlabel("softmax entries >= 2^-12 in the row (of 262,144)")
    axis.set_ylabel("fraction of rows with at most that many")
    axis.set_title("(b) entries that survive gradient filtering, per row")
    axis.legend(fontsize=9, loc="upper left")
    axis.grid(True, which="major", alpha=0.3)


def plot_tile_sweep(axis: Any, sparsity: SoftmaxSparsity) -> None:
    """Live-tile fraction against tile size, natural and sorted vocabulary, by token group."""
    for group in GROUPS:
        for order, style in zip(ORDERS, ("-", "--")):
            fractions = [100 * sparsity.live_tile_fraction(tile, order, group)
                         for tile in TILE_SIZES]
            axis.plot(TILE_SIZES, fractions, style, marker="o", color=GROUP_COLORS[group],
                      label=f"{group}, {order} vocabulary")
    for order, marker in zip(ORDERS, ("x", "+")):
        axis.plot([CCE_TILE], [100 * sparsity.cce_live_fraction(order)], marker, color="gray",
                  markersize=10, linestyle="none",
                  label=f"all, {order}: cce's live table (bound + target tiles)")
    axis.axvline(CCE_TILE, color="gray", linestyle=":", label="cce's live grid (128 x 128)")
    axis.set_xscale("log", base=2)
    axis.set_yscale("log")
    axis.set_yticks(PERCENT_TICKS, [f"{tick:g}%" for tick in PERCENT_TICKS])
    axis.yaxis.set_minor_formatter(lambda value, _: "")
    axis.set_xticks(TILE_SIZES, [f"{tile}" for tile in TILE_SIZES])
    axis.set_xlabel("tile size (tokens = vocabulary entries)")
    axis.set_ylabel("tiles holding an entry >= eps")
    axis.set_title("(c) live tiles: what the backward must compute")
    axis.legend(fontsize=8, loc="lower right")
    axis.grid(True, which="both", alpha=0.3)


def _describe(numbers: dict[str, Any]) -> str:
    return (f"{numbers['rows']} rows; {numbers['entries_ge_eps_pct']:.4f}% of entries >= eps, "
            f"{numbers['mean_per_row']:.1f} per row (median {numbers['median_per_row']:.0f}, "
            f"max {numbers['max_per_row']}), leaving out {numbers['dropped_mass_pct']:.1f}% of "
            f"the probability mass; average probability below eps from rank "
            f"{numbers['crossing_rank']}; live {CCE_TILE}x{CCE_TILE} tiles "
            f"{numbers[f'live_{CCE_TILE}_natural_pct']:.2f}% natural, "
            f"{numbers[f'live_{CCE_TILE}_sorted_pct']:.2f}% sorted; cce's table "
            f"(bound + target tiles) {numbers['cce_table_natural_pct']:.2f}% natural, "
            f"{numbers['cce_table_sorted_pct']:.2f}% sorted")


def _describe_masked(sparsity: SoftmaxSparsity) -> str:
    """The response rows in place among ignored prompt rows, as prompt-masked training has them."""
    exact = {order: 100 * sparsity.live_tile_fraction(CCE_TILE, order, "response", compact=False)
             for order in ORDERS}
    table = {order: 100 * sparsity.cce_live_fraction(order, "response", compact=False)
             for order in ORDERS}
    return (f"response rows in place, prompt rows ignored (the vocabulary order is still the "
            f"whole batch's): live {CCE_TILE}x{CCE_TILE} tiles {exact['natural']:.2f}% natural, "
            f"{exact['sorted']:.2f}% sorted; cce's table {table['natural']:.2f}% natural, "
            f"{table['sorted']:.2f}% sorted")


def _blocks_per_tile(tile: int) -> int:
    if tile < BLOCK or tile % BLOCK:
        raise ValueError(f"tile sizes must be multiples of {BLOCK}, got {tile}")
    return tile // BLOCK


def _blocks(logits: torch.Tensor) -> torch.Tensor:
    """(rows, ceil(V / BLOCK), BLOCK) view of consecutive runs of BLOCK columns, padded with
    -inf (a copy only then: 256 MiB per chunk of 256 rows of 262,144)."""
    padding = (-logits.shape[1]) % BLOCK
    padded = torch.nn.functional.pad(logits, (0, padding), value=-math.inf) if padding else logits
    return padded.reshape(logits.shape[0], -1, BLOCK)


def _block_max(logits: torch.Tensor) -> torch.Tensor:
    """(rows, ceil(V / BLOCK)) maxima of consecutive runs of BLOCK columns."""
    return _blocks(logits).amax(dim=2)


def _block_lse(logits: torch.Tensor) -> torch.Tensor:
    """(rows, ceil(V / BLOCK)) log-sum-exp of consecutive runs of BLOCK columns."""
    return torch.logsumexp(_blocks(logits), dim=2)


def _tile_max(values: torch.Tensor, rows_per_tile: int, blocks_per_tile: int) -> torch.Tensor:
    """(ceil(rows / rows_per_tile), ceil(blocks / blocks_per_tile)) maxima, padded with -inf."""
    rows, blocks = values.shape
    padded = torch.nn.functional.pad(values, (0, (-blocks) % blocks_per_tile,
                                              0, (-rows) % rows_per_tile), value=-math.inf)
    tiles = padded.view(padded.shape[0] // rows_per_tile, rows_per_tile,
                        padded.shape[1] // blocks_per_tile, blocks_per_tile)
    return tiles.amax(dim=(1, 3))


def _sort_ascending(values: torch.Tensor) -> torch.Tensor:
    """Each row sorted in increasing order. On CPU through numpy, whose vectorized sort is ~20x
    faster than torch.sort there (2 s against 0.1 s for 64 rows of 262,144)."""
    if values.device.type != "cpu":
        return torch.sort(values, dim=1).values
    import numpy as np

    return torch.from_numpy(np.sort(values.numpy(), axis=1))


def main(argv: list[str] | None = None) -> int:
    def options(parser: argparse.ArgumentParser
                ) -> Callable[[argparse.Namespace], dict[str, Any]]:
        parser.add_argument("--tokens", type=int, help=f"token count, overriding --quick's "
                            f"{QUICK_TOKENS} and a full run's {FULL_TOKENS}")
        add_data_argument(parser)
        return lambda args: dict(data_path=args.data, num_tokens=args.tokens)

    return harness.main(NAME, run, __doc__.split("\n\n")[0], argv, options)


if __name__ == "__main__":
    sys.exit(main())
