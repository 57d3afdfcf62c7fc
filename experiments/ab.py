"""``python -m experiments.ab [REV ...] [--shapes NAME ...] [--rounds R] [--steps S]
[--option KEY=VALUE ...] [--kernels N]``: cce's forward + backward at git revisions against the
working tree, in one process, on the same inputs.

Single benchmark runs move more than the changes they judge (docs/notes/measurement.md), so a
change is judged against its base in one process: each revision's ``cce/`` (by ``git archive``)
and a copy of the working tree's are imported under names of their own (``cce_ab<token>_<i>``),
their custom ops under the same namespace. Before timing, each one's loss, dE and dC in
deterministic mode are compared with the tree's, bit for bit. Then rounds interleave the
variants, their order reversed every other round; a round times ``--steps`` steps of each, every
step from an idle GPU (CUDA events; wall time on CPU), and keeps their median. The report gives
each variant's median over rounds, its ratio to the tree and the host time of its forward call;
the tree's copy against the tree is the harness's own bias, the smallest difference worth
reading. With ``--kernels N``, the profiler then records ``--steps`` steps of each variant per
round, the variants alternating as above, and the report adds the N kernels that take each
variant most time: each variant's median ms per step in each (on CPU: PyTorch's operations, self
time).
Inputs: the bench's shapes (:data:`experiments.bench.SHAPES`), LM-like synthetic at their sizes
(real-data shapes too).
"""

from __future__ import annotations

import argparse
import collections
import importlib
import io
import re
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any, Callable, NamedTuple, Sequence

import torch
from torch.profiler import ProfilerActivity, profile

from experiments.bench import SHAPES, _synthetic_inputs
from experiments.harness import (INTERPRETER_CAVEAT, ON_GPU, REPOSITORY, environment,
                                 kernels_interpreted, log, loss_option, progress)

TREE = "tree"
TREE_COPY = "tree copy"
# Where a package names itself: imports of its modules, its custom ops ("cce::..."), dynamic
# imports ("cce.integrations"). A plain `import cce` (the integrations') keeps the tree's.
_OWN_NAME = re.compile(r"""(\bfrom |\bimport |["']|torch\.ops\.)cce(?=\.|::| import)""")
_COPY_NAMESPACE = re.compile(r"\bcce_ab[0-9a-f]+_[0-9]+::")


def renamed_copy(revision: str, name: str, root: Path) -> None:
    """``cce/`` at ``revision`` (:data:`TREE`: the working tree) as the package ``name`` in
    ``root``, every reference to its own name (and its custom ops' namespace) renamed."""
    target = root / name
    if revision == TREE:
        shutil.copytree(REPOSITORY / "cce", target,
                        ignore=shutil.ignore_patterns("__pycache__"))
    else:
        try:
            git = subprocess.run(["git", "-C", str(REPOSITORY), "archive", revision, "cce"],
                                 capture_output=True)
        except FileNotFoundError:
            raise ValueError("comparing revisions needs git on the PATH") from None
        if git.returncode:
            raise ValueError(f"revision {revision!r}: git archive says "
                             f"{git.stderr.decode().strip()}")
        archive = git.stdout
        with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
            for member in tar.getmembers():
                member.name = member.name.partition("/")[2] or "."
            safe = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
            tar.extractall(target, **safe)
    for path in target.rglob("*.py"):
        path.write_text(_OWN_NAME.sub(lambda match: match.group(1) + name, path.read_text()))


def variants(revisions: Sequence[str], root: Path) -> "dict[str, Any]":
    """Label -> imported package: the tree itself, each revision, and the tree's copy. Names
    new to the process: a custom op's namespace can be registered once."""
    packages = {TREE: importlib.import_module("cce")}
    if Path(packages[TREE].__file__).resolve().parents[1] != REPOSITORY:
        raise ValueError(f"the cce imported ({packages[TREE].__file__}) is not this "
                         f"repository's working tree ({REPOSITORY}): install it with "
                         "`pip install -e .`")
    sys.path.insert(0, str(root))
    token = uuid.uuid4().hex[:8]
    for index, revision in enumerate([*revisions, TREE]):
        name = f"cce_ab{token}_{index}"
        renamed_copy(revision, name, root)
        packages[TREE_COPY if index == len(revisions) else revision] = (
            importlib.import_module(name))
    return packages


def _step(package: Any, e: torch.Tensor, c: torch.Tensor, targets: torch.Tensor,
          options: "dict[str, Any]") -> "tuple[float, float]":
    """(ms of forward + backward from an idle device, host ms of the forward call)."""
    e.grad = c.grad = None
    if ON_GPU:
        torch.cuda.synchronize()
        start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
        start.record()
    began = time.perf_counter()
    loss = package.linear_cross_entropy(e, c, targets, **options)
    forward_host = time.perf_counter() - began
    loss.backward()
    if not ON_GPU:
        return (time.perf_counter() - began) * 1e3, forward_host * 1e3
    end.record()
    end.synchronize()
    return start.elapsed_time(end), forward_host * 1e3


def bitwise_equal(packages: "dict[str, Any]", e: torch.Tensor, c: torch.Tensor,
                  targets: torch.Tensor, options: "dict[str, Any]") -> "dict[str, list[bool]]":
    """Per variant, whether its (loss, dE, dC) with ``options`` are the tree's bits (dC None
    where ``c`` is frozen). Deterministic mode is the caller's to ask for."""
    results = {}
    for label, package in packages.items():
        e.grad = c.grad = None
        loss = package.linear_cross_entropy(e, c, targets, **options)
        loss.backward()
        results[label] = [loss.detach().clone(), e.grad.clone(),
                          None if c.grad is None else c.grad.clone()]
    tree = results[TREE]
    return {label: [(a is None and b is None) or (a is not None and b is not None
                                                 and torch.equal(a, b))
                    for a, b in zip(outputs, tree)]
            for label, outputs in results.items() if label != TREE}


def kernel_times(package: Any, e: torch.Tensor, c: torch.Tensor, targets: torch.Tensor,
                 options: "dict[str, Any]", steps: int) -> "dict[str, float]":
    """Kernel name -> ms per step over ``steps`` profiled steps (on CPU: each operation's
    self time)."""
    activity = ProfilerActivity.CUDA if ON_GPU else ProfilerActivity.CPU
    with profile(activities=[activity]) as profiler:
        for _ in range(steps):
            _step(package, e, c, targets, options)
    device = torch.autograd.DeviceType.CUDA if ON_GPU else torch.autograd.DeviceType.CPU
    totals: "dict[str, float]" = collections.defaultdict(float)
    for event in profiler.events():
        if event.device_type == device:
            microseconds = event.device_time if ON_GPU else event.self_cpu_time_total
            # A copy's custom ops under the tree's namespace, so that the variants line up.
            totals[_COPY_NAMESPACE.sub("cce::", event.name)] += microseconds / 1e3 / steps
    return dict(totals)


class Comparison(NamedTuple):
    """One shape's A/B: per variant other than the tree, whether its (loss, dE, dC) are the
    tree's bits; per variant, its median ms of forward + backward and of the forward call's
    host time; with ``--kernels``, per variant, kernel name -> median ms per step."""

    bit_for_bit: "dict[str, list[bool]]"
    medians: "dict[str, dict[str, float]]"
    kernels: "dict[str, dict[str, float]]"


def compare(packages: "dict[str, Any]", shape_name: str, rounds: int, steps: int,
            options: "dict[str, Any]", report: Callable[[str], None] = print,
            kernels: int = 0) -> Comparison:
    """Time every variant at one shape (module docstring); report and return the results."""
    shape = SHAPES[shape_name]
    e, c, targets = _synthetic_inputs(shape, shape.ignored_fraction)
    try:
        checked, how = {**options, "deterministic": True}, "in deterministic mode"
        equal = bitwise_equal(packages, e, c, targets, checked)
    except ValueError:  # options that deterministic mode does not take
        checked, how = options, "(not deterministic: bits may differ between runs)"
        equal = bitwise_equal(packages, e, c, targets, checked)
    for label, same in equal.items():
        report(f"{shape_name}: {label} == tree bit for bit {how} (loss, dE, dC): {same}")
    if ON_GPU:  # compiled and warm (the interpreter compiles nothing)
        for package in packages.values():
            _step(package, e, c, targets, options)
    times: "dict[str, list[float]]" = {label: [] for label in packages}
    host: "dict[str, list[float]]" = {label: [] for label in packages}
    for label, package in progress(_interleaved(packages, rounds), f"{shape_name} rounds",
                                   leave=False):
        samples = [_step(package, e, c, targets, options) for _ in range(steps)]
        times[label].append(statistics.median(sample[0] for sample in samples))
        host[label].append(statistics.median(sample[1] for sample in samples))
    medians = {label: {"ms": statistics.median(times[label]),
                       "forward_host_ms": statistics.median(host[label])} for label in packages}
    tree_ms = medians[TREE]["ms"]
    for label, median in medians.items():
        report(f"{shape_name}: {label:>12}  {median['ms']:9.3f} ms  "
               f"{median['ms'] / tree_ms:6.3f} of the tree  forward call's host time "
               f"{median['forward_host_ms']:.3f} ms")
    return Comparison(equal, medians, _kernel_report(
        packages, e, c, targets, options, rounds, steps, kernels, shape_name, report)
        if kernels else {})


def _interleaved(packages: "dict[str, Any]", rounds: int) -> "list[tuple[str, Any]]":
    """Every variant once per round, the order reversed every other round."""
    order = list(packages.items())
    return [item for index in range(rounds) for item in (order if index % 2 == 0
                                                          else order[::-1])]


def _kernel_report(packages: "dict[str, Any]", e: torch.Tensor, c: torch.Tensor,
                   targets: torch.Tensor, options: "dict[str, Any]", rounds: int, steps: int,
                   count: int, shape_name: str, report: Callable[[str], None]
                   ) -> "dict[str, dict[str, float]]":
    """Profiled rounds (module docstring); report the ``count`` kernels that take each variant
    most time and return every kernel's median ms per step, per variant."""
    samples: "dict[str, list[dict[str, float]]]" = {label: [] for label in packages}
    for label, package in progress(_interleaved(packages, rounds),
                                   f"{shape_name} profiled rounds", leave=False):
        samples[label].append(kernel_times(package, e, c, targets, options, steps))
    medians = {label: {name: statistics.median(sample.get(name, 0.0) for sample in runs)
                       for name in set().union(*runs)} for label, runs in samples.items()}
    # Each variant's busiest kernels: a kernel that only a revision launches shows too.
    busiest = {name for times in medians.values()
               for name in sorted(times, key=times.get, reverse=True)[:count]}
    report(f"{shape_name}: ms per step, median of {rounds} profiled rounds of {steps} steps: "
           + ", ".join(packages))
    for name in sorted(busiest, key=lambda name: max(times.get(name, 0.0)
                                                     for times in medians.values()),
                       reverse=True):
        times = "  ".join(f"{medians[label].get(name, 0.0):8.3f}" for label in packages)
        report(f"{shape_name}: {times}  {name[:70]}")
    return medians


def main(argv: "Sequence[str] | None" = None) -> "dict[str, Comparison]":
    """The command line (module docstring); each shape's :class:`Comparison`."""
    parser = argparse.ArgumentParser(prog="python -m experiments.ab", description=(
        "cce's fwd+bwd at git revisions against the working tree, in one process"))
    parser.add_argument("revisions", nargs="*", help="git revisions to compare with the tree")
    parser.add_argument("--shapes", nargs="+", default=["llama3_8b_n1024"] if ON_GPU
                        else ["quick"], choices=sorted(SHAPES), metavar="NAME",
                        help="the bench's shapes (default: llama3_8b_n1024; quick on CPU)")
    parser.add_argument("--rounds", type=int, default=10 if ON_GPU else 2)
    parser.add_argument("--steps", type=int, default=10 if ON_GPU else 1,
                        help="steps per variant and round (their median is the round's)")
    parser.add_argument("--option", type=loss_option, action="append", default=[],
                        metavar="KEY=VALUE", help="a loss option for every variant")
    parser.add_argument("--kernels", type=int, default=0, metavar="N",
                        help="then profile the variants, alternating, and report the N "
                        "kernels that take each variant most time")
    args = parser.parse_args(argv)
    env = environment()
    log(f"{env['device']} · torch {env['torch']} · triton {env['triton']} · {env['date']} · "
        f"options {dict(args.option)} · {args.rounds} rounds of {args.steps} steps")
    if kernels_interpreted(env):
        log(INTERPRETER_CAVEAT)
    with tempfile.TemporaryDirectory() as root:
        packages = variants(args.revisions, Path(root))
        return {shape: compare(packages, shape, args.rounds, args.steps, dict(args.option),
                               report=log, kernels=args.kernels)
                for shape in args.shapes}


if __name__ == "__main__":
    main()
