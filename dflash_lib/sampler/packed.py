"""PackedSampler: a random order packed into rows of at most token_budget tokens, documents laid end to end
(attention kept inside each document via cu_seqlens). No padding except row tails, full random order.

Packer: best fit within a window of open rows. Samples arrive in random order; each goes to the open row with
the LEAST room that still holds it; a new row opens when none does; when more than `window` rows are open, the
fullest is closed. First-fit-decreasing would pack tighter but sorts the data (no randomness); the window keeps
the order random and reaches ~98-99% on chat length distributions. Closed rows are served in a shuffled order.
"""

from __future__ import annotations

from bisect import bisect_left, insort
from typing import Any

import numpy as np

from dflash_lib.sampler.base import EpochBatchSampler, EpochPlan, SamplerError, shard_in_order


def pack_rows(lengths: np.ndarray, budget: int, window: int) -> tuple[np.ndarray, np.ndarray]:
    """Pack samples of `lengths` tokens (n,), in the given order, into rows of <= budget tokens.

    Returns (positions (n,), offsets (R + 1,)): row r holds positions[offsets[r]:offsets[r+1]] (indices into
    `lengths`), rows in the order they were closed.
    """
    x = lengths.tolist()
    smallest = min(x)
    open_rows: list[tuple[int, int]] = []  # (room left in tokens, row id), ascending
    rows: list[list[int]] = []
    closed: list[int] = []
    for pos, length in enumerate(x):
        i = bisect_left(open_rows, (length, -1))  # the tightest open row with room >= length
        if i < len(open_rows):
            room, rid = open_rows.pop(i)
            rows[rid].append(pos)
            room -= length
        else:
            rid, room = len(rows), budget - length
            rows.append([pos])
        if room < smallest:
            closed.append(rid)
            continue
        insort(open_rows, (room, rid))
        if len(open_rows) > window:
            closed.append(open_rows.pop(0)[1])  # the fullest row leaves the window
    closed.extend(rid for _, rid in open_rows)
    sizes = np.fromiter((len(rows[r]) for r in closed), dtype=np.int64, count=len(closed))
    positions = np.fromiter((p for r in closed for p in rows[r]), dtype=np.int64, count=len(x))
    return positions, np.concatenate([[0], np.cumsum(sizes)])


def cu_seqlens(batch: list[int] | np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """(D + 1,) int32 cumulative document lengths of a packed row (flash-attn varlen's cu_seqlens)."""
    return np.concatenate([[0], np.cumsum(lengths[np.asarray(batch, dtype=np.int64)])]).astype(np.int32)


class PackedSampler(EpochBatchSampler):
    """Each batch is ONE row: a list of sample indices whose lengths sum to <= token_budget tokens."""

    def __init__(self, lengths: Any, token_budget: int, seed: int = 0, *, rank: int = 0, world_size: int = 1,
                 window: int = 64) -> None:
        super().__init__(lengths, seed=seed, rank=rank, world_size=world_size)
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

    def _plan(self, epoch: int, rng: np.random.Generator) -> EpochPlan:
        perm = rng.permutation(len(self.lengths))
        positions, offsets = pack_rows(self.lengths[perm], self.token_budget, self.window)
        return shard_in_order(perm[positions], offsets, self.world_size, rng.permutation(len(offsets) - 1))
