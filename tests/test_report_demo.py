"""The demo report page and summary.json: self-contained, linked, validated, escaped."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from urllib.parse import unquote

import numpy as np
import plotly.graph_objects as go
import pytest

from dflash_lib.lab.report.demo import (EVALUATION_KEYS, STRATEGIES, SUMMARY_KEYS, DemoReportError, build_demo_report,
                                        demo_evaluation, write_demo_summary)
from html_check import external_references

PLOTLY_JS_BANNER = "plotly.js v"  # the licence header at the top of the inlined bundle


def summary_rows() -> dict[str, dict[str, float]]:
    ktok = {"sorted": 32.0, "random": 12.0, "bucketed": 25.1, "packed": 30.4}
    return {s: dict(ktok_s=k, ratio_to_sorted=k / ktok["sorted"], predicted_efficiency=0.868,
                    realized_efficiency=0.78, co_batch_recurrence=0.01 * (i + 1), steps=100 + i)
            for i, (s, k) in enumerate(ktok.items())}


@pytest.fixture
def demo_tree(tmp_path: Path) -> dict:
    """runs/ with two notebook run folders, a demo folder, and figures of every accepted kind."""
    runs = tmp_path / "runs"
    r1, r2 = runs / "20260101T000000Z_01_length_analysis", runs / "20260101T000100Z_03_throughput probe"
    for run, nb in ((r1, "01_length_analysis.ipynb"), (r2, "03_throughput.ipynb")):
        run.mkdir(parents=True)
        (run / nb).write_text("{}")
    (r2 / "throughput.html").write_text("<html></html>")
    json_fig = r1 / "lengths.json"
    go.Figure(go.Histogram(x=[1, 2, 2, 3]), layout_title_text="Lengths").write_json(json_fig)
    figures = [go.Figure(go.Bar(x=list(STRATEGIES), y=[32, 12, 25, 30]), layout_title_text="Ktok/s <by strategy>"),
               go.Figure(go.Scatter(x=[1, 2, 3], y=[1, 4, 9])), json_fig, r2 / "throughput.html"]
    return dict(demo=runs / "20260101T000200Z_demo", runs={"01_length_analysis": r1, "03_throughput": r2},
                figures=figures)


def test_report_is_one_self_contained_page_with_every_figure(demo_tree):
    path = build_demo_report(demo_tree["demo"], demo_tree["runs"], summary_rows(), demo_tree["figures"])
    page = path.read_text()
    assert path == demo_tree["demo"] / "report.html"
    assert page.count(PLOTLY_JS_BANNER) == 1  # plotly.js inlined exactly once
    assert len(re.findall(r'class="plotly-graph-div"', page)) == 3  # two Figures + the JSON file, embedded
    assert external_references(page) == []
    assert not re.search(r"<script[^>]*\ssrc\s*=", page)  # every script is inline
    assert "MathJax.js" not in page


def test_report_links_every_run_folder_and_notebook_relatively(demo_tree):
    demo = demo_tree["demo"]
    page = build_demo_report(demo, demo_tree["runs"], summary_rows(), demo_tree["figures"]).read_text()
    hrefs = re.findall(r'href="([^"]+)"', page)
    for run in demo_tree["runs"].values():
        folder = [h for h in hrefs if unquote(h).rstrip("/") == f"../{run.name}"]
        assert folder, f"no link to {run.name} in {hrefs}"
        assert (demo / unquote(folder[0])).resolve() == run.resolve()
    notebooks = [h for h in hrefs if h.endswith(".ipynb")]
    assert {unquote(h) for h in notebooks} == {"../20260101T000000Z_01_length_analysis/01_length_analysis.ipynb",
                                              "../20260101T000100Z_03_throughput probe/03_throughput.ipynb"}
    for h in notebooks + [h for h in hrefs if h.endswith("throughput.html")]:
        assert not h.startswith(("/", "file:")) and (demo / unquote(h)).is_file(), h
    assert "%20" in "".join(hrefs)  # a space in a folder name is percent-encoded, not left raw


def test_summary_table_shows_every_strategy_and_column(demo_tree):
    page = build_demo_report(demo_tree["demo"], demo_tree["runs"], summary_rows(), []).read_text()
    table = page[page.index('<table class="summary">'): page.index("</table>")]
    header = re.findall(r"<th>([^<]+)</th>", table.split("</thead>")[0])
    assert header == ["strategy", *SUMMARY_KEYS, "steps"]
    rows = re.findall(r"<tr><th>(\w+)</th>(.*?)</tr>", table.split("<tbody>")[1])
    assert [r[0] for r in rows] == list(STRATEGIES)
    cells = dict((name, re.findall(r'<td class="num">([^<]*)</td>', rest)) for name, rest in rows)
    assert cells["bucketed"][:2] == ["25.10", f"{25.1 / 32:.3f}"]
    assert cells["random"][-1] == "101"
    assert PLOTLY_JS_BANNER not in page  # no figures: no plotly.js either


def test_text_is_escaped(demo_tree):
    rows = summary_rows()
    rows["<script>alert(1)</script>"] = {**rows["sorted"], "note": "a & b"}
    page = build_demo_report(demo_tree["demo"], {"<i>run</i>": next(iter(demo_tree["runs"].values()))}, rows,
                             demo_tree["figures"][:1], title='Demo "x" <b>').read_text()
    assert "<script>alert(1)" not in page and "&lt;script&gt;alert(1)&lt;/script&gt;" in page
    assert "a &amp; b" in page and "&lt;i&gt;run&lt;/i&gt;" in page
    assert "<title>Demo &quot;x&quot; &lt;b&gt;</title>" in page
    assert "<h3>Ktok/s &lt;by strategy&gt;</h3>" in page


def test_bad_figures_and_runs_are_refused_by_name(demo_tree, tmp_path):
    build = lambda runs, figs: build_demo_report(demo_tree["demo"], runs, summary_rows(), figs)  # noqa: E731
    with pytest.raises(DemoReportError, match="figure 1: file not found: .*missing.json"):
        build(demo_tree["runs"], [go.Figure(), tmp_path / "missing.json"])
    (tmp_path / "fig.png").write_bytes(b"\x89PNG")
    with pytest.raises(DemoReportError, match=r"figure 0: .*fig.png must be a plotly .json"):
        build(demo_tree["runs"], [tmp_path / "fig.png"])
    (tmp_path / "notfig.json").write_text('{"rows": [1, 2]}')
    with pytest.raises(DemoReportError, match="figure 0: .*notfig.json is not a plotly figure JSON"):
        build(demo_tree["runs"], [tmp_path / "notfig.json"])
    with pytest.raises(DemoReportError, match="figure 0: expected a plotly Figure or a path, got dict"):
        build(demo_tree["runs"], [{"data": []}])
    with pytest.raises(DemoReportError, match="run '02_buckets': folder not found"):
        build({"02_buckets": tmp_path / "nowhere"}, [])


def test_external_references_finds_every_kind_of_outside_link():
    page = """<html><head><link rel="stylesheet" href="//fonts.example.com/a.css">
    <style>@import 'https://x.example/b.css'; body { background: url("http://x.example/bg.png"); }</style>
    <script src="https://cdn.plot.ly/plotly-2.min.js"></script></head><body>
    <img srcset="a.png 1x, https://img.example/b.png 2x"><div style="background:url(ftp://x/y)"></div>
    <a href="../run/01.ipynb">ok</a><a href="#top">ok</a><img src="data:image/png;base64,AA==">
    <script>var s = "https://not.an.attribute/";</script></body></html>"""
    assert sorted(external_references(page)) == sorted([
        "//fonts.example.com/a.css", "https://x.example/b.css", "http://x.example/bg.png",
        "https://cdn.plot.ly/plotly-2.min.js", "https://img.example/b.png", "ftp://x/y"])


def test_write_demo_summary_round_trips_and_the_report_links_it(tmp_path):
    rows = summary_rows()
    path = write_demo_summary(tmp_path / "demo", rows)
    assert path == tmp_path / "demo" / "summary.json"
    assert json.loads(path.read_text()) == {"strategies": rows}
    numpy_rows = {s: {k: (np.int64(v) if isinstance(v, int) else np.float64(v)) for k, v in r.items()}
                  for s, r in rows.items()}  # what a notebook computing with numpy hands over
    assert json.loads(write_demo_summary(tmp_path / "demo", numpy_rows).read_text()) == {"strategies": rows}
    both = json.loads(write_demo_summary(tmp_path / "demo", rows, evaluation_entry()).read_text())
    assert both == {"strategies": rows, "evaluation": evaluation_entry()}
    page = build_demo_report(tmp_path / "demo", {}, rows, []).read_text()
    assert '<a href="summary.json">summary.json</a>' in page


@pytest.mark.parametrize("edit, message", [
    (lambda s: s.pop("packed"), r"strategies \['packed'\] missing"),
    (lambda s: s["random"].pop("co_batch_recurrence"), r"summary\['random'\]: keys \['co_batch_recurrence'\] missing"),
    (lambda s: s["bucketed"].update(ktok_s=math.nan), r"summary\['bucketed'\]\['ktok_s'\] must be a finite number"),
    (lambda s: s["sorted"].update(realized_efficiency="0.9"), r"\['realized_efficiency'\] must be a finite number"),
    (lambda s: s["packed"].update(predicted_efficiency=1.2), r"\['predicted_efficiency'\] must lie in \[0, 1\]"),
    (lambda s: s["random"].update(ratio_to_sorted=0.5), r"summary\['random'\]\['ratio_to_sorted'\] = 0.5 but"),
    (lambda s: s["sorted"].update(ktok_s=0.0), r"summary\['sorted'\]\['ktok_s'\] must be > 0"),
])
def test_write_demo_summary_refuses_incomplete_or_wrong_rows(tmp_path, edit, message):
    rows = summary_rows()
    edit(rows)
    with pytest.raises(DemoReportError, match=message):
        write_demo_summary(tmp_path, rows)
    assert not (tmp_path / "summary.json").exists()


def evaluation_entry() -> dict:
    """What notebook 05's summary.json hands the demo (demo_evaluation keeps these keys)."""
    return dict(loss_first=11.9, loss_last=4.25, loss_window=5, heldout_loss_last=4.5, tau_untrained=1.0,
                tau_trained=2.375, tau_by_step={"0": 1.0, "20": 1.75, "40": 2.125, "60": 2.375}, speedup=1.42,
                tokens_per_s=71.0, baseline_tokens_per_s=50.0, prompts=8, max_new_tokens=64, steps=60,
                token_fill=0.6875, query_fill=0.994, bound_tokens=0.0125, bound_blocks=0.9875)


def test_demo_evaluation_keeps_the_figures_the_report_shows():
    notebook05 = {**evaluation_entry(), "histogram": {"1": 3}, "prompt_indices": [4, 2], "export_files": ["x"]}
    assert demo_evaluation(notebook05) == evaluation_entry()


def test_report_shows_the_evaluation_loss_tau_and_speedup(demo_tree):
    page = build_demo_report(demo_tree["demo"], demo_tree["runs"], summary_rows(), [],
                             evaluation=evaluation_entry()).read_text()
    table = page[page.index('<table class="summary evaluation">'):]
    table = table[:table.index("</table>")]
    rows = dict(re.findall(r"<tr><th>([^<]+)</th><td>([^<]*)</td></tr>", table))
    assert rows["training loss, first -&gt; last"] == "11.900 -&gt; 4.250 nats (means of 5 steps)"
    assert rows["held-out loss, last evaluation"] == "4.500 nats"
    assert rows["tau, untrained -&gt; trained drafter"].startswith("1.000 -&gt; 2.375 tokens per target forward on 8 "
                                                                  "held-out prompts, up to 64 new tokens each")
    assert rows["tau by training step"] == "0: 1.000, 20: 1.750, 40: 2.125, 60: 2.375"
    assert rows["speedup vs plain greedy decoding (wall clock)"] == "1.42x (71.0 vs 50.0 tokens/s)"
    assert rows["batch fill of the training run (means over its steps)"] == (
        "0.69 of the token budget, 0.99 of the block budget (drafter queries); closed 0.01 by the token budget, "
        "0.99 by the block budget")
    no_blocks = {**evaluation_entry(), "query_fill": None, "bound_blocks": None}  # a run without a block budget
    partial = build_demo_report(demo_tree["demo"], demo_tree["runs"], summary_rows(), [],
                                evaluation=no_blocks).read_text()
    assert ("<tr><th>batch fill of the training run (means over its steps)</th><td>0.69 of the token budget; closed "
            "0.01 by the token budget</td></tr>") in partial
    assert page.index("<h2>Summary</h2>") < page.index("<h2>Evaluation: what training bought</h2>") < page.index(
        "<h2>Runs</h2>")
    plain = build_demo_report(demo_tree["demo"], demo_tree["runs"], summary_rows(), []).read_text()
    assert "Evaluation" not in plain


@pytest.mark.parametrize("edit, message", [
    (lambda e: e.pop("tau_trained"), r"evaluation: keys \['tau_trained'\] missing"),
    (lambda e: e.update(loss_last=math.nan), r"evaluation\['loss_last'\] must be a finite number"),
    (lambda e: e.update(tau_untrained=0.5), r"evaluation\['tau_untrained'\] must be >= 1"),
    (lambda e: e.update(speedup=0.0), r"evaluation\['speedup'\] must be > 0"),
    (lambda e: e.update(tau_by_step={"20": 1.5}), r"untrained drafter at '0'"),
    (lambda e: e["tau_by_step"].update({"40": None}), r"evaluation\['tau_by_step'\]\['40'\] must be a finite"),
    (lambda e: e.update(token_fill="full"), r"evaluation\['token_fill'\] must be a finite number"),
])
def test_a_wrong_evaluation_is_refused_by_name(tmp_path, edit, message):
    entry = evaluation_entry()
    edit(entry)
    with pytest.raises(DemoReportError, match=message):
        write_demo_summary(tmp_path, summary_rows(), entry)
    assert not (tmp_path / "summary.json").exists()
    assert set(EVALUATION_KEYS) <= set(evaluation_entry())


def _benchmark_rows() -> list[dict]:
    row = dict(benchmark="humaneval", thinking="off", prompts=2, turns=2, tau=3.25, speedup=1.9, tokens_per_s=95.0,
               baseline_tokens_per_s=50.0, cycles=20, per_position=[0.9, 0.7, 0.5], histogram={"4": 20})
    return [row, {**row, "benchmark": "mt-bench", "turns": 4, "tau": 2.5, "speedup": 1.25, "cycles": 40}]


def test_report_shows_the_per_benchmark_table(demo_tree, tmp_path):
    entry = {**evaluation_entry(), "benchmarks": _benchmark_rows()}
    assert demo_evaluation({**entry, "by_turn": []})["benchmarks"] == _benchmark_rows()
    page = build_demo_report(demo_tree["demo"], demo_tree["runs"], summary_rows(), [], evaluation=entry).read_text()
    table = page[page.index('<table class="summary benchmarks">'):]
    table = table[:table.index("</table>")]
    assert re.findall(r"<th>([^<]+)</th>", table) == ["benchmark", "thinking", "prompts", "turns", "tau", "speedup",
                                                     "tokens_per_s", "baseline_tokens_per_s", "cycles"]
    cells = [re.findall(r'<td class="num">([^<]*)</td>', r) for r in table.split("<tr>")[2:]]
    assert cells == [["humaneval", "off", "2", "2", "3.250", "1.90x", "95.0", "50.0", "20"],
                     ["mt-bench", "off", "2", "4", "2.500", "1.25x", "95.0", "50.0", "40"]]
    bad = {**entry, "benchmarks": [{**_benchmark_rows()[0], "tau": 0.5}]}
    with pytest.raises(DemoReportError, match=r"evaluation\['benchmarks'\]\[0\]: tau must be >= 1"):
        write_demo_summary(tmp_path, summary_rows(), bad)
    with pytest.raises(DemoReportError, match=r"evaluation\['benchmarks'\]\[0\]: keys \['speedup'\] missing"):
        write_demo_summary(tmp_path, summary_rows(), {**entry, "benchmarks": [
            {k: v for k, v in _benchmark_rows()[0].items() if k != "speedup"}]})


def _sampled() -> dict:
    return dict(temperature=1.0, top_p=1.0, tau=1.75, speedup=1.1, tokens_per_s=55.0, baseline_tokens_per_s=50.0,
                benchmarks=[{**_benchmark_rows()[1], "tau": 1.5, "speedup": 0.95}])


def _doctor() -> dict:
    return dict(ok=True, summary="12 of 13 rules pass; 1 N/A (chat_template)",
                lines=["PASS architecture: architectures ['DFlashDraftModel']", "N/A chat_template: a <mapped> one"])


def test_report_shows_the_sampled_evaluation_and_the_doctor(demo_tree, tmp_path):
    entry = {**evaluation_entry(), "benchmarks": _benchmark_rows(), "sampled": _sampled(), "doctor": _doctor()}
    assert demo_evaluation({**entry, "histogram": {}}) == entry
    page = build_demo_report(demo_tree["demo"], demo_tree["runs"], summary_rows(), [], evaluation=entry).read_text()
    rows = dict(re.findall(r"<tr><th>([^<]+)</th><td>([^<]*)</td></tr>", page))
    assert rows["sampled at temperature 1 (top_p 1), final drafter"] == (
        "tau 1.750; 1.10x vs plain sampling (55.0 vs 50.0 tokens/s)")
    table = page[page.index('<table class="summary benchmarks">'):]
    table = table[:table.index("</table>")]
    assert re.findall(r"<th>([^<]+)</th>", table)[-2:] == ["tau T=1", "speedup T=1"]
    cells = [re.findall(r'<td class="num">([^<]*)</td>', r)[-2:] for r in table.split("<tr>")[2:]]
    assert cells == [["-", "-"], ["1.500", "0.95x"]]  # humaneval has no sampled row; mt-bench's
    assert "<h3>Serving doctor on the export: passes</h3><p>12 of 13 rules pass; 1 N/A (chat_template)" in page
    assert ("PASS architecture: architectures [&#x27;DFlashDraftModel&#x27;]\nN/A chat_template: a &lt;mapped&gt; "
            "one</pre>") in page
    failing = build_demo_report(demo_tree["demo"], demo_tree["runs"], summary_rows(), [],
                                evaluation={**entry, "doctor": {**_doctor(), "ok": False}}).read_text()
    assert "Serving doctor on the export: FAILS" in failing
    for bad, message in (({**_sampled(), "temperature": 0.0}, r"evaluation\['sampled'\]: temperature must be > 0"),
                         ({**_sampled(), "tau": math.nan}, r"evaluation\['sampled'\]\['tau'\] must be a finite"),
                         ({k: v for k, v in _sampled().items() if k != "top_p"}, r"keys \['top_p'\] missing"),
                         ({**_sampled(), "benchmarks": [{**_benchmark_rows()[0], "tau": 0.5}]},
                          r"evaluation\['sampled'\]\['benchmarks'\]\[0\]: tau must be >= 1")):
        with pytest.raises(DemoReportError, match=message):
            write_demo_summary(tmp_path, summary_rows(), {**entry, "sampled": bad})
    with pytest.raises(DemoReportError, match=r"evaluation\['doctor'\] must hold ok \(a bool\)"):
        write_demo_summary(tmp_path, summary_rows(), {**entry, "doctor": {**_doctor(), "lines": "PASS x"}})


def _served_report(temperature: float = 0.0) -> dict:
    """A served record as `evaluate.served` writes it: a row judged from a cycle log and the engine's counters."""
    from dflash_lib.serve.client import ServedDecode, SpecCounters
    from dflash_lib.evaluate.served import ServedReport, judge, pooled_speedup, verdict_line
    from dflash_lib.serve.measure import ServedSet

    ours = ServedSet("heldout (thinking off)", [[1, 2]], [[5, 6, 7, 8, 9]], [[(2, 3), (5, 2)]])
    counters = SpecCounters(drafts=2, draft_tokens=6, accepted=3, per_position=(2, 1, 0))
    engine = ServedDecode([[5, 6, 7, 8, 9]], counters, [counters], 0.5)
    none = SpecCounters(0, 0, 0, ())
    plain = ServedDecode([[5, 6, 7, 8, 9]], none, [none], 1.0)
    row = judge(ours, engine, 4, temperature == 0, temperature > 0, plain)
    line = verdict_line(row, temperature == 0, [], "EXPORT", "TARGET")
    speedup, span = pooled_speedup([engine], [plain])
    return ServedReport("python", "0.32.0", "float32", temperature == 0, temperature, [row], [line], "x.log", speedup,
                        span).to_json()


def test_report_shows_the_served_drafter_beside_ours(demo_tree, tmp_path):
    entry = {**evaluation_entry(), "served_tau_by_step": {"0": 1.0, "60": 2.5}, "best_step": 60,
             "best_drafter": "final (drafter/)", "best_by": "served tau", "best_tau": 2.5,
             "served": _served_report(), "sampled_served": _served_report(1.0)}
    assert demo_evaluation({**entry, "histogram": {}}) == entry
    page = build_demo_report(demo_tree["demo"], demo_tree["runs"], summary_rows(), [], evaluation=entry).read_text()
    rows = dict(re.findall(r"<tr><th>([^<]+)</th><td>([^<]*)</td></tr>", page))
    assert rows["served tau by training step (vLLM)"] == "0: 1.000, 60: 2.500"
    assert rows["best drafter (by served tau)"] == "step 60 (final (drafter/)): 2.500"
    tables = page.split('<table class="summary served">')[1:]
    assert len(tables) == 2 and "Served by vLLM 0.32.0 at temperature 0 (final drafter)" in page
    cells = re.findall(r"<td>([^<]*)</td>", tables[0][:tables[0].index("</table>")])
    # ours 2.5 tokens per cycle (3 and 2); the engine's 2 drafts accepted 3 of 6: 2.5; 10 vs 5 tokens/s
    assert cells == ["heldout (thinking off)", "2.500", "2.500", "10.0", "5.0", "2.00x", "2.00-2.00x",
                     "1.00/1.00 0.50/0.50 0.00/0.00", "PASS", "every set", "", "", "", "", "2.00x", "2.00-2.00x", "",
                     ""]
    assert "PASS served heldout (thinking off): served tau 2.500 vs ours 2.500" in page
    with pytest.raises(DemoReportError, match=r"evaluation\['served'\]\['rows'\]\[0\]: keys \['ok'\] missing"):
        write_demo_summary(tmp_path, summary_rows(), {**entry, "served": {
            **_served_report(), "rows": [{k: v for k, v in _served_report()["rows"][0].items() if k != "ok"}]}})
    with pytest.raises(DemoReportError, match=r"evaluation\['served_tau_by_step'\]\['0'\] must be a finite"):
        write_demo_summary(tmp_path, summary_rows(), {**entry, "served_tau_by_step": {"0": None}})
