"""RandomShuffleSampler: a full random order every epoch, cut into batches by the token budget with padding
counted. Most random, most padding: every batch pays for its longest member."""

from __future__ import annotations

from typing import Any

import numpy as np

from dflash_lib.sampler.base import EpochBatchSampler, EpochPlan, shard_in_order
from dflash_lib.sampler.budget import TokenBudget, greedy_fill


class RandomShuffleSampler(EpochBatchSampler):
    """Uniform permutation per epoch; each batch grows while (n + 1) * g(max) <= token_budget and (given
    `queries`) its drafter query tokens stay <= block_budget."""

    def __init__(self, lengths: Any, token_budget: int, seed: int = 0, *, rank: int = 0, world_size: int = 1,
                 q: float | None = None, queries: Any = None, block_budget: int | None = None) -> None:
        super().__init__(lengths, seed=seed, rank=rank, world_size=world_size, queries=queries,
                         block_budget=block_budget)
        self.budget = TokenBudget(token_budget, q)
        self.budget.check_longest(self.lengths)
        self._capacity = self.budget.capacity_table(int(self.lengths.max()))

    def _settings(self) -> dict[str, Any]:
        return {"token_budget": int(self.budget.tokens), "q": self.budget.q}

    def _plan(self, epoch: int, rng: np.random.Generator) -> EpochPlan:
        order = rng.permutation(len(self.lengths))
        q = None if self.queries is None else self.queries[order]
        return shard_in_order(order, greedy_fill(self.lengths[order], self._capacity, q, self.block_budget),
                              self.world_size)
