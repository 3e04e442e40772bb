"""What a training run folder's metrics.jsonl holds, read the way the tests compare runs: its rows, a metric's
column, and "the same trajectory" (the same global batches, the same losses) that resume and multi-rank runs must
keep."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np

BATCH_KEYS = ("step", "epoch", "real_tokens", "padded_tokens", "skipped_tokens", "bucket")  # equal: the same batches


def metrics_rows(run_dir: Path) -> list[dict]:
    """Every row of `run_dir`/metrics.jsonl, in order."""
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def metric_column(rows: list[dict], key: str) -> np.ndarray:
    """(len(rows),) the rows' `key`, a null (a skipped step's NaN, written as null) as NaN."""
    return np.array([math.nan if r[key] is None else r[key] for r in rows], dtype=float)


def assert_same_trajectory(got: list[dict], want: list[dict], *, atol: float,
                           exact_keys: tuple[str, ...] = BATCH_KEYS) -> None:
    """Steps 1 .. len(want) in both; `exact_keys` equal step by step (the same global batches); losses, accuracies,
    gradient norms and learning rates within `atol` (a NaN only where the other has a NaN)."""
    assert [r["step"] for r in got] == [r["step"] for r in want] == list(range(1, len(want) + 1))
    for key in exact_keys:
        assert [r[key] for r in got] == [r[key] for r in want], key
    for key in ("loss", "acc", "grad_norm", "lr"):
        np.testing.assert_allclose(metric_column(got, key), metric_column(want, key), rtol=0, atol=atol, err_msg=key)
