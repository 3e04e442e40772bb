"""The demo report in a real headless Chromium (Debian's, driven by Playwright): plots draw, no JS errors, no
network. Negative controls prove each of the three checks can fail."""

from __future__ import annotations

from pathlib import Path

import plotly.graph_objects as go
import pytest

from browser_check import ReportBrowser, unavailable_reason
from dflash_lib.lab.report.demo import build_demo_report


@pytest.fixture(scope="module")
def browser():
    reason = unavailable_reason()
    if reason:
        pytest.skip(reason)
    with ReportBrowser() as b:
        yield b


def _summary() -> dict[str, dict[str, float]]:
    return {s: dict(ktok_s=k, ratio_to_sorted=k / 32.0, predicted_efficiency=0.87, realized_efficiency=0.8,
                    co_batch_recurrence=0.02) for s, k in (("sorted", 32.0), ("random", 12.0), ("bucketed", 25.1),
                                                           ("packed", 30.0))}


def test_demo_report_renders_every_plot_offline_without_errors(browser, tmp_path):
    run = tmp_path / "runs" / "20260101T000000Z_03_throughput"
    run.mkdir(parents=True)
    (run / "03_throughput.ipynb").write_text("{}")
    figures = [go.Figure(go.Bar(x=["sorted", "random"], y=[32, 12]), layout_title_text="Ktok/s"),
               go.Figure(go.Scatter(x=list(range(50)), y=[i * i for i in range(50)], mode="lines")),
               go.Figure(go.Histogram(x=[1, 2, 2, 3, 3, 3]))]
    report = build_demo_report(tmp_path / "runs" / "x_demo", {"03_throughput": run}, _summary(), figures)
    check = browser.check(report, expected_plots=3)
    assert check.problems(expected_plots=3) == []
    assert (check.loaded, check.plots, check.plots_rendered) == (True, 3, 3)
    assert check.js_errors == [] and check.network_requests == []


def _page(tmp_path: Path, name: str, body: str) -> Path:
    path = tmp_path / name
    path.write_text(f"<!DOCTYPE html><html><head><meta charset='utf-8'></head><body>{body}</body></html>")
    return path


def test_a_javascript_error_is_caught(browser, tmp_path):
    page = _page(tmp_path, "error.html", "<p>hi</p><script>throw new Error('deliberate failure')</script>"
                                         "<script>console.error('console complaint')</script>")
    check = browser.check(page)
    assert check.loaded and check.network_requests == []
    assert any("deliberate failure" in e for e in check.js_errors), check.js_errors
    assert any("console complaint" in e for e in check.js_errors), check.js_errors
    assert len(check.problems()) == 2


def test_a_network_request_is_caught(browser, tmp_path):
    page = _page(tmp_path, "network.html", "<script src='https://cdn.example.com/plotly.min.js'></script>"
                                           "<script>fetch('http://api.example.com/x').catch(() => {})</script>")
    check = browser.check(page)
    assert "https://cdn.example.com/plotly.min.js" in check.network_requests
    assert "http://api.example.com/x" in check.network_requests
    assert any("network request: https://cdn.example.com" in p for p in check.problems())


def test_a_plot_that_does_not_draw_is_caught(browser, tmp_path):
    fig = go.Figure(go.Scatter(x=[1, 2], y=[2, 1]))
    page = tmp_path / "no_plotlyjs.html"
    page.write_text(fig.to_html(full_html=True, include_plotlyjs=False))  # the figure div, but no plotly.js
    check = browser.check(page, expected_plots=1, timeout_s=3)
    assert (check.plots, check.plots_rendered) == (1, 0)
    assert "expected 1 rendered plots, found 0 rendered of 1 plot divs" in check.problems(expected_plots=1)


def test_a_missing_browser_is_named_in_the_skip_reason(monkeypatch, tmp_path):
    monkeypatch.setenv("DFLASH_CHROMIUM", str(tmp_path / "no-such-chromium"))
    reason = unavailable_reason()
    assert reason is not None and "no Chromium found" in reason and "DFLASH_CHROMIUM" in reason
    monkeypatch.setenv("DFLASH_CHROMIUM", "/bin/sh")  # an executable stands in for a found browser
    reason = unavailable_reason()
    assert reason is None or "no Chromium found" not in reason  # (playwright may still be named as missing)
