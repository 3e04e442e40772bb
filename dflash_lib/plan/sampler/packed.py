"""PackedSampler: a random order packed into rows of at most token_budget tokens, documents laid end to end
(attention kept inside each document via cu_seqlens). No padding except row tails, full random order.

Packer: best fit within a window of open rows. Samples arrive in random order; each goes to the open row with
the LEAST room that still holds it; a new row opens when none does; when more than `window` rows are open, the
fullest is closed. First-fit-decreasing would pack tighter but sorts the data (no randomness); the window keeps
the order random and packs chat lengths nearly as tight (docs/batching.md). Closed rows are served in a shuffled
order.
"""

from __future__ import annotations

from bisect import bisect_left, insort
from typing import Any

import numpy as np

from dflash_lib.plan.sampler.base import EpochBatchSampler, EpochPlan, shard_in_order
from dflash_lib.plan.sampler.budget import BatchBudget, Bound, SamplerError, TokenBudget


def pack_rows(lengths: np.ndarray, budget: int, window: int, queries: np.ndarray | None = None,
              block_budget: int | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Pack samples of `lengths` tokens (n,), in the given order, into rows of <= budget tokens and, given
    `queries` (n,) drafter query tokens, <= block_budget query tokens (each sample must fit on its own): the
    packed `BatchBudget`.

    With two budgets, best fit runs on the one the data fills faster (sum(queries) / block_budget against
    sum(lengths) / budget), and the open rows are scanned from the tightest fit for room in the other one: the
    scan stays short because the other one rarely binds. Without queries, exactly the tokens-only packer.
    Returns (positions (n,), offsets (R + 1,), bound (R,) int8): row r holds positions[offsets[r]:offsets[r+1]]
    (indices into `lengths`), rows in the order they were closed; bound[r] is the `Bound` of the sample that
    closed it: the one it could not take when it left the window (the sample opened a row of its own), or the
    data's smallest when the row had no room left for it; NONE for the rows still open at the end.
    """
    x = lengths.tolist()
    if queries is None:
        first, second, cap1, cap2 = x, [0] * len(x), budget, 0  # the second budget never binds
        why1, why2 = Bound.TOKENS, Bound.NONE
    elif int(queries.sum()) * budget > int(lengths.sum()) * block_budget:  # drafter queries fill rows first
        first, second, cap1, cap2 = queries.tolist(), x, int(block_budget), budget
        why1, why2 = Bound.BLOCKS, Bound.TOKENS
    else:
        first, second, cap1, cap2 = x, queries.tolist(), budget, int(block_budget)
        why1, why2 = Bound.TOKENS, Bound.BLOCKS
    smallest1, smallest2 = min(first), min(second)
    open_rows: list[tuple[int, int]] = []  # (room left in the first budget, row id), ascending
    room2: list[int] = []  # room left in the second budget, by row id
    rows: list[list[int]] = []
    closed: list[int] = []
    why: dict[int, int] = {}  # closed row id -> the Bound of the sample it refused
    for pos, (need1, need2) in enumerate(zip(first, second)):
        i = bisect_left(open_rows, (need1, -1))  # the tightest open row with room >= need1 ...
        if need2:
            while i < len(open_rows) and room2[open_rows[i][1]] < need2:  # ... and room for need2
                i += 1
        if i < len(open_rows):
            room, rid = open_rows.pop(i)
            rows[rid].append(pos)
            room -= need1
            room2[rid] -= need2
        else:
            rid, room = len(rows), cap1 - need1
            rows.append([pos])
            room2.append(cap2 - need2)
        if room < smallest1 or room2[rid] < smallest2:  # no sample of the data fits it any more
            closed.append(rid)
            why[rid] = int(why1 * (room < smallest1) | why2 * (room2[rid] < smallest2))
            continue
        insort(open_rows, (room, rid))
        if len(open_rows) > window:  # a row was opened for this sample: the fullest row leaves the window
            room, out = open_rows.pop(0)
            closed.append(out)
            why[out] = int(why1 * (room < need1) | why2 * (room2[out] < need2))
    closed.extend(rid for _, rid in open_rows)
    sizes = np.fromiter((len(rows[r]) for r in closed), dtype=np.int64, count=len(closed))
    positions = np.fromiter((p for r in closed for p in rows[r]), dtype=np.int64, count=len(x))
    bound = np.fromiter((why.get(r, 0) for r in closed), dtype=np.int8, count=len(closed))
    return positions, np.concatenate([[0], np.cumsum(sizes)]), bound


def cu_seqlens(batch: list[int] | np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """(D + 1,) int32 cumulative document lengths of a packed row (flash-attn varlen's cu_seqlens)."""
    return np.concatenate([[0], np.cumsum(lengths[np.asarray(batch, dtype=np.int64)])]).astype(np.int32)


class PackedSampler(EpochBatchSampler):
    """Each batch is ONE row: a list of sample indices whose lengths sum to <= token_budget tokens and (given
    `queries`) whose drafter query tokens sum to <= block_budget."""

    def __init__(self, lengths: Any, token_budget: int, seed: int = 0, *, rank: int = 0, world_size: int = 1,
                 window: int = 64, queries: Any = None, block_budget: int | None = None) -> None:
        super().__init__(lengths, seed=seed, rank=rank, world_size=world_size, queries=queries,
                         block_budget=block_budget)
        if not (isinstance(token_budget, (int, np.integer)) and token_budget >= 1):
            raise SamplerError(f"token_budget must be an int >= 1, got {token_budget!r}")
        if not (isinstance(window, (int, np.integer)) and window >= 1):
            raise SamplerError(f"window must be an int >= 1 (open rows), got {window!r}")
        longest = int(np.argmax(self.lengths))
        if self.lengths[longest] > token_budget:
            raise SamplerError(f"sample {longest} has {int(self.lengths[longest])} tokens, more than the packed "
                               f"row of token_budget={token_budget}: raise the budget or lower max_len")
        self.token_budget, self.window = int(token_budget), int(window)

    def _settings(self) -> dict[str, Any]:
        return {"token_budget": self.token_budget, "window": self.window}

    @property
    def batch_budget(self) -> BatchBudget:
        return BatchBudget(TokenBudget(self.token_budget), self.blocks, packed=True)

    def _plan(self, epoch: int, rng: np.random.Generator) -> EpochPlan:
        perm = rng.permutation(len(self.lengths))
        positions, offsets, bound = pack_rows(self.lengths[perm], self.token_budget, self.window,
                                              None if self.queries is None else self.queries[perm], self.block_budget)
        return shard_in_order(perm[positions], offsets, self.world_size, rng.permutation(len(offsets) - 1), bound)
