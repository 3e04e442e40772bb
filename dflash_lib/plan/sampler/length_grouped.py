"""LengthGroupedSampler: Hugging Face transformers' `group_by_length` rule, implemented from its definition as a
comparison baseline. A random permutation is cut into megabatches of mega_batch_mult x batch_size samples;
each megabatch is sorted by length, longest first; the longest sample of all is swapped to the very front (so
an out-of-memory shows at step 0); the result is cut into FIXED-size batches. It pads little, but batch lengths
fall in a sawtooth inside each megabatch (high lag-1 correlation) and the budget is not respected."""

from __future__ import annotations

from typing import Any

import numpy as np

from dflash_lib.plan.sampler.base import EpochBatchSampler, EpochPlan, shard_in_order
from dflash_lib.plan.sampler.budget import SamplerError


class LengthGroupedSampler(EpochBatchSampler):
    """Megabatch length grouping with fixed batch_size; mega_batch_mult=None applies HF's default
    min(N // (4 * batch_size), 50), at least 1."""

    def __init__(self, lengths: Any, batch_size: int, seed: int = 0, *, rank: int = 0, world_size: int = 1,
                 mega_batch_mult: int | None = None) -> None:
        super().__init__(lengths, seed=seed, rank=rank, world_size=world_size)
        if not (isinstance(batch_size, (int, np.integer)) and batch_size >= 1):
            raise SamplerError(f"batch_size must be an int >= 1, got {batch_size!r}")
        if mega_batch_mult is None:
            mega_batch_mult = max(1, min(len(self.lengths) // (batch_size * 4), 50))
        if not (isinstance(mega_batch_mult, (int, np.integer)) and mega_batch_mult >= 1):
            raise SamplerError(f"mega_batch_mult must be an int >= 1 or None, got {mega_batch_mult!r}")
        self.batch_size, self.mega_batch_mult = int(batch_size), int(mega_batch_mult)

    def _settings(self) -> dict[str, Any]:
        return {"batch_size": self.batch_size, "mega_batch_mult": self.mega_batch_mult}

    def _plan(self, epoch: int, rng: np.random.Generator) -> EpochPlan:
        n = len(self.lengths)
        perm = rng.permutation(n)
        mega = np.arange(n) // (self.mega_batch_mult * self.batch_size)  # (N,) megabatch of each position
        order = perm[np.lexsort((-self.lengths[perm], mega))]  # each megabatch longest first
        starts = np.arange(0, n, self.mega_batch_mult * self.batch_size)  # (G,) first position of each megabatch
        longest = starts[int(np.argmax(self.lengths[order[starts]]))]
        order[[0, longest]] = order[[longest, 0]]
        offsets = np.append(np.arange(0, n, self.batch_size), n)
        return shard_in_order(order, offsets, self.world_size)
