"""Speculative sampling (temperature > 0, top_p): the accept/resample rule gives exactly the target's distribution
(computed), speculative decoding's first tokens follow it (a chi-square test with its power stated, and a wrong
rule caught), greedy is its temperature-0 limit, and no token outside the nucleus or a masked stop id appears."""

from __future__ import annotations

import itertools
import json
from collections import Counter
from dataclasses import fields

import numpy as np
import pytest
import torch

import dflash_lib.models.sampling as sampling
from dflash_lib.evaluate.acceptance import acceptance_length, greedy_decode
from dflash_lib.target.local import TargetModel
from dflash_lib.models.sampling import BlockRule, block_rule, draw, nucleus, sampling_probs, speculative_step
from tiny_models import decode_drafter, decode_target, random_prompts

V = 4  # the exact rule tests' vocabulary (blocks of B = 3: two draft slots)


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: tiny matmuls run faster on one thread


# -- the rule, exactly ------------------------------------------------------------------------------------------

def _random(shape: tuple[int, ...], gen: torch.Generator, scale: float = 2.0) -> torch.Tensor:
    return torch.softmax(scale * torch.randn(*shape, generator=gen, dtype=torch.float64), dim=-1)


def output_law(p1, p2, p3, q1, q2, rule=block_rule) -> torch.Tensor:
    """(V, V, V) the law of the first three tokens when one block of B = 3 is drafted and verified by `rule`, and
    whatever the block did not produce is then sampled from the target: the sum over every draft (d1, d2), drawn
    with probability q1(d1) q2(d2) (the slots drafted independently, as DFlash does), of each outcome's
    probability. p1 (V,), p2 (V, V) [z1], p3 (V, V, V) [z1, z2]: the target's conditionals."""
    law = torch.zeros(V, V, V, dtype=torch.float64)
    for d1, d2 in itertools.product(range(V), repeat=2):
        w = q1[d1] * q2[d2]
        if w == 0:
            continue
        r = rule(torch.stack([p1, p2[d1], p3[d1, d2]]), torch.stack([q1, q2]), torch.tensor([d1, d2]))
        a1, a2 = r.accept
        law += w * (1 - a1) * r.resample[0][:, None, None] * p2[:, :, None] * p3  # slot 1 rejected
        law[d1] += w * a1 * (1 - a2) * r.resample[1][:, None] * p3[d1]  # slot 1 accepted, slot 2 rejected
        law[d1, d2] += w * a1 * a2 * r.resample[2]  # both accepted, the bonus token
    return law


def _cases() -> dict[str, tuple[torch.Tensor, ...]]:
    """(p1, p2, p3, q1, q2) per case: random; q with zeros where p > 0; p with zeros where q > 0 (p's nucleus);
    both cut to their nucleus; a drafter of tokens (q one-hot); q1 = p1."""
    gen = torch.Generator().manual_seed(0)
    out = {}
    for name in ("random", "q zeros", "p zeros", "both top_p", "q one-hot", "q = p"):
        p1, p2, p3 = _random((V,), gen), _random((V, V), gen), _random((V, V, V), gen)
        q1, q2 = _random((V,), gen), _random((V,), gen)
        if name == "q zeros":
            q1, q2 = nucleus(q1, 0.5), nucleus(q2, 0.5)  # p keeps its full support
            assert (q1 == 0).sum() >= 1 and (q2 == 0).sum() >= 1
        elif name == "p zeros":
            p1, p2, p3 = nucleus(p1, 0.6), nucleus(p2, 0.6), nucleus(p3, 0.6)
        elif name == "both top_p":
            p1, p2, p3, q1, q2 = (nucleus(t, 0.7) for t in (p1, p2, p3, q1, q2))
        elif name == "q one-hot":
            q1, q2 = torch.eye(V, dtype=torch.float64)[1], torch.eye(V, dtype=torch.float64)[2]
        elif name == "q = p":
            q1 = p1.clone()
        out[name] = (p1, p2, p3, q1, q2)
    return out


@pytest.mark.parametrize("case", list(_cases()))
def test_the_rule_gives_the_targets_distribution_exactly(case):
    p1, p2, p3, q1, q2 = _cases()[case]
    want = p1[:, None, None] * p2[:, :, None] * p3  # (V, V, V) the target's own sampling
    got = output_law(p1, p2, p3, q1, q2)
    assert float((got - want).abs().max()) < 1e-12
    assert float(got.sum()) == pytest.approx(1.0, abs=1e-12)


def _accept_always(p, q, draft) -> BlockRule:
    r = block_rule(p, q, draft)
    return BlockRule(torch.ones_like(r.accept), r.resample)


def _residual_from_p(p, q, draft) -> BlockRule:
    r = block_rule(p, q, draft)
    return BlockRule(r.accept, p)


WRONG_RULES = {"accept always": _accept_always, "resample from p, not the residual": _residual_from_p}


def test_wrong_rules_miss_the_targets_distribution():
    """The exact check has teeth: each deliberately wrong rule is off by more than 0.01 in some cell."""
    p1, p2, p3, q1, q2 = _cases()["random"]
    want = p1[:, None, None] * p2[:, :, None] * p3
    for name, rule in WRONG_RULES.items():
        assert float((output_law(p1, p2, p3, q1, q2, rule) - want).abs().max()) > 0.01, name


def test_block_rule_numbers():
    p = torch.tensor([[0.5, 0.5, 0.0], [0.2, 0.2, 0.6], [0.1, 0.1, 0.8]], dtype=torch.float64)  # (B=3, V=3)
    q = torch.tensor([[0.25, 0.25, 0.5], [0.2, 0.2, 0.6]], dtype=torch.float64)
    r = block_rule(p, q, torch.tensor([2, 0]))
    assert r.accept.tolist() == [0.0, 1.0]  # p1(2) / q1(2) = 0; p2(0) / q2(0) = 1
    torch.testing.assert_close(r.resample[0], torch.tensor([0.5, 0.5, 0.0], dtype=torch.float64))  # (p1 - q1)+
    torch.testing.assert_close(r.resample[1], p[1])  # p2 = q2: no residual mass, p2 itself
    torch.testing.assert_close(r.resample[2], p[2])  # the bonus
    with pytest.raises(ValueError, match="probability 0"):
        block_rule(p, torch.tensor([[0.5, 0.5, 0.0], [0.2, 0.2, 0.6]], dtype=torch.float64), torch.tensor([2, 0]))
    with pytest.raises(ValueError, match=r"p \(B, V\), q \(B-1, V\)"):
        block_rule(p, q[:1], torch.tensor([2]))


def test_speculative_step_accepts_by_the_rule_and_draws_b_uniforms():
    """B = 4, V = 6, a drafter of tokens (q one-hot at the draft 1, 2, 3): q = p accepts all three; p1(1) = 0
    rejects slot 1 and never resamples 1; p1, p2 sure of the draft and p3(3) = 0 accept exactly two. Each step
    draws B uniforms (B-1 to accept, one for the token), whatever it accepts."""
    gen = torch.Generator().manual_seed(0)
    p = _random((4, 6), gen)  # (B, V)
    draft = torch.tensor([1, 2, 3])
    q = torch.nn.functional.one_hot(draft, 6).double()  # (B-1, V)
    none = p.clone()
    none[0, 1] = 0.0
    none[0] /= none[0].sum()
    two = p.clone()
    two[:2] = q[:2]
    two[2, 3] = 0.0
    two[2] /= two[2].sum()
    steps = {name: [speculative_step(pp, qq, draft, torch.Generator().manual_seed(s)) for s in range(30)]
             for name, pp, qq in (("all", p, p[:3].clone()), ("none", none, q), ("two", two, q))}
    assert {n for n, _ in steps["all"]} == {3} and len({t for _, t in steps["all"]}) >= 3  # the bonus, from p_B
    assert {n for n, _ in steps["none"]} == {0} and 1 not in {t for _, t in steps["none"]}
    assert {n for n, _ in steps["two"]} == {2} and 3 not in {t for _, t in steps["two"]}
    for pp in (p, none, two):
        a, b = torch.Generator().manual_seed(7), torch.Generator().manual_seed(7)
        speculative_step(pp, q, draft, a)
        torch.rand(3, generator=b, dtype=torch.float64), torch.rand((), generator=b, dtype=torch.float64)
        assert torch.rand(1, generator=a).item() == torch.rand(1, generator=b).item()


def test_nucleus_sampling_probs_and_draw_numbers():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    torch.testing.assert_close(nucleus(probs, 0.8), torch.tensor([0.625, 0.375, 0.0, 0.0]))  # 0.5 + 0.3 reaches it
    torch.testing.assert_close(nucleus(probs, 0.81), torch.tensor([0.5, 0.3, 0.15, 0.0]) / 0.95)
    assert torch.equal(nucleus(probs, 1.0), probs)
    assert nucleus(torch.tensor([0.4, 0.4, 0.2]), 0.3).tolist() == [0.5, 0.5, 0.0]  # a tie at the edge: both kept
    gen = torch.Generator().manual_seed(0)
    rows = torch.softmax(3 * torch.randn(64, 300, generator=gen), dim=-1)  # (64, 300), top 64 too few for some
    rows[:8] = torch.randint(1, 4, (8, 300), generator=gen).float() / 600  # ties everywhere
    rows[:8] /= rows[:8].sum(dim=-1, keepdim=True)
    for top_p in (0.05, 0.5, 0.9, 0.999):
        above = (rows[:, None, :] * (rows[:, None, :] > rows[:, :, None])).sum(dim=-1)  # (64, 300) mass above each
        want = rows * (above < top_p)
        torch.testing.assert_close(nucleus(rows, top_p), want / want.sum(dim=-1, keepdim=True))
    logits = torch.tensor([[0.0, 1.0, float("-inf")]])
    torch.testing.assert_close(sampling_probs(logits, 1.0), torch.tensor([[1, np.e, 0]]) / (1 + np.e))
    torch.testing.assert_close(sampling_probs(logits, 0.5), torch.tensor([[1, np.e ** 2, 0]]) / (1 + np.e ** 2))
    assert sampling_probs(logits.double(), 2.0).dtype == torch.float64
    with pytest.raises(ValueError, match="temperature > 0"):
        sampling_probs(logits, 0.0)
    with pytest.raises(ValueError, match="top_p"):
        nucleus(probs, 0.0)
    rows = torch.tensor([[0.5, 0.0, 0.3, 0.2]]).expand(20000, 4)
    got = draw(rows, torch.Generator().manual_seed(1))
    assert got.shape == (20000,) and got.dtype == torch.long
    share = torch.bincount(got, minlength=4) / 20000
    assert share[1] == 0 and torch.allclose(share, rows[0], atol=4 * (0.25 / 20000) ** 0.5)
    same = [draw(rows[:50], torch.Generator().manual_seed(3)) for _ in range(2)]
    assert torch.equal(*same)
    assert draw(torch.tensor([0.0, 0.0, 2.0]), torch.Generator().manual_seed(0)).item() == 2  # unnormalised row


# -- speculative decoding on a tiny target ----------------------------------------------------------------------

SMALL_VOCAB, B = 16, 4
PROMPT = [3, 7, 1]
T_STAT, TOP_P_STAT, N_STAT, ALPHA, MIN_EXPECTED = 0.05, 0.8, 1500, 1e-3, 5.0


@pytest.fixture(scope="module")
def small() -> TargetModel:
    """A random 4-layer Qwen3 over 16 ids (the last one MASK)."""
    return decode_target(SMALL_VOCAB)


def _law3(target: TargetModel, prompt: list[int], temperature: float, top_p: float) -> torch.Tensor:
    """(V^3,) the exact probability of each first three tokens under the target's sampling, by enumeration."""
    Vs = target.vocab_size

    def probs(seq: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return sampling_probs(target.step(torch.tensor(seq)).logits[-1].double(), temperature, top_p)

    law = torch.zeros(Vs, Vs, Vs, dtype=torch.float64)
    p1 = probs(prompt)
    for a in p1.nonzero().flatten().tolist():
        p2 = probs(prompt + [a])
        for b in p2.nonzero().flatten().tolist():
            law[a, b] = p1[a] * p2[b] * probs(prompt + [a, b])
    return law.flatten()


@pytest.fixture(scope="module")
def law(small) -> torch.Tensor:
    """(V^3,) the exact law of the first three tokens of PROMPT at T_STAT and TOP_P_STAT (`_law3`), enumerated once
    for the chi-square tests."""
    return _law3(small, PROMPT, T_STAT, TOP_P_STAT)


def _pool(values: torch.Tensor, law: torch.Tensor, n: int) -> torch.Tensor:
    """(C,) `values` (V^3,) per cell of law (V^3,): the cells expected >= MIN_EXPECTED times in n, then (when
    they hold any probability) the sum over the other cells of positive probability."""
    big, rare = law * n >= MIN_EXPECTED, (law * n < MIN_EXPECTED) & (law > 0)
    return torch.cat([values[big], values[rare].sum()[None]]) if rare.any() else values[big]


def _cells(law: torch.Tensor, n: int) -> torch.Tensor:
    """(C,) the pooled cells' probabilities (`_pool`)."""
    return _pool(law, law, n)


def _chi_square(counts: torch.Tensor, law: torch.Tensor) -> tuple[float, int, float]:
    """(statistic, degrees of freedom, p-value) of counts (V^3,) against law (V^3,), rare cells pooled
    (`_pool`). A count in a cell of probability 0 (a sequence outside the target's nuclei) makes the statistic
    infinite and the p-value 0."""
    n = int(counts.sum())
    obs, exp = _pool(counts, law, n), _cells(law, n) * n
    if float(counts[law == 0].sum()) > 0:
        return float("inf"), len(exp) - 1, 0.0
    stat = float(((obs - exp) ** 2 / exp).sum())
    df = len(exp) - 1
    return stat, df, float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                                   torch.tensor(stat / 2, dtype=torch.float64)))


def _power(cells: torch.Tensor, n: int, tv: float, runs: int = 4000) -> float:
    """The share of `runs` simulated samples of n, drawn at total-variation distance `tv` from `cells`, that the
    test rejects at ALPHA, for the least detectable shift of that distance: mass tv added to a set U of cells and
    taken from the rest D, each in proportion to its probability, with U (largest cells first) holding as near
    half the mass as the cells allow; its noncentrality n tv^2 (1/P(U) + 1/P(D)) is the smallest of any shift of
    distance tv (4 n tv^2 when P(U) = 1/2)."""
    e = cells.numpy()
    up = np.zeros(len(e), dtype=bool)
    for i in np.argsort(-e):  # the largest cells go up until half the mass is up
        if e[up].sum() < 0.5:
            up[i] = True
    alt = np.where(up, e + tv * e / e[up].sum(), e - tv * e / e[~up].sum())
    counts = np.random.default_rng(0).multinomial(n, alt, size=runs)  # (runs, C)
    stat = ((counts - n * e) ** 2 / (n * e)).sum(axis=1)
    df = len(e) - 1
    p = torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), torch.tensor(stat / 2))
    return float((p < ALPHA).double().mean())


def _counts(outputs: list[list[int]], vocab: int) -> torch.Tensor:
    c = torch.zeros(vocab ** 3, dtype=torch.float64)
    for o in outputs:
        c[(o[0] * vocab + o[1]) * vocab + o[2]] += 1
    return c


def _speculative_counts(target: TargetModel, seed: int) -> tuple[torch.Tensor, list[float]]:
    """The first three tokens' counts over N_STAT speculative decodings of PROMPT, and the per-slot acceptance."""
    drafter = decode_drafter(target, B, seed=3)  # untrained: most of its first slots are rejected
    res = acceptance_length(target, drafter, [PROMPT] * N_STAT, 3, temperature=T_STAT, top_p=TOP_P_STAT,
                            generator=torch.Generator().manual_seed(seed))
    return _counts(res.outputs, target.vocab_size), res.per_position


@pytest.mark.slow
def test_speculative_sampling_follows_the_targets_distribution(small, law):
    """The first three tokens of N = 1500 seeded speculative decodings (blocks of 4, an untrained drafter whose
    first slot is rejected in about 78 % of the cycles; temperature 0.05 and top_p 0.8 so that the target's law is
    far from uniform and its nucleus drops ids: 46 sequences of the 4096 have a positive probability, each expected
    >= 7 times) against their exact probabilities under the target's own sampling (enumerated): chi-square goodness
    of fit over those 46 cells (none pooled), significance level ALPHA = 0.001, and no sequence of probability 0
    (outside a nucleus) may appear at all. Power, simulated for the least detectable shift of each size (`_power`,
    4000 samples): a shift of total variation 0.10 from the target's law is rejected with probability 90 %
    (0.11: 97 %, 0.08: 46 %; no shift: 0.2 %). Plain sampling (`greedy_decode` at the same temperature and top_p, the
    evaluation's baseline) passes the same test."""
    cells = _cells(law, N_STAT)
    assert len(cells) == int((law > 0).sum()) == 46  # nothing pooled
    assert _power(cells, N_STAT, 0.10) == pytest.approx(0.90, abs=0.01)
    assert _power(cells, N_STAT, 0.11) >= 0.95 and _power(cells, N_STAT, 0.08) < 0.5
    counts, per_slot = _speculative_counts(small, seed=1)
    assert 0.15 < per_slot[0] < 0.35 and per_slot[1] > 0.03  # many rejections: the residual is exercised
    stat, df, p = _chi_square(counts, law)
    assert p > ALPHA, (stat, df)
    plain = greedy_decode(small, [PROMPT] * N_STAT, 3, temperature=T_STAT, top_p=TOP_P_STAT,
                          generator=torch.Generator().manual_seed(2))
    assert _chi_square(_counts(plain.outputs, SMALL_VOCAB), law)[2] > ALPHA


@pytest.mark.slow
@pytest.mark.parametrize("wrong", list(WRONG_RULES))
def test_the_chi_square_rejects_a_wrong_rule(small, law, monkeypatch, wrong):
    """The same test, same N and seed, on a deliberately wrong rule: it rejects (p-value < ALPHA)."""
    monkeypatch.setattr(sampling, "block_rule", WRONG_RULES[wrong])
    counts, _ = _speculative_counts(small, seed=1)
    stat, df, p = _chi_square(counts, law)
    assert p < ALPHA, (stat, df)


def test_temperature_zero_is_greedy_and_a_tiny_one_too():
    """Temperature 0 is today's greedy decoding exactly (outputs, histogram, cycle log); 1e-4 gives the same
    outputs on prompts whose greedy continuations have no near-tie (top two logits >= 0.005 apart at every
    output token, so a runner-up's probability is < 255 exp(-50) at that temperature)."""
    target = decode_target(256)
    drafter = decode_drafter(target, B, seed=3)

    def gap(prompt: list[int]) -> float:
        out = target.greedy(prompt, 12)
        with torch.no_grad():
            top2 = target.step(torch.tensor(prompt + out)).logits[len(prompt) - 1:-1].topk(2).values  # (12, 2)
        return float((top2[:, 0] - top2[:, 1]).min())

    prompts = [p for p in random_prompts(12, seed=2) if gap(p) >= 0.005][:3]
    assert len(prompts) == 3
    greedy = acceptance_length(target, drafter, prompts, 12)
    zero = acceptance_length(target, drafter, prompts, 12, temperature=0.0, top_p=0.5)
    assert zero.outputs == greedy.outputs == [target.greedy(p, 12) for p in prompts]
    assert zero.histogram == greedy.histogram and zero.cycle_log == greedy.cycle_log
    tiny = acceptance_length(target, drafter, prompts, 12, temperature=1e-4, generator=torch.Generator().manual_seed(0))
    assert tiny.outputs == greedy.outputs and tiny.temperature == 1e-4
    plain = greedy_decode(target, prompts, 12, temperature=1e-4, generator=torch.Generator().manual_seed(0))
    assert plain.outputs == greedy.outputs


def test_tokens_outside_the_nucleus_and_masked_stop_ids_never_appear(small):
    """top_p 0.5 at temperature 1 (the nucleus: a few of the 16 ids): every generated token is in the target's
    nucleus at its position; the stop id (frequent otherwise) is absent from the first min_new_tokens tokens
    and ends the answer after them. Same seed, same tokens."""
    drafter = decode_drafter(small, B, seed=3)
    prompts = random_prompts(24, seed=4, vocab=SMALL_VOCAB)
    stop, min_new = 5, 4
    kw = dict(stop_ids=[stop], min_new_tokens=min_new, temperature=1.0, top_p=0.5)
    res = acceptance_length(small, drafter, prompts, 8, generator=torch.Generator().manual_seed(0), **kw)
    again = acceptance_length(small, drafter, prompts, 8, generator=torch.Generator().manual_seed(0), **kw)
    assert res.outputs == again.outputs and res.histogram == again.histogram
    sizes, stops_after = Counter(), 0
    for p, out in zip(prompts, res.outputs):
        assert stop not in out[:min_new]
        stops_after += out[-1] == stop
        with torch.no_grad():
            logits = small.step(torch.tensor(p + out)).logits[len(p) - 1:len(p) - 1 + len(out)]  # (len(out), V)
        logits[:min_new, stop] = float("-inf")
        allowed = sampling_probs(logits, 1.0, 0.5) > 0
        sizes.update(allowed.sum(dim=-1).tolist())
        assert all(allowed[i, tok] for i, tok in enumerate(out)), (p, out)
    assert max(sizes) <= 12 and min(sizes) >= 2  # the nucleus drops ids, and there is a choice to make
    assert stops_after >= 2  # the stop id is reachable once allowed
    with pytest.raises(ValueError, match="temperature must be >= 0"):
        acceptance_length(small, drafter, prompts[:1], 4, temperature=-1.0)
    with pytest.raises(ValueError, match="top_p"):
        greedy_decode(small, prompts[:1], 4, temperature=1.0, top_p=1.5)


class _Recording:
    """The drafter, keeping the logits (B-1, V) at the draft slots of every block it drafts."""

    def __init__(self, drafter):
        self._d, self.cfg, self.logits = drafter, drafter.cfg, []

    def __getattr__(self, name):
        return getattr(self._d, name)

    def draft_logits_cached(self, cache, block_ids):
        out = self._d.draft_logits_cached(cache, block_ids)  # (B, V): the anchor's row first
        self.logits.append(out[1:].detach().clone())
        return out


def test_the_proposal_is_the_drafters_own_nucleus_at_top_p(small, monkeypatch):
    """At temperature 1 and top_p 0.5 the drafter proposes from ITS nucleus, as the target samples from its own:
    every q the rule divides by equals softmax(drafter logits / T) cut to top_p and renormalised (computed here
    by brute force: a token is kept when the mass strictly more probable than it is < top_p), and every drafted
    token lies inside it. A q left uncut keeps the output law exact (so the chi-square cannot see it) but changes
    the acceptance and so tau."""
    import dflash_lib.evaluate.acceptance as acceptance

    T, top_p = 1.0, 0.5
    drafter = _Recording(decode_drafter(small, B, seed=3))
    seen = []

    def spy(p, q, draft, generator):
        seen.append((q.clone(), draft.clone()))
        return speculative_step(p, q, draft, generator)

    monkeypatch.setattr(acceptance, "speculative_step", spy)
    res = acceptance_length(small, drafter, random_prompts(6, seed=4, vocab=SMALL_VOCAB), 8, temperature=T,
                            top_p=top_p, generator=torch.Generator().manual_seed(0))
    assert len(seen) == len(drafter.logits) == res.cycles >= 12
    cut = 0
    for (q, draft), logits in zip(seen, drafter.logits):
        probs = torch.softmax(logits.double() / T, dim=-1)  # (B-1, V)
        above = (probs[:, None, :] * (probs[:, None, :] > probs[:, :, None])).sum(dim=-1)  # mass above each id
        want = probs * (above < top_p)
        want = want / want.sum(dim=-1, keepdim=True)
        torch.testing.assert_close(q.double(), want, atol=1e-6, rtol=0)
        assert bool((want[torch.arange(B - 1), draft] > 0).all())  # drafted inside the drafter's nucleus
        cut += int((want == 0).any(dim=-1).sum())
    assert cut >= len(seen)  # the nucleus drops ids in most slots: an uncut q would differ


class _Uncached:
    """A DFlash drafter seen without its context cache: `acceptance_length` then hands it the growing features
    (`draft`, `draft_logits`), the path a drafter without `context_cache` takes."""

    def __init__(self, drafter):
        self.cfg, self._d = drafter.cfg, drafter

    def draft(self, features, anchor_pos, anchor_token):
        return self._d.draft(features, anchor_pos, anchor_token)

    def draft_logits(self, features, anchor_pos, block_ids):
        return self._d.draft_logits(features, anchor_pos, block_ids)


def test_cached_and_uncached_drafting_sample_the_same_tokens():
    """Same seed, same draws: the drafter over its context cache and over the growing features give the same
    outputs and cycles at temperature 1, top_p 0.9 (their logits agree to float rounding)."""
    target = decode_target(256)
    drafter = decode_drafter(target, B, seed=3)
    prompts = random_prompts(3, seed=6)
    kw = dict(temperature=1.0, top_p=0.9)
    cached = acceptance_length(target, drafter, prompts, 10, generator=torch.Generator().manual_seed(5), **kw)
    plain = acceptance_length(target, _Uncached(drafter), prompts, 10, generator=torch.Generator().manual_seed(5), **kw)
    assert cached.outputs == plain.outputs and cached.cycle_log == plain.cycle_log
    assert [len(o) for o in cached.outputs] == [10, 10, 10] and cached.cycles >= 3


# -- the evaluate command ------------------------------------------------------------------------------------------

def test_evaluate_command_samples_and_reports_tau_at_a_temperature(tmp_path, capsys):
    """`evaluate -p temperature 0.7 -p top_p 0.9`: both decodings sample, the report records the temperature,
    top_p and seed, leaves outputs_equal_baseline null and says so; the same seed repeats the same tau."""
    from dflash_lib.__main__ import main
    from dflash_lib.config import from_params
    from dflash_lib.evaluate import DecodeReport
    from dflash_lib.models import DFlashDrafter, DrafterConfig
    from dflash_lib.models.export import export_drafter

    config = from_params({"hidden_size": 32, "target_layers": 4, "num_features": 1, "block_size": 4, "limit": 300,
                          "max_len": 512})  # test_evaluate's tiny run (its token store is cached)
    tgt = TargetModel.from_model_config(config.model, seed=config.train.seed)
    torch.manual_seed(0)
    export_drafter(DFlashDrafter(DrafterConfig.from_model_config(config.model, tgt), tgt), tmp_path / "drafter",
                   torch.float32)
    (tmp_path / "config.json").write_text(json.dumps({"config": config.to_dict()}))
    args = ["evaluate", "--drafter", str(tmp_path), "--target", "tiny", "-p", "prompts", "2", "-p", "max_new_tokens",
            "8", "-p", "timing_warmup", "false", "-p", "temperature", "0.7", "-p", "top_p", "0.9"]
    reports = []
    for _ in range(2):
        assert main(args) == 0
        out, err = capsys.readouterr()
        reports.append(json.loads(out.strip().splitlines()[-1]))
    report = reports[0]
    assert set(report) == {f.name for f in fields(DecodeReport)} - {"served"}  # served: -p engine vllm only
    assert DecodeReport.from_json(report).to_json() == report
    assert (report["temperature"], report["top_p"], report["sample_seed"]) == (0.7, 0.9, 0)
    assert report["outputs_equal_baseline"] is None and 1.0 <= report["tau"] <= 4 and report["cycles"] >= 2
    assert "sampling: outputs are not compared token for token" in err
    assert "plain sampling (temperature 0.7, top_p 0.9)" in err
    assert reports[1]["tau"] == report["tau"] and reports[1]["histogram"] == report["histogram"]
