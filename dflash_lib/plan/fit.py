"""Whether a bucket plan's worst batches fit: the token budget, an activation-memory model (`MemoryModel`) and the
drafter's query tokens. `check_fit` reports every bucket (`BucketFit`) and raises `BucketFitError` naming the ones
that never fit. numpy only."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from dflash_lib.plan.buckets import BatchSizing, BucketError, BucketFitError, BucketPlan, bucket_of, check_lengths


# ---------------------------------------------------------------------------------------------------------
# Worst-case fit check


@dataclass(frozen=True)
class MemoryModel:
    """Activation memory of one padded batch of B rows x L tokens: fixed + B * (per_token * L + per_token_sq *
    L^2) bytes, refused above limit_bytes. Fit the three numbers on the device (or from the model's shapes)."""

    limit_bytes: float  # memory available for activations, bytes
    per_token_bytes: float  # bytes per token slot (hidden states, MLP activations kept for backward)
    per_token_sq_bytes: float = 0.0  # bytes per attention score kept (0 with flash attention)
    fixed_bytes: float = 0.0  # bytes independent of the batch

    def bytes_for(self, batch: Any, seq_len: Any) -> np.ndarray:
        b, L = np.asarray(batch, dtype=np.float64), np.asarray(seq_len, dtype=np.float64)
        return self.fixed_bytes + b * (self.per_token_bytes * L + self.per_token_sq_bytes * L * L)


@dataclass(frozen=True)
class BucketFit:
    """The largest batch bucket `bucket` can produce, and whether it fits."""

    bucket: int  # bucket index
    lower: int  # exclusive lower edge, tokens
    edge: int  # inclusive upper edge, tokens
    batch_size: int  # samples in the worst-case batch
    seq_len: int  # tokens per row of the worst-case batch (padded)
    tokens: int  # padded token slots, batch_size * seq_len
    cost: float  # batch_size * g(seq_len), cost units (compare with token_budget)
    memory_bytes: float | None  # activation memory estimate; None without a MemoryModel
    fits: bool
    queries: int | None = None  # drafter query tokens (anchors x block_size) of the bucket's costliest batch for
    # the drafter (not necessarily the token-worst batch above), capped at block_budget when the sampler fills by
    # one; None without per-sample or per-bucket queries


def worst_batch_queries(lengths: Any, queries: Any, rows: Any) -> int:
    """Most drafter query tokens one batch can hold when a batch whose longest member has m tokens may take
    rows(m) samples: max over the distinct lengths m of the sum of the rows(m) largest queries among the samples
    of <= m tokens (exact: any batch of maximum m is such a subset, and such a subset is a batch).

    lengths, queries: (n,) tokens and drafter query tokens of the candidate samples (e.g. one bucket); rows:
    callable from (D,) int64 distinct lengths to (D,) int64 rows, nonincreasing. Works on the (lengths x
    distinct query values) count table in chunks of rows: O(n + D * U) for D distinct lengths and U distinct
    queries (U <= num_anchors + 1 for anchor blocks).
    """
    x, q = np.asarray(lengths, dtype=np.int64), np.asarray(queries, dtype=np.int64)
    if x.shape != q.shape or x.ndim != 1:
        raise BucketError(f"lengths and queries must be equal 1-D arrays, got shapes {x.shape} and {q.shape}")
    if x.size == 0:
        return 0
    values, li = np.unique(x, return_inverse=True)  # (D,) distinct lengths, ascending
    neg, qi = np.unique(-q, return_inverse=True)
    levels = -neg  # (U,) distinct queries, descending
    D, U = len(values), len(levels)
    cap = np.asarray(rows(values), dtype=np.int64)  # (D,)
    by_length = np.argsort(li, kind="stable")
    first = np.searchsorted(li[by_length], np.arange(D + 1), side="left")  # (D+1,) samples before each length
    running = np.zeros(U, dtype=np.int64)  # samples of each query level among the lengths before the chunk
    best = 0
    step = max(1, (1 << 22) // U)  # distinct lengths per chunk: at most ~4M table cells at once
    for a in range(0, D, step):
        b = min(D, a + step)
        sel = by_length[first[a]:first[b]]
        here = np.bincount((li[sel] - a) * U + qi[sel], minlength=(b - a) * U).reshape(b - a, U)
        counts = running + np.cumsum(here, axis=0)  # (c, U) samples <= values[t] at each query level
        running = counts[-1]
        n_top = np.cumsum(counts, axis=1)  # (c, U) samples at the top `u + 1` levels
        q_top = np.cumsum(counts * levels, axis=1)  # (c, U) their queries
        c = np.maximum(cap[a:b], 0)  # (c,)
        full = (n_top < c[:, None]).sum(axis=1)  # (c,) levels taken whole
        last = np.minimum(full, U - 1)
        before_n = np.where(full > 0, n_top[np.arange(b - a), np.maximum(full - 1, 0)], 0)
        before_q = np.where(full > 0, q_top[np.arange(b - a), np.maximum(full - 1, 0)], 0)
        top = np.where(full >= U, q_top[:, -1], before_q + (c - before_n) * levels[last])  # (c,)
        best = max(best, int(top.max()))
    return best


def check_fit(plan: BucketPlan, memory: MemoryModel | None = None, *, dynamic: bool = False,
              lengths: Any = None, queries: Any = None, max_queries: Any = None, block_budget: int | None = None
              ) -> tuple[BucketFit, ...]:
    """Every bucket's worst-case batch against the token budget, (given `memory`) the memory limit and (given
    queries) the drafter's query tokens.

    dynamic=False: fixed batches of plan.batch_sizes padded to the edge. dynamic=True: the fill rule of
    BucketedShuffleSampler (keep adding while (n + 1) * g(max) <= budget); the worst case is searched over every
    possible batch maximum m in the bucket, with floor(T / g(m)) rows of m tokens.
    Drafter queries (anchors x block_size per sample, `data.stats.store_drafter_queries`): `queries` (N,)
    with the samples' `lengths` (N,) tokens gives each bucket's exact worst batch (`worst_batch_queries`);
    `max_queries` (K,), the costliest sample of each bucket, gives the bound rows x max_queries instead.
    `block_budget` (query tokens per batch): a sample above it never fits; fixed batch sizes must keep their
    worst batch within it (the sampler refuses them otherwise); the dynamic fill stops at it, so the reported
    worst is capped there. Raises BucketFitError listing every bucket that can never fit, before any training.
    """
    sizing = BatchSizing(plan.cost, plan.q, plan.token_budget, None, plan.multiple)
    if plan.batch_sizes is None and plan.token_budget is None:
        raise BucketError("check_fit needs a plan with a token_budget or batch sizes")
    if dynamic and plan.token_budget is None:
        raise BucketError("check_fit(dynamic=True) needs a plan with a token_budget")
    per_bucket = _bucket_queries(plan, lengths, queries, max_queries)  # K (lengths, queries) or K maxima or None
    if block_budget is not None and not (isinstance(block_budget, (int, np.integer)) and block_budget >= 1):
        raise BucketError(f"block_budget must be an int >= 1 (drafter query tokens) or None, got {block_budget!r}")
    out, bad = [], []
    for i, (lower, edge) in enumerate(zip(plan.lower_edges, plan.edges)):
        if dynamic:
            m = np.arange(lower + 1, edge + 1, dtype=np.int64)  # (E,) possible batch maxima
            rows = np.maximum(sizing.capacity(m), 0)
            score = (memory.bytes_for(rows, m) if memory else rows * m).astype(np.float64)
            zero = np.flatnonzero(rows < 1)  # a length no batch can hold is the worst case of all
            w = int(zero[0]) if zero.size else int(np.argmax(score))
            b, L = int(rows[w]), int(m[w])
        else:
            b, L = int(plan.batch_sizes[i]), int(edge)
        cost_units = float(b * sizing.g(L))
        mem = float(memory.bytes_for(b, L)) if memory else None
        fits = b >= 1 and (plan.token_budget is None or cost_units <= plan.token_budget)
        fits = fits and (mem is None or mem <= memory.limit_bytes)
        why = [] if b >= 1 else ["not even one sample fits the token budget"]
        if b >= 1 and plan.token_budget is not None and cost_units > plan.token_budget:
            why.append(f"cost {cost_units:g} > token_budget {plan.token_budget}")
        if mem is not None and mem > memory.limit_bytes:
            why.append(f"{_fmt_bytes(mem)} of activations > limit {_fmt_bytes(memory.limit_bytes)}")
        worst = None
        if per_bucket is not None:
            def rows_of(v: np.ndarray, b: int = b) -> np.ndarray:  # rows of a batch whose longest has v tokens
                return np.maximum(sizing.capacity(v), 0) if dynamic else np.full(len(v), b)

            if isinstance(per_bucket, list):
                x, q = per_bucket[i]
                worst, single = worst_batch_queries(x, q, rows_of), int(q.max(initial=0))
            else:
                single = int(per_bucket[i])
                most_rows = min(int(rows_of(np.array([lower + 1]))[0]), int(plan.counts[i]))
                worst = most_rows * single
            if block_budget is not None:
                if single > block_budget:
                    why.append(f"a sample needs {single} drafter query tokens > block_budget {block_budget}")
                elif not dynamic and worst > block_budget:
                    why.append(f"{worst} drafter query tokens > block_budget {block_budget}")
                worst = min(worst, block_budget) if dynamic else worst
        fits = fits and len(why) == 0
        fit = BucketFit(i, int(lower), int(edge), b, L, b * L, cost_units, mem, fits, worst)
        out.append(fit)
        if not fits:
            bad.append((fit, why))
    if bad:
        lines = [f"bucket {f.bucket} ({f.lower}, {f.edge}]: worst batch {f.batch_size} x {f.seq_len} tokens: "
                 f"{'; '.join(why)}" for f, why in bad]
        raise BucketFitError("buckets that can never fit:\n  " + "\n  ".join(lines))
    return tuple(out)


def _bucket_queries(plan: BucketPlan, lengths: Any, queries: Any, max_queries: Any
                    ) -> list[tuple[np.ndarray, np.ndarray]] | np.ndarray | None:
    """check_fit's queries input as K (lengths, queries) pairs, one per bucket, or (K,) maxima, or None."""
    if queries is not None and max_queries is not None:
        raise BucketError("pass per-sample queries (with lengths) or per-bucket max_queries, not both")
    if max_queries is not None:
        mq = np.asarray(max_queries)
        if mq.shape != (plan.k,) or mq.dtype.kind not in "iu" or (mq < 0).any():
            raise BucketError(f"max_queries must be {plan.k} ints >= 0 (drafter query tokens per bucket), got "
                              f"{mq.tolist()!r}")
        return mq.astype(np.int64)
    if queries is None:
        if lengths is not None:
            raise BucketError("lengths are only needed with per-sample queries")
        return None
    if lengths is None:
        raise BucketError("per-sample queries need the samples' lengths (tokens) to find their buckets")
    x = check_lengths(lengths)
    q = np.asarray(queries)
    if q.shape != x.shape or q.dtype.kind not in "iu" or (q < 0).any():
        raise BucketError(f"queries must be {len(x)} ints >= 0 (drafter query tokens per sample, one per length)")
    bucket = bucket_of(x, plan.edges)  # (N,)
    order = np.argsort(bucket, kind="stable")
    bounds = np.searchsorted(bucket[order], np.arange(plan.k + 1), side="left")
    return [(x[order[a:b]], q.astype(np.int64)[order[a:b]]) for a, b in zip(bounds[:-1], bounds[1:])]


def _fmt_bytes(n: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} B"
