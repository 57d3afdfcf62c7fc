"""Hugging Face transformers: train a causal LM with Cut Cross-Entropy, never building its logits.

    from transformers import AutoModelForCausalLM
    from cce.integrations.transformers import patch

    model = patch(AutoModelForCausalLM.from_pretrained("google/gemma-2-2b"))
    loss = model(input_ids=ids, labels=ids).loss   # output.logits is None

One generic mechanism serves every ``*ForCausalLM`` whose forward is "base model -> ``lm_head`` ->
optional ``final_logit_softcapping`` -> ``ForCausalLMLoss``" (Llama, Mistral, Qwen2, Qwen3, Phi-3,
Gemma 2, Gemma 3, ...): when labels are given, the patched forward calls the base model
(``model.model``) for the final hidden states and computes the loss from them and
``model.lm_head``'s weight (and bias) with :func:`cce.linear_cross_entropy`, reproducing
``ForCausalLMLoss``: next-token shift (or the caller's ``shift_labels``), ``ignore_index``, and
``num_items_in_batch`` (sum / num_items_in_batch, so that gradient accumulation equals one big
batch). Every other call (no labels, or ``logits_to_keep``) runs the model's own forward untouched.

Not for models whose logits or loss involve more than that (Cohere's ``logit_scale``, Granite's
``logits_scaling``, a mixture of experts' router loss): :func:`patch` refuses them rather than
return a different loss. With PEFT, patch the wrapped model: ``patch(peft_model.get_base_model())``.
The loss reads ``lm_head.weight`` outside ``lm_head``'s forward, except under FSDP2
(``fully_shard``) when ``lm_head`` is sharded as a module of its own: FSDP2 gathers its weight
only for its forward, so the loss then runs as that forward. FSDP1 (``FullyShardedDataParallel``,
flattened parameters) is not supported.
"""

from __future__ import annotations

import functools
import inspect
import types
from dataclasses import dataclass
from typing import Any, Callable, Literal, Optional, Union

import torch
from torch import nn
from transformers import PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

import cce

__all__ = ["patch", "unpatch"]

# Config entries that announce a change to the logits or the loss that a patched forward would
# not reproduce; the value says what the model's own forward does with it.
UNREPRODUCED_CONFIG_ENTRIES = {
    "logit_scale": "multiplies the logits by config.logit_scale",
    "logits_scaling": "divides the logits by config.logits_scaling",
    "router_aux_loss_coef": "adds a router load-balancing loss to the loss",
}

# Keyword arguments that transformers' ForCausalLMLoss reads: the loss takes them, not the base
# model.
LOSS_ARGUMENTS = ("shift_labels", "num_items_in_batch", "ignore_index")


@dataclass
class _Patch:
    """What a patched model keeps: the loss options and the forward to restore on unpatch."""

    options: dict[str, Any]
    # A forward set on the instance before patching (e.g. accelerate's device hooks), else None.
    instance_forward: Optional[Callable[..., Any]]


def patch(
    model: PreTrainedModel,
    *,
    impl: str = "cce",
    filter_eps: Union[float, Literal["auto"], None] = "auto",
    vocab_sorting: bool = True,
    filter_correction: bool = True,
    weight: Optional[torch.Tensor] = None,
    label_smoothing: float = 0.0,
) -> PreTrainedModel:
    """Make ``model`` compute its loss with :func:`cce.linear_cross_entropy`, in place.

    With labels, the forward returns the same loss (and gradients) as before without
    materializing the logits: ``output.logits`` is None. Without labels (inference, generation)
    or with ``logits_to_keep``, it is the model's own forward. Patching again replaces the options.

    Args:
        model: a ``*ForCausalLM`` with a base model ``model.model`` and an ``nn.Linear``
            ``model.lm_head``.
        impl, filter_eps, vocab_sorting, filter_correction, weight, label_smoothing: as in
            :func:`cce.linear_cross_entropy` (``weight`` on the device of ``lm_head``).
            transformers' own loss has neither of the last two. Trainer's
            ``label_smoothing_factor`` keeps the labels from the model and smooths its logits,
            so the model's own forward runs and builds them: leave it at 0 and pass
            ``label_smoothing`` here. With ``num_items_in_batch`` (gradient accumulation) the
            loss is the sum divided by that count of tokens, not by the summed ``weight`` of
            their targets.

    Returns:
        ``model`` itself.

    Raises:
        ValueError: naming the model class when it is not supported, or naming a bad option.
    """
    _check_supported(model)
    # Builds nothing that is kept: it validates the options now rather than at the first step.
    options = dict(impl=impl, filter_eps=filter_eps, vocab_sorting=vocab_sorting,
                   filter_correction=filter_correction, weight=weight,
                   label_smoothing=label_smoothing)
    cce.LinearCrossEntropy(**options)
    unpatch(model)
    model._cce_patch = _Patch(
        options=options,
        instance_forward=model.__dict__.get("forward"),
    )

    # wraps: inspect.signature(model.forward) stays the class's, which Trainer (does it accept
    # num_items_in_batch?) and generate (does it accept logits_to_keep?) read.
    @functools.wraps(type(model).forward)
    def forward(self: PreTrainedModel, *args: Any, **kwargs: Any) -> Any:
        return _forward_with_cce_loss(self, args, kwargs)

    # A method bound to the instance rather than a closure over it: copy.deepcopy(model) then
    # yields a copy whose forward runs the copy.
    model.forward = types.MethodType(forward, model)
    return model


def unpatch(model: PreTrainedModel) -> PreTrainedModel:
    """Undo :func:`patch` in place (nothing to do on an unpatched model); returns ``model``."""
    state: Optional[_Patch] = model.__dict__.pop("_cce_patch", None)
    if state is None:
        return model
    if state.instance_forward is None:
        del model.forward
    else:
        model.forward = state.instance_forward
    return model


def _check_supported(model: nn.Module) -> None:
    name = type(model).__name__
    if not isinstance(model, PreTrainedModel) or not name.endswith("ForCausalLM"):
        raise ValueError(f"{name} is not supported: cce patches transformers *ForCausalLM "
                         f"models (with PEFT, patch peft_model.get_base_model())")
    if not isinstance(getattr(model, "model", None), nn.Module):
        raise ValueError(f"{name} is not supported: it has no base model at `.model` to compute "
                         f"the final hidden states")
    if not isinstance(getattr(model, "lm_head", None), nn.Linear):
        raise ValueError(f"{name} is not supported: it has no nn.Linear `.lm_head` whose weight "
                         f"is the classifier")
    for entry, effect in UNREPRODUCED_CONFIG_ENTRIES.items():
        if getattr(model.config, entry, None) is not None:
            raise ValueError(f"{name} is not supported: its forward {effect}, which the cce loss "
                             f"does not reproduce")


def _forward_with_cce_loss(model: PreTrainedModel, args: tuple, kwargs: dict) -> Any:
    state: _Patch = model._cce_patch
    original_forward = state.instance_forward or types.MethodType(type(model).forward, model)
    arguments = _named_arguments(original_forward, args, kwargs)
    labels = arguments.pop("labels", None)
    logits_to_keep = arguments.pop("logits_to_keep", 0)
    # logits_to_keep asks for logits, which only the model's own forward computes.
    keeps_every_position = isinstance(logits_to_keep, int) and logits_to_keep == 0
    if labels is None or not keeps_every_position:
        return original_forward(*args, **kwargs)

    loss_arguments = {name: arguments.pop(name) for name in LOSS_ARGUMENTS if name in arguments}
    return_dict = arguments.pop("return_dict", None)
    outputs = model.model(**arguments, return_dict=True)
    loss = _as_lm_head_forward(
        model.lm_head, outputs.last_hidden_state,
        lambda hidden_states: _causal_lm_loss(model, hidden_states, labels, state.options,
                                              **loss_arguments))
    output = CausalLMOutputWithPast(
        loss=loss,
        logits=None,
        hidden_states=outputs.hidden_states,
        attentions=outputs.attentions,
        **{_CACHE_FIELD: getattr(outputs, _CACHE_FIELD)},
    )
    # The rule of transformers' can_return_tuple, which the model's own forward follows.
    if return_dict is None:
        return_dict = model.config.return_dict
    return output if return_dict else output.to_tuple()


# The key-value cache's field: "cache" from transformers 5.24 on, whose "past_key_values" only
# prints a deprecation notice; "past_key_values" before.
_CACHE_FIELD = ("cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__
                else "past_key_values")


def _as_lm_head_forward(lm_head: nn.Module, hidden_states: torch.Tensor,
                        loss: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """``loss(hidden_states)``, run as ``lm_head``'s forward when FSDP2 shards ``lm_head``: outside
    its forward, its weight is this rank's shard (a DTensor); the hooks of a call of ``lm_head``
    gather the weight for the loss and reduce its gradient in the backward."""
    if not _is_fsdp2_module(lm_head):
        return loss(hidden_states)
    instance_forward = lm_head.__dict__.get("forward")
    lm_head.forward = loss
    try:
        return lm_head(hidden_states)
    finally:
        if instance_forward is None:
            del lm_head.forward
        else:
            lm_head.forward = instance_forward


def _is_fsdp2_module(module: nn.Module) -> bool:
    if not torch.distributed.is_available():
        return False
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # torch < 2.6 has FSDP2 under its former name
        from torch.distributed._composable.fsdp import FSDPModule

    return isinstance(module, FSDPModule)


def _named_arguments(forward: Callable[..., Any], args: tuple, kwargs: dict) -> dict[str, Any]:
    """The call's arguments by name, ``**kwargs`` merged in: labels may come positionally."""
    signature = inspect.signature(forward)
    arguments = dict(signature.bind(*args, **kwargs).arguments)
    for name, parameter in signature.parameters.items():
        if parameter.kind is inspect.Parameter.VAR_KEYWORD:
            arguments.update(arguments.pop(name, {}))
    return arguments


def _causal_lm_loss(
    model: PreTrainedModel,
    hidden_states: torch.Tensor,
    labels: torch.Tensor,
    options: dict[str, Any],
    *,
    shift_labels: Optional[torch.Tensor] = None,
    num_items_in_batch: Union[torch.Tensor, int, None] = None,
    ignore_index: int = -100,
) -> torch.Tensor:
    """transformers' ForCausalLMLoss of ``softcap(lm_head(hidden_states))``, without the logits."""
    weight, bias = model.lm_head.weight, model.lm_head.bias
    device_type = weight.device.type
    # Under autocast, lm_head would multiply in the autocast dtype; cce needs one dtype anyway.
    if torch.is_autocast_enabled(device_type):
        dtype = torch.get_autocast_dtype(device_type)
    else:
        dtype = weight.dtype
    # With a model split over devices, the loss runs where lm_head lives, as lm_head would.
    embeddings = hidden_states.to(device=weight.device, dtype=dtype)
    if shift_labels is None:
        targets, shift = labels, 1  # position i predicts labels[i + 1]
    else:
        targets, shift = shift_labels, 0
    loss = cce.linear_cross_entropy(
        embeddings,
        weight.to(dtype),
        targets.to(weight.device),
        bias=None if bias is None else bias.to(dtype),
        ignore_index=ignore_index,
        softcap=getattr(model.config, "final_logit_softcapping", None),
        reduction="mean" if num_items_in_batch is None else "sum",
        shift=shift,
        **options,
    )
    if num_items_in_batch is None:
        return loss
    if isinstance(num_items_in_batch, torch.Tensor):
        num_items_in_batch = num_items_in_batch.to(loss.device)
    # The trainer counts the tokens of all accumulated micro-batches: the sum of the
    # micro-batch losses is then the loss of one big batch.
    return loss / num_items_in_batch
