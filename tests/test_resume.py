"""Resume: (run k steps, stop, resume to n) is the uninterrupted run to n; run folders are never mixed."""

from __future__ import annotations

import json
import math
import os
import shutil
from functools import partial
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

import run_folder
from checkpoints import load_latest, save_checkpoint
from dflash_lib.__main__ import main
from dflash_lib.config import FLAT_FIELDS, ConfigError, from_params, preset
from dflash_lib.rundir.checkpoints import CheckpointError, list_checkpoints
from dflash_lib.rundir.reader import RUN_OUTPUTS
from dflash_lib.train.checkpoint import CheckpointMismatchError
from dflash_lib.train.loop import train
from dflash_lib.rundir.records import BUDGET_FIGURES
from dflash_lib.train.resume import (RESUME_NEUTRAL_KEYS, config_differences, prepare_run_dir, resume_config_hash,
                                     truncate_metrics)
from run_folder import metrics_rows as rows

# lr high enough that a step taken with the wrong weights, optimizer moments, batch or anchors shows in the loss
BASE = dict(steps=8, lr=1e-2, warmup_steps=1, ckpt_every=3, log_every=100)

# the same batches, micro-batches included (one process each), and the same losses within 1e-6
assert_same_trajectory = partial(run_folder.assert_same_trajectory, atol=1e-6,
                                 exact_keys=(*run_folder.BATCH_KEYS, "micro_batches"))


def config(**params):
    return from_params({**BASE, **params}, preset("smoke"))


def weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(str(run_dir / "drafter" / "model.safetensors"))


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> tuple[Path, list[dict]]:
    run_dir = tmp_path_factory.mktemp("reference")
    summary = train(config(), run_dir)
    assert summary.complete and summary.steps == 8 and summary.resumed_from_step == 0
    return run_dir, rows(run_dir)


@pytest.mark.slow
def test_stop_then_resume_equals_the_uninterrupted_run(tmp_path, reference):
    ref_dir, ref_rows = reference
    first = train(config(stop_at_step=4), tmp_path)
    assert (first.complete, first.stop_reason, first.steps) == (False, "stop_at_step=4", 4)
    assert [p.name for p in list_checkpoints(tmp_path / "checkpoints")] == ["ckpt-00000003", "ckpt-00000004"]
    # resume-neutral settings may change between the two invocations
    second = train(config(ckpt_every=5, log_every=1, keep_checkpoints=1), tmp_path)
    assert (second.complete, second.resumed_from_step, second.steps) == (True, 4, 8)
    assert_same_trajectory(rows(tmp_path), ref_rows)
    assert second.real_tokens == sum(r["real_tokens"] for r in ref_rows)  # run totals carried over
    assert second.skipped_samples == json.loads((ref_dir / "summary.json").read_text())["skipped_samples"]
    assert second.mean_loss == pytest.approx(np.mean([r["loss"] for r in ref_rows]), abs=1e-6)
    for key in BUDGET_FIGURES:  # the batches' fill over the whole run, not this invocation's steps only
        assert getattr(second, key) == pytest.approx(np.mean([r[key] for r in ref_rows]), abs=1e-12), key
    assert [p.name for p in list_checkpoints(tmp_path / "checkpoints")] == ["ckpt-00000008"]  # keep_checkpoints=1
    got, want = weights(tmp_path), weights(ref_dir)
    assert all(torch.allclose(got[k], want[k], rtol=0, atol=1e-6) for k in want)
    # the finished run's folder resumes to "complete" without training a step
    again = train(config(), tmp_path)
    assert again.steps == 8 and again.resumed_from_step == 8 and len(rows(tmp_path)) == 8


@pytest.mark.slow
def test_resume_skips_a_corrupt_checkpoint_and_drops_the_rows_logged_past_the_one_used(tmp_path, reference, caplog):
    _, ref_rows = reference
    train(config(stop_at_step=5), tmp_path)  # checkpoints at 3 and 5, rows 1..5
    state = tmp_path / "checkpoints" / "ckpt-00000005" / "dcp" / "__0_0.distcp"  # the weights and AdamW bytes
    data = bytearray(state.read_bytes())
    data[len(data) // 2] ^= 0xFF
    state.write_bytes(bytes(data))
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 6, "loss": 1')  # a row cut by a kill in mid-write
    summary = train(config(), tmp_path)
    assert summary.resumed_from_step == 3
    assert "skipping checkpoint ckpt-00000005" in caplog.text and "fails its checksum" in caplog.text
    assert_same_trajectory(rows(tmp_path), ref_rows)  # rows 4, 5 and the cut row 6 were dropped, then retrained


@pytest.mark.slow
def test_async_checkpoints_resume_like_synchronous_ones(tmp_path, reference):
    """async_ckpt: DCP stages the tensors and writes them in a background thread; the next save or the end commits
    each one (manifest last), so a stop and a resume still reproduce the uninterrupted run."""
    _, ref_rows = reference
    first = train(config(stop_at_step=7, async_ckpt=True), tmp_path)  # saves at 3 and 6 in the background, 7 at the end
    assert first.checkpoint.endswith("ckpt-00000007")
    assert [p.name for p in list_checkpoints(tmp_path / "checkpoints")] == ["ckpt-00000003", "ckpt-00000006",
                                                                             "ckpt-00000007"]
    assert not [p for p in (tmp_path / "checkpoints").iterdir() if p.name.startswith(".")]  # every one committed
    second = train(config(async_ckpt=True), tmp_path)
    assert second.resumed_from_step == 7
    assert_same_trajectory(rows(tmp_path), ref_rows)


@pytest.mark.slow
def test_resume_at_an_epoch_boundary_in_an_epochs_run(tmp_path):
    """1.5 epochs of the first 40 records; stop exactly at the end of epoch 0."""
    params = dict(limit=40, steps=0, epochs=1.5, ckpt_every=0)
    ref = train(config(**params), tmp_path / "ref")
    per_epoch = sum(r["epoch"] == 0 for r in rows(tmp_path / "ref"))  # sampler steps of one epoch
    assert ref.steps == ref.planned_steps == math.ceil(1.5 * per_epoch) and ref.last_epoch == 1
    stopped = train(config(**params, stop_at_step=per_epoch), tmp_path / "run")
    assert stopped.last_epoch == 0 and [p.name for p in list_checkpoints(tmp_path / "run" / "checkpoints")] == [
        f"ckpt-{per_epoch:08d}"]
    resumed = train(config(**params), tmp_path / "run")
    assert resumed.steps == ref.steps and resumed.complete
    assert resumed.empty_batches == ref.empty_batches  # kept by the checkpoint
    assert_same_trajectory(rows(tmp_path / "run"), rows(tmp_path / "ref"))


@pytest.mark.slow
def test_muon_and_wsd_resume_like_the_uninterrupted_run(tmp_path):
    """Two optimizers (Muon on the matrices, AdamW on the norms): both states go through the checkpoint."""
    params = dict(optimizer="muon", lr_schedule="wsd", decay_ratio=0.5, steps=6, ckpt_every=0)
    ref = train(config(**params), tmp_path / "ref")
    assert ref.complete and ref.final_loss == ref.final_loss
    train(config(**params, stop_at_step=3), tmp_path / "run")
    train(config(**params), tmp_path / "run")
    assert_same_trajectory(rows(tmp_path / "run"), rows(tmp_path / "ref"))
    assert [r["lr"] for r in rows(tmp_path / "ref")][2:] == pytest.approx([1e-2, 1e-2, 1e-2 * 2 / 3, 1e-2 / 3])
    got, want = weights(tmp_path / "run"), weights(tmp_path / "ref")
    assert all(torch.allclose(got[k], want[k], rtol=0, atol=1e-6) for k in want)
    adamw = train(config(steps=6, ckpt_every=0, lr_schedule="wsd", decay_ratio=0.5), tmp_path / "adamw")
    assert adamw.final_loss != pytest.approx(ref.final_loss, rel=1e-6)  # the optimizer setting reached the run


@pytest.mark.slow
def test_resume_inside_an_accumulated_step_sequence(tmp_path):
    params = dict(steps=5, accum_tokens=3000, ckpt_every=0)
    train(config(**params), tmp_path / "ref")
    ref_rows = rows(tmp_path / "ref")
    assert all(r["micro_batches"] >= 2 for r in ref_rows)  # each step really spans several sampler batches
    train(config(**params, stop_at_step=2), tmp_path / "run")
    train(config(**params), tmp_path / "run")
    assert_same_trajectory(rows(tmp_path / "run"), ref_rows)


def test_another_config_is_refused_and_fresh_starts_over(tmp_path):
    train(config(steps=2, ckpt_every=1), tmp_path)
    with pytest.raises(CheckpointMismatchError, match=r"holds checkpoints of another config \(lr: 0.005 vs 0.01, "
                                                      r"this run's vs the folder's; resume hash \w+ != \w+\); "
                                                      r"use --fresh or another --run-dir"):
        train(config(steps=2, lr=5e-3), tmp_path)
    summary = train(config(steps=2, lr=5e-3, fresh=True), tmp_path)
    assert summary.resumed_from_step == 0 and summary.steps == 2
    assert [r["step"] for r in rows(tmp_path)] == [1, 2]  # the old run's rows were cleared, not appended to
    state, _ = load_latest(tmp_path / "checkpoints", resume_config_hash(config(steps=2, lr=5e-3)))
    assert state["step"] == 2


def test_a_checkpoint_without_trainer_state_is_refused(tmp_path):
    cfg = config(steps=2)
    save_checkpoint(tmp_path / "checkpoints", {"step": 1}, 1, config_hash=resume_config_hash(cfg))
    with pytest.raises(CheckpointError, match=r"ckpt-00000001 holds no trainer state with its data shards"):
        train(cfg, tmp_path)


def test_other_trainer_outputs_without_a_checkpoint_are_never_mixed_into(tmp_path):
    (tmp_path / "nb.ipynb").write_text("{}")  # a notebook run's own file: neither inspected nor touched
    summary = train(config(steps=1), tmp_path)
    assert summary.steps == 1 and (tmp_path / "nb.ipynb").read_text() == "{}"

    for p in list_checkpoints(tmp_path / "checkpoints"):  # a finished run whose checkpoints were removed by hand
        shutil.rmtree(p)
    with pytest.raises(ConfigError, match=r"already holds drafter and summary.json of a finished run but no "
                                          r"checkpoint of this config to resume; use --fresh"):
        train(config(steps=1), tmp_path)
    summary = train(config(steps=1, fresh=True), tmp_path)
    assert summary.steps == 1 and (tmp_path / "nb.ipynb").read_text() == "{}"  # fresh keeps foreign files

    unknown = tmp_path / "unknown"
    unknown.mkdir()
    (unknown / "metrics.jsonl").write_text('{"step": 1}\n')
    with pytest.raises(ConfigError, match=r"a metrics.jsonl of an unknown run \(no config.json\)"):
        train(config(steps=1), unknown)
    assert os.listdir(unknown) == ["metrics.jsonl"]  # refused before writing anything


def remove_outputs_but_traces(run_dir: Path) -> None:
    """Leave what a run that died before its first checkpoint leaves: config.json, env.json, metrics.jsonl."""
    shutil.rmtree(run_dir / "checkpoints")
    shutil.rmtree(run_dir / "drafter")
    (run_dir / "summary.json").unlink()


def test_a_run_that_died_before_its_first_checkpoint_starts_over(tmp_path):
    cfg = config(steps=2)
    train(cfg, tmp_path)
    remove_outputs_but_traces(tmp_path)
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 9.0}\n')  # the dead run's only row
    summary = train(cfg, tmp_path)
    assert summary.resumed_from_step == 0 and [r["step"] for r in rows(tmp_path)] == [1, 2]
    assert rows(tmp_path)[0]["loss"] != 9.0  # the dead run's row was dropped, not kept before the new ones
    remove_outputs_but_traces(tmp_path)
    with pytest.raises(ConfigError, match=r"already holds the outputs of another config \(lr: 0.005 vs 0.01, this "
                                          r"run's vs the folder's; resume hash \w+ != \w+\) but no checkpoint"):
        train(config(steps=2, lr=5e-3), tmp_path)


def _files(folder: Path) -> dict[str, bytes]:
    """Every file under `folder` (relative path -> bytes)."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_fresh_refuses_a_folder_that_is_not_a_training_run_and_touches_nothing(tmp_path):
    notebook = tmp_path / "20260101T000000Z_01_length_analysis"  # what `run 01_length_analysis` leaves
    notebook.mkdir()
    for name, text in (("01_length_analysis.ipynb", "{}"), ("params.json", "{}"), ("env.json", '{"host": "a"}'),
                       ("summary.json", '{"samples": 224}'), ("lengths.html", "<html>")):
        (notebook / name).write_text(text)
    plain = tmp_path / "mine"  # a user's folder
    (plain / "wandb").mkdir(parents=True)
    (plain / "notes.txt").write_text("keep")
    (plain / "metrics.jsonl").write_text('{"step": 1}\n')
    (plain / "wandb" / "run.log").write_text("mine")
    for folder in (notebook, plain):
        before = _files(folder)
        with pytest.raises(ConfigError, match=rf"--fresh: {folder} is not a training run folder \(no config.json "
                                              r"written by the trainer, no checkpoint\) and holds .*give a new or "
                                              r"empty --run-dir"):
            prepare_run_dir(config(fresh=True), folder)
        assert _files(folder) == before
    # without --fresh the refusal does not send the user to --fresh
    with pytest.raises(ConfigError, match=r"already holds summary.json but .* not a training run folder .* which "
                                          r"--fresh never clears: use another --run-dir"):
        prepare_run_dir(config(), notebook)
    assert prepare_run_dir(config(fresh=True), tmp_path / "new").step == 0  # a new folder is fine
    empty = tmp_path / "empty"
    empty.mkdir()
    assert prepare_run_dir(config(fresh=True), empty).step == 0
    assert sorted(p.name for p in empty.iterdir()) == ["config.json", "env.json"]


def test_fresh_deletes_exactly_what_a_training_run_owns(tmp_path):
    cfg = config(steps=2)
    prepare_run_dir(cfg, tmp_path)  # the trainer's config.json: now a training run folder
    for name in ("metrics.jsonl", "heldout.json", "summary.json", "summary.json.tmp"):
        (tmp_path / name).write_text("{}")
    for folder in ("drafter", "wandb", "checkpoints/ckpt-00000002", "notebook_figures"):
        (tmp_path / folder).mkdir(parents=True)
        (tmp_path / folder / "x").write_text("x")
    (tmp_path / "04_train.ipynb").write_text("{}")
    prepare_run_dir(config(steps=2, lr=5e-3, fresh=True), tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["04_train.ipynb", "config.json", "env.json",
                                                         "notebook_figures"]
    assert (tmp_path / "notebook_figures" / "x").read_text() == "x"
    assert json.loads((tmp_path / "config.json").read_text())["config"]["train"]["lr"] == 5e-3
    assert {"metrics.jsonl", "heldout.json", "summary.json", "drafter", "wandb", "checkpoints"} <= RUN_OUTPUTS


def test_resume_hash_ignores_run_control_settings() -> None:
    base = preset("smoke")
    assert RESUME_NEUTRAL_KEYS <= set(FLAT_FIELDS)
    same = from_params({"ckpt_every": 5, "log_every": 3, "fresh": True, "wandb_mode": "disabled",
                        "keep_checkpoints": 1, "dist_timeout_s": 9.0}, base)
    assert resume_config_hash(same) == resume_config_hash(base)
    for key, value in [("lr", 1e-3), ("sampler_seed", 1), ("token_budget", 1024), ("seed", 5)]:
        assert resume_config_hash(from_params({key: value}, base)) != resume_config_hash(base), key


def test_config_differences_name_the_settings_this_run_first():
    mine = config(lr=5e-3, steps=3)
    assert config_differences(mine, config().to_dict()) == "steps: 3 vs 8, lr: 0.005 vs 0.01"
    assert config_differences(mine, config(log_every=1, ckpt_every=9).to_dict()) == "steps: 3 vs 8, lr: 0.005 vs 0.01"
    many = config(lr=5e-3, steps=3, seed=7, warmup_steps=2, grad_clip=0.5, max_len=200)
    diff = config_differences(many, config().to_dict(), most=4)
    assert diff.count(" vs ") == 4 and diff.endswith(" and 2 more")
    recorded = config().to_dict()
    recorded["train"]["retired_setting"] = 1  # a setting of another version of the code
    del recorded["train"]["seed"]
    assert config_differences(config(), recorded) == "seed: 0 vs (unset), retired_setting: (unset) vs 1"
    assert config_differences(config(), None) == ""


def test_truncate_metrics_keeps_a_prefix(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s}) + "\n" for s in range(1, 6)) + '{"step": 6, "lo')
    assert truncate_metrics(path, 3) == 3
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [1, 2, 3]
    assert truncate_metrics(path, 3) == 0 and truncate_metrics(tmp_path / "absent.jsonl", 3) == 0


def test_command_line_fresh_flag(tmp_path, capsys):
    args = ["train", "--preset", "smoke", "--run-dir", str(tmp_path), "-p", "steps", "1"]
    assert main(args) == 0
    assert main(args + ["-p", "lr", "0.005"]) == 1  # a mismatching checkpoint: a clear error, exit 1
    err = capsys.readouterr().err
    assert "CheckpointMismatchError: run folder" in err and f"(lr: 0.005 vs {preset('smoke').train.lr}, this run's" in err
    assert main(args + ["-p", "lr", "0.005", "--fresh"]) == 0
    assert "fresh start in" in capsys.readouterr().out
    assert main(args + ["--fresh", "-p", "fresh", "true"]) == 2
    assert "give --fresh or -p fresh, not both" in capsys.readouterr().err
