"""Training figures: metrics.jsonl reading, per-bucket smoothing, steady window, and notebook 04 end to end."""

import json

import numpy as np
import pandas as pd
import papermill as pm
import pytest

from dflash_lib.lab.report.training import dashboard, loss_by_bucket, smooth_by_bucket, steady_window
from dflash_lib.rundir import REPO_ROOT
from dflash_lib.rundir.reader import load_metrics


def _rows(n=12):
    return [dict(step=s, loss=float(10 - s * 0.1 + (s % 3)), acc=s / 20, lr=1e-3, bucket=s % 3,
                 ktok_s=10.0 + s, q_pre=[2, 1], q_hs=[0], data_wait_pct=1.0, eta_s=60.0, full_run_eta_s=86400.0 * 2,
                 steady=s >= 8) for s in range(1, n + 1)]


def test_load_metrics_ignores_only_a_torn_last_line(tmp_path):
    p = tmp_path / "metrics.jsonl"
    p.write_text("\n".join(json.dumps(r) for r in _rows()) + '\n{"step": 13, "lo')
    df = load_metrics(tmp_path)
    assert list(df.step) == list(range(1, 13))
    p.write_text(json.dumps(_rows()[0]) + "\nnot json\n" + json.dumps(_rows()[1]) + "\n")
    with pytest.raises(ValueError, match=r"metrics.jsonl:2"):
        load_metrics(p)


def test_smoothing_follows_each_bucket_separately():
    df = pd.DataFrame(_rows())
    sm = smooth_by_bucket(df, "loss", window=2).set_index("step")
    # bucket 1 holds steps 1, 4, 7, 10: the smoothed value at step 7 is the mean of the losses at steps 4 and 7
    loss = df.set_index("step")["loss"]
    assert sm.loc[7, "smooth"] == pytest.approx((loss[4] + loss[7]) / 2)
    assert sm.loc[1, "smooth"] == pytest.approx(loss[1])
    with pytest.raises(ValueError):
        smooth_by_bucket(df, window=0)


def test_steady_window_and_figures():
    df = pd.DataFrame(_rows())
    assert steady_window(df) == (8, 12)
    assert steady_window(df.assign(steady=False)) is None
    fig = loss_by_bucket(df)
    assert len(fig.data) == 2 * 3  # dots + smoothed curve per bucket
    dash = dashboard(df)
    names = {t.name for t in dash.data}
    assert {"acc", "lr", "Ktok/s", "q_pre[0]", "q_pre[1]", "q_hs", "ETA (d)"} <= names
    eta = next(t for t in dash.data if t.name == "ETA (d)")
    assert np.allclose(eta.y, 2.0)  # the full run's (full_run_eta_s), not this invocation's eta_s


@pytest.mark.slow
def test_notebook_04_trains_and_writes_figures(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    params = dict(limit=200, max_len=512, token_budget=2048, steps=6, target_layers=2, hidden_size=32,
                  num_features=1, block_size=4, num_anchors=8, log_every=2, wandb_mode="disabled", out_dir=str(out))
    pm.execute_notebook(str(REPO_ROOT / "notebooks" / "04_train.ipynb"), str(out / "nb.ipynb"), parameters=params,
                        kernel_name="python3", cwd=str(REPO_ROOT), progress_bar=False)
    summary = json.loads((out / "train" / "summary.json").read_text())
    assert summary["steps"] == 6 and summary["strategy"] == "bucketed"
    df = load_metrics(out / "train")
    assert list(df.step) == [1, 2, 3, 4, 5, 6]
    assert {"loss", "acc", "lr", "noise", "ktok_s", "bucket", "q_pre", "q_hs"} <= set(df.columns)
    assert (out / "loss_by_bucket.html").stat().st_size > 1_000_000 and (out / "dashboard.html").exists()
    assert (out / "train" / "drafter" / "model.safetensors").exists()
    executed = (out / "nb.ipynb").read_text()
    assert "(live, step 6)" in executed  # the live loss figure was redrawn up to the last step while training
    plotly = [o for c in json.loads(executed)["cells"] for o in c.get("outputs", [])
              if "application/vnd.plotly.v1+json" in o.get("data", {})]
    assert len(plotly) == 3  # the live figure once (each redraw replaced it), the final loss figure, the dashboard


def test_live_figure_collects_and_redraws_outside_ipython():
    from dflash_lib.lab.report.training import LiveFigure

    live = LiveFigure(every=2)
    for r in _rows(6):
        live.log(r, r["step"])
    live.close()
    fig = live.figure()
    assert len(live.rows) == 6 and "step 6" in fig.layout.title.text
    assert sum(len(t.x) for t in fig.data if t.mode == "markers") == 6
    with pytest.raises(ValueError):
        LiveFigure(every=0)


def test_live_figure_is_one_output_updated_in_place_at_most_every_interval(monkeypatch):
    """In an IPython shell the live figure publishes ONE display output and then only updates of that output (an
    executed notebook keeps one figure, not one per redraw), and redraws at most once per min_interval_s."""
    import plotly.io as pio
    from IPython.core.interactiveshell import InteractiveShell
    from IPython.utils.capture import capture_output

    from dflash_lib.lab.report.training import LiveFigure

    monkeypatch.setattr(pio.renderers, "default", "plotly_mimetype")  # what a notebook kernel renders with
    now = [0.0]
    live = LiveFigure(every=1, min_interval_s=5.0, clock=lambda: now[0])
    InteractiveShell.instance()
    try:
        with capture_output(stdout=False, stderr=False, display=True) as cap:
            for r in _rows(12):  # one step per second: redraws at steps 1, 6 and 11, the last state at close
                live.log(r, r["step"])
                now[0] += 1.0
            live.close()
    finally:
        InteractiveShell.clear_instance()
    outputs = cap.outputs
    ids = [(o.transient or {}).get("display_id") for o in outputs]
    assert [o.update for o in outputs] == [False, True, True, True]
    assert ids[0] is not None and set(ids) == {ids[0]}  # every update replaces that first output
    titles = [o.data["application/vnd.plotly.v1+json"]["layout"]["title"]["text"] for o in outputs]
    assert [t.rsplit(" ", 1)[-1] for t in titles] == ["1)", "6)", "11)", "12)"]
    with pytest.raises(ValueError, match="min_interval_s"):
        LiveFigure(min_interval_s=-1.0)
