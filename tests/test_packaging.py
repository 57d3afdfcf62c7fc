"""What a new user meets first: the package installs and imports without Triton on a CPU-only
machine, ``cce.integrations`` is reachable after ``import cce``, the licence is declared, and
cce's own calls print no warning.

Each check runs in a fresh interpreter, as a user's script would: this suite has imported
Triton already and set ``TRITON_INTERPRET``.
"""

from __future__ import annotations

import configparser
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# Makes `import triton` fail, as on a machine where it is not installed.
WITHOUT_TRITON = """
import importlib.abc, sys

class _NoTriton(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == "triton" or name.startswith("triton."):
            raise ModuleNotFoundError(f"No module named {name!r}")

sys.meta_path.insert(0, _NoTriton())
"""


def _run(code: str) -> subprocess.CompletedProcess:
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, cwd=ROOT,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def test_the_cpu_path_needs_no_triton() -> None:
    _run(WITHOUT_TRITON + """
import torch
import cce

e = torch.randn(8, 16, requires_grad=True)
c = torch.randn(50, 16, requires_grad=True)
targets = torch.randint(0, 50, (8,))
for impl in ("cce", "cce_torch", "torch"):
    cce.linear_cross_entropy(e, c, targets, impl=impl).backward()
assert cce.integrations.__name__ == "cce.integrations"
assert not [name for name in sys.modules if name.split(".")[0] == "triton"]
""")


def test_integrations_are_reachable_after_import_cce() -> None:
    """As the README writes it: ``cce.integrations.transformers.patch(model)`` after a bare
    ``import cce``; transformers is imported on that first use, not by ``import cce``."""
    pytest.importorskip("transformers")
    _run("""
import sys
import cce

assert "transformers" not in sys.modules
assert callable(cce.integrations.transformers.patch)
""")


def test_the_licence_and_the_distribution_name_are_declared() -> None:
    metadata = configparser.ConfigParser()
    metadata.read(ROOT / "setup.cfg")
    assert (ROOT / "LICENSE").read_text().startswith("MIT License")
    assert metadata["metadata"]["license"] == "MIT"
    assert metadata["metadata"]["license_files"] == "LICENSE"
    # "cce" on the package index is another project: pip install cce would install that.
    assert metadata["metadata"]["name"] == "cce-triton"
    requirements = metadata["options"]["install_requires"]
    assert "triton" not in requirements and "torch" in requirements


# Runs STATEMENTS with every warning recorded, then fails on any but torch's own deprecation
# notices (its compiler imports torch.jit), which no call of cce causes.
RECORDING_WARNINGS = """
import warnings
import torch
import cce

with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
STATEMENTS
ours = [f"{w.category.__name__}: {w.message}" for w in caught
        if not (w.category is DeprecationWarning and "torch.jit" in str(w.message))]
assert not ours, ours
"""


def _run_recording_warnings(statements: str) -> subprocess.CompletedProcess:
    return _run(RECORDING_WARNINGS.replace("STATEMENTS", textwrap.indent(statements, "    ")))


def test_a_patched_model_prints_no_warning() -> None:
    """transformers >= 5.24 logged a deprecation notice (on stderr, through its logger) when
    the patch read the base model's cache as ``past_key_values``."""
    pytest.importorskip("transformers")
    result = _run_recording_warnings("""
from transformers import LlamaConfig, LlamaForCausalLM

config = LlamaConfig(vocab_size=300, hidden_size=32, intermediate_size=64,
                     num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2)
model = cce.integrations.transformers.patch(LlamaForCausalLM(config))
ids = torch.randint(0, 300, (2, 10))
output = model(input_ids=ids, labels=ids)
output.loss.backward()
# transformers >= 5.24 names the returned cache `cache`, earlier versions `past_key_values`.
cache = output.cache if hasattr(output, "cache") else output.past_key_values
assert output.logits is None and cache is not None
""")
    assert "deprecated" not in result.stderr, result.stderr[-2000:]


def test_a_compiled_loss_prints_no_warning() -> None:
    """Dynamo warned, at every compile, that it traced through a functools cache in cce's
    configuration."""
    _run_recording_warnings("""
loss = torch.compile(cce.linear_cross_entropy, fullgraph=True)
e = torch.randn(8, 16, requires_grad=True)
loss(e, torch.randn(50, 16), torch.randint(0, 50, (8,))).backward()
""")
