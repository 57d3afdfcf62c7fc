"""Benchmarks and paper reproductions; run them with ``python -m experiments`` from the
repository root (the package is not installed: it lives beside ``cce``).

Every experiment is a module with ``run(quick: bool, out_dir: Path) -> WrittenResults`` (see
:mod:`experiments.harness`) that writes ``<out_dir>/<name>.json`` and ``<out_dir>/<name>.md``.
Registering one is one line below. Modules are imported only when run, so an experiment's
optional dependencies (transformers, matplotlib, ...) are needed only by that experiment.
Beside them, tools with a command line of their own: ``experiments.ab`` (cce at git revisions
against the working tree, in one process), ``experiments.tp_bench`` and
``experiments.fsdp_finetune`` (several GPUs).

On a machine without CUDA the experiments measure cce's Triton kernels in Triton's CPU
interpreter, which must be turned on before anything imports triton. Importing this package
does it (keeping a ``TRITON_INTERPRET`` that the caller set), so it holds for
``python -m experiments``, ``python -m experiments.NAME`` and the notebook alike.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

EXPERIMENTS: dict[str, str] = {
    "alpaca_finetune": "experiments.alpaca_finetune",
    "bench": "experiments.bench",
    "compare_impls": "experiments.compare_impls",
    "fig1_memory": "experiments.fig1_memory",
    "fig3_sparsity": "experiments.fig3_sparsity",
    "table1": "experiments.table1",
    "table_a1": "experiments.table_a1",
    "table_a2": "experiments.table_a2",
}
# Experiments that compute without timing anything: no interpreter caveat for them on a CPU.
COMPUTED_ONLY = frozenset({"fig1_memory"})
