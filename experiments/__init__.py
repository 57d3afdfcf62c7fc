"""Benchmarks and paper reproductions; run them with ``python -m experiments``.

Every experiment is a module with ``run(quick: bool, out_dir: Path) -> WrittenResults`` (see
:mod:`experiments.harness`) that writes ``<out_dir>/<name>.json`` and ``<out_dir>/<name>.md``.
Registering one is one line below. Modules are imported only when run, so an experiment's
optional dependencies (transformers, datasets, ...) are needed only by that experiment.
"""

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
