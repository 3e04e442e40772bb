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


# Qwen3.5 / Qwen3.6 (hybrid: three gated-delta-net layers, then a gated full-attention layer, repeated), their text
# config (the published folders are vision-language wrappers: `text_config`). Shared by the four: heads of 256 over
# a quarter of which the rotary runs (theta 1e7), linear key / value heads of 128, a causal conv of 4, the 248,320-row
# vocabulary, 262,144 positions, untied. Sources (the Hub's own config.json was not reachable from here; each value
# agrees in several copies): the model cards, copies of each text_config (unsloth/Qwen3.5-9B,
# Intel/Qwen3.6-27B-int4-mlx-AutoRound), transformers' Qwen3.5-MoE docs (35B-A3B) and engines' tests pinned to
# the official revisions; LOG.md (issue 39) lists them.
QWEN3_5_VOCAB = 248320
_QWEN3_5_COMMON = dict(vocab_size=QWEN3_5_VOCAB, head_dim=256, linear_key_head_dim=128, linear_value_head_dim=128,
                       linear_conv_kernel_dim=4, rope_theta=10_000_000.0, partial_rotary_factor=0.25,
                       max_position_embeddings=262144, rms_norm_eps=1e-6, tie_word_embeddings=False,
                       attn_implementation="sdpa")


def _hybrid_layers(n: int) -> list[str]:
    """Qwen3.5's layer kinds: linear, linear, linear, full, repeated over `n` layers (full_attention_interval 4)."""
    return ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(n)]


def qwen3_5_9b_config() -> transformers.PretrainedConfig:
    """Qwen/Qwen3.5-9B: 32 layers (24 gated delta net, 8 full attention), hidden 4096, 16 query / 4 key-value heads
    of 256, 16 linear key / 32 value heads of 128, MLP 12288."""
    return transformers.Qwen3_5TextConfig(hidden_size=4096, intermediate_size=12288, num_hidden_layers=32,
                                          num_attention_heads=16, num_key_value_heads=4, linear_num_key_heads=16,
                                          linear_num_value_heads=32, layer_types=_hybrid_layers(32), **_QWEN3_5_COMMON)


def qwen3_6_27b_config() -> transformers.PretrainedConfig:
    """Qwen/Qwen3.6-27B (the shapes of Qwen3.5-27B): 64 layers (48 gated delta net, 16 full attention), hidden 5120,
    24 query / 4 key-value heads of 256, 16 linear key / 48 value heads of 128, MLP 17408."""
    return transformers.Qwen3_5TextConfig(hidden_size=5120, intermediate_size=17408, num_hidden_layers=64,
                                          num_attention_heads=24, num_key_value_heads=4, linear_num_key_heads=16,
                                          linear_num_value_heads=48, layer_types=_hybrid_layers(64), **_QWEN3_5_COMMON)


def qwen3_5_35b_a3b_config() -> transformers.PretrainedConfig:
    """Qwen/Qwen3.5-35B-A3B: 40 MoE layers (30 gated delta net, 10 full attention), hidden 2048, 16 query / 2
    key-value heads of 256, 16 linear key / 32 value heads of 128, 256 experts of width 512, 8 routed per token plus
    a shared expert of 512."""
    return transformers.Qwen3_5MoeTextConfig(hidden_size=2048, num_hidden_layers=40, num_attention_heads=16,
                                             num_key_value_heads=2, linear_num_key_heads=16, linear_num_value_heads=32,
                                             moe_intermediate_size=512, shared_expert_intermediate_size=512,
                                             num_experts=256, num_experts_per_tok=8, layer_types=_hybrid_layers(40),
                                             **_QWEN3_5_COMMON)


def qwen3_5_122b_a10b_config() -> transformers.PretrainedConfig:
    """Qwen/Qwen3.5-122B-A10B: 48 MoE layers (36 gated delta net, 12 full attention), hidden 3072, 32 query / 2
    key-value heads of 256, 16 linear key / 64 value heads of 128, 256 experts of width 1024, 8 routed per token plus
    a shared expert of 1024."""
    return transformers.Qwen3_5MoeTextConfig(hidden_size=3072, num_hidden_layers=48, num_attention_heads=32,
                                             num_key_value_heads=2, linear_num_key_heads=16, linear_num_value_heads=64,
                                             moe_intermediate_size=1024, shared_expert_intermediate_size=1024,
                                             num_experts=256, num_experts_per_tok=8, layer_types=_hybrid_layers(48),
                                             **_QWEN3_5_COMMON)


NAMED_SHAPES: dict[str, Callable[[], transformers.PretrainedConfig]] = {  # `target` values naming shapes only
    "qwen3-8b": qwen3_8b_config, "qwen3-32b": qwen3_32b_config, "qwen3-30b-a3b": qwen3_30b_a3b_config,
    "qwen3-235b-a22b": qwen3_235b_a22b_config, "qwen3.5-9b": qwen3_5_9b_config, "qwen3.6-27b": qwen3_6_27b_config,
    "qwen3.5-35b-a3b": qwen3_5_35b_a3b_config, "qwen3.5-122b-a10b": qwen3_5_122b_a10b_config,
}
