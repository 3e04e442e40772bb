"""dflash_lib.plan.buckets: exactness against brute force, the cost model, baselines, k choice and the fit check."""

import itertools
import json
import math

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dflash_lib.plan.buckets import (BatchSizing, BucketError, BucketFitError, BucketPlan, SampleCost, bucket_of,
                                     choose_k, efficiency_vs_k, equal_length_boundaries, length_histogram,
                                     optimal_boundaries, plan_for_edges, seed_boundaries)
from dflash_lib.plan.fit import MemoryModel, check_fit

# ---------------------------------------------------------------------------------------------------------
# An independent reference: samples listed one by one, binomials as exact integers.


def g_of(cost, q):
    return (lambda l: float(l)) if cost == "linear" else (lambda l: l + l * l / q)


def ref_objective(lengths, edges, objective, g, token_budget=None, batch_size=None, multiple=1, queries=None,
                  block_budget=None):
    """Padded cost of one epoch: pad to edge, or E[sum of b * g(max)] over a shuffled bucket cut into chunks. With
    drafter queries and a block budget B: b also <= B // the bucket's costliest sample, and every bucket costs its
    queries x token_budget / B on top."""
    pairs = sorted(zip((int(v) for v in lengths), [0] * len(lengths) if queries is None else queries))
    xs_all, total, lower = [v for v, _ in pairs], 0.0, 0
    for e in edges:
        xs = [v for v in xs_all if lower < v <= e]
        qs = [int(q) for v, q in pairs if lower < v <= e]
        lower, n = e, len(xs)
        if n == 0:
            continue
        if block_budget is not None:
            total += sum(qs) * token_budget / block_budget
        if objective == "edge":
            total += n * g(e)
            continue
        if token_budget is not None:
            b = math.floor(token_budget / g(e))
            if block_budget is not None and max(qs) > 0:
                b = min(b, max(1, block_budget // max(qs)))
            b = b // multiple * multiple if b >= multiple else b
        else:
            b = batch_size

        def e_max(size):  # rank formula: P(max is the r-th smallest) = C(r-1, size-1) / C(n, size)
            return sum(g(xs[r - 1]) * math.comb(r - 1, size - 1) for r in range(1, n + 1)) / math.comb(n, size)

        r = n % b
        total += (n - r) * (e_max(min(b, n)) if n >= b else 0.0) + (r * e_max(r) if r else 0.0)
    return total


def brute_force(lengths, k, max_len, objective, g, **kw):
    """min over EVERY set of k-1 inner edges among the observed lengths below max_len."""
    inner = sorted({int(v) for v in lengths if v < max_len})
    return min(ref_objective(lengths, list(c) + [max_len], objective, g, **kw)
               for c in itertools.combinations(inner, k - 1))


small_corpus = st.lists(st.integers(1, 30), min_size=1, max_size=12, unique=True).flatmap(
    lambda vals: st.tuples(st.just(vals), st.lists(st.sampled_from(vals), max_size=25)))


@pytest.mark.parametrize("objective", ["edge", "batch_max"])
@pytest.mark.parametrize("cost", ["linear", "quadratic"])
@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(corpus=small_corpus, k=st.integers(1, 4), budget_factor=st.floats(1.0, 8.0), multiple=st.sampled_from([1, 2]),
       top=st.integers(0, 5))
def test_optimal_boundaries_equal_brute_force(objective, cost, corpus, k, budget_factor, multiple, top):
    vals, extra = corpus
    lengths = np.array(vals + extra)
    max_len = max(vals) + top  # top > 0: no sample reaches max_len, the top bucket may stay empty
    q = 16.0 if cost == "quadratic" else None
    g = g_of(cost, q)
    k = min(k, len(vals))
    budget = math.ceil(g(max_len) * budget_factor)
    plan = optimal_boundaries(lengths, k, max_len=max_len, objective=objective, cost=cost, q=q,
                              token_budget=budget, multiple=multiple)
    best = brute_force(lengths, k, max_len, objective, g, token_budget=budget, multiple=multiple)
    assert plan.exact and plan.k == k and plan.edges[-1] == max_len
    assert plan.objective_value == pytest.approx(best, rel=1e-9)
    assert ref_objective(lengths, plan.edges, objective, g, token_budget=budget, multiple=multiple) == \
        pytest.approx(best, rel=1e-9)
    assert sum(plan.counts) == len(lengths)


@pytest.mark.parametrize("objective", ["edge", "batch_max"])
@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(corpus=small_corpus, k=st.integers(1, 4), budget_factor=st.floats(1.0, 8.0), multiple=st.sampled_from([1, 2]),
       block_factor=st.floats(1.0, 6.0), seed=st.integers(0, 2**31))
def test_optimal_boundaries_with_both_budgets_equal_brute_force(objective, corpus, k, budget_factor, multiple,
                                                                 block_factor, seed):
    vals, extra = corpus
    lengths = np.array(vals + extra)
    queries = np.random.default_rng(seed).integers(0, 6, len(lengths)) * 4  # drafter query tokens per sample
    block_budget = max(1, int(queries.max() * block_factor))
    max_len, g = max(vals), g_of("linear", None)
    k = min(k, len(vals))
    budget = math.ceil(max_len * budget_factor)
    kw = dict(token_budget=budget, multiple=multiple, queries=queries, block_budget=block_budget)
    plan = optimal_boundaries(lengths, k, max_len=max_len, objective=objective, **kw)
    best = brute_force(lengths, k, max_len, objective, g, **kw)
    assert plan.exact and plan.block_budget == block_budget
    assert plan.objective_value == pytest.approx(best, rel=1e-9)
    assert ref_objective(lengths, plan.edges, objective, g, **kw) == pytest.approx(best, rel=1e-9)
    for b, e, lo in zip(plan.batch_sizes, plan.edges, plan.lower_edges):  # both budgets cap the sizes
        mq = queries[(lengths > lo) & (lengths <= e)].max(initial=0)
        assert b <= max(budget // e, 1) and (mq == 0 or b <= max(1, block_budget // mq))


def test_the_block_budget_sizes_and_prices_the_batches():
    """10 documents of 10 tokens with 20 drafter queries each, 10 of 50 tokens with none; token budget 100, block
    budget 40. The short bucket's batches are capped at 40 // 20 = 2 rows (10 by tokens); its 200 queries fill 5
    block budgets, priced 100 / 40 = 2.5 token-budget units each: 500 on top of its 100 tokens."""
    lengths = np.array([10] * 10 + [50] * 10)
    queries = np.array([20] * 10 + [0] * 10)
    kw = dict(max_len=50, token_budget=100, queries=queries, block_budget=40)
    plan = plan_for_edges(lengths, [10, 50], objective="batch_max", **kw)
    assert plan.batch_sizes == (2, 2) and plan.steps_per_epoch == 5 + 5
    assert plan.objective_value == pytest.approx(100 + 500 + 500)
    tokens_only = plan_for_edges(lengths, [10, 50], objective="batch_max", max_len=50, token_budget=100)
    assert tokens_only.batch_sizes == (10, 2) and tokens_only.objective_value == pytest.approx(600)
    assert tokens_only.block_budget is None and plan.efficiency == tokens_only.efficiency == 1.0
    static = plan_for_edges(lengths, [10, 50], objective="edge", **kw)  # a padded kernel: its slots, as before
    assert static.objective_value == 10 * 10 + 10 * 50 + 500 and static.batch_sizes == (2, 2)
    # one bucket: batches of 40 // 20 = 2 rows padded to their longest; a pair holds a 50 unless both are 10s:
    # P = C(10, 2) / C(20, 2) = 45 / 190, so 10 pairs cost 10 x 2 x (50 - 40 x 45 / 190) tokens
    one = plan_for_edges(lengths, [50], objective="batch_max", **kw)
    assert one.batch_sizes == (2,) and one.objective_value == pytest.approx(20 * (50 - 40 * 45 / 190) + 500)
    assert one.efficiency < plan.efficiency
    assert BucketPlan.from_json(plan.to_json()) == plan
    legacy = {k: v for k, v in json.loads(tokens_only.to_json()).items() if k != "block_budget"}
    assert BucketPlan.from_json(json.dumps(legacy)) == tokens_only  # a plan written before block_budget
    with pytest.raises(BucketError, match="go together"):
        plan_for_edges(lengths, [10, 50], max_len=50, token_budget=100, queries=queries)
    with pytest.raises(BucketError, match="needs 20 drafter query tokens, more than block_budget 16"):
        plan_for_edges(lengths, [10, 50], **{**kw, "block_budget": 16})


@settings(max_examples=30, deadline=None)
@given(corpus=small_corpus, k=st.integers(1, 4), batch_size=st.integers(1, 9))
def test_batch_max_with_fixed_batch_size_equals_brute_force(corpus, k, batch_size):
    vals, extra = corpus
    lengths = np.array(vals + extra)
    k = min(k, len(vals))
    plan = optimal_boundaries(lengths, k, max_len=max(vals), objective="batch_max", batch_size=batch_size)
    best = brute_force(lengths, k, max(vals), "batch_max", g_of("linear", None), batch_size=batch_size)
    assert plan.objective_value == pytest.approx(best, rel=1e-9)
    assert plan.batch_sizes == (batch_size,) * k and plan.capacity_utilisation is None


def plain_dp(lengths, k, max_len):
    """O(k P^2) edge-objective DP with no monotonicity assumption (checks the divide-and-conquer speed-up)."""
    h = length_histogram(lengths, max_len=max_len)
    cum = np.concatenate([[0], np.cumsum(h.counts)]).astype(float)
    P = len(h.values)
    w = np.full((P + 1, P + 1), np.inf)
    for j in range(1, P + 1):
        w[:j, j] = h.values[j - 1] * (cum[j] - cum[:j])
    f = np.full(P + 1, np.inf)
    f[0] = 0.0
    out = []
    for _ in range(k):
        f = np.min(f[:, None] + w, axis=0)
        out.append(f[P])
    return out


def test_divide_and_conquer_matches_plain_dp_on_hundreds_of_lengths():
    rng = np.random.default_rng(3)
    lengths = np.clip(np.round(rng.lognormal(4.5, 0.8, 3000)), 1, 400).astype(int)
    plans = efficiency_vs_k(lengths, 10, max_len=400)
    expected = plain_dp(lengths, 10, 400)
    assert [p.objective_value for p in plans] == pytest.approx(expected, rel=1e-12)
    effs = [p.efficiency for p in plans]
    assert all(b >= a for a, b in zip(effs, effs[1:]))  # an optimal k+1 split is never worse


def test_expected_max_is_exact_on_thousands_of_samples():
    rng = np.random.default_rng(0)
    lengths = rng.integers(100, 160, 2500)
    b = 7
    plan = plan_for_edges(lengths, [159], max_len=159, objective="batch_max", batch_size=b)
    assert plan.objective_value == pytest.approx(
        ref_objective(lengths, [159], "batch_max", g_of("linear", None), batch_size=b), rel=1e-10)


def test_batch_max_on_a_grid_is_flagged_inexact_and_beats_the_seed_baseline_on_the_same_grid():
    rng = np.random.default_rng(5)
    lengths = np.clip(np.round(rng.lognormal(5.5, 0.9, 5000)), 1, 2048).astype(int)
    kw = dict(max_len=2048, objective="batch_max", token_budget=8192, grid=24)
    plan = optimal_boundaries(lengths, 4, **kw)
    assert not plan.exact
    assert plan.objective_value <= seed_boundaries(lengths, 4, **kw).objective_value * (1 + 1e-12)
    again = plan_for_edges(lengths, plan.edges, **{k: v for k, v in kw.items() if k != "grid"})
    assert again.objective_value == pytest.approx(plan.objective_value, rel=1e-9)


def test_batch_sizes_steps_and_predicted_figures():
    lengths = np.array([10, 20, 20, 30, 40, 50, 60, 64, 64, 64])
    plan = plan_for_edges(lengths, [20, 40, 64], max_len=64, token_budget=130, multiple=2)
    # floor(130 / edge) = 6, 3, 2 -> rounded down to multiples of 2: 6, 2, 2
    assert plan.batch_sizes == (6, 2, 2) and plan.counts == (3, 2, 5)
    assert plan.steps_per_epoch == 1 + 1 + 3
    real = int(lengths.sum())
    assert plan.efficiency == pytest.approx(real / (3 * 20 + 2 * 40 + 5 * 64))
    assert plan.capacity_utilisation == pytest.approx(real / (5 * 130))
    quad = BatchSizing("quadratic", q=64.0, token_budget=1000)
    assert quad.batch_sizes([64]).tolist() == [7]  # g(64) = 64 + 64 = 128 -> floor(1000 / 128)


def test_sample_cost_and_its_two_spellings():
    assert SampleCost("quadratic", 64.0)([0, 32, 64]).tolist() == [0.0, 48.0, 128.0]  # l + l^2 / 64
    assert SampleCost()([3, 7]).tolist() == [3.0, 7.0]
    # a config's pair (q = 0.0 unused when linear) -> the samplers' q, None meaning linear; and back
    assert SampleCost("linear", 0.0).q is None and SampleCost("linear", 64.0).q is None
    assert SampleCost("quadratic", 64.0).q == 64.0
    assert SampleCost.of_q(None) == SampleCost("linear") and SampleCost.of_q(8.0) == SampleCost("quadratic", 8.0)
    assert BatchSizing("quadratic", 64.0).g([64]).tolist() == [128.0]
    with pytest.raises(BucketError, match="needs q > 0"):
        SampleCost("quadratic", 0.0)
    with pytest.raises(BucketError, match="cost must be one of"):
        BatchSizing("cubic")


def test_bucket_of_uses_inclusive_upper_edges():
    edges = [10, 20, 30]
    # an edge is in its own bucket, one token more in the next; 0 and everything up to edges[0] in bucket 0
    assert bucket_of([0, 1, 10, 11, 20, 21, 30], edges).tolist() == [0, 0, 0, 1, 1, 2, 2]
    assert int(bucket_of(20, edges)) == 1 and bucket_of(20, edges).shape == ()
    assert bucket_of(np.zeros(0, dtype=np.int64), edges).shape == (0,)
    with pytest.raises(BucketError, match=r"do not cover sample 1 of 31 tokens: the last edge must reach max_len"):
        bucket_of([30, 31], edges)
    with pytest.raises(BucketError, match="do not cover a sample of 99 tokens"):
        bucket_of(99, edges)
    for bad, message in (([], "non-empty"), ([10.0, 20.0], "ints"), ([20, 10], "strictly ascending"),
                         ([0, 10], "positive")):
        with pytest.raises(BucketError, match=message):
            bucket_of(5, bad)


def test_truncate_and_drop_policies():
    lengths = [5, 7, 12, 30, 30]
    h = length_histogram(lengths, max_len=10, policy="truncate")
    assert h.values.tolist() == [5, 7, 10] and h.counts.tolist() == [1, 1, 3] and h.clipped == 3
    h = length_histogram(lengths, max_len=10, policy="drop")
    assert h.values.tolist() == [5, 7, 10] and h.counts.tolist() == [1, 1, 0] and h.dropped == 3
    plan = optimal_boundaries(lengths, 2, max_len=10, policy="drop")
    assert sum(plan.counts) == 2 and plan.edges == (7, 10) and plan.counts == (2, 0)


def test_baselines_follow_their_definitions_and_never_beat_the_optimum():
    rng = np.random.default_rng(11)
    lengths = np.clip(np.round(rng.lognormal(5.0, 1.0, 4000)), 1, 1024).astype(int)
    kw = dict(max_len=1024, token_budget=4096)
    best = optimal_boundaries(lengths, 5, **kw)
    seed = seed_boundaries(lengths, 5, **kw)
    equal = equal_length_boundaries(lengths, 5, **kw)
    assert seed.method == "seed" and equal.method == "equal_length"
    assert best.objective_value <= seed.objective_value and best.objective_value <= equal.objective_value
    # equal total length: edge m is the first length where the running token total reaches m/5 of all tokens
    xs = np.sort(np.minimum(lengths, 1024))
    running = np.cumsum(xs)
    for m, e in enumerate(equal.edges[:-1], start=1):
        assert running[xs <= e][-1] >= running[-1] * m / 5 > running[xs < e][-1]
    # coordinate descent ends in a local optimum: no single edge can move to a better observed length
    observed = np.unique(xs)
    for m in range(seed.k - 1):
        lo = seed.edges[m - 1] if m else 0
        for cand in observed[(observed > lo) & (observed < seed.edges[m + 1])]:
            moved = list(seed.edges)
            moved[m] = int(cand)
            assert plan_for_edges(lengths, moved, **kw).objective_value >= seed.objective_value - 1e-6


def test_choose_k_takes_the_smallest_k_within_distance():
    rng = np.random.default_rng(2)
    lengths = np.clip(np.round(rng.lognormal(5.0, 0.7, 3000)), 1, 1024).astype(int)
    plans = efficiency_vs_k(lengths, 12, max_len=1024)
    target = plans[5].efficiency  # k = 6 reaches it; k = 5 does not (strictly increasing here)
    assert plans[4].efficiency < target
    chosen = choose_k(lengths, max_len=1024, distance=1.0 - target + 1e-12, k_max=12)
    assert chosen.k == 6 and chosen.edges == plans[5].edges
    with pytest.raises(BucketError, match="raise k_max or distance"):
        choose_k(lengths, max_len=1024, distance=0.0001, k_max=3)


def test_plan_json_round_trip_and_refusals():
    plan = optimal_boundaries([3, 5, 5, 9, 12], 2, max_len=12, token_budget=48)
    assert BucketPlan.from_json(plan.to_json()) == plan
    raw = json.loads(plan.to_json())
    with pytest.raises(BucketError, match="unknown keys"):
        BucketPlan.from_json(json.dumps(raw | {"bogus": 1}))
    raw.pop("edges")
    with pytest.raises(BucketError, match="lacks"):
        BucketPlan.from_json(json.dumps(raw))


@pytest.mark.parametrize("objective", ["edge", "batch_max"])
def test_too_few_distinct_lengths_get_one_bucket_each_and_one_warning_line(objective, caplog):
    """A corpus with fewer distinct lengths than requested buckets is planned with the buckets it can have: one
    per length (the top one up to max_len), no padding at all; every planner says so in one warning line."""
    kw = dict(max_len=10, objective=objective, token_budget=40)
    for planner in (optimal_boundaries, seed_boundaries, equal_length_boundaries):
        caplog.clear()
        with caplog.at_level("WARNING", logger="dflash_lib.plan.buckets"):
            plan = planner([3, 3, 4], 6, **kw)
        assert (plan.edges, plan.counts, plan.efficiency) == ((3, 4, 10), (2, 1, 0), 1.0), planner.__name__
        assert [r.getMessage() for r in caplog.records] == [
            "k=6 buckets requested, but the 3 sample(s) have only 2 distinct length(s): planning 3 bucket(s), "
            "one per length, the last one up to max_len=10"]
    caplog.clear()
    with caplog.at_level("WARNING", logger="dflash_lib.plan.buckets"):
        one = optimal_boundaries([7], 4, **kw)  # a one-record corpus
        at_max = optimal_boundaries([3, 3, 10], 4, **kw)  # a sample at max_len: no extra top bucket
        enough = optimal_boundaries([3, 3, 4], 3, **kw)  # exactly as many as it can have: no warning
    assert (one.edges, one.counts, one.steps_per_epoch) == ((7, 10), (1, 0), 1)
    assert (at_max.edges, at_max.counts) == ((3, 10), (2, 1))
    assert enough.edges == (3, 4, 10)
    assert [r.getMessage().split(":")[-1] for r in caplog.records] == [
        " planning 2 bucket(s), one per length, the last one up to max_len=10",
        " planning 2 bucket(s), one per length"]
    assert len(efficiency_vs_k([3, 3, 4], 12, **kw)) == 3  # k = 1..3: every plan that exists


@pytest.mark.parametrize("call, message", [
    (lambda: optimal_boundaries([], 2, max_len=10), "empty"),
    (lambda: optimal_boundaries([3, 0, 4], 1, max_len=10), r"lengths\[1\] = 0"),
    (lambda: optimal_boundaries([3.5, 4], 1, max_len=10), "whole number"),
    (lambda: optimal_boundaries([3, 4], 1, max_len=10, token_budget=9), "below the cost"),
    (lambda: optimal_boundaries([3, 4], 1, max_len=10, objective="batch_max"), "needs a batch size"),
    (lambda: optimal_boundaries([3, 4], 1, max_len=10, cost="quadratic"), "needs q > 0"),
    (lambda: optimal_boundaries([3, 4], 1, max_len=10, policy="keep"), "policy"),
    (lambda: plan_for_edges([3, 4], [4, 8], max_len=10), "do not cover max_len"),
    (lambda: plan_for_edges([3, 4], [8, 4, 10], max_len=10), "strictly ascending"),
])
def test_bad_input_is_refused_with_a_clear_message(call, message):
    with pytest.raises(BucketError, match=message):
        call()


def test_fit_check_fixed_and_dynamic_worst_cases():
    lengths = np.arange(1, 101)
    plan = plan_for_edges(lengths, [50, 100], max_len=100, token_budget=400)
    fits = check_fit(plan)
    assert [(f.batch_size, f.seq_len) for f in fits] == [(8, 50), (4, 100)] and all(f.fits for f in fits)
    dyn = check_fit(plan, dynamic=True)
    for f, (lo, hi) in zip(dyn, [(0, 50), (50, 100)]):  # worst padded tokens over every possible batch max
        assert f.tokens == max((400 // m) * m for m in range(lo + 1, hi + 1))
    # bucket 0: 8 * (1000 * 50 + 20 * 50^2) = 0.8 MB fits; bucket 1: 4 * (1000 * 100 + 20 * 100^2) = 1.2 MB
    memory = MemoryModel(limit_bytes=1.0e6, per_token_bytes=1000.0, per_token_sq_bytes=20.0)
    with pytest.raises(BucketFitError, match=r"bucket 1 \(50, 100\]: worst batch 4 x 100") as err:
        check_fit(plan, memory)
    assert "bucket 0" not in str(err.value)
    tight = plan_for_edges(lengths, [50, 100], max_len=100, batch_size=5)
    with pytest.raises(BucketFitError, match="bucket 1"):
        check_fit(tight, MemoryModel(limit_bytes=450.0, per_token_bytes=1.0))  # 5 x 100 > 450 bytes


def test_report_figures_for_notebook_02(tmp_path):
    from dflash_lib.lab.report.buckets import (efficiency_vs_k as k_figure, efficiency_vs_randomness, lengths_histogram,
                                               write_bucket_figures)
    from dflash_lib.plan.sampler import StrategyPoint

    rng = np.random.default_rng(4)
    lengths = np.clip(np.round(rng.lognormal(4.0, 0.8, 2000)), 1, 256).astype(int)
    plans = efficiency_vs_k(lengths, 6, max_len=256, token_budget=1024)
    seed_edges = seed_boundaries(lengths, 4, max_len=256).edges
    hist = lengths_histogram(lengths, {"optimal": plans[3].edges, "seed": seed_edges})
    assert len(hist.data) == 1 + 4 + 4 and hist.data[0].y.sum() == len(lengths)
    kfig = k_figure({"optimal": plans}, packing=0.99, chosen=plans[3])
    assert list(kfig.data[0].y) == [p.efficiency for p in plans]
    pts = [StrategyPoint("a", True, 0.9, 0.5, 0.1, 0.0, 10, None),
           StrategyPoint("b", False, 0.8, 0.01, 0.0, 0.0, 12, None),
           StrategyPoint("c", True, 0.7, 0.02, 0.0, 0.0, 14, None)]
    rfig = efficiency_vs_randomness(pts)
    assert list(rfig.data[0].y) == [0.8, 0.9]  # the frontier skips "c" (less efficient AND less random than "b")
    paths = write_bucket_figures(tmp_path, {"lengths": hist, "k": kfig, "frontier": rfig})
    assert all(p.stat().st_size > 100_000 for p in paths.values())  # plotly.js inlined: opens offline
