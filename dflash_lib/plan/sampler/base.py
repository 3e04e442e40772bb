"""What every batch sampler shares: the epoch plan, rank sharding, epochs, and exact O(1) mid-epoch resume.

A sampler's whole epoch is planned at once with numpy from (seed, epoch): a flat array of sample indices cut
into batches by offsets (CSR), and a (steps, world_size) table saying which batch rank r takes at step s. All
ranks compute the same plan; rank r only reads column r. Resuming at (epoch, step) regenerates the plan (O(N))
and indexes into it: nothing of the epoch is replayed.
"""

from __future__ import annotations

import hashlib
import json
from abc import abstractmethod
from dataclasses import dataclass
from typing import Any, Iterator

import numpy as np
from torch.utils.data import Sampler

from dflash_lib.plan.buckets import BucketError, check_lengths
from dflash_lib.plan.sampler.budget import BatchBudget, SamplerError, TokenBudget, check_queries, fill_in_order


@dataclass(frozen=True)
class EpochPlan:
    """One epoch of batches for every rank."""

    order: np.ndarray  # (n,) int64 sample indices; batch b is order[offsets[b]:offsets[b+1]]
    offsets: np.ndarray  # (B+1,) int64 batch boundaries into `order`
    steps: np.ndarray  # (S, W) int64 batch id that rank r takes at step s
    step_bucket: np.ndarray | None  # (S,) bucket of the W batches of step s (bucketed samplers), else None
    dropped: int  # samples in batches left out so that every rank takes exactly S steps
    bound: np.ndarray | None = None  # (B,) int8 `budget.Bound` of each batch: the budgets that closed it; None =
    # not recorded (a sampler that fills by no budget)

    @property
    def num_steps(self) -> int:
        return int(self.steps.shape[0])

    def batch(self, step: int, rank: int = 0) -> list[int]:
        b = int(self.steps[step, rank])
        return self.order[self.offsets[b]:self.offsets[b + 1]].tolist()

    def csr(self) -> tuple[np.ndarray, np.ndarray]:
        """The batches actually served, step-major then rank: (indices (n,), offsets (S*W + 1,))."""
        ids = self.steps.ravel()
        sizes = self.offsets[ids + 1] - self.offsets[ids]  # (S*W,)
        out_off = np.concatenate([[0], np.cumsum(sizes)])
        within = np.arange(out_off[-1]) - np.repeat(out_off[:-1], sizes)
        return self.order[np.repeat(self.offsets[ids], sizes) + within], out_off

    def step_csr(self) -> tuple[np.ndarray, np.ndarray]:
        """One entry per optimizer step, the W rank batches of a step together: (indices (n,), offsets (S + 1,)).
        Randomness is judged per step (what one gradient update averages over); padding per batch (csr)."""
        order, offsets = self.csr()
        return order, offsets[::self.steps.shape[1]]

    def batches(self) -> list[np.ndarray]:
        """The batches actually served, step-major then rank, as index arrays."""
        order, offsets = self.csr()
        return np.split(order, offsets[1:-1])

    def served_bound(self) -> np.ndarray | None:
        """(S*W,) int8 `Bound` of the batches actually served, in `csr` order; None when not recorded."""
        return None if self.bound is None else self.bound[self.steps.ravel()]


def shard_in_order(order: np.ndarray, offsets: np.ndarray, world_size: int,
                   batch_order: np.ndarray | None = None, bound: np.ndarray | None = None) -> EpochPlan:
    """Deal batches (in `batch_order`, default 0..B-1) to ranks round-robin; the tail that would leave ranks
    unequal (fewer than world_size batches) is dropped and counted. `bound`: (B,) the batches' `Bound`s."""
    n_batches = len(offsets) - 1
    seq = np.arange(n_batches) if batch_order is None else np.asarray(batch_order, dtype=np.int64)
    _check_world(world_size, n_batches)
    S = len(seq) // world_size
    tail = seq[S * world_size:]
    dropped = int(np.sum(offsets[tail + 1] - offsets[tail]))
    return EpochPlan(order, offsets, seq[:S * world_size].reshape(S, world_size), None, dropped, bound)


def shard_by_bucket(order: np.ndarray, offsets: np.ndarray, batch_bucket: np.ndarray, world_size: int,
                    rng: np.random.Generator, choice: str = "proportional", bound: np.ndarray | None = None
                    ) -> EpochPlan:
    """Bucket-synchronous sharding. Each bucket's batches (contiguous ids, in fill order) are cut into groups of
    world_size; the last incomplete group of each bucket is dropped and counted. Step s serves one group: all
    ranks get a batch of the SAME bucket. Group order: "proportional" = a uniformly random interleaving of all
    groups, i.e. the next bucket is drawn with probability proportional to its remaining groups (the mix stays
    even to the end); "uniform" = the next bucket is drawn uniformly among non-empty ones (the flawed rule that
    empties small buckets early; kept for comparison). `bound`: (B,) the batches' `Bound`s."""
    n_batches = len(offsets) - 1
    _check_world(world_size, n_batches)
    K = int(batch_bucket.max()) + 1
    counts = np.bincount(batch_bucket, minlength=K)  # (K,) batches per bucket
    first = np.concatenate([[0], np.cumsum(counts)[:-1]])  # (K,) id of each bucket's first batch
    groups = counts // world_size  # (K,)
    keep = np.arange(n_batches) - first[batch_bucket] < (groups * world_size)[batch_bucket]  # (B,)
    sizes = offsets[1:] - offsets[:-1]
    dropped = int(sizes[~keep].sum())
    if groups.sum() == 0:
        raise SamplerError(f"world_size={world_size} exceeds the batches of every bucket (at most {counts.max()} "
                           f"per bucket): no step can give every rank a batch of one bucket")
    if choice == "proportional":
        step_bucket = rng.permutation(np.repeat(np.arange(K), groups))
    elif choice == "uniform":
        remaining, seq = groups.copy(), []
        for _ in range(int(groups.sum())):
            live = np.flatnonzero(remaining)
            k = int(live[rng.integers(live.size)])
            remaining[k] -= 1
            seq.append(k)
        step_bucket = np.asarray(seq, dtype=np.int64)
    else:
        raise SamplerError(f"bucket_choice must be 'proportional' or 'uniform', got {choice!r}")
    S = len(step_bucket)
    by_bucket = np.argsort(step_bucket, kind="stable")
    occurrence = np.empty(S, dtype=np.int64)  # (S,) how many earlier steps used the same bucket
    occurrence[by_bucket] = np.arange(S) - np.repeat(np.cumsum(groups) - groups, groups)
    steps = (first[step_bucket] + occurrence * world_size)[:, None] + np.arange(world_size)[None, :]  # (S, W)
    return EpochPlan(order, offsets, steps, step_bucket, dropped, bound)


def _check_world(world_size: int, n_batches: int) -> None:
    if world_size > n_batches:
        raise SamplerError(f"world_size={world_size} is larger than the number of batches in the epoch "
                           f"({n_batches}): some rank would get no batch")


class EpochBatchSampler(Sampler[list[int]]):
    """Base of the batch samplers: yields lists of sample indices; usable as `batch_sampler=` of a DataLoader.

    Deterministic given (seed, epoch). `set_epoch(e)` selects the epoch (keeping the position when e is the
    current epoch, so a trainer may call it after `load_state_dict`); a completed iteration moves to the next
    epoch by itself. `state_dict()` is {"epoch", "step", ...}: step counts batches handed out by THIS sampler;
    a DataLoader prefetches, so a trainer that resumes exactly should save the number of steps it consumed
    instead, e.g. `state = sampler.state_dict() | {"step": consumed}`. `__len__` is the steps per epoch of one
    rank (equal on all ranks).

    Block budget (optional, every subclass that batches under a budget): `queries` (N,) drafter query tokens per
    sample (anchors x block_size, `dflash_lib.data.stats.store_drafter_queries`) and `block_budget` (query
    tokens per batch) bound every batch's summed queries too; both None = tokens only. The budget and a hash of
    the queries enter the state fingerprint, so a resume with other ones is refused.
    """

    def __init__(self, lengths: Any, *, seed: int, rank: int, world_size: int, queries: Any = None,
                 block_budget: int | None = None) -> None:
        super().__init__()
        try:
            self.lengths = check_lengths(lengths)
        except BucketError as e:
            raise SamplerError(str(e)) from None
        if not (isinstance(seed, (int, np.integer)) and seed >= 0):
            raise SamplerError(f"seed must be an int >= 0, got {seed!r}")
        if not (isinstance(world_size, (int, np.integer)) and world_size >= 1):
            raise SamplerError(f"world_size must be an int >= 1, got {world_size!r}")
        if not (isinstance(rank, (int, np.integer)) and 0 <= rank < world_size):
            raise SamplerError(f"rank must be an int in [0, {world_size}), got {rank!r}")
        self.seed, self.rank, self.world_size = int(seed), int(rank), int(world_size)

        self.queries, self.blocks = check_queries(queries, len(self.lengths), block_budget)  # (N,) | None
        self._epoch, self._step = 0, 0
        self._cached: tuple[int, EpochPlan] | None = None

    @abstractmethod
    def _plan(self, epoch: int, rng: np.random.Generator) -> EpochPlan:
        """The whole epoch for all ranks, from `rng` (seeded by (seed, epoch)) only."""

    def _settings(self) -> dict[str, Any]:
        """Everything besides lengths, seed and world_size that shapes the batches (for the state fingerprint)."""
        return {}

    # -- epochs and plans

    def epoch_plan(self, epoch: int | None = None) -> EpochPlan:
        """The plan of `epoch` (default: the current one); the last one is cached."""
        epoch = self._epoch if epoch is None else int(epoch)
        if self._cached is None or self._cached[0] != epoch:
            rng = np.random.default_rng([self.seed, epoch])
            self._cached = (epoch, self._plan(epoch, rng))
        return self._cached[1]

    @property
    def epoch(self) -> int:
        return self._epoch

    @property
    def step(self) -> int:
        """Batches of the current epoch already handed out on this rank."""
        return self._step

    @property
    def dropped(self) -> int:
        """Samples of the current epoch left out (all ranks together) so that every rank takes equal steps."""
        return self.epoch_plan().dropped

    def set_epoch(self, epoch: int) -> None:
        if not (isinstance(epoch, (int, np.integer)) and epoch >= 0):
            raise SamplerError(f"epoch must be an int >= 0, got {epoch!r}")
        if int(epoch) != self._epoch:
            self._epoch, self._step = int(epoch), 0

    def __len__(self) -> int:
        return self.epoch_plan().num_steps

    def __iter__(self) -> Iterator[list[int]]:
        plan = self.epoch_plan()
        while self._step < plan.num_steps:
            s = self._step
            self._step = s + 1  # counted before the yield: a consumer holding batch s has consumed s + 1
            yield plan.batch(s, self.rank)
        self._epoch, self._step = self._epoch + 1, 0

    # -- resume

    @property
    def block_budget(self) -> int | None:
        """Drafter query tokens per batch, or None when batches are bounded by tokens only."""
        return None if self.blocks is None else int(self.blocks.queries)

    @property
    def batch_budget(self) -> BatchBudget | None:
        """The rule this sampler fills its batches by (None: a fixed batch size, no budget)."""
        return None

    def _fingerprint(self) -> str:
        h = hashlib.sha256(self.lengths.tobytes())
        settings = self._settings()
        if self.queries is not None:  # tokens-only samplers keep the fingerprint they always had
            h.update(self.queries.tobytes())
            settings = settings | {"block_budget": self.block_budget}
        h.update(json.dumps({"kind": type(self).__name__, **settings}, sort_keys=True).encode())
        return h.hexdigest()[:16]

    def state_dict(self) -> dict[str, Any]:
        return {"sampler": type(self).__name__, "epoch": self._epoch, "step": self._step, "seed": self.seed,
                "world_size": self.world_size, "block_budget": self.block_budget,
                "fingerprint": self._fingerprint()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue at (state["epoch"], state["step"]) exactly; refuses a state from other data or settings."""
        for key in ("epoch", "step"):
            if key not in state:
                raise SamplerError(f"sampler state lacks {key!r} (has {sorted(state)})")
        checks = {"sampler": type(self).__name__, "seed": self.seed, "world_size": self.world_size,
                  "block_budget": self.block_budget, "fingerprint": self._fingerprint()}
        for key, mine in checks.items():
            if key in state and state[key] != mine:
                raise SamplerError(f"sampler state {key}={state[key]!r} does not match this sampler's {mine!r}: "
                                   f"it was saved with other data or settings")
        epoch, step = state["epoch"], state["step"]
        if not (isinstance(epoch, (int, np.integer)) and epoch >= 0):
            raise SamplerError(f"sampler state epoch must be an int >= 0, got {epoch!r}")
        steps = self.epoch_plan(epoch).num_steps
        if not (isinstance(step, (int, np.integer)) and 0 <= step <= steps):
            raise SamplerError(f"sampler state step must be an int in [0, {steps}] for epoch {epoch}, got {step!r}")
        self._epoch, self._step = int(epoch), int(step)


class FixedBatchSampler:
    """The same batches in the same order every epoch: replays a recorded list of index batches, so that two
    training loops (or a loop and a fault) can be compared on exactly the same work. Plain batch-sampler
    protocol (set_epoch, len, iteration); no sharding, no resume position."""

    def __init__(self, batches: list[list[int]]) -> None:
        if not batches or any(len(b) == 0 for b in batches):
            raise SamplerError("FixedBatchSampler: needs at least one batch and no empty batch")
        self.batches = [list(b) for b in batches]

    def set_epoch(self, epoch: int) -> None:
        """Nothing changes between epochs."""

    def __len__(self) -> int:
        return len(self.batches)

    def __iter__(self):
        return iter(self.batches)


class PaddedBudgetSampler(EpochBatchSampler):
    """A sampler whose batches are padded to their longest member under one TokenBudget (`self.budget`; every
    sample must fit a batch on its own) and filled by `fill_in_order` with `self.capacity`. Subclasses say in what
    order (`_plan`)."""

    def __init__(self, lengths: Any, token_budget: int, seed: int = 0, *, rank: int = 0, world_size: int = 1,
                 q: float | None = None, queries: Any = None, block_budget: int | None = None) -> None:
        super().__init__(lengths, seed=seed, rank=rank, world_size=world_size, queries=queries,
                         block_budget=block_budget)
        self.budget = TokenBudget(token_budget, q)
        self.budget.check_longest(self.lengths)
        self.capacity = self.budget.capacity_table(int(self.lengths.max()))  # (max_len + 1,) rows by longest

    def _settings(self) -> dict[str, Any]:
        return {"token_budget": int(self.budget.tokens), "q": self.budget.q}

    @property
    def batch_budget(self) -> BatchBudget:
        return BatchBudget(self.budget, self.blocks)

    def _fill(self, order: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(offsets (B + 1,), bound (B,)) of the samples `order` (n,) cut in that order by the batch budget."""
        return fill_in_order(self.lengths[order], self.capacity, None if self.queries is None else self.queries[order],
                             self.block_budget)
