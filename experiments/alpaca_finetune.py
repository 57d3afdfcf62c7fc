"""alpaca_finetune: the paper's Fig. 4, fine-tuning with CCE against torch.compile's loss.

Fine-tunes the pretrained Gemma 3 270M (:mod:`experiments.real_model`) on the Alpaca subset
(:mod:`experiments.alpaca_data`: the Alpaca prompt, prompt tokens ignored by the loss) with the
loss of :func:`cce.integrations.transformers.patch` computed three ways:

- ``cce``: the CCE kernels with gradient filtering and vocabulary sorting (the defaults);
- ``torch_compile``: materialized logits under torch.compile, the paper's control;
- ``cce_no_filter``: the CCE kernels without gradient filtering (``filter_eps=None``).

For one seed every implementation starts from the same weights and sees the same batches in the
same order; the seed sets that order and seeds torch's generator, so implementations are
compared seed by seed (paired). 5 seeds, as in the paper.

Precision: float32 weights and AdamW state, forward under ``torch.autocast(bfloat16)``. The
paper's runs (the reference's ``training/train.py``: Trainer with ``bf16=True`` on a model
loaded in bfloat16) keep bfloat16 weights, but at lr 2e-5 an AdamW update (about lr per
weight) is below half a bfloat16 spacing for 79% of this model's weights (its median |w| is
0.021): pure bfloat16 would round most updates away, and the curves would show rounding rather
than the loss. The loss sees what it sees in the paper: under autocast the integration casts
the final hidden states and the (tied) lm_head weight to bfloat16, so
``cce.linear_cross_entropy`` gets bfloat16 ``e`` and ``c`` (filter threshold 2^-12) and returns
a float32 loss, whose gradient flows back through the cast into the float32 weight. Memory is
no concern at 270M parameters: 16 bytes each with AdamW, 4.3 GB.

Hyper-parameters, sized so that 3 implementations x 5 seeds, with the model load and the
compilations, take about 6 minutes on one H200 (a median step of 138-144 ms measured there,
``results/alpaca_finetune.md``; ``--steps`` scales it): 150
steps of 8 examples (1,200 of the 5,000, none seen twice), examples truncated to 512 tokens (2
of the 5,000 are longer), each batch padded on the right to a multiple of 64 tokens, so that
torch.compile (fixed shapes) compiles at most 8 shapes rather than one per batch length, for
under 64 padded tokens per row (Alpaca examples average 110 tokens). Learning rate 2e-5
(Stanford Alpaca's) with the reference's Trainer schedule and defaults: linear warm-up over the
first 5% of the steps (the first step at lr 0, as in Trainer), linear decay to 0, AdamW betas
(0.9, 0.999) and eps 1e-8, no weight decay, gradient norm clipped to 1.0.

Recorded for every step: the loss the model returns (the mean over the batch's response
tokens), the gradient norm before clipping, and the time of the whole step (forward, backward,
clipping and optimizer step, between two device synchronizations); for every run the peak GPU
memory (``torch.cuda.max_memory_allocated``: weights, gradients, AdamW state, activations and
the loss). A run that raises (out of memory, a kernel error) becomes its implementation's
``"error"`` and the others go on.

Quick mode is a CPU smoke test, not the experiment: in Triton's interpreter one CCE forward of
128 tokens over the real 262,144-entry vocabulary takes over 10 minutes, so it trains a tiny
randomly initialised Gemma 3 (vocabulary of 259: pad, EOS, BOS and the 256 bytes) on the UTF-8
bytes of the same Alpaca examples, through the same prompt masking, padding, loss and training
loop, for 3 steps of 2 seeds. Its files say so.
"""

from __future__ import annotations

import argparse
import copy
import gc
import math
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence

import torch

from cce.integrations.transformers import patch
from experiments.alpaca_data import (IGNORE_INDEX, add_data_argument, load_alpaca,
                                     tokenize_examples)
from experiments import harness
from experiments.harness import (DEVICE, ON_GPU, WrittenResults, device_label, environment, log,
                                 progress, shown_method, write_results)
from experiments.real_model import load_model

if TYPE_CHECKING:
    from transformers import Gemma3ForCausalLM, PreTrainedModel

NAME = "alpaca_finetune"
FIGURE = "fig4_alpaca_loss.png"

# name -> keyword arguments of cce.integrations.transformers.patch
IMPLEMENTATIONS: dict[str, dict[str, Any]] = {
    "cce": {"impl": "cce", "filter_eps": "auto", "vocab_sorting": True},
    "torch_compile": {"impl": "torch_compile"},
    "cce_no_filter": {"impl": "cce", "filter_eps": None},
}
BASELINE = "torch_compile"
# Those that run cce's Triton kernels (in Triton's interpreter on a CPU).
KERNEL_IMPLEMENTATIONS = tuple(name for name, options in IMPLEMENTATIONS.items()
                               if options["impl"] == "cce")
# Curves that coincide stay visible: the baseline dashed, the exact CCE dotted.
STYLES = {"cce": dict(color="#1f77b4", linestyle="-"),
          "torch_compile": dict(color="black", linestyle="--"),
          "cce_no_filter": dict(color="#ff7f0e", linestyle=":")}

REAL_MODEL = "gemma3-270m"
TINY_MODEL = "tiny-gemma3"
FULL_STEPS, FULL_SEEDS = 150, 5
QUICK_STEPS, QUICK_SEEDS = 3, 2
FINAL_STEPS = 10  # the final loss is the mean over the last 10 steps
WARMUP_RATIO = 0.05
MAX_GRAD_NORM = 1.0


@dataclass(frozen=True)
class TrainingSetup:
    """How a model is fine-tuned, apart from the number of steps and seeds."""

    description: str
    batch_size: int  # sequences per step
    max_length: int  # tokens per example, after truncation
    pad_multiple: int  # batches are right-padded to a multiple of it: few shapes to compile
    learning_rate: float


SETUPS = {
    REAL_MODEL: TrainingSetup(
        description="Gemma 3 270M, pretrained (Q4_K_M GGUF, dequantized to float32)",
        batch_size=8, max_length=512, pad_multiple=64, learning_rate=2e-5),
    TINY_MODEL: TrainingSetup(
        description="SMOKE TEST, NOT THE EXPERIMENT: a tiny randomly initialised Gemma 3 "
                    "(tiny_gemma3) on the UTF-8 bytes of the Alpaca examples",
        # One padded shape (320 bytes) compiles once; a random model needs a larger rate to
        # move in 3 steps.
        batch_size=2, max_length=320, pad_multiple=320, learning_rate=1e-3),
}


class ByteTokenizer:
    """UTF-8 bytes as token ids after pad (0), EOS (1) and BOS (2); BOS first unless
    ``add_special_tokens=False``. The part of a Hugging Face tokenizer's interface that
    :func:`experiments.alpaca_data.tokenize_examples` uses."""

    pad_token_id, eos_token_id, bos_token_id = 0, 1, 2
    vocab_size = 3 + 256

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict[str, list[int]]:
        specials = [self.bos_token_id] if add_special_tokens else []
        return {"input_ids": specials + [3 + byte for byte in text.encode()]}


def tiny_gemma3() -> Gemma3ForCausalLM:
    """A 2-layer Gemma 3 for :class:`ByteTokenizer`'s ids, the same weights on every call."""
    # Imported here, as everywhere in experiments: transformers is an optional dependency,
    # needed only by what uses it.
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    tokenizer = ByteTokenizer()
    config = Gemma3TextConfig(
        vocab_size=tokenizer.vocab_size, hidden_size=32, intermediate_size=64,
        num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id)
    torch.manual_seed(0)
    return Gemma3ForCausalLM(config)


def load(model_name: str) -> tuple[PreTrainedModel, Any]:
    """``(model, tokenizer)``: the initial weights, in float32 on the CPU, unpatched."""
    if model_name == REAL_MODEL:
        return load_model("cpu", torch.float32)
    return tiny_gemma3(), ByteTokenizer()


@dataclass(frozen=True)
class RunResult:
    """One implementation trained with one seed: per-step values, in step order."""

    implementation: str
    seed: int
    losses: list[float]
    grad_norms: list[float]  # before clipping
    step_ms: list[float]
    peak_memory_mb: Optional[float]  # GPU only


def trainable_examples(tokenizer: Any, records: list[dict], max_length: int) -> list[dict]:
    """Tokenized examples with prompt labels -100, less those whose response was truncated
    away: a batch of them alone would have no token to average the loss over."""
    examples = [example for example in tokenize_examples(tokenizer, records, max_length)
                if bool((example["labels"] != IGNORE_INDEX).any())]
    if not examples:
        raise ValueError(f"--data: none of the {len(records)} examples keeps a response token "
                         f"within {max_length} tokens: nothing to train on")
    return examples


def collate(examples: Sequence[dict], pad_id: int, pad_multiple: int) -> dict[str, torch.Tensor]:
    """``input_ids``, ``attention_mask`` and ``labels`` padded on the right (labels with -100)
    to the longest example rounded up to a multiple of ``pad_multiple``."""
    longest = max(len(example["input_ids"]) for example in examples)
    length = math.ceil(longest / pad_multiple) * pad_multiple
    input_ids = torch.full((len(examples), length), pad_id, dtype=torch.long)
    labels = torch.full((len(examples), length), IGNORE_INDEX, dtype=torch.long)
    attention_mask = torch.zeros((len(examples), length), dtype=torch.long)
    for row, example in enumerate(examples):
        size = len(example["input_ids"])
        input_ids[row, :size] = example["input_ids"]
        labels[row, :size] = example["labels"]
        attention_mask[row, :size] = 1
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


def training_batches(examples: Sequence[dict], seed: int, steps: int, batch_size: int,
                     pad_id: int, pad_multiple: int) -> list[dict[str, torch.Tensor]]:
    """The ``steps`` batches of one seed, in order, on the CPU: the examples shuffled by the
    seed (and reshuffled for every further pass when the steps need more than one)."""
    generator = torch.Generator().manual_seed(seed)
    needed = steps * batch_size
    passes = math.ceil(needed / len(examples))
    order = torch.cat([torch.randperm(len(examples), generator=generator)
                       for _ in range(passes)])[:needed].tolist()
    return [collate([examples[index] for index in order[start:start + batch_size]], pad_id,
                    pad_multiple)
            for start in range(0, needed, batch_size)]


def train(initial_model: PreTrainedModel, batches: Sequence[dict[str, torch.Tensor]],
          implementation: str, seed: int, learning_rate: float) -> RunResult:
    """Fine-tune a copy of ``initial_model`` on ``batches`` with one implementation's loss."""
    from transformers import get_linear_schedule_with_warmup

    torch.manual_seed(seed)
    model = patch(copy.deepcopy(initial_model).to(DEVICE).train(),
                  **IMPLEMENTATIONS[implementation])
    optimizer = torch.optim.AdamW(model.parameters(), lr=learning_rate, weight_decay=0.0,
                                  fused=ON_GPU)
    schedule = get_linear_schedule_with_warmup(
        optimizer, num_warmup_steps=math.ceil(WARMUP_RATIO * len(batches)),
        num_training_steps=len(batches))
    if ON_GPU:
        torch.cuda.reset_peak_memory_stats()
    losses, grad_norms, step_ms = [], [], []
    for batch in progress(batches, f"{implementation}, seed {seed}", leave=False):
        batch = {name: tensor.to(DEVICE) for name, tensor in batch.items()}
        loss, grad_norm, ms = training_step(model, batch, optimizer, schedule)
        step_ms.append(ms)
        losses.append(loss.item())
        grad_norms.append(grad_norm.item())
    peak_memory_mb = torch.cuda.max_memory_allocated() / 2**20 if ON_GPU else None
    return RunResult(implementation, seed, losses, grad_norms, step_ms, peak_memory_mb)


def training_step(model: torch.nn.Module, batch: dict[str, torch.Tensor],
                  optimizer: torch.optim.Optimizer, schedule: Any, **forward_options: Any
                  ) -> tuple[torch.Tensor, torch.Tensor, float]:
    """One optimizer step on ``batch`` (on the model's device): bfloat16 autocast, gradients
    clipped to ``MAX_GRAD_NORM``, the schedule advanced. Returns the loss (detached), the
    gradient norm before clipping and the step's milliseconds (:func:`synchronized_clock`).
    ``forward_options`` go to the model's forward with the batch."""
    device_type = next(iter(batch.values())).device.type
    start_s = synchronized_clock()
    with torch.autocast(device_type, dtype=torch.bfloat16):
        loss = model(**batch, **forward_options).loss
    loss.backward()
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_GRAD_NORM)
    optimizer.step()
    schedule.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.detach(), grad_norm, (synchronized_clock() - start_s) * 1e3


def synchronized_clock() -> float:
    """``perf_counter`` once the device has finished its queued work, so that a step's time
    covers its kernels."""
    if ON_GPU:
        torch.cuda.synchronize()
    return time.perf_counter()


def run(quick: bool, out_dir: Path, *, steps: Optional[int] = None, seeds: Optional[int] = None,
        impls: Optional[Sequence[str]] = None, data_path: Optional[Path] = None,
        model: Optional[str] = None) -> WrittenResults:
    """The registered entry point: every implementation in ``impls`` (default: all three)
    fine-tuned with seeds ``0 .. seeds - 1``.

    Quick mode defaults to the tiny model, 3 steps and 2 seeds; otherwise the real model,
    150 steps and 5 seeds. ``model`` is "gemma3-270m" or "tiny-gemma3"; ``data_path`` the
    Alpaca JSON file (default: the repository's ``data/alpaca_5000.json``).
    """
    steps = (QUICK_STEPS if quick else FULL_STEPS) if steps is None else steps
    seeds = (QUICK_SEEDS if quick else FULL_SEEDS) if seeds is None else seeds
    impls = list(IMPLEMENTATIONS) if impls is None else list(impls)
    model = (TINY_MODEL if quick else REAL_MODEL) if model is None else model
    _check_arguments(steps, seeds, impls, model)
    setup = SETUPS[model]

    initial_model, tokenizer = load(model)
    examples = trainable_examples(tokenizer, load_alpaca(data_path), setup.max_length)
    results: dict[str, list[RunResult]] = {name: [] for name in impls}
    errors: dict[str, str] = {}
    for seed in progress(range(seeds), "seeds", leave=False):
        batches = training_batches(examples, seed, steps, setup.batch_size,
                                   tokenizer.pad_token_id, setup.pad_multiple)
        for name in impls:
            if name in errors:
                continue
            start_s = time.perf_counter()
            try:
                result = train(initial_model, batches, name, seed, setup.learning_rate)
            except Exception as error:  # an OOM or a kernel error must not hide the others
                errors[name] = f"seed {seed}: {type(error).__name__}: {error}"
                log(f"{name}: FAILED at {errors[name]}")
            else:
                results[name].append(result)
                log(f"{_shown(name)}, seed {seed}: loss {result.losses[0]:.4f} -> "
                    f"{result.losses[-1]:.4f}, median step "
                    f"{statistics.median(result.step_ms):.1f} ms, "
                    f"{time.perf_counter() - start_s:.1f} s")
            # The patched forward refers to its model: only the collector frees the copy.
            gc.collect()
            if ON_GPU:
                torch.cuda.empty_cache()

    completed = {name: runs for name, runs in results.items() if name not in errors}
    rows = [summary_row(name, completed) if name in completed
            else {"implementation": name, "patch_options": _describe_options(name),
                  "error": errors[name]}
            for name in impls]
    meta = _meta(setup, model, steps, seeds, len(examples))
    details = {"runs": [asdict(result) for runs in completed.values() for result in runs]}
    written = write_results(NAME, rows, meta, out_dir, details=details,
                            kernel_methods={"implementation": KERNEL_IMPLEMENTATIONS})
    plot(completed, out_dir / FIGURE,
         title=f"{setup.description}: training loss on Alpaca, seeds 0..{seeds - 1} "
               f"({device_label(environment())})")
    return written


def _check_arguments(steps: Any, seeds: Any, impls: list[Any], model: Any) -> None:
    for name, value in (("steps", steps), ("seeds", seeds)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    unknown = [name for name in impls if name not in IMPLEMENTATIONS]
    if not impls or unknown or len(set(impls)) != len(impls):
        raise ValueError(f"impls must be distinct names among {tuple(IMPLEMENTATIONS)}, "
                         f"got {impls!r}")
    if model not in SETUPS:
        raise ValueError(f"model must be one of {tuple(SETUPS)}, got {model!r}")


def loss_matrix(runs: Sequence[RunResult]) -> torch.Tensor:
    """(seeds, steps) float64 losses, one row per run."""
    return torch.tensor([result.losses for result in runs], dtype=torch.float64)


def summary_row(name: str, completed: dict[str, list[RunResult]]) -> dict[str, Any]:
    """The table's row of one implementation whose runs all completed."""
    runs = completed[name]
    losses = loss_matrix(runs)
    row: dict[str, Any] = {
        "implementation": name,
        "patch_options": _describe_options(name),
        "final_loss": _mean_and_std(losses[:, -FINAL_STEPS:].mean(dim=1)),
        "mean_loss": _mean_and_std(losses.mean(dim=1)),
        f"max_abs_diff_vs_{BASELINE}": None,
        "max_abs_diff_seed_means": None,
    }
    if name != BASELINE and BASELINE in completed:
        difference = losses - loss_matrix(completed[BASELINE])  # paired: the same seeds
        row[f"max_abs_diff_vs_{BASELINE}"] = float(difference.abs().max())
        row["max_abs_diff_seed_means"] = float(difference.mean(dim=0).abs().max())
    peaks = [result.peak_memory_mb for result in runs if result.peak_memory_mb is not None]
    row["peak_memory_mb"] = max(peaks) if peaks else None
    row["median_step_ms"] = statistics.median(ms for result in runs for ms in result.step_ms)
    return row


def _mean_and_std(values: torch.Tensor) -> str:
    """"mean ± std" over seeds (sample std), 4 decimals: loss differences are small."""
    if len(values) < 2:
        return f"{float(values.mean()):.4f}"
    return f"{float(values.mean()):.4f} ± {float(values.std()):.4f}"


def _describe_options(name: str) -> str:
    return ", ".join(f"{key}={value!r}" for key, value in IMPLEMENTATIONS[name].items())


def _shown(name: str) -> str:
    """An implementation as the console and the figure name it: "cce (interpreter)" where
    cce's kernels ran in Triton's interpreter."""
    return shown_method(name) if name in KERNEL_IMPLEMENTATIONS else name


def _meta(setup: TrainingSetup, model: str, steps: int, seeds: int,
          num_examples: int) -> dict[str, Any]:
    warmup_steps = math.ceil(WARMUP_RATIO * steps)
    return {
        "what": "the paper's Fig. 4: training loss per step when fine-tuning on Alpaca with "
                "each loss implementation (patched with cce.integrations.transformers.patch)",
        "model": f"{model}: {setup.description}",
        "data": f"{num_examples} Alpaca examples with a response token left after truncation "
                f"to {setup.max_length} tokens; per seed, {steps * setup.batch_size} of them "
                "in a seeded random order; prompt tokens ignored by the loss",
        "training": f"{steps} steps of {setup.batch_size} sequences, right-padded to a "
                    f"multiple of {setup.pad_multiple} tokens; AdamW lr {setup.learning_rate:g}, "
                    f"{warmup_steps} warm-up step(s) then linear decay to 0, betas (0.9, 0.999), "
                    f"no weight decay, gradient norm clipped to {MAX_GRAD_NORM}",
        "precision": "float32 weights and AdamW state; forward under torch.autocast(bfloat16): "
                     "the loss gets bfloat16 hidden states and lm_head weight",
        "seeds": f"0..{seeds - 1}; a seed sets the data order and torch's generator, and every "
                 "implementation trains from the same weights on the same batches",
        "columns": f"final_loss: mean of the last {FINAL_STEPS} steps, mean ± std over seeds; "
                   "mean_loss: mean over all steps, the same; max_abs_diff_vs_torch_compile: "
                   "largest |loss - torch_compile's loss| over steps and seeds, paired by seed; "
                   "max_abs_diff_seed_means: the same between the curves averaged over seeds; "
                   "peak_memory_mb: largest over seeds of torch.cuda.max_memory_allocated during "
                   "training (GPU only); median_step_ms: median over every step of every seed "
                   "(forward, backward, clipping, optimizer step; the compiling first steps "
                   "included)",
        "figure": FIGURE,
    }


def plot(completed: dict[str, list[RunResult]], path: Path, title: str) -> None:
    """(a) Fig. 4: loss per step, mean over seeds and min-max band, not smoothed; (b) each
    implementation's paired difference from torch.compile's loss."""
    import matplotlib

    matplotlib.use("Agg")  # no display: the figure only goes to a file
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    figure, (curves, differences) = plt.subplots(1, 2, figsize=(15, 5.5))
    baseline = loss_matrix(completed[BASELINE]) if BASELINE in completed else None
    for name, runs in completed.items():
        losses = loss_matrix(runs)
        steps = torch.arange(1, losses.shape[1] + 1)
        _band(curves, steps, losses, name, label=f"{_shown(name)} ({_describe_options(name)})")
        if baseline is not None and name != BASELINE:
            _band(differences, steps, losses - baseline, name,
                  label=f"{_shown(name)} - {BASELINE}")
    curves.set_xlabel("step")
    curves.set_ylabel("training loss (mean over the batch's response tokens)")
    curves.set_title("(a) loss per step, not smoothed: mean over seeds, band = min to max")
    curves.legend(fontsize=9)
    differences.axhline(0, linewidth=1, **STYLES[BASELINE])
    differences.set_xlabel("step")
    differences.set_ylabel(f"loss - {BASELINE}'s loss, same seed")
    differences.set_title("(b) paired difference from torch.compile: mean over seeds, "
                          "band = min to max")
    if baseline is not None and len(completed) > 1:
        differences.legend(fontsize=9)
    for axis in (curves, differences):
        axis.grid(True, alpha=0.3)
        axis.xaxis.set_major_locator(MaxNLocator(integer=True))
    figure.suptitle(title, fontsize=12)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def _band(axis: Any, steps: torch.Tensor, values: torch.Tensor, name: str, label: str) -> None:
    """The mean over seeds (rows of ``values``) as a line, their min-max range as a band."""
    axis.plot(steps, values.mean(dim=0), linewidth=1.5, label=label, **STYLES[name])
    axis.fill_between(steps, values.amin(dim=0), values.amax(dim=0),
                      color=STYLES[name]["color"], alpha=0.12, linewidth=0)


def main(argv: Optional[list[str]] = None) -> int:
    def options(parser: argparse.ArgumentParser
                ) -> Callable[[argparse.Namespace], dict[str, Any]]:
        parser.add_argument("--steps", type=int,
                            help=f"optimizer steps per run (default: {FULL_STEPS}; "
                                 f"{QUICK_STEPS} with --quick)")
        parser.add_argument("--seeds", type=int,
                            help=f"runs per implementation, seeds 0..N-1 (default: "
                                 f"{FULL_SEEDS}; {QUICK_SEEDS} with --quick)")
        parser.add_argument("--impls", nargs="+", choices=list(IMPLEMENTATIONS), metavar="IMPL",
                            help=f"implementations to train (default: all of "
                                 f"{', '.join(IMPLEMENTATIONS)})")
        add_data_argument(parser)
        parser.add_argument("--model", choices=list(SETUPS),
                            help=f"{REAL_MODEL} (default; its GGUF file from the PyPI package "
                                 f"or $CCE_GEMMA3_GGUF) or {TINY_MODEL} (default with --quick)")
        return lambda args: dict(steps=args.steps, seeds=args.seeds, impls=args.impls,
                                 data_path=args.data, model=args.model)

    return harness.main(NAME, run, __doc__.split("\n\n")[0], argv, options,
                        files=f"{NAME}.json, {NAME}.md and {FIGURE}")


if __name__ == "__main__":
    sys.exit(main())
