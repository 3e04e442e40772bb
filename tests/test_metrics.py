"""Metrics: the log line, the jsonl and wandb sinks, the steady-state detector, throughput, data wait and ETA."""

from __future__ import annotations

import json
import math
import random
import sys
from dataclasses import dataclass

import pytest

from dflash_lib.rundir import omitted
from dflash_lib.rundir.records import HELDOUT_KEYS, HeldoutFigures, WithHeldoutFigures
from dflash_lib.train.metrics import (JsonlSink, NullSink, SteadyStateDetector, ThroughputMeter, WandbSink,
                                      _wandb_scalars, eta_seconds, format_duration, format_log_line)

SEED_LIKE = dict(step=58, loss=1.4213, acc=0.6071, lr=1.2e-05, noise=1.0, ktok_s=25.13, data_wait_pct=0.42,
                 bucket=3, eta_s=5.1 * 86400, steady=True, q_pre=[50, 50], q_hs=[0])


class ManualClock:
    """A synthetic clock: returns `now`, which the test advances."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.mark.parametrize("seconds,text", [(42, "42s"), (750, "12.5m"), (5.1 * 3600, "5.1h"), (5.1 * 86400, "5.1d"),
                                          (None, "--"), (math.inf, "--"), (math.nan, "--")])
def test_format_duration(seconds, text):
    assert format_duration(seconds) == text


def test_log_line_matches_the_seed_format():
    assert format_log_line(SEED_LIKE) == ("step 58 | loss 1.42 | acc 0.61 | lr 1.2e-05 | noise 1.00 | 25.1 Ktok/s | "
                                          "wait 0.4% | bucket 3 | ETA 5.1d | q_pre=[50,50] q_hs=[0]")


def test_log_line_says_how_full_the_budgets_are_and_which_bound():
    base = format_log_line(SEED_LIKE)
    both = {**SEED_LIKE, "token_fill": 0.694, "query_fill": 1.0, "bound_tokens": 0.0, "bound_blocks": 1.0}
    assert format_log_line(both) == base + " | fill tok 0.69 blk 1.00 | bound tok 0.00 blk 1.00"
    assert format_log_line({**SEED_LIKE, "token_fill": 0.5, "bound_tokens": 0.25}) == \
        base + " | fill tok 0.50 | bound tok 0.25"  # no block budget
    assert format_log_line({**SEED_LIKE, "token_fill": 0.5, "query_fill": 0.75}) == \
        base + " | fill tok 0.50 blk 0.75"  # a sampler whose plan does not record what closed its batches


def test_log_line_marks_provisional_and_missing_eta():
    assert "| ETA ~5.1d |" in format_log_line({**SEED_LIKE, "steady": False})
    assert "| ETA -- |" in format_log_line({**SEED_LIKE, "steady": False, "eta_s": None})
    with pytest.raises(KeyError, match="q_hs"):
        format_log_line({k: v for k, v in SEED_LIKE.items() if k != "q_hs"})


def test_jsonl_sink_flushes_every_line_and_nulls_nan(tmp_path):
    path = tmp_path / "sub" / "metrics.jsonl"
    sink = JsonlSink(path)
    sink.log({"loss": 1.5, "q_pre": [2, 1]}, step=1)
    assert json.loads(path.read_text().splitlines()[0]) == {"step": 1, "loss": 1.5, "q_pre": [2, 1]}  # before close
    sink.log({"loss": float("nan"), "acc_per_pos": [0.5, float("inf")]}, step=2)
    sink.close()
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert rows[1] == {"step": 2, "loss": None, "acc_per_pos": [0.5, None]}


def test_wandb_disabled_never_imports_wandb(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "wandb", None)  # any `import wandb` would now raise ImportError
    sink = WandbSink("disabled", "p", tmp_path)
    sink.log({"loss": 1.0}, step=1)
    sink.close()
    assert not sink.active
    monkeypatch.setenv("WANDB_MODE", "disabled")  # the environment switch wins over mode="offline"
    assert not WandbSink("offline", "p", tmp_path).active
    with pytest.raises(ValueError, match="mode"):
        WandbSink("sometimes", "p", tmp_path)
    NullSink().log({"x": 1}, 1)


def test_wandb_scalars_flatten_lists_and_drop_text():
    out = _wandb_scalars({"loss": 1.0, "q_pre": [3, 4], "steady": True, "eta_s": None, "note": "x"})
    assert out == {"loss": 1.0, "q_pre/0": 3, "q_pre/1": 4, "steady": 1.0}


@dataclass
class FlatRow(WithHeldoutFigures):
    step: int
    heldout: HeldoutFigures | None = omitted()
    bucket: int = 0


def test_held_out_figures_are_written_flat_in_their_place_and_read_back():
    figures = HeldoutFigures(loss=2.5, acc=0.4, acc_per_pos=[0.5, 0.25], tau=1.5, eal=1.625, blocks=4, samples=2, s=0.1)
    doc = FlatRow(step=3, heldout=figures, bucket=1).to_json()
    assert list(doc) == ["step", *HELDOUT_KEYS, "bucket"] == FlatRow.json_keys()
    assert (doc["heldout_eal"], doc["heldout_acc_per_pos"], doc["heldout_s"]) == (1.625, [0.5, 0.25], 0.1)
    assert FlatRow.from_json(doc) == FlatRow(3, figures, 1)
    assert FlatRow(step=3).to_json() == {"step": 3, "bucket": 0} and FlatRow.from_json({"step": 3}).heldout is None
    with pytest.raises(ValueError, match=r"FlatRow.heldout: .*missing keys \['tau'\]"):
        FlatRow.from_json({k: v for k, v in doc.items() if k != "heldout_tau"})


def test_files_of_the_trainer_before_the_eal_rename_read_back_under_todays_names():
    """A row (summary.json, a checkpoint's last row) an older trainer wrote: heldout_eal_marginal is heldout_eal,
    eal_marginal (a copy of eal) is dropped; any other unknown key is still refused."""
    figures = HeldoutFigures(loss=2.5, acc=0.4, acc_per_pos=[0.5, 0.25], tau=1.5, eal=1.625, blocks=4, samples=2, s=0.1)
    old = {("heldout_eal_marginal" if k == "heldout_eal" else k): v
           for k, v in FlatRow(step=3, heldout=figures, bucket=1).to_json().items()}
    assert "heldout_eal" not in old
    assert FlatRow.from_json({**old, "eal_marginal": 1.625}) == FlatRow(3, figures, 1)
    with pytest.raises(ValueError, match=r"unknown keys \['eal_typo'\]"):
        FlatRow.from_json({**old, "eal_typo": 1.0})


def ramp_then_noise(seed: int, ramp: int = 30, n: int = 200, noise: float = 0.05) -> list[float]:
    r = random.Random(seed)
    return [(0.2 + 0.8 * s / ramp if s < ramp else 1.0) * (1 + r.gauss(0, noise)) for s in range(n)]


@pytest.mark.parametrize("seed", range(5))
def test_detector_finds_the_end_of_a_warmup_ramp(seed):
    det = SteadyStateDetector(window=20, max_drift=0.1, max_cv=0.25)
    fired = next(s for s, v in enumerate(ramp_then_noise(seed)) if det.update(s, v))
    assert 30 <= fired <= 55  # not during the ramp, and soon after it
    assert 20 <= det.start_step <= 35  # the steady window starts near the ramp's end (30)
    for s, v in enumerate(ramp_then_noise(seed)[fired + 1:], start=fired + 1):
        det.update(s, v)
    assert det.mean == pytest.approx(1.0, abs=0.02)


def test_detector_rejects_ramps_and_scatter():
    ramp = SteadyStateDetector(window=20)
    assert not any(ramp.update(s, 1.01**s) for s in range(300))  # 1 % per step, without end
    assert ramp.mean is None and ramp.start_step is None
    r = random.Random(0)
    scatter = SteadyStateDetector(window=20, max_cv=0.25)
    assert not any(scatter.update(s, max(0.01, 1 + r.gauss(0, 0.6))) for s in range(100))
    flat = SteadyStateDetector(window=5)
    assert [flat.update(s, 3.0) for s in range(6)] == [False] * 4 + [True, True]
    assert flat.start_step == 0 and flat.mean == 3.0
    with pytest.raises(ValueError, match="window"):
        SteadyStateDetector(window=2)


def test_eta_seconds():
    assert eta_seconds(1e6, 1000.0) == 1000.0
    assert eta_seconds(-5, 1000.0) == 0.0
    assert eta_seconds(1e6, 0.0) is None


def test_meter_on_a_synthetic_clock():
    """5 warm-up steps of 10 s, then 1 s steps; 1000 real tokens each, 0.01 s data wait in steady steps.

    Rolling throughput over 10 steps is flat from step 14 (its window 5..14 holds no warm-up step); the
    detector needs 10 flat values, so it fires at step 23 with the steady window starting at step 14.
    """
    clock = ManualClock()
    meter = ThroughputMeter(clock=clock, window=10, detector=SteadyStateDetector(window=10))
    with pytest.raises(RuntimeError, match="start"):
        meter.step(0, 1, 1, 0.0)
    meter.start()
    rates = []
    for step in range(40):
        warm = step < 5
        clock.now += 10.0 if warm else 1.0
        rates.append(meter.step(step, real_tokens=1000, padded_tokens=1250, wait_s=0.0 if warm else 0.01))
    assert [r.steady for r in rates].index(True) == 23
    assert rates[-1].steady_start_step == 14
    assert rates[-1].steady_tok_s == pytest.approx(1000.0)
    assert meter.steady_time_s == pytest.approx(26.0)  # steps 14..39
    assert rates[-1].ktok_s == pytest.approx(1.0)
    assert rates[4].ktok_s == pytest.approx(0.1)  # rolling throughput while warming up
    assert rates[4].steady_tok_s is None and rates[4].eta_tok_s == pytest.approx(100.0)  # provisional
    assert eta_seconds(3_600_000, rates[-1].eta_tok_s) == pytest.approx(3600.0)
    assert meter.steady_data_wait_pct == pytest.approx(1.0)  # 0.01 s of every 1 s step
    assert rates[-1].data_wait_pct == pytest.approx(100 * 35 * 0.01 / (50 + 35))  # cumulative
    assert rates[-1].data_wait_pct_window == pytest.approx(1.0)
    assert (meter.real_tokens, meter.padded_tokens, meter.steps) == (40_000, 50_000, 40)


def test_meter_finds_steady_state_despite_per_step_swings():
    """Alternating batch shapes (2 s and 0.5 s per 1000-token step: per-step throughput swings 4x) after a
    warm-up: the rolling throughput is flat, so steady state is found and its rate is tokens / time."""
    clock = ManualClock()
    meter = ThroughputMeter(clock=clock, window=10)
    meter.start()
    r = random.Random(0)
    for step in range(80):
        clock.now += 8.0 if step < 3 else r.choice((2.0, 0.5))
        rate = meter.step(step, 1000, 1000, 0.0)
    assert rate.steady and 3 <= rate.steady_start_step <= 25
    swing = SteadyStateDetector(window=10)  # the same detector on the raw per-step series never settles
    r = random.Random(0)
    assert not any(swing.update(s, 1000 / (8.0 if s < 3 else r.choice((2.0, 0.5)))) for s in range(80))
    assert 500 < rate.steady_tok_s < 2000
    assert rate.steady_tok_s == pytest.approx(1000 * (80 - rate.steady_start_step) / meter.steady_time_s)
