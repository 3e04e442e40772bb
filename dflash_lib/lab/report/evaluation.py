"""Notebook 05's figures: what a training run bought, measured on held-out prompts (the loss figures
themselves: `evaluate.loss_figures`).

- `tau_by_step`: acceptance length per checkpoint, the untrained drafter at step 0.
- `acceptance`: the final drafter's histogram of tokens per cycle and its per-position acceptance curve.
- `loss_vs_heldout`: training loss per step (and its running mean) with the held-out loss of each evaluation.
- `benchmark_frame`, `breakdown_frame`, `tau_by_benchmark`: the per-benchmark table (the paper's), the acceptance
  by context length, turn and thinking mode, and tau per benchmark as bars (`dflash_lib.benchmark_report`).
"""

from __future__ import annotations

from typing import Mapping, Sequence

import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from dflash_lib.benchmark_report import BenchmarkRow
from dflash_lib.evaluate import LOSS_WINDOW, DecodeReport, DrafterMeasurement

BENCHMARK_COLUMNS = ("benchmark", "thinking", "prompts", "turns", "tau", "speedup", "tokens_per_s",
                     "baseline_tokens_per_s", "cycles")  # the table's columns, then accepted@k per draft position


def tau_by_step(by_step: Sequence[DrafterMeasurement], block_size: int,
                title: str = "Acceptance length on held-out prompts, per checkpoint") -> go.Figure:
    """tau (tokens per drafting cycle, 1 .. block_size) of each drafter against its training step; step 0 is the
    untrained drafter; served tau beside it where the engine served them (`-p engine vllm`). Dotted: tau = 1
    (every draft rejected: no gain) and tau = block_size (all accepted)."""
    if not by_step:
        raise ValueError("tau_by_step: no drafter measured")
    steps = [r.step for r in by_step]
    taus = [r.tau for r in by_step]
    fig = go.Figure(go.Scatter(x=steps, y=taus, mode="lines+markers+text", name="tau",
                               text=[f"{t:.2f}" for t in taus], textposition="top center",
                               hovertext=[r.drafter for r in by_step]))
    served = [r for r in by_step if r.served_tau is not None]
    if served:
        fig.add_trace(go.Scatter(x=[r.step for r in served], y=[r.served_tau for r in served],
                                 mode="lines+markers", name="served tau (engine)", line_dash="dash",
                                 hovertext=[r.drafter for r in served]))
    for y, label in ((1.0, "no gain (tau 1)"), (float(block_size), f"every draft accepted (tau {block_size})")):
        fig.add_hline(y=y, line_dash="dot", line_color="#888", annotation_text=label,
                      annotation_position="bottom right")
    fig.update_layout(title=title, xaxis_title="training step (0 = untrained)",
                      yaxis_title="tau (tokens per target forward)", template="plotly_white",
                      yaxis_range=[0.5, block_size + 0.4])  # room below tau 1 for its label
    return fig


def acceptance(histogram: Mapping[str, int], per_position: Sequence[float], block_size: int,
               title: str = "Final drafter: tokens per cycle and acceptance by draft position") -> go.Figure:
    """Left: share of drafting cycles that produced k tokens (k-1 drafts accepted + the target's own), k = 1 ..
    block_size. Right: per draft position k, the share of cycles that accepted draft k (falls with k: a draft
    counts only after all before it)."""
    counts = {int(k): int(v) for k, v in histogram.items()}
    total = sum(counts.values())
    if total == 0:
        raise ValueError("acceptance: empty histogram (no drafting cycle)")
    ks = list(range(1, block_size + 1))
    fig = make_subplots(rows=1, cols=2, subplot_titles=("tokens per cycle (share of cycles)",
                                                        "acceptance by draft position"))
    fig.add_trace(go.Bar(x=ks, y=[counts.get(k, 0) / total for k in ks], name="cycles",
                         text=[counts.get(k, 0) for k in ks], textposition="outside"), 1, 1)
    fig.add_trace(go.Scatter(x=list(range(1, len(per_position) + 1)), y=list(per_position), mode="lines+markers",
                             name="accepted"), 1, 2)
    fig.update_xaxes(title_text="tokens per cycle", dtick=1, row=1, col=1)
    fig.update_xaxes(title_text="draft position k", dtick=1, row=1, col=2)
    fig.update_yaxes(range=[0, 1.05], row=1, col=1)
    fig.update_yaxes(range=[0, 1.05], row=1, col=2)
    fig.update_layout(title=title, template="plotly_white", showlegend=False)
    return fig


def loss_vs_heldout(metrics: pd.DataFrame, window: int = LOSS_WINDOW,
                    title: str = "Training loss vs held-out loss") -> go.Figure:
    """Training loss per step (dots), its trailing mean over `window` steps (line) and the held-out loss of each
    evaluation (diamonds): a gap opening between the two is overfitting."""
    rows = metrics.dropna(subset=["loss"])
    fig = go.Figure()
    fig.add_trace(go.Scatter(x=rows["step"], y=rows["loss"], mode="markers", name="training loss (step)",
                             marker=dict(size=5, opacity=0.45, color="#1f77b4")))
    fig.add_trace(go.Scatter(x=rows["step"], y=rows["loss"].rolling(window, min_periods=1).mean(), mode="lines",
                             name=f"training loss (mean of {window})", line=dict(color="#1f77b4", width=2)))
    if "heldout_loss" in metrics:
        held = metrics.dropna(subset=["heldout_loss"])
        fig.add_trace(go.Scatter(x=held["step"], y=held["heldout_loss"], mode="lines+markers",
                                 name="held-out loss", marker=dict(symbol="diamond", size=10, color="#d62728"),
                                 line=dict(color="#d62728", dash="dash")))
    fig.update_layout(title=title, xaxis_title="step", yaxis_title="loss (nats)", template="plotly_white")
    return fig


def benchmark_frame(rows: Sequence[BenchmarkRow]) -> pd.DataFrame:
    """One row per prompt set x thinking mode: BENCHMARK_COLUMNS, then `accepted@k` = the share of cycles that
    accepted draft position k (k = 1 .. B-1)."""
    if not rows:
        raise ValueError("benchmark_frame: no benchmark row (a report written before prompt sets existed?)")
    out = []
    for r in rows:
        row = {c: getattr(r, c) for c in BENCHMARK_COLUMNS}
        row.update({f"accepted@{k}": p for k, p in enumerate(r.per_position, start=1)})
        out.append(row)
    return pd.DataFrame(out)


def breakdown_frame(report: DecodeReport) -> pd.DataFrame:
    """The report's acceptance by turn, by thinking mode and by context length (tokens), one row per slice:
    by (what), slice, cycles, tau."""
    rows = [{"by": what, "slice": s.label, "cycles": s.cycles, "tau": s.tau}
            for what, parts in (("turn", report.by_turn), ("thinking", report.by_thinking),
                                ("context length", report.by_context)) for s in parts]
    return pd.DataFrame(rows, columns=["by", "slice", "cycles", "tau"])


def tau_by_benchmark(rows: Sequence[BenchmarkRow], block_size: int,
                     title: str = "Acceptance length per benchmark") -> go.Figure:
    """tau of each prompt set (a bar per thinking mode), the speedup written on each bar; dotted: tau = 1."""
    if not rows:
        raise ValueError("tau_by_benchmark: no benchmark row")
    fig = go.Figure()
    for mode in dict.fromkeys(r.thinking for r in rows):
        mine = [r for r in rows if r.thinking == mode]
        fig.add_trace(go.Bar(x=[r.benchmark for r in mine], y=[r.tau for r in mine], name=f"thinking {mode}",
                             text=[f"{r.tau:.2f} ({r.speedup:.2f}x)" for r in mine], textposition="outside"))
    fig.add_hline(y=1.0, line_dash="dot", line_color="#888", annotation_text="no gain (tau 1)",
                  annotation_position="bottom right")
    fig.update_layout(title=title, barmode="group", xaxis_title="prompt set", yaxis_title="tau (tokens per cycle)",
                      template="plotly_white", yaxis_range=[0, block_size + 0.4])
    return fig
