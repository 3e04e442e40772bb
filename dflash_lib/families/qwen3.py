"""Qwen3 and Qwen3-MoE: their published shapes (each the model's config.json on the Hugging Face Hub, the model card
named beside it; only the fields that shape the weights and the forward, the rest transformers' defaults: dropout
0, no attention bias, SiLU) and the paper's recipe as presets (docs/dflash.md, "The paper's recipe")."""

from __future__ import annotations

from typing import Any

from dflash_lib.families.family import TargetFamily

QWEN3_VOCAB = 151936  # Qwen3 embedding rows (the tokenizer's ids and the reserved MASK fit)
QWEN3_MASK = 151669  # the drafter's MASK: an unused padded embedding row of Qwen3 (ModelConfig.mask_id's default)
_COMMON = dict(vocab_size=QWEN3_VOCAB, head_dim=128, max_position_embeddings=40960, rope_theta=1_000_000.0,
               rms_norm_eps=1e-6, tie_word_embeddings=False)
_MOE = dict(num_experts=128, num_experts_per_tok=8, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[])

SHAPES: dict[str, dict[str, Any]] = {
    # Qwen/Qwen3-8B: 36 layers, hidden 4096, 32 query / 8 key-value heads, MLP 12288
    "qwen3-8b": dict(model_type="qwen3", hidden_size=4096, num_hidden_layers=36, num_attention_heads=32,
                     num_key_value_heads=8, intermediate_size=12288, **_COMMON),
    # Qwen/Qwen3-32B: 64 layers, hidden 5120, 64 query / 8 key-value heads (head_dim 128, so the attention is 8192
    # wide, not hidden_size), MLP 25600
    "qwen3-32b": dict(model_type="qwen3", hidden_size=5120, num_hidden_layers=64, num_attention_heads=64,
                      num_key_value_heads=8, intermediate_size=25600, **_COMMON),
}
MOE_SHAPES: dict[str, dict[str, Any]] = {
    # Qwen/Qwen3-30B-A3B: 48 MoE layers (decoder_sparse_step 1, no mlp_only_layers), hidden 2048, 32 query / 4
    # key-value heads, 128 experts of width 768 (moe_intermediate_size), 8 routed per token (norm_topk_prob);
    # intermediate_size 6144 is the dense MLP width its config also lists (unused by its layers)
    "qwen3-30b-a3b": dict(model_type="qwen3_moe", hidden_size=2048, num_hidden_layers=48, num_attention_heads=32,
                          num_key_value_heads=4, intermediate_size=6144, moe_intermediate_size=768, **_MOE, **_COMMON),
    # Qwen/Qwen3-235B-A22B: 94 MoE layers, hidden 4096, 64 query / 4 key-value heads, 128 experts of width 1536, 8
    # routed per token; intermediate_size 12288 as its config lists (unused by its layers)
    "qwen3-235b-a22b": dict(model_type="qwen3_moe", hidden_size=4096, num_hidden_layers=94, num_attention_heads=64,
                            num_key_value_heads=4, intermediate_size=12288, moe_intermediate_size=1536, **_MOE,
                            **_COMMON),
}


def qwen3_8b() -> dict[str, Any]:
    """The paper recipe (docs/dflash.md "The paper's recipe") for a Qwen3-8B target: a 5-layer drafter, block 16,
    512 anchors, max_len 3072, the features of layers [1, 9, 17, 25, 33], AdamW 6e-4, warmup 4 %, clip 1.0, 6
    epochs; on CUDA FlexAttention, activation checkpointing, bf16 target and autocast. `target` names the Qwen3-8B
    SHAPES only (the dry run needs no weights); training needs the model: `-p target DIR` (a local Hugging Face
    folder).

    token_budget 16384: 5 documents of 3072 tokens, so the derived block budget (sampler.resolve_block_budget) is
    5 x 512 x 16 = 40960 drafter queries per micro-batch, and every bucket's worst batch fits 80 GiB on the flex
    path with its reserve, with room for the dense reference path (`python -m dflash_lib dryrun`; its table in
    docs/scale.md). ce_chunk_blocks 64 (1024 scored positions, a 0.6 GiB fp32 logits chunk per LM-head call): the
    step's peak is in a drafter layer's backward, not in the head, so a larger chunk (fewer, larger matmuls) is
    free until the head's chunk becomes the peak (the dry run's figures: docs/scale.md)."""
    return dict(
        target="qwen3-8b", drafter_layers=5, block_size=16, num_anchors=512, max_len=3072, num_features=5,
        target_layer_ids=[1, 9, 17, 25, 33], mask_id=QWEN3_MASK, lr=6e-4, warmup_ratio=0.04, grad_clip=1.0,
        epochs=6.0, full_run_epochs=6.0, drafter_attention="auto", drafter_checkpointing="auto", token_budget=16384,
        ce_chunk_blocks=64,
    )


def paper_recipe_for(target: str, target_layer_ids: list[int]) -> dict[str, Any]:
    """`qwen3_8b`'s recipe (drafter, anchors, block, max_len, optimiser, token budget) for the target whose
    published shapes `target` names, with its five feature layers: the layer-id rule
    (`models.target_config.feature_layer_ids`) for its depth, written out because the settings import no model code
    (tests/test_dryrun.py checks them against the rule). The drafter's width follows the target
    (`models.drafter.drafter_shape`: dense, also for a mixture-of-experts target)."""
    return {**qwen3_8b(), "target": target, "target_layer_ids": target_layer_ids}


def qwen3_32b() -> dict[str, Any]:
    """The paper recipe (`qwen3_8b`) for Qwen3-32B's shapes (64 layers, hidden 5120): features of layers
    [1, 16, 31, 46, 61]."""
    return paper_recipe_for("qwen3-32b", [1, 16, 31, 46, 61])


def qwen3_30b_a3b() -> dict[str, Any]:
    """The paper recipe (`qwen3_8b`) for Qwen3-30B-A3B's shapes (48 MoE layers, hidden 2048): features of layers
    [1, 12, 23, 34, 45]; a dense drafter of the target's width."""
    return paper_recipe_for("qwen3-30b-a3b", [1, 12, 23, 34, 45])


def qwen3_235b_a22b() -> dict[str, Any]:
    """The paper recipe (`qwen3_8b`) for Qwen3-235B-A22B's shapes (94 MoE layers, hidden 4096): features of
    layers [1, 24, 46, 68, 91]; a dense drafter of the target's width. Its bf16 weights (~438 GiB) fit no single
    GPU: `-p target_parallel fsdp` over the ranks (the dry run's `--world-size`)."""
    return paper_recipe_for("qwen3-235b-a22b", [1, 24, 46, 68, 91])


QWEN3 = TargetFamily("qwen3", ("qwen3",), shapes=SHAPES, presets={"qwen3-8b": qwen3_8b, "qwen3-32b": qwen3_32b})
QWEN3_MOE = TargetFamily("qwen3_moe", ("qwen3_moe",), shapes=MOE_SHAPES,
                         presets={"qwen3-30b-a3b": qwen3_30b_a3b, "qwen3-235b-a22b": qwen3_235b_a22b})
