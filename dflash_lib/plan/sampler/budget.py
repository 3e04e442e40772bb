"""When is a batch full, kept apart from the samplers that decide the order: `TokenBudget` (the target's cost,
padding counted), `BlockBudget` (the drafter's query tokens) and `BatchBudget`, the one rule every sampler fills by:
a batch takes samples until the next one would pass either budget, and records which did (`Bound`).
`fill_in_order` applies it along a sequence, `PackedSampler` per row, `fixed_batch_sizes` to a bucket's worst batch.

Why two budgets and how each sampler uses them: docs/batching.md, "The objective" and "The samplers".
"""

from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass
from enum import IntFlag
from typing import Any, Sequence

import numpy as np

from dflash_lib.config import BucketConfig, ModelConfig, SamplerConfig
from dflash_lib.plan.buckets import BatchSizing, BucketError, SampleCost


class SamplerError(ValueError):
    """Bad sampler input or state; the message names the parameter, sample or key at fault."""


@dataclass(frozen=True)
class TokenBudget:
    """n samples with longest m fit iff n * g(m) <= tokens; g(l) = l, or l + l^2/q when q is set."""

    tokens: int  # budget per batch in cost units INCLUDING padding (tokens when linear)
    q: float | None = None  # quadratic cost scale in tokens; None = linear

    def __post_init__(self) -> None:
        if not (isinstance(self.tokens, (int, np.integer)) and self.tokens >= 1):
            raise SamplerError(f"token_budget must be an int >= 1, got {self.tokens!r}")
        if self.q is not None and not self.q > 0:
            raise SamplerError(f"q must be > 0 (tokens) or None, got {self.q!r}")

    @property
    def sizing(self) -> BatchSizing:
        return BatchSizing(SampleCost.of_q(self.q).cost, self.q, int(self.tokens))

    def cost(self, lengths: np.ndarray) -> np.ndarray:
        """g(lengths), float64, cost units."""
        return self.sizing.g(lengths)

    def capacity_table(self, max_len: int) -> np.ndarray:
        """(max_len + 1,) int64: most samples a batch whose longest member has l tokens may hold."""
        try:
            return self.sizing.capacity(np.arange(max_len + 1))
        except BucketError as e:
            raise SamplerError(str(e)) from None

    def check_longest(self, lengths: np.ndarray, what: str = "sample") -> None:
        """Refuse a budget below the cost of the longest sample (it could never be batched)."""
        i = int(np.argmax(lengths))
        if float(self.cost(lengths[i])) > self.tokens:
            raise SamplerError(f"token_budget {self.tokens} is below the cost {float(self.cost(lengths[i])):g} of "
                               f"{what} {i} ({int(lengths[i])} tokens): it can never fit a batch")


@dataclass(frozen=True)
class BlockBudget:
    """Drafter query tokens per batch: samples with queries q_i (anchors x block_size each) fit iff
    sum(q_i) <= queries. A config's value (0 = derived) is resolved by `resolve_block_budget`."""

    queries: int  # drafter query tokens per batch (anchor blocks x block_size, summed over the batch's samples)

    def __post_init__(self) -> None:
        if not (isinstance(self.queries, (int, np.integer)) and self.queries >= 1):
            raise SamplerError(f"block_budget must be an int >= 1 (drafter query tokens), got {self.queries!r}")

    def check_largest(self, queries: np.ndarray, what: str = "sample") -> None:
        """Refuse a budget below the queries of the costliest sample (it could never be batched)."""
        i = int(np.argmax(queries))
        if int(queries[i]) > self.queries:
            raise SamplerError(f"{what} {i} needs {int(queries[i])} drafter query tokens (anchors x block_size), "
                               f"more than block_budget {self.queries}: it can never fit a batch; raise "
                               f"block_budget or lower num_anchors")


class Bound(IntFlag):
    """Why a batch was closed: the budgets the next sample offered to it would have passed. NONE: neither (the
    data ran out, or a fixed batch size was reached); TOKENS | BLOCKS: both. Plans store it as int8 codes."""

    NONE = 0
    TOKENS = 1  # the token budget (target tokens, padding counted for padded rows)
    BLOCKS = 2  # the block budget (drafter query tokens)


@dataclass(frozen=True)
class BatchBudget:
    """The rule every sampler fills by: a batch of samples with lengths l_i (tokens) and drafter queries q_i fits
    iff its token cost <= tokens.tokens and (with `blocks`) sum(q_i) <= blocks.queries. Token cost: padded rows
    (one sample per row, padded to the longest, or to `row_len` with static shapes) n * g(max l_i); a packed row
    (documents end to end) sum(l_i) plain tokens (g is not applied: attention stays inside each document)."""

    tokens: TokenBudget
    blocks: BlockBudget | None = None  # None: the drafter's queries are not bounded
    packed: bool = False  # one packed row rather than padded rows

    def token_cost(self, lengths: Any, row_len: int = 0) -> float:
        """Cost units (tokens when linear) a batch of `lengths` (n,) tokens takes from the token budget."""
        x = np.asarray(lengths, dtype=np.int64)
        if x.size == 0:
            return 0.0
        if self.packed:
            return float(x.sum())
        return float(x.size * self.tokens.cost(max(int(x.max()), int(row_len))))

    def refusal(self, lengths: Any, queries: Any, length: int, query: int = 0) -> Bound:
        """The budgets a batch of `lengths` (n,) tokens and `queries` (n,) drafter queries (None: not counted)
        would pass by taking one more sample of `length` tokens and `query` drafter queries."""
        why = Bound.NONE
        if self.token_cost(np.append(np.asarray(lengths, dtype=np.int64), int(length))) > self.tokens.tokens:
            why |= Bound.TOKENS
        if self.blocks is not None and int(np.sum(queries if queries is not None else 0)) + int(query) > \
                self.blocks.queries:
            why |= Bound.BLOCKS
        return why

    def fill(self, lengths: Any, queries: Any = None, row_len: int = 0) -> tuple[float, float | None]:
        """How full a batch is: (its token cost / the token budget, its drafter queries / the block budget; None
        without a block budget or without `queries`)."""
        tokens = self.token_cost(lengths, row_len) / self.tokens.tokens
        if self.blocks is None or queries is None:
            return tokens, None
        return tokens, float(np.sum(queries)) / self.blocks.queries


def derived_block_budget(token_budget: int, max_len: int, num_anchors: int, block_size: int,
                         q: float | None = None) -> int:
    """The block budget `block_budget = 0` stands for, in drafter query tokens: what a batch of the longest
    documents the token budget admits costs the drafter, max(1, floor(token_budget / g(max_len))) rows x
    min(num_anchors, max_len - 1) anchors (a document of max_len tokens has at most max_len - 1) x block_size.
    The rule: no batch may cost the drafter more than a batch of full-length documents, so a dry run of the
    longest bucket's worst batch bounds every batch of every bucket (and of every strategy)."""
    rows = max(1, int(TokenBudget(token_budget, q).sizing.capacity(max_len)))
    return rows * min(num_anchors, max(1, max_len - 1)) * block_size


def resolve_block_budget(sampler: SamplerConfig, buckets: BucketConfig, model: ModelConfig, max_len: int) -> int:
    """Drafter query tokens per batch: `sampler.block_budget`, or when it is 0 the derived_block_budget of the
    sampler's token budget, `max_len` (tokens per sample, data.max_len), model.num_anchors and model.block_size
    (with the buckets' quadratic cost when the strategy prices batches by it; packed rows count plain tokens)."""
    if sampler.block_budget > 0:
        return int(sampler.block_budget)
    q = None if sampler.strategy == "packed" else SampleCost(buckets.cost, buckets.q).q
    return derived_block_budget(sampler.token_budget, max_len, model.num_anchors, model.block_size, q)


def check_queries(queries: Any, n: int, block_budget: Any) -> tuple[np.ndarray | None, BlockBudget | None]:
    """Validate a sampler's optional (queries, block_budget) pair: both None (no block budget) or an (n,) array of
    ints >= 0 (drafter query tokens per sample) with a budget no sample exceeds. Returns int64 queries, BlockBudget."""
    if queries is None and block_budget is None:
        return None, None
    if queries is None or block_budget is None:
        raise SamplerError("queries (drafter query tokens per sample) and block_budget go together: pass both "
                           "or neither")
    q = np.asarray(queries)
    if q.shape != (n,) or q.dtype.kind not in "iu":
        raise SamplerError(f"queries must be {n} ints (drafter query tokens per sample), got shape {q.shape} "
                           f"dtype {q.dtype}")
    q = q.astype(np.int64)
    bad = np.flatnonzero(q < 0)
    if bad.size:
        raise SamplerError(f"queries[{bad[0]}] = {q[bad[0]]}: drafter query tokens cannot be negative")
    budget = BlockBudget(block_budget)
    budget.check_largest(q)
    return q, budget


def fill_in_order(lengths: np.ndarray, capacity: np.ndarray, queries: np.ndarray | None = None,
                  block_budget: int | None = None, max_size: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """`BatchBudget`'s rule for padded rows over a sequence: cut it (in its given order) into consecutive batches,
    each grown while (n + 1) * g(max) <= budget, while (given `queries`) its drafter query tokens stay <=
    block_budget and (given `max_size`) while it holds fewer than max_size samples.

    lengths: (n,) tokens, in batch order. capacity: (max_len + 1,) from TokenBudget.capacity_table.
    queries: (n,) drafter query tokens, in the same order (None: tokens only). Returns (offsets (B + 1,) int64,
    bound (B,) int8): bound[b] is the `Bound` of the sample after batch b, the budgets it would have passed
    (NONE after the last batch, or where only max_size closed the batch).
    Any cap[longest of all] samples fit the tokens, so each batch starts with that many in one slice (cut where
    the prefix sum of queries passes the block budget, found by bisection) and grows one sample at a time only
    from there.
    """
    x = lengths.tolist()
    cap = capacity.tolist()
    n = len(x)
    if n == 0:
        return np.zeros(1, dtype=np.int64), np.zeros(0, dtype=np.int8)
    sure = cap[max(x)]
    if sure < 1:
        raise SamplerError(f"a sample of {max(x)} tokens does not fit the token budget")
    if max_size is not None:
        if not (isinstance(max_size, (int, np.integer)) and max_size >= 1):
            raise SamplerError(f"max_size must be an int >= 1 (samples per batch) or None, got {max_size!r}")
        sure = min(sure, int(max_size))
    if queries is not None:
        if block_budget is None or int(np.max(queries)) > block_budget:
            raise SamplerError(f"a sample of {int(np.max(queries))} drafter query tokens does not fit the "
                               f"block budget {block_budget}")
        prefix = np.concatenate([[0], np.cumsum(queries, dtype=np.int64)]).tolist()  # (n + 1,) queries before p
    offsets, bound = [0], []
    tokens, blocks = int(Bound.TOKENS), int(Bound.BLOCKS)
    p = 0
    while p < n:
        # end: the most samples from p whose queries fit, prefix[end] - prefix[p] <= block_budget
        end = n if queries is None else bisect_right(prefix, prefix[p] + block_budget, p + 1) - 1
        if max_size is not None:
            end = min(end, p + int(max_size))
        e = min(p + sure, end)
        m = max(x[p:e])
        while e < end:
            m2 = x[e] if x[e] > m else m
            if e - p + 1 > cap[m2]:
                break
            m, e = m2, e + 1
        why = 0  # plain ints: an IntFlag operation per batch would cost more than the fill itself
        if e < n:  # the sample the batch was offered last: which budgets it would have passed
            if e - p + 1 > cap[x[e] if x[e] > m else m]:
                why = tokens
            if queries is not None and prefix[e + 1] - prefix[p] > block_budget:
                why |= blocks
        offsets.append(e)
        bound.append(why)
        p = e
    return np.asarray(offsets, dtype=np.int64), np.asarray(bound, dtype=np.int8)


def greedy_fill(lengths: np.ndarray, capacity: np.ndarray, queries: np.ndarray | None = None,
                block_budget: int | None = None) -> np.ndarray:
    """The batch offsets (B + 1,) int64 of `fill_in_order` (same arguments), without the bounds."""
    return fill_in_order(lengths, capacity, queries, block_budget)[0]


def fixed_batch_sizes(budget: BatchBudget, edges: Sequence[int],
                      costliest: Sequence[np.ndarray] | None = None) -> list[int]:
    """Rows per batch of each bucket when every row is padded to its bucket's upper edge (static shapes): the
    most rows b whose WORST batch fits `budget`, b rows of edges[k] tokens and (given `costliest`, per bucket its
    samples' drafter queries in descending order) its b costliest samples; at least 1. The budgets row b + 1
    would pass: `worst_batch_refusal`."""
    sizes = []
    for k, edge in enumerate(edges):
        rows = int(budget.tokens.sizing.capacity(int(edge)))  # floor(tokens / g(edge))
        if budget.blocks is not None and costliest is not None:
            top = np.cumsum(np.asarray(costliest[k], dtype=np.int64))  # (n_k,) queries of the b costliest
            if top.size and top[-1] > budget.blocks.queries:  # otherwise the whole bucket fits the queries
                rows = min(rows, int(np.searchsorted(top, budget.blocks.queries, side="right")))
        sizes.append(max(1, rows))
    return sizes


def worst_batch_refusal(budget: BatchBudget, rows: int, edge: int, costliest: np.ndarray | None = None) -> Bound:
    """The budgets a bucket's worst batch of `rows` rows padded to `edge` tokens would pass with one row more: the
    token budget for rows + 1 rows of edge tokens, the block budget for the rows + 1 costliest samples
    (`costliest`: the bucket's drafter queries in descending order). NONE when the bucket holds `rows` samples
    or fewer (it never makes a batch of rows + 1)."""
    if costliest is not None and len(costliest) <= rows:
        return Bound.NONE
    top = None if costliest is None else np.asarray(costliest[:rows + 1], dtype=np.int64)
    return budget.refusal(np.full(rows, int(edge)), None if top is None else top[:rows], int(edge),
                          0 if top is None else int(top[rows]))


def split_by_budget(lengths: np.ndarray, token_budget: int, q: float | None = None) -> list[np.ndarray]:
    """The batches `greedy_fill` cuts `lengths` (n,) tokens, in their given order, into under `token_budget`
    (padding counted; g from q as in TokenBudget): a list of B arrays of the batches' lengths."""
    x = np.asarray(lengths, dtype=np.int64)
    if x.size == 0:
        return []
    offsets = greedy_fill(x, TokenBudget(token_budget, q).capacity_table(int(x.max())))
    return np.split(x, offsets[1:-1])
