"""Figures of a training run, read from its `metrics.jsonl` (one JSON object per optimizer step; the frame
comes from `rundir.reader.load_metrics`).

The loss of a bucketed run jumps from step to step because consecutive steps draw batches from different length
buckets; colouring each step by its bucket and smoothing per bucket shows that the jumps are the bucket mix, not
instability.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Callable, Mapping

import numpy as np
import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

if TYPE_CHECKING:  # the figures never import the trainer
    from dflash_lib.rundir.records import RunSummary

PALETTE = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22",
           "#17becf")


def smooth_by_bucket(df: pd.DataFrame, column: str = "loss", window: int = 5) -> pd.DataFrame:
    """Per-bucket trailing mean of `column` over that bucket's last `window` steps.

    Returns columns step, bucket, smooth: one row per step, the mean of the steps of the SAME bucket up to and
    including it (so each curve follows one length range).
    """
    if window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    out = df[["step", "bucket", column]].copy()
    out["smooth"] = out.groupby("bucket")[column].transform(lambda s: s.rolling(window, min_periods=1).mean())
    return out[["step", "bucket", "smooth"]]


def steady_window(df: pd.DataFrame) -> tuple[int, int] | None:
    """(first, last) step of the steady-state window the trainer's detector marked, or None if never steady."""
    if "steady" not in df or not df["steady"].any():
        return None
    steady = df.loc[df["steady"].astype(bool), "step"]
    return int(steady.iloc[0]), int(df["step"].iloc[-1])


def loss_by_bucket(df: pd.DataFrame, window: int = 5, title: str = "Loss per step, coloured by bucket") -> go.Figure:
    """Each step's loss as a dot coloured by its bucket, plus each bucket's smoothed curve."""
    fig = go.Figure()
    smooth = smooth_by_bucket(df, "loss", window)
    for i, (bucket, part) in enumerate(df.groupby("bucket")):
        color = PALETTE[i % len(PALETTE)]
        name = "no bucket" if bucket < 0 else f"bucket {bucket}"
        fig.add_trace(go.Scatter(x=part["step"], y=part["loss"], mode="markers", name=name, legendgroup=name,
                                 marker=dict(color=color, size=6, opacity=0.6)))
        s = smooth[smooth["bucket"] == bucket]
        fig.add_trace(go.Scatter(x=s["step"], y=s["smooth"], mode="lines", name=f"{name} (mean of {window})",
                                 legendgroup=name, line=dict(color=color, width=2)))
    fig.update_layout(title=title, xaxis_title="step", yaxis_title="loss", template="plotly_white")
    return fig


def dashboard(df: pd.DataFrame, title: str = "Training run") -> go.Figure:
    """Accuracy, learning rate, Ktok/s with the steady window shaded, queue depths, data wait and ETA vs step."""
    fig = make_subplots(rows=3, cols=2, shared_xaxes=True, vertical_spacing=0.08,
                        subplot_titles=("accuracy (top-1, weighted)", "learning rate", "throughput (Ktok/s, real)",
                                        "queue depths", "data wait (%)", "ETA of the full run (days)"))
    x = df["step"]
    fig.add_trace(go.Scatter(x=x, y=df["acc"], name="acc", mode="lines"), 1, 1)
    fig.add_trace(go.Scatter(x=x, y=df["lr"], name="lr", mode="lines"), 1, 2)
    fig.add_trace(go.Scatter(x=x, y=df["ktok_s"], name="Ktok/s", mode="lines+markers", marker=dict(size=4)), 2, 1)
    win = steady_window(df)
    if win is not None:
        fig.add_vrect(x0=win[0], x1=win[1], fillcolor="#2ca02c", opacity=0.12, line_width=0, row=2, col=1,
                      annotation_text="steady state", annotation_position="top left")
    q_pre = np.array([q if isinstance(q, list) else [q] for q in df["q_pre"]], dtype=float)  # (S, workers)
    for w in range(q_pre.shape[1]):
        fig.add_trace(go.Scatter(x=x, y=q_pre[:, w], name=f"q_pre[{w}]", mode="lines"), 2, 2)
    q_hs = np.array([sum(q) if isinstance(q, list) else q for q in df["q_hs"]], dtype=float)
    fig.add_trace(go.Scatter(x=x, y=q_hs, name="q_hs", mode="lines", line=dict(dash="dash")), 2, 2)
    if "data_wait_pct" in df:
        fig.add_trace(go.Scatter(x=x, y=df["data_wait_pct"], name="data wait %", mode="lines"), 3, 1)
    if "full_run_eta_s" in df:  # (`eta_s` is this invocation's)
        fig.add_trace(go.Scatter(x=x, y=df["full_run_eta_s"] / 86400.0, name="ETA (d)", mode="lines"), 3, 2)
    fig.update_layout(title=title, template="plotly_white", height=900, showlegend=True)
    return fig


def summary_table(summary: RunSummary) -> pd.DataFrame:
    """The scalar entries of a run's summary (its summary.json) as a two-column table (lists and dicts left out)."""
    rows = [(k, v) for k, v in summary.to_json().items() if isinstance(v, (int, float, str, bool)) or v is None]
    return pd.DataFrame(rows, columns=["metric", "value"]).set_index("metric")


class LiveFigure:
    """A metrics sink that redraws the loss-by-bucket figure in a notebook while training runs.

    Pass it to `train(..., sinks=[LiveFigure()])`: every `every` steps, and at most once per `min_interval_s`
    seconds, it rebuilds the figure from the steps logged so far and replaces ONE notebook output in place (an
    IPython display handle); at close it draws the final state. The executed notebook keeps that one output, not a
    copy per redraw. Outside IPython it only collects rows. `clock`: seconds (a test passes its own).
    """

    def __init__(self, every: int = 5, window: int = 5, min_interval_s: float = 10.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if every < 1:
            raise ValueError(f"every must be >= 1, got {every}")
        if min_interval_s < 0:
            raise ValueError(f"min_interval_s must be >= 0, got {min_interval_s}")
        self.every, self.window, self.min_interval_s, self.clock = every, window, min_interval_s, clock
        self.rows: list[dict[str, Any]] = []
        self._handle = None
        self._drawn_at: float | None = None  # clock() of the last redraw
        self._drawn_rows = 0  # rows the last redraw showed

    def log(self, metrics: Mapping[str, Any], step: int) -> None:
        self.rows.append({k: metrics[k] for k in ("step", "loss", "bucket") if k in metrics})
        # each redraw rebuilds the whole figure (O(steps)): a redraw per step would cost O(steps^2) in all
        if step % self.every == 0 and (self._drawn_at is None or self.clock() - self._drawn_at >= self.min_interval_s):
            self._draw()

    def close(self) -> None:
        if self.rows and self._drawn_rows != len(self.rows):
            self._draw()

    def figure(self) -> go.Figure:
        """The figure of the steps logged so far."""
        frame = pd.DataFrame(self.rows).dropna(subset=["loss"])
        return loss_by_bucket(frame, window=self.window, title=f"Loss per step, coloured by bucket "
                                                                f"(live, step {self.rows[-1]['step']})")

    def _draw(self) -> None:
        try:
            from IPython import get_ipython
            from IPython.display import display
        except ImportError:  # pragma: no cover - IPython ships with the notebook stack
            return
        if get_ipython() is None:
            return
        self._drawn_at, self._drawn_rows = self.clock(), len(self.rows)
        # A plotly Figure displays itself (`_ipython_display_`), which ignores display_id: every update would add
        # a new output. Its mime bundle, shown raw, is one output that each update replaces.
        bundle = self.figure()._repr_mimebundle_()
        if self._handle is None:
            self._handle = display(bundle, raw=True, display_id=True)
        else:
            self._handle.update(bundle, raw=True)
