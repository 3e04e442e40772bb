"""Block budget: drafter query tokens (anchors x block_size) per sample from the store's loss masks, every sampler
bounded by them as well as by target tokens, the derived budget, refusals, resume, and the fit check's queries."""

import itertools
import json

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dflash_lib.config import BucketConfig, ModelConfig, SamplerConfig, from_params, preset
from dflash_lib.data.batch import collate_padded
from dflash_lib.data.stats import drafter_queries, store_drafter_queries, valid_anchor_counts
from dflash_lib.models.anchors import sample_anchors
from dflash_lib.plan.buckets import BucketFitError, plan_for_edges
from dflash_lib.plan.fit import check_fit, worst_batch_queries
from dflash_lib.plan.sampler import (BatchBudget, BlockBudget, Bound, BucketedShuffleSampler, LengthGroupedSampler,
                                     PackedSampler, RandomShuffleSampler, SamplerError, SortedStaticSampler,
                                     TokenBudget, budget_use, derived_block_budget, fill_in_order, fixed_batch_sizes,
                                     pack_rows, resolve_block_budget, worst_batch_refusal)

BUDGET = 256  # target tokens per batch
EDGES = (16, 40, 64)
FIXED = (16, 6, 4)  # rows per bucket: 16*16, 6*40, 4*64 <= 256


def make(kind, lengths, queries=None, block_budget=None, seed=0, rank=0, world_size=1):
    kw = dict(rank=rank, world_size=world_size, queries=queries, block_budget=block_budget)
    if kind == "sorted":
        return SortedStaticSampler(lengths, BUDGET, seed, **kw)
    if kind == "random":
        return RandomShuffleSampler(lengths, BUDGET, seed, **kw)
    if kind == "bucketed":
        return BucketedShuffleSampler(lengths, EDGES, BUDGET, seed, **kw)
    if kind == "static":
        return BucketedShuffleSampler(lengths, EDGES, BUDGET, seed, batch_sizes=FIXED, **kw)
    if kind == "grouped":  # Hugging Face's megabatches, capped at GROUPED samples, cut by the budgets too
        return LengthGroupedSampler(lengths, GROUPED, seed, mega_batch_mult=3, token_budget=BUDGET, **kw)
    return PackedSampler(lengths, BUDGET, seed, window=4, **kw)


GROUPED = 8  # the length-grouped sampler's batch size
KINDS = ["sorted", "random", "bucketed", "static", "packed", "grouped"]


def corpus(seed, n, max_len=64, assistant=0.6):
    """Random samples: lengths (n,) in [1, max_len], loss masks back to back (T,) uint8, offsets (n+1,)."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, max_len + 1, n)
    mask = (rng.random(int(lengths.sum())) < assistant).astype(np.uint8)
    return lengths, mask, np.concatenate([[0], np.cumsum(lengths)])


def brute_valid(mask, offsets, max_len=None):
    """Valid anchors per sample by the definition, one position at a time."""
    out = []
    for i in range(len(offsets) - 1):
        m = mask[offsets[i]:offsets[i + 1]][:max_len]
        out.append(sum(1 for a in range(len(m)) if a + 1 < len(m) and m[a] and m[a + 1]))
    return np.asarray(out)


# -- per-sample drafter queries from the loss masks


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**31), n=st.integers(1, 40), max_len=st.integers(1, 70), chunk=st.integers(1, 200))
def test_valid_anchor_counts_match_the_definition_with_truncation(seed, n, max_len, chunk):
    lengths, mask, off = corpus(seed, n, max_len=64, assistant=0.7)
    want = brute_valid(mask, off, max_len)
    np.testing.assert_array_equal(valid_anchor_counts(mask, off, max_len, chunk_tokens=chunk), want)
    # the store cuts each sample to its first max_len tokens; counting the cut store without max_len agrees
    keep = np.concatenate([np.arange(a, min(b, a + max_len)) for a, b in zip(off[:-1], off[1:])])
    cut_off = np.concatenate([[0], np.cumsum(np.minimum(lengths, max_len))])
    np.testing.assert_array_equal(valid_anchor_counts(mask[keep], cut_off, chunk_tokens=chunk), want)


def test_drafter_queries_equal_the_blocks_sample_anchors_draws():
    lengths, mask, off = corpus(3, 30, max_len=48, assistant=0.8)
    mask[off[5]:off[6]] = 0  # a sample with no anchor at all
    mask[off[7]:off[8]] = 1  # one fully trained: length - 1 anchors
    ids = np.arange(int(off[-1])) % 97 + 3
    samples = [(ids[a:b], mask[a:b]) for a, b in zip(off[:-1], off[1:])]
    batch = collate_padded(samples, pad_id=0)
    for num_anchors, block_size in [(10_000, 1), (4, 8), (1, 16)]:
        anchors = sample_anchors(batch, num_anchors, block_size, gamma=4.0, mask_id=1,
                                 generator=torch.Generator().manual_seed(0))
        drawn = anchors.valid.sum(dim=1).numpy() * block_size  # (R,) one document per row
        got = drafter_queries(valid_anchor_counts(mask, off), num_anchors, block_size)
        np.testing.assert_array_equal(got, drawn)
    assert got[5] == 0 and valid_anchor_counts(mask, off)[7] == lengths[7] - 1


def test_store_drafter_queries_read_the_memmapped_store(tmp_path):
    from dflash_lib.data import build_token_store

    convs = [{"id": str(i), "conversations": [{"from": "human", "value": "question " * (3 + i)},
                                              {"from": "gpt", "value": "answer word " * (2 + 5 * i)}]}
             for i in range(6)]
    path = tmp_path / "c.jsonl"
    path.write_text("\n".join(json.dumps(c) for c in convs))
    full = build_token_store(str(path), max_len=4096, cache_dir=tmp_path / "cache", progress=False)
    max_len = int(np.sort(full.lengths)[2])  # half the samples get cut inside their answer
    cut = build_token_store(str(path), max_len=max_len, cache_dir=tmp_path / "cache", progress=False)
    want = np.asarray([min(3, v) * 4 for v in brute_valid(np.concatenate([cut[i][1] for i in range(6)]),
                                                          np.concatenate([[0], np.cumsum(cut.lengths)]))])
    got = store_drafter_queries(cut, num_anchors=3, block_size=4)
    np.testing.assert_array_equal(got, want)
    full_mask = np.concatenate([full[i][1] for i in range(6)])
    full_off = np.concatenate([[0], np.cumsum(full.lengths)])
    np.testing.assert_array_equal(got, drafter_queries(valid_anchor_counts(full_mask, full_off, max_len), 3, 4))
    assert (store_drafter_queries(full, 3, 4) >= got).all() and got.sum() > 0


# -- every sampler within both budgets, every sample once


def served(kind, lengths, queries, block_budget, world_size, epoch):
    """All ranks' batches of one epoch, and the plan's dropped count."""
    batches = []
    for rank in range(world_size):
        s = make(kind, lengths, queries, block_budget, seed=7, rank=rank, world_size=world_size)
        s.set_epoch(epoch)
        batches += list(s)
    return batches, s.epoch_plan(epoch).dropped


def within_token_budget(kind, x):
    if kind == "packed":
        return x.sum() <= BUDGET
    if kind == "static":
        return len(x) <= FIXED[int(np.searchsorted(EDGES, x.max()))]
    return len(x) * x.max() <= BUDGET and (kind != "grouped" or len(x) <= GROUPED)


@pytest.mark.parametrize("kind", KINDS)
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**31), n=st.integers(8, 150), world_size=st.sampled_from([1, 2]),
       num_anchors=st.integers(1, 40), slack=st.integers(0, 300))
def test_every_batch_within_both_budgets_and_every_sample_once(kind, seed, n, world_size, num_anchors, slack):
    lengths, mask, off = corpus(seed, n)
    queries = drafter_queries(valid_anchor_counts(mask, off), num_anchors, 4)
    if kind == "static":  # fixed rows: the budget must hold each bucket's FIXED costliest samples
        bucket = np.searchsorted(EDGES, lengths)
        need = max(int(np.sort(queries[bucket == k])[::-1][:FIXED[k]].sum()) for k in range(3))
    else:
        need = int(queries.max())
    block_budget = max(1, need) + slack
    try:
        batches, dropped = served(kind, lengths, queries, block_budget, world_size, epoch=1)
    except SamplerError as e:
        assert world_size == 2 and "world_size" in str(e)  # too few batches (of one bucket) for two ranks
        return
    for b in batches:
        assert within_token_budget(kind, lengths[b]) and queries[b].sum() <= block_budget
    flat = np.concatenate(batches)
    assert len(np.unique(flat)) == len(flat) and len(flat) + dropped == n
    if world_size == 1:
        assert dropped == 0


@pytest.mark.parametrize("kind", ["sorted", "random", "bucketed", "packed"])
def test_short_documents_are_split_by_the_block_budget(kind):
    """400 documents of 16 tokens, all trained: token-only batches hold 16 (packed: 16 per row); 15 anchors x
    4 = 60 queries each, so a budget of 240 query tokens holds only 4 per batch."""
    lengths = np.full(400, 16)
    mask = np.ones(6400, dtype=np.uint8)
    queries = drafter_queries(valid_anchor_counts(mask, np.arange(0, 6401, 16)), 64, 4)
    assert (queries == 60).all()
    tokens_only = make(kind, lengths)
    both = make(kind, lengths, queries, 240)
    assert len(tokens_only) == 25 and len(both) == 100
    assert max(queries[b].sum() for b in tokens_only) == 960 and max(queries[b].sum() for b in both) == 240
    # 4 x 16 of 256 tokens, 240 of 240 queries; every batch closed by the block budget (but the epoch's last of a
    # fill sequence, which the data closed; a packed row with no room for a 5th sample's queries is closed too)
    use = budget_use(both)
    assert (use.batches, use.token_fill, use.query_fill, use.bound_tokens) == (100, 0.25, 1.0, 0.0)
    assert use.bound_blocks == (1.0 if kind == "packed" else 0.99)
    alone = budget_use(tokens_only)  # 16 x 16 = 256 tokens: full; no block budget to report
    assert (alone.token_fill, alone.query_fill, alone.bound_blocks) == (1.0, None, None)
    assert alone.bound_tokens == (1.0 if kind == "packed" else 24 / 25)


def test_the_fill_closes_each_batch_at_the_first_budget_the_next_sample_would_pass():
    budget = TokenBudget(64)
    cap = budget.capacity_table(30)
    # [10 10 10] + 30 -> 4 x 30 = 120 tokens > 64; [30 5] + 5 -> 3 x 30 > 64 and 48 + 8 queries > 48; [5] ends
    offsets, bound = fill_in_order(np.array([10, 10, 10, 30, 5, 5]), cap, np.array([8, 8, 8, 8, 40, 8]), 48)
    assert offsets.tolist() == [0, 3, 5, 6] and bound.tolist() == [Bound.TOKENS, Bound.TOKENS | Bound.BLOCKS, 0]
    offsets, bound = fill_in_order(np.full(4, 4), cap, np.full(4, 20), 48)  # 3 x 20 queries > 48, tokens 12
    assert offsets.tolist() == [0, 2, 4] and bound.tolist() == [Bound.BLOCKS, Bound.NONE]
    offsets, bound = fill_in_order(np.full(5, 4), cap, max_size=2)  # a size cap closes batches by neither budget
    assert offsets.tolist() == [0, 2, 4, 5] and bound.tolist() == [0, 0, 0]
    rule = BatchBudget(budget, BlockBudget(48))
    assert rule.refusal([10, 10, 10], [8, 8, 8], 30, 8) == Bound.TOKENS
    assert rule.refusal([30, 5], [8, 40], 5, 8) == Bound.TOKENS | Bound.BLOCKS
    assert rule.fill([30, 5], [8, 40]) == (60 / 64, 48 / 48)  # 2 rows x 30 tokens; 48 of 48 queries
    packed = BatchBudget(budget, BlockBudget(48), packed=True)
    assert packed.fill([30, 5], [8, 40]) == (35 / 64, 1.0) and packed.refusal([30, 5], [8, 8], 29) == Bound.NONE
    assert rule.fill([30, 5], None, row_len=40) == (80 / 64, None)  # rows padded to 40 (static shapes)


def test_packed_rows_record_the_budget_that_closed_them():
    # window 1: 5 does not fit the row of 6 (room 4): that row leaves the window; 4 fills the row of 5 to 9, no
    # room for the smallest sample (3); the row of 3 is still open at the end
    positions, offsets, bound = pack_rows(np.array([6, 5, 4, 3]), 10, window=1)
    assert positions.tolist() == [0, 1, 2, 3] and offsets.tolist() == [0, 1, 3, 4]
    assert bound.tolist() == [Bound.TOKENS, Bound.TOKENS, Bound.NONE]
    # the drafter queries fill rows first (100 of 50 queries against 8 of 100 tokens): the same, in queries
    positions, offsets, bound = pack_rows(np.full(4, 2), 100, 1, np.array([30, 30, 10, 30]), 50)
    assert offsets.tolist() == [0, 1, 3, 4] and bound.tolist() == [Bound.BLOCKS, Bound.BLOCKS, Bound.NONE]


FILL_KINDS = ["sorted", "random", "bucketed", "grouped"]


@pytest.mark.parametrize("kind", FILL_KINDS)
@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**31), n=st.integers(8, 120), num_anchors=st.integers(1, 40), slack=st.integers(0, 200))
def test_every_fill_closes_where_the_one_rule_refuses_the_next_sample(kind, seed, n, num_anchors, slack):
    """Each batch of a fill sequence (the epoch's order; a bucket; a megabatch) ends where `BatchBudget.refusal`
    says the next sample of the sequence passes a budget, with that Bound; the last batch of a sequence ends with
    none (as does a length-grouped batch cut at its size)."""
    lengths, mask, off = corpus(seed, n)
    queries = drafter_queries(valid_anchor_counts(mask, off), num_anchors, 4)
    s = make(kind, lengths, queries, max(1, int(queries.max())) + slack, seed=seed % 1000)
    plan, rule = s.epoch_plan(1), s.batch_budget
    if kind == "bucketed":
        bucket = np.searchsorted(EDGES, lengths[plan.order])
        ends = set(np.flatnonzero(np.diff(bucket)) + 1) | {n}
    elif kind == "grouped":
        ends = set(range(3 * GROUPED, n, 3 * GROUPED)) | {n}
    else:
        ends = {n}
    for b in range(len(plan.offsets) - 1):
        lo, hi = plan.offsets[b], plan.offsets[b + 1]
        batch = plan.order[lo:hi]
        if hi in ends:
            assert plan.bound[b] == Bound.NONE
            continue
        nxt = plan.order[hi]
        why = rule.refusal(lengths[batch], queries[batch], lengths[nxt], queries[nxt])
        if kind == "grouped" and why == Bound.NONE:
            assert hi - lo == GROUPED  # only the size closed it
        assert plan.bound[b] == why


def test_static_batch_sizes_follow_the_block_budget():
    from dflash_lib.train.build import static_batch_sizes

    assert static_batch_sizes([100, 500, 2048], 2048) == [20, 4, 1]
    # bucket 0: 3 samples of 64 drafter query tokens and 10 of 16: its 7 costliest hold 3*64 + 4*16 = 256, the
    # 8th passes a 256-query budget (a bound of rows x its costliest, 256 // 64, would allow only 4); bucket 1: no
    # anchor anywhere, tokens decide (2048 // 500); bucket 2: one sample
    lengths = np.array([50] * 13 + [400] * 6 + [2000])
    queries = np.array([64] * 3 + [16] * 10 + [0] * 6 + [200])
    assert static_batch_sizes([100, 500, 2048], 2048, None, 256, lengths, queries) == [7, 4, 1]
    budget = BatchBudget(TokenBudget(2048), BlockBudget(256))
    costliest = [np.sort(queries[:13])[::-1], queries[13:19], queries[19:]]
    assert worst_batch_refusal(budget, 7, 100, costliest[0]) == Bound.BLOCKS  # 8 rows of 100 fit the tokens
    assert worst_batch_refusal(budget, 4, 500, costliest[1]) == Bound.TOKENS  # 5 rows of 500 = 2500 > 2048
    assert worst_batch_refusal(budget, 1, 2048, costliest[2]) == Bound.NONE  # the bucket has no second sample
    assert worst_batch_refusal(budget, 3, 500, costliest[1]) == Bound.NONE  # a size below what the budgets allow
    assert fixed_batch_sizes(budget, [100], [np.array([300])]) == [1]  # never below one row
    lengths = np.array([10] * 30 + [30] * 10 + [60] * 5)
    queries = np.array([40] * 30 + [120] * 10 + [120] * 5)
    with pytest.raises(SamplerError, match=r"batch_sizes\[0\] = 16 rows of bucket 0 can hold 640 drafter query "
                                           r"tokens .*block_budget 200"):
        BucketedShuffleSampler(lengths, EDGES, BUDGET, batch_sizes=FIXED, queries=queries, block_budget=200)
    sizes = static_batch_sizes(list(EDGES), BUDGET, None, 200, lengths, queries)
    assert sizes == [5, 1, 1]
    s = BucketedShuffleSampler(lengths, EDGES, BUDGET, batch_sizes=sizes, queries=queries, block_budget=200)
    assert len(s) == 6 + 10 + 5
    # every full batch is bound by the block budget (a 6th row of 40, a 2nd of 120 queries pass 200); none is
    # partial here (30 = 6 x 5)
    assert (s.epoch_plan(0).served_bound() == Bound.BLOCKS).all()
    wide = BucketedShuffleSampler(lengths, EDGES, BUDGET, batch_sizes=[4, 1, 1], queries=queries, block_budget=400)
    assert (wide.epoch_plan(0).served_bound() == Bound.NONE).all()  # sizes below what both budgets allow
    full = BucketedShuffleSampler(lengths, EDGES, BUDGET, batch_sizes=FIXED, queries=queries, block_budget=10_000)
    plan = full.epoch_plan(0)  # 16 + 14, 6 + 4, 4 + 1 rows: the full batches bound by the tokens, the rest by none
    rows = np.diff(plan.offsets)[plan.steps.ravel()]
    assert sorted(zip(rows.tolist(), plan.served_bound().tolist())) == [(1, 0), (4, 0), (4, 1), (6, 1), (14, 0),
                                                                        (16, 1)]
    use = budget_use(full)  # rows padded to their edge: 16x16, 14x16, 6x40, 4x40, 4x64, 1x64 of 256 tokens
    assert use.token_fill == pytest.approx((256 + 224 + 240 + 160 + 256 + 64) / 6 / 256)
    assert use.bound_tokens == 0.5 and use.bound_blocks == 0.0


def test_build_sampler_applies_the_resolved_block_budget():
    from dflash_lib.train.build import build_sampler

    rng = np.random.default_rng(2)
    lengths = rng.integers(2, 512, 300)
    queries = np.minimum(lengths - 1, 8) * 4
    for strategy, static in [("sorted", False), ("random", False), ("bucketed", False), ("bucketed", True),
                             ("packed", False)]:
        cfg = from_params({"strategy": strategy, "static_shapes": static, "block_budget": 96}, preset("smoke"))
        s = build_sampler(cfg, lengths, 0, 1, [128, 256, 512], queries)
        assert s.block_budget == 96 == resolve_block_budget(cfg.sampler, cfg.buckets, cfg.model, cfg.data.max_len)
        assert max(queries[b].sum() for b in s.epoch_plan(0).batches()) <= 96
        assert build_sampler(cfg, lengths, 0, 1, [128, 256, 512]).block_budget is None  # no queries: tokens only
    cfg = from_params({"strategy": "bucketed", "static_shapes": True}, preset("smoke"))
    s = build_sampler(cfg, lengths, 0, 1, [128, 256, 512], queries)
    derived = resolve_block_budget(cfg.sampler, cfg.buckets, cfg.model, cfg.data.max_len)
    assert s.block_budget == derived and all(b * 32 <= derived for b in s.batch_sizes)


# -- the derived budget, refusals, resume


def test_derived_block_budget_is_a_batch_of_full_length_documents():
    # the paper: 16384 tokens hold 5 documents of 3072; 512 anchors x 16
    assert derived_block_budget(16384, 3072, 512, 16) == 5 * 512 * 16 == 40960
    assert derived_block_budget(2048, 4096, 64, 8) == 1 * 64 * 8  # below one full document: still one row
    assert derived_block_budget(64, 8, 100, 4) == 8 * 7 * 4  # a document of 8 tokens has at most 7 anchors
    assert derived_block_budget(2048, 512, 8, 4, q=512.0) == 2 * 8 * 4  # quadratic: g(512) = 1024 -> 2 rows
    paper = ModelConfig(num_anchors=512, block_size=16)
    assert resolve_block_budget(SamplerConfig(token_budget=16384), BucketConfig(), paper, 3072) == 40960
    small = ModelConfig(num_anchors=8, block_size=4)
    assert resolve_block_budget(SamplerConfig(token_budget=2048), BucketConfig(), small, 512) == 4 * 8 * 4
    quadratic = BucketConfig(cost="quadratic", q=512.0)  # g(512) = 1024: 2 rows, but packed rows count tokens
    assert resolve_block_budget(SamplerConfig(token_budget=2048), quadratic, small, 512) == 2 * 8 * 4
    assert resolve_block_budget(SamplerConfig(token_budget=2048, strategy="packed"), quadratic, small, 512) == 4 * 8 * 4
    assert resolve_block_budget(SamplerConfig(block_budget=1000), quadratic, small, 512) == 1000


@pytest.mark.parametrize("kind", KINDS)
def test_a_sample_above_the_block_budget_is_refused(kind):
    lengths = np.array([10, 20, 30, 12, 8, 50])
    queries = np.array([8, 16, 24, 80, 0, 40])
    with pytest.raises(SamplerError, match="sample 3 needs 80 drafter query tokens .* more than block_budget 64"):
        make(kind, lengths, queries, 64)
    with pytest.raises(SamplerError, match="go together"):
        make(kind, lengths, queries, None)
    with pytest.raises(SamplerError, match="queries must be 6 ints"):
        make(kind, lengths, queries[:5], 64)


@pytest.mark.parametrize("kind", KINDS)
def test_resume_refuses_another_block_budget_and_continues_with_the_same(kind):
    lengths, mask, off = corpus(11, 200)
    queries = drafter_queries(valid_anchor_counts(mask, off), 40, 4)
    base = 640 if kind == "static" else 200
    s = make(kind, lengths, queries, base, seed=3)
    it = iter(s)
    head = [next(it) for _ in range(3)]
    state = s.state_dict()
    assert state["block_budget"] == base
    for other in (make(kind, lengths, queries, base + 4, seed=3), make(kind, lengths, seed=3)):
        with pytest.raises(SamplerError, match="block_budget"):
            other.load_state_dict(state)
    with pytest.raises(SamplerError, match="fingerprint"):  # same budget, other queries (e.g. num_anchors)
        make(kind, lengths, np.minimum(queries, 100), base, seed=3).load_state_dict(state)
    again = make(kind, lengths, queries, base, seed=3)
    again.load_state_dict(state)
    assert list(again) == list(it) and len(head) == 3


def test_plans_are_deterministic_from_seed_and_epoch():
    lengths, mask, off = corpus(5, 300)
    queries = drafter_queries(valid_anchor_counts(mask, off), 40, 4)
    for kind in KINDS:
        a = make(kind, lengths, queries, 700, seed=9).epoch_plan(2).csr()
        b = make(kind, lengths, queries, 700, seed=9).epoch_plan(2).csr()
        c = make(kind, lengths, queries, 700, seed=9).epoch_plan(3).csr()
        assert all(np.array_equal(x, y) for x, y in zip(a, b))
        assert kind == "sorted" or not np.array_equal(a[0], c[0])  # sorted freezes batches, shuffles order


# -- the fit check


def brute_worst(lengths, queries, rows_of):
    """Most queries of any batch S with |S| <= rows_of(max length of S), by enumerating every subset."""
    best = 0
    for r in range(1, len(lengths) + 1):
        for S in itertools.combinations(range(len(lengths)), r):
            if r <= rows_of(max(lengths[i] for i in S)):
                best = max(best, sum(int(queries[i]) for i in S))
    return best


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**31), n=st.integers(1, 11))
def test_worst_batch_queries_equal_a_brute_force_search(seed, n):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, 30, n)
    queries = rng.integers(0, 6, n) * 4
    budget = int(rng.integers(30, 120))
    got = worst_batch_queries(lengths, queries, lambda v: budget // v)
    assert got == brute_worst(lengths, queries, lambda m: budget // m)
    assert worst_batch_queries(lengths, queries, lambda v: np.full(len(v), 3)) == np.sort(queries)[::-1][:3].sum()


def test_check_fit_reports_each_buckets_worst_drafter_queries():
    rng = np.random.default_rng(1)
    lengths = rng.integers(1, 41, 18)
    queries = rng.integers(0, 9, 18) * 4
    plan = plan_for_edges(lengths, [15, 40], max_len=40, token_budget=80)  # fixed sizes 5 and 2
    assert plan.batch_sizes == (5, 2)
    members = [np.flatnonzero(lengths <= 15), np.flatnonzero(lengths > 15)]
    dyn = check_fit(plan, dynamic=True, lengths=lengths, queries=queries)
    fixed = check_fit(plan, lengths=lengths, queries=queries)
    for k, idx in enumerate(members):
        assert dyn[k].queries == brute_worst(lengths[idx], queries[idx], lambda m: 80 // m)
        assert fixed[k].queries == brute_worst(lengths[idx], queries[idx], lambda m: plan.batch_sizes[k])
    assert check_fit(plan).__getitem__(0).queries is None  # no queries given: nothing reported
    # per-bucket maxima: the bound rows x max (rows capped by the bucket's samples)
    mq = [int(queries[idx].max()) for idx in members]
    bound = check_fit(plan, max_queries=mq)
    assert [f.queries for f in bound] == [5 * mq[0], 2 * mq[1]]
    # a block budget caps the dynamic fill's worst batch, refuses fixed sizes that exceed it
    cap = fixed[0].queries - 4
    assert check_fit(plan, dynamic=True, lengths=lengths, queries=queries, block_budget=cap)[0].queries == \
        min(dyn[0].queries, cap)
    with pytest.raises(BucketFitError, match=rf"bucket 0 \(0, 15\]: .*{fixed[0].queries} drafter query tokens > "
                                             rf"block_budget {cap}"):
        check_fit(plan, lengths=lengths, queries=queries, block_budget=cap)
    with pytest.raises(BucketFitError, match="a sample needs 32 drafter query tokens > block_budget 31"):
        check_fit(plan, dynamic=True, lengths=lengths, queries=np.where(np.arange(18) == 0, 32, 0),
                  block_budget=31)
