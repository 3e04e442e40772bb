"""What a drafter shares with its frozen target and reads of its shapes (`TargetParts`): the embedding and LM head
(frozen, never the drafter's parameters), the transformers config, the feature layers and the device. Every source
of the target's features answers it: `target.protocol.FeatureSource` extends it with the features themselves, so a
drafter (`models.drafter`) and its serving folder (`models.export`) take any source without importing target/.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import torch


@runtime_checkable
class TargetParts(Protocol):
    """The target's shared modules and shapes. Shapes: F feature layers, H the target's width, V its vocabulary."""

    hf: Any  # the target's transformers config (its config.json as transformers reads it)
    layer_ids: list[int]  # the F feature layers (0-based), in concatenation order
    num_features: int  # F
    num_layers: int  # the target's decoder layers
    hidden_size: int  # H
    vocab_size: int  # V
    gather: bool  # True: the context is the real tokens only; False: every slot (zero on padding)
    embed_tokens: torch.nn.Embedding  # (V, H), frozen, shared with the drafter
    lm_head: torch.nn.Linear  # (V, H), frozen, shared with the drafter

    @property
    def device(self) -> torch.device:
        """Where the features come out (and the drafter is built)."""
        ...
