"""DFlash models: the frozen target wrapper, the block drafter, its attention, anchors, loss and acceptance length.

Modules: `target` (TargetModel, tiny_qwen3_config, the feature-layer rule), `masks` (where a batch's real tokens and
documents are), `anchors` (sampling, decay weights), `layout` (the host-built flat layout of a micro-batch's drafter
work), `attention` (dense / blocks / flex backends), `layers` (draft decoder layers with KV injection), `loss`
(chunked LM head + CE, DrafterLoss), `drafter` (DrafterConfig, DFlashDrafter), `drafters` (the drafter kinds, each
its module and serving format: `drafter_kind`), `export` (the serving folder: `export_drafter`, `read_drafter`,
`init_from`), `acceptance` (speculative decoding loop, tau), `sampling`
(temperature, nucleus and the speculative-sampling accept/resample rule).
"""

from dflash_lib.models.acceptance import AcceptanceResult, acceptance_length
from dflash_lib.models.anchors import Anchors, decay_weights, default_gamma, sample_anchors
from dflash_lib.models.drafter import DFlashDrafter, DrafterConfig
from dflash_lib.models.layout import DraftLayout, build_layout
from dflash_lib.models.loss import DrafterLoss, expected_acceptance, head_cross_entropy
from dflash_lib.models.masks import RealTokens, real_tokens, segment_cu_seqlens
from dflash_lib.models.target import TargetModel, TargetStep, feature_layer_ids, resolve_backend, tiny_qwen3_config

__all__ = [
    "AcceptanceResult", "Anchors", "DFlashDrafter", "DrafterConfig", "DrafterLoss", "TargetModel", "TargetStep",
    "DraftLayout", "acceptance_length", "build_layout", "decay_weights", "default_gamma", "expected_acceptance",
    "feature_layer_ids", "head_cross_entropy", "resolve_backend", "sample_anchors", "segment_cu_seqlens",
    "RealTokens", "real_tokens", "tiny_qwen3_config",
]
