"""A trainer run folder read without importing train/: its file names (one definition each; train/ writes them),
its checkpoints' names and manifests (`list_checkpoints`, `read_manifest`), its metrics.jsonl as a frame
(`load_metrics`) and its summary.json (`read_summary`). The records: `rundir.records`; the writer:
`train.checkpoint`, `train.resume`, `train.loop`. docs/runs.md.
"""

from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dflash_lib.rundir.records import RunSummary

if TYPE_CHECKING:
    import pandas as pd

CONFIG_FILE = "config.json"  # {"config", "config_hash", "resume_hash"} of the run
ENV_FILE = "env.json"  # what the run ran on (`rundir.environment`)
METRICS_FILE = "metrics.jsonl"  # one JSON object per step (`train.metrics.StepMetrics`)
SUMMARY_FILE = "summary.json"  # `RunSummary`, written when the run ends
DRAFTER_DIR = "drafter"  # the final drafter, saved when the run ends
CHECKPOINTS = "checkpoints"  # sub-folder of the run folder holding ckpt-<step>/ directories
CHECKPOINT_NAME = re.compile(r"^ckpt-(\d{8,})$")  # a checkpoint folder: ckpt-<step, 8 digits at least>
MANIFEST_FILE = "manifest.json"  # plain JSON metadata and checksums: the completion marker, written last
FORMAT_VERSION = 2  # bump when the on-disk layout changes; loads refuse other versions (2: DCP shards)


class CheckpointError(RuntimeError):
    """A checkpoint could not be written, or one on disk is missing, partial, corrupt or unreadable."""


@dataclass(frozen=True)
class FileEntry:
    sha256: str  # hex digest of the file's bytes
    bytes: int  # file size in bytes


@dataclass(frozen=True)
class Manifest:
    format_version: int  # FORMAT_VERSION of the writer
    step: int  # optimizer steps completed when the checkpoint was taken
    config_hash: str  # the run's resume hash (`resume.resume_config_hash`)
    world_size: int  # number of processes of the run that wrote it (a resume may have another)
    files: dict[str, FileEntry]  # path inside the checkpoint directory ("dcp/__0_0.distcp") -> checksum and size
    meta: dict[str, Any]  # free-form JSON the caller attached (e.g. the config as a dict, epoch)
    created_utc: str  # ISO-8601 time of the save

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=1, sort_keys=True)

    @classmethod
    def from_json(cls, text: str, where: Path) -> Manifest:
        """Parse a manifest, refusing anything malformed with a CheckpointError naming `where`."""
        try:
            raw = json.loads(text)
        except ValueError as e:
            raise CheckpointError(f"{where}: manifest is not valid JSON ({e})") from None
        if not isinstance(raw, dict) or set(raw) != set(_MANIFEST_TYPES):
            raise CheckpointError(f"{where}: manifest is not an object with the keys {sorted(_MANIFEST_TYPES)}")
        for key, typ in _MANIFEST_TYPES.items():
            if type(raw[key]) is not typ:
                raise CheckpointError(f"{where}: manifest field {key!r} must be {typ.__name__}, got {raw[key]!r}")
        if raw["format_version"] != FORMAT_VERSION:
            raise CheckpointError(f"{where}: checkpoint format version {raw['format_version']} is not the "
                                  f"supported version {FORMAT_VERSION}")
        try:
            files = {name: FileEntry(**entry) for name, entry in raw["files"].items()}
        except TypeError:
            raise CheckpointError(f"{where}: manifest file entries are not {{sha256, bytes}} objects") from None
        return cls(**{**raw, "files": files})


_MANIFEST_TYPES = {"format_version": int, "step": int, "config_hash": str, "world_size": int, "files": dict,
                   "meta": dict, "created_utc": str}


def list_checkpoints(ckpt_dir: str | Path) -> list[Path]:
    """The `ckpt-<step>` directories in `ckpt_dir`, oldest step first (temp directories are never listed)."""
    ckpt_dir = Path(ckpt_dir)
    if not ckpt_dir.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in ckpt_dir.iterdir() if (m := CHECKPOINT_NAME.match(p.name)) and p.is_dir()]
    return [p for _, p in sorted(found)]


def read_manifest(path: str | Path) -> Manifest:
    """Parse `<path>/manifest.json`; CheckpointError naming the file when missing or malformed."""
    mpath = Path(path) / MANIFEST_FILE
    try:
        text = mpath.read_bytes().decode("utf-8")
    except FileNotFoundError:
        raise CheckpointError(f"{mpath} is missing (an interrupted or foreign checkpoint)") from None
    except (OSError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{mpath} cannot be read: {e}") from None
    return Manifest.from_json(text, mpath)


def load_metrics(path: str | Path) -> pd.DataFrame:
    """metrics.jsonl (or a run folder holding it) as a frame, one row per step, sorted by step.

    A torn last line (a run killed mid-write) is ignored; any other bad line is an error naming the line.
    """
    import pandas as pd  # heavy to import; the training loop never reads a frame

    path = Path(path)
    if path.is_dir():
        path = path / METRICS_FILE
    lines = path.read_text().splitlines()
    rows = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as e:
            if n == len(lines):
                break
            raise ValueError(f"{path}:{n}: not JSON ({e})") from None
    if not rows:
        raise ValueError(f"{path}: no steps logged")
    return pd.DataFrame(rows).sort_values("step").reset_index(drop=True)


def read_summary(run_dir: str | Path) -> RunSummary:
    """The run's summary.json; FileNotFoundError when the run has not finished, ValueError naming the missing and
    unknown keys when another version of the trainer wrote it."""
    return RunSummary.from_json(Path(run_dir) / SUMMARY_FILE)
