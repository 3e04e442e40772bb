"""DFlash models: the frozen target wrapper, the block drafter, its masks, anchors, loss and acceptance length.

Modules: `target` (TargetModel, tiny_qwen3_config, the feature-layer rule), `masks` (one mask builder for
padded and packed layouts), `anchors` (sampling, decay weights), `layers` (draft decoder layers with KV
injection), `loss` (chunked LM head + CE, DrafterLoss), `drafter` (DrafterConfig, DFlashDrafter, save/load),
`acceptance` (speculative decoding loop, tau).
"""

from dflash_lib.models.acceptance import AcceptanceResult, acceptance_length
from dflash_lib.models.anchors import Anchors, decay_weights, default_gamma, sample_anchors
from dflash_lib.models.drafter import DFlashDrafter, DrafterConfig
from dflash_lib.models.loss import DrafterLoss, expected_acceptance, head_cross_entropy
from dflash_lib.models.masks import document_segments, drafter_attention_mask, segment_cu_seqlens
from dflash_lib.models.target import TargetModel, TargetStep, feature_layer_ids, resolve_backend, tiny_qwen3_config

__all__ = [
    "AcceptanceResult", "Anchors", "DFlashDrafter", "DrafterConfig", "DrafterLoss", "TargetModel", "TargetStep",
    "acceptance_length", "decay_weights", "default_gamma", "drafter_attention_mask", "expected_acceptance",
    "feature_layer_ids", "head_cross_entropy", "resolve_backend", "sample_anchors", "segment_cu_seqlens",
    "document_segments", "tiny_qwen3_config",
]
