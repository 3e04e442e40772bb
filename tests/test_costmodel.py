"""The calibrated step-time model: recovers known costs, predicts held-out strategies, refuses bad input."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from dflash_lib.plan.costmodel import (BatchShape, CostModel, CostModelError, StepObservation, _nnls,
                                       attention_q_from_fit, candidate_terms, describe_batches, describe_packed,
                                       describe_padded, fit_cost_model, leave_one_out, select_cost_model)
from dflash_lib.plan.sampler import split_by_budget

TRUE = dict(a=0.02, b=2e-6, c=1e-9)  # seconds/step, seconds/padded token, seconds/token^2
BUDGET = 4096  # tokens per batch including padding (packed: per row)


def _fill(lens: np.ndarray, order: np.ndarray) -> list[list[int]]:
    """Batches in `order`, each grown while (n + 1) * max length stays within BUDGET."""
    return [b.tolist() for b in split_by_budget(lens[order], BUDGET)]


def _strategies(n: int = 1500, seed: int = 0) -> dict[str, list[BatchShape]]:
    """One epoch of each of the four strategies on lognormal lengths, as batch shapes; padded batches on padded
    kernels (every slot computed: the fit has to tell padding from documents)."""
    rng = np.random.default_rng(seed)
    lens = np.clip(rng.lognormal(5.5, 0.8, n).astype(np.int64), 8, 2048)  # (n,) tokens
    out = {"sorted": describe_batches(_fill(lens, np.argsort(lens, kind="stable")), padded_kernel=True),
           "random": describe_batches(_fill(lens, rng.permutation(n)), padded_kernel=True)}
    bucket = np.searchsorted(np.quantile(lens, [0.25, 0.5, 0.75, 0.9, 1.0]), lens)
    out["bucketed"] = describe_batches([b for k in range(5)
                                        for b in _fill(lens, rng.permutation(np.flatnonzero(bucket == k)))],
                                       padded_kernel=True)
    rows, cur = [], []
    for i in rng.permutation(n):
        if sum(cur) + lens[i] > BUDGET:
            rows.append(cur)
            cur = []
        cur.append(int(lens[i]))
    out["packed"] = describe_batches(rows + [cur], "packed", BUDGET)
    return out


def _observe(shapes: dict[str, list[BatchShape]], noise: float, seed: int, d: float = 0.0,
             **true: float) -> dict[str, list[StepObservation]]:
    """Step times from the known model (plus d on a run's first step of each shape) with multiplicative noise."""
    a, b, c = (true.get(k, TRUE[k]) for k in "abc")
    rng = np.random.default_rng(seed)
    out = {}
    for name, batch_shapes in shapes.items():
        seen, obs = set(), []
        for s in batch_shapes:
            t = a + b * s.computed_slots + c * s.attention + (d if s.key not in seen else 0.0)
            seen.add(s.key)
            obs.append(StepObservation(s.rows, s.row_len, s.real_tokens, s.attention, padded_kernel=s.padded_kernel,
                                       seconds=t * (1 + noise * rng.standard_normal()), run=name))
        out[name] = obs
    return out


@pytest.fixture(scope="module")
def shapes() -> dict[str, list[BatchShape]]:
    return _strategies()


def _all(obs: dict[str, list[StepObservation]]) -> list[StepObservation]:
    return [o for steps in obs.values() for o in steps]


def test_fit_recovers_known_costs_from_noisy_steps(shapes):
    model = fit_cost_model(_all(_observe(shapes, noise=0.03, seed=1)))
    assert model.a == pytest.approx(TRUE["a"], rel=0.05)
    assert model.b == pytest.approx(TRUE["b"], rel=0.05)
    assert model.c == pytest.approx(TRUE["c"], rel=0.10)
    assert model.d == 0.0 and not model.shape_overhead
    assert 0.02 < model.rel_rmse < 0.04  # the residual is the injected 3% noise, no more
    assert attention_q_from_fit(model) == pytest.approx(TRUE["b"] / TRUE["c"], rel=0.12)


def test_noise_free_fit_is_exact(shapes):
    model = fit_cost_model(_all(_observe(shapes, noise=0.0, seed=0)))
    assert (model.a, model.b, model.c) == pytest.approx((TRUE["a"], TRUE["b"], TRUE["c"]), rel=1e-6)
    assert model.rmse_s < 1e-9


def test_leave_one_out_predicts_each_held_out_strategy_within_3_percent(shapes):
    obs = _observe(shapes, noise=0.05, seed=2)
    held = leave_one_out(obs)
    assert set(held) == {"sorted", "random", "bucketed", "packed"}
    for name, h in held.items():
        realized = sum(o.real_tokens for o in obs[name]) / sum(o.seconds for o in obs[name])
        assert h.realized_tok_s == pytest.approx(realized)
        assert h.rel_error == pytest.approx(h.predicted_tok_s / h.realized_tok_s - 1)
        assert abs(h.rel_error) < 0.03, (name, h)
    # the strategies really differ, so agreement is not trivial: random runs at well under sorted's speed
    assert held["random"].realized_tok_s < 0.7 * held["sorted"].realized_tok_s


def test_padding_only_prediction_misses_where_the_fitted_model_does_not(shapes):
    """The reference run's error: throughput ~ efficiency x sorted throughput ignores step and attention costs."""
    obs = _observe(shapes, noise=0.0, seed=0)
    tok_s = {k: sum(o.real_tokens for o in v) / sum(o.seconds for o in v) for k, v in obs.items()}
    eff = {k: sum(s.real_tokens for s in v) / sum(s.padded_tokens for s in v) for k, v in shapes.items()}
    naive = tok_s["sorted"] * eff["bucketed"] / eff["sorted"]
    fitted = leave_one_out(obs)["bucketed"]
    assert abs(naive / tok_s["bucketed"] - 1) > 5 * abs(fitted.rel_error)


def test_shape_term_is_chosen_and_recovered_when_new_shapes_cost_time(shapes):
    obs = _observe(shapes, noise=0.01, seed=3, d=0.05)
    choice = select_cost_model(obs)
    assert choice.model.shape_overhead
    assert choice.model.d == pytest.approx(0.05, rel=0.10)
    assert choice.max_abs_error < 0.03 and choice.nested_max_abs_error < 0.03
    without_d = tuple(t for t in choice.model.terms if t != "d")
    assert choice.candidates[without_d] > choice.candidates[choice.model.terms]


def test_shape_term_is_left_out_when_it_does_not_help_held_out_error(shapes):
    obs = _observe(shapes, noise=0.05, seed=4)
    choice = select_cost_model(obs)
    assert not choice.model.shape_overhead and choice.model.d == 0.0
    with_d = tuple(sorted({*choice.model.terms, "d"}, key=("a", "b", "r", "c", "e", "d").index))
    assert choice.candidates[with_d] >= choice.candidates[choice.model.terms]  # d only fits noise here
    assert choice.held_out == leave_one_out(obs, choice.model.terms)
    assert choice.max_abs_error < 0.03 and choice.nested_max_abs_error < 0.03


def test_predict_throughput_matches_a_hand_computation():
    model = CostModel(a=0.1, b=1e-3, c=1e-6, d=0.05, terms=("a", "b", "c", "d"))
    padded = describe_padded([3, 5], padded_kernel=True)  # R=2, T=5: 10 slots, attention 2*25 = 50, 8 real
    packed = describe_packed([[4, 4]], row_len=10, padded_kernel=True)  # 1 x 10 slots, attention 16 + 16, 8 real
    assert (padded.padded_tokens, padded.attention, padded.real_tokens) == (10, 50.0, 8)
    assert (packed.padded_tokens, packed.attention, packed.real_tokens) == (10, 32.0, 8)
    t_pad, t_pack = 0.1 + 0.010 + 50e-6, 0.1 + 0.010 + 32e-6
    batches = [padded, packed, padded]  # two new shapes, then a repeat
    expected_s = 2 * t_pad + t_pack + 2 * 0.05
    assert model.predict_seconds(batches) == pytest.approx(expected_s, rel=1e-12)
    assert model.predict_throughput(batches) == pytest.approx(24 / expected_s, rel=1e-12)
    warm = model.predict_throughput(batches, warm_shapes=[padded.key, packed.key])
    assert warm == pytest.approx(24 / (2 * t_pad + t_pack), rel=1e-12)
    # without a padded kernel a batch is priced by its documents: 8 computed slots, attention 9 + 25 (16 + 16)
    free, free_packed = describe_padded([3, 5]), describe_packed([[4, 4]], row_len=10)
    assert (free.computed_slots, free.padded_tokens, free.attention) == (8, 10, 34.0)
    assert model.predict_step(free) == pytest.approx(0.1 + 0.008 + 34e-6, rel=1e-12)
    assert model.predict_step(free_packed) == pytest.approx(0.1 + 0.008 + 32e-6, rel=1e-12)


def test_batch_descriptions_price_layouts_and_edges():
    assert describe_padded([3, 5], pad_to=8).key == (2, 8)
    assert describe_padded([3, 5], pad_to=8, padded_kernel=True).attention == 2 * 64
    assert describe_padded([3, 5], pad_to=8).attention == 9 + 25  # per document, whatever the padding
    assert describe_packed([[4, 4], [9]], row_len=10, varlen=False).attention == 2 * 100
    assert describe_packed([[4, 4], [9]], row_len=10).attention == 16 + 16 + 81
    model = CostModel(a=0.01, b=1e-6, c=1e-9)
    to_max = describe_batches([[100, 120], [300, 310]], padded_kernel=True)
    to_edge = describe_batches([[100, 120], [300, 310]], row_len=512, padded_kernel=True)
    assert model.predict_throughput(to_edge) < model.predict_throughput(to_max)
    # padding-free kernels: padding to the edge costs nothing, the documents are the same
    assert model.predict_throughput(describe_batches([[100, 120], [300, 310]], row_len=512)) == \
        model.predict_throughput(describe_batches([[100, 120], [300, 310]]))
    with pytest.raises(CostModelError, match="row 1: 11 tokens do not fit row_len=10"):
        describe_packed([[4], [5, 6]], row_len=10)
    with pytest.raises(CostModelError, match="lengths must be > 0"):
        describe_padded([3, 0])
    with pytest.raises(CostModelError, match="layout must be"):
        describe_batches([[3]], layout="ragged")


def _obs(rows: int, row_len: int, seconds: float = 0.1, **kw) -> StepObservation:
    base = dict(real_tokens=rows * row_len, attention=float(rows * row_len**2))
    return StepObservation(rows, row_len, **{**base, **kw}, seconds=seconds)


def test_degenerate_observations_are_refused_with_a_clear_error():
    with pytest.raises(CostModelError, match="3 observations for 3 terms"):
        fit_cost_model([_obs(1, 10), _obs(2, 20), _obs(3, 30)])
    with pytest.raises(CostModelError, match=r"all 8 observations have the same \(rows, row_len\) = \(4, 128\)"):
        fit_cost_model([_obs(4, 128, 0.1 + 0.001 * i) for i in range(8)])
    # two shapes, many steps: a, b, c are still not separable
    with pytest.raises(CostModelError, match="span only 2 of the 3 terms"):
        fit_cost_model([_obs(4, 128)] * 4 + [_obs(8, 256)] * 4)
    with pytest.raises(CostModelError, match=r"observation 2 \(run 'probe'\): seconds=0"):
        fit_cost_model([_obs(1, 10), _obs(2, 20), _obs(3, 30, seconds=0.0, run="probe"), _obs(4, 40)])
    with pytest.raises(CostModelError, match=r"observation 0 .*real_tokens=50 must be in \(0, padded_tokens=40\]"):
        fit_cost_model([_obs(1, 40, real_tokens=50)] + [_obs(i, 10 * i) for i in range(2, 6)])
    with pytest.raises(CostModelError, match="needs at least 2 strategies"):
        leave_one_out({"sorted": [_obs(1, 10)]})
    with pytest.raises(CostModelError, match="no batches"):
        CostModel(a=0.1).predict_throughput([])
    with pytest.raises(CostModelError, match=r"unknown cost-model terms \['z'\]"):
        fit_cost_model([_obs(i, 10 * i) for i in range(1, 6)], terms=("a", "z"))
    with pytest.raises(CostModelError, match="needs at least 3 strategies"):
        select_cost_model({"sorted": [_obs(1, 10)], "random": [_obs(2, 20)]})


def test_fit_never_returns_negative_costs():
    """Steps that would suggest a negative attention cost give c = 0, never c < 0."""
    rng = np.random.default_rng(5)
    obs = []
    for _ in range(40):
        R, T = int(rng.integers(1, 16)), int(rng.integers(16, 1024))
        t = 0.01 + 1e-6 * R * T - 5e-10 * R * T * T
        obs.append(_obs(R, T, seconds=max(t, 1e-4)))
    model = fit_cost_model(obs)
    assert min(model.a, model.b, model.c) >= 0.0
    assert model.c == 0.0
    assert attention_q_from_fit(model) == math.inf


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 10_000), st.integers(6, 30), st.integers(1, 4))
def test_nnls_meets_the_optimality_conditions(seed, n, p):
    """KKT of min ||Xw - y||, w >= 0: w >= 0, gradient >= 0, gradient == 0 where w > 0."""
    rng = np.random.default_rng(seed)
    X = rng.uniform(0, 1, (n, p))  # (n, p)
    y = rng.normal(0, 1, n)  # (n,)
    w = _nnls(X, y)
    grad = X.T @ (X @ w - y)  # (p,)
    assert (w >= 0).all()
    assert (grad >= -1e-8).all()
    assert np.allclose(grad[w > 0], 0.0, atol=1e-8)


def test_block_term_is_recovered_when_blocks_vary_independently():
    """The drafter's LM-head work scales with anchor blocks (documents), not tokens: fit it as its own term."""
    from dflash_lib.plan.costmodel import anchor_blocks, describe_padded

    rng = np.random.default_rng(3)
    true = dict(a=0.05, b=2e-5, c=1e-9, e=4e-4)
    obs = []
    for i in range(120):
        docs = rng.integers(20, 900, size=int(rng.integers(1, 12)))
        shape = describe_padded(docs, anchors_per_doc=int(rng.integers(4, 64)), padded_kernel=True)
        t = true["a"] + true["b"] * shape.padded_tokens + true["c"] * shape.attention + true["e"] * shape.blocks
        obs.append(StepObservation(shape.rows, shape.row_len, shape.real_tokens, shape.attention,
                                   blocks=shape.blocks, seconds=t, padded_kernel=True))
    model = fit_cost_model(obs)
    assert (model.a, model.b, model.c, model.e) == pytest.approx(tuple(true.values()), rel=1e-6)
    assert anchor_blocks(np.array([1, 5, 100]), 8) == 0 + 4 + 8
    assert describe_padded([10, 20]).blocks == 0  # anchors unknown: the term is left out


def test_real_token_term_is_chosen_and_recovered_when_padding_is_cheaper_than_documents(shapes):
    """Work that skips padding (collation, per-document attention calls) costs per REAL token: with it in the
    data, the chosen terms include r and every strategy, random (the only one with much padding) included, is
    predicted within 3%, also when the term choice never saw it (nested)."""
    rng = np.random.default_rng(6)
    true = dict(a=0.02, b=5e-7, r=4e-6, c=1e-9)
    obs = {name: [StepObservation(s.rows, s.row_len, s.real_tokens, s.attention, run=name, padded_kernel=True,
                                  seconds=(true["a"] + true["b"] * s.padded_tokens + true["r"] * s.real_tokens
                                           + true["c"] * s.attention) * (1 + 0.01 * rng.standard_normal()))
                   for s in batch_shapes] for name, batch_shapes in shapes.items()}
    choice = select_cost_model(obs)
    assert "r" in choice.model.terms
    assert choice.model.r == pytest.approx(true["r"], rel=0.1)
    assert choice.max_abs_error < 0.03 and choice.nested_max_abs_error < 0.03
    assert choice.held_out["random"].rel_error == pytest.approx(
        choice.held_out["random"].predicted_tok_s / choice.held_out["random"].realized_tok_s - 1)
    assert set(choice.nested) == set(obs) and all("a" in h.terms for h in choice.nested.values())


def test_candidate_terms_and_tie_break_towards_fewer_terms():
    from dflash_lib.plan.costmodel import choose_terms

    sets = candidate_terms()
    assert len(sets) == 32 and sets[0] == ("a",) and sets[-1] == ("a", "b", "r", "c", "e", "d")
    assert candidate_terms(("c",)) == [("a",), ("a", "c")]
    with pytest.raises(CostModelError, match="unknown terms"):
        candidate_terms(("x",))
    # exact data of a + b * padded: every superset of {a, b} predicts as well; the fewest terms win
    obs = {f"s{k}": [_obs(R, T, seconds=0.01 + 1e-5 * R * T, run=f"s{k}") for R, T in shapes]
           for k, shapes in enumerate([[(1, 10), (2, 30), (3, 50)], [(4, 20), (1, 70)], [(2, 90), (5, 15)]])}
    best, scores = choose_terms(obs, ("b", "c", "d"))
    assert best == ("a", "b") and scores[best] < 1e-9


def test_throughput_noise_is_zero_for_identical_steps_and_grows_with_spread():
    from dflash_lib.plan.costmodel import throughput_rel_sd

    same = [_obs(2, 100, seconds=0.1) for _ in range(20)]
    assert throughput_rel_sd(same) == pytest.approx(0.0, abs=1e-12)
    rng = np.random.default_rng(1)
    noisy = [_obs(2, 100, seconds=0.1 * (1 + 0.1 * rng.standard_normal())) for _ in range(100)]
    # 10% per-step noise over 100 steps: about 10% / sqrt(100) = 1% on the mean rate
    assert 0.005 < throughput_rel_sd(noisy) < 0.02
    shapes = [(1, 50), (4, 300), (2, 900), (8, 64)]
    mixed = [_obs(*shapes[i % 4], real_tokens=int(np.prod(shapes[i % 4]) * rng.uniform(0.5, 1.0)),
                  seconds=(0.01 + 1e-5 * np.prod(shapes[i % 4])) * (1 + 0.2 * rng.standard_normal()))
             for i in range(120)]
    for steps in (noisy, mixed):
        # Independent of the bootstrap: the delta method for a ratio of sums R = sum(r) / sum(s) gives a relative
        # sd of sqrt(n) * sd(r_i - R s_i) / sum(r). 500 resamples estimate an sd to about 3%.
        r = np.array([o.real_tokens for o in steps], dtype=np.float64)  # (S,)
        sec = np.array([o.seconds for o in steps])  # (S,)
        delta = math.sqrt(len(r)) * np.std(r - r.sum() / sec.sum() * sec) / r.sum()
        assert throughput_rel_sd(steps) == pytest.approx(delta, rel=0.1)
        other = throughput_rel_sd(steps, np.random.default_rng(7))
        assert other == pytest.approx(delta, rel=0.1) and other != throughput_rel_sd(steps)
        assert throughput_rel_sd(steps) == throughput_rel_sd(steps, np.random.default_rng(0))  # documented default
    with pytest.raises(CostModelError, match="no steps"):
        throughput_rel_sd([])


def _padding_free_probe(noise: float, seed: int = 8) -> dict[str, list[StepObservation]]:
    """The probe after the target went padding-free: sorted, random, bucketed and packed batches cost their
    documents (real tokens, per-document attention) and anchor blocks; static batches (rows padded to the bucket
    edge, a padded kernel) every slot. True costs: a 0.02 s, b 2e-6 s/computed slot, c 1e-9 s/token^2,
    e 4e-4 s/block; 16 anchors per document."""
    rng = np.random.default_rng(seed)
    lens = np.clip(rng.lognormal(5.5, 0.8, 1200).astype(np.int64), 8, 2048)  # (n,) tokens
    edges = np.quantile(lens, [0.25, 0.5, 0.75, 0.9, 1.0]).astype(np.int64)
    bucket = np.searchsorted(edges, lens)
    by_bucket = [(b, int(edges[k])) for k in range(5)
                 for b in _fill(lens, rng.permutation(np.flatnonzero(bucket == k)))]
    rows, cur = [], []
    for i in rng.permutation(len(lens)):
        if sum(cur) + lens[i] > BUDGET:
            rows.append(cur)
            cur = []
        cur.append(int(lens[i]))
    shapes = {"sorted": describe_batches(_fill(lens, np.argsort(lens, kind="stable")), anchors_per_doc=16),
              "random": describe_batches(_fill(lens, rng.permutation(len(lens))), anchors_per_doc=16),
              "bucketed": describe_batches([b for b, _ in by_bucket], anchors_per_doc=16),
              "packed": [describe_packed([r], BUDGET, anchors_per_doc=16) for r in rows + [cur]],
              "static": [describe_padded(b, pad_to=e, anchors_per_doc=16, padded_kernel=True) for b, e in by_bucket]}
    out = {}
    for name, batch_shapes in shapes.items():
        out[name] = [StepObservation(s.rows, s.row_len, s.real_tokens, s.attention, blocks=s.blocks, run=name,
                                     padded_kernel=s.padded_kernel,
                                     seconds=(0.02 + 2e-6 * s.computed_slots + 1e-9 * s.attention + 4e-4 * s.blocks)
                                     * (1 + noise * rng.standard_normal()))
                     for s in batch_shapes]
    return out


def test_padding_free_batches_are_priced_by_documents_and_blocks_static_ones_by_every_slot():
    obs = _padding_free_probe(noise=0.01)
    choice = select_cost_model(obs)
    assert choice.model.b == pytest.approx(2e-6, rel=0.05) and choice.model.e == pytest.approx(4e-4, rel=0.1)
    assert choice.nested_max_abs_error < 0.03
    # the same steps described as the padded world was (every slot computed, attention over whole rows): the fit
    # now charges random's padding, which it never ran, and misses it
    as_padded = {name: [StepObservation(o.rows, o.row_len, o.real_tokens,
                                        float(o.rows) * o.row_len ** 2 if name != "packed" else o.attention,
                                        blocks=o.blocks, run=name, seconds=o.seconds, padded_kernel=True)
                        for o in steps] for name, steps in obs.items()}
    assert abs(select_cost_model(as_padded).nested["random"].rel_error) > 0.05


def test_held_out_noise_separates_probe_noise_from_model_error():
    from dflash_lib.plan.costmodel import held_out_noise

    exact = _padding_free_probe(noise=0.0)
    choice = select_cost_model(exact)
    assert all(sd < 1e-9 for sd in held_out_noise(exact, choice.nested, draws=20).values())  # noise-free: none
    noisy = _padding_free_probe(noise=0.10)
    choice = select_cost_model(noisy)
    spread = held_out_noise(noisy, choice.nested, draws=40)  # 40 draws: each spread within ~11% of its value
    # 10% per-step scatter over ~50-200 steps: a few tenths of a percent to ~2% on a held-out rate
    assert set(spread) == set(noisy) and all(0.002 < sd < 0.03 for sd in spread.values())
    assert all(abs(h.rel_error) < 3 * spread[name] for name, h in choice.nested.items())  # noise, not model
    # a model without the block term: random (many short documents per token) is missed far beyond the noise
    wrong = leave_one_out(noisy, ("a", "b", "c"))
    spread = held_out_noise(noisy, wrong, draws=40)
    assert abs(wrong["random"].rel_error) > 0.2 and abs(wrong["random"].rel_error) > 5 * spread["random"]
