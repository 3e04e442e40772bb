"""A whole training run evaluated (notebook 05): every drafter of the run, the untrained one, each checkpoint's
and the final one, on the same prompts against the same target (`evaluate_run` -> `RunEvaluation`), its losses
from metrics.jsonl (`loss_figures`), the export of the final drafter and the serving doctor on it. The run folder
is read through `rundir.reader`: nothing of train/ is imported.
"""

from __future__ import annotations

import json
import math
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Mapping, Sequence

import pandas as pd
import torch

from dflash_lib.benchmark_report import GroupDecode
from dflash_lib.config import Config, ConfigError, from_params
from dflash_lib.doctor import diagnose
from dflash_lib.evaluate.decoding import _baseline, _warm, _warn_differ, decode_groups, decode_report
from dflash_lib.evaluate.engine import overall_served_tau, serve_drafter, served_sets
from dflash_lib.evaluate.reports import DecodeReport, DrafterMeasurement, RunEvaluation, summary
from dflash_lib.evaluate.setup import Say, Setup, _stderr, decode_threads, initial_drafter, load_drafter, prepare
from dflash_lib.export import export_source
from dflash_lib.models.export import DTYPES, export_drafter
from dflash_lib.rundir.checkpoints import CheckpointError, list_checkpoints, read_manifest
from dflash_lib.rundir.reader import CHECKPOINTS, CONFIG_FILE, SUMMARY_FILE, load_metrics, read_summary
from dflash_lib.rundir.records import BUDGET_FIGURES
from dflash_lib.serve.measure import ServedPass


SERVING_DIR = "serving"  # evaluate_run exports the final drafter to <out_dir>/serving/

LOSS_WINDOW = 5  # steps averaged at each end for loss_first / loss_last (at most a quarter of the run)


def trainer_folder(run: str | Path) -> Path:
    """The trainer run folder of `run`: a notebook-04 run folder (its `train/`) or a trainer folder itself."""
    p = Path(run)
    for candidate in (p / "train", p):
        doc = candidate / CONFIG_FILE
        if doc.is_file() and isinstance(json.loads(doc.read_text()).get("config"), dict):
            return candidate
    raise ConfigError(f"run {str(p)!r}: not a notebook-04 run folder (train/config.json) nor a trainer run folder "
                      f"(config.json with the run's config)")


def run_checkpoints(train_dir: Path) -> list[tuple[int, Path]]:
    """(step, folder) of every checkpoint of a trainer run, oldest first, by their manifests (`rundir.reader`)."""
    out = []
    for path in list_checkpoints(train_dir / CHECKPOINTS):
        try:
            out.append((int(read_manifest(path).step), path))
        except CheckpointError as e:
            raise ConfigError(f"checkpoint {path}: {e}") from None
    return out


def checkpoint_drafter(ckpt: Path, setup: Setup, scratch: Path) -> Any:
    """The drafter of one checkpoint, read the way `python -m dflash_lib export` reads it (fp32, so exact)."""
    out = export_source(ckpt, scratch / ckpt.name, DTYPES["fp32"])
    return load_drafter(out, setup.target)


def _same_weights(a: Any, b: Any) -> bool:
    pa, pb = dict(a.named_parameters()), dict(b.named_parameters())
    return pa.keys() == pb.keys() and all(torch.equal(pa[k], pb[k]) for k in pa)


@dataclass
class _Measured:
    """One drafter of a run as decoded in process, kept for the engine."""

    step: int
    what: str
    folder: Path  # an export folder the engine can serve
    done: list[GroupDecode]


def best_drafter(by_step: Sequence[DrafterMeasurement]) -> tuple[DrafterMeasurement, str, float]:
    """(the best drafter, by what, its tau): the highest served tau when every drafter was served (ties: our tau,
    then the later step), else the highest tau of our decoding (ties: the later step)."""
    if by_step and all(r.served_tau is not None for r in by_step):
        best = max(by_step, key=lambda r: (r.served_tau, r.tau, r.step))
        return best, "served tau", float(best.served_tau)
    best = max(by_step, key=lambda r: (r.tau, r.step))
    return best, "tau", best.tau


def evaluate_run(run: str | Path, target: str | None, params: Mapping[str, Any] | None = None,
                 out_dir: str | Path | None = None, say: Say = _stderr) -> RunEvaluation:
    """Every drafter of a training run on the SAME held-out prompts against the same target: the untrained one
    (step 0, `initial_drafter`), each saved checkpoint's, and the final `drafter/` (decoded in full: histogram,
    per-position acceptance, speedup against plain greedy decoding, timed once for all). With `-p engine vllm`
    each of them is also served by the engine (one start each; the final one at `sampled_temperature` too, and
    the target alone once for the engine's speedup), and the best drafter is named by served tau. With `out_dir`
    the final drafter is exported there in the serving layout (`SERVING_DIR`, bf16) and the engine's logs go to
    its engine/. Training and held-out losses come from the run's metrics.jsonl (`evaluate.loss_figures`)."""
    if (params or {}).get("engine_url"):
        raise ConfigError("engine_url: a running server serves one drafter, and a run's evaluation serves each of "
                          "its drafters; give -p engine_python (or none: .venv-engine) and the engine is started "
                          "for each")
    train_dir = trainer_folder(run)
    setup = prepare(train_dir, target, params, say)
    final_model = setup.drafter
    if not (train_dir / SUMMARY_FILE).is_file():
        raise ConfigError(f"run {train_dir}: no summary.json, so the run did not finish (its drafter/ is written at "
                          f"the end; rerun the training to resume it)")
    try:
        trained = read_summary(train_dir)
    except ValueError as e:  # written by a trainer of another version
        raise ConfigError(str(e)) from None
    final_step = trained.steps
    engine = setup.config.evaluate.engine != "none"
    with decode_threads(setup), tempfile.TemporaryDirectory(prefix="dflash-eval-") as scratch:
        _warm(setup, final_model)
        baseline = _baseline(setup)
        by_step: list[DrafterMeasurement] = []
        measured: list[_Measured] = []

        def measure(step: int, model: Any, what: str, folder: Path) -> DecodeReport:
            done = decode_groups(setup, model, baseline)
            r = decode_report(setup, model, done)
            _warn_differ(r, say, f" ({what})")
            by_step.append(DrafterMeasurement(step, what, r.tau, r.histogram, r.per_position, r.cycles,
                                              r.outputs_equal_baseline, r.tokens_per_s))
            measured.append(_Measured(step, what, folder, done))
            say(f"step {step:>6} ({what}): tau {r.tau:.3f} over {r.cycles} cycles")
            return r

        untrained = initial_drafter(setup.config, setup.target)
        untrained_dir = Path(scratch) / "untrained"
        if engine:
            export_drafter(untrained, untrained_dir, DTYPES["fp32"])
        measure(0, untrained, "untrained (the run's seed)", untrained_dir)
        for step, ckpt in run_checkpoints(train_dir):
            model = checkpoint_drafter(ckpt, setup, Path(scratch))
            if step == final_step and _same_weights(model, final_model):
                continue  # the final drafter itself: decoded once, below
            measure(step, model, str(ckpt.relative_to(train_dir)), Path(scratch) / ckpt.name)
        final = measure(final_step, final_model, "final (drafter/)", setup.drafter_dir)
        hot = sampled_setup(setup)
        hot_done: list[GroupDecode] = []
        hot_base = None
        sampled = None
        if hot is not None:
            hot_base = _baseline(hot)
            hot_done = decode_groups(hot, final_model, hot_base)
            sampled = decode_report(hot, final_model, hot_done)
            say(f"sampled at temperature {hot.config.regenerate.temperature}: tau {sampled.tau:.3f}, speedup "
                f"{sampled.speedup:.2f}x over plain sampling")
        if engine:
            log_dir = (Path(out_dir) / "engine" if out_dir is not None
                       else Path(tempfile.mkdtemp(prefix="dflash-engine-")))
            g = setup.sampling()
            for m, row in zip(measured, by_step):
                passes = [ServedPass(served_sets(baseline.groups, m.done), g["temperature"], g["top_p"],
                                     setup.config.evaluate.sample_seed)]
                is_final = m.folder == setup.drafter_dir
                if is_final and hot is not None and hot_base is not None:
                    h = hot.sampling()
                    passes.append(ServedPass(served_sets(hot_base.groups, hot_done), h["temperature"], h["top_p"],
                                             hot.config.evaluate.sample_seed))
                reports = serve_drafter(setup, m.folder, passes, log_dir, f"engine-step-{m.step}", is_final, say)
                row.served, row.served_tau = reports[0], overall_served_tau(reports[0])
                if is_final:
                    final.served = reports[0]
                    if sampled is not None:
                        sampled.served = reports[1]
    by_step.sort(key=lambda r: r.step)
    metrics = load_metrics(train_dir)
    losses = loss_figures(metrics)
    export, export_files, export_config = None, [], {}
    if out_dir is not None:
        folder = export_source(setup.drafter_dir, Path(out_dir) / SERVING_DIR, DTYPES["bf16"])
        export = str(folder)
        export_files = sorted(p.name for p in folder.iterdir())
        export_config = json.loads((folder / "config.json").read_text())
    doctor = run_doctor(export, setup.config, say)
    best, best_by, best_tau = best_drafter(by_step)
    say(f"best drafter by {best_by}: step {best.step} ({best.drafter}), {best_by} {best_tau:.3f}")
    report = RunEvaluation(
        tau_trained=final.tau, tau_untrained=by_step[0].tau, tau_by_step={str(r.step): r.tau for r in by_step},
        speedup=final.speedup, **losses, export=export, export_files=export_files, export_config=export_config,
        final=final, by_step=by_step, steps=final_step, **{k: getattr(trained, k) for k in BUDGET_FIGURES},
        run=str(Path(run)), train_dir=str(train_dir),
        prompts=final.prompts, max_new_tokens=final.max_new_tokens, min_new_tokens=final.min_new_tokens,
        block_size=final.block_size, prompt_source=setup.prompts.source, prompt_indices=setup.prompts.indices,
        sampled=sampled, doctor=doctor, best_step=best.step, best_drafter=best.drafter, best_by=best_by,
        best_tau=best_tau)
    say(summary(final))
    return report


def sampled_setup(setup: Setup) -> Setup | None:
    """The setup at `sampled_temperature` (the regenerate section's top_p, `sample_seed`); None when it is 0 or
    the setup already decodes at that temperature."""
    t = setup.config.evaluate.sampled_temperature
    if t == 0 or t == setup.config.regenerate.temperature:
        return None
    return replace(setup, config=from_params({"temperature": t}, setup.config))


def run_doctor(export: str | None, config: Config, say: Say = _stderr) -> dict[str, Any] | None:
    """The serving doctor (`doctor.diagnose`, `doctor_samples` conversations) on the exported folder against the
    config's target folder: its JSON record and `lines`; None without an export or a local target folder."""
    target = config.model.target
    if export is None or not Path(target).expanduser().is_dir():
        return None
    report = diagnose(export, target, {"doctor_samples": config.evaluate.doctor_samples})
    for line in report.lines():
        say(f"doctor: {line}")
    say(f"doctor: {report.count_line()}")
    return {**report.to_json(), "lines": report.lines()}


def _number(value: Any) -> float | None:
    """A finite float, or None (JSON has no NaN)."""
    try:
        value = float(value)
    except (TypeError, ValueError):
        return None
    return value if math.isfinite(value) else None


def loss_figures(metrics: pd.DataFrame, window: int = LOSS_WINDOW) -> dict[str, Any]:
    """From a run's metrics frame (`rundir.reader.load_metrics`; rows of skipped steps left out):
    loss_first / loss_last = mean training loss (nats) over the first / last `loss_window` steps, where
    loss_window = max(1, min(window, steps // 4)) so the two windows never overlap; heldout_loss_first /
    heldout_loss_last = the held-out loss of the first / last evaluation (None when the run logged none) and
    heldout_steps = the steps evaluated."""
    if window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    rows = metrics
    if "skipped" in rows:
        rows = rows[~rows["skipped"].fillna(False).astype(bool)]
    losses = rows[["step", "loss"]].dropna()
    if losses.empty:
        raise ValueError("metrics: no step with a training loss")
    w = max(1, min(window, len(losses) // 4))
    out: dict[str, Any] = {"loss_first": float(losses["loss"].iloc[:w].mean()),
                           "loss_last": float(losses["loss"].iloc[-w:].mean()), "loss_window": w,
                           "heldout_loss_first": None, "heldout_loss_last": None, "heldout_steps": []}
    if "heldout_loss" in metrics:
        held = metrics[["step", "heldout_loss"]].dropna()
        if not held.empty:
            out["heldout_loss_first"] = _number(held["heldout_loss"].iloc[0])
            out["heldout_loss_last"] = _number(held["heldout_loss"].iloc[-1])
            out["heldout_steps"] = [int(s) for s in held["step"]]
    return out
