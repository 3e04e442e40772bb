"""Published model shapes, no weights: the Hugging Face configs the dry run and the plan build when no model
folder is at hand. Each value is the model's published config.json on the Hugging Face Hub (the model card named
in each function); only the fields that shape the weights and the forward are set, the rest are transformers'
defaults (dropout 0, no attention bias, SiLU)."""

from __future__ import annotations

from typing import Callable

import transformers

QWEN3_VOCAB = 151936  # Qwen3 embedding rows (the tokenizer's ids and the reserved MASK 151669 fit)
_QWEN3_COMMON = dict(vocab_size=QWEN3_VOCAB, head_dim=128, max_position_embeddings=40960, rope_theta=1_000_000.0,
                     rms_norm_eps=1e-6, tie_word_embeddings=False, attn_implementation="sdpa")


def qwen3_8b_config() -> transformers.Qwen3Config:
    """Qwen/Qwen3-8B: 36 layers, hidden 4096, 32 query / 8 key-value heads, MLP 12288."""
    return transformers.Qwen3Config(hidden_size=4096, num_hidden_layers=36, num_attention_heads=32,
                                    num_key_value_heads=8, intermediate_size=12288, **_QWEN3_COMMON)


def qwen3_32b_config() -> transformers.Qwen3Config:
    """Qwen/Qwen3-32B: 64 layers, hidden 5120, 64 query / 8 key-value heads (head_dim 128, so the attention is
    8192 wide, not hidden_size), MLP 25600."""
    return transformers.Qwen3Config(hidden_size=5120, num_hidden_layers=64, num_attention_heads=64,
                                    num_key_value_heads=8, intermediate_size=25600, **_QWEN3_COMMON)


def qwen3_30b_a3b_config() -> transformers.Qwen3MoeConfig:
    """Qwen/Qwen3-30B-A3B: 48 MoE layers (decoder_sparse_step 1, no mlp_only_layers), hidden 2048, 32 query / 4
    key-value heads, 128 experts of width 768 (moe_intermediate_size), 8 routed per token (norm_topk_prob);
    intermediate_size 6144 is the dense MLP width its config also lists (unused by its layers)."""
    return transformers.Qwen3MoeConfig(hidden_size=2048, num_hidden_layers=48, num_attention_heads=32,
                                       num_key_value_heads=4, intermediate_size=6144, moe_intermediate_size=768,
                                       num_experts=128, num_experts_per_tok=8, norm_topk_prob=True,
                                       decoder_sparse_step=1, mlp_only_layers=[], **_QWEN3_COMMON)


def qwen3_235b_a22b_config() -> transformers.Qwen3MoeConfig:
    """Qwen/Qwen3-235B-A22B: 94 MoE layers, hidden 4096, 64 query / 4 key-value heads, 128 experts of width 1536,
    8 routed per token; intermediate_size 12288 as its config lists (unused by its layers)."""
    return transformers.Qwen3MoeConfig(hidden_size=4096, num_hidden_layers=94, num_attention_heads=64,
                                       num_key_value_heads=4, intermediate_size=12288, moe_intermediate_size=1536,
                                       num_experts=128, num_experts_per_tok=8, norm_topk_prob=True,
                                       decoder_sparse_step=1, mlp_only_layers=[], **_QWEN3_COMMON)


NAMED_SHAPES: dict[str, Callable[[], transformers.PretrainedConfig]] = {  # `target` values naming shapes only
    "qwen3-8b": qwen3_8b_config, "qwen3-32b": qwen3_32b_config, "qwen3-30b-a3b": qwen3_30b_a3b_config,
    "qwen3-235b-a22b": qwen3_235b_a22b_config,
}
