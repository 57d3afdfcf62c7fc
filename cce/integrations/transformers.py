"""Hugging Face transformers: train a language model with Cut Cross-Entropy, never building its
logits.

    from transformers import AutoModelForCausalLM
    from cce.integrations.transformers import patch

    model = patch(AutoModelForCausalLM.from_pretrained("google/gemma-2-2b"))
    loss = model(input_ids=ids, labels=ids).loss   # output.logits is None

One generic mechanism serves every model of transformers whose forward computes its logits with
its output embeddings (``model.get_output_embeddings()``, an ``nn.Linear``), at most scales and
softcaps them, and takes their cross-entropy: the ``*ForCausalLM`` and ``*LMHeadModel`` models
(Llama; Gemma 2 with its softcap, Inkling 2 with a softcap module; Cohere and Granite with
their logit scale; GPT-2's ``transformer`` and GPT-NeoX's ``embed_out`` as well as
``model.model`` and ``lm_head``; BERT's prediction head) and the text head of
``*ForConditionalGeneration`` vision-language models (Gemma 3, Qwen2-VL, LLaVA, Mllama, BLIP-2,
...; Kosmos-2.5's text model takes the cross-entropy within), ``VisionEncoderDecoderModel``,
mixtures of experts with their router loss.
docs/models.md lists every model type tested: exact, refused (why), or not tested (why).

With labels, the patched forward runs the model's own forward, in which the output embeddings
return a stand-in for the logits rather than the logits: it keeps the final hidden states and
records what the forward multiplies or divides the logits by and its softcap (``tanh``), the
vocabulary entries it sets to the dtype's minimum first (Chameleon's image tokens: a bias of
that minimum; a target among them scores it, with no gradient at itself), and slices and
flattens them as the forward does. When the forward takes their cross-entropy
(``F.cross_entropy``, which ``self.loss_function``'s ForCausalLMLoss or ForMaskedLMLoss and
``nn.CrossEntropyLoss`` call), the stand-in computes it from the hidden states and the head's
weight (and bias) with :func:`cce.linear_cross_entropy`, with the call's ``ignore_index`` and
``reduction``: the next-token shift (or the caller's ``shift_labels``) and
``num_items_in_batch`` are then the model's own (so gradient accumulation equals one big batch
where the model's loss does). Their log-sum-exp over the vocabulary (a z-loss, as Bamba's) is
the LSE that the cross-entropy's call returned, or one call more if taken before it.
Everything else is the model's own forward too: the arguments it passes to its base model
(pixels too), a mixture of experts' router loss added to the loss (and ``aux_loss``), the
other fields of its output. Its ``logits`` are None. Without labels (inference, generation) or
with ``logits_to_keep``, the model's own forward runs untouched.

:func:`patch` first reads the source of the model's forward (and of the modules between it and
the output embeddings, and of a module the logits pass through; of a branch on the model's
configuration, the one it takes when patched, as BLIP-2's decoder-only language model's) and
refuses, with a ``ValueError`` that says why, a model whose loss the patched forward would not
reproduce: its logits put to any other use (a module that does more than scale and cap them,
...), a loss that is no cross-entropy of them or a loss function other than ForCausalLMLoss and
ForMaskedLMLoss, output embeddings that are no linear map cce reads (an ``nn.Linear``; Idefics'
decoupled head without extra tokens; Dory's head, whose learnt per-class logit scale multiplies
the weight's rows at each call). With PEFT, patch the wrapped
model: ``patch(peft_model.get_base_model())``. While a patched forward runs, the stand-in takes
the output embeddings' place in their parent module: a patched model runs one forward at a
time (as a model in training does).

The loss reads the head's weight outside the head's forward, except under FSDP2 (``fully_shard``)
when the head is sharded as a module of its own: FSDP2 gathers its weight only for its forward,
so the loss then runs as that forward. FSDP1 (``FullyShardedDataParallel``, flattened
parameters) is not supported.
"""

from __future__ import annotations

import ast
import functools
import inspect
import math
import operator
import textwrap
import types
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Literal, NamedTuple, Optional, Union

import torch
from torch import nn
from transformers import PreTrainedModel
from transformers.loss.loss_utils import ForCausalLMLoss, ForMaskedLMLoss
from transformers.utils import ModelOutput

import cce

__all__ = ["patch", "unpatch"]


@dataclass
class _Patch:
    """What a patched model keeps: the loss options, where its output embeddings sit, and the
    forward to restore on unpatch."""

    options: dict[str, Any]
    # The output embeddings' name in the model, e.g. "lm_head" or "cls.predictions.decoder".
    head_path: str
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
    memory: Literal["low", "fast"] = "low",
) -> PreTrainedModel:
    """Make ``model`` compute its loss with :func:`cce.linear_cross_entropy`, in place.

    With labels, the forward returns the same loss (and gradients) as before without
    materializing the logits: ``output.logits`` is None. Without labels (inference, generation)
    or with ``logits_to_keep``, it is the model's own forward. Patching again replaces the options.

    Args:
        model: a transformers model whose forward computes its logits with its output
            embeddings (an ``nn.Linear``, or a head read as one: module docstring), at most
            scales and softcaps them, and takes their cross-entropy (``self.loss_function``'s
            ForCausalLMLoss or ForMaskedLMLoss, or ``F.cross_entropy``): ``*ForCausalLM``,
            ``*LMHeadModel``, ``*ForConditionalGeneration`` (docs/models.md lists those
            tested).
        impl, filter_eps, vocab_sorting, filter_correction, weight, label_smoothing, memory: as
            in :func:`cce.linear_cross_entropy` (``weight`` on the device of the output
            embeddings; ``memory="fast"`` spends memory for speed, e.g. on Phi 3's 32k vocabulary).
            transformers' own loss has neither of the last two. Trainer's
            ``label_smoothing_factor`` keeps the labels from the model and smooths its logits,
            so the model's own forward runs and builds them: leave it at 0 and pass
            ``label_smoothing`` here. With ``num_items_in_batch`` (gradient accumulation) the
            loss is the sum divided by that count of tokens, not by the summed ``weight`` of
            their targets.

    Returns:
        ``model`` itself.

    Raises:
        ValueError: naming the model class and why, when the patched loss would not be the
            model's own; or naming a bad option.
    """
    head_path = _check_supported(model)
    # Builds nothing that is kept: it validates the options now rather than at the first step.
    options = dict(impl=impl, filter_eps=filter_eps, vocab_sorting=vocab_sorting,
                   filter_correction=filter_correction, weight=weight,
                   label_smoothing=label_smoothing, memory=memory)
    cce.LinearCrossEntropy(**options)
    unpatch(model)
    model._cce_patch = _Patch(
        options=options,
        head_path=head_path,
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


# --- What patch reads: is the model's loss one that the patched forward reproduces? -------------

class _Unsupported(Exception):
    """Why a model is not supported (the message of patch's ValueError, after the class)."""


def _check_supported(model: nn.Module) -> str:
    """The name of ``model``'s output embeddings in it, or a ValueError naming its class and why
    the patched forward would not reproduce its loss."""
    name = type(model).__name__
    try:
        return _supported_head_path(model)
    except _Unsupported as reason:
        raise ValueError(f"{name} is not supported: {reason}") from None


def _supported_head_path(model: nn.Module) -> str:
    if not isinstance(model, PreTrainedModel):
        raise _Unsupported("cce patches transformers models (PreTrainedModel); with PEFT, patch "
                           "peft_model.get_base_model()")
    head = model.get_output_embeddings()
    if head is None:
        raise _Unsupported("it has no output embeddings (get_output_embeddings() is None): it "
                           "is not a language model")
    if _classifier_of(head) is None:
        raise _Unsupported(f"its output embeddings are a {type(head).__name__}, not an "
                           f"nn.Linear whose weight is the classifier")
    _ForwardReading(model, head, outermost=True).check()
    return next(path for path, module in model.named_modules(remove_duplicate=False)
                if module is head)


_Classifier = Callable[[nn.Module], "tuple[torch.Tensor, Optional[torch.Tensor]]"]


def _classifier_of(head: nn.Module) -> Optional[_Classifier]:
    """How to read the weight (V, D) and bias (V,) whose linear map is ``head``'s forward, or
    None for a head that is no linear map cce knows: an ``nn.Linear``'s own, or one of
    :data:`_LINEAR_HEADS`."""
    if isinstance(head, nn.Linear) and type(head).forward is nn.Linear.forward:
        return _linear_classifier
    # By the first class of its own or a base's (FSDP2 makes a subclass of a module it shards).
    known = next((_LINEAR_HEADS[cls.__name__] for cls in type(head).__mro__
                  if cls.__name__ in _LINEAR_HEADS), None)
    return known[1] if known is not None and known[0](head) else None


def _linear_classifier(head: nn.Module) -> "tuple[torch.Tensor, Optional[torch.Tensor]]":
    return head.weight, head.bias


def _class_scaled_classifier(head: nn.Module) -> "tuple[torch.Tensor, Optional[torch.Tensor]]":
    """Dory's head: each class's logit times a learnt scale (in float32), as the rows of the
    weight times it."""
    scale = head.logit_scale.float() * head.logit_scale_factor
    return (head.weight.float() * scale[:, None]).to(head.weight.dtype), None


# Output embeddings whose forward is a linear map of another form, by class name: a check of
# their structure, and how to read their weight and bias (Dory's: made at each loss call, a
# tensor the size of the weight, through which the gradients reach the head's parameters).
_LINEAR_HEADS: dict[str, tuple[Callable[[nn.Module], bool], _Classifier]] = {
    # Idefics' head without extra tokens (with them, the model's own loss fails: its logits
    # are wider than the vocabulary it views them with).
    "IdeficsDecoupledLinear": (
        lambda head: isinstance(head, nn.Linear)
        and getattr(head, "out_additional_features", None) == 0,
        _linear_classifier),
    "DoryLMHead": (
        lambda head: isinstance(head, nn.Linear) and head.bias is None and isinstance(
            getattr(head, "logit_scale", None), torch.Tensor) and isinstance(
            getattr(head, "logit_scale_factor", None), (int, float)),
        _class_scaled_classifier),
}


def _loss_function(model: nn.Module) -> Callable[..., Any]:
    """``model.loss_function``, without its warning for a class name that names no loss (its
    default, ForCausalLMLoss, then)."""
    if not isinstance(model, PreTrainedModel):
        return None
    if "_loss_function" in model.__dict__:
        return model._loss_function
    from transformers.loss.loss_utils import LOSS_MAPPING

    return LOSS_MAPPING.get(getattr(model, "loss_type", None), ForCausalLMLoss)


# What a patched forward reproduces of the logits: multiplied or divided by a number (a logit
# scale; a softcap's division and multiplication), tanh (a softcap), vocabulary entries set to
# the dtype's minimum (a mask), casts, slices of leading dimensions and views that flatten them,
# their shape, their log-sum-exp over the vocabulary (a z-loss), and the cross-entropy of the
# flattened logits (as transformers' loss functions compute it, or F.cross_entropy, or
# nn.CrossEntropyLoss).
_SCALE_OPERATORS = (ast.Mult, ast.Div)
_UNKNOWN = object()  # a test that patch cannot read from the module's attributes
# transformers' loss functions that flatten the logits and take their cross-entropy
# (F.cross_entropy), the labels shifted to the next token or not.
_CROSS_ENTROPY_LOSSES = (ForCausalLMLoss, ForMaskedLMLoss)
_METHODS = ("float", "to", "contiguous", "tanh", "view", "reshape")
_METADATA = ("shape", "size", "dim", "ndim", "dtype", "device")


def _is_vocabulary_mask(node: ast.expr, parent: Optional[ast.AST],
                        grandparent: Optional[ast.AST]) -> bool:
    """Whether ``node`` (the logits) is assigned ``logits[..., tokens] =
    torch.finfo(...).min``: entries masked out of the softmax (Chameleon's image tokens)."""
    return (isinstance(parent, ast.Subscript) and parent.value is node
            and isinstance(parent.ctx, ast.Store) and isinstance(grandparent, ast.Assign)
            and grandparent.targets == [parent]
            and isinstance(grandparent.value, ast.Attribute) and grandparent.value.attr == "min"
            and isinstance(grandparent.value.value, ast.Call)
            and ast.unparse(grandparent.value.value.func).split(".")[-1] == "finfo")


def _is_vocabulary_logsumexp(node: ast.expr, parent: Optional[ast.AST],
                             grandparent: Optional[ast.AST]) -> bool:
    """Whether ``node`` (the logits) is taken ``logits.logsumexp(dim=-1)`` or
    ``torch.logsumexp(logits, -1)``: over the vocabulary, without keepdim."""
    if (isinstance(parent, ast.Attribute) and parent.attr == "logsumexp"
            and isinstance(grandparent, ast.Call) and grandparent.func is parent):
        dims = grandparent.args + [keyword.value for keyword in grandparent.keywords
                                   if keyword.arg == "dim"]
        others = [keyword for keyword in grandparent.keywords if keyword.arg != "dim"]
    elif (isinstance(parent, ast.Call) and parent.args[:1] == [node]
          and ast.unparse(parent.func).split(".")[-1] == "logsumexp"):
        dims = parent.args[1:] + [keyword.value for keyword in parent.keywords
                                  if keyword.arg == "dim"]
        others = [keyword for keyword in parent.keywords if keyword.arg != "dim"]
    else:
        return False
    return len(dims) == 1 and ast.unparse(dims[0]) == "-1" and not others


class _Reading(NamedTuple):
    """What a forward does with the head's output: ``returns`` it as "logits" (the logits
    themselves) or "output" (an output whose ``logits`` they are); whether it, or a module
    within, ``takes_cross_entropy`` of them."""

    returns: str
    takes_cross_entropy: bool


class _ForwardReading:
    """Reads the source of ``module``'s forward: the call of ``head`` (or of a submodule whose
    forward returns what ``head`` returns, as BERT's prediction head, or an output whose
    ``logits`` it is, as Llama 4's language model) and every use of its result: a scale, a
    softcap, slices and views, and then the cross-entropy, the output's ``logits=``, or (within)
    the return value."""

    def __init__(self, module: nn.Module, head: nn.Module, *, outermost: bool) -> None:
        self.module, self.head, self.outermost = module, head, outermost
        self.owner = type(module).__name__
        forward = inspect.unwrap(type(module).forward)
        try:
            self.source = textwrap.dedent(inspect.getsource(forward))
        except (OSError, TypeError):
            raise _Unsupported(f"the source of {self.owner}.forward, which computes the logits, "
                               f"cannot be read") from None
        self.function = ast.parse(self.source).body[0]
        if not isinstance(self.function, (ast.FunctionDef, ast.AsyncFunctionDef)):
            raise _Unsupported(f"{self.owner}.forward is not a function whose source can be read")
        self.self_name = self.function.args.args[0].arg if self.function.args.args else "self"
        self.parents = {child: node for node in ast.walk(self.function)
                        for child in ast.iter_child_nodes(node)}
        self.dead = self._dead_branches()
        # Names bound to nn.CrossEntropyLoss(...): loss_fct = CrossEntropyLoss()
        self.cross_entropy_losses = {
            node.targets[0].id for node in ast.walk(self.function)
            if isinstance(node, ast.Assign) and len(node.targets) == 1
            and isinstance(node.targets[0], ast.Name) and isinstance(node.value, ast.Call)
            and ast.unparse(node.value.func).split(".")[-1] == "CrossEntropyLoss"}

    def read(self) -> Optional[_Reading]:
        """What the forward does with the head's output (:class:`_Reading`), or None when it
        does not call the head; raises _Unsupported when it uses them otherwise."""
        calls = self._head_calls()
        if not calls:
            return None
        if len(calls) > 1:
            raise _Unsupported(f"{self.owner}.forward calls its output embeddings in "
                               f"{len(calls)} places")
        call, within = calls[0]
        ends = self._ends(call, within.returns)
        # Where a module within computes the cross-entropy (Kosmos-2's text model, given the
        # labels), the forward may take its loss.
        takes_cross_entropy = (bool(ends & {"loss_function", "cross_entropy"})
                               or within.takes_cross_entropy)
        if self.outermost and not takes_cross_entropy:
            raise _Unsupported(f"{self.owner}.forward computes no cross-entropy of its logits")
        if "loss_function" in ends and _loss_function(self.module) not in _CROSS_ENTROPY_LOSSES:
            name = getattr(_loss_function(self.module), "__name__", "another")
            raise _Unsupported(f"its loss function is {name}, not transformers' "
                               f"ForCausalLMLoss or ForMaskedLMLoss")
        if "return" in ends:
            return _Reading("logits", takes_cross_entropy)
        if "output" in ends:
            return _Reading("output", takes_cross_entropy)
        raise _Unsupported(f"{self.owner}.forward, within, does not return its logits")

    def check(self) -> None:
        """Raise _Unsupported unless the forward calls the head once and uses its result only
        as the patched forward reproduces it."""
        if self.read() is None:
            raise _Unsupported(f"{self.owner}.forward does not call its output embeddings")

    def _dead_branches(self) -> set[ast.AST]:
        """The nodes of the branches that the module's configuration rules out (BLIP-2's ``if
        self.config.use_decoder_only_language_model:``), read as the configuration is when the
        model is patched."""
        dead: set[ast.AST] = set()
        for node in ast.walk(self.function):
            if isinstance(node, ast.If) and node not in dead:
                value = self._configured(node.test)
                if value is not _UNKNOWN:
                    for statement in node.orelse if value else node.body:
                        dead.update(ast.walk(statement))
        return dead

    def _configured(self, node: ast.expr) -> Any:
        """The truth of a test of the module's attributes and constants (``self.a.b``, ``not``,
        ``is``, ``is not``, ``==``, ``!=``), else _UNKNOWN."""
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
            value = self._configured(node.operand)
            return _UNKNOWN if value is _UNKNOWN else not value
        if isinstance(node, ast.Compare) and len(node.ops) == 1:
            left, right = self._value(node.left), self._value(node.comparators[0])
            if left is _UNKNOWN or right is _UNKNOWN:
                return _UNKNOWN
            compare = {ast.Is: operator.is_, ast.IsNot: operator.is_not, ast.Eq: operator.eq,
                       ast.NotEq: operator.ne}.get(type(node.ops[0]))
            return _UNKNOWN if compare is None else bool(compare(left, right))
        value = self._value(node)
        return value if value is _UNKNOWN else bool(value)

    def _value(self, node: ast.expr) -> Any:
        """The value of a constant or of ``self.a.b`` when it is a plain constant (a bool, a
        number, a string or None), else _UNKNOWN; not ``self.training``, which ``train()`` and
        ``eval()`` change."""
        if isinstance(node, ast.Constant):
            return node.value
        names = []
        while isinstance(node, ast.Attribute):
            names.append(node.attr)
            node = node.value
        if not (isinstance(node, ast.Name) and node.id == self.self_name and names
                and "training" not in names):
            return _UNKNOWN
        value: Any = self.module
        for name in reversed(names):
            value = getattr(value, name, _UNKNOWN)
            if value is _UNKNOWN:
                return _UNKNOWN
        return value if value is None or isinstance(value, (bool, int, float, str)) else _UNKNOWN

    def _head_calls(self) -> list[tuple[ast.Call, _Reading]]:
        """The calls of the head, or of a submodule that returns its logits, with what the
        callee does with them, outside the branches the configuration rules out."""
        calls = []
        for node in ast.walk(self.function):
            if not isinstance(node, ast.Call) or node in self.dead:
                continue
            callee = self._submodule(node.func)
            if callee is self.head:
                calls.append((node, _Reading("logits", takes_cross_entropy=False)))
            elif callee is not None and any(module is self.head for module in callee.modules()):
                within = _ForwardReading(callee, self.head, outermost=False).read()
                if within is not None:
                    calls.append((node, within))
        return calls

    def _submodule(self, node: ast.expr) -> Optional[nn.Module]:
        """The submodule that ``self.a.b`` names, else None."""
        names = []
        while isinstance(node, ast.Attribute):
            names.append(node.attr)
            node = node.value
        if not (isinstance(node, ast.Name) and node.id == self.self_name and names):
            return None
        module: Any = self.module
        for name in reversed(names):
            module = module._modules.get(name) if isinstance(module, nn.Module) else None
        return module if isinstance(module, nn.Module) else None

    def _ends(self, call: ast.Call, returns: str) -> set[str]:
        """Follow the head's output through the names it is assigned to, up to its ends."""
        return self._follow([call] if returns == "logits" else self._logits_of_output(call),
                            call)

    def passes_input_through(self) -> bool:
        """Whether the forward takes one input and returns it through what the stand-in
        reproduces, using it nowhere else (a softcap module: ``tanh(x / cap) * cap``)."""
        arguments = self.function.args
        if (len(arguments.args) != 2 or arguments.vararg or arguments.kwarg
                or arguments.kwonlyargs or arguments.posonlyargs):
            return False
        parameter = arguments.args[1]
        loads = [node for node in ast.walk(self.function) if isinstance(node, ast.Name)
                 and node.id == parameter.arg and isinstance(node.ctx, ast.Load)]
        try:
            ends = self._follow(loads, parameter, names=frozenset({parameter.arg}))
        except _Unsupported:
            return False
        return "return" in ends and ends <= {"return", "metadata"}

    def _passes_through(self, func: ast.expr) -> bool:
        """Whether ``func`` names a submodule (not the head) whose forward passes the logits
        through (:meth:`passes_input_through`)."""
        module = self._submodule(func)
        if module is None or any(part is self.head for part in module.modules()):
            return False
        try:
            reading = _ForwardReading(module, self.head, outermost=False)
        except _Unsupported:
            return False
        return reading.passes_input_through()

    def _follow(self, pending: list[ast.expr], after: ast.AST,
                names: frozenset[str] = frozenset()) -> set[str]:
        """Follow the logits from the expressions ``pending`` through the names they are
        assigned to (their uses after ``after``), up to their ends; ``names`` hold them
        already (a parameter)."""
        ends: set[str] = set()
        names = set(names)
        while pending:
            name, end = self._climb(pending.pop())
            ends.add(end)
            if name is not None and name not in names:
                names.add(name)
                pending.extend(self._loads_after(name, after))
        for node in ast.walk(self.function):
            # logits *= scale
            if (isinstance(node, ast.AugAssign) and isinstance(node.target, ast.Name)
                    and node.target.id in names and not isinstance(node.op, _SCALE_OPERATORS)):
                self._refuse(node)
        return ends

    def _logits_of_output(self, call: ast.Call) -> list[ast.expr]:
        """``outputs.logits`` and ``outputs[0]`` of ``outputs = self.language_model(...)``;
        other fields of the output are not the logits, and the output may be a field of the
        forward's own (``language_model_outputs=outputs``, BLIP-2), whose logits the patched
        forward leaves out too."""
        name = self._assigned_name(call)
        if name is None:
            self._refuse(call)
        logits = []
        for node in self._loads_after(name, call):
            use = self.parents.get(node)
            if isinstance(use, ast.Attribute) and use.attr == "logits" or (
                    isinstance(use, ast.Subscript) and ast.unparse(use.slice) == "0"):
                logits.append(use)
            elif not isinstance(use, (ast.Attribute, ast.Subscript)) and not (
                    (isinstance(use, ast.keyword)
                     and "Output" in ast.unparse(self.parents[use].func))
                    or self._in_tuple_branch(node)):
                self._refuse(node)
        return logits

    def _assigned_name(self, node: ast.expr) -> Optional[str]:
        """The name in ``name = node`` or ``name: Type = node``, else None."""
        parent = self.parents.get(node)
        if isinstance(parent, ast.Assign) and len(parent.targets) == 1:
            target = parent.targets[0]
        elif isinstance(parent, ast.AnnAssign) and parent.value is node:
            target = parent.target
        else:
            return None
        return target.id if isinstance(target, ast.Name) else None

    def _loads_after(self, name: str, node: ast.AST) -> Iterator[ast.Name]:
        after = (node.end_lineno, node.end_col_offset)
        for node in ast.walk(self.function):
            if (isinstance(node, ast.Name) and node.id == name
                    and isinstance(node.ctx, ast.Load) and node not in self.dead
                    and (node.lineno, node.col_offset) >= after):
                yield node

    def _climb(self, node: ast.expr) -> tuple[Optional[str], str]:
        """From an expression that holds the logits, through what the stand-in reproduces, to
        where they go: (the name they are assigned to, "name"), or (None, the end); raises
        _Unsupported for anything else."""
        while True:
            parent = self.parents.get(node)
            grandparent = self.parents.get(parent)
            if _is_vocabulary_mask(node, parent, grandparent):
                return None, "mask"  # logits[:, :, tokens] = torch.finfo(logits.dtype).min
            if isinstance(parent, ast.BinOp) and isinstance(parent.op, _SCALE_OPERATORS) and (
                    parent.left is node or isinstance(parent.op, ast.Mult)):
                node = parent  # logits * scale, scale * logits, logits / scale
            elif (isinstance(parent, ast.Call) and parent.args == [node] and not parent.keywords
                  and ast.unparse(parent.func).split(".")[-1] == "tanh"):
                node = parent  # torch.tanh(logits)
            elif (isinstance(parent, ast.Call) and parent.args == [node] and not parent.keywords
                  and self._passes_through(parent.func)):
                node = parent  # self.logit_softcap(logits), a module that only caps them
            elif isinstance(parent, ast.Subscript) and parent.value is node:
                node = parent  # logits[:, start:-1, :], checked to keep the last dimension
            elif isinstance(parent, ast.IfExp) and ast.unparse(parent.test) == "return_dict":
                if parent.body is not node:  # the tuple's side: a patched forward returns a dict
                    return None, "tuple"
                node = parent  # outputs.logits if return_dict else outputs[0]
            elif (isinstance(parent, ast.Attribute) and parent.attr in _METHODS
                  and isinstance(grandparent, ast.Call) and grandparent.func is parent):
                node = grandparent  # logits.float(), logits.view(-1, vocab_size)
            elif isinstance(parent, ast.Attribute) and parent.attr in _METADATA:
                return None, "metadata"  # labels.to(logits.device)
            elif _is_vocabulary_logsumexp(node, parent, grandparent):
                return None, "logsumexp"  # a z-loss: logits.logsumexp(dim=-1), a tensor
            else:
                break
        name = self._assigned_name(node)
        if name is not None:
            return name, "name"
        if not self.outermost and isinstance(parent, ast.Return):
            return None, "return"
        end = self._end(node, parent)
        if end is None:
            self._refuse(node)
        return None, end

    def _end(self, node: ast.expr, parent: Optional[ast.AST]) -> Optional[str]:
        call = self.parents.get(parent) if isinstance(parent, ast.keyword) else parent
        if not isinstance(call, ast.Call):
            return self._in_tuple_branch(node)
        first = call.args[0] is node if call.args else False
        keyword = isinstance(parent, ast.keyword)
        callee = ast.unparse(call.func)
        if callee == f"{self.self_name}.loss_function" and (
                first or keyword and parent.arg == "logits"):
            return "loss_function"  # self.loss_function(logits, labels, ...)
        if first and (callee in self.cross_entropy_losses
                      or callee.split(".")[-1] == "cross_entropy"):
            return "cross_entropy"  # loss_fct(logits.view(-1, vocab_size), labels.view(-1))
        if keyword and parent.arg == "logits" and "Output" in callee:
            return "output"  # SomeOutput(..., logits=logits, ...)
        return self._in_tuple_branch(node)

    def _in_tuple_branch(self, node: ast.AST) -> Optional[str]:
        """"tuple" within ``if not return_dict:``, which a patched forward does not take."""
        while node in self.parents:
            parent = self.parents[node]
            if (isinstance(parent, ast.If) and node in parent.body
                    and ast.unparse(parent.test) in ("not return_dict", "return_dict is False")):
                return "tuple"
            node = parent
        return None

    def _refuse(self, node: ast.AST) -> None:
        while not isinstance(node, ast.stmt) and node in self.parents:
            node = self.parents[node]
        line = " ".join((ast.get_source_segment(self.source, node) or "").split())
        if len(line) > 100:
            line = line[:97] + "..."
        where = "" if self.outermost else ", within,"
        raise _Unsupported(f"{self.owner}.forward{where} does more with the logits than "
                           f"cce reproduces: `{line}`")


# --- The patched forward: the model's own, with a stand-in for the logits ----------------------

def _forward_with_cce_loss(model: PreTrainedModel, args: tuple, kwargs: dict) -> Any:
    state: _Patch = model._cce_patch
    original_forward = state.instance_forward or types.MethodType(type(model).forward, model)
    arguments = _named_arguments(original_forward, args, kwargs)
    labels = arguments.get("labels")
    logits_to_keep = arguments.get("logits_to_keep", 0)
    # logits_to_keep asks for logits, which only the model's own forward computes.
    keeps_every_position = isinstance(logits_to_keep, int) and logits_to_keep == 0
    if labels is None or not keeps_every_position:
        return original_forward(*args, **kwargs)

    return_dict = arguments.get("return_dict")
    args, kwargs = _with_return_dict(original_forward, args, kwargs)
    parent_path, _, name = state.head_path.rpartition(".")
    parent = model.get_submodule(parent_path)
    head = parent._modules[name]
    parent._modules[name] = _HeadStandIn(head, state.options)
    try:
        output = original_forward(*args, **kwargs)
    finally:
        parent._modules[name] = head
    if isinstance(output, tuple) or not isinstance(output.get("logits"), _DeferredLogits):
        raise RuntimeError(f"cce: {type(model).__name__}.forward did not return the stand-in "
                           f"of its logits; unpatch(model) to train it")
    # The output without its logits, which were never computed (nor those of an output within).
    output = _without_logits(output)
    # The rule of transformers' can_return_tuple, which the model's own forward follows.
    if return_dict is None:
        return_dict = model.config.return_dict
    return output if return_dict else output.to_tuple()


def _without_logits(output: Any) -> Any:
    """``output`` (a ModelOutput) without its stand-in logits, and so the outputs within it;
    ``output`` itself where it holds none."""
    fields = {key: _without_logits(value) if isinstance(value, ModelOutput) else value
              for key, value in output.items() if not isinstance(value, _DeferredLogits)}
    if fields.keys() == output.keys() and all(fields[key] is output[key] for key in fields):
        return output
    return type(output)(**fields)


def _with_return_dict(forward: Callable[..., Any], args: tuple,
                      kwargs: dict) -> tuple[tuple, dict]:
    """The call's arguments with return_dict=True: an output whose logits can be left out."""
    signature = inspect.signature(forward)
    if "return_dict" in signature.parameters:
        bound = signature.bind(*args, **kwargs)
        bound.arguments["return_dict"] = True
        return bound.args, bound.kwargs
    return args, {**kwargs, "return_dict": True}


def _named_arguments(forward: Callable[..., Any], args: tuple, kwargs: dict) -> dict[str, Any]:
    """The call's arguments by name, ``**kwargs`` merged in: labels may come positionally."""
    signature = inspect.signature(forward)
    arguments = dict(signature.bind(*args, **kwargs).arguments)
    for name, parameter in signature.parameters.items():
        if parameter.kind is inspect.Parameter.VAR_KEYWORD:
            arguments.update(arguments.pop(name, {}))
    return arguments


class _HeadStandIn(nn.Module):
    """Takes the place of the output embeddings during a patched forward: returns the stand-in
    of the logits rather than computing them. Other attributes are the head's."""

    def __init__(self, head: nn.Linear, options: dict[str, Any]) -> None:
        super().__init__()
        # Not submodules or parameters of the stand-in, which owns none of them.
        self.__dict__.update(_head=head, _options=options)

    def forward(self, hidden_states: torch.Tensor) -> _DeferredLogits:
        return _DeferredLogits(hidden_states, self._head, self._options)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["_head"], name)


@dataclass
class _TakenLSE:
    """The LSE of every row of a cross-entropy that a stand-in took: of which hidden states
    (N, D), after which operations."""

    hidden_states: torch.Tensor
    operations: tuple
    lse: torch.Tensor


class _DeferredLogits:
    """The logits ``head(hidden_states)`` of a patched forward, never computed: the hidden
    states, and what the forward applies to the logits (a scale, tanh), for their
    cross-entropy (and log-sum-exp, a z-loss) to reproduce. Slices of the leading dimensions
    and views that flatten them apply to the hidden states; any other use raises."""

    def __init__(self, hidden_states: torch.Tensor, head: nn.Linear, options: dict[str, Any],
                 operations: tuple = (), taken: Optional[list[_TakenLSE]] = None) -> None:
        self.hidden_states, self.head, self.options = hidden_states, head, options
        # ("mask", vocabulary index), ("scale", number) and ("tanh",), in order
        self.operations = operations
        # Shared by the stand-ins made from one: the LSEs their cross-entropies took.
        self.taken = [] if taken is None else taken
        self.derived = False  # whether a stand-in was made from this one

    def __repr__(self) -> str:
        return f"_DeferredLogits(shape={tuple(self.shape)}, operations={self.operations})"

    def _then(self, operation: tuple = (), hidden_states: Optional[torch.Tensor] = None,
              ) -> _DeferredLogits:
        self.derived = True  # a later mask would not reach what is made here (__setitem__)
        return _DeferredLogits(self.hidden_states if hidden_states is None else hidden_states,
                               self.head, self.options, self.operations + operation, self.taken)

    # What the logits would be.
    @property
    def shape(self) -> torch.Size:
        return torch.Size((*self.hidden_states.shape[:-1], self.head.out_features))

    def size(self, dim: Optional[int] = None) -> Union[torch.Size, int]:
        return self.shape if dim is None else self.shape[dim]

    def dim(self) -> int:
        return self.hidden_states.dim()

    ndim = property(dim)

    @property
    def device(self) -> torch.device:
        return self.head.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.head.weight.dtype

    # Scale and softcap.
    def __mul__(self, factor: Any) -> _DeferredLogits:
        return self._then((("scale", _scalar(factor)),))

    __rmul__ = __mul__

    def __truediv__(self, divisor: Any) -> _DeferredLogits:
        return self._then((("scale", 1 / _scalar(divisor)),))

    def tanh(self) -> _DeferredLogits:
        return self._then((("tanh",),))

    # Casts: the loss is computed in float32 anyway.
    def float(self) -> _DeferredLogits:
        return self

    def contiguous(self) -> _DeferredLogits:
        return self

    def to(self, *args: Any, **kwargs: Any) -> _DeferredLogits:
        if all(isinstance(arg, torch.dtype) for arg in (*args, *kwargs.values())):
            return self
        raise _unreproduced_use(".to() other than a cast")

    # A mask: entries of the vocabulary set to the dtype's minimum, before any scale or cap.
    def __setitem__(self, index: Any, value: Any) -> None:
        *leading, vocabulary = index if isinstance(index, tuple) else (index,)
        whole = all(item is Ellipsis or isinstance(item, slice) and item == slice(None)
                    for item in leading)
        reaches_vocabulary = Ellipsis in leading or len(leading) == self.dim() - 1
        if (not (whole and reaches_vocabulary) or not isinstance(value, float)
                or value != torch.finfo(self.dtype).min
                or any(operation[0] != "mask" for operation in self.operations)
                # In PyTorch the views made before see the entries set; the stand-ins do not.
                or self.derived):
            raise _unreproduced_use("entries set, other than vocabulary entries to the dtype's "
                                    "minimum before any scale or cap")
        self.operations += (("mask", vocabulary),)

    # Slices and views of the leading dimensions.
    def __getitem__(self, index: Any) -> _DeferredLogits:
        index = index if isinstance(index, tuple) else (index,)
        explicit = [item for item in index if item is not None and item is not Ellipsis]
        if Ellipsis in index or len(explicit) == self.dim():
            # The index reaches the last dimension: it must keep all of it.
            if index[-1] != slice(None):
                raise _unreproduced_use("index of the vocabulary dimension")
        return self._then(hidden_states=self.hidden_states[index])

    def view(self, *shape: Any) -> _DeferredLogits:
        shape = tuple(shape[0]) if len(shape) == 1 and not isinstance(shape[0], int) else shape
        if not shape or shape[-1] not in (self.head.out_features, -1) or (
                shape[-1] == -1 and -1 in shape[:-1]):
            raise _unreproduced_use(f".view{shape} other than of the leading dimensions")
        return self._then(hidden_states=self.hidden_states.reshape(
            *shape[:-1], self.hidden_states.shape[-1]))

    reshape = view

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (torch.tanh, torch.Tensor.tanh) and len(args) == 1 and not kwargs:
            return args[0].tanh()
        if func in (torch.mul, torch.Tensor.mul, torch.Tensor.__mul__, torch.Tensor.__rmul__):
            first, second = args
            return first * second if isinstance(first, cls) else second * first
        if func in (torch.div, torch.Tensor.div, torch.Tensor.__truediv__) and not kwargs:
            first, second = args
            if isinstance(first, cls):
                return first / second
        if func is nn.functional.cross_entropy and isinstance(args[0], cls):
            return args[0].cross_entropy(*args[1:], **kwargs)
        if func in (torch.logsumexp, torch.Tensor.logsumexp) and isinstance(args[0], cls):
            return args[0].logsumexp(*args[1:], **kwargs)
        raise _unreproduced_use(getattr(func, "__name__", str(func)))

    def __getattr__(self, name: str) -> Any:
        raise _unreproduced_use(f".{name}")

    def cross_entropy(
        self,
        target: torch.Tensor,
        weight: Optional[torch.Tensor] = None,
        size_average: Optional[bool] = None,
        ignore_index: int = -100,
        reduce: Optional[bool] = None,
        reduction: str = "mean",
        label_smoothing: float = 0.0,
    ) -> torch.Tensor:
        """``F.cross_entropy(logits, target, ...)`` of these (flattened) logits, by cce, with
        the patch's options (its weight and label smoothing, else the call's)."""
        if size_average is not None or reduce is not None:
            raise _unreproduced_use("cross-entropy with size_average or reduce")
        if self.hidden_states.dim() != 2 or target.shape != self.hidden_states.shape[:1]:
            raise _unreproduced_use("cross-entropy of logits not flattened to (tokens, vocabulary)")
        options = dict(self.options)
        if options["weight"] is None:
            options["weight"] = weight
        if options["label_smoothing"] == 0.0:
            options["label_smoothing"] = label_smoothing
        loss, lse = self._loss_and_lse(target, ignore_index=ignore_index, reduction=reduction,
                                       **options)
        self.taken.append(_TakenLSE(self.hidden_states, self.operations, lse))
        return loss

    def logsumexp(self, dim: int, keepdim: bool = False) -> torch.Tensor:
        """``torch.logsumexp(logits, dim=-1)`` (a z-loss, as Bamba's): the LSE that the latest
        cross-entropy taken over the same rows computed, else one more call of cce."""
        if keepdim or dim not in (-1, self.dim() - 1):
            raise _unreproduced_use("log-sum-exp other than over the vocabulary")
        rows = self.hidden_states.shape[:-1]
        for taken in reversed(self.taken):
            if (_same_rows(taken.hidden_states, self.hidden_states)
                    and _same_operations(taken.operations, self.operations)):
                return taken.lse.view(rows)
        flat = self._then(hidden_states=self.hidden_states.reshape(rows.numel(), -1))
        no_target = torch.full((rows.numel(),), -100, dtype=torch.long,
                               device=self.hidden_states.device)
        _, lse = flat._loss_and_lse(no_target, ignore_index=-100, reduction="none",
                                    **self.options)
        return lse.view(rows)

    def _loss_and_lse(self, target: torch.Tensor, **options: Any,
                      ) -> tuple[torch.Tensor, torch.Tensor]:
        """cce's loss and every row's LSE of these (flattened) logits."""
        entries = [operation[1] for operation in self.operations if operation[0] == "mask"]
        if not entries:
            scale, softcap = _scale_and_softcap(self.operations)
            return self._cross_entropy(target, scale, softcap, None, **options)
        if len(self.operations) > len(entries):  # a masked target's logit would not be the minimum
            raise _unreproduced_use("scale or cap after masked vocabulary entries")
        masked = torch.zeros(self.head.out_features, dtype=torch.bool, device=target.device)
        for vocabulary in entries:
            masked[vocabulary] = True
        return self._masked_loss_and_lse(masked, target, **options)

    def _cross_entropy(self, target: torch.Tensor, scale: Union[float, torch.Tensor],
                       softcap: Optional[float], masked: Optional[torch.Tensor],
                       **options: Any) -> tuple[torch.Tensor, torch.Tensor]:
        return _as_head_forward(
            self.head, self.hidden_states,
            lambda hidden_states: _cross_entropy(
                self.head, hidden_states, target, scale=scale, softcap=softcap, masked=masked,
                return_lse=True, **options))

    def _masked_loss_and_lse(self, masked: torch.Tensor, target: torch.Tensor, *,
                             reduction: str, ignore_index: int,
                             **options: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """The loss with vocabulary entries masked (set to the dtype's minimum, whose
        gradient is 0): the softmax's part is cce's with those entries' bias at the minimum;
        a row whose target is masked scores ``lse - minimum`` with no gradient at its target,
        so cce takes it as ignored and its loss is added here."""
        if options["weight"] is not None or options["label_smoothing"]:
            raise _unreproduced_use("masked vocabulary entries with class weights or label "
                                    "smoothing")
        scored = target != ignore_index
        hits = scored & masked[target.clamp(0, masked.shape[0] - 1)]
        loss, lse = self._cross_entropy(torch.where(hits, ignore_index, target), 1.0, None,
                                        masked, reduction="none", ignore_index=ignore_index,
                                        **options)
        loss = loss + torch.where(hits, lse - torch.finfo(self.dtype).min, 0.0)
        if reduction == "sum":
            loss = loss.sum()
        elif reduction == "mean":  # over the scored rows, NaN without one, as F.cross_entropy
            loss = loss.sum() / scored.sum()
        return loss, lse


def _same_rows(flat: torch.Tensor, hidden_states: torch.Tensor) -> bool:
    """Whether ``flat`` (N, D) holds the rows of ``hidden_states`` (..., D), in order."""
    return (flat.data_ptr() == hidden_states.data_ptr() and flat.is_contiguous()
            and hidden_states.is_contiguous() and flat.shape[-1] == hidden_states.shape[-1]
            and flat.shape[0] == hidden_states.shape[:-1].numel())


def _same_operations(first: tuple, second: tuple) -> bool:
    """Whether two stand-ins' operations are the same (a learnt scale: the same tensor)."""
    return len(first) == len(second) and all(
        a[0] == b[0] and (len(a) == 1 or a[1] is b[1] or (
            not isinstance(a[1], torch.Tensor) and not isinstance(b[1], torch.Tensor)
            and a[1] == b[1]))
        for a, b in zip(first, second))


def _unreproduced_use(what: str) -> AttributeError:
    return AttributeError(f"cce: a patched forward uses its logits' {what}, but never computes "
                          f"the logits; unpatch(model) to run this forward")


def _scalar(value: Any) -> Union[float, torch.Tensor]:
    """A logit scale: a number, or a tensor of one element (kept: a learnt scale trains)."""
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return value.reshape(())
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
        return float(value)
    raise _unreproduced_use(f"product with a {type(value).__name__}")


def _scale_and_softcap(operations: tuple) -> tuple[Union[float, torch.Tensor], Optional[float]]:
    """What ``operations`` make of logits z, ``b * tanh(a * z)`` (or ``a * z``), as
    ``softcap(s * z)`` with softcap(x) = cap * tanh(x / cap): s = a * b and cap = |b|, whichever
    order the forward applies its scale and softcap in (Gemma 2's softcap, z / cap, tanh, * cap,
    is s = 1). (With linear_cross_entropy's temperature, softcap(z) / temperature, it is
    cap = 1 / a and temperature = 1 / (a * b).)"""
    factors: list[Union[float, torch.Tensor]] = [1.0]
    for operation in operations:
        if operation[0] == "scale":
            factors[-1] = factors[-1] * operation[1]
        elif len(factors) == 1:
            factors.append(1.0)
        else:
            raise _unreproduced_use("tanh of a tanh")
    if len(factors) == 1:
        return factors[0], None
    before, after = factors
    if isinstance(after, torch.Tensor) or after == 0:
        raise _unreproduced_use("tanh times a tensor or 0")
    return before * after, abs(after)


def _as_head_forward(head: nn.Module, hidden_states: torch.Tensor,
                     loss: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """``loss(hidden_states)``, run as the head's forward when FSDP2 shards the head: outside
    its forward, its weight is this rank's shard (a DTensor); the hooks of a call of the head
    gather the weight for the loss and reduce its gradient in the backward."""
    if not _is_fsdp2_module(head):
        return loss(hidden_states)
    instance_forward = head.__dict__.get("forward")
    head.forward = loss
    try:
        return head(hidden_states)
    finally:
        if instance_forward is None:
            del head.forward
        else:
            head.forward = instance_forward


def _is_fsdp2_module(module: nn.Module) -> bool:
    if not torch.distributed.is_available():
        return False
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # torch < 2.6 has FSDP2 under its former name
        from torch.distributed._composable.fsdp import FSDPModule

    return isinstance(module, FSDPModule)


def _cross_entropy(
    head: nn.Linear,
    hidden_states: torch.Tensor,
    targets: torch.Tensor,
    *,
    scale: Union[float, torch.Tensor],
    softcap: Optional[float],
    masked: Optional[torch.Tensor] = None,
    **options: Any,
) -> Any:
    """``F.cross_entropy(softcap(scale * head(hidden_states)), targets, ...)`` by cce, without
    the logits (with ``return_lse=True``, and every row's LSE); the vocabulary entries where
    ``masked`` (bool (V,)) is set to the logits' minimum first, as a bias of that minimum
    (added to a logit, it rounds to the minimum)."""
    weight, bias = _classifier_of(head)(head)
    if masked is not None:
        bias = (torch.zeros(weight.shape[0], dtype=weight.dtype, device=weight.device)
                if bias is None else bias).masked_fill(masked, torch.finfo(weight.dtype).min)
    device_type = weight.device.type
    # Under autocast, the head would multiply in the autocast dtype; cce needs one dtype anyway.
    if torch.is_autocast_enabled(device_type):
        dtype = torch.get_autocast_dtype(device_type)
    else:
        dtype = weight.dtype
    # With a model split over devices, the loss runs where the head lives, as the head would.
    embeddings = hidden_states.to(device=weight.device, dtype=dtype)
    bias = None if bias is None else bias.to(dtype)
    embeddings, bias = _logit_scale_as_scaled_embeddings(embeddings, bias, scale)
    return cce.linear_cross_entropy(embeddings, weight.to(dtype), targets.to(weight.device),
                                    bias=bias, softcap=softcap, **options)


def _logit_scale_as_scaled_embeddings(
    embeddings: torch.Tensor, bias: Optional[torch.Tensor], scale: Union[float, torch.Tensor],
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Logits ``scale * (e @ c.T + b)`` as ``(scale * e) @ c.T + scale * b``: exact, and a
    gradient flows to a learnt scale, which linear_cross_entropy's ``temperature`` (a number)
    could not carry; for a number it is the same computation as ``temperature = 1 / scale``."""
    if not isinstance(scale, torch.Tensor) and math.isclose(scale, 1.0, rel_tol=1e-12):
        return embeddings, bias
    if isinstance(scale, torch.Tensor):
        scale = scale.to(device=embeddings.device, dtype=embeddings.dtype)
    return embeddings * scale, None if bias is None else bias * scale
