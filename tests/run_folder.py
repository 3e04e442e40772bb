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


def one_flip(want: list[dict], weight_ratio: float) -> np.ndarray:
    """(steps,) how much one scored position's argmax flipping at a near tie moves a step's accuracy: its weight
    over the step's weight sum, at most 1 / (scored positions x `weight_ratio`), the smallest position weight over
    the largest (`head_rows` of a one-process `want`: every scored position of the step)."""
    return 1.0 / (metric_column(want, "head_rows") * weight_ratio)


def assert_same_trajectory(got: list[dict], want: list[dict], *, atol: float,
                           exact_keys: tuple[str, ...] = BATCH_KEYS, acc_flips: np.ndarray | None = None) -> None:
    """Steps 1 .. len(want) in both; `exact_keys` equal step by step (the same global batches); losses, accuracies,
    gradient norms and learning rates within `atol` (a NaN only where the other has a NaN); accuracies also by
    `acc_flips` (per step, `one_flip`): two runs that round apart may flip an argmax at a near tie."""
    assert [r["step"] for r in got] == [r["step"] for r in want] == list(range(1, len(want) + 1))
    for key in exact_keys:
        assert [r[key] for r in got] == [r[key] for r in want], key
    for key in ("loss", "acc", "grad_norm", "lr"):
        a, b = metric_column(got, key), metric_column(want, key)
        if key == "acc" and acc_flips is not None:
            gap = np.abs(a - b)
            within = (gap <= atol + acc_flips) | np.isnan(gap)
            assert np.array_equal(np.isnan(a), np.isnan(b)) and bool(within.all()), \
                f"acc: gaps {gap.tolist()} over {atol:.3g} + one flip {acc_flips.tolist()}"
        else:
            np.testing.assert_allclose(a, b, rtol=0, atol=atol, err_msg=key)
