r"""Tensor-parallel loss benchmark: cce's vocabulary-parallel loss against PyTorch's loss_parallel.

    torchrun --nproc-per-node K -m experiments.tp_bench [--quick] [--shapes ...] [--tokens ...]
        [--methods ...] [--backend auto|nccl|gloo] [--warmup W] [--repeats R] [--out DIR]

The run on two GPUs (NCCL) whose results are committed under results/tp (its console output
kept as results/tp/tp_bench_tp2.log; ``--nproc-per-node 1`` redoes the TP 1 run the figure also
draws):

    torchrun --nproc-per-node 2 -m experiments.tp_bench \
        --shapes gemma2_2b llama3_8b --out results/tp

The tensor-parallel size is the world size K (``python -m experiments.tp_bench`` without
torchrun: K = 1). Each rank holds its rows of the classifier (``torch.chunk``'s split, the one
DTensor's ``Shard`` uses) and the same tokens: e and targets, bfloat16, from
:func:`experiments.synthetic.lm_like_inputs` (a language model's softmax sparsity). Shapes:
Gemma 2 2B (D 2304, V 256000) and Llama 3 8B (D 4096, V 128256), N = 8192 to 65536 tokens.
Every method computes the mean loss, e's full gradient (summed over the ranks) and the gradient
of the rank's rows of c:

- ``cce``: ``cce.linear_cross_entropy(e, c_local, targets, vocab_parallel=...)``, default
  filter; dE is summed over the ranks in float32.
- ``cce_dtensor``: the drop-in for loss_parallel, as tensor parallelism places the output layer:
  c a DTensor sharded by vocabulary rows (``Shard(0)``, the rank's rows) on the 1-D mesh, e a
  DTensor ``Replicate()`` on it, both leaves; ``cce.linear_cross_entropy(e, c, targets)`` with
  its defaults finds the shard in c's placement and runs ``cce``'s call; the gradients are
  DTensors placed as e and c.
- ``loss_parallel``: the local logits ``e @ c_local.T`` as a DTensor sharded on the vocabulary
  (``Shard(1)``), upcast to float32 (as Hugging Face does), ``F.cross_entropy`` under
  ``torch.distributed.tensor.parallel.loss_parallel()``; dE all-reduced in bfloat16 (tensor
  parallelism's Partial -> Replicate).

Per row: the slowest rank's median time of loss + gradients (CUDA events, after a barrier, W
warm-up calls, median of R), each rank's peak memory above its inputs, and how far each cce
method's results are from loss_parallel's (and cce_dtensor's from cce's: ``diff_cce``, 0 when
the same kernels give the same bits, as in Triton's interpreter; on a GPU the forward's merge of
log-sum-exps under a lock may differ in the last bits). A row whose estimated memory exceeds
what a rank has free is skipped (every rank decides alike). Before the timings, the agreement
check, bfloat16 with the default filter and float32 without, a quarter of the targets ignored:
every rank's vocabulary-parallel results (loss, lse, dE, its rows of dC) against the unsharded
call on the full classifier, and the DTensor call's (c split by DTensor's own
``distribute_tensor``) against the ``VocabParallelOptions`` call's.

Devices: rank r uses GPU ``LOCAL_RANK % device_count``, so with one GPU every rank shares GPU 0
(use ``--backend gloo``, the default then: NCCL refuses two ranks on one GPU; the timings then
share the GPU and say nothing about TP speed). Without a GPU it runs on the CPU over gloo
(``--quick``: tiny sizes, the kernels in Triton's interpreter). Rank 0 writes
``tp_bench_tp<K>.json`` and ``.md`` (device, versions, date) under ``--out``, and redraws
``tp_bench.png`` there from every ``tp_bench_tp*.json`` it holds: runs at several K into one
folder give one figure of time and memory against N.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F

import cce
from experiments.harness import (INTERPRETER_CAVEAT, add_sections, device_label, exit_rank,
                                 gather_from_ranks, kernels_interpreted, label_log_axis, log,
                                 markdown_table, shown_method, write_results)
from experiments.synthetic import lm_like_inputs

MIB = 2**20
GB = 10**9  # the figure's unit, the README's
DTYPE = torch.bfloat16
TOKENS = (8192, 16384, 32768, 65536)
QUICK_TOKENS = (48, 96)
METHODS = ("cce", "cce_dtensor", "loss_parallel")
REFERENCE = "loss_parallel"  # the methods' diff_* and speedup are against it
# The later run on two GPUs, as the module's docstring gives it.
TP_RUN = ("torchrun --nproc-per-node 2 -m experiments.tp_bench --shapes gemma2_2b llama3_8b "
          "--out results/tp")
# The agreement check runs on the first tokens of the smallest timed N, this many at most, with
# this fraction of them ignored (target -100).
CHECK_TOKENS = 4096
CHECK_IGNORED = 0.25
FIGURE = "tp_bench.png"


@dataclass(frozen=True)
class Shape:
    name: str
    description: str
    vocab_size: int
    dim: int


SHAPES = {shape.name: shape for shape in (
    Shape("gemma2_2b", "Gemma 2 2B", 256000, 2304),
    Shape("llama3_8b", "Llama 3 8B", 128256, 4096),
    # CPU smoke test. A prime vocabulary: uneven shards for any number of ranks (2 ranks: 252
    # and 251 rows, two vocabulary blocks each in Triton's interpreter).
    Shape("quick", "tiny (CPU smoke test)", 503, 64),
)}
FULL_SHAPES = ("gemma2_2b", "llama3_8b")


@dataclass(frozen=True)
class Ranks:
    """This process's place in the tensor-parallel group."""

    rank: int
    world_size: int
    device: torch.device
    ranks_per_gpu: int
    backend: str

    def shard(self, vocab_size: int) -> tuple[int, int]:
        """This rank's rows [start, stop) of the classifier: torch.chunk's split."""
        sizes = [len(part) for part in torch.arange(vocab_size).chunk(self.world_size)]
        sizes += [0] * (self.world_size - len(sizes))
        start = sum(sizes[:self.rank])
        return start, start + sizes[self.rank]

    def synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def barrier(self) -> None:
        # A tiny all-reduce on the rank's device: the same call for NCCL and gloo.
        dist.all_reduce(torch.zeros(1, device=self.device))
        self.synchronize()

    def gather(self, value: float) -> list[float]:
        """``value`` of every rank, in rank order."""
        return gather_from_ranks(value, self.device)


def parser() -> argparse.ArgumentParser:
    """The command line's parser."""
    parser = argparse.ArgumentParser(prog="torchrun --nproc-per-node K -m experiments.tp_bench",
                                     description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true",
                        help=f"the tiny shape, N = {', '.join(map(str, QUICK_TOKENS))}, one "
                             "warm-up and two timed calls (a CPU smoke test)")
    parser.add_argument("--shapes", nargs="+", choices=list(SHAPES), metavar="SHAPE",
                        help=f"default: {' '.join(FULL_SHAPES)} ({' '.join(SHAPES)} exist)")
    parser.add_argument("--tokens", nargs="+", type=int, metavar="N",
                        help=f"default: {' '.join(map(str, TOKENS))}")
    parser.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS))
    parser.add_argument("--backend", default="auto",
                        help="torch.distributed backend; auto: nccl when every rank has a GPU "
                             "of its own, else gloo")
    parser.add_argument("--warmup", type=int, help="warm-up calls (default 3, quick 1)")
    parser.add_argument("--repeats", type=int, help="timed calls (default 10, quick 2)")
    parser.add_argument("--no-check", action="store_true",
                        help="skip the agreement check against the unsharded call")
    parser.add_argument("--out", type=Path, default=Path("scratch/tp_bench"),
                        help="folder for tp_bench_tp<K>.json and .md (default: scratch/tp_bench)")
    return parser


def main(argv: Optional[list[str]] = None) -> int:
    command_line = parser()
    args = command_line.parse_args(argv)
    shapes = args.shapes or (["quick"] if args.quick else list(FULL_SHAPES))
    tokens = sorted(args.tokens or (QUICK_TOKENS if args.quick else TOKENS))
    warmup = args.warmup if args.warmup is not None else (1 if args.quick else 3)
    repeats = args.repeats if args.repeats is not None else (2 if args.quick else 10)
    if min(tokens) < 1 or warmup < 0 or repeats < 1:
        command_line.error("--tokens must be >= 1, --warmup >= 0 and --repeats >= 1")

    ranks = _init_ranks(args.backend)
    if ranks.rank == 0 and kernels_interpreted():  # before any timing reaches the console
        log(f"tp_bench: {INTERPRETER_CAVEAT}")
    try:
        rows, checks = [], []
        for name in shapes:
            shape = SHAPES[name]
            e, c_local, targets = _shape_inputs(ranks, shape, max(tokens))
            if not args.no_check:
                checks += _agreement(ranks, shape, e, c_local, targets,
                                     min(CHECK_TOKENS, tokens[0]))
            for num_tokens in tokens:
                rows += _measure(ranks, shape, e[:num_tokens], c_local, targets[:num_tokens],
                                 args.methods, warmup, repeats)
                if ranks.rank == 0:  # after every row: a run cut short still leaves its rows
                    _write(ranks, rows, checks, args.out, warmup, repeats)
            del e, c_local, targets
        if ranks.rank == 0:
            plot(args.out)
            print(f"wrote {args.out}/tp_bench_tp{ranks.world_size}.json and .md, {FIGURE}",
                  file=sys.stderr)
    finally:
        dist.destroy_process_group()
    return 0


def _init_ranks(backend: str) -> Ranks:
    """Join the process group that torchrun describes (RANK, WORLD_SIZE, ...), or a group of
    one process without torchrun; pick this rank's device."""
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    if torch.cuda.is_available():
        gpus = torch.cuda.device_count()
        device = torch.device("cuda", local_rank % gpus)
        torch.cuda.set_device(device)
        ranks_per_gpu = -(-local_world_size // gpus)
    else:
        device, ranks_per_gpu = torch.device("cpu"), 0
    if backend == "auto":
        backend = "nccl" if device.type == "cuda" and ranks_per_gpu == 1 else "gloo"
    if "RANK" in os.environ:
        dist.init_process_group(backend, timeout=datetime.timedelta(minutes=10))
    else:
        store = tempfile.NamedTemporaryFile(prefix="tp_bench_", delete=False).name
        dist.init_process_group(backend, init_method=f"file://{store}", rank=0, world_size=1)
    return Ranks(dist.get_rank(), dist.get_world_size(), device, ranks_per_gpu, backend)


def _shape_inputs(ranks: Ranks, shape: Shape, num_tokens: int
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """e and targets (the same on every rank: rank 0's, broadcast) and this rank's rows of c."""
    e, c, targets = lm_like_inputs(num_tokens, shape.vocab_size, shape.dim, seed=0, dtype=DTYPE,
                                   device=ranks.device, requires_grad=False)
    dist.broadcast(e, src=0)
    dist.broadcast(targets, src=0)
    start, stop = ranks.shard(shape.vocab_size)
    c_local = c[start:stop].clone()  # a copy: the full c is freed
    return e.requires_grad_(), c_local.requires_grad_(), targets


def _cce_step(ranks: Ranks, vocab_size: int) -> Callable[..., tuple[torch.Tensor, ...]]:
    shard = cce.VocabParallelOptions(*ranks.shard(vocab_size))

    def step(e: torch.Tensor, c_local: torch.Tensor, targets: torch.Tensor):
        loss = cce.linear_cross_entropy(e, c_local, targets, vocab_parallel=shard)
        return (loss, *torch.autograd.grad(loss, (e, c_local)))

    return step


def _cce_dtensor_step(ranks: Ranks, vocab_size: int) -> Callable[..., tuple[torch.Tensor, ...]]:
    mesh = _mesh(ranks.device.type, ranks.world_size)

    def step(e: torch.Tensor, c_local: torch.Tensor, targets: torch.Tensor):
        # Leaves as a model's would be: c a parameter, e the last norm's output (the DTensors
        # share the local tensors' memory). The gradients are DTensors placed as e and c.
        e_dt, c_dt = _dtensor_leaves(mesh, e, c_local, vocab_size)
        loss = cce.linear_cross_entropy(e_dt, c_dt, targets)
        grad_e, grad_c = torch.autograd.grad(loss, (e_dt, c_dt))
        return loss, grad_e.to_local(), grad_c.to_local()

    return step


def _dtensor_leaves(mesh, e: torch.Tensor, c_local: torch.Tensor, vocab_size: int
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """e as a DTensor ``Replicate()`` and the rank's rows of c as a DTensor ``Shard(0)`` (global
    shape given: torch.chunk's split may be uneven, which ``from_local`` cannot infer), leaves
    that require grad."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    dim = c_local.shape[1]
    e_dt = DTensor.from_local(e.detach(), mesh, [Replicate()], run_check=False)
    c_dt = DTensor.from_local(c_local.detach(), mesh, [Shard(0)], run_check=False,
                              shape=(vocab_size, dim), stride=(dim, 1))
    return e_dt.requires_grad_(), c_dt.requires_grad_()


def _loss_parallel_step(ranks: Ranks, vocab_size: int) -> Callable[..., tuple[torch.Tensor, ...]]:
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor.parallel import loss_parallel

    mesh = _mesh(ranks.device.type, ranks.world_size)

    def step(e: torch.Tensor, c_local: torch.Tensor, targets: torch.Tensor):
        local_logits = e @ c_local.T
        logits = DTensor.from_local(local_logits, mesh, [Shard(1)], run_check=False,
                                    shape=(e.shape[0], vocab_size), stride=(vocab_size, 1))
        with loss_parallel():
            loss = F.cross_entropy(logits.float(), targets)
            grad_e, grad_c = torch.autograd.grad(loss, (e, c_local))
        dist.all_reduce(grad_e)  # every rank's logits depend on e
        return loss.to_local(), grad_e, grad_c

    return step


@functools.cache
def _mesh(device_type: str, world_size: int) -> "torch.distributed.device_mesh.DeviceMesh":
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device_type, (world_size,))


def _estimated_peak_bytes(method: str, num_tokens: int, local_vocab: int, dim: int) -> int:
    """A generous estimate of a step's memory above its inputs (to skip what cannot fit)."""
    outputs = 2 * num_tokens * dim + 2 * local_vocab * dim
    if method in ("cce", "cce_dtensor"):
        return outputs + 4 * num_tokens * dim + 256 * MIB  # + dE in float32, tables, buffers
    # Logits in bfloat16 and float32, the saved log-softmax, its float32 and bfloat16 gradient.
    return outputs + 16 * num_tokens * local_vocab


def _memory_budget(ranks: Ranks) -> float:
    """Bytes a step may use on every rank: the least free memory of any rank's GPU, shared by
    the ranks on it, with a margin."""
    if ranks.device.type != "cuda":
        return float("inf")
    torch.cuda.empty_cache()  # what the allocator caches from earlier rows is free too
    free = torch.cuda.mem_get_info(ranks.device)[0] * 0.9 / ranks.ranks_per_gpu
    return min(ranks.gather(free))


def _measure(ranks: Ranks, shape: Shape, e: torch.Tensor, c_local: torch.Tensor,
             targets: torch.Tensor, methods: Sequence[str], warmup: int,
             repeats: int) -> list[dict[str, Any]]:
    """One row per method at this shape and number of tokens."""
    num_tokens = e.shape[0]
    steps = {"cce": _cce_step, "cce_dtensor": _cce_dtensor_step,
             "loss_parallel": _loss_parallel_step}
    rows, results = [], {}
    budget = _memory_budget(ranks)
    for method in methods:
        row: dict[str, Any] = {"shape": shape.description, "tokens": num_tokens,
                               "method": method}
        rows.append(row)
        estimate = _estimated_peak_bytes(method, num_tokens, c_local.shape[0], shape.dim)
        if estimate > budget:
            row["skipped"] = f"needs about {estimate / 2**30:.1f} GiB per rank"
            continue
        step = steps[method](ranks, shape.vocab_size)
        try:
            results[method] = [tensor.detach() for tensor in step(e, c_local, targets)]
            times = [_timed_ms(ranks, lambda: step(e, c_local, targets))
                     for _ in range(warmup + repeats)][warmup:]
            row["ms"] = max(ranks.gather(statistics.median(times)))
            peaks = ranks.gather(_peak_mib(ranks, lambda: step(e, c_local, targets)) or 0.0)
            if ranks.device.type == "cuda":
                row["peak_mib_max"] = max(peaks)
                row["peak_mib_per_rank"] = [round(peak) for peak in peaks]
        except torch.cuda.OutOfMemoryError as error:
            row["error"] = f"OutOfMemoryError: {str(error).splitlines()[0]}"
            results.pop(method, None)
        if ranks.rank == 0:
            print(f"{shape.name} N={num_tokens} {method}: {row}", file=sys.stderr)
    for method in results:
        row = rows[methods.index(method)]
        if method != REFERENCE and REFERENCE in results:
            (loss, grad_e, grad_c), (other_loss, other_e, other_c) = (results[method],
                                                                      results[REFERENCE])
            row["speedup"] = rows[methods.index(REFERENCE)]["ms"] / row["ms"]
            row["diff_loss"] = _relative_difference(loss, other_loss)
            row["diff_de"] = _relative_difference(grad_e, other_e)
            row["diff_dc"] = max(ranks.gather(_relative_difference(grad_c, other_c)))
        if method == "cce_dtensor" and "cce" in results:
            # The same kernels on the same local tensors: 0 where they give the same bits.
            row["diff_cce"] = max(ranks.gather(max(
                _relative_difference(value, expected)
                for value, expected in zip(results[method], results["cce"]))))
    return rows


def _timed_ms(ranks: Ranks, fn: Callable[[], Any]) -> float:
    ranks.barrier()
    if ranks.device.type != "cuda":
        start_s = time.perf_counter()
        fn()
        return (time.perf_counter() - start_s) * 1e3
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def _peak_mib(ranks: Ranks, fn: Callable[[], Any]) -> Optional[float]:
    """Peak memory allocated by this process during ``fn``, above what was in use before."""
    if ranks.device.type != "cuda":
        return None
    ranks.barrier()
    torch.cuda.reset_peak_memory_stats(ranks.device)
    before = torch.cuda.memory_allocated(ranks.device)
    fn()
    ranks.synchronize()
    return (torch.cuda.max_memory_allocated(ranks.device) - before) / MIB


def _agreement(ranks: Ranks, shape: Shape, e: torch.Tensor, c_local: torch.Tensor,
               targets: torch.Tensor, num_tokens: int) -> list[dict[str, Any]]:
    """Per dtype, two rows of the largest relative difference over the ranks of loss, lse, dE
    and the rank's rows of dC: the vocabulary-parallel call (``VocabParallelOptions``) against
    the unsharded one on the full classifier (gathered from the ranks' rows), and the DTensor
    call (c split by ``distribute_tensor``, ``Shard(0)``) against the vocabulary-parallel
    call."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    full_c = _gather_rows(ranks, c_local.detach(), shape.vocab_size)
    start, stop = ranks.shard(shape.vocab_size)
    mesh = _mesh(ranks.device.type, ranks.world_size)
    ignored = torch.rand(num_tokens, generator=torch.Generator().manual_seed(1)) < CHECK_IGNORED
    targets = torch.where(ignored.to(targets.device), -100, targets[:num_tokens])
    rows = []
    for dtype, filter_eps in ((DTYPE, "auto"), (torch.float32, None)):
        inputs = (e[:num_tokens].detach().to(dtype), full_c.to(dtype), targets)
        sharded = _loss_lse_grads(*inputs, filter_eps, start, stop)
        unsharded = _loss_lse_grads(*inputs, filter_eps)
        unsharded[-1] = unsharded[-1][start:stop]
        # DTensor's own split of the full classifier: it must be torch.chunk's, this rank's
        # rows [start, stop) (an error on every rank otherwise, as each checks its own).
        e_dt = distribute_tensor(inputs[0], mesh, [Replicate()])
        c_dt = distribute_tensor(inputs[1], mesh, [Shard(0)])
        split_ok = torch.equal(c_dt.to_local(), inputs[1][start:stop])
        if not all(ranks.gather(float(split_ok))):
            raise RuntimeError("DTensor's Shard(0) split of c is not torch.chunk's")
        dtensor = _loss_lse_grads(e_dt, c_dt, targets, filter_eps)
        for call, against, value, expected in (
                ("vocab_parallel", "unsharded", sharded, unsharded),
                ("dtensor", "vocab_parallel", dtensor, sharded)):
            row = {"shape": shape.description, "tokens": num_tokens,
                   "ignored": int(ignored.sum()), "dtype": str(dtype).removeprefix("torch."),
                   "filter_eps": filter_eps, "call": call, "against": against}
            for column, got, want in zip(("loss", "lse", "de", "dc"), value, expected):
                row[column] = max(ranks.gather(_relative_difference(got, want)))
            rows.append(row)
            if ranks.rank == 0:
                print(f"agreement, {row['call']} against {row['against']}: {row}",
                      file=sys.stderr)
    return rows


def _loss_lse_grads(e: torch.Tensor, c: torch.Tensor, targets: torch.Tensor, filter_eps,
                    start: Optional[int] = None, stop: Optional[int] = None
                    ) -> list[torch.Tensor]:
    """Loss, lse, dE and dC of the mean loss; vocabulary-parallel over c's rows [start, stop)
    of the full c when they are given. DTensors e (``Replicate()``) and c (``Shard(0)``): the
    DTensor call, whose gradients must be DTensors placed as e and c; their local tensors are
    returned."""
    e = e.detach().requires_grad_()
    vocab_parallel = None
    if start is not None:
        c, vocab_parallel = c[start:stop], cce.VocabParallelOptions(start, stop)
    c = c.detach().requires_grad_()
    loss, lse = cce.linear_cross_entropy(e, c, targets, filter_eps=filter_eps, return_lse=True,
                                         vocab_parallel=vocab_parallel)
    grads = torch.autograd.grad(loss, (e, c))
    for grad, tensor in zip(grads, (e, c)):
        placements = getattr(tensor, "placements", None)
        if getattr(grad, "placements", None) != placements:
            raise RuntimeError(f"a gradient placed as {getattr(grad, 'placements', None)} for "
                               f"a tensor placed as {placements}")
    return [loss.detach(), lse.detach(),
            *(grad.to_local() if hasattr(grad, "to_local") else grad for grad in grads)]


def _gather_rows(ranks: Ranks, rows: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """The full (V, D) tensor of every rank's rows (a SUM of zero-padded copies: the same call
    for NCCL and gloo, CPU and CUDA tensors)."""
    start, stop = ranks.shard(vocab_size)
    full = torch.zeros((vocab_size, rows.shape[1]), dtype=torch.float32, device=rows.device)
    full[start:stop] = rows
    dist.all_reduce(full)
    return full.to(rows.dtype)


def _relative_difference(value: torch.Tensor, expected: torch.Tensor) -> float:
    value, expected = value.detach().double(), expected.detach().double()
    return float((value - expected).norm() / expected.norm())


def _write(ranks: Ranks, rows: list[dict[str, Any]], checks: list[dict[str, Any]],
           out_dir: Path, warmup: int, repeats: int) -> None:
    on_gpu = ranks.device.type == "cuda"
    meta = {
        "tp_size": ranks.world_size,
        "backend": ranks.backend,
        "ranks_per_gpu": ranks.ranks_per_gpu if on_gpu else None,
        "gpus": torch.cuda.device_count() if on_gpu else 0,
        "nccl": ".".join(map(str, torch.cuda.nccl.version())) if on_gpu else None,
        "dtype": str(DTYPE).removeprefix("torch."),
        "times": f"ms of loss + gradients of e and of the rank's rows of c: the slowest rank's "
                 f"median of {repeats} calls after {warmup} warm-up calls"
                 + (" (CUDA events)" if on_gpu else " (CPU smoke test)"),
        "memory": "peak MiB allocated by a rank during one call above its inputs (dE and dC "
                  "included); GPU only",
        "speedup": "loss_parallel's time / the method's",
        "diff_*": "||method - loss_parallel|| / ||loss_parallel|| of the loss, dE and (largest "
                  "over the ranks) the rank's dC",
        "diff_cce": "cce_dtensor against cce: the largest of the relative differences of the "
                    "loss, dE and (over the ranks) dC; 0: the same bits (a GPU's forward may "
                    "differ in the last bits)",
    }
    if on_gpu and ranks.ranks_per_gpu > 1:
        meta["shared_gpu"] = (f"{ranks.ranks_per_gpu} ranks share each GPU: the timings say "
                              "nothing about tensor-parallel speed")
    written = write_results(f"tp_bench_tp{ranks.world_size}", rows, meta, out_dir)
    if checks:
        add_sections(written, {"agreement": checks}, [
            "", "## Agreement with the unsharded call", "",
            "Largest relative difference over the ranks between the vocabulary-parallel call "
            "and the unsharded call on the full classifier, and between the DTensor call (c "
            "sharded Shard(0) by distribute_tensor, e Replicate()) and the vocabulary-parallel "
            "call (dc: the rank's rows).", "",
            *markdown_table(checks)])


def plot(out_dir: Path) -> None:
    """``tp_bench.png``: time and peak memory per rank against N, one panel per shape, a line
    per method and tensor-parallel size, from every ``tp_bench_tp*.json`` in ``out_dir``."""
    import matplotlib

    matplotlib.use("Agg")  # no display: the figure only goes to a file
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullLocator

    runs = sorted((json.loads(path.read_text()) for path in out_dir.glob("tp_bench_tp*.json")),
                  key=lambda run: run["meta"]["tp_size"])
    shapes = list(dict.fromkeys(row["shape"] for run in runs for row in run["rows"]))
    if not shapes:
        return
    figure, axes = plt.subplots(2, len(shapes), figsize=(6.5 * len(shapes), 8.5), squeeze=False)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for index, run in enumerate(runs):
        color = colors[index % len(colors)]  # one color per tensor-parallel size
        size = run["meta"]["tp_size"]
        shared = " (ranks share a GPU)" if run["meta"].get("shared_gpu") else ""
        for method, style, marker in (("cce", "-", "o"), ("cce_dtensor", ":", "^"),
                                      ("loss_parallel", "--", "s")):
            for column, shape in enumerate(shapes):
                rows = [row for row in run["rows"] if row["shape"] == shape
                        and row["method"] == method and "ms" in row]
                if not rows:
                    continue
                tokens = [row["tokens"] for row in rows]
                shown = (method if method == REFERENCE
                         else shown_method(method, run["environment"]))
                label = f"{shown}, TP {size}{shared}"
                axes[0, column].plot(tokens, [row["ms"] for row in rows], style, marker=marker,
                                     color=color, label=label)
                if all("peak_mib_max" in row for row in rows):
                    gigabytes = [row["peak_mib_max"] * MIB / GB for row in rows]
                    axes[1, column].plot(tokens, gigabytes, style, marker=marker, color=color,
                                         label=label)
    for column, shape in enumerate(shapes):
        axes[0, column].set_title(f"{shape}: loss + gradients, slowest rank")
        axes[0, column].set_ylabel("ms (median)")
        axes[1, column].set_title(f"{shape}: peak memory of the busiest rank")
        axes[1, column].set_ylabel("GB above the inputs (1 GB = 10⁹ bytes)")
        for axis in axes[:, column]:
            if not axis.lines:  # memory on a CPU
                axis.text(0.5, 0.5, "not measured (GPU only)", ha="center",
                          transform=axis.transAxes)
                axis.set_axis_off()
                continue
            tokens = sorted({int(x) for line in axis.lines for x in line.get_xdata()})
            axis.set_xscale("log", base=2)
            axis.set_xticks(tokens, [str(n) for n in tokens])
            axis.xaxis.set_minor_locator(NullLocator())
            axis.set_yscale("log")
            label_log_axis(axis)
            axis.set_xlabel("tokens N")
            axis.grid(True, which="major", alpha=0.3)
            axis.legend(fontsize=10)
    environment = runs[-1]["environment"]
    figure.suptitle(f"Vocabulary-parallel cce (local shard, DTensor) vs loss_parallel, "
                    f"bfloat16\n"
                    f"{device_label(environment)}, {environment['date'][:10]}")
    figure.tight_layout()
    figure.savefig(out_dir / FIGURE, dpi=110)
    plt.close(figure)


if __name__ == "__main__":
    exit_rank(main())
