"""Tuning (`dryrun.search`): the chosen candidate fits its full dry run, faster ones were refused for memory,
pruning never skips a candidate that fits (brute force), the projection prices the dry run's counted FLOPs,
preset files round-trip into train's and notebook 04's config, exit codes and the nothing-fits message.
Device sizes come from measured peaks, so the constraints bind at any tiny shape."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import numpy as np
import pytest

from dflash_lib.__main__ import main
from dflash_lib.config import ConfigError, from_params, preset, read_preset_file
from dflash_lib.data import build_token_store_from_config
from dflash_lib.data.stats import store_drafter_queries
from dflash_lib.lab.runs import notebook_config, resolve_params
from dflash_lib.models.target_config import target_hf_config
from dflash_lib.rundir import REPO_ROOT, load_config
from dflash_lib import dryrun
from dflash_lib.dryrun import search
from dflash_lib.train.build import bucket_edges

BASE = ["-p", "k", "2", "-p", "drafter_layers", "2", "-p", "token_budget", "1024"]  # smoke, 2 buckets and layers
LADDER, FRACTIONS = (1.0, 2.0), (1.0, 0.5)  # a short ladder: 2 token budgets x 2 block budgets x 3 layer counts


def _config():
    return load_config(dict(zip(BASE[1::3], BASE[2::3])), "smoke")


def _base_need_gib(config) -> float:
    """The largest need of the base's worst batches (one memory step each): the device the test tunes for."""
    c = search.base_candidate(config)
    lengths, queries, key = _corpus(config)
    edges = bucket_edges(config, lengths, key, queries)
    models = dryrun.build_step_models(config, target_hf_config(config.model), dryrun.for_cuda(config), True)
    needs = []
    for w in dryrun.worst_batches(config, edges, c.block_budget):
        fig = dryrun.measure_step(models, dryrun.host_batch(w, models.drafter.cfg.vocab_size, config.model.mask_id),
                                  count_flops=False)
        needs.append(dryrun.Reserve().required_bytes(fig.peak_bytes, fig.kernel_allowance) / dryrun.GIB)
    return max(needs)


def _corpus(config):
    store = build_token_store_from_config(config.data, progress=False)
    lengths = np.asarray(store.lengths)
    return lengths, store_drafter_queries(store, config.model.num_anchors, config.model.block_size), store.meta["key"]


@pytest.fixture(scope="module")
def tuned(tmp_path_factory):
    """The tuning of the base config on a device exactly its own need (the base fits, anything needing more
    does not), through the command line with the short ladder."""
    config = _config()
    device = _base_need_gib(config)
    out = tmp_path_factory.mktemp("tune")
    real = search.tune
    search.tune = lambda *a, **kw: real(*a, ladder=LADDER, fractions=FRACTIONS, **kw)
    try:
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            code = main(["tune", "--preset", "smoke", *BASE, "--device-gib", repr(device), "--out", str(out)])
    finally:
        search.tune = real
    lines = buf.getvalue().splitlines()
    return config, device, out, code, lines, search.TuneReport.from_json(json.loads(lines[-1]))


@pytest.mark.slow  # the `tuned` fixture: a tuning through the command line (~25 s)
def test_the_chosen_candidate_fits_its_full_dry_run_and_a_faster_one_did_not(tuned):
    config, device, out, code, lines, report = tuned
    assert code == 0 and report.device_gib == device
    assert report.rows[0].decided == "defaults" and report.rows[0].fits and report.rows[0].speedup == 1.0
    chosen = report.chosen
    assert chosen.decided == "proven" and chosen.fits and chosen.need_gib <= device
    assert chosen == report.rows[-1] and chosen.speedup >= 1.0
    faster = [r for r in report.rows[1:-1] if r.speedup > chosen.speedup]
    assert faster and all(r.decided in ("measured", "pruned", "rejected") and not r.fits
                          or r.decided == "fits" and r.speedup * (1 - search.TIE) <= chosen.speedup + 1e-3
                          for r in faster)  # slower than a misfit, or as fast within the FLOP model's resolution
    # the walk went fastest first; among the fits as fast, the choice is the preferred one
    walked = [r.speedup for r in report.rows[1:] if r.decided in ("measured", "pruned")]
    assert walked == sorted(walked, reverse=True)
    pref = lambda r: search.preference(  # noqa: E731
        search.Candidate(r.token_budget, r.block_budget, r.checkpointed),
        search.Projection(1.0, r.step_s, r.ktok_s_gpu, r.ktok_s, r.tokens_per_step, 0), report.rows[0].tokens_per_step)
    assert all(pref(chosen) <= pref(r) for r in report.rows if r.decided == "fits")


@pytest.mark.slow
def test_the_chosen_candidate_proven_again_and_priced_at_its_counted_flops(tuned):
    config, device, out, code, lines, report = tuned
    chosen = report.chosen
    # proven again, independently: every bucket's worst batch and the packed row of the chosen settings fit
    c = search.Candidate(chosen.token_budget, chosen.block_budget, chosen.checkpointed)
    cfg = search.with_candidate(config, c)
    lengths, queries, key = _corpus(cfg)
    worst = dryrun.worst_batches(cfg, bucket_edges(cfg, lengths, key, queries), c.block_budget)
    results = dryrun.measure_batches(cfg, worst, dryrun.for_cuda(cfg), device)
    assert all(r.fits for r in results) and dryrun.for_cuda(cfg).checkpointing == c.checkpointed
    assert max(r.required_bytes for r in results) / dryrun.GIB == pytest.approx(chosen.need_gib, abs=0.01)
    # the projection prices these batches (other budgets and layer counts than the base's) at their counted FLOPs
    work = search.EpochWork(*(np.array([[f(w)] for w in worst], dtype=float) for f in (
        lambda w: sum(w.lengths), search._squares, search._slots, lambda w: w.drafter_queries, search._context)),
        edges=[])
    counted = np.array([[r.figures.flops_total] for r in results], dtype=float)
    np.testing.assert_allclose(report.flop_model.flops(work, c.checkpointed), counted, rtol=0.02)


@pytest.mark.slow  # the `tuned` fixture: a tuning through the command line (~25 s)
def test_the_report_line_files_and_the_table(tuned):
    config, device, out, code, lines, report = tuned
    assert search.TuneReport.from_json(out / "tune.json").to_json() == report.to_json()
    assert report.params == dict(token_budget=report.chosen.token_budget, block_budget=report.chosen.block_budget,
                                 drafter_checkpointing=str(report.chosen.checkpointed),
                                 accum_tokens=report.chosen.accum_tokens)
    assert lines[-2] == str(out / "preset.json") and lines[-3] == str(out / "tune.json")
    dash_p = next(line for line in lines if line.startswith("  -p token_budget"))
    assert dash_p.split() == [x for k, v in report.params.items() for x in ("-p", k, str(v))]
    assert 0 < report.recompute_share < 1 and report.worst_kind in {"packed", "bucket 0", "bucket 1"}
    assert len([line for line in lines if line.rstrip().endswith(("defaults", "measured", "pruned", "proven",
                                                                  "rejected", "fits"))]) == len(report.rows)


@pytest.mark.slow  # the `tuned` fixture: a tuning through the command line (~25 s)
def test_the_preset_file_gives_train_and_notebook_04_the_tuned_config(tuned):
    config, device, out, code, lines, report = tuned
    path = out / "preset.json"
    want = from_params({"k": 2, "drafter_layers": 2, "token_budget": 1024, **report.params}, preset("smoke"))
    base = {"k": 2, "drafter_layers": 2, "token_budget": 1024}
    assert read_preset_file(path) == ("smoke", {**base, **report.params})  # the chosen over the base
    assert load_config({}, str(path)) == want  # what `train --preset FILE` and `dryrun --preset FILE` build
    nb = REPO_ROOT / "notebooks" / "04_train.ipynb"
    injected = resolve_params(nb, {}, preset_name=str(path))
    assert injected["preset"] == str(path.resolve())
    assert notebook_config({**injected}, say=lambda line: None) == want
    for key in ("token_budget", "block_budget", "drafter_checkpointing", "accum_tokens"):
        if key in injected:  # a name notebook 04's parameters cell declares carries the tuned value
            assert injected[key] == report.params[key]


@pytest.mark.slow  # the `tuned` fixture: a tuning through the command line (~25 s)
def test_accum_tokens_keeps_the_optimizer_step_of_smaller_micro_batches(tuned):
    config, device, out, code, lines, report = tuned
    assert all(r.accum_tokens == 0 for r in report.rows)  # the ladder has no smaller token budget than the base's
    assert "optimizer step holds" in report.step_change


def test_step_accum_and_optimizer_steps_arithmetic():
    """A candidate with smaller micro-batches than the base accumulates to the base's tokens per optimizer step
    (a larger one does not; an accum_tokens the user set is kept); an optimizer step spans whole sampler steps
    until it holds accum_tokens x world_size real tokens, a rest counting as one."""
    config = _config()  # token_budget 1024
    small, large = search.Candidate(512, 64, 0), search.Candidate(2048, 64, 0)
    assert search.step_accum(config, small, 1806.4) == 1806 and search.step_accum(config, large, 1806.4) == 0
    kept = from_params({"accum_tokens": 5000}, config)
    assert search.step_accum(kept, small, 1806.4) == search.step_accum(kept, large, 1806.4) == 5000
    five = np.array([5, 5, 5, 5, 5])
    assert search.optimizer_steps(five, 0, 1) == 5
    assert search.optimizer_steps(five, 9, 1) == 3  # 10, 10 and the rest
    assert search.optimizer_steps(five, 10, 1) == 3  # 10 reaches 10: 10, 10, then the rest 5
    assert search.optimizer_steps(five, 11, 1) == 2  # 15, then the rest 10
    assert search.optimizer_steps(five, 5, 2) == 3  # 5 tokens x 2 ranks a step
    assert search.optimizer_steps(np.array([3, 9, 1, 1, 8]), 10, 1) == 2  # 12, then 10
    assert search.optimizer_steps(five, 100, 1) == 1  # never reached: one step of the whole epoch


def test_candidates_span_the_ladder_and_needs_at_least_orders_memory():
    cfg = from_params(dict(token_budget=1000, max_len=300, num_anchors=8, block_size=4, drafter_layers=2))
    cands = search.candidates(cfg, ladder=(0.25, 1.0, 2.0), fractions=(1.0, 0.5, 0.01))
    tokens = sorted({c.token_budget for c in cands})
    assert tokens == [300, 1000, 1024, 1984]  # 250 < max_len; 1000, 2000 round to 1024, 1984; the base's own 1000
    assert search.base_candidate(cfg) in cands  # 1000 tokens, derived block budget, all layers (CUDA's auto)
    assert {c.checkpointed for c in cands} == {0, 1, 2}
    one_doc = 8 * 4
    assert all(c.block_budget >= one_doc for c in cands)  # 0.01 of any derived budget is less: left out
    a, b = search.Candidate(2048, 64, 0), search.Candidate(1024, 64, 1)
    assert a.needs_at_least(b) and not b.needs_at_least(a) and a.needs_at_least(a)
    assert not search.Candidate(2048, 32, 0).needs_at_least(b)


def test_as_fast_candidates_prefer_the_optimizer_step_kept_then_the_larger_micro_batch():
    base_step = 8000.0
    small, big, bigger = (search.Candidate(t, 2 * t, 0) for t in (4096, 8192, 16384))
    P = lambda step_tokens: search.Projection(1.0, 1.0, 7.0, 7.0, step_tokens, 0)  # noqa: E731
    order = sorted([(bigger, P(16000.0)), (small, P(8000.0)), (big, P(9600.0))],
                   key=lambda cp: search.preference(*cp, base_step))
    # 9,600 tokens is within STEP_TIE of 8,000: kept, so the larger micro-batch first; 16,000 changes the step
    assert [c for c, _ in order] == [big, small, bigger]
    assert search.preference(small, P(8000.0), base_step) < search.preference(
        search.Candidate(4096, 8192, 1), P(8000.0), base_step)  # then fewer checkpointed layers


def test_a_device_nothing_fits_names_the_smallest_candidates_need(capsys, monkeypatch):
    device = dryrun.Reserve().reserve_gib  # the reserve alone: no step fits in it
    real = search.tune
    monkeypatch.setattr(search, "tune", lambda *a, **kw: real(*a, ladder=(1.0,), fractions=(1.0,), **kw))
    one = ["-p", "k", "1", "-p", "drafter_layers", "1", "-p", "token_budget", "1024"]  # 1 bucket, 1 layer: quick
    code = main(["plan", "--preset", "smoke", *one, "--device-gib", repr(device), "--out", "unused"])
    err = capsys.readouterr().err
    assert code == 1 and f"nothing fits {device:g} GiB: the smallest candidate (token_budget 1024" in err
    need = float(err.split("checkpointed) needs ")[1].split()[0])
    assert need > device and "all 1 drafter layers checkpointed" in err and not Path("unused").exists()


def test_bad_tune_arguments_exit_2_under_either_name(capsys, tmp_path):
    assert main(["tune", "--preset", "smoke", "--world-size", "0"]) == 2
    assert main(["plan", "--preset", "smoke", "-p", "drafter_checkpointing", "9"]) == 2
    assert "0..1 (drafter_layers)" in capsys.readouterr().err
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"preset": "smoke", "params": {"token_budgt": 4}}))
    assert main(["plan", "--preset", str(bad)]) == 2
    assert "unknown parameter 'token_budgt'" in capsys.readouterr().err
    bad.write_text(json.dumps({"preset": "nope", "params": {}}))
    with pytest.raises(ConfigError, match="a named preset"):
        load_config({}, str(bad))


@pytest.mark.slow
@pytest.mark.timeout(1800)  # 8 candidates' full dry runs, memory only: minutes on a loaded 2-core machine
def test_pruning_never_skips_a_candidate_that_fits():
    """Brute force on a small grid (1 bucket, 1 drafter layer: 2 token budgets x 2 block budgets x 2 layer
    counts): every candidate's full dry run. The tuning's choice is the first that fits in the walk's order, and
    every candidate it refused (measured, pruned, rejected) does not fit."""
    config = load_config({"k": 1, "drafter_layers": 1, "token_budget": 1024}, "smoke")
    device = _base_need_gib(config)
    lengths, queries, key = _corpus(config)
    report = search.tune(config, device, ladder=LADDER, fractions=FRACTIONS)
    fits = {}
    for c in search.candidates(config, LADDER, FRACTIONS):
        cfg = search.with_candidate(config, c)
        models = dryrun.build_step_models(cfg, target_hf_config(cfg.model), dryrun.for_cuda(cfg), True)
        assert models.settings.checkpointing == c.checkpointed
        needs = [dryrun.Reserve().required_bytes(f.peak_bytes, f.kernel_allowance) for f in (
            dryrun.measure_step(models, dryrun.host_batch(w, models.drafter.cfg.vocab_size, cfg.model.mask_id),
                                count_flops=False)
            for w in dryrun.worst_batches(cfg, bucket_edges(cfg, lengths, key, queries), c.block_budget))]
        fits[c] = max(needs) <= device * dryrun.GIB
    assert len(fits) == 8 and sum(fits.values()) > 1 and not all(fits.values())
    refused = [search.Candidate(r.token_budget, r.block_budget, r.checkpointed) for r in report.rows[1:-1]
               if r.decided != "fits"]
    assert refused and not any(fits[c] for c in refused)
    chosen = search.Candidate(report.chosen.token_budget, report.chosen.block_budget, report.chosen.checkpointed)
    work = search.work_of(config, lengths, queries, key, 1)
    proj = search.projections(config, report.flop_model, work, 1, report.mfu, report.peak_tflops, LADDER, FRACTIONS)
    base = proj[search.base_candidate(config)]
    fastest = max(proj[c].ktok_s for c in fits if fits[c])
    pool = [c for c in fits if fits[c] and proj[c].ktok_s >= fastest * (1 - search.TIE)]
    assert chosen == min(pool, key=lambda c: search.preference(c, proj[c], base.tokens_per_step))
