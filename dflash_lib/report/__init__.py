"""Plotly figures and report assembly. Every figure is written as self-contained HTML (plotly.js embedded,
no CDN: reports must open offline)."""

from __future__ import annotations

from pathlib import Path

import plotly.graph_objects as go


def write_html(fig: go.Figure, path: str | Path) -> Path:
    """Write `fig` to `path` as a standalone HTML file with plotly.js inlined (opens with no network)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.write_html(path, include_plotlyjs=True, full_html=True)
    return path
