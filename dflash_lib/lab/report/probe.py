"""Figures of notebook 03: throughput per strategy, and predicted vs realized throughput."""

from __future__ import annotations

import pandas as pd
import plotly.graph_objects as go


def throughput_bars(table: pd.DataFrame, title: str = "Real-token throughput per strategy") -> go.Figure:
    """Bars of measured Ktok/s (real tokens) per strategy, labelled with the ratio to sorted batches."""
    fig = go.Figure(go.Bar(x=list(table.index), y=table["ktok_s"],
                           text=[f"{r:.2f}x sorted" for r in table["ratio_to_sorted"]], textposition="outside",
                           marker_color="#4c72b0", name="measured"))
    fig.update_layout(title=title, yaxis_title="Ktok/s (real tokens)", template="plotly_white")
    return fig


def predicted_vs_realized(table: pd.DataFrame, title: str = "Predicted vs realized throughput") -> go.Figure:
    """Each strategy at (realized Ktok/s, predicted Ktok/s) for the padding-only estimate and, when the table has
    it, the held-out cost model; the diagonal is a perfect prediction."""
    fig = go.Figure()
    series = [("padding_only_ktok_s", "padding-only (reference run's estimate)", "square")]
    if "cost_model_ktok_s" in table:
        series.append(("cost_model_ktok_s", "cost model, held out", "circle"))
    for column, name, symbol in series:
        fig.add_trace(go.Scatter(x=table["ktok_s"], y=table[column], mode="markers+text", name=name,
                                 text=list(table.index), textposition="top center",
                                 marker=dict(size=12, symbol=symbol)))
    lo = float(min(table["ktok_s"].min(), *(table[c].min() for c, _, _ in series))) * 0.9
    hi = float(max(table["ktok_s"].max(), *(table[c].max() for c, _, _ in series))) * 1.1
    fig.add_trace(go.Scatter(x=[lo, hi], y=[lo, hi], mode="lines", name="perfect",
                             line=dict(dash="dash", color="#999999")))
    fig.update_layout(title=title, xaxis_title="realized Ktok/s", yaxis_title="predicted Ktok/s",
                      template="plotly_white")
    return fig


def budget_fill_bars(table: pd.DataFrame, title: str = "How full the batches are, and which budget closed them"
                     ) -> go.Figure:
    """Per strategy, bars of its batches' mean token fill and drafter-query fill (`token_fill`, `query_fill`,
    fractions of each budget), each labelled with the share of the batches that budget closed (`bound_tokens`,
    `bound_blocks`); a figure the table lacks is left out."""
    fig = go.Figure()
    for fill, bound, name, color in (("token_fill", "bound_tokens", "token budget", "#4c72b0"),
                                     ("query_fill", "bound_blocks", "block budget", "#dd8452")):
        if fill not in table:
            continue
        closed = table[bound] if bound in table else pd.Series(float("nan"), index=table.index)
        fig.add_trace(go.Bar(x=list(table.index), y=table[fill], name=name, marker_color=color,
                             text=[f"closed {c:.0%}" if pd.notna(c) else "" for c in closed],
                             textposition="outside"))
    fig.update_layout(title=title, barmode="group", yaxis_title="mean fill (fraction of the budget)",
                      yaxis_range=[0, 1.15], template="plotly_white")
    return fig
