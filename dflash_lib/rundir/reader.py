"""A trainer run folder read without importing train/: its file names (one definition each; train/ writes them),
whether a folder is a training run (`recorded_run`, `is_training_run`), its metrics.jsonl as a frame
(`load_metrics`) and its summary.json (`read_summary`). Its records: `rundir.records`; its checkpoints:
`rundir.checkpoints`; the writer: `train.resume`, `train.loop`, `train.checkpoint`. docs/runs.md.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dflash_lib.rundir.checkpoints import list_checkpoints
from dflash_lib.rundir.records import RunSummary

if TYPE_CHECKING:
    import pandas as pd

CONFIG_FILE = "config.json"  # {"config", "config_hash", "resume_hash"} of the run
ENV_FILE = "env.json"  # what the run ran on (`rundir.environment`)
METRICS_FILE = "metrics.jsonl"  # one JSON object per step (`train.metrics.StepMetrics`)
SUMMARY_FILE = "summary.json"  # `RunSummary`, written when the run ends
DRAFTER_DIR = "drafter"  # the final drafter, saved when the run ends
CHECKPOINTS = "checkpoints"  # sub-folder of the run folder holding ckpt-<step>/ directories
HELDOUT_FILE = "heldout.json"  # the held-out split of the run's samples (`data.split`)
# Everything the trainer writes into a run folder (and the temp names of its atomic writes): what a training run
# owns, and all that `fresh` deletes.
RUN_OUTPUTS = frozenset({CONFIG_FILE, ENV_FILE, METRICS_FILE, HELDOUT_FILE, SUMMARY_FILE, DRAFTER_DIR, "wandb",
                         CHECKPOINTS})


def recorded_run(run_dir: Path) -> dict[str, Any] | None:
    """run_dir/config.json as the trainer wrote it ({"config", "config_hash", "resume_hash"}); None when it is
    absent, unreadable or another program's (an exported drafter's config.json, say)."""
    try:
        doc = json.loads((run_dir / CONFIG_FILE).read_text())
    except (OSError, ValueError):
        return None
    if not (isinstance(doc, dict) and isinstance(doc.get("config"), dict) and isinstance(doc.get("resume_hash"), str)):
        return None
    return doc


def is_training_run(run_dir: str | Path) -> bool:
    """True when `run_dir` holds a training run: a config.json the trainer wrote, or a checkpoint."""
    run_dir = Path(run_dir)
    return recorded_run(run_dir) is not None or bool(list_checkpoints(run_dir / CHECKPOINTS))


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
