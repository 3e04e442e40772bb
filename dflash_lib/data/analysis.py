"""Length statistics of a token store: counts, totals, percentiles, share above max_len, skips by reason."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from dflash_lib.data.readers import LoadReport

PERCENTILES = (50, 90, 95, 99)  # reported length percentiles (tokens)


@dataclass
class LengthSummary:
    samples: int  # samples in the store
    total_tokens: int  # tokens in the store (after the max_len policy)
    raw_tokens: int  # tokens before truncation
    assistant_tokens: int  # trained tokens (loss_mask = 1)
    assistant_share: float  # assistant_tokens / total_tokens
    mean: float  # tokens per sample (after policy)
    min: int  # tokens
    max: int  # tokens
    percentiles: dict[str, float]  # "p50" ... -> tokens (after policy)
    raw_percentiles: dict[str, float]  # same, before truncation
    max_len: int  # the policy's limit (tokens)
    above_max_len: int  # samples whose raw length exceeds max_len
    share_above_max_len: float  # above_max_len / samples

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def summarize_lengths(length: np.ndarray, raw_length: np.ndarray, assistant_tokens: np.ndarray,
                      max_len: int) -> LengthSummary:
    """Statistics of per-sample token counts; all arrays (N,) ints, N >= 1. Share above max_len uses raw_length."""
    length, raw = np.asarray(length, np.int64), np.asarray(raw_length, np.int64)
    assistant = np.asarray(assistant_tokens, np.int64)
    if not len(length) or not len(length) == len(raw) == len(assistant):
        raise ValueError(f"summarize_lengths needs equal, non-empty arrays; got lengths {len(length)}, "
                         f"raw_length {len(raw)}, assistant_tokens {len(assistant)}")
    total = int(length.sum())
    above = int(np.sum(raw > max_len))
    return LengthSummary(
        samples=len(length), total_tokens=total, raw_tokens=int(raw.sum()), assistant_tokens=int(assistant.sum()),
        assistant_share=float(assistant.sum() / total) if total else 0.0, mean=float(length.mean()),
        min=int(length.min()), max=int(length.max()),
        percentiles={f"p{q}": float(v) for q, v in zip(PERCENTILES, np.percentile(length, PERCENTILES))},
        raw_percentiles={f"p{q}": float(v) for q, v in zip(PERCENTILES, np.percentile(raw, PERCENTILES))},
        max_len=max_len, above_max_len=above, share_above_max_len=above / len(length),
    )


def summarize_store(store) -> LengthSummary:
    """summarize_lengths over a TokenStore's lengths table, with the store's own max_len."""
    frame = store.lengths_frame()
    return summarize_lengths(frame["length"].to_numpy(), frame["raw_length"].to_numpy(),
                             frame["assistant_tokens"].to_numpy(), store.meta["settings"]["max_len"])


def skip_table(report: LoadReport):
    """pandas DataFrame: one row per outcome (kept, then each skip reason), records and share of records seen."""
    import pandas as pd

    rows = [("kept", report.records_kept)] + sorted(report.skipped.items(), key=lambda kv: -kv[1])
    seen = max(report.records_seen, 1)
    return pd.DataFrame([dict(outcome=name, records=n, share=n / seen) for name, n in rows])
