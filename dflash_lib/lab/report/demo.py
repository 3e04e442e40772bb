"""The demo's one page: `runs/<id>_demo/report.html` (figures, summary tables, links to every run) and the
`summary.json` beside it: {"strategies": {strategy: figures of the throughput probe}, "evaluation": what the
training run bought, from notebook 05 (EVALUATION_KEYS: training loss first -> last, tau of the untrained and
the trained drafter on held-out prompts, speedup against plain greedy decoding)}.

The page is self-contained: plotly.js is inlined once (with the first figure) and every other figure is a div
that reuses it, so it opens offline and from a copied folder. Links are relative (`../<run folder>/...`), so the
whole `runs/` folder can move.
"""

from __future__ import annotations

import datetime as _dt
import html
import json
import math
import numbers
import os
from pathlib import Path
from typing import Any, Mapping, Sequence
from urllib.parse import quote

import plotly.graph_objects as go
import plotly.io as pio

from dflash_lib.evaluate.served import range_text
from dflash_lib.rundir.records import BUDGET_FIGURES

STRATEGIES = ("sorted", "random", "bucketed", "packed")  # every demo measures these four
SUMMARY_KEYS = ("ktok_s", "ratio_to_sorted", "predicted_efficiency", "realized_efficiency", "co_batch_recurrence")
_FRACTION_KEYS = ("predicted_efficiency", "realized_efficiency", "co_batch_recurrence")  # each within [0, 1]
_RATIO_TOLERANCE = 0.01  # ratio_to_sorted may differ this much (relative) from ktok_s / sorted ktok_s (rounding)
EVALUATION_KEYS = ("loss_first", "loss_last", "tau_untrained", "tau_trained", "speedup")  # finite numbers
EVALUATION_EXTRA = ("heldout_loss_last", "tau_by_step", "loss_window", "steps", "prompts", "max_new_tokens",
                    "min_new_tokens", "block_size", "tokens_per_s", "baseline_tokens_per_s", "export",
                    *BUDGET_FIGURES, "benchmarks", "sampled", "doctor", "best_step", "best_drafter", "best_by",
                    "best_tau", "served_tau_by_step", "served", "sampled_served")  # kept when notebook 05 has them
# (BUDGET_FIGURES: the trained run's batch fill; benchmarks: the final drafter's rows per prompt set,
# `benchmark_report.BenchmarkRow`; sampled: the final drafter at `sampled_temperature`, SAMPLED_KEYS and its own
# benchmark rows; doctor: the serving doctor on the export, `doctor.DoctorReport.to_json` with its `lines`;
# served, sampled_served: the final drafter served by the engine, `evaluate.served.ServedReport`, greedy and sampled)
SERVED_ROW_KEYS = ("name", "tau", "served_tau", "per_position", "served_per_position", "served_tokens_per_s",
                   "plain_tokens_per_s", "served_speedup", "ok")  # each served row's, shown
BENCHMARK_KEYS = ("benchmark", "thinking", "prompts", "turns", "tau", "speedup", "tokens_per_s",
                  "baseline_tokens_per_s", "cycles")  # each benchmark row's, shown in this order
SAMPLED_KEYS = ("temperature", "top_p", "tau", "speedup", "tokens_per_s", "baseline_tokens_per_s")  # finite numbers
DOCTOR_KEYS = ("ok", "summary", "lines")  # the doctor record's, shown: verdict, count line, one line per rule
_FIGURE_HEIGHT_PX = 460  # height of a figure whose layout sets none (a div with height 100% would collapse)

FigureLike = go.Figure | str | Path  # a Figure, a plotly JSON file (embedded) or an HTML file (linked)


class DemoReportError(ValueError):
    """The summary or a figure handed to the report is missing something or malformed."""


def write_demo_summary(demo_dir: str | Path, per_strategy: Mapping[str, Mapping[str, Any]],
                       evaluation: Mapping[str, Any] | None = None) -> Path:
    """Validate and write `demo_dir/summary.json` = {"strategies": {strategy: {key: number}}, "evaluation": {...}}.

    Every strategy of STRATEGIES must be present with every key of SUMMARY_KEYS as a finite number; efficiencies
    and recurrence lie in [0, 1], ktok_s > 0, and ratio_to_sorted agrees with ktok_s / sorted's ktok_s.
    Extra strategies and extra keys are kept. `evaluation` (None: left out) is checked by `validate_evaluation`.
    """
    summary: dict[str, Any] = {"strategies": validate_summary(per_strategy)}
    if evaluation is not None:
        summary["evaluation"] = validate_evaluation(evaluation)
    path = Path(demo_dir) / "summary.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(summary, indent=2, default=_json_scalar) + "\n")
    os.replace(tmp, path)  # a reader never sees half a file
    return path


def validate_summary(per_strategy: Mapping[str, Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    """The checks of `write_demo_summary`, returning a plain-dict copy; raises DemoReportError naming the field."""
    if not isinstance(per_strategy, Mapping):
        raise DemoReportError(f"summary must map strategy -> {{key: value}}, got {type(per_strategy).__name__}")
    missing = [s for s in STRATEGIES if s not in per_strategy]
    if missing:
        raise DemoReportError(f"summary: strategies {missing} missing (need {list(STRATEGIES)}, "
                              f"got {sorted(per_strategy)})")
    out: dict[str, dict[str, Any]] = {}
    for name, row in per_strategy.items():
        row = _record(f"summary[{name!r}]", row, SUMMARY_KEYS)
        for key in SUMMARY_KEYS:
            value = row[key]
            if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
                raise DemoReportError(f"summary[{name!r}][{key!r}] must be a finite number, got {value!r}")
            row[key] = float(value)  # numpy scalars too
        for key in _FRACTION_KEYS:
            if not 0.0 <= row[key] <= 1.0:
                raise DemoReportError(f"summary[{name!r}][{key!r}] must lie in [0, 1], got {row[key]!r}")
        if row["ktok_s"] <= 0:
            raise DemoReportError(f"summary[{name!r}]['ktok_s'] must be > 0 (thousand tokens/s), got {row['ktok_s']!r}")
        out[name] = row
    sorted_ktok = out["sorted"]["ktok_s"]
    for name, row in out.items():
        expected = row["ktok_s"] / sorted_ktok
        if abs(row["ratio_to_sorted"] - expected) > _RATIO_TOLERANCE * expected:
            raise DemoReportError(f"summary[{name!r}]['ratio_to_sorted'] = {row['ratio_to_sorted']!r} but ktok_s / "
                                  f"sorted ktok_s = {expected:.4f}")
    return out


def demo_evaluation(notebook05: Mapping[str, Any]) -> dict[str, Any]:
    """The demo's evaluation entry from notebook 05's summary.json: EVALUATION_KEYS and EVALUATION_EXTRA."""
    return {k: notebook05[k] for k in (*EVALUATION_KEYS, *EVALUATION_EXTRA) if k in notebook05}


def _record(where: str, value: Any, keys: Sequence[str]) -> dict[str, Any]:
    """A plain-dict copy of `value`; DemoReportError naming `where` unless it is a mapping holding every key."""
    if not isinstance(value, Mapping):
        raise DemoReportError(f"{where} must be a mapping of key -> value, got {type(value).__name__}")
    absent = [k for k in keys if k not in value]
    if absent:
        raise DemoReportError(f"{where}: keys {absent} missing (need {list(keys)})")
    return dict(value)


def _finite(where: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise DemoReportError(f"{where} must be a finite number, got {value!r}")
    return float(value)


def validate_evaluation(evaluation: Mapping[str, Any]) -> dict[str, Any]:
    """A plain-dict copy of the evaluation entry; raises DemoReportError naming the field. EVALUATION_KEYS must be
    finite numbers, each tau >= 1 (a cycle always yields the target's own token), speedup > 0; tau_by_step, when
    present, maps steps to finite taus >= 1 and holds the untrained drafter at step "0"."""
    out = _record("evaluation", evaluation, EVALUATION_KEYS)
    for key in EVALUATION_KEYS:
        out[key] = _finite(f"evaluation[{key!r}]", evaluation[key])
    for key in ("tau_untrained", "tau_trained"):
        if out[key] < 1.0:
            raise DemoReportError(f"evaluation[{key!r}] must be >= 1 (tokens per target forward), got {out[key]!r}")
    if out["speedup"] <= 0:
        raise DemoReportError(f"evaluation['speedup'] must be > 0, got {out['speedup']!r}")
    if "tau_by_step" in out:
        by_step = out["tau_by_step"]
        if not isinstance(by_step, Mapping) or "0" not in by_step:
            raise DemoReportError(f"evaluation['tau_by_step'] must map steps to tau with the untrained drafter at "
                                  f"'0', got {by_step!r}")
        out["tau_by_step"] = {str(k): _finite(f"evaluation['tau_by_step'][{k!r}]", v) for k, v in by_step.items()}
    for key in BUDGET_FIGURES:  # None: the run had no such figure
        if out.get(key) is not None:
            out[key] = _finite(f"evaluation[{key!r}]", out[key])
    if "benchmarks" in out:
        out["benchmarks"] = _benchmark_rows(out["benchmarks"])
    if out.get("sampled") is not None:
        out["sampled"] = _sampled(out["sampled"])
    if out.get("doctor") is not None:
        out["doctor"] = _doctor(out["doctor"])
    if "served_tau_by_step" in out:
        out["served_tau_by_step"] = {str(k): _finite(f"evaluation['served_tau_by_step'][{k!r}]", v)
                                     for k, v in _record("evaluation['served_tau_by_step']",
                                                         out["served_tau_by_step"], ()).items()}
    for key in ("served", "sampled_served"):
        if out.get(key) is not None:
            out[key] = _served(out[key], f"evaluation[{key!r}]")
    return out


def _served(served: Any, where: str) -> dict[str, Any]:
    """A served report's copy: temperature, version, rows (SERVED_ROW_KEYS each) and lines (strings)."""
    out = _record(where, served, ("version", "temperature", "rows", "lines"))
    if not isinstance(out["rows"], list) or not isinstance(out["lines"], list):
        raise DemoReportError(f"{where}: rows and lines must be lists")
    out["rows"] = [_record(f"{where}['rows'][{i}]", r, SERVED_ROW_KEYS) for i, r in enumerate(out["rows"])]
    return out


def _sampled(sampled: Any) -> dict[str, Any]:
    """The sampled evaluation's copy: SAMPLED_KEYS finite, temperature > 0, tau >= 1, speedup > 0; its benchmark
    rows checked as the greedy ones."""
    out = _record("evaluation['sampled']", sampled, SAMPLED_KEYS)
    for key in SAMPLED_KEYS:
        out[key] = _finite(f"evaluation['sampled'][{key!r}]", sampled[key])
    if out["temperature"] <= 0 or out["tau"] < 1.0 or out["speedup"] <= 0:
        raise DemoReportError(f"evaluation['sampled']: temperature must be > 0, tau >= 1 and speedup > 0, got "
                              f"temperature {out['temperature']!r}, tau {out['tau']!r}, speedup {out['speedup']!r}")
    if "benchmarks" in out:
        out["benchmarks"] = _benchmark_rows(out["benchmarks"], "evaluation['sampled']['benchmarks']")
    return out


def _doctor(doctor: Any) -> dict[str, Any]:
    """The doctor record's copy: `ok` a bool, `summary` a string, `lines` a list of strings."""
    out = _record("evaluation['doctor']", doctor, DOCTOR_KEYS)
    lines = out["lines"]
    if not isinstance(out["ok"], bool) or not isinstance(out["summary"], str) or not (
            isinstance(lines, Sequence) and not isinstance(lines, str) and all(isinstance(x, str) for x in lines)):
        raise DemoReportError("evaluation['doctor'] must hold ok (a bool), summary (a string) and lines (a list of "
                              f"strings), got ok {out['ok']!r}, summary {out['summary']!r}, lines {lines!r}")
    return out


def _benchmark_rows(rows: Any, name: str = "evaluation['benchmarks']") -> list[dict[str, Any]]:
    """Plain-dict copies of the per-benchmark rows; DemoReportError naming the row and field: every BENCHMARK_KEYS
    present, tau >= 1, speedup > 0, the speeds finite."""
    if not isinstance(rows, Sequence) or isinstance(rows, str):
        raise DemoReportError(f"{name} must be a list of rows, got {type(rows).__name__}")
    out = []
    for i, row in enumerate(rows):
        where = f"{name}[{i}]"
        got = _record(where, row, BENCHMARK_KEYS)
        for key in ("tau", "speedup", "tokens_per_s", "baseline_tokens_per_s"):
            got[key] = _finite(f"{where}[{key!r}]", row[key])
        if got["tau"] < 1.0 or got["speedup"] <= 0:
            raise DemoReportError(f"{where}: tau must be >= 1 and speedup > 0, got tau {got['tau']!r}, speedup "
                                  f"{got['speedup']!r}")
        out.append(got)
    return out


def _json_scalar(value: Any) -> Any:
    """numpy scalars in extra columns become plain numbers; anything else is refused by name."""
    if hasattr(value, "item") and getattr(value, "ndim", 1) == 0:
        return value.item()
    raise TypeError(f"summary value {value!r} of type {type(value).__name__} is not JSON serialisable")


def build_demo_report(demo_dir: str | Path, runs: Mapping[str, str | Path], summary: Mapping[str, Mapping[str, Any]],
                      figures: Sequence[FigureLike], title: str = "DFlash Lab demo",
                      evaluation: Mapping[str, Any] | None = None, data_note: str = "") -> Path:
    """Write `demo_dir/report.html` and return its path.

    runs: {label (e.g. notebook stem): run folder}; each is linked (folder, executed notebooks, HTML files in it).
    summary: {strategy: {column: value}}; the SUMMARY_KEYS columns come first, then any others in given order.
    figures: plotly Figures or plotly JSON files (embedded, plotly.js inlined once) and HTML files (linked).
    evaluation: notebook 05's figures (`validate_evaluation`), shown as a second table; None = no such section.
    data_note: one sentence above that table saying what the drafter trained on and against which target.
    """
    demo_dir = Path(demo_dir)
    demo_dir.mkdir(parents=True, exist_ok=True)
    embedded, linked = _split_figures(figures)
    parts = [_head(title),
             f"<h1>{_e(title)}</h1>",
             f'<p class="meta">Written {_e(_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"))} '
             f"in {_e(demo_dir.name)}. Self-contained: opens offline; links are relative to this folder.</p>",
             "<h2>Summary</h2>", _summary_table(summary)]
    if evaluation is not None:
        parts += ["<h2>Evaluation: what training bought</h2>"]
        parts += [f'<p class="meta">{_e(data_note)}</p>'] if data_note else []
        checked = validate_evaluation(evaluation)
        parts += [_evaluation_table(checked)]
        if checked.get("benchmarks"):
            parts += ["<h3>Per benchmark (final drafter)</h3>",
                      _benchmark_table(checked["benchmarks"], checked.get("sampled"))]
        if checked.get("doctor"):
            parts += [_doctor_section(checked["doctor"])]
        for key in ("served", "sampled_served"):
            if checked.get(key):
                parts += [_served_section(checked[key])]
    parts += ["<h2>Runs</h2>", _run_links(demo_dir, runs), _own_files(demo_dir)]
    if embedded:
        parts.append("<h2>Figures</h2>")
    for i, fig in enumerate(embedded):
        heading = _figure_title(fig) or f"Figure {i + 1}"
        height = fig.layout.height or _FIGURE_HEIGHT_PX
        div = pio.to_html(fig, full_html=False, include_plotlyjs=(i == 0), include_mathjax=False,
                          config={"displaylogo": False}, default_height=f"{height}px",
                          default_width="100%")
        parts.append(f'<section class="figure"><h3>{_e(heading)}</h3>{div}</section>')
    if linked:
        items = "".join(f'<li><a href="{_e(_rel(demo_dir, p))}">{_e(p.name)}</a></li>' for p in linked)
        parts.append(f"<h2>More figures</h2><ul>{items}</ul>")
    parts.append("</body></html>")
    page = "\n".join(parts)
    path = demo_dir / "report.html"
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(page, encoding="utf-8")
    os.replace(tmp, path)
    return path


def _split_figures(figures: Sequence[FigureLike]) -> tuple[list[go.Figure], list[Path]]:
    embedded: list[go.Figure] = []
    linked: list[Path] = []
    for i, fig in enumerate(figures):
        if isinstance(fig, go.Figure):
            embedded.append(fig)
            continue
        if not isinstance(fig, (str, Path)):
            raise DemoReportError(f"figure {i}: expected a plotly Figure or a path, got {type(fig).__name__}")
        path = Path(fig)
        if not path.is_file():
            raise DemoReportError(f"figure {i}: file not found: {path}")
        if path.suffix == ".json":
            try:
                embedded.append(pio.read_json(path))
            except (ValueError, KeyError) as e:
                raise DemoReportError(f"figure {i}: {path} is not a plotly figure JSON: {e}") from None
        elif path.suffix in (".html", ".htm"):
            linked.append(path)
        else:
            raise DemoReportError(f"figure {i}: {path} must be a plotly .json (embedded) or an .html file (linked)")
    return embedded, linked


def _figure_title(fig: go.Figure) -> str:
    text = fig.layout.title.text if fig.layout.title is not None else None
    return str(text) if text else ""


def _summary_table(summary: Mapping[str, Mapping[str, Any]]) -> str:
    if not summary:
        raise DemoReportError("summary is empty: the report needs at least one strategy row")
    columns = [k for k in SUMMARY_KEYS if any(k in row for row in summary.values())]
    for row in summary.values():
        columns += [k for k in row if k not in columns]
    head = "".join(f"<th>{_e(c)}</th>" for c in ["strategy", *columns])
    body = []
    for name, row in summary.items():
        cells = "".join(f'<td class="num">{_e(_fmt(c, row.get(c)))}</td>' for c in columns)
        body.append(f"<tr><th>{_e(name)}</th>{cells}</tr>")
    return f'<table class="summary"><thead><tr>{head}</tr></thead><tbody>{"".join(body)}</tbody></table>'


def _evaluation_table(ev: Mapping[str, Any]) -> str:
    """Training loss first -> last, held-out loss, tau untrained -> trained (and per checkpoint), speedup."""
    held = ev.get("heldout_loss_last")
    window = ev.get("loss_window")
    prompts = " on held-out prompts"
    if "prompts" in ev and "max_new_tokens" in ev:
        exact = ev.get("min_new_tokens", 0) >= ev["max_new_tokens"]  # the end of turn masked: every answer that long
        prompts = (f" on {ev['prompts']} held-out prompts, {'exactly' if exact else 'up to'} {ev['max_new_tokens']} "
                   "new tokens each")
    rows = [
        ("training loss, first -> last", f"{ev['loss_first']:.3f} -> {ev['loss_last']:.3f} nats"
         + (f" (means of {window} steps)" if window else "")),
        ("held-out loss, last evaluation", "-" if held is None else f"{held:.3f} nats"),
        ("tau, untrained -> trained drafter", f"{ev['tau_untrained']:.3f} -> {ev['tau_trained']:.3f} tokens per "
         f"target forward{prompts}"),
    ]
    if "tau_by_step" in ev:
        rows.append(("tau by training step", ", ".join(f"{k}: {v:.3f}" for k, v in ev["tau_by_step"].items())))
    if "served_tau_by_step" in ev:
        rows.append(("served tau by training step (vLLM)",
                     ", ".join(f"{k}: {v:.3f}" for k, v in ev["served_tau_by_step"].items())))
    if "best_step" in ev and "best_by" in ev and "best_tau" in ev:
        rows.append((f"best drafter (by {ev['best_by']})",
                     f"step {ev['best_step']} ({ev.get('best_drafter', '')}): {ev['best_tau']:.3f}"))
    speed = f"{ev['speedup']:.2f}x"
    if "tokens_per_s" in ev and "baseline_tokens_per_s" in ev:
        speed += f" ({ev['tokens_per_s']:.1f} vs {ev['baseline_tokens_per_s']:.1f} tokens/s)"
    rows.append(("speedup vs plain greedy decoding (wall clock)", speed))
    hot = ev.get("sampled")
    if hot:
        rows.append((f"sampled at temperature {hot['temperature']:g} (top_p {hot['top_p']:g}), final drafter",
                     f"tau {hot['tau']:.3f}; {hot['speedup']:.2f}x vs plain sampling ({hot['tokens_per_s']:.1f} vs "
                     f"{hot['baseline_tokens_per_s']:.1f} tokens/s)"))
    fill = _fill_text(ev)
    if fill:
        rows.append(("batch fill of the training run (means over its steps)", fill))
    body = "".join(f"<tr><th>{_e(k)}</th><td>{_e(v)}</td></tr>" for k, v in rows)
    return f'<table class="summary evaluation"><tbody>{body}</tbody></table>'


def _benchmark_table(rows: Sequence[Mapping[str, Any]], sampled: Mapping[str, Any] | None = None) -> str:
    """The paper's table: one row per prompt set x thinking mode, BENCHMARK_KEYS as columns; with a sampled
    evaluation, its tau and speedup of the same set and mode as two more columns ("-" where it has no such row)."""
    formats = {"tau": "{:.3f}", "speedup": "{:.2f}x", "tokens_per_s": "{:.1f}", "baseline_tokens_per_s": "{:.1f}"}
    heads = list(BENCHMARK_KEYS)
    hot: dict[tuple[str, str], Mapping[str, Any]] | None = None
    if sampled and sampled.get("benchmarks"):
        hot = {(r["benchmark"], r["thinking"]): r for r in sampled["benchmarks"]}
        heads += [f"tau T={sampled['temperature']:g}", f"speedup T={sampled['temperature']:g}"]
    body = []
    for r in rows:
        cells = [formats.get(k, "{}").format(r[k]) for k in BENCHMARK_KEYS]
        if hot is not None:
            h = hot.get((r["benchmark"], r["thinking"]))
            cells += [f"{h['tau']:.3f}", f"{h['speedup']:.2f}x"] if h else ["-", "-"]
        body.append("<tr>" + "".join(f'<td class="num">{_e(c)}</td>' for c in cells) + "</tr>")
    head = "".join(f"<th>{_e(k)}</th>" for k in heads)
    return f'<table class="summary benchmarks"><thead><tr>{head}</tr></thead><tbody>{"".join(body)}</tbody></table>'


def _doctor_section(doctor: Mapping[str, Any]) -> str:
    """The serving doctor on the export: its verdict and count line, then one line per rule."""
    verdict = "passes" if doctor["ok"] else "FAILS"
    lines = "\n".join(doctor["lines"])
    return (f"<h3>Serving doctor on the export: {_e(verdict)}</h3><p>{_e(doctor['summary'])} "
            "(python -m dflash_lib doctor EXPORT --target TARGET, docs/serving.md)</p>"
            f'<pre class="doctor">{_e(lines)}</pre>')


def _served_section(served: Mapping[str, Any]) -> str:
    """The final drafter served by the engine: per prompt set, our tau and the engine's, its tokens/s with and
    without the drafter, per-position acceptance ours / served; then the PASS/FAIL lines."""
    head = ("prompt set", "tau (ours)", "served tau", "served tokens/s", "plain tokens/s", "served speedup",
            "speedup per round", "per position ours / served", "verdict")
    rows = []
    for r in served["rows"]:
        plain, speed = r["plain_tokens_per_s"], r["served_speedup"]
        pos = " ".join(f"{a:.2f}/{b:.2f}" for a, b in zip(r["per_position"], r["served_per_position"]))
        rows.append((r["name"], f"{r['tau']:.3f}", f"{r['served_tau']:.3f}", f"{r['served_tokens_per_s']:.1f}",
                     "-" if plain is None else f"{plain:.1f}", "-" if speed is None else f"{speed:.2f}x",
                     range_text(r.get("speedup_range")), pos, "PASS" if r["ok"] else "FAIL"))
    if served.get("speedup") is not None:
        rows.append(("every set", "", "", "", "", f"{served['speedup']:.2f}x", range_text(served.get("speedup_range")),
                     "", ""))
    table = ("<table class=\"summary served\"><thead><tr>" + "".join(f"<th>{_e(h)}</th>" for h in head)
             + "</tr></thead><tbody>" + "".join("<tr>" + "".join(f"<td>{_e(c)}</td>" for c in row) + "</tr>"
                                                  for row in rows) + "</tbody></table>")
    return (f"<h3>Served by vLLM {_e(served['version'])} at temperature {served['temperature']:g} (final "
            "drafter)</h3><p>The same prompts sent as token ids; acceptance from the engine's own counters "
            "(docs/serving.md, \"The engine in the loop\"). Speedups: each set decoded in timed rounds on each "
            "engine, one prompt at a time, tokens/s of the median round, the range over rounds.</p>" + table
            + f'<pre class="doctor">{_e(chr(10).join(served["lines"]))}</pre>')


def _fill_text(ev: Mapping[str, Any]) -> str:
    """The trained run's BUDGET_FIGURES in words, those it has: how full its batches were in each budget and the
    share of them each budget closed; "" with none."""
    parts = [f"{ev[key]:.2f} {what}" for key, what in (("token_fill", "of the token budget"),
                                                        ("query_fill", "of the block budget (drafter queries)"))
             if ev.get(key) is not None]
    closed = [f"{ev[key]:.2f} by the {what}" for key, what in (("bound_tokens", "token budget"),
                                                                ("bound_blocks", "block budget"))
              if ev.get(key) is not None]
    return ", ".join(parts) + ("; closed " + ", ".join(closed) if closed else "")


def _fmt(column: str, value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return str(value)
    if isinstance(value, int):
        return f"{value:,}"
    if not math.isfinite(value):
        return str(value)
    return f"{value:.2f}" if column == "ktok_s" else f"{value:.3f}" if abs(value) < 100 else f"{value:,.1f}"


def _run_links(demo_dir: Path, runs: Mapping[str, str | Path]) -> str:
    if not runs:
        return "<p>No run folders were recorded.</p>"
    items = []
    for label, run in runs.items():
        run = Path(run)
        if not run.is_dir():
            raise DemoReportError(f"run {label!r}: folder not found: {run}")
        files = sorted(p for p in run.iterdir() if p.is_file() and p.suffix in (".ipynb", ".html"))
        links = "".join(f' &middot; <a href="{_e(_rel(demo_dir, p))}">{_e(p.name)}</a>' for p in files)
        items.append(f'<li><b>{_e(label)}</b>: <a href="{_e(_rel(demo_dir, run))}/">{_e(run.name)}/</a>{links}</li>')
    return f'<ul class="runs">{"".join(items)}</ul>'


def _own_files(demo_dir: Path) -> str:
    """Links to the records already in the demo folder (summary.json, chain.json, ...)."""
    files = sorted(p for p in demo_dir.iterdir() if p.is_file() and p.suffix == ".json")
    if not files:
        return ""
    links = " &middot; ".join(f'<a href="{_e(quote(p.name))}">{_e(p.name)}</a>' for p in files)
    return f'<p class="meta">In this folder: {links}</p>'


def _rel(demo_dir: Path, target: Path) -> str:
    """A relative URL from the demo folder to `target` (POSIX separators, each segment percent-safe)."""
    rel = os.path.relpath(Path(target).resolve(), Path(demo_dir).resolve())
    return "/".join(quote(part) for part in Path(rel).parts)


def _e(text: Any) -> str:
    return html.escape(str(text), quote=True)


def _head(title: str) -> str:
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{_e(title)}</title>
<style>
body {{ font-family: system-ui, sans-serif; margin: 2em auto; max-width: 72em; padding: 0 1em; color: #222; }}
table.summary {{ border-collapse: collapse; }}
table.summary th, table.summary td {{ border: 1px solid #ccc; padding: 0.3em 0.7em; }}
table.summary td.num {{ text-align: right; font-variant-numeric: tabular-nums; }}
p.meta {{ color: #666; }}
pre.doctor {{ white-space: pre-wrap; font-size: 0.85em; }}
section.figure {{ margin-bottom: 2em; }}
</style></head><body>"""
