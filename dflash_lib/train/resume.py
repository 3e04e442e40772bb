"""What a training run finds in its run folder decides whether it resumes, starts, or refuses.

`find_resume_point`: resume from the newest verified checkpoint of this config (at any world size), start at
step 0, or refuse (CheckpointMismatchError, ConfigError: use --fresh or another folder); `prepare_run_dir` applies
it under torchrun (rank 0 decides) and records config.json and env.json; `clear_run_dir` is `--fresh`;
`shared_new_run_dir` a new folder every rank shares.
Which folder does what: docs/runs.md, "Runs that survive: resume, stop, torchrun".
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dflash_lib.config import Config, ConfigError
from dflash_lib.rundir import environment, new_run_dir, writable, write_json
from dflash_lib.rundir.checkpoints import CheckpointError, load_objects
from dflash_lib.rundir.reader import (CHECKPOINTS, CONFIG_FILE, DRAFTER_DIR, ENV_FILE, METRICS_FILE, RUN_OUTPUTS,
                                     SUMMARY_FILE, is_training_run, recorded_run)
from dflash_lib.train import distributed
from dflash_lib.train.checkpoint import CheckpointMismatchError, find_latest, fresh_run_dir

log = logging.getLogger(__name__)

# Outputs that only a finished run writes: present without a checkpoint, they are another run's results.
FINAL_OUTPUTS = frozenset({SUMMARY_FILE, DRAFTER_DIR})
# Settings that may change between a stop and a resume without changing the batches, anchors or losses.
RESUME_NEUTRAL_KEYS = frozenset({
    "fresh", "ckpt_every", "keep_checkpoints", "log_every", "max_bad_steps", "dist_timeout_s", "wandb_mode",
    "wandb_project", "out_dir", "queue_timeout_s", "close_timeout_s", "prefetch", "hs_queue", "workers",
    "cache_dir", "full_run_epochs", "full_run_samples", "stop_at_step", "probe_steps", "probe_rounds",
    "target_threads", "eval_every", "eval_samples",  # held-out evaluation reads the drafter, never steers it
    "parallel", "async_ckpt",  # DDP and FSDP share one checkpoint layout; async only changes when bytes land
    "target_parallel",  # a sharded target all-gathers the same weights: the same features, bit for bit
    "prompts_from", "enable_thinking", "doctor_samples", "sample_seed", "sampled_temperature",  # evaluation and the
    # doctor read a run, never steer it
    "engine", "engine_python", "engine_url", "engine_start_timeout_s",  # nor does the engine that serves it
})


@dataclass
class ResumePoint:
    """Where a run starts: a verified checkpoint, or nothing (step 0)."""

    path: Path | None  # the checkpoint directory (None = start from scratch)
    step: int  # optimizer steps completed in that checkpoint (0 = none)
    data_shards: int = 0  # the data shards its run cut every sampler step into (0 = none yet: the world size)


def resume_config_hash(config: Config) -> str:
    """Short stable hash of every setting that shapes the training trajectory: the hash a checkpoint records.

    Unlike `Config.hash()`, it leaves out RESUME_NEUTRAL_KEYS (logging cadence, queue sizes, `fresh`, ...), so a
    run stopped and resumed with, say, another `ckpt_every` is still the same run.
    """
    params = {k: v for k, v in config.to_params().items() if k not in RESUME_NEUTRAL_KEYS}
    return hashlib.sha256(json.dumps(params, sort_keys=True).encode()).hexdigest()[:16]


def _own_name(name: str) -> bool:
    return name in RUN_OUTPUTS or (name.endswith(".tmp") and name[:-4] in RUN_OUTPUTS)


def config_differences(config: Config, recorded: Any, most: int = 4) -> str:
    """The settings that make `config` another run than `recorded` (a run's `Config.to_dict()`, from its
    config.json or a checkpoint's manifest), this run's value first: "lr: 0.005 vs 0.01, steps: 2 vs 8", at most
    `most` of them, then "and N more"; settings that may change on resume (RESUME_NEUTRAL_KEYS) are left out.
    '' when `recorded` is no such dict or no setting differs by name."""
    if not isinstance(recorded, dict):
        return ""
    theirs = {k: v for section in recorded.values() if isinstance(section, dict) for k, v in section.items()}
    mine = config.to_params()
    unset = "(unset)"  # a setting one of the two configs does not have (another version of the code)

    def value(settings: dict[str, Any], key: str) -> Any:  # tuples as lists, as JSON holds them
        return json.loads(json.dumps(settings[key], default=str)) if key in settings else unset

    def show(v: Any) -> str:
        return v if v is unset else repr(v)

    keys = [k for k in [*mine, *sorted(set(theirs) - set(mine))] if k not in RESUME_NEUTRAL_KEYS]
    diffs = [f"{k}: {show(value(mine, k))} vs {show(value(theirs, k))}" for k in keys
             if value(mine, k) != value(theirs, k)]
    more = len(diffs) - most
    return ", ".join(diffs[:most]) + (f" and {more} more" if more > 0 else "")


def _another_config(config: Config, recorded: Any, recorded_hash: Any) -> str:
    """Why a folder's run is another config: the differing settings, and the two resume hashes."""
    diffs = config_differences(config, recorded)
    hashes = f"resume hash {resume_config_hash(config)} != {recorded_hash}"
    return f"{diffs}, this run's vs the folder's; {hashes}" if diffs else hashes


def _some(names: list[str], most: int = 4) -> str:
    return ", ".join(names[:most]) + (f" and {len(names) - most} more" if len(names) > most else "")


def clear_run_dir(run_dir: str | Path) -> list[str]:
    """fresh=True: delete what a training run wrote into `run_dir` (RUN_OUTPUTS, the checkpoints first);
    returns what was removed. Files the trainer does not write are left in place (a notebook's own files, a
    user's notes). Refuses (ConfigError) a non-empty folder that is not a training run (`is_training_run`):
    there even a summary.json or env.json is another program's."""
    run_dir = Path(run_dir)
    if not run_dir.exists():
        return []
    if not run_dir.is_dir():
        raise ConfigError(f"run folder {run_dir} exists and is not a folder")
    names = sorted(p.name for p in run_dir.iterdir())
    if names and not is_training_run(run_dir):
        raise ConfigError(f"--fresh: {run_dir} is not a training run folder (no {CONFIG_FILE} written by the trainer, "
                          f"no checkpoint) and holds {_some(names)}; --fresh deletes only a training run's own "
                          f"files: give a new or empty --run-dir")
    removed = []
    if fresh_run_dir(run_dir / CHECKPOINTS):  # atomic per checkpoint: a crash here leaves no half checkpoint
        removed.append(CHECKPOINTS + "/ckpt-*")
    for p in sorted(run_dir.iterdir()):
        if _own_name(p.name):
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p)
            else:
                p.unlink()
            removed.append(p.name)
    return removed


def find_resume_point(run_dir: str | Path, config: Config) -> ResumePoint:
    """Inspect `run_dir` (read only; the newest checkpoint's checksums are verified) and say where a run of
    `config` starts; refuses a folder that would mix runs.

    Raises CheckpointMismatchError for checkpoints of another config, CheckpointError when checkpoints exist
    but none verifies, and ConfigError for other trainer outputs without a checkpoint; the refusals of another
    config name the settings that differ.
    """
    run_dir = Path(run_dir)
    resume_hash = resume_config_hash(config)
    try:
        found = find_latest(run_dir / CHECKPOINTS, resume_hash)
    except CheckpointMismatchError as e:
        m = e.manifest
        if m is None:
            raise
        why = _another_config(config, m.meta.get("config"), m.config_hash)
        raise CheckpointMismatchError(f"run folder {run_dir} holds checkpoints of another config ({why}); use --fresh "
                                      f"or another --run-dir", m) from None
    if found is not None:
        manifest, path = found
        trainer = load_objects(path).get("trainer")
        shards = trainer.get("data_shards") if isinstance(trainer, dict) else None
        if type(shards) is not int or shards < 1:
            raise CheckpointError(f"checkpoint {path} holds no trainer state with its data shards (not written "
                                  f"by the trainer?); use --fresh or another --run-dir")
        return ResumePoint(path, manifest.step, shards)
    if not run_dir.exists():
        return ResumePoint(None, 0)
    if not run_dir.is_dir():
        raise ConfigError(f"run folder {run_dir} exists and is not a folder")
    names = {p.name for p in run_dir.iterdir()}
    final = sorted(FINAL_OUTPUTS & names)
    recorded = recorded_run(run_dir)  # None: not a training run (no checkpoint either, by now)
    if final:
        why = " and ".join(final) + (" of a finished run" if recorded is not None else "")
    elif recorded is not None and recorded["resume_hash"] != resume_hash:
        why = "the outputs of another config (" + _another_config(config, recorded["config"],
                                                                  recorded["resume_hash"]) + ")"
    elif CONFIG_FILE in names and recorded is None:
        why = f"a {CONFIG_FILE} that the trainer did not write"
    elif METRICS_FILE in names and CONFIG_FILE not in names:
        why = f"a {METRICS_FILE} of an unknown run (no {CONFIG_FILE})"
    else:
        if METRICS_FILE in names:
            log.warning("run folder %s holds a run of this config that stopped before its first checkpoint: "
                        "starting over", run_dir)
        return ResumePoint(None, 0)
    advice = ("use --fresh (fresh=True) to clear it, or another --run-dir" if recorded is not None else
              f"it is not a training run folder (no {CONFIG_FILE} of the trainer, no checkpoint), which --fresh "
              f"never clears: use another --run-dir")
    raise ConfigError(f"run folder {run_dir} already holds {why} but no checkpoint of this config to resume; {advice}")


def truncate_metrics(path: str | Path, last_step: int) -> int:
    """Keep the rows of a metrics.jsonl with step <= `last_step`; returns how many rows were dropped.

    Later rows belong to steps an interrupted run took after its last checkpoint (they are about to be trained
    again), and a line that does not parse was cut by a kill in mid-write. Rewritten atomically (temp file,
    fsync, rename); a missing file is left missing.
    """
    path = Path(path)
    if not path.is_file():
        return 0
    kept, dropped = [], 0
    with open(path, "rb") as f:
        for line in f:
            try:
                row = json.loads(line)
                step = row["step"]
            except (ValueError, KeyError, TypeError):
                dropped += 1
                continue
            if isinstance(step, int) and step <= last_step:
                kept.append(line if line.endswith(b"\n") else line + b"\n")
            else:
                dropped += 1
    if dropped:
        tmp = path.with_name(path.name + ".tmp")
        with open(tmp, "wb") as f:
            f.writelines(kept)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    return dropped


def shared_new_run_dir(tag: str = "") -> Path:
    """A new runs/<UTC>_train[_tag]/ folder created by rank 0; every rank gets rank 0's path, or its ConfigError
    (a runs root that cannot be written)."""
    made = ["", ""]  # [path, error]
    if distributed.is_main():
        try:
            made[0] = str(new_run_dir("train", tag))
        except ConfigError as e:
            made[1] = str(e)
    path, error = json.loads(distributed.all_gather_bytes(json.dumps(made).encode())[0])
    if error:
        raise ConfigError(error)
    return Path(path)


def prepare_run_dir(config: Config, run_dir: Path) -> ResumePoint:
    """Decide whether the run resumes, starts, or is refused (`dflash_lib.train.resume`): rank 0 looks (verifying the
    newest checkpoint's checksums), `fresh` first clearing the folder, then trims metrics.jsonl to the
    checkpoint's step and writes config.json and env.json; every rank gets its verdict or its refusal (a
    ConfigError naming the folder when it cannot be written)."""
    dist = distributed.info()
    resume_hash = resume_config_hash(config)
    verdict: dict[str, Any] = {}
    if dist.rank == 0:
        try:
            with writable("the run folder", run_dir):
                if config.train.fresh:
                    removed = clear_run_dir(run_dir)
                    if removed:
                        distributed.print0(f"fresh start in {run_dir}: removed {', '.join(removed)}")
                    point = ResumePoint(None, 0)  # files the trainer did not write stay: the user starts here
                else:
                    point = find_resume_point(run_dir, config)
                run_dir.mkdir(parents=True, exist_ok=True)
                dropped = truncate_metrics(run_dir / METRICS_FILE, point.step)
                write_json(run_dir / CONFIG_FILE, {"config": config.to_dict(), "config_hash": config.hash(),
                                                   "resume_hash": resume_hash})
                write_json(run_dir / ENV_FILE, environment())
            if point.path is not None:
                distributed.print0(f"resuming from {point.path}" + (f" (dropped {dropped} metrics rows logged "
                                                                     f"past it)" if dropped else ""))
            verdict = {"path": None if point.path is None else str(point.path), "step": point.step,
                       "data_shards": point.data_shards}
        except (CheckpointError, ConfigError) as e:
            if dist.world_size == 1:
                raise
            verdict = {"error": type(e).__name__, "message": str(e)}
    verdict = json.loads(distributed.all_gather_bytes(json.dumps(verdict).encode())[0])
    if "error" in verdict:
        kind = {"CheckpointMismatchError": CheckpointMismatchError, "CheckpointError": CheckpointError}
        raise kind.get(verdict["error"], ConfigError)(verdict["message"])
    return ResumePoint(None if verdict["path"] is None else Path(verdict["path"]), verdict["step"],
                       verdict["data_shards"])
