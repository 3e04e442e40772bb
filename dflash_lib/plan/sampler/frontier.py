"""Efficiency vs randomness of every batching strategy on one set of lengths, and the Pareto frontier.

Axes: efficiency (higher is better: padded strategies real / padded tokens, packing real / (rows * budget)),
pair co-batch recurrence between consecutive epochs and |lag-1 correlation| of step lengths (lower is more
random). Each figure is a mean over several epochs with its standard error, and a strategy is dominated only
when another is no worse on every axis and better on one, both beyond twice the standard error of the
difference: two strategies the measurement cannot tell apart are a tie, not a ranking decided by noise.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np

from dflash_lib.plan.buckets import (SampleCost, apply_policy, equal_length_boundaries, optimal_boundaries,
                                     seed_boundaries)
from dflash_lib.plan.sampler.base import EpochBatchSampler
from dflash_lib.plan.sampler.bucketed import BucketedShuffleSampler
from dflash_lib.plan.sampler.budget import SamplerError
from dflash_lib.plan.sampler.length_grouped import LengthGroupedSampler
from dflash_lib.plan.sampler.metrics import (bucket_mix_kl, cobatch_recurrence, lag1_correlation, packing_efficiency,
                                             padding_efficiency)
from dflash_lib.plan.sampler.packed import PackedSampler
from dflash_lib.plan.sampler.random_shuffle import RandomShuffleSampler
from dflash_lib.plan.sampler.sorted_static import SortedStaticSampler

BASELINES = ("sorted", "random", "bucketed_seed", "bucketed_equal_length", "length_grouped")
OURS = ("bucketed_optimal", "packed")


@dataclass(frozen=True)
class StrategyPoint:
    """One strategy measured on epochs e .. e+E-1 of its own plans (means, and standard errors of the means)."""

    name: str  # strategy label (see BASELINES and OURS)
    baseline: bool  # True for a comparison baseline
    efficiency: float  # real tokens / padded tokens (packed: / (rows * token_budget))
    recurrence: float  # pair co-step recurrence between consecutive epochs
    lag1: float  # lag-1 correlation of step mean lengths
    tail_kl: float  # bucket-mix KL of the last 10% of an epoch vs all of it (buckets = the optimal edges), nats
    steps: int  # optimizer steps in epoch e (all ranks)
    edges: tuple[int, ...] | None  # bucket edges used, tokens (bucketed strategies)
    efficiency_se: float = 0.0  # standard error of `efficiency` over the epochs
    recurrence_se: float = 0.0  # standard error of `recurrence`
    lag1_se: float = 0.0  # standard error of `lag1`


def _margin(se_a: float, se_b: float) -> float:
    return 2.0 * math.hypot(se_a, se_b)


def dominates(a: StrategyPoint, b: StrategyPoint) -> bool:
    """True when `a` is no worse than `b` on every axis and better on one, beyond measurement noise
    (twice the standard error of each difference)."""
    d_eff = a.efficiency - b.efficiency  # > 0: a better
    d_rec = b.recurrence - a.recurrence
    d_lag = abs(b.lag1) - abs(a.lag1)
    m = (_margin(a.efficiency_se, b.efficiency_se), _margin(a.recurrence_se, b.recurrence_se),
         _margin(a.lag1_se, b.lag1_se))
    diffs = (d_eff, d_rec, d_lag)
    no_worse = all(d >= -mm for d, mm in zip(diffs, m))
    better = any(d > mm for d, mm in zip(diffs, m))
    return no_worse and better


def pareto_front(points: Sequence[StrategyPoint]) -> list[StrategyPoint]:
    """The points no other point dominates."""
    return [p for p in points if not any(dominates(o, p) for o in points if o is not p)]


def dominating_baselines(point: StrategyPoint, points: Sequence[StrategyPoint]) -> list[str]:
    """Names of the baselines that dominate `point` (empty: it sits on or above every baseline's frontier)."""
    return [o.name for o in points if o.baseline and dominates(o, point)]


def _mean_se(values: Sequence[float]) -> tuple[float, float]:
    x = np.asarray(values, dtype=np.float64)
    se = float(np.std(x, ddof=1) / math.sqrt(len(x))) if len(x) > 1 else 0.0
    return float(np.mean(x)), se


def measure(name: str, sampler: EpochBatchSampler, edges: Sequence[int], *, epoch: int = 0, epochs: int = 4,
            packed_budget: int | None = None, plan_edges: Sequence[int] | None = None,
            pack_multiple: int = 0) -> StrategyPoint:
    """Measure one sampler on epochs epoch .. epoch+epochs-1 (recurrence on each consecutive pair).
    packed_budget: measure packing efficiency, rows rounded up to `pack_multiple` tokens (0 = full rows of
    packed_budget). Efficiency is per batch; randomness per optimizer step (all ranks' batches of a step
    together)."""
    if epochs < 2:
        raise SamplerError(f"epochs must be >= 2 (recurrence compares consecutive epochs), got {epochs}")
    lengths = sampler.lengths
    effs, recs, lags, kls, prev, steps = [], [], [], [], None, 0
    for e in range(epoch, epoch + epochs):
        plan = sampler.epoch_plan(e)
        batches, cur = plan.csr(), plan.step_csr()
        effs.append(packing_efficiency(batches, lengths, packed_budget, pack_multiple) if packed_budget
                    else padding_efficiency(batches, lengths))
        lags.append(lag1_correlation(cur, lengths))
        kls.append(bucket_mix_kl(cur, lengths, edges))
        if prev is None:
            steps = plan.num_steps
        else:
            recs.append(cobatch_recurrence(prev, cur, len(lengths)))
        prev = cur
    (eff, eff_se), (rec, rec_se), (lag, lag_se) = _mean_se(effs), _mean_se(recs), _mean_se(lags)
    return StrategyPoint(name, name in BASELINES, eff, rec, lag, float(np.mean(kls)), steps,
                         None if plan_edges is None else tuple(int(e) for e in plan_edges), eff_se, rec_se, lag_se)


def evaluate_strategies(lengths: Any, token_budget: int, *, k: int, max_len: int, seed: int = 0,
                        epoch: int = 0, epochs: int = 4, objective: str = "batch_max", q: float | None = None,
                        window: int = 64, policy: str = "truncate", mega_batch_mult: int | None = None,
                        pack_multiple: int = 0) -> list[StrategyPoint]:
    """Every strategy on `lengths` (tokens) with one token budget: the reference run's sorted static batches,
    full random shuffle, bucketed shuffle with optimal / "seed" / equal-total-length edges, Hugging Face
    megabatch length grouping, and packing. Lengths follow `policy` at max_len first.

    Our edges are optimal for `objective` ("batch_max" models what the fill-rule sampler pays: random batches
    padded to their longest member). The "seed" baseline is the reference run's own method as it ran: geometric
    start and coordinate descent on the padding to the edge. Megabatch grouping has a fixed batch size,
    round(token_budget / mean length) (the budget filled on average); like every strategy here it also closes a
    batch where the next sample would pass the token budget, so its long batches do not overrun it. Packed rows
    are `pack_multiple` rounded (0 = full rows).
    """
    x = apply_policy(lengths, max_len, policy)
    kw = dict(max_len=max_len, cost=SampleCost.of_q(q).cost, q=q, token_budget=token_budget)
    optimal = optimal_boundaries(x, k, objective=objective, **kw)
    seed_plan = seed_boundaries(x, k, objective="edge", **kw)
    equal = equal_length_boundaries(x, k, **kw)
    hf_batch = max(1, int(round(token_budget / float(x.mean()))))
    makers: dict[str, Callable[[], tuple[EpochBatchSampler, Sequence[int] | None]]] = {
        "sorted": lambda: (SortedStaticSampler(x, token_budget, seed, q=q), None),
        "random": lambda: (RandomShuffleSampler(x, token_budget, seed, q=q), None),
        "bucketed_optimal": lambda: (BucketedShuffleSampler(x, optimal.edges, token_budget, seed, q=q),
                                     optimal.edges),
        "bucketed_seed": lambda: (BucketedShuffleSampler(x, seed_plan.edges, token_budget, seed, q=q),
                                  seed_plan.edges),
        "bucketed_equal_length": lambda: (BucketedShuffleSampler(x, equal.edges, token_budget, seed, q=q),
                                          equal.edges),
        "length_grouped": lambda: (LengthGroupedSampler(x, hf_batch, seed, mega_batch_mult=mega_batch_mult,
                                                        token_budget=token_budget, q=q), None),
        "packed": lambda: (PackedSampler(x, token_budget, seed, window=window), None),
    }
    points = []
    for name, make in makers.items():
        sampler, edges = make()
        points.append(measure(name, sampler, optimal.edges, epoch=epoch, epochs=epochs, plan_edges=edges,
                              packed_budget=token_budget if name == "packed" else None,
                              pack_multiple=pack_multiple))
    return points


def format_points(points: Sequence[StrategyPoint]) -> str:
    """A fixed-width table of the points: frontier members starred, and for each of ours the baselines that
    dominate it ("none" = on or above every baseline's frontier)."""
    front = {p.name for p in pareto_front(points)}
    lines = [f"{'strategy':24s} {'efficiency (+-se)':>18s} {'recurrence':>10s} {'lag1 (+-se)':>14s} "
             f"{'tail_kl':>8s} {'steps':>6s}  frontier  dominated by baselines"]
    for p in points:
        beaten = "" if p.baseline else (", ".join(dominating_baselines(p, points)) or "none")
        lines.append(f"{p.name:24s} {p.efficiency:9.4f} +-{p.efficiency_se:.4f} {p.recurrence:10.4f} "
                     f"{p.lag1:6.3f} +-{p.lag1_se:.3f} {p.tail_kl:8.4f} {p.steps:6d}  "
                     f"{'*' if p.name in front else ' ':8s}  {beaten}")
    return "\n".join(lines)
