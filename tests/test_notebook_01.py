"""notebooks/01_length_analysis.ipynb: committed clean, and executed by papermill on a small limit."""

from __future__ import annotations

import json
import os
from pathlib import Path

import nbformat
import pandas as pd
import pytest
from notebook_checks import assert_committed_clean

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK = ROOT / "notebooks" / "01_length_analysis.ipynb"
PARAMETERS = {"preset", "source", "tokenizer", "template", "thinking", "max_len", "policy", "limit", "regenerated",
              "out_dir"}  # cache_dir and every other config field: from the preset, or -p


def test_notebook_is_committed_clean_with_one_parameters_cell():
    nb = nbformat.read(NOTEBOOK, as_version=4)
    assert nb.metadata["kernelspec"]["name"] == "python3"
    tagged = [c for c in nb.cells if "parameters" in c.metadata.get("tags", [])]
    assert len(tagged) == 1
    names = {line.split("=")[0].strip() for line in tagged[0].source.splitlines() if "=" in line}
    assert names == PARAMETERS
    assert_committed_clean(nb)


@pytest.mark.slow
def test_notebook_runs_on_a_small_limit(tmp_path):
    papermill = pytest.importorskip("papermill")
    out_dir = tmp_path / "run"
    os.environ["WANDB_MODE"] = "disabled"
    papermill.execute_notebook(
        str(NOTEBOOK), str(tmp_path / "executed.ipynb"), kernel_name="python3", cwd=str(ROOT),
        parameters=dict(limit=200, max_len=1024, out_dir=str(out_dir), cache_dir=str(tmp_path / "cache")),
        progress_bar=False,
    )
    summary = json.loads((out_dir / "summary.json").read_text())
    report = summary["report"]
    assert report["records_seen"] == 200 and not report["complete"]
    assert report["records_kept"] + sum(report["skipped"].values()) == 200
    assert summary["samples"] == report["records_kept"] > 150
    lengths = pd.read_parquet(out_dir / "lengths.parquet")
    assert len(lengths) == summary["samples"] and lengths["length"].max() <= 1024
    assert lengths["length"].sum() == summary["total_tokens"]
    assert int((lengths["raw_length"] > 1024).sum()) == report["truncated_max_len"]  # the store's samples
    dropped = report["skipped"].get("no_assistant_within_max_len", 0)  # left out of the store, not of the figures
    assert summary["dropped"] == dropped and summary["above_max_len"] == report["truncated_max_len"] + dropped
    assert summary["share_above_max_len"] == pytest.approx(summary["above_max_len"] / (len(lengths) + dropped))
    assert 0.3 < summary["assistant_share"] < 1.0
    assert summary["percentiles"]["p50"] <= summary["percentiles"]["p99"] <= 1024
    for name in ("length_histogram.html", "length_tail.html"):
        html = (out_dir / name).read_text()
        assert "<html>" in html and "plotly" in html and "cdn.plot.ly" not in html.split("<body>")[0]
