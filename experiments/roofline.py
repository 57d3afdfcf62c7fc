"""Roofline of cce's kernels: each step's time, its throughput and its ratio to cuBLAS on the
same amount of work, at the benchmark's shapes (``python -m experiments.roofline``).

One forward+backward call (bf16; the default options, or those of ``--option KEY=VALUE``) is
traced step by step with CUDA events recorded around each of cce's launchers, so the steps add
up to the call. A step's time in the call also counts the GPU waiting for the host to queue its
kernels; each step is therefore timed a second time with the GPU held busy
(``torch.cuda._sleep``) until the host has queued all of the step's kernels, which then run back
to back: its kernel time, from which the throughputs below are computed. cuBLAS and the copy are
timed the same way: after idling, the GPU runs the next kernels several percent slower. Work:

- matrix steps (the forward's log-sum-exp, the backward's recomputes and products) in FLOPs:
  ``2 * 128 * 128 * D`` per live-grid tile they touch. Their "cuBLAS" column is the time
  cuBLAS takes for the same number of FLOPs, at the rate it reaches on the matching dense
  product of the same shape (logits ``E C^T``, ``dE = G C`` and ``dC = G^T E``);
- the other steps by the bytes they must move, against a device-to-device copy's bandwidth.

Per shape it also gives forward and forward+backward in units of one ``E C^T`` GEMM, next to
the ideals for the fraction ``f`` of tiles recomputed: ``1 + 4f`` (each live tile recomputed
twice, today's structure) and ``1 + 3f`` (once).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import inspect
import statistics
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Union

import torch

import cce
import cce.backward.run
import cce.cce_function
from cce.backward.gradient_tiles import TileStore
from cce.backward.sparse_tile_matmul import Product
from cce.config import kernel_configs
from experiments.harness import (ON_GPU, WrittenResults, add_sections, loss_option, progress,
                                 write_results)
from experiments.synthetic import lm_like_inputs

# (name, description, N, V, D): the benchmark's synthetic shapes (its small batch included).
SHAPES = (
    ("gemma3", "Gemma 3 270M shape", 8192, 262144, 640),
    ("gemma2_2b", "Gemma 2 2B shape", 8192, 256000, 2304),
    ("llama3_8b", "Llama 3 8B shape", 8192, 128256, 4096),
    ("llama3_8b_n1024", "Llama 3 8B shape, N = 1024", 1024, 128256, 4096),
    ("phi3_5_mini", "Phi 3.5 mini shape", 8192, 32064, 3072),
)
QUICK_SHAPES = (("quick", "tiny (CPU smoke test)", 96, 1000, 72),)

# The backward's steps, named from each launch of its loop.
RECOMPUTE_BY_ROWS = "recompute by grid rows (pass 1)"
RECOMPUTE_BY_LISTS = "recompute by lists (pass 2 or one pass)"
PRODUCT_DE = "product dE = G C"
PRODUCT_DC = "product dC = G^T E"

# The steps traced, in the table's order: (step name, kind of work).
STEPS = (
    ("vocabulary order", "bytes"),
    ("target logits (indexed dot)", "bytes"),
    ("log-sum-exp forward", "logits"),
    ("table of tiles to recompute", "bytes"),
    (RECOMPUTE_BY_ROWS, "recompute"),
    (PRODUCT_DE, "dE"),
    (RECOMPUTE_BY_LISTS, "listed"),
    (PRODUCT_DC, "dC"),
)


def _recompute_step(store: TileStore) -> str:
    return RECOMPUTE_BY_ROWS if store.tile_lists is None else RECOMPUTE_BY_LISTS


def _product_step(product: Product) -> str:
    return PRODUCT_DC if product.transposed else PRODUCT_DE


# The launchers traced: (module, attribute, the step every call is), or, for the backward's
# two launchers, (module, attribute, (the argument holding the launch, its step's name)).
LAUNCHERS = (
    (cce.cce_function, "sort_vocabulary", "vocabulary order"),
    (cce.cce_function, "indexed_dot", "target logits (indexed dot)"),
    (cce.cce_function, "lse_forward", "log-sum-exp forward"),
    (cce.cce_function, "recompute_table", "table of tiles to recompute"),
    (cce.backward.run, "store_gradient_tiles", ("store", _recompute_step)),
    (cce.backward.run, "multiply", ("product", _product_step)),
)


def _listed_counts(launch: Union[TileStore, Product]) -> torch.Tensor:
    """The tiles per block that a recompute by lists or a product lists."""
    return launch.tile_lists.counts if isinstance(launch, TileStore) else launch.counts


# About 2.5 ms of GPU spinning at an H100's clock: longer than any launcher takes to queue its
# kernels, so that they run back to back.
QUEUE_AHEAD_CYCLES = 5_000_000


class StepTimer:
    """CUDA events around every call of the traced launchers; nothing is synchronized until
    :meth:`elapsed_ms` reads them. ``queue_ahead``: the GPU spins before each step's first
    event, while the host queues the step's kernels, so that the events time the kernels alone."""

    def __init__(self, queue_ahead: bool = False) -> None:
        self.queue_ahead = queue_ahead
        self.events: list[tuple[str, torch.cuda.Event, torch.cuda.Event]] = []
        self.arguments: dict[str, list[inspect.BoundArguments]] = defaultdict(list)
        self.results: dict[str, list[Any]] = defaultdict(list)

    def wrap(self, step: Union[str, "tuple[str, Callable[[Any], str]]"],
             launcher: Callable[..., Any]) -> Callable[..., Any]:
        """``launcher`` timed as ``step``, or as the step that ``(argument, name_of)`` names from
        the call's argument of that name."""
        signature = inspect.signature(launcher)

        @functools.wraps(launcher)
        def traced(*args: Any, **kwargs: Any) -> Any:
            bound = signature.bind(*args, **kwargs)
            name = step if isinstance(step, str) else step[1](bound.arguments[step[0]])
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            if self.queue_ahead:
                torch.cuda._sleep(QUEUE_AHEAD_CYCLES)
            start.record()
            result = launcher(*args, **kwargs)
            end.record()
            self.events.append((name, start, end))
            self.arguments[name].append(bound)
            self.results[name].append(result)
            return result

        return traced

    def elapsed_ms(self) -> dict[str, float]:
        torch.cuda.synchronize()
        totals: dict[str, float] = defaultdict(float)
        for step, start, end in self.events:
            totals[step] += start.elapsed_time(end)
        return dict(totals)


@contextlib.contextmanager
def traced_steps(timer: StepTimer) -> Iterator[None]:
    originals = [(module, attribute, getattr(module, attribute))
                 for module, attribute, _ in LAUNCHERS]
    try:
        for (module, attribute, original), (_, _, step) in zip(originals, LAUNCHERS):
            setattr(module, attribute, timer.wrap(step, original))
        yield
    finally:
        for module, attribute, original in originals:
            setattr(module, attribute, original)


def median_ms(fn: Callable[[], Any], warmup: int, repeats: int,
              queue_ahead: bool = False) -> float:
    """Median of ``repeats`` calls; ``queue_ahead``: each with the GPU spinning until it is
    queued, as the steps' kernel times are (a GPU that has idled runs the next kernels slower)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        if queue_ahead:
            torch.cuda._sleep(QUEUE_AHEAD_CYCLES)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def copy_bandwidth_gbs(warmup: int, repeats: int) -> float:
    """Bytes read plus bytes written per second by a 2 GiB device-to-device copy."""
    source = torch.randn(2**29, device="cuda")
    target = torch.empty_like(source)
    ms = median_ms(lambda: target.copy_(source), warmup, repeats, queue_ahead=True)
    return 2 * source.numel() * source.element_size() / ms / 1e6


def cublas_tflops(n: int, v: int, d: int, warmup: int, repeats: int) -> dict[str, float]:
    """cuBLAS's rate on the three dense products of the shape, bf16 operands, timed as the
    steps' kernels are."""
    generator = torch.Generator(device="cuda").manual_seed(0)
    e = torch.randn(n, d, device="cuda", dtype=torch.bfloat16, generator=generator)
    c = torch.randn(v, d, device="cuda", dtype=torch.bfloat16, generator=generator)
    g = torch.randn(n, v, device="cuda", dtype=torch.bfloat16, generator=generator)
    flops = 2 * n * v * d
    rates = {
        # Whole calls (forward, forward + backward) start from an idle GPU, like this one.
        "logits, idle start": flops / median_ms(lambda: e @ c.T, warmup, repeats) / 1e9,
        "logits": flops / median_ms(lambda: e @ c.T, warmup, repeats, queue_ahead=True) / 1e9,
        "dE": flops / median_ms(lambda: g @ c, warmup, repeats, queue_ahead=True) / 1e9,
        "dC": flops / median_ms(lambda: g.T @ e, warmup, repeats, queue_ahead=True) / 1e9,
    }
    return rates


def measure_shape(name: str, description: str, n: int, v: int, d: int, warmup: int,
                  repeats: int, bandwidth_gbs: float, options: dict[str, Any]
                  ) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    rates = cublas_tflops(n, v, d, warmup, repeats)
    torch.cuda.empty_cache()  # cuBLAS's operands, freed on return
    gemm_ms = 2 * n * v * d / rates["logits, idle start"] / 1e9
    e, c, targets = lm_like_inputs(n, v, d, seed=1, device="cuda")

    def forward_backward() -> None:
        e.grad = c.grad = None
        cce.linear_cross_entropy(e, c, targets, **options).backward()

    def forward() -> None:
        with torch.no_grad():
            cce.linear_cross_entropy(e, c, targets, **options)

    total_ms = median_ms(forward_backward, warmup, repeats)
    forward_ms = median_ms(forward, warmup, repeats)

    def step_medians(queue_ahead: bool) -> tuple[dict[str, float], float, StepTimer]:
        """Each step's median, the median of the traced call as a whole, and the last timer."""
        step_ms: dict[str, list[float]] = defaultdict(list)
        call_ms = []
        for _ in range(warmup + repeats):
            timer = StepTimer(queue_ahead)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            with traced_steps(timer):
                forward_backward()
            end.record()
            for step, ms in timer.elapsed_ms().items():
                step_ms[step].append(ms)
            call_ms.append(start.elapsed_time(end))
        return ({step: statistics.median(times[warmup:]) for step, times in step_ms.items()},
                statistics.median(call_ms[warmup:]), timer)

    # Tracing costs host time of its own, so the steps are shares of the traced call, not of
    # the untraced total_ms that the GEMM units use.
    medians, traced_total_ms, timer = step_medians(queue_ahead=False)
    kernel_medians, _, _ = step_medians(queue_ahead=True)

    grid = kernel_configs(e.dtype).live_grid
    tile_flops = 2 * grid.block_tokens * grid.block_vocab * d
    all_tiles = -(-n // grid.block_tokens) * -(-v // grid.block_vocab)
    # Tiles each step worked on, whichever backward ran (two passes or one).
    table = timer.results["table of tiles to recompute"]
    live = int((table[0] != 0).sum()) if table and table[0] is not None else all_tiles

    def listed(step: str, argument: str) -> int:
        """The tiles the step's calls list (a product's lists count what it multiplies)."""
        return sum(int(_listed_counts(call.arguments[argument]).sum())
                   for call in timer.arguments[step])

    tiles = {"logits": all_tiles, "recompute": live, "dE": listed(PRODUCT_DE, "product"),
             "listed": listed(RECOMPUTE_BY_LISTS, "store"), "dC": listed(PRODUCT_DC, "product")}
    element = e.element_size()
    moved_bytes = {
        "vocabulary order": (v * d + n * d) * element + v * 8,
        "target logits (indexed dot)": 2 * n * d * element,
        "table of tiles to recompute": all_tiles * 8,
    }
    reference_rate = {"logits": "logits", "recompute": "logits", "listed": "logits",
                      "dE": "dE", "dC": "dC"}

    rows = []
    for step, work in STEPS:
        ms = medians.get(step)
        if ms is None:
            continue
        kernel_ms = kernel_medians[step]
        row: dict[str, Any] = {"shape": description, "step": step, "ms": ms,
                               "share of fwd+bwd": ms / traced_total_ms, "kernel ms": kernel_ms}
        if work == "bytes":
            row["GB/s"] = moved_bytes[step] / kernel_ms / 1e6
            row["of copy bandwidth"] = row["GB/s"] / bandwidth_gbs
        else:
            flops = tiles[work] * tile_flops
            row["tiles"] = tiles[work]
            row["TFLOP/s"] = flops / kernel_ms / 1e9
            row["cuBLAS ms, same work"] = flops / rates[reference_rate[work]] / 1e9
            row["of cuBLAS"] = row["TFLOP/s"] / rates[reference_rate[work]]
        rows.append(row)
    # A difference of medians: it can come out slightly negative where nothing else runs.
    rest_ms = traced_total_ms - sum(medians.values())
    rows.append({"shape": description, "step": "everything else (PyTorch ops, gaps)",
                 "ms": rest_ms, "share of fwd+bwd": rest_ms / traced_total_ms})

    f = live / all_tiles
    summary = {
        "shape": description, "N": n, "V": v, "D": d, "GEMM ms": gemm_ms,
        "cuBLAS TFLOP/s (logits, dE, dC)": [rates["logits"], rates["dE"], rates["dC"]],
        "forward ms": forward_ms, "forward GEMMs": forward_ms / gemm_ms,
        "fwd+bwd ms": total_ms, "fwd+bwd GEMMs": total_ms / gemm_ms,
        "traced fwd+bwd ms": traced_total_ms,
        "live fraction f": f, "multiplied fraction": tiles["dC"] / all_tiles,
        "ideal 1+4f": 1 + 4 * f, "ideal 1+3f": 1 + 3 * f,
    }
    return rows, summary


def run(quick: bool, out_dir: Path, repeats: Optional[int] = None,
        shape_names: Optional[list[str]] = None,
        options: Optional[dict[str, Any]] = None) -> WrittenResults:
    """``shape_names``: a subset of SHAPES' names (None: all); ``options``: keywords of every
    call (None: the defaults), which name the results ``roofline_<key>-<value>...``."""
    options = options or {}
    if not ON_GPU:
        raise SystemExit("experiments.roofline needs a CUDA device (it times GPU kernels)")
    shapes = QUICK_SHAPES if quick else SHAPES
    if shape_names:
        shapes = tuple(s for s in shapes if s[0] in shape_names)
    repeats = repeats or 10
    warmup = 3
    bandwidth = copy_bandwidth_gbs(warmup, repeats)
    rows, summaries = [], []
    for name, description, n, v, d in progress(shapes, "roofline"):
        shape_rows, summary = measure_shape(name, description, n, v, d, warmup, repeats,
                                            bandwidth, options)
        torch.cuda.empty_cache()  # the shape's inputs, freed on return
        rows += shape_rows
        summaries.append(summary)
    shown_options = ", ".join(f"{key}={value!r}" for key, value in options.items())
    meta = {"dtype": "bfloat16",
            "options": shown_options or "defaults (filter 2^-12, sorting, correction)",
            "inputs": "experiments.synthetic.lm_like_inputs (seed 1)",
            "copy bandwidth GB/s (read + write)": bandwidth,
            "timing": (f"CUDA events, median of {repeats} after {warmup} warm-up calls; ms: the "
                       "step within the call, host waits included; kernel ms: the same step "
                       "with its kernels queued ahead of the GPU, which the throughputs use; "
                       "cuBLAS and the copy are timed queued ahead too; steps and shares are "
                       "of the traced call, whose tracing adds host time; GEMM units below are "
                       "of untraced calls")}
    stem = "_".join(["roofline"] + [f"{key}-{value}" for key, value in options.items()])
    written = write_results(stem, rows, meta, out_dir, group_by="shape")
    lines = ["## Forward and forward+backward in GEMM units", "",
             "| shape | GEMM ms | forward | fwd+bwd | f | ideal 1+4f | ideal 1+3f |",
             "|---|---|---|---|---|---|---|"]
    for s in summaries:
        lines.append(f"| {s['shape']} | {s['GEMM ms']:.2f} | {s['forward ms']:.2f} ms = "
                     f"{s['forward GEMMs']:.2f} | {s['fwd+bwd ms']:.2f} ms = "
                     f"{s['fwd+bwd GEMMs']:.2f} | {s['live fraction f']:.3f} | "
                     f"{s['ideal 1+4f']:.2f} | {s['ideal 1+3f']:.2f} |")
    return add_sections(written, {"summary": summaries}, lines)


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m experiments.roofline", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="one tiny shape")
    parser.add_argument("--out", type=Path, default=Path("results"))
    parser.add_argument("--repeats", type=int, default=10)
    names = [s[0] for s in SHAPES]
    parser.add_argument("--shapes", nargs="+", choices=names, metavar="SHAPE",
                        help="a subset of the shapes (default: all): " + ", ".join(names))
    parser.add_argument("--option", type=loss_option, action="append", default=[],
                        metavar="KEY=VALUE", help="a loss option of every call (memory=fast, "
                        "keep_tiles=True, ...)")
    args = parser.parse_args(argv)
    if args.quick and args.shapes:
        parser.error("--shapes picks among the full shapes; --quick has one tiny shape")
    written = run(args.quick, args.out, args.repeats, args.shapes, dict(args.option))
    print(written.markdown)


if __name__ == "__main__":
    sys.exit(main())
