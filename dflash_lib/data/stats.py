"""Length statistics of a token store: counts, totals, percentiles, share above max_len, skips by reason; and
what each sample costs the drafter: its valid anchor positions and drafter query tokens. numpy only."""

from __future__ import annotations

import html
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from dflash_lib.data.readers import LoadReport
from dflash_lib.data.store import MASK_FILE, OFFSETS_FILE

PERCENTILES = (50, 90, 95, 99)  # reported length percentiles (tokens)


@dataclass
class LengthSummary:
    samples: int  # samples in the store
    total_tokens: int  # tokens in the store (after the max_len policy)
    raw_tokens: int  # tokens before truncation (of the samples in the store and the `dropped` ones)
    assistant_tokens: int  # trained tokens (loss_mask = 1)
    assistant_share: float  # assistant_tokens / total_tokens
    mean: float  # tokens per sample (after policy)
    min: int  # tokens
    max: int  # tokens
    percentiles: dict[str, float]  # "p50" ... -> tokens (after policy)
    raw_percentiles: dict[str, float]  # same, before truncation (with the `dropped` ones)
    max_len: int  # the policy's limit (tokens)
    above_max_len: int  # samples whose raw length exceeds max_len (with the `dropped` ones)
    share_above_max_len: float  # above_max_len / (samples + dropped)
    dropped: int = 0  # samples tokenized but left out of the store: no assistant token within max_len

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def summarize_lengths(length: np.ndarray, raw_length: np.ndarray, assistant_tokens: np.ndarray,
                      max_len: int, dropped_raw_length: np.ndarray | None = None) -> LengthSummary:
    """Statistics of per-sample token counts; all arrays (N,) ints, N >= 1. Share above max_len uses raw_length.

    dropped_raw_length: (M,) raw lengths of samples the store left out (no assistant token within max_len);
    they count in the before-truncation figures only (raw_tokens, raw_percentiles, above and share above max_len),
    which describe the corpus, while the others describe what training sees.
    """
    length, raw = np.asarray(length, np.int64), np.asarray(raw_length, np.int64)
    assistant = np.asarray(assistant_tokens, np.int64)
    if not len(length) or not len(length) == len(raw) == len(assistant):
        raise ValueError(f"summarize_lengths needs equal, non-empty arrays; got lengths {len(length)}, "
                         f"raw_length {len(raw)}, assistant_tokens {len(assistant)}")
    dropped = np.zeros(0, np.int64) if dropped_raw_length is None else np.asarray(dropped_raw_length, np.int64)
    total = int(length.sum())
    raw = np.concatenate([raw, dropped])  # (N + M,)
    above = int(np.sum(raw > max_len))
    return LengthSummary(
        samples=len(length), total_tokens=total, raw_tokens=int(raw.sum()), assistant_tokens=int(assistant.sum()),
        assistant_share=float(assistant.sum() / total) if total else 0.0, mean=float(length.mean()),
        min=int(length.min()), max=int(length.max()),
        percentiles={f"p{q}": float(v) for q, v in zip(PERCENTILES, np.percentile(length, PERCENTILES))},
        raw_percentiles={f"p{q}": float(v) for q, v in zip(PERCENTILES, np.percentile(raw, PERCENTILES))},
        max_len=max_len, above_max_len=above, share_above_max_len=above / len(raw), dropped=len(dropped),
    )


def summarize_store(store) -> LengthSummary:
    """summarize_lengths over a TokenStore's lengths table (and its dropped samples), with its own max_len."""
    frame = store.lengths_frame()
    return summarize_lengths(frame["length"].to_numpy(), frame["raw_length"].to_numpy(),
                             frame["assistant_tokens"].to_numpy(), store.meta["settings"]["max_len"],
                             store.dropped_frame()["raw_length"].to_numpy())


def valid_anchor_counts(loss_mask: np.ndarray, offsets: np.ndarray, max_len: int | None = None,
                        chunk_tokens: int = 1 << 24) -> np.ndarray:
    """(N,) int64 valid anchor positions of each sample, the candidates `models.anchors.sample_anchors` draws from.

    Position a (sample-local) is valid when loss_mask[a] and loss_mask[a + 1] are set and a + 1 < length.
    loss_mask: (T,) bool/uint8 of all samples back to back; offsets: (N + 1,) int64, sample i is
    [offsets[i], offsets[i + 1]). max_len (tokens): count each sample as cut to its first max_len tokens, the
    store's "truncate" policy (None: as stored). Vectorised, O(T), memory bounded by `chunk_tokens` per pass.
    """
    off = np.asarray(offsets, dtype=np.int64)
    if off.ndim != 1 or off.size < 1 or off[0] != 0 or (np.diff(off) < 0).any():
        raise ValueError(f"offsets must be (N + 1,) ascending from 0, got shape {off.shape}")
    if len(loss_mask) != off[-1]:
        raise ValueError(f"loss_mask has {len(loss_mask)} tokens, offsets say {int(off[-1])}")
    if max_len is not None and not (isinstance(max_len, (int, np.integer)) and max_len >= 1):
        raise ValueError(f"max_len must be an int >= 1 (tokens) or None, got {max_len!r}")
    start = off[:-1]
    end = off[1:] if max_len is None else np.minimum(off[1:], start + max_len)  # (N,) exclusive
    counts = np.zeros(len(start), dtype=np.int64)
    i = 0
    while i < len(start):  # samples [i, j) in one pass of about chunk_tokens tokens
        j = max(i + 1, int(np.searchsorted(off, off[i] + chunk_tokens, side="right")) - 1)
        j = min(j, len(start))
        lo, hi = int(off[i]), int(off[j])
        m = np.asarray(loss_mask[lo:hi]) != 0  # (t,)
        pair = np.concatenate([[0], np.cumsum(m[:-1] & m[1:], dtype=np.int64)])  # (t,) pairs starting before p
        s, e = start[i:j] - lo, end[i:j] - lo  # (n,) chunk-local
        top = max(hi - lo - 1, 0)  # clamps the indices of empty samples (their count is 0 anyway)
        counts[i:j] = np.where(e > s, pair[np.minimum(np.maximum(e - 1, s), top)] - pair[np.minimum(s, top)], 0)
        i = j
    return counts


def drafter_queries(anchor_counts: np.ndarray, num_anchors: int, block_size: int) -> np.ndarray:
    """(N,) int64 drafter query tokens of each sample per step: min(num_anchors, valid anchors) * block_size."""
    if num_anchors < 1 or block_size < 1:
        raise ValueError(f"num_anchors and block_size must be >= 1, got {num_anchors}, {block_size}")
    return np.minimum(np.asarray(anchor_counts, dtype=np.int64), num_anchors) * block_size


def store_drafter_queries(store, num_anchors: int, block_size: int) -> np.ndarray:
    """drafter_queries of every sample of a TokenStore (read from its memmapped loss mask), (N,) int64."""
    offsets = np.load(store.path / OFFSETS_FILE, mmap_mode="r")  # (N + 1,) int64
    mask = (np.memmap(store.path / MASK_FILE, dtype=np.uint8, mode="r") if int(offsets[-1])
            else np.zeros(0, np.uint8))  # (T,); mmap refuses empty files
    return drafter_queries(valid_anchor_counts(mask, offsets), num_anchors, block_size)


def skip_table(report: LoadReport):
    """pandas DataFrame: one row per outcome (kept, then each skip reason), records and share of records seen."""
    import pandas as pd  # heavy to import; only this frame needs it

    rows = [("kept", report.records_kept)] + sorted(report.skipped.items(), key=lambda kv: -kv[1])
    seen = max(report.records_seen, 1)
    return pd.DataFrame([dict(outcome=name, records=n, share=n / seen) for name, n in rows])


def loss_mask_html(tokenizer, ids: np.ndarray, mask: np.ndarray, max_tokens: int = 400) -> str:
    """One sample's tokens (T,) as HTML: trained tokens (mask 1) highlighted, special tokens in bold, newlines
    kept; the first `max_tokens` only."""
    spans = []
    specials = tokenizer.special_strings
    for tid, m in zip(ids[:max_tokens].tolist(), mask[:max_tokens].tolist()):
        text = tokenizer.decode([tid])
        body = html.escape(text).replace("\n", "&#8629;<br>")
        if text in specials:
            body = f"<b>{body}</b>"
        style = "background:#b7e4c7" if m else "color:#777"
        spans.append(f'<span style="{style}" title="{tid}">{body}</span>')
    more = f"<br>... {len(ids) - max_tokens} more tokens" if len(ids) > max_tokens else ""
    return ('<div style="font-family:monospace;white-space:pre-wrap;line-height:1.5">' + "".join(spans) + more +
            '</div><p><span style="background:#b7e4c7">green</span> = trained (loss mask 1), grey = context</p>')
