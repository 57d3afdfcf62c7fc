"""cce.integrations.transformers.patch on a model sharded by FSDP2 (``fully_shard``).

FSDP2 runs on CPU tensors over gloo (torch 2.13), so this runs in CI: 2 processes over gloo, each
with the same tiny model, sharded by decoder layer and at the root over a CPU device mesh (also on
a machine with GPUs, where cce runs its kernels there). The patched sharded model's
loss and gradients (the full tensors of the sharded ones) match those of the model unwrapped and
unpatched, as in tests/test_integration_transformers.py. The spawn has a time limit, so a hang
fails (tests/distributed.py).
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

import cce
from tests.distributed import run_ranks
from tests.reference import relative_error

transformers = pytest.importorskip("transformers")

from cce.integrations.transformers import patch  # noqa: E402
from tests.test_integration_transformers import TOLERANCE, make_batch, tiny_model  # noqa: E402

# (family, whether lm_head is sharded as a module of its own): then its weight is gathered only
# inside its forward. Gemma 2 ties lm_head to the embedding, which the root shards (with the
# softcap on top).
CASES = (("llama", True), ("gemma2", False))


def fsdp_worker(rank: int, world_size: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    # Explicitly on the CPU: fully_shard's default mesh is on the GPUs when there are some.
    mesh = init_device_mesh("cpu", (world_size,))
    for family, shard_lm_head in CASES:
        reference = tiny_model(family, "cpu")
        model = copy.deepcopy(reference)
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        if shard_lm_head:
            fully_shard(model.lm_head, mesh=mesh)
        fully_shard(model, mesh=mesh)
        patch(model)
        inputs = make_batch(torch.Generator().manual_seed(0), "cpu")

        expected = reference(**inputs)
        output = model(**inputs)
        expected.loss.backward()
        output.loss.backward()

        where = f"rank {rank}, {family}"
        assert output.logits is None, where
        assert relative_error(output.loss, expected.loss) <= TOLERANCE, where
        expected_gradients = {name: parameter.grad
                              for name, parameter in reference.named_parameters()}
        for name, parameter in model.named_parameters():
            error = relative_error(parameter.grad.full_tensor(), expected_gradients[name])
            assert error <= TOLERANCE, f"{where}: gradient of {name}: relative error {error:.2e}"

        # Outside the forward, the weight is this rank's shard, a DTensor.
        with pytest.raises(ValueError, match="c is a DTensor"):
            cce.linear_cross_entropy(torch.randn(3, model.config.hidden_size),
                                     model.lm_head.weight, torch.zeros(3, dtype=torch.long))


def test_patched_fsdp2_model_matches_the_unwrapped_model(tmp_path: Path) -> None:
    run_ranks(fsdp_worker, 2, tmp_path, timeout_s=600)
