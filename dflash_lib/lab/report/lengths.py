"""Plotly figures of sample lengths (tokens): a log-x histogram with its CDF, and the long tail."""

from __future__ import annotations

import numpy as np
import plotly.graph_objects as go

CDF_POINTS = 400  # points drawn on the CDF line (the full array is summarised, not plotted)


def length_histogram(lengths: np.ndarray, max_len: int | None = None, bins: int = 60,
                     title: str = "Sample lengths") -> go.Figure:
    """Histogram of `lengths` (N,) tokens on log-spaced bins and a log x axis, CDF on a second y axis.

    Bars are drawn as a step line so that they keep their true width on the log axis. A dashed line marks
    `max_len` when given.
    """
    x = np.asarray(lengths, np.float64)
    if not len(x):
        raise ValueError("length_histogram needs at least one length")
    lo, hi = max(1.0, float(x.min())), max(2.0, float(x.max()))
    edges = np.geomspace(lo, hi * 1.0001, bins + 1)  # (bins+1,) so the maximum falls inside the last bin
    counts, _ = np.histogram(np.clip(x, lo, None), edges)  # (bins,)
    sorted_x = np.sort(x)
    pick = np.unique(np.linspace(0, len(x) - 1, min(CDF_POINTS, len(x))).astype(np.int64))
    fig = go.Figure()
    fig.add_trace(go.Scatter(x=np.repeat(edges, 2)[1:-1], y=np.repeat(counts, 2), mode="lines", fill="tozeroy",
                             name="samples per bin", line=dict(width=1)))
    fig.add_trace(go.Scatter(x=sorted_x[pick], y=(pick + 1) / len(x), mode="lines", name="CDF", yaxis="y2",
                             line=dict(width=2)))
    if max_len:
        share = float(np.mean(x > max_len))
        fig.add_trace(go.Scatter(x=[max_len, max_len], y=[0, 1], yaxis="y2", mode="lines",
                                 name=f"max_len={max_len} ({share:.1%} above)", line=dict(dash="dash", width=1)))
    fig.update_layout(title=title, xaxis=dict(type="log", title="tokens per sample (log)"),
                      yaxis=dict(title="samples"),
                      yaxis2=dict(title="cumulative share", overlaying="y", side="right", range=[0, 1.02]),
                      legend=dict(orientation="h", y=-0.2), template="plotly_white")
    return fig


def length_tail(lengths: np.ndarray, max_len: int | None = None, quantile: float = 0.9, bins: int = 50,
                title: str = "Longest samples") -> go.Figure:
    """Linear histogram of the samples at or above the `quantile` of `lengths` (N,) tokens."""
    x = np.asarray(lengths, np.float64)
    if not len(x):
        raise ValueError("length_tail needs at least one length")
    if not 0.0 <= quantile < 1.0:
        raise ValueError(f"quantile must be in [0, 1), got {quantile}")
    cut = float(np.quantile(x, quantile))
    tail = x[x >= cut]
    fig = go.Figure(go.Histogram(x=tail, nbinsx=bins, name=f"lengths >= p{quantile * 100:g} ({cut:.0f} tokens)"))
    if max_len:
        n_above = int(np.sum(x > max_len))
        fig.add_vline(x=max_len, line_dash="dash", annotation_text=f"max_len={max_len}: {n_above} samples above")
    fig.update_layout(title=f"{title}: {len(tail)} samples >= p{quantile * 100:g} = {cut:.0f} tokens",
                      xaxis_title="tokens per sample", yaxis_title="samples", template="plotly_white",
                      showlegend=True)
    return fig


def length_before_after(before: np.ndarray, after: np.ndarray, max_len: int | None = None, bins: int = 60,
                        title: str = "Tokens per sample, before and after regeneration") -> go.Figure:
    """CDFs of two length arrays (tokens) on a log x axis, with their medians: how regenerated answers move
    the samples between buckets."""
    fig = go.Figure()
    for name, arr in (("before (source answers)", before), ("after (target's answers)", after)):
        x = np.sort(np.asarray(arr, np.float64))
        if not len(x):
            raise ValueError(f"length_before_after: no {name.split()[0]} lengths")
        pick = np.unique(np.linspace(0, len(x) - 1, min(CDF_POINTS, len(x))).astype(np.int64))
        fig.add_trace(go.Scatter(x=x[pick], y=(pick + 1) / len(x), mode="lines",
                                 name=f"{name}: {len(x)} samples, median {np.median(x):.0f}"))
    if max_len:
        fig.add_vline(x=max_len, line_dash="dash", annotation_text=f"max_len={max_len}")
    fig.update_layout(title=title, xaxis=dict(type="log", title="tokens per sample (log)"),
                      yaxis=dict(title="cumulative share", range=[0, 1.02]), template="plotly_white",
                      legend=dict(orientation="h", y=-0.2))
    return fig
