"""Figures of notebook 02 (bucket boundaries and batching strategies): the lengths histogram with the chosen
edges, efficiency vs k, and efficiency vs randomness with the Pareto frontier. Each function returns a plotly
Figure; `write_bucket_figures` saves them as self-contained HTML with `write_html`."""

from __future__ import annotations

from pathlib import Path
from typing import Mapping, Sequence

import numpy as np
import plotly.graph_objects as go

from dflash_lib.lab.report import write_html
from dflash_lib.plan.buckets import BucketPlan
from dflash_lib.plan.sampler.frontier import StrategyPoint, pareto_front

EDGE_STYLES = ("solid", "dash", "dot", "dashdot")  # one line style per edge set


def lengths_histogram(lengths: Sequence[int] | np.ndarray, edges: Mapping[str, Sequence[int]], *,
                      bins: int = 120, title: str = "Sample lengths and bucket edges") -> go.Figure:
    """Histogram of sample lengths (tokens; `bins` equal-width bins) with each named edge set drawn as
    vertical lines (the first set solid, the others dashed)."""
    x = np.asarray(lengths)
    counts, bounds = np.histogram(x, bins=bins, range=(0, int(x.max())))
    fig = go.Figure(go.Bar(x=(bounds[:-1] + bounds[1:]) / 2, y=counts, width=np.diff(bounds), name="samples",
                           marker_color="#8da0cb", hovertemplate="%{x:.0f} tokens: %{y} samples<extra></extra>"))
    palette = ("#d62728", "#2ca02c", "#9467bd", "#ff7f0e")
    for n, (name, es) in enumerate(edges.items()):
        style, color = EDGE_STYLES[n % len(EDGE_STYLES)], palette[n % len(palette)]
        for i, e in enumerate(es):
            fig.add_trace(go.Scatter(x=[e, e], y=[0, counts.max()], mode="lines", name=name, legendgroup=name,
                                     showlegend=i == 0, line=dict(color=color, dash=style, width=1.5),
                                     hovertemplate=f"{name}: edge {e} tokens<extra></extra>"))
    fig.update_layout(title=title, xaxis_title="length (tokens)", yaxis_title="samples", bargap=0,
                      template="plotly_white")
    return fig


def efficiency_vs_k(curves: Mapping[str, Sequence[BucketPlan]], *, packing: float | None = None,
                    chosen: BucketPlan | None = None,
                    title: str = "Predicted padding efficiency vs number of buckets") -> go.Figure:
    """One line per method (e.g. optimal, seed, equal_length): plan.efficiency against plan.k. `packing`
    draws packing's efficiency as the ceiling; `chosen` marks the plan picked."""
    fig = go.Figure()
    for name, plans in curves.items():
        fig.add_trace(go.Scatter(x=[p.k for p in plans], y=[p.efficiency for p in plans], mode="lines+markers",
                                 name=name, hovertemplate="k=%{x}: %{y:.4f}<extra>" + name + "</extra>"))
    if packing is not None:
        fig.add_hline(y=packing, line_dash="dot", annotation_text=f"packing {packing:.3f}")
    if chosen is not None:
        fig.add_trace(go.Scatter(x=[chosen.k], y=[chosen.efficiency], mode="markers", name=f"chosen k={chosen.k}",
                                 marker=dict(size=14, symbol="star", color="#d62728")))
    fig.update_layout(title=title, xaxis_title="buckets k", yaxis_title="real / padded tokens",
                      template="plotly_white")
    return fig


def efficiency_vs_randomness(points: Sequence[StrategyPoint],
                             title: str = "Padding efficiency vs randomness") -> go.Figure:
    """Each strategy at (pair co-batch recurrence, efficiency), colour = |lag-1 correlation|; circles are
    ours, squares baselines. The line joins the strategies no other beats on efficiency AND recurrence; a
    star marks every strategy on the 3-axis Pareto frontier (|lag-1| included)."""
    front3 = {p.name for p in pareto_front(points)}
    order = sorted(points, key=lambda p: (p.recurrence, -p.efficiency))
    front2, best = [], -np.inf
    for p in order:  # 2-D frontier: more efficient than every point with lower recurrence
        if p.efficiency > best:
            front2.append(p)
            best = p.efficiency
    fig = go.Figure(go.Scatter(x=[max(p.recurrence, 1e-5) for p in front2], y=[p.efficiency for p in front2],
                               mode="lines", line=dict(color="#999999", dash="dash"), name="frontier",
                               hoverinfo="skip"))
    fig.add_trace(go.Scatter(
        x=[max(p.recurrence, 1e-5) for p in points], y=[p.efficiency for p in points], mode="markers+text",
        text=[p.name + (" *" if p.name in front3 else "") for p in points], textposition="top center",
        marker=dict(size=13, symbol=["square" if p.baseline else "circle" for p in points],
                    color=[abs(p.lag1) for p in points], colorscale="Viridis", cmin=0, cmax=1,
                    colorbar=dict(title="|lag-1|"), line=dict(width=1, color="#333333")),
        customdata=[[p.lag1, p.tail_kl, p.steps] for p in points], name="strategies",
        hovertemplate=("%{text}<br>efficiency %{y:.4f}<br>recurrence %{x:.4f}<br>lag-1 %{customdata[0]:.3f}"
                       "<br>tail KL %{customdata[1]:.4f}<br>steps %{customdata[2]}<extra></extra>")))
    fig.update_layout(title=title, xaxis_title="pair co-batch recurrence, epoch e -> e+1 (log; lower = more random)",
                      yaxis_title="padding efficiency", xaxis_type="log", template="plotly_white")
    return fig


def write_bucket_figures(out_dir: str | Path, figures: Mapping[str, go.Figure]) -> dict[str, Path]:
    """Write each figure to out_dir/<name>.html (self-contained); returns name -> path."""
    return {name: write_html(fig, Path(out_dir) / f"{name}.html") for name, fig in figures.items()}
