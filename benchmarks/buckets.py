"""Bucket boundaries and batch samplers: speed at a million samples, and efficiency on the bundled corpus.

    .venv/bin/python benchmarks/buckets.py               # bundled corpus via dflash_lib.data (cached store)
    .venv/bin/python benchmarks/buckets.py --synthetic   # skip the corpus, use a labelled lognormal stand-in

Targets (issue 3): 1,000,000 lengths up to 8192 tokens, k <= 16: exact boundaries in <= 1 s and one epoch
planned in <= 1 s with O(N) memory. On the bundled corpus: the padding efficiency of every strategy and the
optimal edges' gain over the reference run's coordinate descent and lhotse's equal-total-length edges.
"""

from __future__ import annotations

import sys
from pathlib import Path

# Run as a script, benchmarks/ is sys.path[0]: a sibling file named like a stdlib module (benchmarks/tokenize.py)
# would shadow it for torch's imports. This script needs nothing from its own folder.
sys.path = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

import argparse  # noqa: E402
import itertools  # noqa: E402
import time  # noqa: E402
import tracemalloc  # noqa: E402
from typing import Any, Callable  # noqa: E402

import numpy as np  # noqa: E402

from dflash_lib.config import BucketConfig, DataConfig, SamplerConfig  # noqa: E402
from dflash_lib.plan.buckets import (efficiency_vs_k, equal_length_boundaries, length_histogram,  # noqa: E402
                                     optimal_boundaries, seed_boundaries)
from dflash_lib.plan.sampler import BucketedShuffleSampler, evaluate_strategies, format_points  # noqa: E402


def best_time(fn: Callable[[], Any], repeat: int = 3) -> tuple[float, Any]:
    """Fastest of `repeat` runs in seconds (the machine is shared; the minimum is the least noisy figure)."""
    best, out = float("inf"), None
    for _ in range(repeat):
        t0 = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t0)
    return best, out


def lognormal(n: int, max_len: int, seed: int = 0, mu: float = 6.5, sigma: float = 1.0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.clip(np.round(rng.lognormal(mu, sigma, n)), 1, max_len).astype(np.int64)


def scale(n: int = 1_000_000, max_len: int = 8192, budget: int = 16384) -> None:
    lengths = lognormal(n, max_len)
    h = length_histogram(lengths, max_len=max_len)
    print(f"== scale: {n:,} lognormal lengths (mu 6.5, sigma 1.0) clipped to {max_len}; "
          f"{h.num_distinct} distinct; budget {budget} tokens")
    for k in (8, 16):
        t, plan = best_time(lambda: optimal_boundaries(lengths, k, max_len=max_len, token_budget=budget))
        print(f"optimal_boundaries edge k={k:2d}: {t:.3f} s  (target <= 1 s)  exact={plan.exact}  "
              f"efficiency {plan.efficiency:.4f}")
    t, plans = best_time(lambda: efficiency_vs_k(lengths, 16, max_len=max_len, token_budget=budget))
    print(f"efficiency_vs_k k=1..16 (one DP): {t:.3f} s")
    t, plan = best_time(lambda: optimal_boundaries(lengths, 8, max_len=max_len, objective="batch_max",
                                                   token_budget=budget), repeat=1)
    print(f"optimal_boundaries batch_max k=8 (grid {BucketConfig().bucket_grid}): {t:.3f} s  exact={plan.exact}  "
          f"efficiency {plan.efficiency:.4f}")
    plan = optimal_boundaries(lengths, 16, max_len=max_len, token_budget=budget)
    sampler = BucketedShuffleSampler(lengths, plan.edges, budget, 0)
    epochs = itertools.count(1)  # a fresh epoch each run: no cached plan
    t, epoch = best_time(lambda: sampler.epoch_plan(next(epochs)))
    tracemalloc.start()
    sampler.epoch_plan(5000)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    print(f"BucketedShuffleSampler one epoch plan: {t:.3f} s  (target <= 1 s)  {epoch.num_steps} steps  "
          f"peak {peak / 2**20:.1f} MiB = {peak / n:.1f} bytes/sample (O(N))")


def corpus_lengths(synthetic: bool, limit: int) -> tuple[np.ndarray, str, int]:
    cfg = DataConfig()
    if not synthetic:
        try:
            from dflash_lib.data import build_token_store

            store = build_token_store(cfg.source, cfg.tokenizer, cfg.template, cfg.max_len, cfg.policy, limit,
                                      cfg.cache_dir, cfg.workers, progress=False)
            return np.asarray(store.lengths), f"BUNDLED CORPUS {cfg.source} ({len(store)} samples)", cfg.max_len
        except ImportError as e:
            print(f"!! dflash_lib.data.build_token_store unavailable ({e}); falling back to synthetic")
    return (lognormal(90_000, cfg.max_len, seed=1, mu=6.2, sigma=1.1),
            "SYNTHETIC stand-in: 90,000 lognormal(6.2, 1.1) lengths (NOT the bundled corpus)", cfg.max_len)


def corpus(synthetic: bool, limit: int) -> None:
    lengths, label, max_len = corpus_lengths(synthetic, limit)
    budget, k = SamplerConfig().token_budget, BucketConfig().k
    x = np.minimum(lengths, max_len)
    print(f"\n== {label}\nmax_len {max_len}, budget {budget} tokens, k {k}; mean length {x.mean():.0f}, "
          f"median {np.median(x):.0f}, max {x.max()}, distinct {len(np.unique(x))}")
    kw = dict(max_len=max_len, token_budget=budget)
    for objective in ("edge", "batch_max"):
        opt = optimal_boundaries(lengths, k, objective=objective, **kw)
        seed = seed_boundaries(lengths, k, objective=objective, **kw)
        equal = equal_length_boundaries(lengths, k, objective=objective, **kw)
        print(f"-- predicted, objective={objective} (exact={opt.exact})")
        for p in (opt, seed, equal):
            print(f"{p.method:13s} edges {list(p.edges)}  efficiency {p.efficiency:.4f}  "
                  f"steps {p.steps_per_epoch}  capacity {p.capacity_utilisation:.4f}")
        print(f"optimal gain: {100 * (opt.efficiency - seed.efficiency):+.2f} points over seed, "
              f"{100 * (opt.efficiency - equal.efficiency):+.2f} points over equal_length; padded cost "
              f"{100 * (1 - opt.objective_value / seed.objective_value):.2f}% / "
              f"{100 * (1 - opt.objective_value / equal.objective_value):.2f}% lower")
    sweeps = {"optimal": efficiency_vs_k(lengths, 12, **kw),
              "seed": [seed_boundaries(lengths, kk, **kw) for kk in range(1, 13)],
              "equal_length": [equal_length_boundaries(lengths, kk, **kw) for kk in range(1, 13)]}
    print("-- predicted edge efficiency vs k:  k " + " ".join(f"{kk:6d}" for kk in range(1, 13)))
    for name, plans in sweeps.items():
        print(f"{name:>34s} " + " ".join(f"{p.efficiency:6.4f}" for p in plans))
    print("-- measured on each sampler's epochs 0-3 (efficiency per batch; randomness per step, epoch e -> e+1)")
    t, points = best_time(lambda: evaluate_strategies(lengths, budget, k=k, max_len=max_len), repeat=1)
    print(format_points(points))
    byname = {p.name: p for p in points}
    opt_m = byname["bucketed_optimal"].efficiency
    print(f"measured bucketed gain: {100 * (opt_m - byname['bucketed_seed'].efficiency):+.2f} points over seed "
          f"edges, {100 * (opt_m - byname['bucketed_equal_length'].efficiency):+.2f} over equal-length edges; "
          f"packed {100 * byname['packed'].efficiency:.2f}% (target >= 98%)  [{t:.1f} s]")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--synthetic", action="store_true", help="skip the bundled corpus")
    ap.add_argument("--limit", type=int, default=0, help="conversations read from the corpus (0 = all)")
    ap.add_argument("--skip-scale", action="store_true", help="skip the million-sample timings")
    args = ap.parse_args()
    if not args.skip_scale:
        scale()
    corpus(args.synthetic, args.limit)


if __name__ == "__main__":
    main()
