"""Shared benchmark harness: environment, timing, peak memory, random inputs, result files.

Everything runs on :data:`DEVICE`, the GPU when there is one. On CPU the timings say nothing
about GPU performance (the Triton kernels run in the interpreter), and the result files say so.
"""

from __future__ import annotations

import argparse
import ast
import datetime
import importlib.metadata
import json
import math
import os
import platform
import statistics
import sys
import time
import traceback
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Collection, Iterable, NoReturn, Optional, TypeVar

import torch

from experiments import COMPUTED_ONLY

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
ON_GPU = DEVICE.type == "cuda"
REPOSITORY = Path(__file__).resolve().parents[1]
# Where results go without --out: the committed results of full GPU runs, or a folder that git
# ignores for --quick runs, so that a smoke test never overwrites the GPU results.
RESULTS_DIR = REPOSITORY / "results"
QUICK_RESULTS_DIR = REPOSITORY / "scratch" / "quick"
IGNORE_INDEX = -100
MISSING = "—"
GPU_WARMUP = 5  # time_fn's defaults on a GPU: warm-up calls, then timed calls (the median)
GPU_REPEATS = 20

T = TypeVar("T")


@dataclass(frozen=True)
class WrittenResults:
    """What :func:`write_results` wrote, and the rows that recorded an ``"error"``."""

    json_path: Path
    markdown_path: Path
    markdown: str
    errors: list[str]


def default_out_dir(quick: bool) -> Path:
    """:data:`QUICK_RESULTS_DIR` for a quick run, :data:`RESULTS_DIR` for a full one."""
    return QUICK_RESULTS_DIR if quick else RESULTS_DIR


def device_name() -> str:
    """The GPU's name, or "CPU": the device that computed the results, for figure titles."""
    return torch.cuda.get_device_name(DEVICE) if ON_GPU else "CPU"


def device_label(env: dict[str, Any]) -> str:
    """The device that timings come from, for figure titles, from the :func:`environment` of
    the process that measured them (a merged report is drawn elsewhere): the GPU's name, or a
    warning that CPU timings (of Triton's interpreter, as a rule) say nothing about a GPU."""
    if env["device"] != "cpu":
        return env["device"]
    interpreter = " (Triton interpreter)" if env.get("triton_interpret") else ""
    return f"CPU{interpreter}: not GPU timings"


INTERPRETER_CAVEAT = ("CPU run: cce's kernels run in Triton's interpreter (a CPU emulator, "
                      "thousands of times slower than a GPU): timings are not GPU speed")


def kernels_interpreted(env: Optional[dict[str, Any]] = None) -> bool:
    """Whether cce's Triton kernels ran in Triton's interpreter, in the process whose
    :func:`environment` is ``env`` (None: this one)."""
    env = environment() if env is None else env
    return env["device"] == "cpu" and bool(env.get("triton_interpret"))


def shown_method(name: str, env: Optional[dict[str, Any]] = None) -> str:
    """A method that runs cce's Triton kernels as the console, reports and figures name it:
    "cce (interpreter)", "cce (filter_eps=None, interpreter)" where :func:`kernels_interpreted`,
    else ``name``, so that no interpreter timing passes for a kernel's."""
    if not kernels_interpreted(env):
        return name
    return f"{name[:-1]}, interpreter)" if name.endswith(")") else f"{name} (interpreter)"


def add_run_arguments(parser: argparse.ArgumentParser, files: str) -> None:
    """``--quick`` and ``--out DIR``, as every experiment's command line has them; ``files``
    names what goes into the folder. :func:`run_mode` reads them."""
    parser.add_argument("--quick", action="store_true",
                        help="small sizes, a smoke test that runs in minutes on a CPU (the "
                             "default when no CUDA device is available)")
    parser.add_argument("--out", type=Path, metavar="DIR",
                        help=f"folder for {files} (default: {_shown(RESULTS_DIR)} for a full "
                             f"run, {_shown(QUICK_RESULTS_DIR)} for --quick, which git ignores)")


def run_mode(args: argparse.Namespace, measures: bool = True) -> tuple[bool, Path]:
    """``(quick, out_dir)`` from :func:`add_run_arguments`' options: quick without a GPU.
    ``measures``: whether the command measures anything; only then is a quick run it was not
    asked for worth a notice."""
    quick = args.quick or not ON_GPU
    if quick and not args.quick and measures:
        log("No CUDA device: running in --quick mode (a smoke test; Triton's interpreter runs "
            "the kernels).")
    return quick, default_out_dir(quick) if args.out is None else args.out


def loss_option(text: str) -> tuple[str, Any]:
    """One ``--option KEY=VALUE`` of the command-line tools: a keyword of
    ``cce.linear_cross_entropy`` and its value as a Python literal (``keep_tiles=True``,
    ``filter_eps=None``), or as a plain string where it is none (``memory=fast``)."""
    key, separator, value = text.partition("=")
    if not separator or not key.isidentifier():
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    try:
        return key, ast.literal_eval(value)
    except (ValueError, SyntaxError):
        return key, value


def log(message: str) -> None:
    """Print ``message`` to stderr without breaking a progress bar that is being drawn."""
    try:
        from tqdm import tqdm
    except ImportError:  # tqdm comes with the optional "experiments" extra
        print(message, file=sys.stderr)
        return
    tqdm.write(message, file=sys.stderr)


@dataclass(frozen=True)
class Outcome:
    """How one experiment went, for the summary that ends a run."""

    name: str
    seconds: float
    files: list[Path]
    status: str  # "ok", or what failed


def file_times(out_dir: Path) -> dict[Path, int]:
    """The modification time (ns) of every file in ``out_dir``: before a run, for
    :func:`files_written` after it."""
    if not out_dir.is_dir():
        return {}
    return {path: path.stat().st_mtime_ns for path in out_dir.iterdir() if path.is_file()}


def files_written(out_dir: Path, before: dict[Path, int]) -> list[Path]:
    """The files of ``out_dir`` that are new or changed since :func:`file_times` gave
    ``before``, by name."""
    return sorted(path for path, time_ns in file_times(out_dir).items()
                  if before.get(path) != time_ns)


def run_experiment(name: str, out_dir: Path, run: Callable[[], WrittenResults],
                   measures: bool = True) -> tuple[Outcome, list[str]]:
    """Call ``run`` (which writes into ``out_dir``): how it went and what failed. ``measures``:
    whether ``run`` times anything (a merge of earlier runs does not).

    An exception is logged with its traceback and becomes a failed outcome, so that one
    experiment's failure does not hide the results of those after it.
    """
    # Before any timing reaches the console; an experiment that times nothing has no caveat.
    if measures and name not in COMPUTED_ONLY and kernels_interpreted():
        log(f"{name}: {INTERPRETER_CAVEAT}")
    before, start_s = file_times(out_dir), time.perf_counter()
    try:
        written = run()
    except Exception as error:
        log(traceback.format_exc())
        failure = f"{type(error).__name__}: {error}"
        status, errors = f"FAILED ({failure})", [failure]
    else:
        errors = written.errors
        status = "ok" if not errors else f"FAILED ({len(errors)} failing rows)"
    outcome = Outcome(name, time.perf_counter() - start_s, files_written(out_dir, before),
                      status)
    return outcome, [f"{name}: {error}" for error in errors]


def main(name: str, run: Callable[..., WrittenResults], description: str,
         argv: Optional[list[str]] = None,
         options: Optional[Callable[[argparse.ArgumentParser],
                                    Callable[[argparse.Namespace], dict[str, Any]]]] = None,
         *, files: Optional[str] = None) -> int:
    """``python -m experiments.<name> [--quick] [--out DIR] ...``: one experiment's command
    line. ``options``, given the parser, adds the experiment's own arguments and returns what
    turns the parsed arguments into ``run``'s keyword arguments. ``files``: what the experiment
    writes (default: ``<name>.json, <name>.md and <name>.png``)."""
    parser = argparse.ArgumentParser(prog=f"python -m experiments.{name}",
                                     description=description)
    add_run_arguments(parser, files or f"{name}.json, {name}.md and {name}.png")
    keywords = options(parser) if options is not None else lambda args: {}
    args = parser.parse_args(argv)
    quick, out_dir = run_mode(args, measures=name not in COMPUTED_ONLY)
    outcome, errors = run_experiment(name, out_dir,
                                     lambda: run(quick, out_dir, **keywords(args)))
    return finish([outcome], errors, out_dir)


def summary(outcomes: list[Outcome]) -> str:
    """One line per experiment: name, seconds, status and the names of the files it wrote."""
    width = max(len(outcome.name) for outcome in outcomes)
    return "\n".join(f"{outcome.name:<{width}}  {outcome.seconds:5.0f} s  {outcome.status}  "
                     + (" ".join(path.name for path in outcome.files) or "no files")
                     for outcome in outcomes)


def finish(outcomes: list[Outcome], errors: list[str], out_dir: Path) -> int:
    """End a command: the summary, where the files are, and the failures; the exit status, 1
    when anything failed."""
    print(summary(outcomes))
    print(f"Files in {_shown(out_dir)}")
    for error in errors:
        print(f"FAILED {error}", file=sys.stderr)
    return 1 if errors else 0


def _shown(path: Path) -> str:
    """``path`` relative to the working directory when it is inside it, else as it is."""
    try:
        return str(path.resolve().relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def environment() -> dict[str, Any]:
    """Where and with what the results were produced; deliberately no hostname."""
    return {
        "device": device_name() if ON_GPU else "cpu",
        "torch": torch.__version__,
        "triton": _package_version("triton"),
        "cuda": torch.version.cuda if ON_GPU else None,
        "cce": _package_version("cce-triton"),  # its distribution name (import name: cce)
        "python": platform.python_version(),
        # The version that tokenized the real data, if this process loaded it: the Gemma 3
        # tokenizer depends on it (experiments.real_model.check_tokenizer).
        "transformers": _imported_version("transformers"),
        # Importing experiments turns the interpreter on on a machine with no CUDA device.
        "triton_interpret": os.environ.get("TRITON_INTERPRET") == "1",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


def time_fn(fn: Callable[..., Any], warmup: Optional[int] = None, repeats: Optional[int] = None,
            setup: Optional[Callable[[], Any]] = None) -> float:
    """Median time of one call of ``fn`` in milliseconds.

    On GPU: CUDA events, 5 warm-up calls and the median of 20 by default. On CPU:
    ``time.perf_counter`` and one call, no warm-up: CPU runs are smoke tests, in which Triton's
    interpreter takes seconds per call, and :func:`measure_loss`'s first, untimed call has
    compiled what needs compiling.
    ``setup``, when given, runs untimed before every call and its result is passed to ``fn``
    (the forward pass, to time the backward pass alone).
    """
    warmup = (GPU_WARMUP if ON_GPU else 0) if warmup is None else warmup
    repeats = (GPU_REPEATS if ON_GPU else 1) if repeats is None else repeats
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")

    def one_call_ms() -> float:
        arguments = () if setup is None else (setup(),)
        if ON_GPU:
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            fn(*arguments)
            end.record()
            end.synchronize()
            return start.elapsed_time(end)
        start_s = time.perf_counter()
        fn(*arguments)
        return (time.perf_counter() - start_s) * 1e3

    for _ in range(warmup):
        one_call_ms()
    return statistics.median(one_call_ms() for _ in range(repeats))


def peak_memory_mb(fn: Callable[..., Any], setup: Optional[Callable[[], Any]] = None
                   ) -> Optional[float]:
    """Peak GPU memory allocated during one call of ``fn``, above what was in use before it.

    Memory that ``fn`` returns counts (it was allocated during the call), memory allocated
    before (inputs, references) does not. ``setup``, when given, runs first and its result is
    passed to ``fn``: what it holds counts as in use before (the forward's saved state and
    output, to measure the backward alone). None on CPU, where PyTorch does not track it.
    """
    if not ON_GPU:
        return None
    arguments = () if setup is None else (setup(),)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    in_use_before = torch.cuda.memory_allocated()
    fn(*arguments)
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - in_use_before) / 2**20


def make_inputs(n_tokens: int, vocab_size: int, dim: int, dtype: torch.dtype = torch.float32, *,
                classifier_scale: float = 1.0, ignored_fraction: float = 0.0, seed: int = 0,
                requires_grad: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random ``(e, c, targets)`` on :data:`DEVICE`.

    ``e`` ~ N(0, 1) of shape (n_tokens, dim); ``c`` ~ N(0, 1) / sqrt(dim) * classifier_scale of
    shape (vocab_size, dim), so logits have standard deviation ``classifier_scale``; targets
    uniform in [0, vocab_size), with about ``ignored_fraction`` of them set to IGNORE_INDEX.
    Drawn in float32 and then cast, so that every dtype gets the same values for one seed.
    """
    generator = torch.Generator(device=DEVICE).manual_seed(seed)
    e = torch.randn(n_tokens, dim, generator=generator, device=DEVICE)
    c = torch.randn(vocab_size, dim, generator=generator, device=DEVICE)
    c *= classifier_scale / math.sqrt(dim)
    targets = torch.randint(vocab_size, (n_tokens,), generator=generator, device=DEVICE)
    ignored = torch.rand(n_tokens, generator=generator, device=DEVICE) < ignored_fraction
    targets[ignored] = IGNORE_INDEX
    return (e.to(dtype).requires_grad_(requires_grad), c.to(dtype).requires_grad_(requires_grad),
            targets)


def relative_error(value: torch.Tensor, reference: torch.Tensor) -> float:
    """``||value - reference|| / ||reference||``, in float64."""
    return float((value.detach().double() - reference).norm() / reference.norm())


# Float64 logits per chunk of tokens in the reference (its other memory: float64_reference).
REFERENCE_CHUNK_BYTES = 2**30


def float64_reference(e: torch.Tensor, c: torch.Tensor, targets: torch.Tensor,
                      chunk_bytes: int = REFERENCE_CHUNK_BYTES, label_smoothing: float = 0.0,
                      classifier_gradient: bool = True, *, z_loss: float = 0.0,
                      temperature: float = 1.0, entropy_bonus: float = 0.0,
                      entropy_of_ignored: bool = True) -> tuple[torch.Tensor, ...]:
    """Float64 ``(loss, dE, dC)`` of the mean cross-entropy of ``e @ c.T`` (ignore_index -100),
    with F.cross_entropy's ``label_smoothing``; ``(loss, dE)`` without ``classifier_gradient``
    (a frozen classifier, whose dC nobody needs: it saves a float64 dC and a GEMM per chunk).

    The options of ``cce.linear_cross_entropy`` that the benchmark measures, in float64:
    ``temperature`` divides the logits (before everything else); ``z_loss`` adds
    ``z_loss * lse**2`` to each non-ignored token's loss, averaged with the cross-entropy over
    the non-ignored tokens; ``entropy_bonus`` subtracts ``entropy_bonus`` times the mean
    entropy ``-sum(p * log p)`` of the softmax of every row (ignored ones too; only of the
    non-ignored rows without ``entropy_of_ignored``: a loss that never sees the ignored rows),
    as ``loss - entropy_bonus * entropy.mean()`` with ``return_entropy=True`` does.

    The full float64 logits (17 GB for 8192 x 262144) never exist: the tokens go through in
    chunks of ``chunk_bytes`` of logits, each chunk's softmax gradient turned into its rows of
    dE and its contribution to dC at once. Memory: float64 copies of e and c, dE and dC, and
    one chunk (two with ``entropy_bonus``; about 10 GB for the Gemma 2 2B shape).
    """
    e64 = e.detach().double()
    c64 = c.detach().double()
    valid = targets >= 0
    n_valid = valid.sum()
    entropy_rows = torch.ones_like(valid) if entropy_of_ignored else valid
    n_entropy_rows = entropy_rows.sum()
    grad_e = torch.zeros_like(e64)
    grad_c = torch.zeros_like(c64) if classifier_gradient else None
    loss_sum = torch.zeros((), dtype=torch.float64, device=e.device)
    entropy_sum = torch.zeros((), dtype=torch.float64, device=e.device)
    chunk_rows = max(1, chunk_bytes // (8 * c.shape[0]))
    for start in range(0, e.shape[0], chunk_rows):
        rows = slice(start, start + chunk_rows)
        chunk_targets = targets[rows].clamp(min=0)[:, None]
        chunk_valid = valid[rows]
        logits = e64[rows] @ c64.T
        if temperature != 1:
            logits /= temperature
        lse = torch.logsumexp(logits, dim=1, keepdim=True)
        target_logit = logits.gather(1, chunk_targets)
        # The logit that the smoothed target distribution averages.
        scored_logit = (1 - label_smoothing) * target_logit
        if label_smoothing:
            scored_logit += label_smoothing * logits.mean(dim=1, keepdim=True)
        token_loss = lse - scored_logit
        if z_loss:
            token_loss += z_loss * lse**2
        loss_sum += (token_loss.squeeze(1) * chunk_valid).sum()
        log_probs = logits.sub_(lse)  # in place
        if entropy_bonus:
            grad_logits = log_probs.exp()
            # Row by row dot products: no third chunk-sized buffer.
            entropy = -(grad_logits[:, None, :] @ log_probs[:, :, None]).view(-1)
            chunk_entropy_rows = entropy_rows[rows].double()
            entropy_sum += (entropy * chunk_entropy_rows).sum()
            # d(-bonus * mean entropy)/d(logits) = bonus / rows * p * (log p + entropy), in
            # place of log p.
            entropy_grad = log_probs.add_(entropy[:, None]).mul_(grad_logits)
            entropy_grad *= (entropy_bonus * chunk_entropy_rows / n_entropy_rows)[:, None]
        else:
            grad_logits = log_probs.exp_()  # in place
            entropy_grad = None
        # d(mean loss)/d(logits) = (softmax * (1 + 2 z_loss lse) - smoothed onehot(target))
        # / n_valid on valid rows, in place.
        if z_loss:
            grad_logits *= 1 + 2 * z_loss * lse
        grad_logits.scatter_add_(1, chunk_targets,
                                 torch.full_like(target_logit, label_smoothing - 1))
        if label_smoothing:
            grad_logits -= label_smoothing / c.shape[0]
        grad_logits *= (chunk_valid.double() / n_valid)[:, None]
        if entropy_grad is not None:
            grad_logits += entropy_grad
        if temperature != 1:
            grad_logits /= temperature
        grad_e[rows] = grad_logits @ c64
        if grad_c is not None:
            grad_c.addmm_(grad_logits.T, e64[rows])
        del logits, log_probs, grad_logits, entropy_grad
    loss = loss_sum / n_valid
    if entropy_bonus:
        loss = loss - entropy_bonus * entropy_sum / n_entropy_rows
    return (loss, grad_e) if grad_c is None else (loss, grad_e, grad_c)


def measure_loss(loss_fn: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
                 e: torch.Tensor, c: torch.Tensor, targets: torch.Tensor,
                 reference: Optional[tuple[torch.Tensor, ...]],
                 timing: Optional[dict[str, int]] = None) -> dict[str, Any]:
    """Accuracy, times and peak memory of one loss ``loss_fn(e, c, targets)``.

    The backward computes the gradients of the inputs that require one: dE alone when ``c``
    does not (a frozen classifier, as with LoRA). Returns loss/dE/dC relative errors against
    ``reference`` (:func:`float64_reference`'s float64 loss, dE and dC; left out when
    ``reference`` is None, dC's when there is no dC), the median times of forward, backward
    alone and forward+backward (``timing`` is passed to :func:`time_fn`), and the peak memory
    of the forward under torch.no_grad (``fwd_peak_mb``), of the forward with gradients enabled
    (``fwd_grad_peak_mb``: a training step's forward, the state saved for the backward
    included), of the backward alone above what is in use after the forward
    (``bwd_peak_mb``), and of forward+backward. An exception becomes an ``"error"`` entry,
    so that one failing method (OOM, a kernel bug) does not hide the others.
    """
    timing = timing or {}

    def forward() -> torch.Tensor:
        return loss_fn(e, c, targets)

    def forward_no_grad() -> torch.Tensor:
        with torch.no_grad():
            return loss_fn(e, c, targets)

    differentiated = (e, c) if c.requires_grad else (e,)

    # autograd.grad rather than .backward(): gradients do not pile up in e.grad and c.grad.
    def backward(loss: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return torch.autograd.grad(loss, differentiated)

    def forward_backward() -> tuple[torch.Tensor, ...]:
        return backward(forward())

    row: dict[str, Any] = {}
    try:
        # First call: accuracy, and compilation out of the way before any timing.
        loss = forward()
        gradients = backward(loss)
        if reference is not None:
            # zip stops after dE when the classifier is frozen.
            for column, result, expected in zip(("loss_rel_err", "de_rel_err", "dc_rel_err"),
                                                (loss, *gradients), reference):
                row[column] = relative_error(result, expected)
        del loss, gradients  # so that they do not sit in memory during the measurements
        row["fwd_ms"] = time_fn(forward, **timing)
        row["bwd_ms"] = time_fn(backward, setup=forward, **timing)
        row["fwd_bwd_ms"] = time_fn(forward_backward, **timing)
        forward_no_grad()  # torch.compile guards on grad mode: compile that graph untracked
        row["fwd_peak_mb"] = peak_memory_mb(forward_no_grad)
        row["fwd_grad_peak_mb"] = peak_memory_mb(forward)
        row["bwd_peak_mb"] = peak_memory_mb(backward, setup=forward)
        row["fwd_bwd_peak_mb"] = peak_memory_mb(forward_backward)
    except Exception as error:
        row["error"] = f"{type(error).__name__}: {error}"
    return row


def write_results(name: str, rows: list[dict[str, Any]], meta: dict[str, Any],
                  out_dir: Path = Path("results"), device_dependent: bool = True,
                  group_by: Optional[str] = None,
                  details: Optional[dict[str, Any]] = None,
                  measured_in: Optional[dict[str, Any]] = None,
                  kernel_methods: Optional[dict[str, Collection[str]]] = None
                  ) -> WrittenResults:
    """Write ``<out_dir>/<name>.json`` (rows, meta, environment) and ``<out_dir>/<name>.md``.

    A row that failed carries an ``"error"`` string; the returned object lists them so that
    the caller can fail loudly. ``device_dependent=False`` marks results that do not depend on
    the machine (an analytic model): they carry no CPU-run warning. ``group_by`` names a row
    key whose values become headings, one Markdown table under each, instead of a column.
    ``details`` go to the JSON file only, under "details": data too long for the report
    (per-step curves). ``measured_in``: the :func:`environment` of the process that measured
    the rows, when it was another one (results merged elsewhere); default this one's.
    ``kernel_methods``: column -> the names in it of methods that run cce's Triton kernels,
    which the Markdown shows as :func:`shown_method` does (the JSON keeps the names).
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    env = measured_in or environment()
    json_path = out_dir / f"{name}.json"
    contents = {"name": name, "environment": env, "meta": meta, "rows": rows}
    if details is not None:
        contents["details"] = details
    json_path.write_text(json.dumps(contents, indent=2) + "\n")
    kernel_names = kernel_methods or {}
    shown_rows = [{key: shown_method(value, env) if value in kernel_names.get(key, ()) else value
                   for key, value in row.items()} for row in rows]
    markdown = _markdown_report(name, shown_rows, meta, env, device_dependent, group_by)
    markdown_path = out_dir / f"{name}.md"
    markdown_path.write_text(markdown)
    errors = [str(row["error"]) for row in rows if row.get("error")]
    return WrittenResults(json_path, markdown_path, markdown, errors)


def add_sections(written: WrittenResults, fields: dict[str, Any], markdown_lines: list[str]
                 ) -> WrittenResults:
    """Add top-level ``fields`` to the JSON file and ``markdown_lines`` to the Markdown file."""
    results = json.loads(written.json_path.read_text())
    results.update(fields)
    written.json_path.write_text(json.dumps(results, indent=2) + "\n")
    markdown = written.markdown + "\n".join(markdown_lines) + "\n"
    written.markdown_path.write_text(markdown)
    return replace(written, markdown=markdown)


def gather_from_ranks(value: float, device: torch.device) -> list[float]:
    """``value`` of every rank of the default process group, in rank order (a multi-process
    experiment's per-rank measurements)."""
    import torch.distributed as dist

    table = torch.zeros(dist.get_world_size(), dtype=torch.float64, device=device)
    table[dist.get_rank()] = value
    dist.all_reduce(table)
    return table.tolist()


def exit_rank(status: int) -> NoReturn:
    """End a rank's process with ``status`` once its process group is destroyed, skipping the
    interpreter's teardown: in a process that made a DTensor over gloo, torch's exit-time
    destructors abort now and then ("terminate called without an active exception", torch
    2.13 on the CPU), which would fail a run that has already written its results."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def label_log_axis(axis: Any, which: str = "y") -> None:
    """Ticks of a log-scale axis of a matplotlib Axes at 1, 2 and 5 times the powers of ten in
    its range (more steps in a narrow range, fewer in a wide one), labelled as plain numbers
    (0.5, 20, 100) and without minor labels: read at a glance, unlike 10^1 and 3 x 10^1."""
    from matplotlib.ticker import FixedLocator, FuncFormatter, NullFormatter

    low, high = axis.get_ylim() if which == "y" else axis.get_xlim()
    decades = range(math.floor(math.log10(low)), math.ceil(math.log10(high)) + 1)

    def ticks(steps: tuple[float, ...]) -> list[float]:
        return [step * 10.0**power for power in decades for step in steps
                if low <= step * 10.0**power <= high]

    spanned = math.log10(high / low)
    chosen = ticks((1, 2, 5) if spanned <= 2.5 else (1, 3) if spanned <= 4 else (1,))
    if len(chosen) < 4:
        chosen = ticks((1, 1.5, 2, 3, 5, 7))
    if len(chosen) < 2:  # a range too narrow for these steps: matplotlib's own ticks
        return
    ruler = axis.yaxis if which == "y" else axis.xaxis
    ruler.set_major_locator(FixedLocator(chosen))
    ruler.set_major_formatter(FuncFormatter(lambda value, _: f"{value:g}"))
    ruler.set_minor_formatter(NullFormatter())


def progress(items: Iterable[T], description: str, total: Optional[int] = None,
             leave: bool = True) -> Iterable[T]:
    """A tqdm progress bar over ``items`` when tqdm is installed (and stderr is a terminal)."""
    try:
        from tqdm import tqdm
    except ImportError:  # tqdm comes with the optional "experiments" extra
        return items
    # disable=None: no bar when stderr is not a terminal, which keeps CI logs short.
    return tqdm(items, desc=description, total=total, leave=leave, disable=None)


def _package_version(name: str) -> Optional[str]:
    # Read from metadata rather than imported: importing triton before cce has set
    # TRITON_INTERPRET is not something a harness should do behind the caller's back.
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _imported_version(name: str) -> Optional[str]:
    """The version of module ``name`` if this process imported it (None otherwise: importing
    it here would be a side effect)."""
    module = sys.modules.get(name)
    return getattr(module, "__version__", None) if module is not None else None


def _markdown_report(name: str, rows: list[dict[str, Any]], meta: dict[str, Any],
                     env: dict[str, Any], device_dependent: bool, group_by: Optional[str]
                     ) -> str:
    versions = [f"torch {env['torch']}", f"triton {env['triton']}", f"Python {env['python']}"]
    if env.get("transformers"):
        versions.append(f"transformers {env['transformers']}")
    if env["cuda"]:
        versions.insert(1, f"CUDA {env['cuda']}")
    lines = [f"# {name}", "",
             f"Device: {env['device']} · {' · '.join(versions)} · {env['date']}", ""]
    if device_dependent and env["device"] == "cpu":
        lines += ["> **CPU RUN: THESE ARE NOT GPU TIMINGS.** This machine has no CUDA device; "
                  "the Triton kernels ran in the interpreter"
                  f"{' (TRITON_INTERPRET=1)' if env['triton_interpret'] else ''}. Use these "
                  "numbers to check that everything runs and agrees, never to compare speed "
                  "or memory with the paper.", ""]
    if meta:
        lines += [f"- {key}: {_format(value)}" for key, value in meta.items()] + [""]
    if group_by is None:
        lines += markdown_table(rows)
    else:
        for heading in dict.fromkeys(row[group_by] for row in rows):
            group = [{key: value for key, value in row.items() if key != group_by}
                     for row in rows if row[group_by] == heading]
            lines += [f"## {heading}", "", *markdown_table(group), ""]
    return "\n".join(lines) + "\n"


def markdown_table(rows: list[dict[str, Any]]) -> list[str]:
    """The lines of a Markdown table: a column per key (in order of appearance), a line per row."""
    columns = list(dict.fromkeys(key for row in rows for key in row))
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    return lines + ["| " + " | ".join(_format(row.get(column)) for column in columns) + " |"
                    for row in rows]


def _format(value: Any) -> str:
    if value is None:
        return MISSING
    if isinstance(value, list):
        return ", ".join(_format(item) for item in value)
    if isinstance(value, float):
        if value == 0 or not math.isfinite(value):
            return str(value)
        if abs(value) < 1e-3:  # relative errors
            return f"{value:.2e}"
        return f"{value:.3g}" if abs(value) < 1 else f"{value:.1f}"
    # A table cell cannot hold a pipe or a newline.
    return str(value).replace("|", "\\|").replace("\n", " ")
