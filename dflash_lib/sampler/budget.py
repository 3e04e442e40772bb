"""When is a batch full: the token-budget constraint (padding counted), kept apart from the samplers that
decide the order. A batch of n samples whose longest has m tokens costs n * g(m) (g from dflash_lib.buckets)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dflash_lib.buckets import BatchSizing, BucketError
from dflash_lib.sampler.base import SamplerError


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
        return BatchSizing("linear" if self.q is None else "quadratic", self.q, int(self.tokens))

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


def greedy_fill(lengths: np.ndarray, capacity: np.ndarray) -> np.ndarray:
    """Cut a sequence (in its given order) into consecutive batches, each grown while (n + 1) * g(max) <= budget.

    lengths: (n,) tokens, in batch order. capacity: (max_len + 1,) from TokenBudget.capacity_table.
    Returns offsets (B + 1,) int64. Any cap[longest of all] samples fit, so each batch starts with that many in
    one slice and grows one sample at a time only from there (~0.3 s per million samples in random order).
    """
    x = lengths.tolist()
    cap = capacity.tolist()
    n = len(x)
    if n == 0:
        return np.zeros(1, dtype=np.int64)
    sure = cap[max(x)]
    if sure < 1:
        raise SamplerError(f"a sample of {max(x)} tokens does not fit the token budget")
    offsets = [0]
    p = 0
    while p < n:
        e = min(p + sure, n)
        m = max(x[p:e])
        while e < n:
            m2 = x[e] if x[e] > m else m
            if e - p + 1 > cap[m2]:
                break
            m, e = m2, e + 1
        offsets.append(e)
        p = e
    return np.asarray(offsets, dtype=np.int64)
