"""fsdp_finetune: fine-tuning Gemma 3 270M with cce's loss under FSDP2, against one GPU.

    torchrun --nproc-per-node K -m experiments.fsdp_finetune [--quick] [--steps S] [--seeds N]
        [--repeats R] [--data FILE] [--out DIR]

The training of :mod:`experiments.alpaca_finetune` (its model, Alpaca batches, seeds, schedule
and float32 weights under bfloat16 autocast), with the loss of
:func:`cce.integrations.transformers.patch` at its defaults (filter and vocabulary sorting on),
run two ways for every seed:

- ``single``: each rank trains the unwrapped model alone on its own GPU, ``R`` times, on the
  whole batch: K x R repeats of the single-GPU run, whose differences are the run-to-run spread
  (cce's default kernels merge with atomics, so repeats are not bitwise equal);
- ``fsdp``: the K ranks train one model sharded by ``fully_shard`` (each decoder layer, then
  the root, which holds the tied embedding and lm_head), each on its 1/K of every batch.

The sharded run computes the loss of the whole batch: each rank divides its sum over its
response tokens by the batch's count / K (``num_items_in_batch``), so FSDP2's mean of the
ranks' gradients is the gradient of the batch's mean loss, and the loss logged (the ranks'
mean) is the one the single-GPU run logs. The gradient norm is clipped over the whole model.

Recorded per step: the loss, the gradient norm before clipping and the step time; per run and
rank: the peak GPU memory (``torch.cuda.max_memory_allocated``). Rank 0 writes
``fsdp_finetune.json`` and ``.md``, and ``fsdp_finetune.png``: the curves, and each run's paired
difference from the first single-GPU run.

Without a GPU it runs on the CPU over gloo; ``--quick`` is a CPU smoke test (the tiny model of
alpaca_finetune's quick mode, 3 steps, 1 seed), not the experiment.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import gc
import json
import math
import os
import statistics
import tempfile
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist

from cce.integrations.transformers import patch
from experiments.alpaca_data import IGNORE_INDEX, add_data_argument, load_alpaca
from experiments.alpaca_finetune import (FINAL_STEPS, MAX_GRAD_NORM, REAL_MODEL, SETUPS,
                                         TINY_MODEL, WARMUP_RATIO, load, trainable_examples,
                                         training_batches, training_step)
from experiments.harness import (INTERPRETER_CAVEAT, device_label, exit_rank, gather_from_ranks,
                                 kernels_interpreted, log, progress, write_results)

NAME = "fsdp_finetune"
FIGURE = "fsdp_finetune.png"
FULL_STEPS, FULL_SEEDS = 100, 3
QUICK_STEPS, QUICK_SEEDS = 3, 1


@dataclass(frozen=True)
class RunResult:
    """One training run of one seed: per-step values in step order."""

    mode: str  # "single" or "fsdp"
    seed: int
    repeat: int  # which single-GPU repeat (rank * R + r); 0 for fsdp
    losses: list[float]
    grad_norms: list[float]
    step_ms: list[float]
    peak_memory_mib: Optional[list[float]]  # per rank that took part, GPU only


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="torchrun --nproc-per-node K -m "
                                          "experiments.fsdp_finetune",
                                     description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true",
                        help=f"CPU smoke test: the tiny model, {QUICK_STEPS} steps, "
                             f"{QUICK_SEEDS} seed")
    parser.add_argument("--steps", type=int, help=f"default {FULL_STEPS} ({QUICK_STEPS} quick)")
    parser.add_argument("--seeds", type=int,
                        help=f"seeds 0..N-1 (default {FULL_SEEDS}, {QUICK_SEEDS} quick)")
    parser.add_argument("--repeats", type=int, default=1,
                        help="single-GPU runs per rank and seed (default 1)")
    add_data_argument(parser)
    parser.add_argument("--out", type=Path, default=Path("scratch/fsdp_finetune"),
                        help="folder for the results (default: scratch/fsdp_finetune)")
    args = parser.parse_args(argv)
    steps = args.steps if args.steps is not None else (QUICK_STEPS if args.quick else FULL_STEPS)
    seeds = args.seeds if args.seeds is not None else (QUICK_SEEDS if args.quick else FULL_SEEDS)
    if steps < 1 or seeds < 1 or args.repeats < 1:
        parser.error("--steps, --seeds and --repeats must be >= 1")
    model_name = TINY_MODEL if args.quick else REAL_MODEL
    setup = SETUPS[model_name]

    device = _init_process_group()
    rank, world_size = dist.get_rank(), dist.get_world_size()
    if rank == 0 and kernels_interpreted():  # before any step time reaches the console
        log(f"{NAME}: {INTERPRETER_CAVEAT}")
    try:
        if setup.batch_size % world_size:
            raise ValueError(f"the batch of {setup.batch_size} sequences does not split over "
                             f"{world_size} ranks")
        initial_model, tokenizer = load(model_name)
        examples = trainable_examples(tokenizer, load_alpaca(args.data), setup.max_length)
        runs: list[RunResult] = []
        for seed in range(seeds):
            batches = training_batches(examples, seed, steps, setup.batch_size,
                                       tokenizer.pad_token_id, setup.pad_multiple)
            for repeat in range(args.repeats):
                runs.append(train(initial_model, batches, seed, rank * args.repeats + repeat,
                                  device, setup.learning_rate, sharded=False))
            runs.append(train(initial_model, batches, seed, 0, device, setup.learning_rate,
                              sharded=True))
        gathered: list[Optional[list[RunResult]]] = [None] * world_size
        dist.all_gather_object(gathered, runs)
        if rank == 0:
            single = [run for ranks_runs in gathered for run in ranks_runs or []
                      if run.mode == "single"]
            sharded = [run for run in runs if run.mode == "fsdp"]  # the same on every rank
            report(single + sharded, args.out, model_name, steps, seeds, args.repeats, world_size,
                   len(examples))
            log(f"wrote {args.out}/{NAME}.json, .md and {FIGURE}")
    finally:
        dist.destroy_process_group()
    return 0


def _init_process_group() -> torch.device:
    """Join torchrun's group (or a group of one without torchrun): NCCL with a GPU per rank,
    else gloo on the CPU."""
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    if torch.cuda.is_available():
        if local_world_size > torch.cuda.device_count():
            raise ValueError(f"{local_world_size} ranks on this node but "
                             f"{torch.cuda.device_count()} GPUs: one GPU per rank is needed")
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
    timeout = datetime.timedelta(minutes=10)
    if "RANK" in os.environ:
        dist.init_process_group(backend, timeout=timeout, device_id=device
                                if device.type == "cuda" else None)
    else:
        store = tempfile.NamedTemporaryFile(prefix=f"{NAME}_", delete=False).name
        dist.init_process_group(backend, init_method=f"file://{store}", rank=0, world_size=1,
                                timeout=timeout)
    return device


def train(initial_model: Any, batches: Sequence[dict[str, torch.Tensor]], seed: int,
          repeat: int, device: torch.device, learning_rate: float, *,
          sharded: bool) -> RunResult:
    """Fine-tune a copy of ``initial_model``: alone on this rank's device, or sharded over the
    group with each rank on its part of every batch."""
    from transformers import get_linear_schedule_with_warmup

    shards = dist.get_world_size() if sharded else 1
    shard = dist.get_rank() if sharded else 0
    torch.manual_seed(seed)
    model = copy.deepcopy(initial_model).to(device).train()
    if sharded:
        shard_model(model, device)
    patch(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=learning_rate, weight_decay=0.0)
    schedule = get_linear_schedule_with_warmup(
        optimizer, num_warmup_steps=math.ceil(WARMUP_RATIO * len(batches)),
        num_training_steps=len(batches))
    on_gpu = device.type == "cuda"
    if on_gpu:
        torch.cuda.reset_peak_memory_stats(device)
    losses, grad_norms, step_ms = [], [], []
    mode = "fsdp" if sharded else "single"
    steps = batches if dist.get_rank() else progress(batches, f"{mode}, seed {seed}",
                                                       leave=False)
    for batch in steps:
        # The loss counts labels[:, 1:] (the model shifts them); every rank divides its sum by
        # the whole batch's count over the number of ranks, whose mean FSDP2 takes.
        tokens = int((batch["labels"][:, 1:] != IGNORE_INDEX).sum())
        part = {name: tensor.chunk(shards)[shard].to(device) for name, tensor in batch.items()}
        loss, grad_norm, ms = training_step(model, part, optimizer, schedule,
                                            num_items_in_batch=tokens / shards)
        step_ms.append(ms)
        if sharded:
            dist.all_reduce(loss)
            loss /= shards
        losses.append(loss.item())
        grad_norms.append(_full(grad_norm).item())
    peaks = None
    if on_gpu:
        peak = torch.cuda.max_memory_allocated(device) / 2**20
        peaks = gather_from_ranks(peak, device) if sharded else [peak]
    del model, optimizer
    gc.collect()  # the patched forward refers to its model: only the collector frees it
    if on_gpu:
        torch.cuda.empty_cache()
    if dist.get_rank() == 0:
        log(f"{mode}, seed {seed}, repeat {repeat}: loss {losses[0]:.4f} -> {losses[-1]:.4f}, "
            f"median step {statistics.median(step_ms):.1f} ms")
    return RunResult(mode, seed, repeat, losses, grad_norms, step_ms, peaks)


def shard_model(model: Any, device: torch.device) -> None:
    """FSDP2: each decoder layer, then the root (embedding, tied lm_head, final norm)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)


def _full(value: torch.Tensor) -> torch.Tensor:
    """A DTensor's full value (the sharded model's gradient norm), or the tensor itself."""
    return value.full_tensor() if hasattr(value, "full_tensor") else value


def report(runs: list[RunResult], out_dir: Path, model_name: str, steps: int, seeds: int,
           repeats: int, world_size: int, num_examples: int) -> None:
    """Rows per mode, the spread and the FSDP difference, the figure."""
    reference = _first_single_losses(runs)
    rows = []
    for mode in ("single", "fsdp"):
        chosen = [run for run in runs if run.mode == mode]
        # Paired by seed, against the first single-GPU run; that run itself is left out.
        differences = [torch.tensor(run.losses, dtype=torch.float64) - reference[run.seed]
                       for run in chosen if not (mode == "single" and run.repeat == 0)]
        finals = torch.tensor([statistics.fmean(run.losses[-FINAL_STEPS:]) for run in chosen])
        peaks = [peak for run in chosen for peak in run.peak_memory_mib or []]
        rows.append({
            "mode": mode,
            "gpus": 1 if mode == "single" else world_size,
            "runs": len(chosen),
            "final_loss": f"{float(finals.mean()):.4f}",
            "max_abs_diff_vs_single_run_0": (float(torch.stack(differences).abs().max())
                                             if differences else None),
            "mean_abs_diff_vs_single_run_0": (float(torch.stack(differences).abs().mean())
                                              if differences else None),
            "peak_memory_mib_per_gpu": round(max(peaks)) if peaks else None,
            "median_step_ms": statistics.median(ms for run in chosen for ms in run.step_ms),
        })
    setup = SETUPS[model_name]
    per_rank = setup.batch_size // world_size
    meta = {
        "what": "fine-tuning under FSDP2 (fully_shard per decoder layer and at the root) with "
                "cce.integrations.transformers.patch's loss, against the single-GPU run",
        "model": f"{model_name}: {setup.description}",
        "ranks": world_size,
        "data": f"{num_examples} Alpaca examples; per seed {steps * setup.batch_size} in a "
                "seeded order (experiments.alpaca_finetune's batches)",
        "training": f"{steps} steps of {setup.batch_size} sequences ({per_rank} per rank "
                    f"under FSDP); AdamW lr {setup.learning_rate:g}, "
                    "linear warm-up and decay, gradient norm clipped to "
                    f"{MAX_GRAD_NORM}; float32 weights, bfloat16 autocast",
        "seeds": f"0..{seeds - 1}; single-GPU repeats per seed: {world_size * repeats} "
                 f"({repeats} per rank, on every rank's own GPU)",
        "columns": f"final_loss: mean of the last {FINAL_STEPS} steps, mean over runs; "
                   "max/mean_abs_diff_vs_single_run_0: |loss - the first single-GPU run's loss| "
                   "over steps and seeds, paired by seed (for single: the other repeats, i.e. "
                   "the run-to-run spread); peak_memory_mib_per_gpu: largest "
                   "torch.cuda.max_memory_allocated of a rank; median_step_ms: forward, "
                   "backward, clipping and optimizer step",
        "figure": FIGURE,
    }
    details = {"runs": [asdict(run) for run in runs]}
    plot(write_results(NAME, rows, meta, out_dir, details=details).json_path)


def _first_single_losses(runs: list[RunResult]) -> dict[int, torch.Tensor]:
    """Seed -> the losses of its first single-GPU run, against which every other run of the
    seed is paired."""
    return {run.seed: torch.tensor(run.losses, dtype=torch.float64) for run in runs
            if run.mode == "single" and run.repeat == 0}


def plot(json_path: Path, path: Optional[Path] = None) -> None:
    """Draw ``fsdp_finetune.png`` (or ``path``) from a written ``fsdp_finetune.json``: (a) the
    loss per step of every run; (b) each run minus the first single-GPU run of its seed. Every
    line is in a legend entry: one per seed for its single-GPU runs, one for its FSDP run."""
    import matplotlib

    matplotlib.use("Agg")  # no display: the figure only goes to a file
    import matplotlib.pyplot as plt

    results = json.loads(json_path.read_text())
    runs = [RunResult(**run) for run in results["details"]["runs"]]
    reference = _first_single_losses(runs)
    world_size = results["meta"]["ranks"]
    single_runs = Counter(run.seed for run in runs if run.mode == "single")
    figure, (curves, differences) = plt.subplots(1, 2, figsize=(15, 6.5), layout="constrained")
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    # Per panel, (sharded, seed) -> a line of that group, for its legend entry.
    groups: tuple[dict[tuple[int, bool], Any], ...] = ({}, {})
    for run in runs:
        color = colors[run.seed % len(colors)]
        group = (run.mode == "fsdp", run.seed)
        steps = range(1, len(run.losses) + 1)
        if run.mode == "fsdp":
            style, label = "-", f"FSDP2, {world_size} GPUs, seed {run.seed}"
            difference_label = label
        else:
            count = single_runs[run.seed]
            style, label = ":", f"one GPU, {count} run{'s' * (count > 1)}, seed {run.seed}"
            later = "run 2" if count == 2 else f"runs 2-{count}"
            difference_label = f"one GPU, {later}, seed {run.seed}"
        groups[0][group], = curves.plot(steps, run.losses, style, color=color, linewidth=1.2,
                                        label=label)
        if not (run.mode == "single" and run.repeat == 0):
            difference = torch.tensor(run.losses, dtype=torch.float64) - reference[run.seed]
            groups[1][group], = differences.plot(steps, difference, style, color=color,
                                                 linewidth=1.2, label=difference_label)
    curves.set_title("(a) training loss per step, not smoothed")
    curves.set_ylabel("loss (mean over the batch's response tokens)")
    differences.axhline(0, color="black", linewidth=0.8)
    differences.set_title("(b) minus the first single-GPU run of the same seed")
    differences.set_ylabel("loss difference")
    for axis, lines in zip((curves, differences), groups):
        axis.set_xlabel("step")
        axis.grid(True, alpha=0.3)
        # The single-GPU groups in the first column, the FSDP runs in the second.
        shown = [line for _, line in sorted(lines.items())]
        axis.legend(shown, [line.get_label() for line in shown], fontsize=10, ncol=2,
                    loc="upper center", bbox_to_anchor=(0.5, -0.12))
    # A quick run's tiny random model is no Gemma 3 270M.
    model = results["meta"]["model"].split(":")[0]
    model = "Gemma 3 270M" if model == REAL_MODEL else f"SMOKE TEST: {model}"
    figure.suptitle(f"{model} fine-tuning on Alpaca with cce's loss: FSDP2 over {world_size} "
                    f"ranks against one GPU ({device_label(results['environment'])})")
    figure.savefig(path or json_path.with_name(FIGURE), dpi=110)
    plt.close(figure)


if __name__ == "__main__":
    exit_rank(main())
