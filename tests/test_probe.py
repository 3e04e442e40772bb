"""Probe bookkeeping: observations from trainer metrics, the side-by-side table, the JSON the demo reads."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from dflash_lib.config import ConfigError, from_params
from dflash_lib.lab.probe import (StrategyProbe, budget_figures, cost_model_json, demo_summary, observations,
                                  probe_table)
from dflash_lib.plan.costmodel import held_out_noise, select_cost_model, throughput_rel_sd


def _metrics(n: int, rows: int, row_len: int, fill: float, blocks: int, seconds, seed: int = 0) -> pd.DataFrame:
    """Trainer-like metrics rows: `rows` x `row_len` slots filled to `fill`, `seconds` per step (callable)."""
    rng = np.random.default_rng(seed)
    out = []
    for step in range(1, n + 1):
        R = max(1, rows + int(rng.integers(-1, 2)))
        T = max(8, row_len + int(rng.integers(-row_len // 4, row_len // 4 + 1)))
        real = int(R * T * fill)
        varlen = float(R * (T * fill) ** 2)
        out.append(dict(step=step, rows=R, row_len=T, real_tokens=real, padded_tokens=R * T, blocks=blocks * R,
                        attn_varlen=varlen, attn_dense=float(R * T * T),
                        step_s=seconds(R * T, real, varlen, blocks * R)))
    return pd.DataFrame(out)


def test_observations_skip_warm_up_and_steps_that_ran_no_batch():
    m = _metrics(10, 4, 512, 0.9, 8, lambda *_: 0.2)
    m.loc[6, ["rows", "row_len", "attn_varlen", "attn_dense"]] = np.nan  # every sample failed validation
    m.loc[6, ["real_tokens", "padded_tokens", "blocks"]] = 0
    obs = observations(m, start_step=3)
    assert [o.seconds for o in obs] == [0.2] * 7  # steps 3..10 less step 7
    assert obs[0].attention == m.loc[2, "attn_varlen"] and obs[0].blocks == m.loc[2, "blocks"]
    assert observations(m, 3, attention="attn_dense")[0].attention == m.loc[2, "attn_dense"]
    with pytest.raises(ConfigError, match="attn_dense' or 'attn_varlen"):
        observations(m, 3, attention="flops")
    with pytest.raises(ConfigError, match=r"metrics lack \['blocks'\]"):
        observations(m.drop(columns="blocks"), 3)
    # padding is priced only for a run of padded kernels (static shapes)
    assert obs[0].computed_slots == m.loc[2, "real_tokens"]
    assert observations(m, 3, padded_kernel=True)[0].computed_slots == m.loc[2, "padded_tokens"]


def test_budget_figures_average_the_steps_that_have_them():
    m = pd.DataFrame(dict(step=[1, 2, 3, 4], token_fill=[0.5, 0.7, 0.9, np.nan], query_fill=[1.0, 1.0, 0.5, np.nan],
                          bound_tokens=[0.0, 0.0, 1.0, np.nan], bound_blocks=[1.0, 1.0, 0.0, np.nan]))
    assert budget_figures(m) == pytest.approx(dict(token_fill=0.7, query_fill=2.5 / 3, bound_tokens=1 / 3,
                                                   bound_blocks=2 / 3))
    assert budget_figures(m[["step", "token_fill"]]) == {"token_fill": pytest.approx(0.7)}  # no block budget
    assert budget_figures(m[["step"]]) == {}  # an older trainer's metrics


def _probe(name: str, m: pd.DataFrame, predicted: float) -> StrategyProbe:
    obs = observations(m, 1, run=name)
    real, sec = sum(o.real_tokens for o in obs), sum(o.seconds for o in obs)
    realized = float(m["real_tokens"].sum() / m["padded_tokens"].sum())
    return StrategyProbe(name, Path(name), {}, obs, True, real / sec / 1000, predicted, realized, 100,
                         2e9 / (real / sec) / 86400, 0.01, 0.0)


def test_probe_table_puts_measurement_prediction_and_noise_side_by_side():
    # padding-free kernels: a step pays its documents (real tokens, per-document attention) and blocks
    cost = lambda pad, real, attn, blocks: 0.02 + 2e-6 * real + 1e-9 * attn + 1e-3 * blocks  # noqa: E731
    ms = {"sorted": _metrics(40, 8, 512, 0.99, 8, cost, 1), "random": _metrics(40, 4, 1024, 0.6, 8, cost, 2),
          "bucketed": _metrics(40, 6, 700, 0.9, 8, cost, 3), "packed": _metrics(40, 1, 4096, 0.98, 40, cost, 4)}
    predicted = {"sorted": 0.99, "random": 0.62, "bucketed": 0.92, "packed": 0.98}
    probes = [_probe(k, m, predicted[k]) for k, m in ms.items()]
    probes[3].fills.update(token_fill=0.69, query_fill=1.0, bound_tokens=0.0, bound_blocks=1.0)
    choice = select_cost_model({p.strategy: p.observations for p in probes})
    table = probe_table(probes, choice, noise_draws=50)
    assert list(table.index) == ["sorted", "random", "bucketed", "packed"]
    assert table.loc["sorted", "ratio_to_sorted"] == 1.0
    assert table.loc["random", "ratio_to_sorted"] == pytest.approx(probes[1].ktok_s / probes[0].ktok_s)
    # no timing noise, but the batch mix varies: the bootstrap spread is that sampling noise of the rate
    assert table.loc["packed", "ktok_s_noise_pct"] == pytest.approx(200 * throughput_rel_sd(probes[3].observations))
    assert (table["ktok_s_noise_pct"] > 0).all() and (table["ktok_s_noise_pct"] < 10).all()
    assert (table["cost_model_error_pct"].abs() < 1e-6).all() and (table["nested_error_pct"].abs() < 1e-6).all()
    noise = held_out_noise({p.strategy: p.observations for p in probes}, choice.nested, 50)
    assert table["nested_noise_pct"].to_dict() == pytest.approx({k: 200 * v for k, v in noise.items()})
    assert (table["nested_noise_pct"] < 1e-6).all()  # noise-free step times: resampled steps are fitted exactly
    assert table.loc["packed", "token_fill"] == 0.69 and table.loc["packed", "bound_blocks"] == 1.0
    assert np.isnan(table.loc["sorted", "token_fill"])  # a probe without the figures
    gap = table.loc["random", "efficiency_gap_pts"]
    assert gap == pytest.approx(100 * (0.62 - probes[1].realized_efficiency))
    # the reference run's padding-only estimate misses random, the fitted model does not
    assert abs(table.loc["random", "padding_only_error_pct"]) > 5
    assert table.loc["packed", "full_run_eta_days"] == probes[3].full_run_eta_days  # the full run's, named so
    summary = demo_summary(table)
    assert set(summary["packed"]) >= {"ktok_s", "ratio_to_sorted", "predicted_efficiency", "realized_efficiency",
                                      "co_batch_recurrence", "cost_model_error_pct", "nested_error_pct",
                                      "nested_noise_pct", "full_run_eta_days", "token_fill", "bound_blocks"}
    assert "token_fill" not in summary["sorted"]  # left out where the table has none
    js = json.loads(json.dumps(cost_model_json(choice)))
    assert js["model"]["terms"][0] == "a" and js["max_abs_error"] < 1e-6 and js["nested_max_abs_error"] < 1e-6
    assert math.isclose(js["q"], choice.model.b / choice.model.c, rel_tol=1e-9)
    assert list(js["candidates"].values()) == sorted(js["candidates"].values())
    with pytest.raises(ConfigError, match="'sorted' strategy as the reference"):
        probe_table(probes[1:])


@pytest.mark.slow
def test_probes_in_rounds_take_turns_resume_and_leave_out_each_resume_warm_up(tmp_path, monkeypatch):
    import dflash_lib.lab.probe as probe_mod
    import dflash_lib.train.loop as train_mod
    from dflash_lib.config import preset
    from dflash_lib.lab.probe import RESUME_WARMUP, run_probes
    from dflash_lib.rundir.reader import load_metrics

    calls = []
    real_train = train_mod.train

    def spy(cfg, run_dir, *a, **kw):
        calls.append((Path(run_dir).name, cfg.train.stop_at_step))
        return real_train(cfg, run_dir, *a, **kw)

    monkeypatch.setattr(probe_mod, "train", spy)  # probe binds `train` at import
    probes = run_probes(preset("smoke"), tmp_path, steps=8, strategies=("sorted", "packed"), rounds=2)
    assert calls == [("sorted", 4), ("packed", 4), ("sorted", 0), ("packed", 0)]  # turns, chunk by chunk
    for p in probes:
        m = load_metrics(tmp_path / p.strategy)
        assert m["step"].tolist() == list(range(1, 9))  # one run, resumed: every step once
        measured = {o.seconds for o in p.observations}
        after_resume = set(m.loc[m["step"].between(5, 4 + RESUME_WARMUP), "step_s"])
        assert not measured & after_resume and len(p.observations) <= 8 - RESUME_WARMUP
        assert p.summary.complete and p.ktok_s > 0
    with pytest.raises(ConfigError, match=r"probe_rounds must be in \[1, probe_steps=8\], got 9"):
        run_probes(preset("smoke"), tmp_path / "x", steps=8, rounds=9)


def test_probes_run_no_periodic_checkpoint_or_held_out_evaluation():
    """A probe times training alone, target included: the demo preset checkpoints, evaluates periodically and
    caches the target's features; no probe does, nor evaluates at its end."""
    from dflash_lib.config import preset
    from dflash_lib.lab.probe import PROBES, strategy_config

    base = preset("demo")
    assert base.train.eval_every > 0 and base.train.ckpt_every > 0 and base.pipeline.target_cache_gib > 0
    for strategy in PROBES:
        cfg = strategy_config(base, strategy, steps=30, stop_at_step=10)
        assert (cfg.train.eval_every, cfg.train.ckpt_every, cfg.train.steps, cfg.train.stop_at_step) == (0, 0, 30, 10)
        assert cfg.pipeline.target_cache_gib == 0
        assert base.train.eval_samples > 0 and cfg.train.eval_samples == 0  # no evaluation at the end either


def test_static_probe_pads_to_bucket_edges_and_predicts_its_efficiency_exactly():
    from dflash_lib.config import preset
    from dflash_lib.lab.probe import predicted_efficiency, strategy_config
    from dflash_lib.train.build import build_sampler

    cfg = strategy_config(preset("smoke"), "static", steps=5)
    assert cfg.sampler.strategy == "bucketed" and cfg.sampler.static_shapes and cfg.train.stop_at_step == 0
    lengths = np.random.default_rng(0).integers(10, 500, 400)
    edges = [100, 250, 500]
    sampler = build_sampler(cfg, lengths, 0, 1, edges)
    idx, off = sampler.epoch_plan(0).csr()
    slots = sum(edges[int(np.searchsorted(edges, lengths[idx[a:b]].max()))] * (b - a)
                for a, b in zip(off[:-1], off[1:]))
    assert predicted_efficiency(cfg, sampler, lengths, edges) == pytest.approx(lengths[idx].sum() / slots)
    for static in (False, True):  # packed rows: their tokens rounded up to pack_multiple, or the whole budget
        packed = from_params({"static_shapes": static}, strategy_config(preset("smoke"), "packed", steps=5))
        sampler = build_sampler(packed, lengths, 0, 1, [])
        idx, off = sampler.epoch_plan(0).csr()
        row = np.add.reduceat(lengths[idx], off[:-1])  # (rows,) real tokens of each row
        budget = packed.sampler.token_budget
        slots = np.full(len(row), budget) if static else np.minimum(budget, -(-row // 64) * 64)
        assert predicted_efficiency(packed, sampler, lengths, []) == pytest.approx(row.sum() / slots.sum())
    with pytest.raises(ConfigError, match="not one of"):
        strategy_config(preset("smoke"), "megabatch", steps=5)


def test_budget_fill_bars_show_both_fills_and_which_budget_closed_the_batches():
    from dflash_lib.lab.report.probe import budget_fill_bars

    table = pd.DataFrame(dict(token_fill=[0.675, 0.677], query_fill=[0.995, 0.998], bound_tokens=[0.509, 0.008],
                              bound_blocks=[0.999, 0.985]), index=pd.Index(["sorted", "packed"], name="strategy"))
    fig = budget_fill_bars(table)
    assert [t.name for t in fig.data] == ["token budget", "block budget"]
    assert list(fig.data[0].y) == [0.675, 0.677] and list(fig.data[1].text) == ["closed 100%", "closed 98%"]
    assert list(fig.data[0].text) == ["closed 51%", "closed 1%"]
    assert [t.name for t in budget_fill_bars(table[["token_fill"]]).data] == ["token budget"]  # no block budget
