"""The one interface every source of the target's features answers (`FeatureSource`): the local model
(`target.local.TargetModel`), the sharded one (`target.sharded.ShardedTarget`), the served one
(`target.served.ServedTarget`, which also reads the captured cache `target.cached.CapturedFeatures`). The
in-memory cache (`target.feature_cache.FeatureCache`) stands in front of any of them in the feed. `target.open`
picks the source.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

from dflash_lib.data.batch import Batch
from dflash_lib.models.masks import RealTokens
from dflash_lib.models.target_parts import TargetParts


@runtime_checkable
class FeatureSource(TargetParts, Protocol):
    """What the trainer reads of its frozen target: the drafter's context features of a batch, the final-normed
    states where the source has them, and what the drafter shares with it (`TargetParts`: the embedding and LM
    head, the config, the feature layers, the device).

    Shapes: C context entries (the batch's real tokens in row-major order, or every slot when the padding ran),
    F feature layers, H the target's width, u the rows a loss reading the target's distribution asks for."""

    def segments(self, host_doc_ids: torch.Tensor) -> RealTokens:
        """The sequence a pass runs and its documents, from a batch's HOST doc_ids (R, T)."""
        ...

    def context_features(self, batch: Batch, segments: RealTokens | None = None) -> torch.Tensor:
        """(C, F*H) features of the batch's context, on `device`."""
        ...

    def context_features_and_final(self, batch: Batch, rows: torch.Tensor,
                                   segments: RealTokens | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """((C, F*H), (u, H)): the features and the final-normed last states at context entries `rows` (u,);
        ConfigError in one line from a source that does not have them."""
        ...

    def close(self) -> None:
        """Release what the source holds outside the process's memory (an engine's client); idempotent."""
        ...
