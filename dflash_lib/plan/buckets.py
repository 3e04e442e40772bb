"""Bucket boundaries for length-aware batching: the cost of a sample, EXACTLY optimal edges under the "edge"
(static shapes) and "batch_max" (random batches padded to their longest) objectives, with or without the drafter's
block budget, the two baselines we compare against and the choice of k (the worst-case fit check: `fit.py`). numpy
only, on the histogram of distinct lengths; `BucketPlan.exact` says whether a plan is proven optimal ("batch_max"
above `grid` distinct lengths is optimal among grid edges only).

Units, the objectives, their dynamic programs and why they are exact: docs/batching.md, "The objective".
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import asdict, dataclass, fields
from typing import Any, Sequence

import numpy as np

OBJECTIVES = ("edge", "batch_max")
COSTS = ("linear", "quadratic")
POLICIES = ("truncate", "drop")
METHODS = ("optimal", "seed", "equal_length", "given")
DEFAULT_GRID = 64  # batch_max candidate edge positions above which the search is on a grid (see module doc)
_TAIL_TOL = 1e-30  # P(max <= v) below which the rest of an expected-max sum is dropped (relative error < 1e-20)

log = logging.getLogger(__name__)


class BucketError(ValueError):
    """Bad input to bucket planning; the message names the parameter or record at fault."""


class BucketFitError(BucketError):
    """Some bucket's largest possible batch exceeds the token budget or the activation-memory limit."""


# ---------------------------------------------------------------------------------------------------------
# Cost model


@dataclass(frozen=True)
class SampleCost:
    """What one sample of l tokens costs, in token-equivalents: g(l) = l ("linear") or l + l^2 / q ("quadratic",
    attention's share; q in tokens). Configs and plans spell it as the pair (cost, q); the samplers as q alone,
    None meaning linear: `SampleCost(cost, q).q` is the samplers' q, `SampleCost.of_q(q).cost` the pair's name."""

    cost: str = "linear"  # "linear" | "quadratic"
    q: float | None = None  # quadratic scale in tokens; None when linear (a q given with "linear" is dropped)

    def __post_init__(self) -> None:
        if self.cost not in COSTS:
            raise BucketError(f"cost must be one of {list(COSTS)}, got {self.cost!r}")
        if self.cost == "quadratic" and (self.q is None or not self.q > 0):
            raise BucketError(f"cost='quadratic' needs q > 0 (tokens), got q={self.q!r}")
        if self.cost == "linear":
            object.__setattr__(self, "q", None)  # a config's unused q (0.0) must not read as a quadratic scale

    @classmethod
    def of_q(cls, q: float | None) -> SampleCost:
        """The cost a sampler's `q` stands for: linear when None, else quadratic with scale q (tokens)."""
        return cls("linear" if q is None else "quadratic", q)

    def __call__(self, lengths: Any) -> np.ndarray:
        """g(lengths), float64 of the same shape (token-equivalents)."""
        x = np.asarray(lengths, dtype=np.float64)
        return x if self.q is None else x + x * x / self.q


@dataclass(frozen=True)
class BatchSizing:
    """How one sample is priced (`SampleCost`) and how many samples one batch of a bucket holds."""

    cost: str = "linear"  # "linear": g(l) = l; "quadratic": g(l) = l + l^2 / q
    q: float | None = None  # quadratic scale in tokens (required for "quadratic")
    token_budget: int | None = None  # cost units per batch INCLUDING padding (tokens when linear)
    batch_size: int | None = None  # fixed samples per batch, used only when token_budget is None
    multiple: int = 1  # batch sizes are rounded down to a multiple of this (kernel shapes), never below 1
    block_budget: int | None = None  # drafter query tokens per batch; None = not bounded

    def __post_init__(self) -> None:
        SampleCost(self.cost, self.q)  # refuses an unknown cost, or a quadratic one without q > 0
        if self.block_budget is not None and not (isinstance(self.block_budget, (int, np.integer))
                                                  and self.block_budget >= 1):
            raise BucketError(f"block_budget must be an int >= 1 (drafter query tokens) or None, got "
                              f"{self.block_budget!r}")
        if self.token_budget is not None and not self.token_budget > 0:
            raise BucketError(f"token_budget must be > 0, got {self.token_budget!r}")
        if self.batch_size is not None and not self.batch_size > 0:
            raise BucketError(f"batch_size must be > 0, got {self.batch_size!r}")
        if not (isinstance(self.multiple, int) and self.multiple >= 1):
            raise BucketError(f"multiple must be an int >= 1, got {self.multiple!r}")

    @property
    def sample_cost(self) -> SampleCost:
        return SampleCost(self.cost, self.q)

    def g(self, lengths: Any) -> np.ndarray:
        """Cost of samples of `lengths` tokens, float64 of the same shape (token-equivalents)."""
        return self.sample_cost(lengths)

    def capacity(self, lengths: Any) -> np.ndarray:
        """Most samples a batch whose longest member has `lengths` tokens may hold: floor(T / g(l)), int64."""
        if self.token_budget is None:
            raise BucketError("capacity needs a token_budget")
        x = np.asarray(lengths, dtype=np.int64)
        if self.cost == "linear":
            return self.token_budget // np.maximum(x, 1)
        return np.floor(self.token_budget / self.g(np.maximum(x, 1))).astype(np.int64)

    def batch_sizes(self, edges: Any, max_queries: Any = None) -> np.ndarray | None:
        """(K,) samples per batch of each bucket, or None when neither token_budget nor batch_size is set. With
        block_budget and `max_queries` (K,) (each bucket's costliest sample, drafter query tokens), also at most
        block_budget // max_queries rows (at least 1), before rounding to `multiple`."""
        edges = np.asarray(edges, dtype=np.int64)
        if self.token_budget is None:
            return None if self.batch_size is None else np.full(edges.shape, self.batch_size, dtype=np.int64)
        raw = self.capacity(edges)
        bad = np.flatnonzero(raw < 1)
        if bad.size:
            e = int(edges[bad[0]])
            raise BucketError(f"token_budget {self.token_budget} is below the cost {float(self.g(e)):g} of one "
                              f"sample of {e} tokens (bucket edge {e}): that bucket can never fit a batch")
        if self.block_budget is not None and max_queries is not None:
            mq = np.broadcast_to(np.asarray(max_queries, dtype=np.int64), raw.shape)
            raw = np.where(mq > 0, np.minimum(raw, np.maximum(1, self.block_budget // np.maximum(mq, 1))), raw)
        rounded = (raw // self.multiple) * self.multiple
        return np.where(rounded >= 1, rounded, raw)  # below one multiple: keep what fits rather than 0


# ---------------------------------------------------------------------------------------------------------
# Histogram of lengths


@dataclass(frozen=True)
class LengthHistogram:
    """Distinct lengths with their counts, after the max_len policy. max_len is always the last value."""

    values: np.ndarray  # (P,) int64 distinct lengths in tokens, ascending; values[-1] == max_len
    counts: np.ndarray  # (P,) int64 samples of each length (the max_len entry may be 0)
    max_len: int  # longest allowed sample, tokens
    clipped: int  # samples longer than max_len cut to it (policy "truncate")
    dropped: int  # samples longer than max_len left out (policy "drop")
    queries: np.ndarray | None = None  # (P,) int64 drafter query tokens of the samples of each length, summed
    max_queries: np.ndarray | None = None  # (P,) int64 the costliest sample of each length (0 where none)

    @property
    def num_samples(self) -> int:
        return int(self.counts.sum())

    @property
    def num_distinct(self) -> int:
        """Distinct lengths actually present (M)."""
        return int(np.count_nonzero(self.counts))

    @property
    def real_tokens(self) -> int:
        return int((self.values * self.counts).sum())


def check_lengths(lengths: Any, name: str = "lengths") -> np.ndarray:
    """Validate sample lengths (tokens): a non-empty 1-D array of integers >= 1. Returns int64 (N,)."""
    arr = np.asarray(lengths)
    if arr.ndim != 1:
        raise BucketError(f"{name} must be 1-D (one length per sample), got shape {arr.shape}")
    if arr.size == 0:
        raise BucketError(f"{name} is empty: nothing to bucket")
    if arr.dtype.kind == "f":
        bad = np.flatnonzero(~np.isfinite(arr) | (arr != np.round(arr)))
        if bad.size:
            raise BucketError(f"{name}[{bad[0]}] = {arr[bad[0]]!r} is not a whole number of tokens")
    elif arr.dtype.kind not in "iu":
        raise BucketError(f"{name} must hold integers (tokens), got dtype {arr.dtype}")
    arr = arr.astype(np.int64)
    bad = np.flatnonzero(arr < 1)
    if bad.size:
        raise BucketError(f"{name}[{bad[0]}] = {arr[bad[0]]}: every sample needs at least 1 token")
    return arr


def apply_policy(lengths: Any, max_len: int, policy: str = "truncate") -> np.ndarray:
    """Lengths as the token store keeps them: cut to max_len ("truncate") or without the longer ones ("drop")."""
    arr = check_lengths(lengths)
    _check_policy(policy, max_len)
    if policy == "truncate":
        return np.minimum(arr, max_len)
    kept = arr[arr <= max_len]
    if kept.size == 0:
        raise BucketError(f"policy='drop' leaves no sample: every length exceeds max_len={max_len}")
    return kept


def length_histogram(lengths: Any, *, max_len: int, policy: str = "truncate", queries: Any = None) -> LengthHistogram:
    """Histogram of `lengths` (tokens) after the max_len policy, with the samples' drafter `queries` (N,) (query
    tokens, None = not counted) summed and maximised per length; O(N + max_len)."""
    arr = check_lengths(lengths)
    _check_policy(policy, max_len)
    over = int(np.count_nonzero(arr > max_len))
    kept = apply_policy(arr, max_len, policy)
    counts = np.bincount(kept, minlength=max_len + 1)
    values = np.flatnonzero(counts)
    if values[-1] != max_len:
        values = np.append(values, max_len)
    q_sum = q_max = None
    if queries is not None:
        q = np.asarray(queries)
        if q.shape != arr.shape or q.dtype.kind not in "iu" or (q < 0).any():
            raise BucketError(f"queries must be {arr.size} ints >= 0 (drafter query tokens per sample), got shape "
                              f"{q.shape} dtype {q.dtype}")
        q = q.astype(np.int64) if policy == "truncate" else q[arr <= max_len].astype(np.int64)
        q_sum = np.bincount(kept, weights=q, minlength=max_len + 1).astype(np.int64)[values]
        top = np.zeros(max_len + 1, dtype=np.int64)
        np.maximum.at(top, kept, q)
        q_max = top[values]
    return LengthHistogram(values.astype(np.int64), counts[values].astype(np.int64), int(max_len),
                           clipped=over if policy == "truncate" else 0, dropped=over if policy == "drop" else 0,
                           queries=q_sum, max_queries=q_max)


def _check_policy(policy: str, max_len: int) -> None:
    if policy not in POLICIES:
        raise BucketError(f"policy must be one of {list(POLICIES)}, got {policy!r}")
    if not (isinstance(max_len, (int, np.integer)) and max_len >= 1):
        raise BucketError(f"max_len must be an int >= 1 (tokens), got {max_len!r}")


# ---------------------------------------------------------------------------------------------------------
# Bucket costs. A bucket is a run of histogram positions [lo, hi) padded/batched by an edge value (tokens).


def _log_factorials(n_max: int) -> np.ndarray:
    """(n_max + 1,) ln(n!) for n = 0..n_max; exact below 32, Stirling's series above (error < 1e-16 relative)."""
    out = np.empty(n_max + 1, dtype=np.float64)
    small = min(n_max + 1, 32)
    out[:small] = [math.lgamma(i + 1.0) for i in range(small)]
    x = np.arange(small, n_max + 1, dtype=np.float64)
    inv = 1.0 / x
    inv2 = inv * inv
    out[small:] = (x * np.log(x) - x + 0.5 * np.log(2.0 * np.pi * x)
                   + inv * (1 / 12 - inv2 * (1 / 360 - inv2 * (1 / 1260 - inv2 / 1680))))
    return out


class _BucketCost:
    """Predicted padded (cost, tokens) and objective price of buckets of one histogram under one objective and
    sizing."""

    def __init__(self, hist: LengthHistogram, sizing: BatchSizing, objective: str) -> None:
        self.hist, self.sizing, self.objective = hist, sizing, objective
        self.cum = np.concatenate([[0], np.cumsum(hist.counts)])  # (P+1,) samples below each position
        self.tok = hist.values.astype(np.float64)  # (P,)
        self.cost = sizing.g(hist.values)  # (P,)
        self.blocks = hist.queries is not None and sizing.block_budget is not None  # both budgets priced
        if self.blocks:
            self.cum_q = np.concatenate([[0], np.cumsum(hist.queries)]).astype(np.float64)  # (P+1,)
            self.top_q = [hist.max_queries]  # sparse table: top_q[j][i] = max of max_queries[i : i + 2^j]
            while 2 ** len(self.top_q) <= len(hist.values):
                prev, half = self.top_q[-1], 2 ** (len(self.top_q) - 1)
                self.top_q.append(np.maximum(prev[:-half], prev[half:]))
        if objective == "batch_max":
            if sizing.token_budget is None and sizing.batch_size is None:
                raise BucketError("objective='batch_max' needs a batch size: pass token_budget= or batch_size=")
            self.lf = _log_factorials(int(self.cum[-1]))
            self.dtok = np.diff(self.tok)  # (P-1,)
            self.dcost = np.diff(self.cost)  # (P-1,)

    def max_queries(self, lo: np.ndarray, hi: np.ndarray) -> np.ndarray | None:
        """(R,) the costliest sample's drafter queries in positions [lo, hi) (0 for an empty range); None
        without queries."""
        if not self.blocks:
            return None
        span = np.maximum(hi - lo, 1)
        j = np.floor(np.log2(span)).astype(np.int64)  # (R,) the largest 2^j <= span
        out = np.zeros(lo.shape, dtype=np.int64)
        for level in np.unique(j):
            sel = (j == level) & (hi > lo)
            t = self.top_q[int(level)]
            out[sel] = np.maximum(t[lo[sel]], t[hi[sel] - 2 ** int(level)])
        return out

    def sizes(self, lo: Any, hi: Any, edge: Any) -> np.ndarray | None:
        """(R,) batch sizes of the buckets [lo, hi) with upper edge `edge` under both budgets."""
        lo, hi, edge = np.broadcast_arrays(*(np.asarray(a, dtype=np.int64) for a in (lo, hi, edge)))
        return self.sizing.batch_sizes(edge, self.max_queries(lo, hi))

    def price(self, lo: Any, hi: Any, edge: Any) -> np.ndarray:
        """(R,) what the objective charges the buckets [lo, hi) with upper edge `edge`: their padded cost, plus
        with both budgets their drafter queries x token_budget / block_budget (the module docstring)."""
        cost = self.padded(lo, hi, edge)[0]
        if not self.blocks or self.sizing.token_budget is None:
            return cost
        lo, hi = np.broadcast_arrays(np.asarray(lo, dtype=np.int64), np.asarray(hi, dtype=np.int64))
        return cost + (self.cum_q[hi] - self.cum_q[lo]) * (self.sizing.token_budget / self.sizing.block_budget)

    def padded(self, lo: Any, hi: Any, edge: Any) -> tuple[np.ndarray, np.ndarray]:
        """Buckets holding positions [lo, hi) with upper edge `edge` tokens -> (cost, tokens) arrays (R,)."""
        lo, hi, edge = np.broadcast_arrays(*(np.asarray(a, dtype=np.int64) for a in (lo, hi, edge)))
        n = (self.cum[hi] - self.cum[lo]).astype(np.float64)
        if self.objective == "edge":
            return n * self.sizing.g(edge), n * edge
        b = self.sizes(lo, hi, edge).astype(np.int64)
        n_int = n.astype(np.int64)
        r = n_int % b
        full = (n_int - r).astype(np.float64)
        e_cost, e_tok = self._expected_max(lo, hi, np.minimum(b, np.maximum(n_int, 1)))
        r_cost, r_tok = self._expected_max(lo, hi, np.maximum(r, 1))
        return full * e_cost + r * r_cost, full * e_tok + r * r_tok

    def _expected_max(self, lo: np.ndarray, hi: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """E[g(max)], E[max] of b samples drawn without replacement from positions [lo, hi), each (R,).

        Summation by parts: E[h(max)] = h(v_top) - sum_{t < top} (h(v_{t+1}) - h(v_t)) P(max <= v_t), where
        P(max <= v_t) = C(a_t, b) / C(n, b) with a_t the members <= v_t. Terms are taken from the top down in
        column chunks. P rises with t and the differences below t sum to at most h(v_top), so a row stops once
        P(max <= v_t) < 1e-17 h(v_lo) / h(v_top): the dropped remainder is below 1e-17 of its E[h(max)].
        """
        cum, lf = self.cum, self.lf
        n = cum[hi] - cum[lo]  # (R,)
        top = np.maximum(hi - 1, 0)
        e_cost, e_tok = self.cost[top].copy(), self.tok[top].copy()  # (R,)
        live = (n > 0) & (hi - lo >= 2)  # a single distinct length needs no sum
        if not live.any():
            return e_cost, e_tok
        rows = np.flatnonzero(live)
        lo, hi, b, n = lo[rows], hi[rows], b[rows], n[rows]
        log_den = lf[n] - lf[n - b]  # (R,) ln C(n, b) + ln b!
        tol = 1e-17 * self.cost[lo] / self.cost[hi - 1]  # (R,)
        base = cum[lo]  # (R,)
        sub_cost, sub_tok = np.zeros(len(rows)), np.zeros(len(rows))
        chunk = max(16, (1 << 19) // len(rows))
        stop = int(hi.max()) - 1  # exclusive end of the columns t (t <= hi - 2)
        active = np.ones(len(rows), dtype=bool)
        while active.any():
            start = max(int(lo[active].min()), stop - chunk)
            t = np.arange(start, stop)  # (C,)
            sel = np.flatnonzero(active & (lo < stop) & (hi - 2 >= start))  # rows with columns in this chunk
            if sel.size:
                a = cum[t + 1][None, :] - base[sel, None]  # (S, C) members <= values[t]
                bb = b[sel, None]
                ok = (a >= bb) & (t[None, :] <= hi[sel, None] - 2)  # a >= b also implies t >= lo
                a = np.minimum(np.maximum(a, bb), n[sel, None])  # masked entries stay finite (exp <= 1)
                p = np.exp(lf[a] - lf[a - bb] - log_den[sel, None]) * ok  # (S, C) P(max <= values[t])
                sub_cost[sel] += p @ self.dcost[t]
                sub_tok[sel] += p @ self.dtok[t]
                done = (p[:, 0] < tol[sel]) & (hi[sel] - 2 >= start)
                active[sel[done]] = False
            active &= lo < start
            stop = start
        e_cost[rows] -= sub_cost
        e_tok[rows] -= sub_tok
        return e_cost, e_tok


# ---------------------------------------------------------------------------------------------------------
# The plan


@dataclass(frozen=True)
class BucketPlan:
    """Bucket edges and what they are predicted to cost. Written by notebook 02 as plan.json, read by training."""

    edges: tuple[int, ...]  # (K,) inclusive upper edges in tokens, ascending; edges[-1] == max_len
    counts: tuple[int, ...]  # (K,) samples in each bucket
    batch_sizes: tuple[int, ...] | None  # (K,) samples per batch (token budget or fixed size); None if neither
    efficiency: float  # predicted real tokens / padded tokens under the objective
    capacity_utilisation: float | None  # real cost / (steps * token_budget); None without a budget
    steps_per_epoch: int | None  # sum over buckets of ceil(count / batch_size); None without batch sizes
    objective: str  # "edge" | "batch_max"
    cost: str  # "linear" | "quadratic"
    q: float | None  # quadratic cost scale in tokens
    token_budget: int | None  # cost units per batch including padding
    multiple: int  # batch sizes were rounded down to a multiple of this
    max_len: int  # longest allowed sample, tokens
    objective_value: float  # what the objective charges one epoch: the padded cost (sum of g over padded slots),
    # with a block budget + the drafter queries x token_budget / block_budget
    exact: bool  # True: proven optimal over every boundary set; False: grid search, a baseline or given edges
    method: str  # "optimal" | "seed" | "equal_length" | "given"
    corpus: dict[str, Any] | None = None  # the corpus planned for (notebook 02: source, store_key, samples);
    # training refuses the plan for a token store with another key. None = not recorded (never checked)
    block_budget: int | None = None  # drafter query tokens per batch the plan was priced with; None = none

    @property
    def k(self) -> int:
        return len(self.edges)

    @property
    def lower_edges(self) -> tuple[int, ...]:
        """(K,) exclusive lower edges: bucket i holds (lower_edges[i], edges[i]]."""
        return (0,) + self.edges[:-1]

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)

    @classmethod
    def from_json(cls, text: str) -> "BucketPlan":
        """Inverse of to_json; refuses missing or unknown keys with a BucketError naming them (`corpus` and
        `block_budget` may be missing: plans written before they were recorded)."""
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as e:
            raise BucketError(f"plan JSON does not parse: {e}") from None
        if not isinstance(raw, dict):
            raise BucketError(f"plan JSON must be an object, got {type(raw).__name__}")
        names = {f.name for f in fields(cls)}
        if missing := names - raw.keys() - {"corpus", "block_budget"}:
            raise BucketError(f"plan JSON lacks {sorted(missing)}")
        if unknown := raw.keys() - names:
            raise BucketError(f"plan JSON has unknown keys {sorted(unknown)}")
        for key in ("edges", "counts", "batch_sizes"):
            if raw[key] is not None:
                raw[key] = tuple(int(v) for v in raw[key])
        plan = cls(**raw)
        if len(plan.counts) != plan.k or (plan.batch_sizes is not None and len(plan.batch_sizes) != plan.k):
            raise BucketError(f"plan JSON: edges, counts and batch_sizes differ in length ({plan.k} edges)")
        _check_edges(plan.edges, plan.max_len)
        return plan


def bucket_of(lengths: Any, edges: Sequence[int]) -> np.ndarray:
    """Bucket index of each of `lengths` (tokens): int64 of their shape (0-d for one length; int() it).

    `edges` are the buckets' inclusive upper edges, ascending: bucket i holds (edges[i-1], edges[i]], so a length
    equal to an edge is in that edge's bucket, one token more in the next, and every length <= edges[0] (0 too)
    in bucket 0. A length above the last edge is refused with a BucketError naming it (the last edge must reach
    max_len), as are edges that are empty, not ints, not positive or not strictly ascending."""
    e = _check_edges(edges)
    x = np.asarray(lengths)
    if x.size and x.max() > e[-1]:
        i = int(np.argmax(x))  # the first of the longest (a flat index)
        which = "a sample" if x.ndim == 0 else f"sample {i}"
        raise BucketError(f"edges {e.tolist()} do not cover {which} of {int(x.flat[i])} tokens: the last edge must "
                          f"reach max_len")
    return np.searchsorted(e, x, side="left")


def _check_edges(edges: Sequence[int], max_len: int = 0) -> np.ndarray:
    """`edges` as (K,) int64 once they are a non-empty, positive, strictly ascending list of ints whose last one
    reaches max_len (tokens; 0 checks no length)."""
    e = np.asarray(edges)
    if e.ndim != 1 or e.size == 0:
        raise BucketError(f"edges must be a non-empty list of ints, got {list(edges)!r}")
    if e.dtype.kind not in "iu":
        raise BucketError(f"edges must be ints (tokens), got {list(edges)!r}")
    if (e < 1).any() or (np.diff(e) <= 0).any():
        raise BucketError(f"edges must be positive and strictly ascending, got {e.tolist()}")
    if e[-1] < max_len:
        raise BucketError(f"edges {e.tolist()} do not cover max_len={max_len}: the last edge must be >= max_len")
    return e.astype(np.int64)


def _make_plan(hist: LengthHistogram, sizing: BatchSizing, objective: str, positions: np.ndarray,
               edges: np.ndarray, method: str, exact: bool, coster: _BucketCost | None = None) -> BucketPlan:
    """positions: (K+1,) histogram cut positions (0 first, P last); edges: (K,) upper edges in tokens."""
    lo, hi = positions[:-1], positions[1:]
    coster = coster or _BucketCost(hist, sizing, objective)
    _, tokens = coster.padded(lo, hi, edges)
    cost = coster.price(lo, hi, edges)
    counts = coster.cum[hi] - coster.cum[lo]
    sizes = coster.sizes(lo, hi, edges)
    steps = None if sizes is None else int(np.sum(-(-counts // sizes)))
    capacity = None
    if sizing.token_budget is not None and steps:
        capacity = float(np.sum(sizing.g(hist.values) * hist.counts) / (steps * sizing.token_budget))
    return BucketPlan(
        edges=tuple(int(e) for e in edges), counts=tuple(int(c) for c in counts),
        batch_sizes=None if sizes is None else tuple(int(b) for b in sizes),
        efficiency=float(hist.real_tokens / tokens.sum()), capacity_utilisation=capacity, steps_per_epoch=steps,
        objective=objective, cost=sizing.cost, q=sizing.q, token_budget=sizing.token_budget,
        multiple=sizing.multiple, max_len=hist.max_len, objective_value=float(cost.sum()), exact=exact,
        method=method, block_budget=sizing.block_budget if coster.blocks else None)


def _plan_from_cuts(hist: LengthHistogram, sizing: BatchSizing, objective: str, cuts: Sequence[int],
                    method: str, exact: bool, coster: _BucketCost | None = None) -> BucketPlan:
    """cuts: inner cut positions (ascending, in 1..P-1); the edge of each bucket is its top histogram value."""
    positions = np.concatenate([[0], np.asarray(cuts, dtype=np.int64), [len(hist.values)]])
    return _make_plan(hist, sizing, objective, positions, hist.values[positions[1:] - 1], method, exact, coster)


def _setup(lengths: Any, k: int, max_len: int, objective: str, cost: str, q: float | None,
           token_budget: int | None, batch_size: int | None, multiple: int, policy: str, queries: Any = None,
           block_budget: int | None = None) -> tuple[LengthHistogram, BatchSizing, int]:
    """The histogram, the batch sizing and the number of buckets to plan: k, or one per distinct length (plus the
    top one up to max_len) when the lengths have fewer (a small corpus trains with the buckets it can have; one
    warning line says so)."""
    if objective not in OBJECTIVES:
        raise BucketError(f"objective must be one of {list(OBJECTIVES)}, got {objective!r}")
    if (queries is None) != (block_budget is None):
        raise BucketError("queries (drafter query tokens per sample) and block_budget go together: pass both or "
                          "neither")
    hist = length_histogram(lengths, max_len=max_len, policy=policy, queries=queries)
    sizing = BatchSizing(cost, q, token_budget, batch_size, multiple, block_budget)
    if hist.max_queries is not None and int(hist.max_queries.max()) > block_budget:
        raise BucketError(f"a sample needs {int(hist.max_queries.max())} drafter query tokens, more than "
                          f"block_budget {block_budget}: it can never fit a batch")
    if not (isinstance(k, (int, np.integer)) and k >= 1):
        raise BucketError(f"k must be an int >= 1, got {k!r}")
    if k > len(hist.values):  # one bucket per distinct length (+ the top one up to max_len) is all there is
        top = "" if hist.counts[-1] else f", the last one up to max_len={hist.max_len}"
        log.warning("k=%d buckets requested, but the %d sample(s) have only %d distinct length(s): planning %d "
                    "bucket(s), one per length%s", k, hist.num_samples, hist.num_distinct, len(hist.values), top)
        k = len(hist.values)
    if token_budget is not None:
        sizing.batch_sizes([max_len])  # a budget below the longest allowed sample is refused here
    if objective == "batch_max" and token_budget is None and batch_size is None:
        raise BucketError("objective='batch_max' needs a batch size: pass token_budget= or batch_size=")
    return hist, sizing, int(k)


# ---------------------------------------------------------------------------------------------------------
# Exact dynamic programmes


def _edge_layers(hist: LengthHistogram, sizing: BatchSizing, k_max: int) -> list[np.ndarray]:
    """Edge objective: optimal inner cuts for every k in 1..k_max (list index k-1).

    F_k(j) = min_{i<j} F_{k-1}(i) + g(values[j-1]) * (cum[j] - cum[i]). The bucket cost obeys the quadrangle
    inequality (g nondecreasing), so the leftmost optimal split opt_k(j) is nondecreasing in j and each layer is
    found by divide and conquer: O(P log P) per layer, all recursion segments of one depth evaluated at once.
    """
    P = len(hist.values)
    cum = np.concatenate([[0], np.cumsum(hist.counts)]).astype(np.float64)
    top = np.concatenate([[0.0], sizing.g(hist.values)])  # top[j] = g(edge of a bucket ending at position j)
    prev = np.full(P + 1, np.inf)
    prev[0] = 0.0
    args: list[np.ndarray] = []
    for k in range(1, k_max + 1):
        cur = np.full(P + 1, np.inf)
        arg = np.zeros(P + 1, dtype=np.int64)
        if k == 1:
            cur[1:] = top[1:] * cum[1:]
        else:
            _dc_layer(prev, cur, arg, cum, top, lo_j=k, hi_j=P, lo_i=k - 1)
        args.append(arg)
        prev = cur
    plans = []
    for k in range(1, k_max + 1):
        cuts, j = [], P
        for layer in range(k - 1, 0, -1):
            j = int(args[layer][j])
            cuts.append(j)
        plans.append(np.asarray(cuts[::-1], dtype=np.int64))
    return plans


def _dc_layer(prev: np.ndarray, cur: np.ndarray, arg: np.ndarray, cum: np.ndarray, top: np.ndarray,
              lo_j: int, hi_j: int, lo_i: int) -> None:
    """Fill cur[j], arg[j] for j in [lo_j, hi_j] by divide and conquer over monotone leftmost argmins."""
    jl, jr = np.array([lo_j]), np.array([hi_j])
    ol, orr = np.array([lo_i]), np.array([hi_j - 1])
    while jl.size:
        mid = (jl + jr) // 2
        c_lo, c_hi = ol, np.minimum(orr, mid - 1)
        n = c_hi - c_lo + 1  # (S,) candidates per segment, >= 1
        starts = np.concatenate([[0], np.cumsum(n)[:-1]])
        seg = np.repeat(np.arange(mid.size), n)
        i = np.arange(int(n.sum())) - starts[seg] + c_lo[seg]  # (L,) candidate split positions
        j = mid[seg]
        vals = prev[i] + top[j] * (cum[j] - cum[i])  # (L,)
        best = np.minimum.reduceat(vals, starts)  # (S,)
        first = np.flatnonzero(vals == best[seg])
        pick = first[np.unique(seg[first], return_index=True)[1]]  # leftmost argmin of each segment
        cur[mid], arg[mid] = best, i[pick]
        left, right = jl <= mid - 1, mid + 1 <= jr
        jl, jr, ol, orr = (np.concatenate([jl[left], mid[right] + 1]), np.concatenate([mid[left] - 1, jr[right]]),
                           np.concatenate([ol[left], i[pick][right]]), np.concatenate([i[pick][left], orr[right]]))


def _grid_positions(hist: LengthHistogram, grid: int) -> tuple[np.ndarray, bool]:
    """Candidate inner cut positions for batch_max: all of 1..P-1 when they number <= grid (exact), else
    grid//2 count quantiles and grid//2 evenly spaced lengths (so the sparse long tail keeps candidates)."""
    P = len(hist.values)
    if P - 1 <= grid:
        return np.arange(1, P, dtype=np.int64), True
    cum = np.cumsum(hist.counts)
    by_count = np.searchsorted(cum, np.linspace(0, cum[-1], grid // 2 + 2)[1:-1], side="left") + 1
    by_length = np.searchsorted(hist.values, np.linspace(hist.values[0], hist.max_len, grid // 2 + 2)[1:-1],
                                side="right")
    cand = np.unique(np.concatenate([by_count, by_length]))
    return cand[(cand >= 1) & (cand <= P - 1)], False


def _batch_max_layers(hist: LengthHistogram, coster: _BucketCost, k_max: int, grid: int
                      ) -> tuple[list[np.ndarray], bool]:
    """batch_max objective: optimal inner cuts (among candidates) for every k in 1..k_max, and exactness."""
    cand, exact = _grid_positions(hist, grid)
    if len(cand) < k_max - 1:
        raise BucketError(f"grid={grid} leaves {len(cand)} candidate edges, fewer than k-1={k_max - 1}; raise grid")
    P = len(hist.values)
    pos = np.concatenate([[0], cand, [P]])  # (G+2,) grid index -> histogram position
    G = len(pos)
    W = np.full((G, G), np.inf)  # W[a, c]: bucket from grid point a to grid point c
    for c in range(1, G):
        rows = np.arange(c)
        W[rows, c] = coster.price(pos[rows], pos[c], hist.values[pos[c] - 1])
    prev = np.full(G, np.inf)
    prev[0] = 0.0
    args = []
    for _ in range(k_max):
        tot = prev[:, None] + W  # (G, G)
        arg = np.argmin(tot, axis=0)
        prev = tot[arg, np.arange(G)]
        args.append(arg)
    plans = []
    for k in range(1, k_max + 1):
        cuts, c = [], G - 1
        for layer in range(k - 1, 0, -1):
            c = int(args[layer][c])
            cuts.append(int(pos[c]))
        plans.append(np.asarray(cuts[::-1], dtype=np.int64))
    return plans, exact


def _solve(hist: LengthHistogram, coster: _BucketCost, objective: str, k_max: int, grid: int
           ) -> tuple[list[np.ndarray], bool]:
    """Optimal inner cut positions for every k in 1..k_max (list index k-1), and whether they are exact."""
    if objective == "edge":
        return _edge_layers(hist, coster.sizing, k_max), True
    return _batch_max_layers(hist, coster, k_max, grid)


# ---------------------------------------------------------------------------------------------------------
# Public API


def optimal_boundaries(lengths: Any, k: int, *, max_len: int, objective: str = "edge", cost: str = "linear",
                       q: float | None = None, token_budget: int | None = None, batch_size: int | None = None,
                       multiple: int = 1, policy: str = "truncate", queries: Any = None,
                       block_budget: int | None = None, grid: int = DEFAULT_GRID) -> BucketPlan:
    """The k bucket edges minimising what the objective charges one epoch of `lengths` (tokens).

    objective: "edge" (pad to the bucket's upper edge; exact, O(k M log M)) or "batch_max" (random batches
    padded to their longest member; exact when the distinct lengths number <= `grid`, else optimal among grid
    candidates, O(k G^2 + G^2 M) worst case). cost: "linear" or "quadratic" (needs q, tokens).
    token_budget (cost units incl. padding) or batch_size sets the batch sizes; batch_max needs one of them.
    multiple: round batch sizes down to a multiple of this. policy: lengths above max_len are cut
    ("truncate") or dropped ("drop"). queries (N,) drafter query tokens per sample with block_budget (query
    tokens per batch): both budgets size the batches and price them (module docstring); None = tokens only. Edges are observed lengths (an edge above a bucket's longest member only
    pads more, or shrinks its batches); edges[-1] == max_len, and that top bucket may be empty when no sample
    reaches max_len. Lengths with too few distinct values for k buckets get one bucket per value, the top one up
    to max_len (and a warning line).
    """
    hist, sizing, k = _setup(lengths, k, max_len, objective, cost, q, token_budget, batch_size, multiple, policy,
                            queries, block_budget)
    coster = _BucketCost(hist, sizing, objective)
    layers, exact = _solve(hist, coster, objective, k, grid)
    return _plan_from_cuts(hist, sizing, objective, layers[k - 1], "optimal", exact, coster)


def efficiency_vs_k(lengths: Any, k_max: int, *, max_len: int, objective: str = "edge", cost: str = "linear",
                    q: float | None = None, token_budget: int | None = None, batch_size: int | None = None,
                    multiple: int = 1, policy: str = "truncate", queries: Any = None,
                    block_budget: int | None = None, grid: int = DEFAULT_GRID) -> list[BucketPlan]:
    """Optimal plans for k = 1..min(k_max, P), from ONE dynamic programme (list index k-1); P = the distinct
    lengths, plus one when no sample reaches max_len (the top bucket's edge is always max_len)."""
    if not (isinstance(k_max, (int, np.integer)) and k_max >= 1):
        raise BucketError(f"k_max must be an int >= 1, got {k_max!r}")
    hist, sizing, _ = _setup(lengths, 1, max_len, objective, cost, q, token_budget, batch_size, multiple, policy,
                            queries, block_budget)
    k_top = min(int(k_max), len(hist.values))
    coster = _BucketCost(hist, sizing, objective)
    layers, exact = _solve(hist, coster, objective, k_top, grid)
    return [_plan_from_cuts(hist, sizing, objective, cuts, "optimal", exact, coster) for cuts in layers]


def choose_k(lengths: Any, *, max_len: int, distance: float, reference: float = 1.0, k_max: int = 16,
             **plan_kwargs: Any) -> BucketPlan:
    """The optimal plan with the SMALLEST k whose predicted efficiency is >= reference - distance.

    reference: the efficiency of packing to compare with (1.0 = packing pads nothing; pass a measured packing
    efficiency to be fairer). Raises BucketError naming the best k when no k <= k_max gets that close.
    """
    if not 0.0 <= distance < 1.0:
        raise BucketError(f"distance must be in [0, 1), got {distance!r}")
    plans = efficiency_vs_k(lengths, k_max, max_len=max_len, **plan_kwargs)
    for plan in plans:
        if plan.efficiency >= reference - distance:
            return plan
    best = max(plans, key=lambda p: p.efficiency)
    raise BucketError(f"no k <= {len(plans)} reaches efficiency {reference - distance:.4f} (reference "
                      f"{reference:.4f} - distance {distance}); best is {best.efficiency:.4f} at k={best.k}: "
                      f"raise k_max or distance")


def plan_for_edges(lengths: Any, edges: Sequence[int], *, max_len: int, objective: str = "edge",
                   cost: str = "linear", q: float | None = None, token_budget: int | None = None,
                   batch_size: int | None = None, multiple: int = 1, policy: str = "truncate",
                   queries: Any = None, block_budget: int | None = None,
                   method: str = "given") -> BucketPlan:
    """Evaluate GIVEN edges (tokens, ascending, last >= max_len) with the same predictions as the optimum.
    Edges need not be observed lengths; samples are padded to / batched by the edge values as given."""
    if method not in METHODS:
        raise BucketError(f"method must be one of {list(METHODS)}, got {method!r}")
    hist, sizing, _ = _setup(lengths, 1, max_len, objective, cost, q, token_budget, batch_size, multiple, policy,
                            queries, block_budget)
    e = _check_edges(edges, max_len)
    if token_budget is not None:
        sizing.batch_sizes(e)
    positions = np.concatenate([[0], np.searchsorted(hist.values, e, side="right")])
    return _make_plan(hist, sizing, objective, positions, e, method, exact=False)


def seed_boundaries(lengths: Any, k: int, *, max_len: int, objective: str = "edge", cost: str = "linear",
                    q: float | None = None, token_budget: int | None = None, batch_size: int | None = None,
                    multiple: int = 1, policy: str = "truncate", queries: Any = None,
                    block_budget: int | None = None, grid: int = DEFAULT_GRID,
                    max_sweeps: int = 100) -> BucketPlan:
    """Baseline: the reference run's method (plan method "seed"). Start from a geometric progression of edges
    between the shortest length and max_len, then coordinate descent: move one inner edge at a time to its best
    position between its neighbours (an exact 1-D search), sweeping until no edge moves. A local optimum. The
    candidate positions are those optimal_boundaries searches (every observed length; for batch_max, its grid),
    so the optimum is never worse than this baseline."""
    hist, sizing, k = _setup(lengths, k, max_len, objective, cost, q, token_budget, batch_size, multiple, policy,
                            queries, block_budget)
    P = len(hist.values)
    allowed = np.arange(1, P) if objective == "edge" else _grid_positions(hist, grid)[0]  # candidate cuts
    if len(allowed) < k - 1:
        raise BucketError(f"grid={grid} leaves {len(allowed)} candidate edges, fewer than k-1={k - 1}; raise grid")
    lo_len = max(1, int(hist.values[hist.counts > 0][0]))
    geometric = lo_len * (max_len / lo_len) ** (np.arange(1, k) / k)
    slots = np.searchsorted(allowed, np.searchsorted(hist.values, geometric, side="right"))  # into `allowed`
    slots = np.clip(slots, 0, len(allowed) - 1)
    for m in range(1, k - 1):  # make the slots strictly increasing while staying inside `allowed`
        slots[m] = max(slots[m], slots[m - 1] + 1)
    if k > 1:
        slots[-1] = min(slots[-1], len(allowed) - 1)
    for m in range(k - 3, -1, -1):
        slots[m] = min(slots[m], slots[m + 1] - 1)
    cuts = allowed[slots]
    coster = _BucketCost(hist, sizing, objective)
    for _ in range(max_sweeps):
        moved = False
        for m in range(k - 1):
            left = cuts[m - 1] if m > 0 else 0
            right = cuts[m + 1] if m + 1 < k - 1 else P
            cand = allowed[(allowed > left) & (allowed < right)]  # (C,) positions for this edge
            total = (coster.price(left, cand, hist.values[cand - 1])
                     + coster.price(cand, right, hist.values[right - 1]))
            best = int(np.argmin(total))
            if total[best] < total[int(np.searchsorted(cand, cuts[m]))]:
                cuts[m], moved = int(cand[best]), True
        if not moved:
            break
    return _plan_from_cuts(hist, sizing, objective, cuts, "seed", False, coster)


def equal_length_boundaries(lengths: Any, k: int, *, max_len: int, objective: str = "edge",
                            cost: str = "linear", q: float | None = None, token_budget: int | None = None,
                            batch_size: int | None = None, multiple: int = 1, policy: str = "truncate",
                            queries: Any = None, block_budget: int | None = None) -> BucketPlan:
    """Baseline: lhotse's rule, equal TOTAL length per bucket. Edge m (1..k-1) is the shortest length at which
    the running token total reaches m/k of all tokens. Repeated edges merge, so a length holding more than 1/k
    of the tokens (e.g. a pile at max_len under truncation) leaves fewer than k buckets."""
    hist, sizing, k = _setup(lengths, k, max_len, objective, cost, q, token_budget, batch_size, multiple, policy,
                            queries, block_budget)
    running = np.cumsum(hist.values * hist.counts)
    targets = running[-1] * np.arange(1, k) / k
    cuts = np.unique(np.searchsorted(running, targets, side="left") + 1)
    cuts = cuts[(cuts >= 1) & (cuts <= len(hist.values) - 1)]
    return _plan_from_cuts(hist, sizing, objective, cuts, "equal_length", exact=False)
