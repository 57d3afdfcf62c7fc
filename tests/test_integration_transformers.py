"""cce.integrations.transformers: a patched Hugging Face causal LM trains exactly as before.

Every test compares a patched model with an unpatched deep copy of it (tiny, randomly
initialised, float32, on the test device): same loss and gradients within 1e-5 relative error,
logits not materialized when labels are given, the same logits when they are not. (Every model
type of transformers, against the unpatched model: tests/test_model_coverage.py.)
"""

from __future__ import annotations

import copy
import functools
import inspect
from typing import Callable, NamedTuple

import pytest
import torch
from torch.nn import functional as nn_functional

import cce

transformers = pytest.importorskip("transformers")

from cce.integrations.transformers import patch, unpatch  # noqa: E402
from tests.helpers import assert_same_gradients  # noqa: E402
from tests.reference import relative_error  # noqa: E402

BATCH, SEQ, VOCAB = 2, 16, 320
TOLERANCE = 1e-5  # float32
IMPLS = ("cce", "torch")

TINY = dict(
    vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64,
    pad_token_id=0, bos_token_id=1, eos_token_id=2,
    # Logits of standard deviation ~1 rather than ~0.1: a softmax far from uniform, and a
    # softcap that changes the loss by far more than the tolerance.
    initializer_range=0.2,
)
# family: (config class, model class, config entries beyond TINY)
FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {}),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {}),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", {"final_logit_softcapping": 30.0}),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", {}),
    # Logits multiplied by a scale, divided by one; a mixture of experts with its router loss.
    "cohere": ("CohereConfig", "CohereForCausalLM", {"logit_scale": 0.5}),
    "granite": ("GraniteConfig", "GraniteForCausalLM", {"logits_scaling": 2.0}),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", {
        "num_local_experts": 4, "num_experts_per_tok": 2, "output_router_logits": True,
        "router_aux_loss_coef": 0.1}),
}


def tiny_model(family: str, device: str) -> transformers.PreTrainedModel:
    """A freshly initialised 2-layer model of ``family`` (the same weights on every call)."""
    config_name, model_name, extra = FAMILIES[family]
    if not hasattr(transformers, model_name):
        pytest.skip(f"transformers {transformers.__version__} has no {model_name}")
    torch.manual_seed(0)
    config = getattr(transformers, config_name)(**TINY, **extra)
    return getattr(transformers, model_name)(config).to(device)


def reference_and_patched(family: str, device: str, **options) -> tuple:
    """An unpatched model and a patched copy with the same weights."""
    reference = tiny_model(family, device)
    return reference, patch(copy.deepcopy(reference), **options)


def make_batch(gen: torch.Generator, device: str, batch: int = BATCH) -> dict[str, torch.Tensor]:
    """Input ids, attention mask and labels: a masked prompt in row 0, right padding in row 1."""
    input_ids = torch.randint(3, VOCAB, (batch, SEQ), generator=gen)
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, -5:] = 0
    input_ids[1, -5:] = 0  # pad_token_id
    labels = input_ids.clone()
    labels[0, :4] = -100
    labels[attention_mask == 0] = -100
    batch_inputs = dict(input_ids=input_ids, attention_mask=attention_mask, labels=labels)
    return {name: tensor.to(device) for name, tensor in batch_inputs.items()}


def watched_gradients(model) -> dict[str, torch.Tensor]:
    """Gradients of the classifier, the embedding (the same tensor when tied) and layer 0."""
    return {
        "lm_head.weight": model.lm_head.weight.grad,
        "embed_tokens.weight": model.model.embed_tokens.weight.grad,
        "layers.0": torch.cat([p.grad.flatten() for p in model.model.layers[0].parameters()]),
    }


def assert_same_training_step(model, reference) -> None:
    for name, expected in watched_gradients(reference).items():
        error = relative_error(watched_gradients(model)[name], expected)
        assert error <= TOLERANCE, f"gradient of {name}: relative error {error:.2e}"


def count_lm_head_calls(model) -> list[int]:
    """A list whose length grows by one each time lm_head runs (i.e. logits are computed)."""
    calls: list[int] = []
    model.lm_head.register_forward_hook(lambda *_: calls.append(1))
    return calls


class TrainingStep(NamedTuple):
    model: transformers.PreTrainedModel  # the patched copy
    inputs: dict
    output: object  # the patched copy's
    expected: object  # the reference's
    head_calls: list  # of the patched copy's head


def patched_training_step(reference, gen, device) -> TrainingStep:
    """A patched copy of ``reference`` and one training step of both on a batch, gradients
    computed."""
    model = patch(copy.deepcopy(reference))
    head_calls = count_lm_head_calls(model)
    inputs = make_batch(gen, device)
    output, expected = model(**inputs), reference(**inputs)
    output.loss.backward()
    expected.loss.backward()
    return TrainingStep(model, inputs, output, expected, head_calls)


@pytest.fixture
def cce_calls(monkeypatch: pytest.MonkeyPatch) -> list[dict]:
    """The arguments of every cce.linear_cross_entropy call the patched models make."""
    calls: list[dict] = []
    linear_cross_entropy = cce.linear_cross_entropy

    def recording_linear_cross_entropy(*args, **kwargs):
        calls.append(dict(args=args, kwargs=kwargs))
        return linear_cross_entropy(*args, **kwargs)

    monkeypatch.setattr(cce, "linear_cross_entropy", recording_linear_cross_entropy)
    return calls


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("family", FAMILIES)
def test_loss_and_gradients_match_the_unpatched_model(family, impl, gen, device):
    reference, model = reference_and_patched(family, device, impl=impl)
    inputs = make_batch(gen, device)
    lm_head_calls = count_lm_head_calls(model)

    expected = reference(**inputs)
    output = model(**inputs)
    expected.loss.backward()
    output.loss.backward()

    assert relative_error(output.loss, expected.loss) <= TOLERANCE
    assert_same_training_step(model, reference)
    assert output.logits is None
    assert not lm_head_calls, "the patched model computed logits"


def test_gemma2_softcapping_is_applied(gen, device):
    reference, model = reference_and_patched("gemma2", device)
    inputs = make_batch(gen, device)
    uncapped = copy.deepcopy(model)
    uncapped.config.final_logit_softcapping = None

    loss, uncapped_loss = model(**inputs).loss, uncapped(**inputs).loss

    assert relative_error(loss, reference(**inputs).loss) <= TOLERANCE
    assert relative_error(uncapped_loss, loss) > 10 * TOLERANCE


def test_gradient_accumulation_with_num_items_in_batch_equals_one_big_batch(gen, device):
    reference, model = reference_and_patched("llama", device)
    inputs = make_batch(gen, device, batch=4)
    inputs["labels"][2, :10] = -100  # micro-batches with different numbers of target tokens
    num_items_in_batch = (inputs["labels"][:, 1:] != -100).sum()  # what Trainer passes

    expected = reference(**inputs).loss
    expected.backward()
    accumulated = 0.0
    for rows in (slice(0, 2), slice(2, 4)):
        micro_batch = {name: tensor[rows] for name, tensor in inputs.items()}
        loss = model(**micro_batch, num_items_in_batch=num_items_in_batch).loss
        loss.backward()
        accumulated += loss.detach()

    assert relative_error(accumulated, expected) <= TOLERANCE
    assert_same_training_step(model, reference)


@pytest.mark.parametrize("family", FAMILIES)
def test_without_labels_the_logits_are_the_unpatched_ones(family, gen, device):
    reference, model = reference_and_patched(family, device)
    inputs = make_batch(gen, device)
    del inputs["labels"]

    output, expected = model(**inputs), reference(**inputs)

    assert output.loss is None
    assert torch.equal(output.logits, expected.logits)


def test_generation_is_unchanged(device):
    reference, model = reference_and_patched("gemma2", device)
    prompt = torch.arange(3, 8, device=device)[None]

    generated = model.generate(prompt, max_new_tokens=4, do_sample=False)

    assert torch.equal(generated, reference.generate(prompt, max_new_tokens=4, do_sample=False))


def test_the_forward_keeps_the_signature_that_trainer_and_generate_read(device):
    # Trainer passes num_items_in_batch only to a forward with **kwargs; generate passes
    # logits_to_keep only to a forward that names it.
    reference, model = reference_and_patched("llama", device)

    assert inspect.signature(model.forward) == inspect.signature(reference.forward)


def test_shift_labels_replace_the_shifted_labels(gen, device):
    reference, model = reference_and_patched("llama", device, impl="torch")
    inputs = make_batch(gen, device)
    # What sequence-parallel training passes: labels already shifted (and sharded).
    shift_labels = torch.nn.functional.pad(inputs["labels"][:, 1:], (0, 1), value=-100)
    shift_labels[:, 5] = -100

    loss = model(**inputs, shift_labels=shift_labels).loss
    expected = reference(**inputs, shift_labels=shift_labels).loss

    assert relative_error(loss, expected) <= TOLERANCE


def test_labels_may_be_passed_positionally(gen, device):
    reference, model = reference_and_patched("llama", device, impl="torch")
    inputs = make_batch(gen, device)
    # LlamaForCausalLM.forward(input_ids, attention_mask, position_ids, past_key_values,
    # inputs_embeds, labels, ...)
    positional = (inputs["input_ids"], inputs["attention_mask"], None, None, None, inputs["labels"])

    output = model(*positional)

    assert output.logits is None
    assert relative_error(output.loss, reference(**inputs).loss) <= TOLERANCE


def test_return_dict_false_gives_a_tuple_that_starts_with_the_loss(gen, device):
    reference, model = reference_and_patched("llama", device, impl="torch")
    inputs = make_batch(gen, device)

    output = model(**inputs, return_dict=False)

    assert isinstance(output, tuple)
    assert relative_error(output[0], reference(**inputs).loss) <= TOLERANCE


def test_labels_with_logits_to_keep_run_the_model_own_forward(gen, device):
    reference, model = reference_and_patched("llama", device)
    inputs = make_batch(gen, device)

    output = model(**inputs, logits_to_keep=SEQ)
    expected = reference(**inputs, logits_to_keep=SEQ)

    assert torch.equal(output.loss, expected.loss)
    assert torch.equal(output.logits, expected.logits)


def test_under_autocast_the_loss_multiplies_in_the_autocast_dtype(gen, device, cce_calls):
    reference, model = reference_and_patched("llama", device)
    inputs = make_batch(gen, device)

    with torch.autocast(device, dtype=torch.bfloat16):
        loss, expected = model(**inputs).loss, reference(**inputs).loss

    embeddings, classifier, _ = cce_calls[0]["args"]
    assert embeddings.dtype == classifier.dtype == torch.bfloat16  # as lm_head's matmul would
    assert loss.dtype == torch.float32
    # The reference also rounds the logits to bfloat16; cce keeps them in float32.
    assert relative_error(loss, expected) <= 4e-3


def test_unpatch_restores_the_model_own_forward(gen, device):
    reference, model = reference_and_patched("llama", device)
    inputs = make_batch(gen, device)

    assert unpatch(model) is model
    output, expected = model(**inputs), reference(**inputs)

    assert "forward" not in vars(model)
    assert torch.equal(output.loss, expected.loss)
    assert torch.equal(output.logits, expected.logits)


def test_patching_again_replaces_the_options_instead_of_stacking(gen, device, cce_calls):
    model = tiny_model("llama", device)
    inputs = make_batch(gen, device)
    patch(model, impl="torch")
    patch(model, impl="cce")

    model(**inputs)
    unpatch(model)

    assert [call["kwargs"]["impl"] for call in cce_calls] == ["cce"]
    assert "forward" not in vars(model)


def test_memory_option_reaches_the_loss(gen, device, cce_calls):
    """``memory="fast"`` (the dense path at this vocabulary) trains as the model's own loss."""
    reference, model = reference_and_patched("llama", device, memory="fast")
    inputs = make_batch(gen, device)
    output, expected = model(**inputs), reference(**inputs)
    output.loss.backward()
    expected.loss.backward()
    assert [call["kwargs"]["memory"] for call in cce_calls] == ["fast"]
    assert relative_error(output.loss, expected.loss) <= 1e-5
    assert_same_training_step(model, reference)


class LlamaWithCenteredLogits(transformers.LlamaForCausalLM):
    """A forward that does more with its logits than a scale and a softcap."""

    def forward(self, input_ids=None, labels=None, **kwargs):
        hidden_states = self.model(input_ids=input_ids, **kwargs).last_hidden_state
        logits = self.lm_head(hidden_states)
        logits = logits - logits.mean(-1, keepdim=True)
        loss = self.loss_function(logits, labels, self.config.vocab_size)
        return transformers.modeling_outputs.CausalLMOutput(loss=loss, logits=logits)


class LlamaCenteringInTraining(transformers.LlamaForCausalLM):
    """A branch on ``self.training``, which patch does not read as the configuration (the mode
    changes with train() and eval())."""

    def forward(self, input_ids=None, labels=None, **kwargs):
        logits = self.lm_head(self.model(input_ids=input_ids, **kwargs).last_hidden_state)
        if not self.training:
            logits = logits - logits.mean(-1, keepdim=True)
        loss = self.loss_function(logits, labels, self.config.vocab_size)
        return transformers.modeling_outputs.CausalLMOutput(loss=loss, logits=logits)


class LlamaWithItsOwnLoss(transformers.LlamaForCausalLM):
    """A forward that computes its loss from the logits otherwise than by a cross-entropy."""

    def forward(self, input_ids=None, labels=None, **kwargs):
        logits = self.lm_head(self.model(input_ids=input_ids, **kwargs).last_hidden_state)
        loss = logits.logsumexp(-1).mean()
        return transformers.modeling_outputs.CausalLMOutput(loss=loss, logits=logits)


class LogitSoftcap(torch.nn.Module):
    """A softcap as a module of its own (as Inkling 2 has it)."""

    def __init__(self, cap: float) -> None:
        super().__init__()
        self.cap = cap

    def forward(self, logits: torch.Tensor) -> torch.Tensor:
        return torch.tanh(logits / self.cap) * self.cap


class LogitCentering(torch.nn.Module):
    """A module that does more with the logits than a scale and a softcap."""

    def forward(self, logits: torch.Tensor) -> torch.Tensor:
        return logits - logits.mean(-1, keepdim=True)


class LlamaWithLogitModule(transformers.LlamaForCausalLM):
    """A forward that passes its logits through a module of its own."""

    def __init__(self, config, logit_module: torch.nn.Module) -> None:
        super().__init__(config)
        self.logit_module = logit_module

    def forward(self, input_ids=None, labels=None, **kwargs):
        hidden_states = self.model(input_ids=input_ids, **kwargs).last_hidden_state
        logits = self.lm_head(hidden_states).float()
        logits = self.logit_module(logits)
        loss = self.loss_function(logits=logits, labels=labels, vocab_size=logits.shape[-1])
        return transformers.modeling_outputs.CausalLMOutput(loss=loss, logits=logits)


def test_a_softcap_module_of_the_model_is_applied(gen, device):
    torch.manual_seed(0)
    reference = LlamaWithLogitModule(transformers.LlamaConfig(**TINY), LogitSoftcap(0.05))
    reference = reference.to(device)

    step = patched_training_step(reference, gen, device)

    assert step.output.logits is None and not step.head_calls
    assert relative_error(step.output.loss, step.expected.loss) <= TOLERANCE
    assert_same_training_step(step.model, reference)
    uncapped = LlamaWithLogitModule(transformers.LlamaConfig(**TINY), torch.nn.Identity())
    uncapped.load_state_dict(reference.state_dict())
    # The cap moves the loss: the patched loss applied it.
    uncapped_loss = uncapped.to(device)(**step.inputs).loss
    assert relative_error(uncapped_loss, step.expected.loss) > 10 * TOLERANCE


def test_a_masked_lm_loss_function_is_reproduced(gen, device):
    """ForMaskedLMLoss (T5Gemma 2's): the labels are not shifted."""
    from transformers.loss.loss_utils import LOSS_MAPPING

    reference = tiny_model("llama", device)
    reference._loss_function = LOSS_MAPPING["ForMaskedLM"]

    step = patched_training_step(reference, gen, device)

    assert relative_error(step.output.loss, step.expected.loss) <= TOLERANCE
    assert_same_training_step(step.model, reference)
    shifted = tiny_model("llama", device)(**step.inputs).loss  # the default, ForCausalLMLoss
    assert relative_error(shifted, step.expected.loss) > 10 * TOLERANCE


class LlamaMaskingTokens(transformers.LlamaForCausalLM):
    """Chameleon's mask: vocabulary entries (its image tokens) set to the dtype's minimum."""

    MASKED = [5, 17, 40]

    def forward(self, input_ids=None, labels=None, **kwargs):
        logits = self.lm_head(self.model(input_ids=input_ids, **kwargs).last_hidden_state)
        logits[:, :, self.MASKED] = torch.finfo(logits.dtype).min
        loss = self.loss_function(logits=logits, labels=labels, vocab_size=logits.shape[-1])
        return transformers.modeling_outputs.CausalLMOutput(loss=loss, logits=logits)


class LlamaMaskingScaledLogits(LlamaMaskingTokens):
    """A mask after a logit scale, and one before: neither reproduced (a masked target's
    logit would not be the minimum)."""

    def forward(self, input_ids=None, labels=None, **kwargs):
        logits = self.lm_head(self.model(input_ids=input_ids, **kwargs).last_hidden_state)
        if self.config.mask_first:
            logits[:, :, self.MASKED] = torch.finfo(logits.dtype).min
        logits = logits * 2.0
        if not self.config.mask_first:
            logits[:, :, self.MASKED] = torch.finfo(logits.dtype).min
        loss = self.loss_function(logits=logits, labels=labels, vocab_size=logits.shape[-1])
        return transformers.modeling_outputs.CausalLMOutput(loss=loss, logits=logits)


class LlamaMaskingAfterAView(LlamaMaskingTokens):
    """The mask set after a view of the logits was taken: in PyTorch the view sees it."""

    def forward(self, input_ids=None, labels=None, **kwargs):
        logits = self.lm_head(self.model(input_ids=input_ids, **kwargs).last_hidden_state)
        shifted = logits[:, :-1]
        logits[:, :, self.MASKED] = torch.finfo(logits.dtype).min
        loss = nn_functional.cross_entropy(shifted.reshape(-1, shifted.shape[-1]),
                                           labels[:, 1:].reshape(-1))
        return transformers.modeling_outputs.CausalLMOutput(loss=loss, logits=logits)


@pytest.mark.parametrize("masked_targets", [False, True], ids=["other-targets", "masked-targets"])
def test_masked_vocabulary_entries_are_reproduced(masked_targets, gen, device):
    """Entries set to the dtype's minimum take no part in the softmax; a target among them
    scores the minimum (a loss of about 3.4e38, inf once summed, as PyTorch's) with no gradient
    at itself, as an overwritten logit has none."""
    torch.manual_seed(0)
    reference = LlamaMaskingTokens(transformers.LlamaConfig(**TINY)).to(device)
    model = patch(copy.deepcopy(reference))
    inputs = make_batch(gen, device)
    scored = inputs["labels"] >= 0
    is_masked = torch.isin(inputs["labels"], torch.tensor(reference.MASKED, device=device))
    inputs["labels"][scored & is_masked] = 3
    if masked_targets:
        inputs["labels"][0, 6], inputs["labels"][1, 3] = 5, 40
    output, expected = model(**inputs), reference(**inputs)
    assert output.logits is None
    if masked_targets:
        assert torch.isinf(expected.loss) and torch.equal(output.loss, expected.loss)
    else:
        assert relative_error(output.loss, expected.loss) <= TOLERANCE
    output.loss.backward()
    expected.loss.backward()
    assert_same_training_step(model, reference)
    assert torch.all(model.lm_head.weight.grad[reference.MASKED] == 0)

    for mask_first, message in ((False, "before any scale or cap"),
                                (True, "scale or cap after masked")):
        config = transformers.LlamaConfig(**TINY, mask_first=mask_first)
        scaled = patch(LlamaMaskingScaledLogits(config).to(device))
        with pytest.raises(AttributeError, match=message):
            scaled(**inputs)
    after_a_view = patch(LlamaMaskingAfterAView(transformers.LlamaConfig(**TINY)).to(device))
    with pytest.raises(AttributeError, match="before any scale or cap"):
        after_a_view(**inputs)


class LlamaWithZLoss(transformers.LlamaForCausalLM):
    """Bamba's z-loss: the mean square of every position's LSE, added to the loss, here taken
    after the cross-entropy (of scaled logits)."""

    def forward(self, input_ids=None, labels=None, **kwargs):
        hidden_states = self.model(input_ids=input_ids, **kwargs).last_hidden_state
        logits = self.lm_head(hidden_states) * 2.0
        loss = self.loss_function(logits=logits, labels=labels, vocab_size=logits.shape[-1])
        z_loss = logits.logsumexp(dim=-1).to(dtype=loss.dtype).pow(2).mean()
        return transformers.modeling_outputs.CausalLMOutput(loss=loss + 0.01 * z_loss,
                                                            logits=logits)


class LlamaWithZLossFirst(transformers.LlamaForCausalLM):
    """The z-loss taken before the cross-entropy."""

    def forward(self, input_ids=None, labels=None, **kwargs):
        hidden_states = self.model(input_ids=input_ids, **kwargs).last_hidden_state
        logits = self.lm_head(hidden_states) * 2.0
        z_loss = torch.logsumexp(logits, -1).pow(2).mean()
        loss = self.loss_function(logits=logits, labels=labels, vocab_size=logits.shape[-1])
        return transformers.modeling_outputs.CausalLMOutput(loss=loss + 0.01 * z_loss,
                                                            logits=logits)


class LlamaWithPositionLSE(transformers.LlamaForCausalLM):
    """A log-sum-exp over the positions, not the vocabulary."""

    def forward(self, input_ids=None, labels=None, **kwargs):
        logits = self.lm_head(self.model(input_ids=input_ids, **kwargs).last_hidden_state)
        z_loss = logits.logsumexp(dim=1).pow(2).mean()
        loss = self.loss_function(logits=logits, labels=labels, vocab_size=logits.shape[-1])
        return transformers.modeling_outputs.CausalLMOutput(loss=loss + z_loss, logits=logits)


@pytest.mark.parametrize("model_class, calls", [(LlamaWithZLoss, 1), (LlamaWithZLossFirst, 2)])
def test_a_z_loss_of_the_logits_is_reproduced(model_class, calls, gen, device, cce_calls):
    """After the cross-entropy, the z-loss reads the LSE that its call returned; before it, it
    takes one call more."""
    torch.manual_seed(0)
    reference = model_class(transformers.LlamaConfig(**TINY)).to(device)

    step = patched_training_step(reference, gen, device)

    assert step.output.logits is None and not step.head_calls and len(cce_calls) == calls
    assert relative_error(step.output.loss, step.expected.loss) <= TOLERANCE
    assert_same_training_step(step.model, reference)


def tiny_llama_with_token_classification_loss() -> torch.nn.Module:
    from transformers.loss.loss_utils import LOSS_MAPPING

    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY))
    model._loss_function = LOSS_MAPPING["ForTokenClassification"]
    return model


class BiasedLinear(torch.nn.Linear):
    def forward(self, input):
        return super().forward(input) + 1


def tiny_llama_classifier() -> torch.nn.Module:
    return transformers.LlamaForSequenceClassification(transformers.LlamaConfig(**TINY))


def tiny_llama_without_lm_head() -> torch.nn.Module:
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY))
    del model.lm_head
    return model


def tiny_llama_with_another_head() -> torch.nn.Module:
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY))
    model.lm_head = BiasedLinear(32, VOCAB)
    return model


def wrapped_llama() -> torch.nn.Module:
    return torch.nn.Sequential(transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY)))


@pytest.mark.parametrize("make_model, message", [
    (tiny_llama_classifier, "LlamaForSequenceClassification is not supported: it has no output "
                            "embeddings"),
    (tiny_llama_without_lm_head, "LlamaForCausalLM is not supported: it has no output "
                                 "embeddings"),
    (tiny_llama_with_another_head, "its output embeddings are a BiasedLinear, not an nn.Linear"),
    (lambda: LlamaWithCenteredLogits(transformers.LlamaConfig(**TINY)),
     r"LlamaWithCenteredLogits is not supported: LlamaWithCenteredLogits.forward does more "
     r"with the logits than cce reproduces: `logits = logits - logits.mean\(-1, keepdim=True\)`"),
    (lambda: LlamaWithItsOwnLoss(transformers.LlamaConfig(**TINY)),
     r"LlamaWithItsOwnLoss.forward computes no cross-entropy of its logits"),
    (wrapped_llama, "Sequential is not supported: cce patches transformers models"),
    (lambda: LlamaWithLogitModule(transformers.LlamaConfig(**TINY), LogitCentering()),
     r"LlamaWithLogitModule.forward does more with the logits than cce reproduces: "
     r"`logits = self.logit_module\(logits\)`"),
    (lambda: LlamaCenteringInTraining(transformers.LlamaConfig(**TINY)),
     r"`logits = logits - logits.mean\(-1, keepdim=True\)`"),
    (lambda: LlamaWithPositionLSE(transformers.LlamaConfig(**TINY)),
     r"does more with the logits than cce reproduces: "
     r"`z_loss = logits.logsumexp\(dim=1\).pow\(2\).mean\(\)`"),
    (tiny_llama_with_token_classification_loss,
     "its loss function is ForTokenClassification, not transformers' ForCausalLMLoss or "
     "ForMaskedLMLoss"),
], ids=["a classifier", "no lm_head", "not a linear head", "more than scale and softcap",
        "its own loss", "not a transformers model", "a module that does more",
        "a branch on the mode", "a log-sum-exp over positions", "another loss function"])
def test_unsupported_models_raise_a_value_error_naming_the_class_and_why(
        make_model: Callable[[], torch.nn.Module], message):
    model = make_model()

    with pytest.raises(ValueError, match=message):
        patch(model)
    assert "forward" not in vars(model)


@pytest.mark.parametrize("family, entry, value", [
    ("cohere", "logit_scale", 2.0), ("granite", "logits_scaling", 0.5)])
def test_the_logit_scale_is_applied(family, entry, value, gen, device):
    reference, model = reference_and_patched(family, device, impl="torch")
    inputs = make_batch(gen, device)
    rescaled = copy.deepcopy(model)
    setattr(rescaled.config, entry, value)
    if family == "cohere":
        rescaled.logit_scale = value

    loss, rescaled_loss = model(**inputs).loss, rescaled(**inputs).loss

    assert relative_error(loss, reference(**inputs).loss) <= TOLERANCE
    assert relative_error(rescaled_loss, loss) > 10 * TOLERANCE


def test_the_router_loss_is_added_as_the_model_adds_it(gen, device):
    reference, model = reference_and_patched("mixtral", device, impl="torch")
    inputs = make_batch(gen, device)

    output, expected = model(**inputs), reference(**inputs)
    without_router_loss = model(**inputs, output_router_logits=False)

    assert relative_error(output.aux_loss, expected.aux_loss) <= TOLERANCE
    assert relative_error(output.loss, expected.loss) <= TOLERANCE
    assert without_router_loss.aux_loss is None
    assert relative_error(output.loss - without_router_loss.loss,
                          0.1 * output.aux_loss) <= TOLERANCE


def test_a_vision_language_model_gets_its_pixels(gen, device):
    # LLaVA's text head, the base model (`model.model`) taking pixel_values: 4 image tokens
    # (5) per row for the 4 patches of a 28 x 28 image.
    config = transformers.LlavaConfig(
        text_config=dict(model_type="llama", **TINY),
        vision_config=dict(model_type="clip_vision_model", hidden_size=32,
                           intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                           image_size=28, patch_size=14, projection_dim=32),
        image_token_index=5, vision_feature_layer=-1)
    torch.manual_seed(0)
    reference = transformers.LlavaForConditionalGeneration(config).to(device)
    model = patch(copy.deepcopy(reference), impl="torch")
    inputs = make_batch(gen, device)
    inputs["input_ids"][:, 1:5] = 5
    inputs["labels"][:, 1:5] = -100
    pixel_values = torch.randn(BATCH, 3, 28, 28, generator=gen).to(device)

    output = model(**inputs, pixel_values=pixel_values)
    expected = reference(**inputs, pixel_values=pixel_values)
    output.loss.backward()
    expected.loss.backward()
    text_only = model(**{**inputs, "input_ids": inputs["input_ids"].clamp(min=6)}).loss

    assert output.logits is None
    assert relative_error(output.loss, expected.loss) <= TOLERANCE
    vision = "model.vision_tower.embeddings.patch_embedding.weight"
    assert relative_error(model.get_parameter(vision).grad,
                          reference.get_parameter(vision).grad) <= 1e-4
    assert relative_error(text_only, output.loss) > 10 * TOLERANCE


# Models whose inputs the coverage table's text-only batch lacks (docs/models.md): each builder
# gives a tiny model (28 x 28 images) and a batch with labels.
VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
              image_size=28, patch_size=14)
OPT = dict(model_type="opt", vocab_size=VOCAB, hidden_size=32, ffn_dim=64, num_hidden_layers=2,
           num_attention_heads=4, word_embed_proj_dim=32, max_position_embeddings=64,
           pad_token_id=1)


def query_transformer_vlm(family: str, gen: torch.Generator) -> tuple:
    """BLIP-2, InstructBLIP or InstructBLIP-Video (2 frames) with a decoder-only language model
    (OPT): patch reads the branch the config takes; the language model's whole output is a
    field of the model's."""
    frames = 2 if family == "InstructBlipVideo" else 1
    token = "video_token_index" if family == "InstructBlipVideo" else "image_token_index"
    config = getattr(transformers, f"{family}Config")(
        vision_config=VISION, text_config=OPT, num_query_tokens=4, **{token: 5},
        qformer_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                            num_attention_heads=4, encoder_hidden_size=32, vocab_size=VOCAB))
    inputs = make_batch(gen, "cpu")
    inputs["input_ids"][:, :4 * frames] = 5  # the query tokens' places
    inputs["labels"][:, :4 * frames] = -100
    images = torch.randn(BATCH, frames, 3, 28, 28, generator=gen)
    inputs["pixel_values"] = images if family == "InstructBlipVideo" else images[:, 0]
    if family != "Blip2":
        inputs["qformer_input_ids"] = torch.randint(6, VOCAB, (BATCH, 6), generator=gen)
    return getattr(transformers, f"{family}ForConditionalGeneration")(config), inputs


def kosmos2(gen: torch.Generator) -> tuple:
    """Kosmos-2: its text model takes the cross-entropy, given the labels."""
    config = transformers.Kosmos2Config(
        text_config=dict(vocab_size=VOCAB, embed_dim=32, layers=2, attention_heads=4,
                         ffn_dim=64, max_position_embeddings=64, pad_token_id=1),
        vision_config=VISION, latent_query_num=4)
    inputs = make_batch(gen, "cpu")
    inputs["image_embeds_position_mask"] = torch.zeros_like(inputs["input_ids"])
    inputs["image_embeds_position_mask"][:, 1:5] = 1
    inputs["labels"][:, :5] = -100
    inputs["pixel_values"] = torch.randn(BATCH, 3, 28, 28, generator=gen)
    return transformers.Kosmos2ForConditionalGeneration(config), inputs


def pix2struct(gen: torch.Generator) -> tuple:
    """Pix2Struct: its decoder takes the cross-entropy; 9 patches of 4 x 4 pixels with their
    row and column."""
    config = transformers.Pix2StructConfig(
        text_config=dict(vocab_size=VOCAB, hidden_size=32, d_kv=8, d_ff=64, num_layers=2,
                         num_heads=4, pad_token_id=0, decoder_start_token_id=0),
        vision_config=dict(hidden_size=32, patch_embed_hidden_size=48, d_ff=64, d_kv=8,
                           num_hidden_layers=2, num_attention_heads=4))
    patches = torch.randn(BATCH, 9, 2 + 48, generator=gen)
    patches[:, :, 0] = torch.arange(9) // 3 + 1
    patches[:, :, 1] = torch.arange(9) % 3 + 1
    inputs = dict(flattened_patches=patches, attention_mask=torch.ones(BATCH, 9),
                  labels=make_batch(gen, "cpu")["labels"])
    return transformers.Pix2StructForConditionalGeneration(config), inputs


def vision_encoder_decoder(gen: torch.Generator) -> tuple:
    """ViT + GPT-2: the decoder returns the stand-in, the model takes its cross-entropy; its
    tuple branch is not taken."""
    encoder = transformers.ViTConfig(**VISION)
    decoder = transformers.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4,
                                      n_positions=64, bos_token_id=1, eos_token_id=2)
    config = transformers.VisionEncoderDecoderConfig.from_encoder_decoder_configs(encoder,
                                                                                 decoder)
    config.decoder_start_token_id, config.pad_token_id = 1, 0
    inputs = dict(pixel_values=torch.randn(BATCH, 3, 28, 28, generator=gen),
                  labels=make_batch(gen, "cpu")["labels"])
    return transformers.VisionEncoderDecoderModel(config), inputs


def idefics(gen: torch.Generator) -> tuple:
    """Idefics: its output embeddings are an IdeficsDecoupledLinear (with no extra tokens, a
    linear map); gated cross-attention to one image per row."""
    config = transformers.IdeficsConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, cross_layer_interval=1, initializer_range=0.2,
        alpha_initializer="ones", vision_config=dict(**VISION, embed_dim=32),
        perceiver_config=dict(use_resampler=False))
    inputs = make_batch(gen, "cpu")
    inputs["pixel_values"] = torch.randn(BATCH, 1, 3, 28, 28, generator=gen)
    inputs["image_attention_mask"] = torch.ones(BATCH, inputs["input_ids"].shape[1], 1,
                                                dtype=torch.long)
    return transformers.IdeficsForVisionText2Text(config), inputs


def git(gen: torch.Generator) -> tuple:
    """GIT: its loss slices the image's tokens off the logits (and shifts them)."""
    config = transformers.GitConfig(
        vision_config=VISION, vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
        num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=64, pad_token_id=0,
        bos_token_id=1, eos_token_id=2)
    inputs = make_batch(gen, "cpu")
    inputs["pixel_values"] = torch.randn(BATCH, 3, 28, 28, generator=gen)
    return transformers.GitForCausalLM(config), inputs


def pp_formulanet(gen: torch.Generator) -> tuple:
    """PP-FormulaNet: an image encoder (windowed and global attention, convolutions after) and
    a text decoder, given its inputs."""
    config = transformers.PPFormulaNetConfig(
        text_config=dict(vocab_size=VOCAB, d_model=32, decoder_layers=2, decoder_ffn_dim=64,
                         decoder_attention_heads=4, max_position_embeddings=64, pad_token_id=1,
                         bos_token_id=0, eos_token_id=2, decoder_start_token_id=2),
        vision_config=dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                           image_size=64, patch_size=16, output_channels=32, mlp_dim=64,
                           global_attn_indexes=[1], window_size=2, post_conv_in_channels=32,
                           post_conv_mid_channels=32, post_conv_out_channels=32,
                           decoder_hidden_size=32))
    batch = make_batch(gen, "cpu")
    inputs = dict(pixel_values=torch.randn(BATCH, 3, 64, 64, generator=gen),
                  decoder_input_ids=batch["input_ids"], labels=batch["labels"])
    return transformers.PPFormulaNetForConditionalGeneration(config), inputs


@pytest.mark.parametrize("build", [
    functools.partial(query_transformer_vlm, "Blip2"),
    functools.partial(query_transformer_vlm, "InstructBlip"),
    functools.partial(query_transformer_vlm, "InstructBlipVideo"), kosmos2, pix2struct,
    vision_encoder_decoder, idefics, git, pp_formulanet], ids=[
        "blip-2", "instructblip", "instructblipvideo", "kosmos-2", "pix2struct",
        "vision-encoder-decoder", "idefics", "git", "pp_formulanet"])
def test_models_with_pixel_inputs_are_exact(build, gen, device):
    torch.manual_seed(0)
    reference, inputs = build(gen)
    # eval(): their dropouts would draw differently in the two models.
    reference = reference.to(device).eval()
    inputs = {name: tensor.to(device) for name, tensor in inputs.items()}
    model = patch(copy.deepcopy(reference))

    output, expected = model(**inputs), reference(**inputs)
    output.loss.backward()
    expected.loss.backward()

    assert output.logits is None
    # Nor do the outputs within it (BLIP-2's language_model_outputs) hold logits.
    assert not any(isinstance(field, transformers.utils.ModelOutput) and "logits" in field
                   for field in output.values())
    assert relative_error(output.loss, expected.loss) <= TOLERANCE
    assert_same_gradients(model, reference)


def test_models_with_a_base_and_a_head_named_otherwise(gen, device):
    # GPT-2: `transformer` and `lm_head` (tied); GPT-NeoX: `gpt_neox` and `embed_out`.
    for model_class, config in (
            (transformers.GPT2LMHeadModel, transformers.GPT2Config(
                vocab_size=VOCAB, n_embd=32, n_layer=1, n_head=2, initializer_range=0.2)),
            (transformers.GPTNeoXForCausalLM, transformers.GPTNeoXConfig(
                vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                num_attention_heads=2, initializer_range=0.2))):
        torch.manual_seed(0)
        reference = model_class(config).to(device).eval()
        model = patch(copy.deepcopy(reference), impl="torch")
        inputs = make_batch(gen, device)
        output, expected = model(**inputs), reference(**inputs)
        output.loss.backward()
        expected.loss.backward()
        head = model.get_output_embeddings().weight.grad
        assert output.logits is None
        assert relative_error(output.loss, expected.loss) <= TOLERANCE
        assert relative_error(head, reference.get_output_embeddings().weight.grad) <= TOLERANCE


def test_bad_options_raise_before_patching(device):
    model = tiny_model("llama", device)

    with pytest.raises(ValueError, match="impl"):
        patch(model, impl="logits")
    assert "forward" not in vars(model)


@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_lora_adapters_get_the_unpatched_model_gradients(family: str, gen, device: str) -> None:
    """PEFT LoRA on the attention projections with lm_head frozen: patching the wrapped model
    (``patch(peft_model.get_base_model())``) gives the adapters the unpatched model's gradients,
    and lm_head (frozen) none."""
    peft = pytest.importorskip("peft")
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                             lora_dropout=0.0, init_lora_weights=False)
    reference = peft.get_peft_model(tiny_model(family, device), config)
    patched = copy.deepcopy(reference)
    patch(patched.get_base_model())
    batch = make_batch(gen, device)
    losses = []
    for model in (reference, patched):
        loss = model(**batch).loss
        loss.backward()
        losses.append(loss.detach())
    assert relative_error(losses[1], losses[0]) <= TOLERANCE
    adapters = [name for name, parameter in reference.named_parameters()
                if parameter.requires_grad]
    assert adapters and all("lora_" in name for name in adapters)
    expected = dict(reference.named_parameters())
    for name, parameter in patched.named_parameters():
        if name in adapters:
            error = relative_error(parameter.grad, expected[name].grad)
            assert error <= 1e-4, f"gradient of {name}: relative error {error:.2e}"
        else:
            assert parameter.grad is None, name
