"""Randomness and efficiency of batches, for any sampler: cheap, no model needed. Batches are an EpochPlan, a
(indices, offsets) CSR pair or a list of index lists; lengths are tokens.

Efficiency: `padding_efficiency`, `packing_efficiency`, `budget_use` (how full each budget is, which one closed).
Randomness: `cobatch_recurrence`, `lag1_correlation`, `bucket_mix_kl`, and `randomness`, the three for one
sampler between two epochs. What they measure and what good values are: docs/batching.md, "Measuring randomness
without a model".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence, Union

import numpy as np

from dflash_lib.data.batch import packed_row_len
from dflash_lib.plan.buckets import bucket_of
from dflash_lib.plan.sampler.base import EpochBatchSampler, EpochPlan
from dflash_lib.plan.sampler.budget import Bound, SamplerError

Batches = Union[EpochPlan, tuple[np.ndarray, np.ndarray], Sequence[Sequence[int]]]


def as_csr(batches: Batches) -> tuple[np.ndarray, np.ndarray]:
    """(indices (n,), offsets (B + 1,)) for any accepted batches form."""
    if isinstance(batches, EpochPlan):
        return batches.csr()
    if isinstance(batches, tuple) and len(batches) == 2 and isinstance(batches[1], np.ndarray):
        return np.asarray(batches[0], dtype=np.int64), np.asarray(batches[1], dtype=np.int64)
    sizes = np.fromiter((len(b) for b in batches), dtype=np.int64)
    if sizes.size == 0:
        raise SamplerError("no batches given")
    flat = np.concatenate([np.asarray(b, dtype=np.int64) for b in batches])
    return flat, np.concatenate([[0], np.cumsum(sizes)])


def _per_batch(values: np.ndarray, offsets: np.ndarray, ufunc: np.ufunc) -> np.ndarray:
    """ufunc.reduceat over non-empty batches, (B,)."""
    if (np.diff(offsets) <= 0).any():
        raise SamplerError("an empty batch was given")
    return ufunc.reduceat(values, offsets[:-1])


def padding_efficiency(batches: Batches, lengths: np.ndarray) -> float:
    """Real tokens / tokens paid when every batch is padded to its longest member."""
    idx, off = as_csr(batches)
    x = np.asarray(lengths)[idx]
    padded = _per_batch(x, off, np.maximum) * np.diff(off)
    return float(x.sum() / padded.sum())


def packing_efficiency(batches: Batches, lengths: np.ndarray, token_budget: int, multiple: int = 0) -> float:
    """Real tokens / slots of the packed rows: the share of row slots holding a document, each row as long as
    `collate_packed` makes it (its tokens rounded up to `multiple`, at most token_budget; `multiple` 0 = every
    row token_budget slots, static shapes)."""
    idx, off = as_csr(batches)
    real = _per_batch(np.asarray(lengths)[idx], off, np.add)  # (B,) real tokens of each row
    slots = sum(packed_row_len(int(r), token_budget, multiple) for r in real)
    return float(real.sum() / slots)


def cobatch_recurrence(batches_a: Batches, batches_b: Batches, num_samples: int) -> float:
    """Fraction of pairs co-batched in `batches_a` that are co-batched again in `batches_b` (exact, no
    sampling: pairs are counted per (batch in a, batch in b) cell). Pairs with a member absent from `batches_b`
    are not counted. NaN when `batches_a` has no pair (all batches of size 1)."""
    idx_a, off_a = as_csr(batches_a)
    idx_b, off_b = as_csr(batches_b)
    batch_b = np.full(num_samples, -1, dtype=np.int64)
    batch_b[idx_b] = np.repeat(np.arange(len(off_b) - 1), np.diff(off_b))
    batch_a = np.repeat(np.arange(len(off_a) - 1), np.diff(off_a))
    there = batch_b[idx_a] >= 0
    a, b = batch_a[there], batch_b[idx_a][there]
    per_a = np.bincount(a, minlength=len(off_a) - 1)
    pairs = float(np.sum(per_a * (per_a - 1) // 2))
    if pairs == 0:
        return float("nan")
    _, cell = np.unique(a * (len(off_b) - 1) + b, return_counts=True)
    return float(np.sum(cell * (cell - 1) // 2) / pairs)


def lag1_correlation(batches: Batches, lengths: np.ndarray, stat: str = "mean") -> float:
    """Pearson correlation between the mean (stat="mean") or max length of batch s and of batch s+1.
    NaN when fewer than 3 batches or a constant series."""
    idx, off = as_csr(batches)
    x = np.asarray(lengths, dtype=np.float64)[idx]
    if stat == "mean":
        series = _per_batch(x, off, np.add) / np.diff(off)
    elif stat == "max":
        series = _per_batch(x, off, np.maximum)
    else:
        raise SamplerError(f"stat must be 'mean' or 'max', got {stat!r}")
    if len(series) < 3 or np.std(series[:-1]) == 0 or np.std(series[1:]) == 0:
        return float("nan")
    return float(np.corrcoef(series[:-1], series[1:])[0, 1])


def bucket_mix(batches: Batches, lengths: np.ndarray, edges: Sequence[int]) -> np.ndarray:
    """(B,) bucket of each batch, by its longest member (`bucket_of`; a batch longer than the last edge counts in
    the last bucket)."""
    idx, off = as_csr(batches)
    longest = _per_batch(np.asarray(lengths)[idx], off, np.maximum)
    return bucket_of(np.minimum(longest, edges[-1]), edges)


def bucket_mix_kl(batches: Batches, lengths: np.ndarray, edges: Sequence[int], tail: float = 0.1) -> float:
    """KL(P_tail || P_epoch) in nats between the bucket mix of the last `tail` fraction of the batches and of the
    whole epoch. ~0 when buckets are drawn in proportion to what remains; large when the end is one bucket."""
    if not 0.0 < tail <= 1.0:
        raise SamplerError(f"tail must be in (0, 1], got {tail!r}")
    labels = bucket_mix(batches, lengths, edges)
    K = len(edges)
    whole = np.bincount(labels, minlength=K) / len(labels)
    last = labels[len(labels) - max(1, int(round(tail * len(labels)))):]
    end = np.bincount(last, minlength=K) / len(last)
    nz = end > 0
    return float(np.sum(end[nz] * np.log(end[nz] / whole[nz])))


@dataclass(frozen=True)
class RandomnessStats:
    """Randomness of a sampler between epoch e and e+1 (all ranks' batches together)."""

    recurrence: float  # pair co-step recurrence e -> e+1 (lower = more random)
    lag1: float  # lag-1 correlation of step mean lengths in epoch e
    tail_kl: float  # bucket-mix KL (bucket of each step's longest sample) of the last 10% of epoch e, nats
    dropped: int  # samples left out in epoch e to equalise ranks


def randomness(sampler: EpochBatchSampler, edges: Sequence[int], epoch: int = 0, tail: float = 0.1
               ) -> RandomnessStats:
    """The three randomness figures of any sampler, from its plans of `epoch` and `epoch + 1`."""
    a = sampler.epoch_plan(epoch)
    # per optimizer step (every rank's batch of the step together): one update averages over all of them
    csr_a = a.step_csr()
    csr_b = sampler.epoch_plan(epoch + 1).step_csr()
    return RandomnessStats(cobatch_recurrence(csr_a, csr_b, len(sampler.lengths)),
                           lag1_correlation(csr_a, sampler.lengths),
                           bucket_mix_kl(csr_a, sampler.lengths, edges, tail), a.dropped)


@dataclass(frozen=True)
class BudgetUse:
    """How full one epoch's served batches are in each budget of their sampler (`BatchBudget`): means over the
    batches, as the trainer's `token_fill`, `query_fill`, `bound_tokens`, `bound_blocks` are per step."""

    batches: int  # batches served in the epoch (all ranks)
    token_fill: float  # mean token cost / token budget (padded rows: rows x g(longest, or the bucket edge when
    # static); packed: the row's tokens)
    query_fill: float | None  # mean drafter query tokens / block budget; None without a block budget
    bound_tokens: float | None  # share of the batches the token budget closed (the next sample would pass it)
    bound_blocks: float | None  # share the block budget closed (a batch both would close counts in both)


def budget_use(sampler: EpochBatchSampler, epoch: int = 0) -> BudgetUse:
    """`BudgetUse` of `sampler`'s plan of `epoch`; SamplerError for a sampler that fills by no budget. Static
    bucketed batches (fixed `batch_sizes`) are counted padded to their bucket's upper edge, as they are collated."""
    budget = sampler.batch_budget
    if budget is None:
        raise SamplerError(f"{type(sampler).__name__} fills its batches by no budget")
    plan = sampler.epoch_plan(epoch)
    idx, off = plan.csr()
    x = sampler.lengths[idx]
    n = np.diff(off)  # (B,) samples per batch
    if budget.packed:
        tokens = _per_batch(x, off, np.add).astype(np.float64)  # (B,)
    else:
        longest = _per_batch(x, off, np.maximum)  # (B,)
        edges = getattr(sampler, "edges", None)
        if getattr(sampler, "batch_sizes", None) is not None and edges is not None:  # static: rows to the edge
            longest = np.asarray(edges)[bucket_of(longest, edges)]
        tokens = n * budget.tokens.cost(longest)
    queries = None if budget.blocks is None or sampler.queries is None else \
        _per_batch(sampler.queries[idx], off, np.add) / budget.blocks.queries
    bound = plan.served_bound()
    return BudgetUse(len(n), float(np.mean(tokens / budget.tokens.tokens)),
                     None if queries is None else float(np.mean(queries)),
                     None if bound is None else float(np.mean((bound & Bound.TOKENS) > 0)),
                     None if bound is None or budget.blocks is None else float(np.mean((bound & Bound.BLOCKS) > 0)))
