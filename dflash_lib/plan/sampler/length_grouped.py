"""LengthGroupedSampler: Hugging Face transformers' `group_by_length` rule, implemented from its definition as a
comparison baseline. A random permutation is cut into megabatches of mega_batch_mult x batch_size samples;
each megabatch is sorted by length, longest first; the longest sample of all is swapped to the very front (so
an out-of-memory shows at step 0); the result is cut into FIXED-size batches. It pads little, but batch lengths
fall in a sawtooth inside each megabatch (high lag-1 correlation) and, as Hugging Face defines it, no budget is
respected. Given a token budget (and a block budget), each megabatch is cut by the samplers' one rule instead
(`BatchBudget`): a batch closes at batch_size samples or when the next sample would pass a budget."""

from __future__ import annotations

from typing import Any

import numpy as np

from dflash_lib.plan.sampler.base import EpochBatchSampler, EpochPlan, shard_in_order
from dflash_lib.plan.sampler.budget import BatchBudget, SamplerError, TokenBudget, fill_in_order


class LengthGroupedSampler(EpochBatchSampler):
    """Megabatch length grouping with fixed batch_size; mega_batch_mult=None applies HF's default
    min(N // (4 * batch_size), 50), at least 1. token_budget (cost units, padding counted, g from q) and the
    optional (queries, block_budget) pair cap every batch as the other samplers' budgets do; None = HF's rule."""

    def __init__(self, lengths: Any, batch_size: int, seed: int = 0, *, rank: int = 0, world_size: int = 1,
                 mega_batch_mult: int | None = None, token_budget: int | None = None, q: float | None = None,
                 queries: Any = None, block_budget: int | None = None) -> None:
        super().__init__(lengths, seed=seed, rank=rank, world_size=world_size, queries=queries,
                         block_budget=block_budget)
        if not (isinstance(batch_size, (int, np.integer)) and batch_size >= 1):
            raise SamplerError(f"batch_size must be an int >= 1, got {batch_size!r}")
        if mega_batch_mult is None:
            mega_batch_mult = max(1, min(len(self.lengths) // (batch_size * 4), 50))
        if not (isinstance(mega_batch_mult, (int, np.integer)) and mega_batch_mult >= 1):
            raise SamplerError(f"mega_batch_mult must be an int >= 1 or None, got {mega_batch_mult!r}")
        self.batch_size, self.mega_batch_mult = int(batch_size), int(mega_batch_mult)
        self.budget: TokenBudget | None = None
        if token_budget is not None:
            self.budget = TokenBudget(token_budget, q)
            self.budget.check_longest(self.lengths)
            self.capacity = self.budget.capacity_table(int(self.lengths.max()))  # (max_len + 1,) rows by longest
        elif self.blocks is not None:
            raise SamplerError("a block budget needs a token_budget too (HF's rule has neither)")

    @property
    def batch_budget(self) -> BatchBudget | None:
        return None if self.budget is None else BatchBudget(self.budget, self.blocks)

    def _settings(self) -> dict[str, Any]:
        budget = {} if self.budget is None else {"token_budget": int(self.budget.tokens), "q": self.budget.q}
        return {"batch_size": self.batch_size, "mega_batch_mult": self.mega_batch_mult, **budget}

    def _plan(self, epoch: int, rng: np.random.Generator) -> EpochPlan:
        n = len(self.lengths)
        perm = rng.permutation(n)
        mega = np.arange(n) // (self.mega_batch_mult * self.batch_size)  # (N,) megabatch of each position
        order = perm[np.lexsort((-self.lengths[perm], mega))]  # each megabatch longest first
        starts = np.arange(0, n, self.mega_batch_mult * self.batch_size)  # (G,) first position of each megabatch
        longest = starts[int(np.argmax(self.lengths[order[starts]]))]
        order[[0, longest]] = order[[longest, 0]]
        if self.budget is None:
            return shard_in_order(order, np.append(np.arange(0, n, self.batch_size), n), self.world_size)
        cuts, bounds = [np.zeros(1, dtype=np.int64)], []
        for a, b in zip(starts, np.append(starts[1:], n)):  # each megabatch cut on its own, as HF's batches are
            part = order[a:b]
            offs, why = fill_in_order(self.lengths[part], self.capacity,
                                      None if self.queries is None else self.queries[part], self.block_budget,
                                      self.batch_size)
            cuts.append(offs[1:] + a)
            bounds.append(why)
        return shard_in_order(order, np.concatenate(cuts), self.world_size, bound=np.concatenate(bounds))
