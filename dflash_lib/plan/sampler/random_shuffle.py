"""RandomShuffleSampler: a full random order every epoch, cut into batches by the token budget with padding
counted. Most random, most padding: every batch pays for its longest member."""

from __future__ import annotations

import numpy as np

from dflash_lib.plan.sampler.base import EpochPlan, PaddedBudgetSampler, shard_in_order


class RandomShuffleSampler(PaddedBudgetSampler):
    """Uniform permutation per epoch; each batch grows while (n + 1) * g(max) <= token_budget and (given
    `queries`) its drafter query tokens stay <= block_budget."""

    def _plan(self, epoch: int, rng: np.random.Generator) -> EpochPlan:
        order = rng.permutation(len(self.lengths))
        offsets, bound = self._fill(order)
        return shard_in_order(order, offsets, self.world_size, bound=bound)
