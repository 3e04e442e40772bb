"""What a training run finds in its run folder decides whether it resumes, starts, or refuses.

    checkpoints/ckpt-<step>/ of this config      -> resume from the newest one that verifies (at any world size:
                                                    DCP reshards, the data position is global)
    a checkpoint of another config               -> CheckpointMismatchError (never mix two runs)
    no trainer output at all                     -> start at step 0
    only the traces of a run of THIS config that died before its first checkpoint (config.json with the same
    resume hash, metrics.jsonl, wandb/, a checkpoints/ without a checkpoint) -> start at step 0 over them
    other trainer outputs without a checkpoint (a summary.json or drafter/, another config's config.json,
    metrics.jsonl without config.json)           -> ConfigError: use fresh=True (--fresh) or another folder
Files the trainer does not write (a notebook run's executed notebook, params.json, figures) are neither
inspected nor touched: a notebook may train into its own run folder. env.json is rewritten by every run.
`fresh=True` first deletes the checkpoints and this trainer's outputs.
On resume, metrics.jsonl keeps only the rows up to the checkpoint's step, so that the rows appended next make
it the true trajectory of the run (an interrupted run may have logged steps past its last checkpoint).
`prepare_run_dir` applies all this under torchrun (rank 0 decides, every rank gets the verdict) and records the
run's config.json and env.json; `shared_new_run_dir` makes a new run folder whose path every rank shares.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dflash_lib import distributed
from dflash_lib.checkpoint import (CheckpointError, CheckpointMismatchError, find_latest, fresh_run_dir, load_objects,
                                   resume_config_hash)
from dflash_lib.config import Config, ConfigError
from dflash_lib.runs import environment, new_run_dir, write_json

log = logging.getLogger(__name__)

CHECKPOINTS = "checkpoints"  # sub-folder of the run folder holding ckpt-<step>/ directories
CONFIG_FILE = "config.json"  # {"config", "config_hash", "resume_hash"} of the run
METRICS_FILE = "metrics.jsonl"  # one JSON object per step
# Everything the trainer writes into a run folder (and the temp names of its atomic writes).
RUN_OUTPUTS = frozenset({CONFIG_FILE, "env.json", METRICS_FILE, "summary.json", "drafter", "wandb", CHECKPOINTS})
# Outputs that only a finished run writes: present without a checkpoint, they are another run's results.
FINAL_OUTPUTS = frozenset({"summary.json", "drafter"})


@dataclass
class ResumePoint:
    """Where a run starts: a verified checkpoint, or nothing (step 0)."""

    path: Path | None  # the checkpoint directory (None = start from scratch)
    step: int  # optimizer steps completed in that checkpoint (0 = none)
    data_shards: int = 0  # the data shards its run cut every sampler step into (0 = none yet: the world size)


def _own_name(name: str) -> bool:
    return name in RUN_OUTPUTS or (name.endswith(".tmp") and name[:-4] in RUN_OUTPUTS)


def clear_run_dir(run_dir: str | Path) -> list[str]:
    """fresh=True: delete the checkpoints and every trainer output in `run_dir`; returns what was removed.
    Files the trainer does not write are left in place (a notebook's own files, a user's notes)."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        return []
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


def recorded_resume_hash(run_dir: Path) -> str | None:
    """The resume hash in run_dir/config.json (None when absent or unreadable)."""
    try:
        doc = json.loads((run_dir / CONFIG_FILE).read_text())
    except (OSError, ValueError):
        return None
    value = doc.get("resume_hash") if isinstance(doc, dict) else None
    return value if isinstance(value, str) else None


def find_resume_point(run_dir: str | Path, resume_hash: str) -> ResumePoint:
    """Inspect `run_dir` (read only; the newest checkpoint's checksums are verified) and say where the run
    starts; refuses a folder that would mix runs.

    Raises CheckpointMismatchError for checkpoints of another config, CheckpointError when checkpoints exist
    but none verifies, and ConfigError for other trainer outputs without a checkpoint.
    """
    run_dir = Path(run_dir)
    found = find_latest(run_dir / CHECKPOINTS, resume_hash)
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
    recorded = recorded_resume_hash(run_dir)
    if final:
        why = f"{' and '.join(final)} of a finished run"
    elif CONFIG_FILE in names and recorded != resume_hash:
        why = f"the outputs of another config (resume hash {recorded} != {resume_hash})"
    elif METRICS_FILE in names and CONFIG_FILE not in names:
        why = f"a {METRICS_FILE} of an unknown run (no {CONFIG_FILE})"
    else:
        if METRICS_FILE in names:
            log.warning("run folder %s holds a run of this config that stopped before its first checkpoint: "
                        "starting over", run_dir)
        return ResumePoint(None, 0)
    raise ConfigError(f"run folder {run_dir} already holds {why} but no checkpoint of this config to resume; "
                      f"use --fresh (fresh=True) to clear it, or another --run-dir")


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
    """A new runs/<UTC>_train[_tag]/ folder created by rank 0; every rank gets rank 0's path."""
    path = str(new_run_dir("train", tag)) if distributed.is_main() else ""
    return Path(distributed.all_gather_bytes(path.encode())[0].decode())


def prepare_run_dir(config: Config, run_dir: Path) -> ResumePoint:
    """Decide whether the run resumes, starts, or is refused (`dflash_lib.resume`): rank 0 looks (verifying the
    newest checkpoint's checksums) and every rank gets its verdict; `fresh` first clears the folder (rank 0).
    Then rank 0 trims metrics.jsonl to the checkpoint's step and writes config.json and env.json."""
    dist = distributed.info()
    resume_hash = resume_config_hash(config)
    verdict: dict[str, Any] = {}
    if dist.rank == 0:
        try:
            if config.train.fresh:
                removed = clear_run_dir(run_dir)
                if removed:
                    distributed.print0(f"fresh start in {run_dir}: removed {', '.join(removed)}")
                point = ResumePoint(None, 0)  # files the trainer did not write stay, as the user asked to start here
            else:
                point = find_resume_point(run_dir, resume_hash)
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
    point = ResumePoint(None if verdict["path"] is None else Path(verdict["path"]), verdict["step"],
                        verdict["data_shards"])
    if dist.rank == 0:
        run_dir.mkdir(parents=True, exist_ok=True)
        dropped = truncate_metrics(run_dir / METRICS_FILE, point.step)
        write_json(run_dir / CONFIG_FILE, {"config": config.to_dict(), "config_hash": config.hash(),
                                           "resume_hash": resume_hash})
        write_json(run_dir / "env.json", environment())
        if point.path is not None:
            distributed.print0(f"resuming from {point.path}" + (f" (dropped {dropped} metrics rows logged past "
                                                                 f"it)" if dropped else ""))
    return point
