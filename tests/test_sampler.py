"""dflash_lib.plan.sampler: coverage, rank equality, budgets, determinism, exact resume, bucket mix, randomness
metrics and the efficiency-vs-randomness frontier."""

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dflash_lib.plan.buckets import optimal_boundaries
from dflash_lib.plan.sampler import (BucketedShuffleSampler, LengthGroupedSampler, PackedSampler, RandomShuffleSampler,
                                     SamplerError, SortedStaticSampler, TokenBudget, bucket_mix_kl, cobatch_recurrence,
                                     cu_seqlens, dominating_baselines, evaluate_strategies, greedy_fill,
                                     lag1_correlation, packing_efficiency, padding_efficiency, randomness)

BUDGET = 256
EDGES = (16, 40, 64)
FIXED_SIZES = (5, 3, 2)  # "bucketed_fixed": rows per batch of each bucket, under BUDGET (80, 120, 128 tokens)


def make(kind, lengths, seed=0, rank=0, world_size=1, **kw):
    if kind == "sorted":
        return SortedStaticSampler(lengths, BUDGET, seed, rank=rank, world_size=world_size, **kw)
    if kind == "random":
        return RandomShuffleSampler(lengths, BUDGET, seed, rank=rank, world_size=world_size, **kw)
    if kind == "bucketed":
        return BucketedShuffleSampler(lengths, EDGES, BUDGET, seed, rank=rank, world_size=world_size, **kw)
    if kind == "bucketed_fixed":
        return BucketedShuffleSampler(lengths, EDGES, BUDGET, seed, rank=rank, world_size=world_size,
                                      batch_sizes=FIXED_SIZES, **kw)
    if kind == "packed":
        return PackedSampler(lengths, BUDGET, seed, rank=rank, world_size=world_size, window=4, **kw)
    return LengthGroupedSampler(lengths, 5, seed, rank=rank, world_size=world_size, mega_batch_mult=3, **kw)


KINDS = ["sorted", "random", "bucketed", "bucketed_fixed", "packed", "grouped"]


def lognormal_lengths(n, seed=0, mu=6.0, sigma=1.0, max_len=3072):
    rng = np.random.default_rng(seed)
    return np.clip(np.round(rng.lognormal(mu, sigma, n)), 1, max_len).astype(np.int64)


def epoch_of_all_ranks(kind, lengths, world_size, epoch=0, seed=0):
    """Iterate every rank's sampler for one epoch -> (per-rank batch lists, one sampler)."""
    per_rank, sampler = [], None
    for rank in range(world_size):
        sampler = make(kind, lengths, seed, rank, world_size)
        sampler.set_epoch(epoch)
        per_rank.append(list(sampler))
    return per_rank, sampler


def batches_fit(kind, lengths, batch):
    x = lengths[batch]
    if kind == "packed":
        return x.sum() <= BUDGET
    if kind == "grouped":
        return 1 <= len(batch) <= 5  # fixed size (no budget); only the epoch's last batch may be short
    return len(batch) * x.max() <= BUDGET


@pytest.mark.parametrize("kind", KINDS)
@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(lengths=st.lists(st.integers(1, 64), min_size=1, max_size=120), world_size=st.integers(1, 4),
       seed=st.integers(0, 2**31), epoch=st.integers(0, 3))
def test_every_sample_once_equal_steps_budget_and_determinism(kind, lengths, world_size, seed, epoch):
    lengths = np.array(lengths)
    probe = make(kind, lengths, seed, 0, world_size)
    probe.set_epoch(epoch)
    try:
        plan = probe.epoch_plan()
    except SamplerError as e:  # refused only when some rank would get nothing
        assert "world_size" in str(e) and world_size > 1
        return
    per_rank, _ = epoch_of_all_ranks(kind, lengths, world_size, epoch, seed)
    steps = {len(b) for b in per_rank}
    assert steps == {plan.num_steps} and plan.num_steps == len(probe)  # equal steps on every rank
    served = np.concatenate([np.asarray(b, dtype=int) for r in per_rank for b in r])
    assert len(served) == len(set(served.tolist()))  # disjoint across ranks, no repeats
    assert len(served) + plan.dropped == len(lengths)  # every sample once, minus counted drops
    assert all(batches_fit(kind, lengths, b) for r in per_rank for b in r)
    if kind == "grouped":
        assert sum(len(b) < 5 for r in per_rank for b in r) <= 1
    if kind.startswith("bucketed"):  # all ranks at step s draw from the same bucket, and every batch is one bucket
        buckets = [[set(np.searchsorted(EDGES, lengths[b]).tolist()) for b in r] for r in per_rank]
        assert all(len(s) == 1 for r in buckets for s in r)
        assert all(len({next(iter(r[s])) for r in buckets}) == 1 for s in range(plan.num_steps))
    again, _ = epoch_of_all_ranks(kind, lengths, world_size, epoch, seed)
    assert again == per_rank  # deterministic given (seed, epoch)


@pytest.mark.parametrize("kind", KINDS)
@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 1000), world_size=st.integers(1, 3), epoch=st.integers(0, 2), cut=st.floats(0, 1))
def test_resume_equals_the_rest_of_an_uninterrupted_epoch(kind, seed, world_size, epoch, cut):
    lengths = lognormal_lengths(300, seed, mu=3.0, sigma=0.7, max_len=64)
    rank = world_size - 1
    full = make(kind, lengths, seed, rank, world_size)
    full.set_epoch(epoch)
    expected = list(full)
    step = int(cut * len(expected))
    partial = make(kind, lengths, seed, rank, world_size)
    partial.set_epoch(epoch)
    it = iter(partial)
    consumed = [next(it) for _ in range(step)]
    state = partial.state_dict()
    assert state["epoch"] == epoch and state["step"] == step and consumed == expected[:step]
    resumed = make(kind, lengths, seed, rank, world_size)
    resumed.load_state_dict(state)
    resumed.set_epoch(epoch)  # a trainer calling set_epoch after the load keeps the position
    assert list(resumed) == expected[step:]
    assert resumed.epoch == epoch + 1 and resumed.step == 0  # a finished epoch moves on by itself


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(lengths=st.lists(st.integers(1, 64), min_size=1, max_size=150),
       sizes=st.tuples(st.integers(1, 16), st.integers(1, 6), st.integers(1, 4)), world_size=st.integers(1, 4),
       seed=st.integers(0, 2**31), epoch=st.integers(0, 3))
def test_fixed_batch_sizes_serve_every_sample_once_and_count_every_drop(lengths, sizes, world_size, seed, epoch):
    """The documented rule, computed here on its own: bucket k (EDGES[k-1], EDGES[k]] of n_k samples makes
    ceil(n_k / b_k) batches, all of b_k rows but a last partial one; its batches are dealt in groups of world_size
    and only the last incomplete group is left out, counted in `dropped`. One rank: every sample exactly once."""
    lengths = np.array(lengths)
    bucket = np.searchsorted(EDGES, lengths)  # (N,)
    n_k, b_k = np.bincount(bucket, minlength=3), np.array(sizes)
    count_k = -(-n_k // b_k)  # (3,) batches per bucket
    groups_k = count_k // world_size  # (3,) steps per bucket
    fill = [[int(b)] * (c - 1) + [int(n - b * (c - 1))] if c else [] for n, b, c in zip(n_k, b_k, count_k)]
    kept = [sorted(f[:g * world_size]) for f, g in zip(fill, groups_k)]  # row counts of the batches served
    samplers = [BucketedShuffleSampler(lengths, EDGES, BUDGET, seed, rank=r, world_size=world_size,
                                       batch_sizes=sizes) for r in range(world_size)]
    if world_size > count_k.sum() or groups_k.sum() == 0:
        with pytest.raises(SamplerError, match="world_size"):
            samplers[0].epoch_plan(epoch)
        return
    per_rank = []
    for s in samplers:
        s.set_epoch(epoch)
        per_rank.append(list(s))
    assert [len(r) for r in per_rank] == [int(groups_k.sum())] * world_size
    for step in range(int(groups_k.sum())):  # one bucket per step, on every rank
        assert len({int(bucket[i]) for r in per_rank for i in r[step]}) == 1
    served = [np.asarray(b) for r in per_rank for b in r]
    got = [sorted(len(b) for b in served if bucket[b[0]] == k) for k in range(3)]
    assert got == kept
    flat = np.concatenate(served)
    assert len(flat) == len(set(flat.tolist()))  # no sample twice, across ranks
    dropped = int(n_k.sum() - sum(map(sum, kept)))
    assert samplers[0].dropped == dropped and len(flat) + dropped == len(lengths)
    left_out = np.setdiff1d(np.arange(len(lengths)), flat)  # the dropped samples: whole batches of the tails
    assert np.bincount(bucket[left_out], minlength=3).tolist() == [n - sum(k) for n, k in zip(n_k, kept)]
    if world_size == 1:
        assert sorted(flat.tolist()) == list(range(len(lengths))) and dropped == 0


def test_dataloader_uses_the_sampler_as_batch_sampler():
    lengths = lognormal_lengths(200, 1, mu=3.0, sigma=0.7, max_len=64)
    sampler = make("bucketed", lengths, seed=4)
    loader = torch.utils.data.DataLoader(list(range(len(lengths))), batch_sampler=sampler,
                                         collate_fn=lambda items: items)
    assert len(loader) == len(sampler)
    expected = make("bucketed", lengths, seed=4).epoch_plan(0).batches()
    assert [list(b) for b in loader] == [b.tolist() for b in expected]


def test_greedy_fill_makes_maximal_batches_within_budget():
    rng = np.random.default_rng(0)
    for q in (None, 32.0):
        budget = TokenBudget(300, q)
        x = rng.integers(1, 60, 500)
        off = greedy_fill(x, budget.capacity_table(60))
        assert off[0] == 0 and off[-1] == len(x)
        for a, b in zip(off[:-1], off[1:]):
            assert (b - a) * budget.cost(x[a:b].max()) <= 300
            if b < len(x):  # one more sample would have broken the budget
                assert (b - a + 1) * budget.cost(x[a:b + 1].max()) > 300


def test_bucketed_batches_change_every_epoch_sorted_static_ones_never_do():
    lengths = lognormal_lengths(3000, 2, mu=3.0, sigma=0.7, max_len=64)
    for kind, low, high in [("sorted", 1.0, 1.0), ("bucketed", 0.0, 0.2), ("random", 0.0, 0.05)]:
        s = make(kind, lengths)
        rec = cobatch_recurrence(s.epoch_plan(0), s.epoch_plan(1), len(lengths))
        assert low <= rec <= high, (kind, rec)


def skewed_lengths():
    """Bucket (0, 16] holds 6x the samples (and ~1.5x the batches) of each of the two longer buckets."""
    rng = np.random.default_rng(7)
    return np.concatenate([rng.integers(1, 17, 12000), rng.integers(17, 41, 2000), rng.integers(41, 65, 2000)])


def test_proportional_bucket_choice_keeps_the_mix_to_the_end_uniform_does_not():
    lengths = skewed_lengths()
    prop = [bucket_mix_kl(make("bucketed", lengths, seed=s).epoch_plan(0), lengths, EDGES) for s in range(5)]
    unif = [bucket_mix_kl(make("bucketed", lengths, seed=s, bucket_choice="uniform").epoch_plan(0), lengths, EDGES)
            for s in range(5)]
    assert max(prop) < 0.05 and min(unif) > 0.5  # uniform: the epoch ends on the big bucket alone
    assert min(unif) > 10 * max(prop)


def test_next_bucket_is_drawn_in_proportion_to_remaining_batches():
    lengths = skewed_lengths()
    plan = make("bucketed", lengths).epoch_plan(0)
    groups = np.bincount(plan.step_bucket, minlength=3)
    firsts = np.array([make("bucketed", lengths, seed=s).epoch_plan(0).step_bucket[0] for s in range(300)])
    share = np.bincount(firsts, minlength=3) / len(firsts)
    assert share == pytest.approx(groups / groups.sum(), abs=0.06)


def test_drops_equalise_ranks_and_are_counted():
    lengths = skewed_lengths()
    one = make("bucketed", lengths).epoch_plan(0)  # same fills as any world size: the interleave is drawn last
    sizes = np.diff(one.offsets)
    bucket = np.searchsorted(EDGES, lengths[one.order[one.offsets[:-1]]])  # (B,) batches are bucket-major
    assert one.dropped == 0
    drops = []
    for world in (2, 3, 4, 5):
        plan = make("bucketed", lengths, world_size=world).epoch_plan(0)
        counts = np.bincount(bucket, minlength=3)
        tails = [sizes[bucket == k][counts[k] - counts[k] % world:].sum() for k in range(3)]
        assert plan.num_steps == int(np.sum(counts // world)) and plan.dropped == sum(tails)
        assert plan.dropped == len(lengths) - sum(len(b) for b in plan.batches())
        drops.append(plan.dropped)
    assert max(drops) > 0


def test_fixed_batch_sizes_realise_the_batch_max_prediction():
    lengths = lognormal_lengths(2000, 3, mu=3.3, sigma=0.6, max_len=64)
    plan = optimal_boundaries(lengths, 3, max_len=64, objective="batch_max", token_budget=BUDGET)
    sampler = BucketedShuffleSampler(lengths, plan.edges, BUDGET, 0, batch_sizes=plan.batch_sizes)
    padded = []
    for e in range(60):
        idx, off = sampler.epoch_plan(e).csr()
        x = lengths[idx]
        padded.append(np.sum(np.maximum.reduceat(x, off[:-1]) * np.diff(off)))
    assert np.mean(padded) == pytest.approx(lengths.sum() / plan.efficiency, rel=0.005)
    assert len(sampler) == plan.steps_per_epoch


def test_packed_rows_reach_98_percent_and_carry_cu_seqlens():
    lengths = lognormal_lengths(8000, 4)
    sampler = PackedSampler(lengths, 16384, 0)
    plan = sampler.epoch_plan(0)
    assert packing_efficiency(plan, lengths, 16384) >= 0.98
    row = plan.batch(0)
    cu = cu_seqlens(row, lengths)
    assert cu[0] == 0 and cu[-1] == lengths[row].sum() <= 16384 and len(cu) == len(row) + 1


def test_pack_window_reaches_the_packed_sampler_and_changes_the_packing():
    """`pack_window` (a resume-hash setting) is the window the packer of a run's sampler uses: another window packs
    the same epoch differently, both packings serve every sample exactly once within the budget, and the wider
    window packs tighter."""
    from dflash_lib.config import from_params, smoke
    from dflash_lib.train.build import build_sampler

    lengths = lognormal_lengths(3000, 6, mu=5.0, max_len=1024)
    packings, efficiency, samplers = {}, {}, {}
    for window in (1, 64):
        cfg = from_params({"strategy": "packed", "pack_window": window, "token_budget": 2048}, smoke())
        sampler = build_sampler(cfg, lengths, rank=0, world_size=1, edges=[])
        assert isinstance(sampler, PackedSampler) and sampler.window == window
        samplers[window] = sampler
        sampler.set_epoch(0)
        batches = [list(b) for b in sampler]
        assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
        assert all(lengths[b].sum() <= 2048 for b in batches)
        packings[window], efficiency[window] = batches, packing_efficiency(sampler.epoch_plan(0), lengths, 2048)
    assert packings[1] != packings[64]
    assert efficiency[64] > efficiency[1] + 0.01, efficiency
    with pytest.raises(SamplerError, match="fingerprint"):  # a resume under another window is refused
        samplers[64].load_state_dict(samplers[1].state_dict())


def test_length_grouped_follows_the_hugging_face_definition():
    lengths = lognormal_lengths(1000, 5, mu=3.0, sigma=0.8, max_len=64)
    s = LengthGroupedSampler(lengths, 8, 0, mega_batch_mult=5)
    order = s.epoch_plan(0).order
    assert lengths[order[0]] == lengths.max()  # the longest sample leads the epoch
    for start in range(0, 1000, 40):  # every megabatch of 40 sorted longest first (bar the swapped head)
        mb = lengths[order[start + 1 if start == 0 else start:start + 40]]
        assert (np.diff(mb) <= 0).all()
    assert all(len(b) == 8 for b in s.epoch_plan(0).batches())


def test_metrics_on_hand_made_batches():
    lengths = np.array([10, 10, 20, 20, 30, 30])
    a = [[0, 1, 2], [3, 4, 5]]
    assert cobatch_recurrence(a, a, 6) == 1.0
    assert cobatch_recurrence(a, [[0, 3], [1, 4], [2, 5]], 6) == 0.0
    assert cobatch_recurrence(a, [[0, 1, 3], [2, 4, 5]], 6) == pytest.approx(2 / 6)
    assert padding_efficiency(a, lengths) == pytest.approx(120 / (3 * 20 + 3 * 30))
    assert lag1_correlation([[0], [4], [1], [5], [2], [3]], lengths, stat="max") < -0.5
    assert bucket_mix_kl([[0], [2], [4], [1], [3], [5]] * 5, lengths, [10, 20, 30], tail=0.2) == pytest.approx(0.0)


def test_our_samplers_sit_on_or_above_every_baseline_frontier():
    lengths = lognormal_lengths(20000, 6)
    points = {p.name: p for p in evaluate_strategies(lengths, 16384, k=6, max_len=3072)}
    for ours in ("bucketed_optimal", "packed"):
        assert dominating_baselines(points[ours], list(points.values())) == []
    assert points["sorted"].recurrence == 1.0 and points["length_grouped"].lag1 > 0.5
    assert points["bucketed_optimal"].efficiency > points["random"].efficiency + 0.3
    assert points["packed"].efficiency >= 0.98 and points["bucketed_optimal"].recurrence < 0.05


def test_randomness_report_of_a_sampler():
    lengths = lognormal_lengths(2000, 8, mu=3.0, sigma=0.7, max_len=64)
    r = randomness(make("bucketed", lengths, world_size=2), EDGES)
    assert 0 < r.recurrence < 0.2 and abs(r.lag1) < 0.3 and r.tail_kl < 0.1 and r.dropped >= 0


@pytest.mark.parametrize("call, message", [
    (lambda: make("bucketed", []), "empty"),
    (lambda: BucketedShuffleSampler([5, 70], EDGES, BUDGET), "do not cover sample 1 of 70 tokens"),
    (lambda: BucketedShuffleSampler([5, 6], (16, 8), BUDGET), "strictly ascending"),
    (lambda: BucketedShuffleSampler([5, 6], EDGES, 63), "token_budget 63 is below the cost"),
    (lambda: RandomShuffleSampler([5, 300], BUDGET), "sample 1"),
    (lambda: PackedSampler([5, 300], BUDGET), "sample 1 has 300 tokens"),
    (lambda: make("random", [5, 6, 7], world_size=4).epoch_plan(0), "world_size=4 is larger"),
    (lambda: make("random", [5, 6], rank=2, world_size=2), "rank"),
    (lambda: BucketedShuffleSampler([5, 6], EDGES, BUDGET, batch_sizes=[17, 6, 4]), r"batch_sizes\[0\] = 17"),
])
def test_bad_input_is_refused_with_a_clear_message(call, message):
    with pytest.raises(SamplerError, match=message):
        call()


def test_state_from_other_data_or_settings_is_refused():
    lengths = lognormal_lengths(200, 9, mu=3.0, sigma=0.7, max_len=64)
    state = make("bucketed", lengths, seed=1).state_dict()
    with pytest.raises(SamplerError, match="seed"):
        make("bucketed", lengths, seed=2).load_state_dict(state)
    with pytest.raises(SamplerError, match="fingerprint"):
        make("bucketed", lengths[::-1].copy(), seed=1).load_state_dict(state)
    with pytest.raises(SamplerError, match="step"):
        make("bucketed", lengths, seed=1).load_state_dict(state | {"step": 10**6})


def test_dominance_needs_a_margin_beyond_measurement_noise():
    from dflash_lib.plan.sampler import StrategyPoint, dominates

    ours = StrategyPoint("ours", False, 0.880, 0.010, 0.01, 0.0, 100, None, 0.001, 0.0005, 0.01)
    tie = StrategyPoint("tie", True, 0.882, 0.010, 0.00, 0.0, 100, None, 0.001, 0.0005, 0.01)  # +0.002 < 2.8 SE
    better = StrategyPoint("better", True, 0.890, 0.009, 0.00, 0.0, 100, None, 0.001, 0.0005, 0.01)
    worse_rec = StrategyPoint("worse", True, 0.890, 0.020, 0.00, 0.0, 100, None, 0.001, 0.0005, 0.01)
    assert not dominates(tie, ours) and not dominates(ours, tie)
    assert dominates(better, ours) and not dominates(ours, better)
    assert not dominates(worse_rec, ours) and not dominates(ours, worse_rec)
    exact = [StrategyPoint(n, True, e, r, 0.0, 0.0, 1, None) for n, e, r in [("a", 0.9, 0.1), ("b", 0.9, 0.2)]]
    assert dominates(exact[0], exact[1])  # without noise any strict gain counts


def test_fixed_batch_sampler_replays_its_batches_every_epoch():
    from dflash_lib.plan.sampler import FixedBatchSampler, SamplerError

    s = FixedBatchSampler([[3, 1], [2]])
    first = list(s)
    s.set_epoch(5)
    assert first == list(s) == [[3, 1], [2]] and len(s) == 2
    with pytest.raises(SamplerError, match="no empty batch"):
        FixedBatchSampler([[1], []])
