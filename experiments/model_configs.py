"""Architectures of the 15 models of the paper's Fig. 1 / Table A3, written in as data.

The values are transcribed from the models' published Hugging Face ``config.json`` files
(``vocab_size``, ``hidden_size``, ``num_hidden_layers``, ``intermediate_size``,
``num_attention_heads``, ``num_key_value_heads``, ``head_dim``, ``tie_word_embeddings``,
``max_position_embeddings``) and from their published parameter counts, so that the memory
model needs no network and no download. Structural flags (norm type, biases, gated MLP) follow
each model's published architecture (its modeling code in ``transformers``).

``tokenizer_len`` is ``len(tokenizer)`` of the published tokenizer. It differs from
``vocab_size`` where the embedding matrix was padded (Phi 1.5, Phi 3, Qwen 1.5); the paper's
log-probability column matches ``tokenizer_len`` rather than ``vocab_size`` for those models,
so :mod:`experiments.fig1_memory` reports that convention as a variant.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional


@dataclass(frozen=True)
class ModelConfig:
    name: str  # as the paper's Table A3 spells it
    hf_id: str
    vocab_size: int  # rows of the embedding, i.e. the width of the lm_head's logits
    tokenizer_len: int
    hidden_size: int
    num_layers: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    published_params: int
    head_dim: Optional[int] = None  # None: hidden_size // num_heads
    tied_embeddings: bool = False
    learned_positions: int = 0  # rows of a learned position embedding (0: rotary)
    norm: Literal["rms", "layer"] = "rms"  # RMSNorm has a weight, LayerNorm weight and bias
    norms_per_layer: int = 2
    gated_mlp: bool = True  # SwiGLU/GeGLU: gate, up and down projections
    qkv_bias: bool = False
    out_bias: bool = False
    mlp_bias: bool = False
    lm_head_bias: bool = False
    num_experts: int = 1  # Mixtral: every expert's MLP, plus a router, in every layer

    @property
    def attention_head_dim(self) -> int:
        return self.head_dim or self.hidden_size // self.num_heads


def _gpt2_style(**values) -> dict:
    # GPT-2, GPT-Neo and Phi 1.5: LayerNorm, biased non-gated MLP (fc, proj).
    return dict(norm="layer", gated_mlp=False, mlp_bias=True, out_bias=True) | values


# In the order of the paper's Table A3.
MODELS: tuple[ModelConfig, ...] = (
    ModelConfig("GPT 2", "openai-community/gpt2", 50257, 50257, 768, 12, 3072, 12, 12,
                124_439_808, tied_embeddings=True,
                **_gpt2_style(learned_positions=1024, qkv_bias=True)),
    ModelConfig("GPT Neo (1.3B)", "EleutherAI/gpt-neo-1.3B", 50257, 50257, 2048, 24, 8192, 16,
                16, 1_315_575_808, tied_embeddings=True, **_gpt2_style(learned_positions=2048)),
    ModelConfig("GPT Neo (2.7B)", "EleutherAI/gpt-neo-2.7B", 50257, 50257, 2560, 32, 10240, 20,
                20, 2_651_307_520, tied_embeddings=True, **_gpt2_style(learned_positions=2048)),
    ModelConfig("Gemma (2B)", "google/gemma-2b", 256000, 256000, 2048, 18, 16384, 8, 1,
                2_506_172_416, head_dim=256, tied_embeddings=True),
    # Gemma 2 adds a post-attention and a post-MLP RMSNorm: four per layer.
    ModelConfig("Gemma 2 (27B)", "google/gemma-2-27b", 256000, 256000, 4608, 46, 36864, 32, 16,
                27_227_128_320, head_dim=128, tied_embeddings=True, norms_per_layer=4),
    ModelConfig("Gemma 2 (2B)", "google/gemma-2-2b", 256000, 256000, 2304, 26, 9216, 8, 4,
                2_614_341_888, head_dim=256, tied_embeddings=True, norms_per_layer=4),
    ModelConfig("Llama 2 (13B)", "meta-llama/Llama-2-13b-hf", 32000, 32000, 5120, 40, 13824, 40,
                40, 13_015_864_320),
    ModelConfig("Llama 2 (7B)", "meta-llama/Llama-2-7b-hf", 32000, 32000, 4096, 32, 11008, 32,
                32, 6_738_415_616),
    ModelConfig("Llama 3 (70B)", "meta-llama/Meta-Llama-3-70B", 128256, 128256, 8192, 80, 28672,
                64, 8, 70_553_706_496),
    ModelConfig("Llama 3 (8B)", "meta-llama/Meta-Llama-3-8B", 128256, 128256, 4096, 32, 14336,
                32, 8, 8_030_261_248),
    ModelConfig("Mistral 7B", "mistralai/Mistral-7B-v0.1", 32000, 32000, 4096, 32, 14336, 32, 8,
                7_241_732_096),
    ModelConfig("Mixtral 8x7B", "mistralai/Mixtral-8x7B-v0.1", 32000, 32000, 4096, 32, 14336,
                32, 8, 46_702_792_704, num_experts=8),
    # Phi 1.5: attention and MLP in parallel after a single LayerNorm; biased lm_head.
    ModelConfig("Phi 1.5", "microsoft/phi-1_5", 51200, 50295, 2048, 24, 8192, 32, 32,
                1_418_270_720, norms_per_layer=1, lm_head_bias=True,
                **_gpt2_style(qkv_bias=True)),
    ModelConfig("Phi 3 Medium", "microsoft/Phi-3-medium-4k-instruct", 32064, 32011, 5120, 40,
                17920, 40, 10, 13_960_238_080),
    ModelConfig("Qwen 1.5 (7B)", "Qwen/Qwen1.5-7B", 151936, 151646, 4096, 32, 11008, 32, 32,
                7_721_324_544, qkv_bias=True),
)
