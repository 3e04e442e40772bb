"""One-call checkpoint saves and loads for the tests: `save_checkpoint` is `start_save(...).wait()`, and
`load_latest` is `find_latest` then `load_checkpoint`, as a resume finds its checkpoint and export reads it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from dflash_lib.rundir.checkpoints import load_checkpoint
from dflash_lib.train.checkpoint import find_latest, start_save


def save_checkpoint(ckpt_dir: str | Path, state: dict[str, Any], step: int, **kwargs: Any) -> Path:
    """Write `state` as `<ckpt_dir>/ckpt-<step:08d>/` and commit it (`start_save`'s keyword arguments)."""
    return start_save(ckpt_dir, state, step, **kwargs).wait()


def load_latest(ckpt_dir: str | Path, config_hash: str,
                map_location: str | torch.device = "cpu") -> tuple[dict[str, Any], Path] | None:
    """(the whole state of the newest checkpoint that verifies, as plain tensors; its directory), or None when
    `ckpt_dir` holds no checkpoint."""
    found = find_latest(ckpt_dir, config_hash)
    if found is None:
        return None
    state, _ = load_checkpoint(found[1], map_location)
    return state, found[1]
