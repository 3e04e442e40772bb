"""`python -m dflash_lib export SRC OUT_DIR`: a trainer run folder (its newest checkpoint, else its drafter/), one
checkpoint (ckpt-<step>/) or a saved drafter written in the serving layout (`export_source`), into a folder that is
new or empty and never a run's own files (`check_destination`). The format itself: `models.export`;
docs/serving.md, "Export for serving".
"""

from __future__ import annotations

from pathlib import Path

import torch

from dflash_lib.config import ConfigError
from dflash_lib.models.export import CONFIG_FILE, README_FILE, WEIGHTS_FILE, export_folder, export_run_weights
from dflash_lib.rundir.checkpoints import MANIFEST_FILE, CheckpointError, list_checkpoints, load_checkpoint
from dflash_lib.rundir.reader import RUN_OUTPUTS, is_training_run


def export_checkpoint(ckpt: Path, out_dir: str | Path, dtype: torch.dtype = torch.bfloat16) -> Path:
    """One trainer checkpoint's drafter in the serving layout (`export_run_weights`: the run's config is in
    the checkpoint's manifest)."""
    try:
        state, manifest = load_checkpoint(ckpt)
    except CheckpointError as e:
        raise ConfigError(str(e)) from None
    if "config" not in manifest.meta or "drafter" not in state:
        raise ConfigError(f"checkpoint {ckpt}: no run config in its manifest or no drafter weights in its state")
    return export_run_weights(manifest.meta["config"], state["drafter"], out_dir, dtype,
                              f"{ckpt} (step {manifest.step})", f"checkpoint {ckpt}")


def check_destination(out_dir: str | Path, src: str | Path, force: bool = False) -> None:
    """Refuse (ConfigError naming the folder) to export into `out_dir` when it is not a new or empty folder,
    unless `force`; and, even with `force`, when it is the source `src`, a training run folder or one of its own
    outputs (`rundir.reader.RUN_OUTPUTS`: its config.json, drafter/, checkpoints/, ...) or a checkpoint."""
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"destination {out} exists and is not a folder")
    where = out.resolve()
    if where == Path(src).resolve():
        raise ConfigError(f"destination {out} is the source itself: give another folder")
    for inner, folder in zip([where, *where.parents], where.parents):
        if inner.name in RUN_OUTPUTS and is_training_run(folder):
            raise ConfigError(f"destination {out} is {inner.name} of the training run {folder}: give a folder "
                              f"outside its own files")
    if is_training_run(where) or (where / MANIFEST_FILE).is_file():
        raise ConfigError(f"destination {out} is a training run folder or a checkpoint: give another folder")
    names = sorted(p.name for p in out.iterdir()) if out.is_dir() else []
    if names and not force:
        shown = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
        raise ConfigError(f"destination {out} is not empty (it holds {shown}): give a new or empty folder, or "
                          f"--force to replace its {CONFIG_FILE}, {WEIGHTS_FILE} and {README_FILE}")


def export_source(src: str | Path, out_dir: str | Path, dtype: torch.dtype = torch.bfloat16,
                  force: bool = False) -> Path:
    """`python -m dflash_lib export SRC OUT_DIR`: SRC a trainer run folder (its newest checkpoint, else its
    drafter/), one checkpoint folder (ckpt-<step>/), or a saved/exported drafter folder. No target weight is
    loaded: the shapes come from the run's config (and a local target's config.json). OUT_DIR must be new or
    empty unless `force`, and is never a run folder's own files (`check_destination`)."""
    src = Path(src)
    if not src.is_dir():
        raise ConfigError(f"{src} is not a folder")
    check_destination(out_dir, src, force)
    if (src / MANIFEST_FILE).is_file():
        return export_checkpoint(src, out_dir, dtype)
    ckpts = list_checkpoints(src / "checkpoints")
    if ckpts:
        return export_checkpoint(ckpts[-1], out_dir, dtype)
    return export_folder(src, out_dir, dtype)
