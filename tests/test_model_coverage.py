"""Which transformers models cce.integrations.transformers.patch trains exactly: docs/models.md.

Every model type of transformers' causal-LM and image-text-to-text mappings (each class it maps
to) is built tiny from its config (no downloads: hidden 32, 2 layers, 4 heads, vocabulary 256,
4 experts), float32, on the CPU, with cce's chunked PyTorch path. ``patch`` accepts it or
refuses it with its reason. An accepted model must be exact against the unpatched model, with
ignored labels (-100: a prompt, padding): the loss of one big batch (relative error 1e-5); then
gradient accumulation, two micro-batches with ``num_items_in_batch``: the summed loss (1e-5)
and every parameter's gradient (1e-4), and the summed loss equal to the big batch's wherever the
model's own loss is (it takes num_items_in_batch and has no router loss, which is not a sum
over tokens). Mixtures of experts run with ``output_router_logits`` on, so that their router
loss (``router_aux_loss_coef`` times ``aux_loss``) is part of the loss, and ``aux_loss`` is
compared too; a z-loss (``z_loss_coefficient``) is on. The model's head must not run (no logits).

The table of docs/models.md is what this file finds: ``CCE_WRITE_MODEL_TABLE=1 python -m pytest
tests/test_model_coverage.py`` writes it; otherwise the test asserts that the committed table is
the one it finds (with the transformers version it was written with), so it cannot go stale.
"""

from __future__ import annotations

import copy
import functools
import os
from pathlib import Path
from typing import Any, Optional

import pytest
import torch

transformers = pytest.importorskip("transformers")

from transformers import AutoConfig  # noqa: E402
from transformers.models.auto.modeling_auto import (  # noqa: E402
    MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES)

from cce.integrations.transformers import patch  # noqa: E402
from tests.helpers import assert_same_gradients  # noqa: E402
from tests.reference import relative_error  # noqa: E402

TABLE = Path(__file__).resolve().parent.parent / "docs" / "models.md"
LOSS_TOLERANCE, GRADIENT_TOLERANCE = 1e-5, 1e-4  # float32; gradients: assert_same_gradients
BATCH, SEQ, VOCAB, LAYERS = 2, 12, 256, 2
# cce's chunked PyTorch path: the kernels' path in Triton's interpreter takes 100 times longer.
IMPL = "cce_torch"

# The tiny size of every config entry of these names, in the config and its sub-configs
# (text, vision, ...); lists of one entry per layer keep their first LAYERS entries.
TINY = {
    "vocab_size": VOCAB, "n_words": VOCAB, "decoder_vocab_size": VOCAB,
    "hidden_size": 32, "n_embd": 32, "d_model": 32, "embed_dim": 32, "dim": 32,
    "intermediate_size": 64, "n_inner": 64, "ffn_dim": 64, "ffn_hidden_size": 64,
    "intermediate_size_mlp": 64, "shared_intermediate_size": 32,
    "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32,
    "expert_ffn_hidden_size": 32, "projection_dim": 32,
    # Janus's image-generation head: a codebook of this many image tokens of this size.
    "num_embeddings": 64, "image_token_embed_dim": 32,
    "num_hidden_layers": LAYERS, "n_layer": LAYERS, "n_layers": LAYERS, "num_layers": LAYERS,
    "decoder_layers": LAYERS, "encoder_layers": LAYERS,
    "decoder_ffn_dim": 64, "encoder_ffn_dim": 64,
    "num_attention_heads": 4, "n_head": 4, "n_heads": 4, "num_heads": 4,
    "num_key_value_heads": 2, "head_dim": 8,
    "num_experts": 4, "num_local_experts": 4, "n_routed_experts": 4, "moe_num_experts": 4,
    "num_experts_per_tok": 2, "moe_top_k": 2, "moe_k": 2,
    "n_group": 1, "topk_group": 1,
    "encoder_attention_heads": 4, "decoder_attention_heads": 4,
    # Multi-head latent attention and partial rotary embeddings.
    "kv_lora_rank": 16, "q_lora_rank": 16, "qk_rope_head_dim": 4, "qk_nope_head_dim": 4,
    "qk_head_dim": 8, "v_head_dim": 8, "rotary_dim": 4,
    # Mamba 2 layers: heads * head dim = expand (2) * hidden.
    "mamba_n_heads": 8, "mamba_d_head": 8,
    "max_position_embeddings": 128, "n_positions": 128,
    # Logits far from uniform: a scale or a softcap changes the loss by far more than the
    # tolerance.
    "initializer_range": 0.2,
}
# The ids of these tokens when the config's are beyond the tiny vocabulary.
SPECIAL_TOKENS = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}
# Config entries set to 0, so that one big batch and two micro-batches see the same model.
NO_RANDOMNESS = ("dropout", "pdrop", "jitter", "drop_path")
# Per model type: config entries beyond TINY (sub-configs as dicts), for the model to build
# tiny and to run the parts the patch must reproduce (its router loss, its logit scale).
MROPE = {"text_config": {"rope_parameters": {"mrope_section": [2, 1, 1]}}}  # head dim 8
# Qwen4-Exp's indexer sizes (None by default) and linear-attention heads.
QWEN4_EXP_TEXT = dict(
    indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=8, indexer_budget=8,
    indexer_compress_ratio=2, linear_key_head_dim=8, linear_value_head_dim=8,
    linear_num_key_heads=2, linear_num_value_heads=4, hc_lowrank=8, ple_embed_dim=32,
    ngram_vocab_size_base=VOCAB, split_ngram_parts=2,
    layer_types=["linear_attention", "indexed_attention"])
# Dots 3 Note's per-layer overrides (its first layer's, for 64 heads) at the tiny sizes, and
# sliding-attention heads of qk_nope + qk_rope.
DOTS3_NOTE_TEXT = dict(
    head_dim=8, num_key_value_heads=4, index_head_dim=8, index_n_heads=2, index_topk=8,
    sliding_window=8, layer_types=["indexed_attention", "sliding_attention"],
    mlp_layer_types=["dense", "sparse"], per_layer_config={"01": dict(
        num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=16, qk_nope_head_dim=4)})
# Cohere Compass's rotary settings are per layer type, none by default.
COMPASS_TEXT = dict(layer_types=["sliding_attention", "full_attention"], sliding_window=8,
                    rope_parameters={kind: {"rope_type": "default", "rope_theta": 10000.0}
                                     for kind in ("sliding_attention", "full_attention")})
CONFIG = {
    **dict.fromkeys(("qwen2_vl", "qwen2_5_vl", "paddleocr_vl", "glm4v", "glm46v", "glmga",
                     "glm_ocr"), MROPE),
    "glm4v_moe": {"text_config": {"rope_parameters": {"mrope_section": [1, 1, 0]}}},
    # Layer 0 Mamba and dense, layer 1 attention and experts.
    "jamba": dict(attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2,
                  expert_layer_offset=1),
    "dbrx": dict(attn_config=dict(clip_qkv=8.0), ffn_config=dict(moe_top_k=2)),
    "mamba2": dict(num_heads=8),
    "granitemoehybrid": dict(layer_types=["linear_attention", "full_attention"]),
    # Layer 0 Mamba, layer 1 attention (by default every layer of two is Mamba).
    "bamba": dict(attn_layer_indices=[1]),
    # Sizes their configs leave None (derived in the full model's code paths, not in these).
    **dict.fromkeys(("ministral", "hunyuan_v1_dense", "hunyuan_v1_moe"), dict(head_dim=8)),
    "nemotron": dict(num_key_value_heads=4),
    "deepseek_v2": dict(num_experts_per_tok=2),
    # One layer of each kind (their configs name the kinds in lists of another length).
    "recurrent_gemma": dict(block_types=["recurrent", "attention"]),
    "lfm2_moe": dict(layer_types=["conv", "full_attention"], num_dense_layers=1),
    "step3p7": dict(text_config=dict(sliding_window=8)),  # its masks need one, None by default
    # A decoder, its axial positions 3 x 4 = the batch's 12 tokens.
    "reformer": dict(is_decoder=True, axial_pos_shape=[3, 4], axial_pos_embds_dim=[16, 16]),
    # Mamba heads of 8 (heads x head dim = the Mamba width), a state and chunk of 16.
    "falcon_h1": dict(mamba_d_ssm=64, mamba_d_state=16, mamba_chunk_size=16),
    "zamba2": dict(mamba_headdim=8, mamba_d_state=16, chunk_size=16, attention_head_dim=16,
                   attention_hidden_size=64, adapter_rank=8,
                   layers_block_type=["linear_attention", "hybrid"], hybrid_layer_ids=[1]),
    # Two hybrid layers: their shared transformer is tied from the second on.
    "zamba": dict(attention_head_dim=16, attention_hidden_size=64, mamba_dt_rank=4,
                  num_hidden_layers=4, layers_block_type=["linear_attention", "hybrid"] * 2),
    "xlnet": dict(d_head=8),  # d_model / n_head
    "xmod": dict(default_language="en_XX"),  # its adapters need a language chosen
    # Heads of 8, their half split over the 4 multimodal rotary axes (None by default).
    "hunyuan_vl": dict(text_config=dict(head_dim=8, rope_parameters=dict(
        mrope_section=[1, 1, 1, 1]))),
    # The settings its projector reads without defaults, for two tiny layers; a vision width
    # its Q-Former's heads (width // 64) can divide.
    "granite4_vision": dict(deepstack_layer_map=[[0, 0], [1, 1]], spatial_target_layers=[0, 1],
                            downsample_rate="1/2", vision_config=dict(
                                hidden_size=64, num_attention_heads=4, intermediate_size=64)),
    # Image and audio tokens inside the tiny vocabulary (visual codes 100-179, audio 180-243)
    # and small tokenizers for both.
    "apertus1p5": dict(image_token_id=5, audio_token_id=6, image_token_offset=100,
                       audio_token_offset=180, vision_config=dict(
                           codebook_size=80, embed_dim=32, latent_channels=32, base_channels=32,
                           num_res_blocks=1, resolution=32),
                       audio_config=dict(
                           codebook_dim=32, codebook_size=64, decoder_hidden_size=32,
                           decoder_intermediate_size=64, decoder_num_layers=1,
                           decoder_attention_num_groups=4, num_lstm_layers=1)),
    # Sizes its config does not name as the others do; a decoder start token.
    "udop": dict(d_kv=8, d_ff=64, num_decoder_layers=2, decoder_start_token_id=0),
    # Two tiny vision layers to take features from; its image tokens inside the vocabulary.
    "molmo2": dict(adapter_config=dict(vision_feature_layer=[1, 0]), image_patch_id=250,
                   image_start_token_id=251, low_res_image_start_token_id=252,
                   image_end_token_id=253, frame_start_token_id=254, frame_end_token_id=255),
    # The global model's width where its byte encoder and decoder meet it, a small hash vocabulary,
    # and a layer count at the top, which the per-layer settings read.
    "blt": dict(num_hidden_layers=2, encoder_hash_byte_group_vocab=64,
                encoder_config=dict(hidden_size_global=32),
                decoder_config=dict(hidden_size_global=32)),
    # Image-token maps (Chameleon masks their logits) and small VQ models.
    "emu3": dict(vocabulary_map={"<image>": 5, "<|extra_200|>": 6}, vq_config=dict(
        codebook_size=16, embed_dim=32, latent_channels=32, base_channels=32,
        channel_multiplier=[1, 1], num_res_blocks=1)),
    "chameleon": dict(vocabulary_map={"<image>": 5, "IMGIMGAZ": 250, "IMGIMGBZ": 251,
                                      "IMGIMGCZ": 252}, vq_config=dict(
        base_channels=32, embed_dim=32, latent_channels=32, num_embeddings=16,
        channel_multiplier=[1, 1], resolution=16)),
    # Sizes and counts their configs leave None or give for many layers.
    "dots1": dict(n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2,
                  first_k_dense_replace=1),
    "gemma3n_text": dict(num_kv_shared_layers=0, layer_types=["sliding_attention",
                                                              "full_attention"],
                         hidden_size_per_layer_input=8, vocab_size_per_layer_input=VOCAB,
                         laurel_rank=8, sliding_window=8, activation_sparsity_pattern=[0.0, 0.0]),
    "zaya": dict(num_experts_per_tok=1),  # the only count it supports
    **dict.fromkeys(("kimi_linear", "bailing_hybrid"), dict(
        num_experts_per_token=2, num_expert_group=1, topk_group=1, first_k_dense_replace=1,
        linear_head_dim=8, linear_num_heads=4, layer_group_size=2,
        layer_types=["linear_attention", "full_attention"], mlp_layer_types=["dense", "sparse"])),
    "flint": dict(layer_types=["full_attention", "sliding_attention"], mlp_only_layers=[0],
                  sliding_window=8),
    "hrm_text": dict(num_layers_per_stack=1, H_cycles=1, L_cycles=1, L_bp_cycles=[1]),
    "cohere_compass_text": COMPASS_TEXT, "cohere_compass": dict(text_config=COMPASS_TEXT),
    "cosmos3_edge": MROPE,
    "hy_v4_vl": {"text_config": {"rope_parameters": {"mrope_section": [1, 1, 0]}}},  # rope dim 4
    # Its sparse attention layers take no rotary part (NoPE), its index pools of 4 keys.
    "glm5_next": dict(text_config=dict(
        qk_rope_head_dim=0, qk_nope_head_dim=8, qk_head_dim=8, head_dim=0, index_head_dim=8,
        index_n_heads=2, index_topk=8, index_kpool=4, linear_head_dim=8)),
    "qwen4_exp_text": QWEN4_EXP_TEXT, "qwen4_exp": dict(text_config=QWEN4_EXP_TEXT),
    # Text and vision experts' widths; 3D rotary sections (height, width, time) of head dim 8.
    "ernie4_5_vl_moe": dict(text_config=dict(moe_intermediate_size=[32, 16],
                                             moe_num_shared_experts=1,
                                             rope_parameters=dict(mrope_section=[1, 1, 2]))),
    # Encoders whose output width must be the text model's (their defaults are the full size's).
    "granite_docling": dict(vision_config=dict(out_hidden_size=32)),
    **dict.fromkeys(("inkling2", "inkling2_loop"), dict(vision_config=dict(text_hidden_size=32))),
    "muse_spark": dict(audio_config=dict(out_hidden_size=32),
                       vision_config=dict(out_hidden_size=32)),
    "deepseek_ocr2": dict(text_config=dict(mlp_layer_types=["dense", "sparse"],
                                           num_experts_per_tok=2, n_routed_experts=4,
                                           n_shared_experts=1)),  # None by default
    # One layer of each attention and expert kind, compressed 2 and 4 times.
    "deepseek_v4": dict(
        layer_types=["compressed_sparse_attention", "heavily_compressed_attention"],
        mlp_layer_types=["hash_moe", "moe"],
        compress_rates=dict(compressed_sparse_attention=2, heavily_compressed_attention=4),
        head_dim=8, num_key_value_heads=1, q_lora_rank=16, o_groups=2, o_lora_rank=8,
        index_n_heads=2, index_head_dim=8, index_topk=4, sliding_window=8, hc_mult=2),
    # Their forward reads a vision_start_token_id their configs do not have.
    "qwen2_5_omni_thinker": dict(vision_start_token_id=VOCAB - 6, **MROPE),
    "qwen3_omni_moe_thinker": dict(vision_start_token_id=VOCAB - 6),
    "dots3_note_text": DOTS3_NOTE_TEXT,
    "dots3_note": dict(text_config=DOTS3_NOTE_TEXT,
                       vision_config=dict(adapter_in_dim=32, adapter_out_dim=32),
                       audio_config=dict(adapter_input_size=32, adapter_out_dim=32,
                                         downsample_hidden_size=16, conv_output_size=64)),
    # One input, recurrent and output layer each (it counts the three); its head scales each
    # class's logit by a learnt factor.
    "dory": dict(num_hidden_layers=3, n_input_layers=1, n_recurrent_layers=1,
                 n_output_layers=1, sliding_window=8,
                 layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                 rope_parameters={kind: {"rope_type": "default", "rope_theta": 10000.0}
                                  for kind in ("sliding_attention", "full_attention")}),
    "diffusion_gemma": dict(text_config=dict(num_experts=4, top_k_experts=2,
                                             moe_intermediate_size=32, sliding_window=8,
                                             layer_types=["sliding_attention",
                                                          "full_attention"])),
}
# Per model type: config attributes set after it is built (dotted paths into sub-configs):
# DBRX's default config does not build in transformers 5.24 without this.
SET_AFTER = {"dbrx": {"attn_config.rope_theta": 10000.0}}
# Per (model type, class): why it is not tested: it needs a package or inputs this test does
# not have, or no tiny config was found that builds and runs (each with the cause seen).
TIMM = "needs the timm package"
# Per (model type, class): models this file's text-only batch cannot run, tested exact with the
# inputs they need in test_integration_transformers.py (test_models_with_pixel_inputs_are_exact).
TESTED_WITH_PIXELS = {
    **dict.fromkeys([("blip-2", "Blip2ForConditionalGeneration"),
                     ("instructblip", "InstructBlipForConditionalGeneration"),
                     ("kosmos-2", "Kosmos2ForConditionalGeneration"),
                     ("vision-encoder-decoder", "VisionEncoderDecoderModel")], "pixel_values"),
    ("pix2struct", "Pix2StructForConditionalGeneration"): "flattened_patches",
    ("instructblipvideo", "InstructBlipVideoForConditionalGeneration"): "video frames",
    **dict.fromkeys([("idefics", "IdeficsForVisionText2Text"), ("git", "GitForCausalLM"),
                     ("pp_formulanet", "PPFormulaNetForConditionalGeneration")],
                    "pixel_values"),
}
# Inputs that a model asks for in training even on text alone, from the input ids.
TEXT_ONLY_INPUTS = {
    "molmo2": lambda ids: {"mm_token_type_ids": torch.zeros_like(ids)},  # every token text
    "udop": lambda ids: {"bbox": torch.zeros(*ids.shape, 4)},  # every token's box at 0
}
NOT_TESTED = {
    ("gemma3n", "Gemma3nForConditionalGeneration"): TIMM,
    ("fast_vlm", "FastVlmForConditionalGeneration"): TIMM,
    ("perception_lm", "PerceptionLMForConditionalGeneration"): TIMM,
    ("llama4", "Llama4ForConditionalGeneration"):
        "its own forward fails in transformers 5.24, with pixels too (`outputs.image_outputs`)",
    **dict.fromkeys([("gemma4_assistant", "Gemma4AssistantForCausalLM"),
                     ("gemma4_unified_assistant", "Gemma4UnifiedAssistantForCausalLM")],
                    "a drafting model: its forward takes a backbone's embeddings and shared "
                    "key/value states, and no labels"),
}


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny models: one thread each, faster than several (and far faster on a busy machine)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def rows() -> list[tuple[str, str]]:
    """(model type, class name) of every entry of the two mappings, each pair once."""
    pairs = dict.fromkeys(list(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items())
                          + list(MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES.items()))
    return [(model_type, name) for model_type, name in pairs if isinstance(name, str)]


def _tiny_entries(entries: dict[str, Any]) -> dict[str, Any]:
    layers = next((entries[name] for name in ("num_hidden_layers", "n_layer", "n_layers",
                                              "num_layers") if isinstance(entries.get(name), int)),
                  None)
    tiny: dict[str, Any] = {}
    for name, value in entries.items():
        if isinstance(value, dict) and "model_type" in value:
            tiny[name] = _tiny_entries(value)
        elif name in TINY and isinstance(value, int) and not isinstance(value, bool):
            tiny[name] = TINY[name]
        elif name == "initializer_range":
            tiny[name] = TINY[name]
        elif isinstance(value, float) and any(word in name for word in NO_RANDOMNESS):
            tiny[name] = 0.0
        elif isinstance(value, list) and layers and len(value) == layers != LAYERS:
            # One layer of each kind (attention and linear attention, dense and experts, ...).
            kinds = [kind for index, kind in enumerate(value) if kind not in value[:index]]
            tiny[name] = (kinds * LAYERS)[:LAYERS]
        elif (isinstance(value, dict) and value and layers
              and all(str(key).isdigit() for key in value)):
            # Settings of some layers, by index (Gemma 4's full-attention layers): the first's,
            # for the last tiny layer, where the rule above puts a second kind of layer.
            first = min(value, key=int)
            tiny[name] = {str(LAYERS - 1).zfill(len(str(first))): value[first]}
        elif name in SPECIAL_TOKENS and isinstance(value, int) and value >= VOCAB:
            tiny[name] = SPECIAL_TOKENS[name]
        elif name in SPECIAL_TOKENS and isinstance(value, list):
            tiny[name] = [token for token in value if token < VOCAB] or SPECIAL_TOKENS[name]
        else:
            tiny[name] = value
    if "qk_rope_head_dim" in tiny:  # multi-head latent attention: head_dim is the rotary part
        tiny.update(head_dim=TINY["qk_rope_head_dim"], num_key_value_heads=TINY["n_heads"])
    if "first_k_dense_replace" in tiny:  # a layer of experts among the two
        tiny.update(first_k_dense_replace=1)
    return tiny


def _merge(entries: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    merged = dict(entries)
    for name, value in extra.items():
        if isinstance(value, dict) and isinstance(merged.get(name), dict):
            merged[name] = _merge(merged[name], value)
        else:
            merged[name] = value
    return merged


def tiny_config(model_type: str) -> transformers.PretrainedConfig:
    config = AutoConfig.for_model(model_type)
    entries = _merge(_tiny_entries(config.to_dict()), CONFIG.get(model_type, {}))
    for name in ("model_type", "transformers_version"):
        entries.pop(name, None)
    config = type(config)(**entries)
    for path, value in SET_AFTER.get(model_type, {}).items():
        *parents, name = path.split(".")
        setattr(functools.reduce(getattr, parents, config), name, value)
    if hasattr(config, "output_router_logits"):
        config.output_router_logits = True
    if hasattr(config, "z_loss_coefficient"):  # Bamba's z-loss, off by default: on here
        config.z_loss_coefficient = 0.01
    return config


def special_token_ids(config: Any) -> set[int]:
    """The ids a config names (image, pad, ... tokens): random input ids avoid them."""
    entries = config.to_dict() if hasattr(config, "to_dict") else config
    ids = set()
    for name, value in entries.items():
        if isinstance(value, dict):
            ids |= special_token_ids(value)
        elif isinstance(name, str) and name.endswith(("token_id", "token_index", "token_ids")):
            ids |= {value} if isinstance(value, int) else set(value or ()) if isinstance(
                value, list) else set()
    return ids


def build(model_type: str, class_name: str, device: str = "cpu") -> torch.nn.Module:
    model_class = getattr(transformers, class_name)
    config = class_config(tiny_config(model_type), model_class.config_class)
    torch.manual_seed(0)
    with torch.device(device):
        model = model_class(config)
    return model.float().train()


def class_config(config: Any, config_class: Optional[type]) -> Any:
    """The config a class takes: the model type's, or, for a causal LM over a multimodal
    model's language part (Emu3ForCausalLM), the sub-config of the class's own config type."""
    if config_class is None or isinstance(config, config_class):
        return config
    return next((value for value in vars(config).values() if isinstance(value, config_class)),
                config)


@functools.lru_cache(maxsize=None)
def status(model_type: str, class_name: str) -> str:
    """"exact", "exact (with the inputs: where)", "refused: why" or "not tested: why", as the
    table writes it (built on the meta device, where nothing is computed: patch reads the
    model; the exactness is test_patched_model_is_exact's, or the test named)."""
    if (model_type, class_name) in NOT_TESTED:
        return f"not tested: {NOT_TESTED[model_type, class_name]}"
    model = build(model_type, class_name, "meta")
    try:
        patch(model)
    except ValueError as refusal:
        return f"refused: {str(refusal).split(' is not supported: ', 1)[-1]}"
    if (model_type, class_name) in TESTED_WITH_PIXELS:
        return (f"exact (with {TESTED_WITH_PIXELS[model_type, class_name]}, in "
                f"test_integration_transformers.py)")
    return "exact"


def make_batch(gen: torch.Generator, config: Any) -> dict[str, torch.Tensor]:
    """Input ids, attention mask and labels: a masked prompt in row 0, right padding in row 1."""
    input_ids = torch.randint(3, VOCAB, (BATCH, SEQ), generator=gen)
    for special in special_token_ids(config):
        input_ids[input_ids == special] = 3 if special != 3 else 4
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, -3:] = 0
    labels = input_ids.clone()
    labels[0, :4] = -100
    labels[attention_mask == 0] = -100
    extra = TEXT_ONLY_INPUTS.get(getattr(config, "model_type", None), lambda ids: {})
    return dict(input_ids=input_ids, attention_mask=attention_mask, labels=labels,
                **extra(input_ids))


def table_version() -> str:
    """The transformers version docs/models.md was written with."""
    return TABLE.read_text().split(" with transformers ", 1)[1].split(" ", 1)[0]


@pytest.mark.parametrize("model_type, class_name", rows())
def test_patched_model_is_exact(model_type: str, class_name: str, gen: torch.Generator) -> None:
    try:
        found = status(model_type, class_name)
        if found != "exact":
            pytest.skip(found)
        reference = build(model_type, class_name)
    except Exception as error:
        # The tiny configs and NOT_TESTED are those of the table's transformers version; another
        # version may not build a model tiny (a failure in that version, a skip in others).
        if transformers.__version__ == table_version():
            raise
        pytest.skip(f"not built tiny with transformers {transformers.__version__}: {error!r}")
    model = patch(copy.deepcopy(reference), impl=IMPL)
    head_calls = []
    model.get_output_embeddings().register_forward_hook(lambda *_: head_calls.append(1))
    inputs = make_batch(gen, reference.config)
    micro_batches = [{name: tensor[row:row + 1] for name, tensor in inputs.items()}
                     for row in range(BATCH)]
    num_items_in_batch = (inputs["labels"][:, 1:] != -100).sum()

    # The mean over one big batch, without num_items_in_batch.
    with torch.no_grad():
        try:
            expected_mean = reference(**inputs)
        except Exception as error:
            # Another transformers version's own forward may fail on the tiny config.
            if transformers.__version__ == table_version():
                raise
            pytest.skip(f"the unpatched model fails with transformers "
                        f"{transformers.__version__}: {error!r}")
        mean = model(**inputs)
    assert relative_error(mean.loss, expected_mean.loss) <= LOSS_TOLERANCE
    if getattr(expected_mean, "aux_loss", None) is not None:
        assert relative_error(mean.aux_loss, expected_mean.aux_loss) <= LOSS_TOLERANCE
    # Gradient accumulation: two micro-batches with num_items_in_batch.
    loss = expected = 0.0
    for micro_batch in micro_batches:
        output = model(**micro_batch, num_items_in_batch=num_items_in_batch)
        assert output.logits is None
        output.loss.backward()
        loss += output.loss.detach()
        reference_loss = reference(**micro_batch, num_items_in_batch=num_items_in_batch).loss
        reference_loss.backward()
        expected += reference_loss.detach()
    assert relative_error(loss, expected) <= LOSS_TOLERANCE
    # Which is one big batch, where the model's own loss is (it takes num_items_in_batch, and
    # its router loss, if any, is off).
    if (not getattr(reference.config, "output_router_logits", False)
            and relative_error(expected, expected_mean.loss) <= LOSS_TOLERANCE):
        assert relative_error(loss, expected_mean.loss) <= LOSS_TOLERANCE
    assert_same_gradients(model, reference, GRADIENT_TOLERANCE)
    assert not head_calls, "the patched model computed logits"


def table() -> str:
    lines = [
        "# Models that `cce.integrations.transformers.patch` trains exactly",
        "",
        f"Generated by tests/test_model_coverage.py with transformers {transformers.__version__}"
        f" (`CCE_WRITE_MODEL_TABLE=1 python -m pytest tests/test_model_coverage.py`); the test",
        "fails when this table is not what it finds. Every model type of transformers'",
        "causal-LM and image-text-to-text mappings is built tiny from its config (float32, CPU).",
        "*exact*: the patched model's loss and every parameter's gradient match the unpatched",
        "model's (relative error 1e-5 and 1e-4), with ignored labels, gradient accumulation",
        "(`num_items_in_batch`) and, for mixtures of experts, their router loss (models that",
        "need images: loss and gradients of one batch with them, in the test named).",
        "*refused*: `patch` raises a `ValueError` with the reason given. *not tested*: the",
        "tiny model cannot be built or run here, for the reason given.",
        "",
    ]
    statuses = {row: status(*row) for row in rows()}
    counts = {kind: sum(found.startswith(kind) for found in statuses.values())
              for kind in ("exact", "refused", "not tested")}
    lines += [", ".join(f"{count} {kind}" for kind, count in counts.items()) + ".", "",
              "| model type | class | status |", "|---|---|---|"]
    for (model_type, class_name), found in sorted(statuses.items()):
        found = found.replace("|", "\\|")
        lines.append(f"| {model_type} | {class_name} | {found} |")
    return "\n".join(lines) + "\n"


def test_the_support_table_is_what_this_file_finds() -> None:
    if os.environ.get("CCE_WRITE_MODEL_TABLE"):
        TABLE.write_text(table())
        return
    if table_version() != transformers.__version__:
        pytest.skip(f"{TABLE.name} was written with another transformers version")
    committed, found = TABLE.read_text(), table()
    assert committed == found, (f"{TABLE} is stale: regenerate it with "
                                f"CCE_WRITE_MODEL_TABLE=1 python -m pytest {Path(__file__).name}")
