"""The worst-case batch of a bucket and of the packed strategy: the most documents the token budget admits,
each with as many anchors as the block budget allows, anchors at the end of each document (the longest
contexts). docs/scale.md, "The paper scale, proven on a CPU: the dry run".
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from dflash_lib.config import Config, ConfigError
from dflash_lib.data.batch import Batch, collate_packed, collate_padded
from dflash_lib.plan.buckets import SampleCost
from dflash_lib.plan.sampler.budget import TokenBudget


# -- worst-case batches --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class WorstBatch:
    """The costliest micro-batch a bucket (or the packer) can produce: documents and the anchors of each."""

    label: str  # "bucket i" or "packed"
    bucket: int  # bucket index, -1 for packed
    lower: int  # exclusive lower edge (tokens)
    edge: int  # inclusive upper edge (tokens)
    lengths: tuple[int, ...]  # tokens of each document
    anchors: tuple[int, ...]  # anchors of each document (its valid anchor positions, all drawn)
    block_size: int  # B
    row_len: int = 0  # packed: tokens of the row; 0 = padded, one document per row

    @property
    def docs(self) -> int:
        return len(self.lengths)

    @property
    def target_tokens(self) -> int:
        """Token slots of the batch (padding included); the target runs only the real ones, sum(lengths)."""
        return self.row_len if self.row_len else self.docs * max(self.lengths)

    @property
    def drafter_queries(self) -> int:
        """Drafter query tokens, anchors x block_size."""
        return sum(self.anchors) * self.block_size


def _fill_anchors(n: int, per_doc: int, block_size: int, block_budget: int | None) -> list[int]:
    """Anchors of n documents that can hold `per_doc` each: the first ones full until the block budget (query
    tokens) is spent, one partial, the rest none."""
    left = math.inf if block_budget is None else block_budget // block_size  # anchors the budget allows
    out = []
    for _ in range(n):
        a = int(min(per_doc, left))
        out.append(a)
        left -= a
    return out


def worst_bucket_batch(bucket: int, lower: int, edge: int, config: Config, block_budget: int | None) -> WorstBatch:
    """The worst batch of bucket (lower, edge] (module docstring): rows from the token budget's fill rule."""
    sc, mc = config.sampler, config.model
    q = SampleCost(config.buckets.cost, config.buckets.q).q
    n = int(TokenBudget(sc.token_budget, q).sizing.capacity(edge))
    if n < 1:
        raise ConfigError(f"bucket {bucket} ({lower}, {edge}]: not one document of {edge} tokens fits token_budget "
                          f"{sc.token_budget}")
    anchors = _fill_anchors(n, min(mc.num_anchors, edge - 1), mc.block_size, block_budget)
    return WorstBatch(f"bucket {bucket}", bucket, lower, edge, (edge,) * n, tuple(anchors), mc.block_size)


def worst_packed_batch(config: Config, block_budget: int | None) -> WorstBatch:
    """One packed row of token_budget tokens with the worst mix (module docstring)."""
    T, L, mc = config.sampler.token_budget, config.data.max_len, config.model
    most = max(1, T // (mc.num_anchors + 1))  # documents the row holds at num_anchors anchors each
    anchors = [a for a in _fill_anchors(most, mc.num_anchors, mc.block_size, block_budget) if a > 0] or [0]
    length = min(L, T // len(anchors))  # as long as the row allows: later anchors, longer contexts
    lengths, anchors = [length] * len(anchors), [min(a, length - 1) for a in anchors]
    rest = T - sum(lengths)
    while rest >= 2:  # filler documents: one assistant token each, no anchor
        lengths.append(min(L, rest))
        anchors.append(0)
        rest -= lengths[-1]
    return WorstBatch("packed", -1, 0, L, tuple(lengths), tuple(anchors), mc.block_size, row_len=T)


def host_batch(worst: WorstBatch, vocab_size: int, mask_id: int, pad_id: int = 0, seed: int = 0) -> Batch:
    """Real host tensors of `worst`: random tokens; the loss mask set on the last anchors + 1 tokens of each
    document (exactly `anchors` valid anchor positions, at the end; one assistant token when it holds none)."""
    rng = np.random.default_rng(seed)
    high = min(vocab_size, mask_id) if mask_id > 0 else vocab_size
    samples = []
    for length, a in zip(worst.lengths, worst.anchors):
        tokens = rng.integers(0, high, length)
        mask = np.zeros(length, dtype=bool)
        mask[length - max(a + 1, 1):] = True
        samples.append((tokens, mask))
    if worst.row_len:
        return collate_packed(samples, pad_id, worst.row_len)
    return collate_padded(samples, pad_id, bucket=worst.bucket)


# -- the models, real or fake ---------------------------------------------------------------------------------------



def worst_batches(config: Config, edges: Sequence[int], block_budget: int | None) -> list[WorstBatch]:
    """Every bucket's worst batch for bucket upper edges `edges`, then the packed row's."""
    lowers = [0, *edges[:-1]]
    out = [worst_bucket_batch(i, lo, e, config, block_budget) for i, (lo, e) in enumerate(zip(lowers, edges))]
    return out + [worst_packed_batch(config, block_budget)]


