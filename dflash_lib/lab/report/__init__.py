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


def save_figure(fig: go.Figure, directory: str | Path, name: str) -> Path:
    """Write `fig` as `<name>.html` (self-contained, for people) and `<name>.json` (plotly JSON, so a later report
    can embed the same figure without recomputing it). Returns the HTML path."""
    directory = Path(directory)
    fig.write_json(directory / f"{name}.json")
    return write_html(fig, directory / f"{name}.html")
