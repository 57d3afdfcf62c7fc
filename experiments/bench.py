"""The benchmark of the issue: every loss implementation, one cuBLAS GEMM and the targets.

Shapes (bfloat16, N=8192 tokens unless named): Gemma 3 270M on real Alpaca hidden states (all
tokens, then prompt tokens ignored), and the Gemma 2 2B, Llama 3 8B and Phi 3.5 mini shapes on
synthetic inputs with a language model's softmax sparsity (:mod:`experiments.synthetic`); the
Llama 3 8B shape also at N = 1024, 4096, 16384 and 32768 (``llama3_8b_n*``), and the Gemma 2 2B
shape with a frozen classifier (``gemma2_2b_frozen``: ``c.requires_grad=False``, as with LoRA;
the backward computes dE only). For each method: forward, backward (after an untimed forward)
and forward+backward time, peak memory above the inputs (forward under ``torch.no_grad`` and
with gradients, backward alone, forward+backward), and the relative error of the loss, dE and
dC against a float64 reference; for cce's kernels, the backward that the plan chose (one pass,
two passes, dense: :func:`backward_path`). One GEMM ``e @ c.T`` of the same shape is the
yardstick; the softmax's sparsity statistics are printed and stored per shape.

Methods: ``cce`` and its ablations, the ``torch``, ``torch_compile`` and ``chunked`` baselines
(the variants of :mod:`experiments.compare_impls`), ``cce`` with label smoothing, with
``z_loss``, with ``temperature`` and with ``return_entropy`` (an entropy bonus,
``loss - 0.01 * entropy.mean()``), each against a float64 reference of its own loss, and, when
installed, Apple's ``cut_cross_entropy``, Liger's fused linear cross-entropy, Triton and
CuTe-DSL (Hopper only; the shapes it takes, :func:`liger_cutedsl_unsupported`), and quack's
chunked linear cross-entropy in its fused Hopper pipeline (:func:`quack_unsupported`). The N sweep
and the frozen classifier measure only ``cce`` and ``torch_compile`` unless ``--methods``
names others (:attr:`Shape.methods`). Results: ``bench.json``, ``bench.md`` (with the
targets, MET or MISSED, and the cost of the options against plain ``cce``: "Cost of options")
and ``bench.png``.

Targets (issue 20; limits in :data:`FWD_BWD_VS_COMPILE` and the constants below it), for
``impl="cce"`` with its defaults: fwd+bwd time against torch.compile's on each named shape (the
full run measures them all); on every measured shape, the forward against one GEMM, the forward's
memory under ``torch.no_grad``, the fwd+bwd memory against dE + dC (dC's size also with a frozen
classifier), and the dE and dC errors against float64 and against torch.compile's. The cost of
an option (:data:`OPTION_COST_LIMITS`): its fwd+bwd time against plain ``cce``'s on each shape
that measures it (the full run: the named shapes), ``z_loss`` and ``temperature`` at most 2%
more, ``return_entropy`` (with the entropy bonus's backward) at most 10%.

``python -m experiments.bench [--quick] [--shapes ...] [--methods ...] [--out DIR]
[--data PATH] [--repeats N]``; also ``python -m experiments --only bench``. Each shape
takes minutes on a GPU (torch.compile compiles for each): run a few at a time with ``--shapes``
and separate ``--out`` folders when a command's time is limited, then ``python -m
experiments.bench --merge DIR ... [--out DIR]`` writes one report (on any machine).

:func:`measure_shape` is also what the paper's tables (:mod:`experiments.tables`) measure
with. It remembers every (shape, method) it measured, so that experiments run in one process
(``python -m experiments``) measure a pair once, and it loads the real model's hidden states
once per process.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import sys
import textwrap
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import torch

import cce
from cce.cce_function import forward_kernels, recompute_table
from cce.forward.plan import forward_outputs
from cce.options import default_filter_eps
from experiments.alpaca_data import add_data_argument
from experiments.compare_impls import variants
from experiments.harness import (DEVICE, GPU_REPEATS, GPU_WARMUP, IGNORE_INDEX, MISSING, ON_GPU,
                                 WrittenResults, add_run_arguments, add_sections, device_label,
                                 environment, finish, float64_reference, label_log_axis, log,
                                 measure_loss, progress, run_experiment, run_mode, shown_method,
                                 time_fn, write_results)
from experiments.synthetic import REAL_DATA_STATISTICS, lm_like_inputs, sparsity_statistics

NAME = "bench"
DTYPE = torch.bfloat16
MIB = 2**20

Loss = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


# Targets ignored in the prompt-masked Alpaca batch (prompt tokens and sequence ends): 2131 of
# the first 4096 tokens on Gemma 3 270M's tokenizer (fig3_sparsity's quick run, 1965 response
# targets). Synthetic inputs that stand in for prompt-masked data ignore this fraction.
ALPACA_IGNORED_FRACTION = 0.52


@dataclass(frozen=True)
class Shape:
    name: str
    description: str
    n_tokens: int
    vocab_size: int
    dim: int
    data: str  # "alpaca", "alpaca_masked" (prompt tokens ignored) or "lm_like"
    ignored_fraction: float = 0.0  # "lm_like": targets set to ignore_index at random rows
    # The paper's Appendix A: every loss sees only the rows whose target is not ignored.
    ignored_removed: bool = False
    # c.requires_grad=False (a frozen classifier, as with LoRA): the backward computes dE only.
    frozen_classifier: bool = False
    # The methods measured when the caller names none (None: all of METHODS).
    methods: Optional[tuple[str, ...]] = None

    def unlabelled(self) -> Shape:
        """The shape without name, description and default methods: all that its
        measurements depend on."""
        return replace(self, name="", description="", methods=None)


# What the targets compare: shapes measured only for them need no other method (eager torch at
# N = 32768 would materialise tens of GB of logits).
TARGET_METHODS = ("cce", "torch_compile")
# At N <= D / 2 memory="fast" keeps G in dC's memory: no more memory than cce's default.
FAST_METHOD = "cce (memory='fast')"
LLAMA_DIM = 4096


# The real-data shapes' name, and theirs where the model is not importable (synthetic inputs).
REAL_DATA = "Gemma 3 270M, Alpaca"
REAL_DATA_SIZES = "Gemma 3 270M shape"

SHAPES: dict[str, Shape] = {shape.name: shape for shape in (
    Shape("gemma3", REAL_DATA, 8192, 262144, 640, "alpaca"),
    Shape("gemma3_masked", f"{REAL_DATA}, prompt ignored", 8192, 262144, 640,
          "alpaca_masked"),
    Shape("gemma3_removed", f"{REAL_DATA}, prompt ignored and removed", 8192, 262144,
          640, "alpaca_masked", ignored_removed=True),
    Shape("gemma2_2b", "Gemma 2 2B shape", 8192, 256000, 2304, "lm_like"),
    Shape("gemma2_2b_removed", "Gemma 2 2B shape, Alpaca's prompt share ignored and removed",
          8192, 256000, 2304, "lm_like", ignored_fraction=ALPACA_IGNORED_FRACTION,
          ignored_removed=True),
    Shape("gemma2_2b_frozen", "Gemma 2 2B shape, classifier frozen (dE only)", 8192, 256000,
          2304, "lm_like", frozen_classifier=True, methods=TARGET_METHODS),
    Shape("gemma2_9b", "Gemma 2 9B shape", 8192, 256000, 3584, "lm_like"),
    Shape("gemma2_27b", "Gemma 2 27B shape", 8192, 256000, 4608, "lm_like"),
    Shape("llama3_8b", "Llama 3 8B shape", 8192, 128256, LLAMA_DIM, "lm_like"),
    # The sweep of the token count at the Llama 3 8B shape (N = 8192 is llama3_8b).
    *(Shape(f"llama3_8b_n{n}", f"Llama 3 8B shape, N={n}", n, 128256, LLAMA_DIM, "lm_like",
            methods=TARGET_METHODS + (FAST_METHOD,) * (2 * n <= LLAMA_DIM))
      for n in (1024, 4096, 16384, 32768)),
    Shape("mistral_nemo", "Mistral NeMo shape", 8192, 131072, 5120, "lm_like"),
    Shape("phi3_5_mini", "Phi 3.5 mini shape", 8192, 32064, 3072, "lm_like"),
    # About 45 s for every method on 2 CPU cores, where the Triton kernels run in the interpreter.
    Shape("quick", "tiny (CPU smoke test)", 128, 1024, 64, "lm_like"),
    Shape("quick_removed", "tiny, ignored tokens removed (CPU smoke test)", 128, 2048, 64,
          "lm_like", ignored_fraction=ALPACA_IGNORED_FRACTION, ignored_removed=True),
    Shape("quick_frozen", "tiny, classifier frozen (CPU smoke test)", 128, 1024, 64, "lm_like",
          frozen_classifier=True, methods=TARGET_METHODS),
)}
# Every shape that a target names (FWD_BWD_VS_COMPILE): one full run measures every target.
FULL_SHAPES = ("gemma3", "gemma3_masked", "gemma2_2b", "gemma2_2b_frozen", "llama3_8b_n1024",
               "llama3_8b_n4096", "llama3_8b", "llama3_8b_n16384", "llama3_8b_n32768",
               "phi3_5_mini")
QUICK_SHAPES = ("quick", "quick_frozen")


@dataclass(frozen=True)
class Timing:
    """Warm-up and timed calls of :func:`experiments.harness.time_fn` (the median is kept)."""

    warmup: int
    repeats: int


MIN_GPU_REPEATS = 10  # a median of fewer GPU calls moves with clocks and other tenants


def timing(repeats: Optional[int] = None) -> Timing:
    """How to time: ``repeats`` timed calls (None: the default), warm-up on GPU only.

    GPU: 5 warm-up calls and the median of 20 (at least 10). CPU: one timed call and no
    warm-up, since the interpreter takes seconds per CCE call and the first (untimed) call of
    :func:`experiments.harness.measure_loss` has compiled what needs compiling.
    """
    if repeats is None:
        repeats = GPU_REPEATS if ON_GPU else 1
    minimum = MIN_GPU_REPEATS if ON_GPU else 1
    if repeats < minimum:
        raise ValueError(f"repeats must be >= {minimum} on this device, got {repeats}")
    return Timing(GPU_WARMUP if ON_GPU else 0, repeats)


@dataclass(frozen=True)
class Method:
    name: str
    loss: Callable[[], Loss]  # builds the loss function; raises ImportError when not installed
    needs_cuda: bool = False
    # What the loss computes besides the plain mean cross-entropy, and so its float64
    # reference: keyword arguments of experiments.harness.float64_reference (label_smoothing,
    # z_loss, temperature, entropy_bonus).
    reference_options: dict[str, float] = field(default_factory=dict)
    cce_kernels: bool = False  # runs cce's Triton kernels (in the interpreter on a CPU)
    description: str = ""  # what the row measures, where its name does not say it all
    # Why the method cannot take these inputs (e, c and the targets of the rows it sees), or
    # None where it can: the row is then skipped with that reason.
    unsupported: Optional[Callable[[torch.Tensor, torch.Tensor, torch.Tensor],
                                   Optional[str]]] = None


def _cce_variant_loss(impl: str, options: dict[str, Any]) -> Callable[[], Loss]:
    def build() -> Loss:
        return lambda e, c, targets: cce.linear_cross_entropy(e, c, targets, impl=impl,
                                                              **options)
    return build


# The entropy bonus of the "cce (return_entropy)" row: RL code's loss - bonus * the entropy's
# mean over the scored tokens (the response's, where the prompt's are ignored).
ENTROPY_BONUS = 0.01


def _entropy_bonus_loss() -> Loss:
    def loss_with_entropy_bonus(e: torch.Tensor, c: torch.Tensor, targets: torch.Tensor
                                ) -> torch.Tensor:
        loss, entropy = cce.linear_cross_entropy(e, c, targets, impl="cce",
                                                 return_entropy=True)
        scored = targets != IGNORE_INDEX
        # A sum over a mask, not entropy[scored]: no host sync inside the timed step.
        return loss - ENTROPY_BONUS * (entropy * scored).sum() / scored.sum()
    return loss_with_entropy_bonus


def _apple_cce_loss() -> Loss:
    from cut_cross_entropy import linear_cross_entropy  # its default impl "cce": filter + sort
    return linear_cross_entropy


def _liger_loss() -> Loss:
    from liger_kernel.transformers.fused_linear_cross_entropy import (
        LigerFusedLinearCrossEntropyLoss)
    module = LigerFusedLinearCrossEntropyLoss()  # mean over targets != -100, as the others
    # Liger's argument order: forward(lin_weight, _input, target, bias=None).
    return lambda e, c, targets: module(c, e, targets)


def _liger_cutedsl_loss() -> Loss:
    from liger_kernel.ops.cutedsl.ops.fused_linear_cross_entropy_sm90 import (
        liger_fused_linear_cross_entropy_sm90)
    # Its argument order is cce's; mean over targets != -100.
    return lambda e, c, targets: liger_fused_linear_cross_entropy_sm90(e, c, targets)


def liger_cutedsl_unsupported(e: torch.Tensor, c: torch.Tensor, targets: torch.Tensor
                              ) -> Optional[str]:
    """Why Liger's CuTe-DSL SM90 kernel refuses these inputs, or None: it needs a compute
    capability 9.0 GPU, bfloat16 ``e`` and ``c``, and N a multiple of 128, V of 256."""
    if e.dtype != torch.bfloat16 or c.dtype != torch.bfloat16:
        return "needs bfloat16 inputs"
    if targets.shape[0] % 128:
        return f"needs N a multiple of 128 (N = {targets.shape[0]})"
    if c.shape[0] % 256:
        return f"needs V a multiple of 256 (V = {c.shape[0]})"
    if e.device.type != "cuda" or torch.cuda.get_device_capability(e.device) != (9, 0):
        return "needs a compute capability 9.0 GPU"
    return None


# quack's chunk of tokens per step: its default, which its Hopper pipeline needs a multiple of 128.
QUACK_CHUNK_TOKENS = 4096


def _quack_loss() -> Loss:
    from quack.linear_cross_entropy import chunked_linear_cross_entropy
    # Its argument order is cce's; mean over targets != -100. The fused pipeline only: quack's
    # own eligibility test decides which inputs it takes (quack_unsupported).
    return lambda e, c, targets: chunked_linear_cross_entropy(
        e, c, targets, chunk_size=QUACK_CHUNK_TOKENS, use_scaled_exp=True)


def quack_unsupported(e: torch.Tensor, c: torch.Tensor, targets: torch.Tensor
                      ) -> Optional[str]:
    """Why quack's fused ("scaled-exp") Hopper pipeline refuses these inputs, or None, by its
    own test: a compute capability 9.0 GPU, bfloat16, V a multiple of 128 with a tile width
    that divides it."""
    from quack.linear_cross_entropy import scaled_exp_lce_supported
    if scaled_exp_lce_supported(e, c, QUACK_CHUNK_TOKENS, "mean"):
        return None
    return "outside quack's Hopper pipeline (sm90, bf16, V % 128, a tile width dividing V)"


METHODS: dict[str, Method] = {method.name: method for method in (
    # cce_torch (the CPU default) computes float32 logits chunk by chunk: not a GPU method.
    *(Method(v.name, _cce_variant_loss(v.impl, v.options), cce_kernels=v.impl == "cce")
      for v in variants() if v.impl != "cce_torch" or not ON_GPU),
    Method("cce (label_smoothing=0.1)", _cce_variant_loss("cce", {"label_smoothing": 0.1}),
           reference_options={"label_smoothing": 0.1}, cce_kernels=True),
    # The options whose cost the issue bounds (OPTION_COST_LIMITS), on cce's defaults.
    Method("cce (z_loss=1e-4)", _cce_variant_loss("cce", {"z_loss": 1e-4}),
           reference_options={"z_loss": 1e-4}, cce_kernels=True,
           description="mean cross-entropy + 1e-4 * mean lse^2 over the scored tokens"),
    Method("cce (temperature=0.7)", _cce_variant_loss("cce", {"temperature": 0.7}),
           reference_options={"temperature": 0.7}, cce_kernels=True,
           description="mean cross-entropy of the logits / 0.7"),
    Method("cce (return_entropy)", _entropy_bonus_loss,
           reference_options={"entropy_bonus": ENTROPY_BONUS, "entropy_of_ignored": False},
           cce_kernels=True,
           description=f"loss, entropy = f(..., return_entropy=True); loss - {ENTROPY_BONUS:g} "
                       "* the entropy's mean over the scored tokens (an RL entropy bonus over "
                       "the response), differentiated through the entropy"),
    Method("cut_cross_entropy", _apple_cce_loss, needs_cuda=True),
    Method("liger", _liger_loss, needs_cuda=True),
    Method("liger_cutedsl_sm90", _liger_cutedsl_loss, needs_cuda=True,
           unsupported=liger_cutedsl_unsupported,
           description="Liger's CuTe-DSL Hopper kernel (liger_fused_linear_cross_entropy_sm90): "
                       "writes every bf16 logit, dE in the forward"),
    Method("quack_sm90", _quack_loss, needs_cuda=True, unsupported=quack_unsupported,
           description="quack's chunked_linear_cross_entropy, its fused Hopper (scaled-exp) "
                       "pipeline, 4096 tokens per chunk"),
)}
KERNEL_METHODS = tuple(name for name, method in METHODS.items() if method.cce_kernels)
# The limits on the cost of an option: its row's fwd+bwd time over plain cce's on the
# same shape (every shape that measures both; the full run: the named shapes). The issue's
# third bound, no cost when an option is unused, is not one of these rows: plain cce's own
# times (and its fwd+bwd target against torch.compile) against an earlier report show it.
OPTION_COST_LIMITS: dict[str, float] = {
    "cce (z_loss=1e-4)": 1.02,
    "cce (temperature=0.7)": 1.02,
    "cce (return_entropy)": 1.10,
}


def run(quick: bool, out_dir: Path, shapes: Optional[list[str]] = None,
        methods: Optional[list[str]] = None, data_path: Optional[Path] = None,
        repeats: Optional[int] = None) -> WrittenResults:
    """The registered entry point; ``shapes`` default to :data:`FULL_SHAPES` (or
    :data:`QUICK_SHAPES`), ``methods`` to each shape's own (:attr:`Shape.methods`), else all.

    ``data_path``: the Alpaca JSON file for the real-data shapes (None: real_model's default).
    ``repeats``: timed calls per median (None: :func:`timing`'s default).
    """
    shapes = list(QUICK_SHAPES if quick else FULL_SHAPES) if shapes is None else shapes
    how = timing(repeats)

    rows: list[dict[str, Any]] = []
    shape_info: dict[str, dict[str, Any]] = {}
    for shape_name in shapes:
        shape = SHAPES[shape_name]
        shape_info[shape_name], shape_rows = measure_shape(
            shape, methods or shape.methods or list(METHODS), how, data_path=data_path)
        rows += shape_rows

    times = (f"ms, {describe_timing(how)}; fwd with gradients enabled (a training step's "
             "forward); bwd alone after an untimed forward")
    l2_cache_mb = torch.cuda.get_device_properties(DEVICE).L2_cache_size / MIB if ON_GPU else None
    return _report(rows, shape_info, times, out_dir, l2_cache_mb=l2_cache_mb)


def merge(parts: Sequence[Path], out_dir: Path) -> WrittenResults:
    """One report from the ``bench.json`` of runs made in turn (a few ``--shapes`` per command
    where a command's time is limited): their rows and inputs as measured, the ratios and
    targets over all of them. The parts must come from one device and one set of versions, and
    measure shapes no other part does; the merge itself may run anywhere (a CPU machine)."""
    rows: list[dict[str, Any]] = []
    shape_info: dict[str, dict[str, Any]] = {}
    timings = set()
    environments = []
    real_data_transformers = None  # the version that read the real data, if a part did
    dates: list[str] = []
    first_meta: dict[str, Any] = {}
    for part in parts:
        path = Path(part) / f"{NAME}.json"
        if not path.is_file():
            raise ValueError(f"--merge: {path} does not exist")
        results = json.loads(path.read_text())
        env = results["environment"]
        if not environments:
            first_meta = results["meta"]
        else:
            first = environments[0]
            differs = [key for key in ("device", "torch", "triton", "cuda")
                       if env.get(key) != first.get(key)]
            if differs:
                raise ValueError(
                    f"--merge: {path} was measured with another {', '.join(differs)} than "
                    f"{Path(parts[0]) / f'{NAME}.json'} "
                    f"({', '.join(str(env.get(k)) for k in differs)}"
                    f" against {', '.join(str(first.get(k)) for k in differs)})")
        repeated = sorted(set(results["shapes"]) & set(shape_info))
        if repeated:
            raise ValueError(f"--merge: {path} measures {', '.join(repeated)} again")
        shape_info.update(results["shapes"])
        if any(info.get("data", "").startswith("real") for info in results["shapes"].values()):
            real_data_transformers = env.get("transformers")
        rows += results["rows"]
        timings.add(results["meta"]["times"])
        environments.append(env)
        dates += _run_dates(results["meta"], env)
    if len(timings) > 1:
        raise ValueError(f"--merge: the parts were timed differently: {sorted(timings)}")
    # In the benchmark's order of shapes, whatever the order of the parts.
    rows.sort(key=lambda row: list(SHAPES).index(row["shape"]))
    shape_info = {shape: shape_info[shape] for shape in SHAPES if shape in shape_info}
    # Where the parts were measured, as of the last one; the transformers version is that of the
    # part that read the real data (its tokenizer made the inputs), else the first part's.
    measured_in = {**environments[0], "date": max(dates),
                   "transformers": real_data_transformers or environments[0].get("transformers")}
    return _report(rows, shape_info, timings.pop(), out_dir, measured=dates,
                   measured_in=measured_in, l2_cache_mb=first_meta.get("l2_cache_mb"))


def _run_dates(meta: dict[str, Any], environment: dict[str, Any]) -> list[str]:
    """When a part's runs were measured: its own date, or for a part that is itself a merge
    (a shape measured again beside an earlier report), the dates of the runs it merged."""
    merged = meta.get("merged_runs")
    if isinstance(merged, str):
        raise ValueError("--merge: a part is a merged report that names its runs as text (an "
                         "older format); merge that report's own parts instead")
    return list(merged) if merged else [environment["date"]]


def _report(rows: list[dict[str, Any]], shape_info: dict[str, dict[str, Any]],
            times: str, out_dir: Path, measured: Optional[list[str]] = None,
            measured_in: Optional[dict[str, Any]] = None,
            l2_cache_mb: Optional[float] = None) -> WrittenResults:
    """Write bench.json, bench.md and bench.png: the rows with their ratios, the inputs and
    the targets; ``times`` says how the times were measured, ``measured`` when (the dates of
    merged runs; None: now), ``measured_in`` where (merged runs; None: this process), and
    ``l2_cache_mb`` the L2 cache of the GPU that measured them (None: no GPU)."""
    rows = _with_ratios(rows, shape_info)
    targets_report = evaluate_targets(rows, shape_info)
    costs = option_costs(rows)
    env = measured_in or environment()
    meta = {
        "dtype": str(DTYPE).removeprefix("torch."),
        "times": times,
        "memory": "peak MB allocated above what was in use before (the inputs): fwd under "
                  "torch.no_grad; fwd_grad with gradients enabled (state saved for the backward "
                  "included); bwd alone, above what is in use after the forward; fwd_bwd with "
                  "dE and dC included (dE only where the classifier is frozen); GPU only. "
                  "cce's fwd_grad holds a copy of c in position order from N = 4096 where the "
                  "backward takes as much (dC, or a frozen classifier's dE buffer from D "
                  "tokens)",
        "ratios": "speedup_vs_compile = torch_compile fwd_bwd / fwd_bwd; *_vs_gemm = time / "
                  "one e @ c.T",
        "errors": "||x - x64|| / ||x64|| against a float64 reference computed in token "
                  "chunks from the same bfloat16 inputs, reduction='mean', of the row's own "
                  "loss (with its label smoothing, z_loss, temperature or entropy bonus)",
        "backward_path": "the backward that cce's plan chose for the row, from one untimed "
                         "call: one pass, two passes (pass 1 in slots or in whole rows), dE "
                         "alone (frozen classifier), or dense (memory='fast'); 'c by "
                         "position': the tile products read c's rows in position order (the "
                         "forward's sorted copy with keep_tiles on Hopper, or no sorting)",
        "l2_cache_mb": l2_cache_mb,
    }
    if measured is not None:
        meta["merged_runs"] = sorted(measured)
    written = write_results(NAME, rows, meta, out_dir, measured_in=env,
                            kernel_methods={"method": KERNEL_METHODS})
    written = _add_sections(written, shape_info, targets_report, costs, env)
    plot(written.json_path)
    return written


def describe_timing(how: Timing) -> str:
    if ON_GPU:
        return (f"median of {how.repeats} calls after {how.warmup} warm-up calls (CUDA "
                "events)")
    return f"median of {how.repeats} call(s) (CPU smoke test)"


# What this process has measured, for measure_shape: (shape.unlabelled(), data path, timing)
# -> its inputs described, and that key plus a method name -> (row, measured with accuracy).
_SHAPE_INFO: dict[tuple[Shape, Optional[Path], Timing], dict[str, Any]] = {}
_ROWS: dict[tuple[Shape, Optional[Path], Timing, str], tuple[dict[str, Any], bool]] = {}


def measure_shape(shape: Shape, methods: Sequence[str], how: Timing, *,
                  accuracy: bool = True, data_path: Optional[Path] = None
                  ) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The inputs of ``shape`` described, and one row of measurements per method.

    Measures only what this process has not measured yet, with the same inputs (shape sizes
    and data, not its name) and timing: a table that shares a shape with the benchmark costs
    nothing more. ``accuracy=False`` skips the float64 reference and the error columns, unless
    the row was measured with them already; ``accuracy=True`` re-measures a row that was not.
    """
    key = (shape.unlabelled(), data_path, how)
    missing = [name for name in methods
               if (*key, name) not in _ROWS or (accuracy and not _ROWS[(*key, name)][1])]
    info = _SHAPE_INFO.get(key)
    if missing or info is None or (accuracy and "reference_loss" not in info):
        e, c, targets, source = shape_inputs(shape, data_path)
        if info is None:
            info = _describe_inputs(e, c, targets, source, how, shape.ignored_removed)
            log(f"{shape.name}: {info['data']}; "
                + ", ".join(f"{statistic}={value:.4g}"
                            for statistic, value in info["sparsity"].items())
                + f", cce_table={info['cce_table']:.4g}")
        reference = (float64_reference(e, c, targets, classifier_gradient=c.requires_grad)
                     if accuracy else None)
        if reference is not None:
            info["reference_loss"] = float(reference[0])
        _SHAPE_INFO[key] = info
        for name in progress(missing, shape.name, leave=False):
            method = METHODS[name]
            # A method whose loss is more than the plain cross-entropy has a reference of its
            # own (Method.reference_options).
            method_reference = (float64_reference(e, c, targets,
                                                  classifier_gradient=c.requires_grad,
                                                  **method.reference_options)
                                if reference is not None and method.reference_options
                                else reference)
            _ROWS[(*key, name)] = (_measure(method, shape, e, c, targets, method_reference, how),
                                   accuracy)
            del method_reference
        del e, c, targets, reference
        if ON_GPU:
            torch.cuda.empty_cache()
    rows = [{"shape": shape.name, "method": name, **_ROWS[(*key, name)][0]} for name in methods]
    return {"description": shape_description(shape, info["data"]), **info}, rows


def shape_description(shape: Shape, data: str) -> str:
    """The shape's description; a real-data shape measured on synthetic inputs (the model not
    importable) is named by its model's sizes, not by the data it did not see."""
    if shape.data.startswith("alpaca") and data.startswith("synthetic"):
        return shape.description.replace(REAL_DATA, REAL_DATA_SIZES)
    return shape.description


def forget_measurements() -> None:
    """Empty the memo of :func:`measure_shape` (and the cached real-model inputs)."""
    _SHAPE_INFO.clear()
    _ROWS.clear()
    _alpaca_batch.cache_clear()


@dataclass(frozen=True)
class TargetCheck:
    """One of the issue's targets: ``value <= limit`` on one shape."""

    target: str
    shape: str
    value: Optional[float]
    limit: Optional[float]
    note: str = ""

    @property
    def status(self) -> str:
        if self.value is None or self.limit is None or math.isnan(self.value):
            return "NOT MEASURED"
        return "MET" if self.value <= self.limit else "MISSED"


# The targets (issue 20) for impl="cce" with its defaults, all in this table.
# Shape -> limit of cce's fwd+bwd time over torch.compile's.
FWD_BWD_VS_COMPILE: dict[str, float] = {
    "gemma3": 0.6,  # real Alpaca hidden states
    "gemma2_2b": 0.65,
    "llama3_8b": 0.85,
    "phi3_5_mini": 1.0,
    "llama3_8b_n1024": 1.0,
    "llama3_8b_n4096": 1.0,
    "llama3_8b_n16384": 1.0,
    "llama3_8b_n32768": 1.0,
    "gemma2_2b_frozen": 0.8,  # dE-only backward
}
# On every measured shape:
FORWARD_VS_GEMM = 1.15  # forward time over one GEMM e @ c.T
FORWARD_MEMORY_MB = 1.0  # forward under torch.no_grad, above the inputs
BACKWARD_MEMORY_SLACK = 0.01  # fwd+bwd memory <= gradients * (1 + slack) + BACKWARD_MEMORY_MB
BACKWARD_MEMORY_MB = 16.0
GRADIENT_ERROR = 4e-3  # dE and dC against float64 ...
GRADIENT_ERROR_VS_COMPILE = 1.0  # ... and at most this times torch.compile's

# The gradients a backward computes, with their error columns; a frozen classifier has no dC.
GRADIENTS = (("dE", "de_rel_err"), ("dC", "dc_rel_err"))


def evaluate_targets(rows: list[dict[str, Any]], shape_info: dict[str, dict[str, Any]]
                     ) -> list[TargetCheck]:
    """The issue's targets for ``impl="cce"`` (its defaults), on the shapes that were measured.

    The fwd+bwd targets name their shape; the forward time, memory and gradient-error targets
    apply to every measured shape. A quantity that is missing (a shape or method that was not
    run or failed, a CPU run's memory) makes its target NOT MEASURED rather than MET or MISSED.
    """
    by_key = {(row["shape"], row["method"]): row for row in rows}
    checks: list[TargetCheck] = []

    def value(shape: str, method: str, column: str) -> Optional[float]:
        return by_key.get((shape, method), {}).get(column)

    def ratio(numerator: Optional[float], denominator: Optional[float]) -> Optional[float]:
        return None if numerator is None or not denominator else numerator / denominator

    for shape, limit in FWD_BWD_VS_COMPILE.items():
        checks.append(TargetCheck(f"fwd+bwd <= {limit:g}x torch.compile", shape,
                                  ratio(value(shape, "cce", "fwd_bwd_ms"),
                                        value(shape, "torch_compile", "fwd_bwd_ms")),
                                  limit, shape_info.get(shape, {}).get("data", "shape not run")))

    for shape, info in shape_info.items():
        checks.append(TargetCheck(f"forward <= {FORWARD_VS_GEMM:g}x one GEMM", shape,
                                  ratio(value(shape, "cce", "fwd_ms"), info["gemm_ms"]),
                                  FORWARD_VS_GEMM, f"one GEMM: {info['gemm_ms']:.3g} ms"))
        checks.append(TargetCheck(
            f"forward memory (no_grad) <= {FORWARD_MEMORY_MB:g} MB above inputs", shape,
            value(shape, "cce", "fwd_peak_mb"), FORWARD_MEMORY_MB))
        gradients = GRADIENTS[:1] if info["frozen_classifier"] else GRADIENTS
        gradients_mb = info["gradients_mb"]
        # The same bound with a frozen classifier: the dE-only backward may use the memory dC
        # would take as its scratch (docs/design.md).
        checks.append(TargetCheck(
            f"fwd+bwd memory <= dE + dC + {BACKWARD_MEMORY_SLACK:.0%} + "
            f"{BACKWARD_MEMORY_MB:g} MB", shape, value(shape, "cce", "fwd_bwd_peak_mb"),
            gradients_mb * (1 + BACKWARD_MEMORY_SLACK) + BACKWARD_MEMORY_MB,
            f"dE + dC = {gradients_mb:.4g} MB"
            + ("; classifier frozen: dC not returned, its size is scratch"
               if info["frozen_classifier"] else "")))
        for name, column in gradients:
            compiled = value(shape, "torch_compile", column)
            limit = (None if compiled is None
                     else min(GRADIENT_ERROR, GRADIENT_ERROR_VS_COMPILE * compiled))
            checks.append(TargetCheck(
                f"{name} error <= {GRADIENT_ERROR:g} and <= {GRADIENT_ERROR_VS_COMPILE:g}x "
                "torch.compile's", shape, value(shape, "cce", column), limit,
                "" if compiled is None else f"torch.compile: {compiled:.2e}"))
    return checks


def shape_inputs(shape: Shape, data_path: Optional[Path] = None
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, str]:
    """``(e, c, targets, data source)`` on DEVICE; real hidden states when they can be had.
    ``c`` requires a gradient unless the shape's classifier is frozen.

    The real model runs once per process (its hidden states are kept for the next real-data
    shape); without it, a real-data shape falls back to synthetic inputs and says so.
    """
    if not shape.data.startswith("alpaca"):
        return (*_synthetic_inputs(shape, shape.ignored_fraction),
                "synthetic LM-like (experiments.synthetic, calibrated)"
                + _ignored_note(shape.ignored_fraction))
    masked = shape.data == "alpaca_masked"
    try:
        batch = _alpaca_batch(shape.n_tokens, data_path)
    except ImportError as error:
        reason = f"real model not importable ({type(error).__name__}: {error})"
        log(f"{shape.name}: {reason}; using synthetic LM-like inputs")
        ignored_fraction = ALPACA_IGNORED_FRACTION if masked else 0.0
        return (*_synthetic_inputs(shape, ignored_fraction),
                f"synthetic LM-like{_ignored_note(ignored_fraction)}: {reason}")
    targets = batch.loss_targets(mask_prompt=masked)  # one cached batch serves both variants
    # New leaves: the cached batch itself never records a gradient.
    return (batch.e.detach().requires_grad_(),
            batch.c.detach().requires_grad_(not shape.frozen_classifier), targets,
            "real: Gemma 3 270M final hidden states on Alpaca"
            + (", prompt tokens ignored" if masked else ""))


@functools.lru_cache(maxsize=1)
def _alpaca_batch(n_tokens: int, data_path: Optional[Path]) -> Any:
    """Gemma 3 270M's hidden states on Alpaca (a minute on GPU): computed once per process."""
    # Imported here: it needs transformers, gguf and the model package.
    from experiments.real_model import alpaca_batch
    return alpaca_batch(n_tokens, device=DEVICE, dtype=DTYPE, data_path=data_path)


def alpaca_ignored_fraction(n_tokens: int, data_path: Optional[Path] = None
                            ) -> Optional[float]:
    """Fraction of the targets that prompt masking ignores in the first ``n_tokens`` Alpaca
    tokens (the prompts and the sequence ends); None when the real model is not importable."""
    try:
        batch = _alpaca_batch(n_tokens, data_path)
    except ImportError:
        return None
    return 1 - float(batch.response.float().mean())


def _synthetic_inputs(shape: Shape, ignored_fraction: float
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """LM-like inputs of the shape's size, ``ignored_fraction`` of the rows (seeded) ignored,
    ``c`` frozen if the shape's classifier is."""
    e, c, targets = lm_like_inputs(shape.n_tokens, shape.vocab_size, shape.dim, dtype=DTYPE,
                                   device=DEVICE)
    c.requires_grad_(not shape.frozen_classifier)
    generator = torch.Generator(device=DEVICE).manual_seed(0)
    ignored_rows = torch.randperm(shape.n_tokens, generator=generator, device=DEVICE)
    targets[ignored_rows[:round(ignored_fraction * shape.n_tokens)]] = IGNORE_INDEX
    return e, c, targets


def _ignored_note(ignored_fraction: float) -> str:
    return f", {ignored_fraction:.0%} of targets ignored at random rows" if ignored_fraction else ""


def remove_ignored_tokens(loss: Loss, targets: torch.Tensor) -> Loss:
    """``loss`` on the rows whose target is not ignored only (the paper's Appendix A).

    The rows to keep are found here, once, from ``targets`` (what a data loader knows before the
    step). The returned loss gathers them from ``e`` inside autograd, so the gradient of ``e``
    is the full (N, D) tensor that training needs, zero at ignored rows; the gather and its
    backward are part of what a benchmark of the returned loss measures.
    """
    kept_rows = (targets != IGNORE_INDEX).nonzero().squeeze(1)

    def loss_on_kept_rows(e: torch.Tensor, c: torch.Tensor, targets: torch.Tensor
                          ) -> torch.Tensor:
        return loss(e.index_select(0, kept_rows), c, targets.index_select(0, kept_rows))
    return loss_on_kept_rows


def _describe_inputs(e: torch.Tensor, c: torch.Tensor, targets: torch.Tensor, source: str,
                     how: Timing, ignored_removed: bool) -> dict[str, Any]:
    input_bytes = e.numel() * e.element_size() + c.numel() * c.element_size()
    # dE and dC have the shapes and dtype of e and c (dC's size also when c is frozen: the
    # memory bound is the same).
    gradient_bytes = input_bytes
    return {
        "n_tokens": e.shape[0], "vocab_size": c.shape[0], "dim": c.shape[1],
        "valid_tokens": int((targets >= 0).sum()),
        "data": source,
        "inputs_mb": input_bytes / MIB,
        "gradients_mb": gradient_bytes / MIB,
        "frozen_classifier": not c.requires_grad,
        "sparsity": sparsity_statistics(e, c, targets),
        # The losses of a shape with its ignored rows removed see the other rows only.
        "cce_table": (cce_table_fraction(e[targets >= 0], c, targets[targets >= 0])
                      if ignored_removed else cce_table_fraction(e, c, targets)),
        "gemm_ms": _time_gemm(e, c, how),
    }


def cce_table_fraction(e: torch.Tensor, c: torch.Tensor, targets: torch.Tensor) -> float:
    """Fraction of the live grid's tiles that cce's backward recomputes (its table: the tiles
    that the forward's bounds cannot prove negligible) for a mean loss over these inputs, with
    the default filter and sorting; ``tiles_nonempty_sorted`` is the least it could be."""
    eps = default_filter_eps(e.dtype)
    targets = torch.where(targets >= 0, targets, -1)  # cce's canonical targets
    with torch.no_grad():
        plan = forward_outputs(filter_eps=eps, vocab_sorting=True, softcap=None,
                               label_smoothing=0.0, needs_grad=True)
        forward = forward_kernels(e, c, None, targets, None, plan)
        table = recompute_table(forward.tile_bound, forward.lse, (targets >= 0).float(),
                                forward.target_positions, e.dtype, eps)
    return float(table.ne(0).float().mean())


def _time_gemm(e: torch.Tensor, c: torch.Tensor, how: Timing) -> float:
    with torch.no_grad():
        return time_fn(lambda: e @ c.T, **asdict(how))


def _measure(method: Method, shape: Shape, e: torch.Tensor, c: torch.Tensor,
             targets: torch.Tensor,
             reference: Optional[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
             how: Timing) -> dict[str, Any]:
    if method.needs_cuda and not ON_GPU:
        return {"skipped": "needs a CUDA device"}
    try:
        loss_fn = method.loss()
    except ImportError as error:
        return {"skipped": f"not installed ({error})"}
    except Exception as error:  # installed but broken (a version clash): the others still run
        return {"error": f"{type(error).__name__}: {error}"}
    if method.unsupported is not None:
        seen = targets[targets != IGNORE_INDEX] if shape.ignored_removed else targets
        reason = method.unsupported(e, c, seen)
        if reason is not None:
            return {"skipped": reason}
    if shape.ignored_removed:
        loss_fn = remove_ignored_tokens(loss_fn, targets)
    row = measure_loss(loss_fn, e, c, targets, reference, asdict(how))
    if method.cce_kernels and "error" not in row:
        row["backward_path"] = backward_path(loss_fn, e, c, targets)
    return row


def backward_path(loss_fn: Loss, e: torch.Tensor, c: torch.Tensor,
                  targets: torch.Tensor) -> str:
    """Which backward a cce call takes here, from one untimed forward + backward: the tile
    backward's plan in words (:attr:`cce.backward.plan.BackwardPlan.path`), "dense" (the
    dense path of ``memory="fast"``), "chunked PyTorch", or :data:`MISSING`."""
    from cce.backward import plan

    with plan.forced() as plans:
        loss = loss_fn(e, c, targets)
        functions = _functions_in_graph(loss.grad_fn, set())
        torch.autograd.grad(loss, (e, c) if c.requires_grad else (e,))
    tile_plans = [made for made in plans if isinstance(made, plan.BackwardPlan)]
    if tile_plans:
        return tile_plans[0].path
    if any("Dense" in name for name in functions):
        return "dense"
    return "chunked PyTorch" if any("Chunked" in name for name in functions) else MISSING


def _functions_in_graph(node: Any, seen: "set[Any]") -> "set[str]":
    """The class names of ``node`` and of every autograd node it reaches."""
    if node is None or node in seen:
        return set()
    seen.add(node)
    return {type(node).__name__}.union(*(_functions_in_graph(parent, seen)
                                         for parent, _ in node.next_functions))


# The result table's columns, in this order (a row has those it measured).
COLUMNS = ("shape", "method", "fwd_ms", "bwd_ms", "fwd_bwd_ms", "fwd_peak_mb", "fwd_grad_peak_mb",
           "bwd_peak_mb", "fwd_bwd_peak_mb", "speedup_vs_compile", "fwd_vs_gemm",
           "fwd_bwd_vs_gemm", "loss_rel_err", "de_rel_err", "dc_rel_err", "backward_path",
           "skipped", "error")


def _with_ratios(rows: list[dict[str, Any]], shape_info: dict[str, dict[str, Any]]
                 ) -> list[dict[str, Any]]:
    """The rows with their time ratios to torch.compile and to one GEMM, columns in order."""
    compiled = {row["shape"]: row.get("fwd_bwd_ms") for row in rows
                if row["method"] == "torch_compile"}
    finished = []
    for row in rows:
        row = dict(row)
        if "fwd_bwd_ms" in row:
            if compiled.get(row["shape"]):
                row["speedup_vs_compile"] = compiled[row["shape"]] / row["fwd_bwd_ms"]
            gemm_ms = shape_info[row["shape"]]["gemm_ms"]
            row["fwd_vs_gemm"] = row["fwd_ms"] / gemm_ms
            row["fwd_bwd_vs_gemm"] = row["fwd_bwd_ms"] / gemm_ms
        finished.append({column: row[column] for column in COLUMNS if column in row})
    return finished


def _add_sections(written: WrittenResults, shape_info: dict[str, dict[str, Any]],
                  checks: list[TargetCheck], costs: list[dict[str, Any]],
                  env: dict[str, Any]) -> WrittenResults:
    """Add the per-shape inputs, the targets and the cost of options to the JSON and Markdown
    files; ``env``: where the rows were measured (how the report names kernel methods)."""
    real = REAL_DATA_STATISTICS
    lines = ["", "## Inputs", "",
             "Sparsity: softmax entries >= 2^-12 per row, the fraction of 128 x 128 tiles "
             "holding one or more, in vocabulary order and sorted, and the share of each row's "
             "probability mass in those entries, the rest being what the filter can drop "
             f"(Alpaca on Gemma 3 270M: {real['entries_per_row']:.0f}, "
             f"{real['tiles_nonempty']:.0%}, {real['tiles_nonempty_sorted']:.0%}, "
             f"{real['mass_above_eps']:.1%}). cce's table: the tiles that cce's backward "
             "recomputes, those its forward's bounds cannot prove negligible (at least the "
             "sorted tiles, more where the bound is loose).", "",
             "| shape | N x V x D | valid tokens | data | inputs MB | entries/row | tiles "
             "| tiles sorted | mass in entries >= 2^-12 | cce's table | one GEMM ms "
             "| reference loss |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, info in shape_info.items():
        sparsity = info["sparsity"]
        lines.append(
            f"| {name} | {info['n_tokens']} x {info['vocab_size']} x {info['dim']} | "
            f"{info['valid_tokens']} | {_cell(info['data'])} | {info['inputs_mb']:.4g} | "
            f"{sparsity['entries_per_row']:.0f} | {sparsity['tiles_nonempty']:.1%} | "
            f"{sparsity['tiles_nonempty_sorted']:.1%} | {sparsity['mass_above_eps']:.1%} | "
            f"{info['cce_table']:.1%} | "
            f"{info['gemm_ms']:.3g} | "
            f"{info['reference_loss']:.4f} |")
    lines += ["", "## Targets (impl=\"cce\")", "", "| status | target | shape | value | limit "
              "| note |", "|---|---|---|---|---|---|"]
    lines += [f"| {check.status} | {check.target} | {check.shape} | {_number(check.value)} | "
              f"{_number(check.limit)} | {_cell(check.note)} |" for check in checks]
    lines += option_cost_lines(costs, env)
    targets = [{"target": check.target, "shape": check.shape, "value": check.value,
                "limit": check.limit, "status": check.status, "note": check.note}
               for check in checks]
    return add_sections(written, {"shapes": shape_info, "targets": targets,
                                  "option_costs": costs}, lines)


def option_costs(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The cost of each option of :data:`OPTION_COST_LIMITS` on every shape that has its row:
    its fwd+bwd time, plain cce's on the same shape, their ratio, the limit and its status
    (NOT MEASURED without either time), and the option's errors against its own float64
    reference. Option by option, shapes in the rows' order."""
    by_key = {(row["shape"], row["method"]): row for row in rows}
    shapes = list(dict.fromkeys(row["shape"] for row in rows))
    costs = []
    for option, limit in OPTION_COST_LIMITS.items():
        for shape in shapes:
            row = by_key.get((shape, option))
            if row is None:
                continue
            option_ms = row.get("fwd_bwd_ms")
            cce_ms = by_key.get((shape, "cce"), {}).get("fwd_bwd_ms")
            ratio = option_ms / cce_ms if option_ms and cce_ms else None
            check = TargetCheck(f"fwd+bwd <= {limit:g}x cce", shape, ratio, limit)
            costs.append({"option": option, "shape": shape, "fwd_bwd_ms": option_ms,
                          "cce_fwd_bwd_ms": cce_ms, "ratio_to_cce": ratio, "limit": limit,
                          "status": check.status,
                          **{column: row[column] for column in
                             ("loss_rel_err", "de_rel_err", "dc_rel_err", "skipped", "error")
                             if column in row}})
    return costs


def option_cost_lines(costs: list[dict[str, Any]], env: dict[str, Any]) -> list[str]:
    """The report's "Cost of options" section: a line per option and shape, then what each
    option's row computes. No lines when no option was measured."""
    if not costs:
        return []
    limits = ", ".join(f"{option.removeprefix('cce (').removesuffix(')')} <= {limit:g}x"
                       for option, limit in OPTION_COST_LIMITS.items())
    lines = ["", "## Cost of options (impl=\"cce\")", "",
             "Each option on cce's defaults against plain cce on the same shape (same inputs "
             f"and timing): fwd+bwd time and its ratio to cce's, the issue's limit ({limits}), "
             "and the errors against the option's own float64 reference.", "",
             "| status | option | shape | fwd+bwd ms | cce fwd+bwd ms | ratio to cce | target "
             "| loss error | dE error | dC error |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for cost in costs:
        errors = [MISSING if cost.get(column) is None else f"{cost[column]:.2e}"
                  for column in ("loss_rel_err", "de_rel_err", "dc_rel_err")]
        status = cost["status"]
        if cost.get("error") or cost.get("skipped"):
            status += f" ({_cell(cost.get('error') or cost['skipped'])})"
        lines.append(
            f"| {status} | {shown_method(cost['option'], env)} | {cost['shape']} | "
            f"{_number(cost['fwd_bwd_ms'])} | {_number(cost['cce_fwd_bwd_ms'])} | "
            f"{_number(cost['ratio_to_cce'])} | <= {cost['limit']:g}x | {' | '.join(errors)} |")
    lines += [""] + [f"- {shown_method(option, env)}: {METHODS[option].description}"
                     for option in dict.fromkeys(cost["option"] for cost in costs)
                     if METHODS[option].description]
    return lines


def _number(value: Optional[float]) -> str:
    return MISSING if value is None else f"{value:.3g}"


def _cell(text: str) -> str:
    """Text that cannot break a Markdown table row (an error message may hold a pipe)."""
    return text.replace("|", "\\|").replace("\n", " ")


def plot(json_path: Path, path: Optional[Path] = None) -> None:
    """Draw :func:`bench_figure` from a written ``bench.json`` into ``path`` (default: ``bench.png``
    beside it); a report measured elsewhere can be redrawn on any machine."""
    import matplotlib

    matplotlib.use("Agg")  # no display on a benchmark machine
    import matplotlib.pyplot as plt

    drawn = bench_figure(json.loads(json_path.read_text()))
    drawn.savefig(path or json_path.with_suffix(".png"), dpi=150)
    plt.close(drawn)


def bench_figure(results: dict[str, Any]) -> Any:
    """Grouped bars of the forward+backward time of every method per shape, one GEMM as a
    dashed line, from the contents of ``bench.json``: a matplotlib Figure.

    A panel per set of methods measured, so that each reads on a laptop's screen: every method
    on the named shapes, then cce and torch.compile alone on the N sweep and the frozen
    classifier. A method's color is the same in every panel. The rows of
    :data:`OPTION_COST_LIMITS` are left out: within a few percent of cce's bar, they would
    only crowd it; the report's "Cost of options" gives their ratios to cce.
    """
    import matplotlib.pyplot as plt

    env, shape_info = results["environment"], results["shapes"]
    times = {(row["shape"], row["method"]): row["fwd_bwd_ms"] for row in results["rows"]
             if row.get("fwd_bwd_ms") and row["method"] not in OPTION_COST_LIMITS}
    # Methods that were skipped or failed everywhere get no slot in the groups.
    methods = list(dict.fromkeys(method for _, method in times))
    shown = {method: shown_method(method, env) if method in KERNEL_METHODS else method
             for method in methods}
    panels: dict[tuple[str, ...], list[str]] = {}
    for shape in shape_info:
        measured = tuple(method for method in methods if (shape, method) in times)
        panels.setdefault(measured, []).append(shape)
    # tab10 alone would repeat its colors from the eleventh method on.
    palette = plt.get_cmap("tab10").colors + plt.get_cmap("Dark2").colors
    colors = {method: palette[index % len(palette)] for index, method in enumerate(methods)}
    drawn, axes = plt.subplots(len(panels), 1, squeeze=False, layout="constrained",
                               figsize=(12, max(4.5, 1 + 3.1 * len(panels))))
    for index, (axis, (panel_methods, shapes)) in enumerate(zip(axes[:, 0], panels.items())):
        width = 0.8 / max(1, len(panel_methods))
        for slot, method in enumerate(panel_methods):
            axis.bar([i - 0.4 + width * (slot + 0.5) for i in range(len(shapes))],
                     [times[shape, method] for shape in shapes], width, color=colors[method],
                     label=shown[method])
        for i, shape in enumerate(shapes):
            axis.hlines(shape_info[shape]["gemm_ms"], i - 0.42, i + 0.42, colors="black",
                        linestyles="--", label="one GEMM e @ c.T" if i == 0 else None)
        axis.set_xticks(range(len(shapes)), [_shape_label(shape_info[s]) for s in shapes],
                        fontsize=10)
        axis.set_yscale("log")
        label_log_axis(axis)
        axis.set_ylabel("forward + backward, ms")
        axis.grid(True, axis="y", which="major", alpha=0.3)
        if len(panels) > 1:
            axis.set_title(f"({'abcdefgh'[index]}) "
                           + ("every method" if len(panel_methods) == len(methods)
                              else "only " + " and ".join(map(shown.get, panel_methods))),
                           fontsize=11, loc="left")
    legend = {label: handle for axis in axes[:, 0]
              for handle, label in zip(*axis.get_legend_handles_labels())}
    # Centred: clear of the title.
    drawn.legend(legend.values(), legend.keys(), loc="outside right center", fontsize=10)
    drawn.suptitle(f"Linear cross-entropy, bfloat16, log scale ({device_label(env)})",
                   fontsize=12)
    return drawn


def _shape_label(info: dict[str, Any]) -> str:
    """A shape's x label: its description, sizes, and inputs (a real-data shape falls back to
    synthetic inputs without the model)."""
    data = info["data"].split(":")[0].split(" (")[0].split(",")[0]
    # The N sweep's descriptions name N, which the sizes' line gives.
    description = info["description"].removesuffix(f", N={info['n_tokens']}")
    return (f"{textwrap.fill(description, 18)}\n"
            f"N={info['n_tokens']}, D={info['dim']}\nV={info['vocab_size']}\n{data}")


def add_repeats_argument(parser: argparse.ArgumentParser) -> None:
    """``--repeats N``, checked by :func:`timing` when the arguments are parsed."""
    def repeats(text: str) -> int:
        if not text.isdigit():
            raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}")
        try:
            timing(int(text))
        except ValueError as error:
            raise argparse.ArgumentTypeError(str(error)) from None
        return int(text)

    parser.add_argument("--repeats", type=repeats, metavar="N",
                        help=f"timed calls per median (default: {GPU_REPEATS} on a GPU, at least "
                             f"{MIN_GPU_REPEATS}, after {GPU_WARMUP} warm-up calls; 1 on a CPU)")


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m experiments.bench",
                                     description=__doc__.split("\n\n")[0])
    add_run_arguments(parser, f"{NAME}.json, {NAME}.md and {NAME}.png")
    parser.add_argument("--shapes", nargs="+", choices=list(SHAPES), metavar="SHAPE",
                        help=f"shapes to run, of: {', '.join(SHAPES)}")
    parser.add_argument("--methods", nargs="+", choices=list(METHODS), metavar="METHOD",
                        help=f"methods to run (default: all; only {', '.join(TARGET_METHODS)} "
                             "on the shapes measured for the targets alone), of: "
                             f"{', '.join(repr(m) for m in METHODS)}")
    parser.add_argument("--merge", nargs="+", type=Path, metavar="DIR",
                        help="measure nothing: write one report from the bench.json in each DIR "
                             "(runs of a few --shapes each, on one device)")
    add_data_argument(parser)
    add_repeats_argument(parser)
    args = parser.parse_args(argv)
    if args.merge and (args.shapes or args.methods or args.repeats):
        parser.error("--merge measures nothing: it takes no --shapes, --methods or --repeats")
    quick, out_dir = run_mode(args, measures=not args.merge)
    measure = (functools.partial(merge, args.merge, out_dir) if args.merge else
               functools.partial(run, quick, out_dir, shapes=args.shapes, methods=args.methods,
                                 data_path=args.data, repeats=args.repeats))
    outcome, errors = run_experiment(NAME, out_dir, measure, measures=not args.merge)
    return finish([outcome], errors, out_dir)


if __name__ == "__main__":
    sys.exit(main())
