"""DFlash models: the block drafter, its attention, anchors and loss, and what it reads of the frozen target.

Modules: `target_config` (the target's config without weights: tiny_qwen3_config, the feature-layer rule),
`target_parts` (what a drafter shares with its target: `TargetParts`), `masks` (where a batch's real tokens and
documents are), `anchors` (sampling, decay weights), `layout` (the host-built flat layout of a micro-batch's drafter
work), `attention` (dense / blocks / flex backends), `causality` (which layers vLLM runs causal, read from and
written to config.json), `layers` (draft decoder layers with KV injection), `loss` (chunked LM head + CE,
DrafterLoss), `drafter` (DrafterConfig, DFlashDrafter), `drafters` (the drafter kinds, each its module and serving
format: `drafter_kind`), `export` (the serving folder: `export_drafter`, `read_drafter`, `init_from`), `sampling`
(temperature, nucleus and the speculative-sampling accept/resample rule). The target itself:
`target.local.TargetModel`; speculative decoding with it: `evaluate.acceptance`.
"""

from dflash_lib.models.anchors import Anchors, decay_weights, default_gamma, sample_anchors
from dflash_lib.models.drafter import DFlashDrafter, DrafterConfig
from dflash_lib.models.layout import DraftLayout, build_layout
from dflash_lib.models.loss import DrafterLoss, expected_acceptance, head_cross_entropy
from dflash_lib.models.masks import RealTokens, real_tokens, segment_cu_seqlens
from dflash_lib.models.target_config import feature_layer_ids, tiny_qwen3_config
from dflash_lib.models.target_parts import TargetParts

__all__ = [
    "Anchors", "DFlashDrafter", "DrafterConfig", "DrafterLoss", "DraftLayout", "TargetParts", "build_layout",
    "decay_weights", "default_gamma", "expected_acceptance", "feature_layer_ids", "head_cross_entropy",
    "sample_anchors", "segment_cu_seqlens", "RealTokens", "real_tokens", "tiny_qwen3_config",
]
