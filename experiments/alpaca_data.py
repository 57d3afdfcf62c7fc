"""The Alpaca instruction data: loading, the Alpaca prompt template, tokenization with labels.

The data ships with the repository: ``data/alpaca_5000.json``, 5,000 examples of Stanford
Alpaca (CC BY-NC 4.0; provenance in ``data/README.md``). Scripts take ``--data PATH`` to read
another file in the same format.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch

IGNORE_INDEX = -100
# Found from this file, not from the working directory: the scripts run from anywhere.
DEFAULT_DATA_PATH = Path(__file__).resolve().parents[1] / "data" / "alpaca_5000.json"
FIELDS = ("instruction", "input", "output")

# The two templates of Stanford Alpaca (train.py's PROMPT_DICT), as in the data's README.
PROMPT_WITH_INPUT = (
    "Below is an instruction that describes a task, paired with an input that provides further "
    "context. Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n"
)
PROMPT_WITHOUT_INPUT = (
    "Below is an instruction that describes a task. Write a response that appropriately "
    "completes the request.\n\n### Instruction:\n{instruction}\n\n### Response:\n"
)


def load_alpaca(path: Path | None = None, limit: int | None = None) -> list[dict]:
    """The records (``instruction``, ``input``, ``output``) of an Alpaca JSON file, in order.

    ``path`` defaults to :data:`DEFAULT_DATA_PATH`; ``limit`` keeps the first ``limit`` records.
    """
    path = DEFAULT_DATA_PATH if path is None else Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"Alpaca data not found at {path}: pass the path of "
                                "alpaca_5000.json (--data on the command line)")
    records = json.loads(path.read_text())
    if not isinstance(records, list):
        raise ValueError(f"{path}: expected a JSON list of records")
    for index, record in enumerate(records[:limit]):
        missing = [name for name in FIELDS if not isinstance(record.get(name), str)]
        if missing:
            raise ValueError(f"{path}: record {index} lacks the string field(s) {missing}")
    return records[:limit]


def add_data_argument(parser: argparse.ArgumentParser) -> None:
    """``--data PATH``: the Alpaca JSON file, checked to exist when the arguments are parsed
    (default: :data:`DEFAULT_DATA_PATH`)."""
    def existing_file(text: str) -> Path:
        path = Path(text).expanduser()
        if not path.is_file():
            raise argparse.ArgumentTypeError(f"no such file: {text}")
        return path

    parser.add_argument("--data", type=existing_file, metavar="PATH",
                        help="Alpaca JSON file: a list of records with instruction, input and "
                             "output (default: data/alpaca_5000.json in the repository)")


def format_prompt(record: dict) -> tuple[str, str]:
    """``(prompt, response)``: the Alpaca template filled with the record, and its output.

    As in Stanford Alpaca, the template with an input section is used when ``input`` is not
    empty.
    """
    template = PROMPT_WITH_INPUT if record.get("input", "") != "" else PROMPT_WITHOUT_INPUT
    prompt = template.format(instruction=record["instruction"], input=record.get("input", ""))
    return prompt, record["output"]


def tokenize_examples(tokenizer: Any, records: list[dict], max_length: int) -> list[dict]:
    """Token ids and labels of each record, truncated to ``max_length`` tokens.

    Each example is ``prompt tokens + response tokens + EOS``. The prompt is tokenized with the
    tokenizer's special tokens (the BOS, for tokenizers that add one), the response without
    them; tokenizing the two apart keeps the boundary exact (the prompt ends with a newline).
    ``labels`` equals ``input_ids`` with the prompt positions set to -100: the Hugging Face
    convention, where the model shifts the labels itself.
    """
    if max_length < 1:
        raise ValueError(f"max_length must be >= 1, got {max_length}")
    if tokenizer.eos_token_id is None:
        raise ValueError("the tokenizer has no EOS token to end the responses with")
    examples = []
    for record in records:
        prompt, response = format_prompt(record)
        prompt_ids = tokenizer(prompt)["input_ids"]
        response_ids = tokenizer(response, add_special_tokens=False)["input_ids"]
        response_ids = response_ids + [tokenizer.eos_token_id]
        input_ids = (prompt_ids + response_ids)[:max_length]
        labels = ([IGNORE_INDEX] * len(prompt_ids) + response_ids)[:max_length]
        examples.append({"input_ids": torch.tensor(input_ids, dtype=torch.long),
                         "labels": torch.tensor(labels, dtype=torch.long)})
    return examples
