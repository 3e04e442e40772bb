"""SortedStaticSampler: the reference run's flawed baseline. Samples are sorted by length and cut into batches ONCE;
every epoch only the ORDER of those frozen batches is shuffled, so the optimizer sees the same compositions
forever (pair co-batch recurrence 1.0). Kept to measure the flaw against."""

from __future__ import annotations

from typing import Any

import numpy as np

from dflash_lib.plan.sampler.base import EpochPlan, PaddedBudgetSampler, shard_in_order


class SortedStaticSampler(PaddedBudgetSampler):
    """Frozen length-sorted batches under a token budget (padding counted) and, given `queries`, a block budget
    (drafter query tokens); per epoch a shuffled batch order."""

    def __init__(self, lengths: Any, token_budget: int, seed: int = 0, **kwargs: Any) -> None:
        """Arguments as PaddedBudgetSampler's (rank, world_size, q, queries, block_budget)."""
        super().__init__(lengths, token_budget, seed, **kwargs)
        self._order = np.argsort(self.lengths, kind="stable")  # (N,) frozen once
        self._offsets, self._bound = self._fill(self._order)  # (B + 1,), (B,)

    def _plan(self, epoch: int, rng: np.random.Generator) -> EpochPlan:
        return shard_in_order(self._order, self._offsets, self.world_size,
                              rng.permutation(len(self._offsets) - 1), self._bound)
