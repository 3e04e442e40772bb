"""BucketedShuffleSampler: reshuffle inside each length bucket every epoch, build every batch from ONE bucket,
and pick the next bucket with probability proportional to its remaining batches.

Proportional choice is the same as building all batches and interleaving them uniformly at random, so the
bucket mix at the end of an epoch matches the whole epoch's (uniform choice empties small buckets early and
ends the epoch on one length: the periodic loss users report). Distributed: each step serves world_size batches
of the same bucket, one per rank.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from dflash_lib.plan.buckets import BucketError, bucket_of
from dflash_lib.plan.sampler.base import EpochBatchSampler, EpochPlan, shard_by_bucket
from dflash_lib.plan.sampler.budget import BatchBudget, SamplerError, TokenBudget, fill_in_order, worst_batch_refusal


class BucketedShuffleSampler(EpochBatchSampler):
    """Per epoch: shuffle each bucket, fill batches while (n + 1) * g(max) <= token_budget and (given `queries`)
    their drafter query tokens stay <= block_budget (or use fixed `batch_sizes`, one per bucket, e.g.
    BucketPlan.batch_sizes for kernel-friendly static shapes; with `queries` each size must keep the bucket's
    worst batch, its b costliest samples, within block_budget; a full batch is then recorded as bound by the
    budgets its worst batch would pass with one row more), then order the batches by proportional bucket choice
    (`bucket_choice="uniform"` exists only to show its flaw)."""

    def __init__(self, lengths: Any, edges: Sequence[int], token_budget: int, seed: int = 0, *, rank: int = 0,
                 world_size: int = 1, q: float | None = None, batch_sizes: Sequence[int] | None = None,
                 bucket_choice: str = "proportional", queries: Any = None, block_budget: int | None = None) -> None:
        super().__init__(lengths, seed=seed, rank=rank, world_size=world_size, queries=queries,
                         block_budget=block_budget)
        if bucket_choice not in ("proportional", "uniform"):
            raise SamplerError(f"bucket_choice must be 'proportional' or 'uniform', got {bucket_choice!r}")
        try:
            buckets = bucket_of(self.lengths, edges)  # (N,); validates edges first
        except BucketError as e:
            raise SamplerError(str(e)) from None
        self.edges = tuple(int(e) for e in edges)
        self.budget = TokenBudget(token_budget, q)
        self.budget.check_longest(np.asarray(self.edges), "bucket")  # the longest ALLOWED sample: the last edge
        self.bucket_choice = bucket_choice
        K = len(self.edges)
        by_bucket = np.argsort(buckets, kind="stable")
        bounds = np.searchsorted(buckets[by_bucket], np.arange(K + 1), side="left")
        self._members = [by_bucket[bounds[k]:bounds[k + 1]] for k in range(K)]  # K arrays of sample indices
        self._capacity = self.budget.capacity_table(self.edges[-1])
        self.batch_sizes: tuple[int, ...] | None = None
        if batch_sizes is not None:
            sizes = np.asarray(batch_sizes)
            if sizes.shape != (K,) or sizes.dtype.kind not in "iu" or (sizes < 1).any():
                raise SamplerError(f"batch_sizes must be {K} ints >= 1 (one per bucket), got {list(batch_sizes)!r}")
            over = np.flatnonzero(sizes * self.budget.cost(np.asarray(self.edges)) > self.budget.tokens)
            if over.size:
                i = int(over[0])
                raise SamplerError(f"batch_sizes[{i}] = {int(sizes[i])} rows of {self.edges[i]} tokens exceed "
                                   f"token_budget {self.budget.tokens}")
            if self.queries is not None:
                for i, members in enumerate(self._members):
                    worst = int(np.sort(self.queries[members])[::-1][:sizes[i]].sum())  # its b costliest samples
                    if worst > self.block_budget:
                        raise SamplerError(f"batch_sizes[{i}] = {int(sizes[i])} rows of bucket {i} can hold {worst} "
                                           f"drafter query tokens (its {int(sizes[i])} costliest samples), more "
                                           f"than block_budget {self.block_budget}: lower the batch size")
            self.batch_sizes = tuple(int(b) for b in sizes)
            costliest = [None if self.queries is None else np.sort(self.queries[m])[::-1] for m in self._members]
            self._size_bound = [int(worst_batch_refusal(self.batch_budget, b, e, c))
                                for b, e, c in zip(self.batch_sizes, self.edges, costliest)]  # (K,) Bound codes

    @property
    def bucket_sizes(self) -> tuple[int, ...]:
        """(K,) samples in each bucket."""
        return tuple(len(m) for m in self._members)

    @property
    def batch_budget(self) -> BatchBudget:
        return BatchBudget(self.budget, self.blocks)

    def _settings(self) -> dict[str, Any]:
        return {"edges": list(self.edges), "token_budget": int(self.budget.tokens), "q": self.budget.q,
                "batch_sizes": self.batch_sizes, "bucket_choice": self.bucket_choice}

    def _plan(self, epoch: int, rng: np.random.Generator) -> EpochPlan:
        orders, starts, labels, bounds = [], [], [], []
        base = 0
        for k, members in enumerate(self._members):
            if members.size == 0:
                continue
            perm = members[rng.permutation(members.size)]  # (n_k,) this epoch's order inside bucket k
            if self.batch_sizes is None:
                offs, why = fill_in_order(self.lengths[perm], self._capacity,
                                          None if self.queries is None else self.queries[perm], self.block_budget)
            else:
                offs = np.append(np.arange(0, members.size, self.batch_sizes[k]), members.size)
                why = np.where(np.diff(offs) == self.batch_sizes[k], self._size_bound[k], 0).astype(np.int8)
            orders.append(perm)
            starts.append(offs[:-1] + base)
            labels.append(np.full(len(offs) - 1, k, dtype=np.int64))
            bounds.append(why)
            base += members.size
        order = np.concatenate(orders)
        offsets = np.concatenate(starts + [np.array([base])])
        return shard_by_bucket(order, offsets, np.concatenate(labels), self.world_size, rng, self.bucket_choice,
                               np.concatenate(bounds))
