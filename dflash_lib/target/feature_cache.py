"""The target's features per sample, kept in host memory after their first forward (`pipeline.target_cache_gib`).

The target is frozen, so a sample's context features (and, for loss kl, its final-normed states) are the same
every epoch: a target worker whose batch is all cached assembles them from here instead of running the target.
Worth it when the corpus is read for many epochs and its features fit in memory (the demo: a few hundred short
answers x 1728 features in bf16, a fraction of a GiB); a real corpus (800 K samples x 3 x 4096 features per
token) does not: 0 = off.
Equal to a fresh forward up to the forward's batch invariance (the same sample in another batch).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch

from dflash_lib.data.batch import Batch


@dataclass
class CacheStats:
    """What a `FeatureCache` did: batches served from it, and what it holds."""

    hit_batches: int = 0  # batches whose features came from the cache (no target forward)
    miss_batches: int = 0  # batches the target ran (a sample not cached)
    samples: int = 0  # samples held
    bytes: int = 0  # host bytes held
    refused: int = 0  # samples not stored: the budget was full


class FeatureCache:
    """Per-sample target features in host memory, at most `budget_bytes`; shared by the target workers (a lock)."""

    def __init__(self, budget_bytes: int) -> None:
        self.budget_bytes = int(budget_bytes)
        self.stats = CacheStats()
        self._feats: dict[int, torch.Tensor] = {}  # sample index -> (T, F*H)
        self._final: dict[int, torch.Tensor] = {}  # sample index -> (T, H): the final-normed states (loss kl)
        self._lock = threading.Lock()

    def lookup(self, batch: Batch, need_final: bool) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """The batch's features (N, F*H) over its real tokens in row-major order (and the final-normed states
        (N, H) when `need_final`), host tensors; None (a miss, counted) unless every sample is cached."""
        with self._lock:
            idx = [int(i) for i in batch.indices]
            if not idx or any(i not in self._feats or (need_final and i not in self._final) for i in idx):
                self.stats.miss_batches += 1
                return None
            self.stats.hit_batches += 1
            feats = torch.cat([self._feats[i] for i in idx])
            return feats, torch.cat([self._final[i] for i in idx]) if need_final else None

    def store(self, batch: Batch, feats: torch.Tensor, final: torch.Tensor | None) -> None:
        """Keep each sample's rows of `feats` (N, F*H) (and `final` (N, H)) over the batch's real tokens in
        row-major order, where `batch.cu_seqlens` cuts them; copied to host memory. A sample already held is
        kept; one that would pass the budget is not stored (`stats.refused`)."""
        cu = batch.cu_seqlens.tolist()
        with self._lock:
            for d, i in enumerate(int(i) for i in batch.indices):
                if i in self._feats:  # a run's loss is fixed: its samples are stored with a final or all without
                    continue
                parts = [feats[cu[d]:cu[d + 1]]] + ([] if final is None else [final[cu[d]:cu[d + 1]]])
                size = sum(p.numel() * p.element_size() for p in parts)
                if self.stats.bytes + size > self.budget_bytes:
                    self.stats.refused += 1
                    continue
                self._feats[i] = parts[0].to("cpu", copy=True)
                if final is not None:
                    self._final[i] = parts[1].to("cpu", copy=True)
                self.stats.samples, self.stats.bytes = len(self._feats), self.stats.bytes + size


def real_slots(batch: Batch) -> torch.Tensor:
    """(R*T,) bool host mask of the batch's real (document) slots in row-major order."""
    return batch.doc_ids.reshape(-1).cpu() >= 0


def context_rows(batch: Batch, runs_padding: bool) -> torch.Tensor:
    """(N,) int64: the context entry of each real token (`TargetModel.context_features`' C: the real tokens, or
    every slot when the padding ran through the layers)."""
    return real_slots(batch).nonzero().squeeze(1) if runs_padding else torch.arange(batch.real_tokens)


def to_real(rows: torch.Tensor, batch: Batch, runs_padding: bool) -> torch.Tensor:
    """Context entries `rows` (u,) (real ones) -> their places (u,) among the real tokens (host int64)."""
    rows = rows.cpu()
    return (real_slots(batch).cumsum(0) - 1)[rows] if runs_padding else rows


def as_context(real: torch.Tensor, batch: Batch, runs_padding: bool) -> torch.Tensor:
    """Features over the real tokens (N, F) -> the context (C, F): the same, or every slot (zero on padding)."""
    if not runs_padding:
        return real
    out = real.new_zeros(batch.padded_tokens, real.shape[1])
    out[real_slots(batch).to(real.device)] = real
    return out
