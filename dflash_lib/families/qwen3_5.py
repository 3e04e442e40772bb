"""Qwen3.5 / Qwen3.6, dense and MoE: hybrids of three gated-delta-net layers, then a gated full-attention layer,
repeated. Their published shapes (the text config: the published folders are vision-language wrappers, whose
`text_config` the target reads) and the paper's recipe for them as presets.

Shared by the four: heads of 256 over a quarter of which the rotary runs (theta 1e7), linear key / value heads of
128, a causal conv of 4, the 248,320-row vocabulary, 262,144 positions, untied. Sources (the Hub's own config.json
was not reachable from here; each value agrees in several copies): the model cards, copies of each text_config
(unsloth/Qwen3.5-9B, Intel/Qwen3.6-27B-int4-mlx-AutoRound), transformers' Qwen3.5-MoE docs (35B-A3B) and engines'
tests pinned to the official revisions."""

from __future__ import annotations

from typing import Any

from dflash_lib.families.family import TargetFamily
from dflash_lib.families.qwen3 import paper_recipe_for

QWEN3_5_VOCAB = 248320
QWEN3_5_MASK = 248319  # the last of Qwen3.5's 248,320 embedding rows: the vocabulary is padded past the tokenizer's
# ids, so the model never produces it (the doctor checks the MASK against a real folder)
_COMMON = dict(vocab_size=QWEN3_5_VOCAB, head_dim=256, linear_key_head_dim=128, linear_value_head_dim=128,
               linear_conv_kernel_dim=4, rope_theta=10_000_000.0, partial_rotary_factor=0.25,
               max_position_embeddings=262144, rms_norm_eps=1e-6, tie_word_embeddings=False)


def hybrid_layers(n: int) -> list[str]:
    """Qwen3.5's layer kinds: linear, linear, linear, full, repeated over `n` layers (full_attention_interval 4)."""
    return ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(n)]


SHAPES: dict[str, dict[str, Any]] = {
    # Qwen/Qwen3.5-9B: 32 layers (24 gated delta net, 8 full attention), hidden 4096, 16 query / 4 key-value heads of
    # 256, 16 linear key / 32 value heads of 128, MLP 12288
    "qwen3.5-9b": dict(model_type="qwen3_5_text", hidden_size=4096, intermediate_size=12288, num_hidden_layers=32,
                       num_attention_heads=16, num_key_value_heads=4, linear_num_key_heads=16,
                       linear_num_value_heads=32, layer_types=hybrid_layers(32), **_COMMON),
    # Qwen/Qwen3.6-27B (the shapes of Qwen3.5-27B): 64 layers (48 gated delta net, 16 full attention), hidden 5120,
    # 24 query / 4 key-value heads of 256, 16 linear key / 48 value heads of 128, MLP 17408
    "qwen3.6-27b": dict(model_type="qwen3_5_text", hidden_size=5120, intermediate_size=17408, num_hidden_layers=64,
                        num_attention_heads=24, num_key_value_heads=4, linear_num_key_heads=16,
                        linear_num_value_heads=48, layer_types=hybrid_layers(64), **_COMMON),
}
MOE_SHAPES: dict[str, dict[str, Any]] = {
    # Qwen/Qwen3.5-35B-A3B: 40 MoE layers (30 gated delta net, 10 full attention), hidden 2048, 16 query / 2
    # key-value heads of 256, 16 linear key / 32 value heads of 128, 256 experts of width 512, 8 routed per token
    # plus a shared expert of 512
    "qwen3.5-35b-a3b": dict(model_type="qwen3_5_moe_text", hidden_size=2048, num_hidden_layers=40,
                            num_attention_heads=16, num_key_value_heads=2, linear_num_key_heads=16,
                            linear_num_value_heads=32, moe_intermediate_size=512, shared_expert_intermediate_size=512,
                            num_experts=256, num_experts_per_tok=8, layer_types=hybrid_layers(40), **_COMMON),
    # Qwen/Qwen3.5-122B-A10B: 48 MoE layers (36 gated delta net, 12 full attention), hidden 3072, 32 query / 2
    # key-value heads of 256, 16 linear key / 64 value heads of 128, 256 experts of width 1024, 8 routed per token
    # plus a shared expert of 1024
    "qwen3.5-122b-a10b": dict(model_type="qwen3_5_moe_text", hidden_size=3072, num_hidden_layers=48,
                              num_attention_heads=32, num_key_value_heads=2, linear_num_key_heads=16,
                              linear_num_value_heads=64, moe_intermediate_size=1024,
                              shared_expert_intermediate_size=1024, num_experts=256, num_experts_per_tok=8,
                              layer_types=hybrid_layers(48), **_COMMON),
}


def recipe_for(target: str, target_layer_ids: list[int]) -> dict[str, Any]:
    """The paper recipe (`qwen3.qwen3_8b`) for a Qwen3.5 / Qwen3.6 hybrid's published shapes: its five feature
    layers by the layer-id rule, the MASK an unused embedding row of its vocabulary."""
    return {**paper_recipe_for(target, target_layer_ids), "mask_id": QWEN3_5_MASK}


def qwen3_5_9b() -> dict[str, Any]:
    """The paper recipe for Qwen3.5-9B's shapes (32 layers, 24 of them gated delta net, hidden 4096): features of
    layers [1, 8, 15, 22, 29]."""
    return recipe_for("qwen3.5-9b", [1, 8, 15, 22, 29])


def qwen3_6_27b() -> dict[str, Any]:
    """The paper recipe for Qwen3.6-27B's shapes (64 layers, 48 gated delta net, hidden 5120): features of layers
    [1, 16, 31, 46, 61]."""
    return recipe_for("qwen3.6-27b", [1, 16, 31, 46, 61])


def qwen3_5_35b_a3b() -> dict[str, Any]:
    """The paper recipe for Qwen3.5-35B-A3B's shapes (40 MoE layers, 30 gated delta net, hidden 2048): features of
    layers [1, 10, 19, 28, 37]; a dense drafter of the target's width."""
    return recipe_for("qwen3.5-35b-a3b", [1, 10, 19, 28, 37])


def qwen3_5_122b_a10b() -> dict[str, Any]:
    """The paper recipe for Qwen3.5-122B-A10B's shapes (48 MoE layers, 36 gated delta net, hidden 3072): features
    of layers [1, 12, 23, 34, 45]; its bf16 weights (~230 GiB) fit no single GPU: `-p target_parallel fsdp`."""
    return recipe_for("qwen3.5-122b-a10b", [1, 12, 23, 34, 45])


QWEN3_5 = TargetFamily("qwen3_5", ("qwen3_5_text", "qwen3_5"), linear_attention=True, shapes=SHAPES,
                       presets={"qwen3.5-9b": qwen3_5_9b, "qwen3.6-27b": qwen3_6_27b})
QWEN3_5_MOE = TargetFamily("qwen3_5_moe", ("qwen3_5_moe_text", "qwen3_5_moe"), linear_attention=True,
                           shapes=MOE_SHAPES, presets={"qwen3.5-35b-a3b": qwen3_5_35b_a3b,
                                                       "qwen3.5-122b-a10b": qwen3_5_122b_a10b})
