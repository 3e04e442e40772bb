"""The tiny Qwen3 target and DFlash drafter (random weights, built locally in well under a second) that the
attention and drafter-reference tests share."""

from __future__ import annotations

from typing import Any

import torch

from dflash_lib.models import DFlashDrafter, DrafterConfig, TargetModel, tiny_qwen3_config

VOCAB, MASK, HIDDEN, BLOCK = 300, 299, 32, 4  # vocabulary, MASK id (its last row), hidden size, block size (tokens)


def tiny_target(num_layers: int = 6, num_features: int = 2) -> TargetModel:
    """A random `num_layers`-layer Qwen3 of hidden size HIDDEN whose `num_features` layers feed the drafter."""
    return TargetModel.from_hf_config(tiny_qwen3_config(hidden_size=HIDDEN, num_layers=num_layers, vocab_size=VOCAB),
                                      num_features, seed=0)


def tiny_drafter(target: TargetModel, attention: str = "dense", **overrides: Any) -> DFlashDrafter:
    """A 2-layer drafter (4 query / 2 KV heads of 8) on `target`, blocks of BLOCK, 64 anchors; `overrides` replace
    DrafterConfig fields. Seeded: the same weights every call."""
    fields = dict(hidden_size=HIDDEN, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, intermediate_size=64,
                  vocab_size=VOCAB, target_layer_ids=target.layer_ids, target_num_layers=target.num_layers,
                  block_size=BLOCK, mask_id=MASK, num_anchors=64)
    torch.manual_seed(0)
    return DFlashDrafter(DrafterConfig(**(fields | overrides)), target, attention=attention)
