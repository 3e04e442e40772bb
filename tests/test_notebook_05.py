"""notebooks/05_evaluate.ipynb: committed clean, and executed by papermill on a real smoke training run."""

from __future__ import annotations

import json
import os
from pathlib import Path

import nbformat
import pytest

from dflash_lib.evaluate import RUN_SUMMARY_KEYS
from dflash_lib.lab.runs import notebook_parameters
from notebook_checks import assert_committed_clean

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK = ROOT / "notebooks" / "05_evaluate.ipynb"
PARAMETERS = {"preset", "run", "drafter", "target", "prompts", "max_new_tokens", "decode_threads", "out_dir",
              "prompts_from", "enable_thinking", "sampled_temperature", "engine"}


def test_notebook_is_committed_clean_with_one_parameters_cell():
    nb = nbformat.read(NOTEBOOK, as_version=4)
    assert nb.metadata["kernelspec"]["name"] == "python3"
    assert set(notebook_parameters(NOTEBOOK)) == PARAMETERS
    assert_committed_clean(nb)


@pytest.mark.slow
def test_notebook_evaluates_every_checkpoint_of_a_training_run(tmp_path):
    papermill = pytest.importorskip("papermill")
    from dflash_lib.config import from_params
    from dflash_lib.models.export import read_doc
    from dflash_lib.train.loop import train

    os.environ["WANDB_MODE"] = "disabled"
    run04 = tmp_path / "04_train"  # notebook 04's layout: the trainer's folder is train/
    train(from_params(dict(limit=300, max_len=512, hidden_size=32, target_layers=2, num_features=1, num_anchors=8,
                           block_size=4, token_budget=2048, k=4, steps=4, ckpt_every=2, eval_every=2, eval_samples=4,
                           prefetch=2, wandb_mode="disabled")), run04 / "train")
    out_dir = tmp_path / "run"
    out_dir.mkdir()
    papermill.execute_notebook(
        str(NOTEBOOK), str(tmp_path / "executed.ipynb"), kernel_name="python3", cwd=str(ROOT),
        parameters=dict(run=str(run04), prompts=2, max_new_tokens=8, out_dir=str(out_dir), prompts_from="heldout"), progress_bar=False)
    summary = json.loads((out_dir / "summary.json").read_text())
    assert set(RUN_SUMMARY_KEYS) <= set(summary)
    assert list(summary["tau_by_step"]) == ["0", "2", "4"]  # untrained, the step-2 checkpoint, the final drafter
    assert summary["tau_untrained"] == summary["tau_by_step"]["0"]
    assert summary["tau_trained"] == summary["tau_by_step"]["4"]
    assert summary["prompts"] == 2 and summary["max_new_tokens"] == 8 and summary["outputs_equal_baseline"] == 2
    assert summary["speedup"] == pytest.approx(summary["tokens_per_s"] / summary["baseline_tokens_per_s"])
    assert summary["heldout_steps"] == [2, 4] and summary["heldout_loss_last"] > 0 and summary["loss_first"] > 0
    assert summary["export"] == str(out_dir / "serving") and read_doc(out_dir / "serving")["block_size"] == 4
    by_step = json.loads((out_dir / "by_step.json").read_text())
    assert [r["step"] for r in by_step] == [0, 2, 4]
    assert [(r["benchmark"], r["prompts"], r["cycles"]) for r in summary["benchmarks"]] == [
        ("heldout", 2, summary["cycles"])]  # the held-out prompts (prompts_from heldout): one row, every cycle
    sampled = summary["sampled"]  # the final drafter sampled at temperature 1.0 (the default), against plain sampling
    assert (sampled["temperature"], sampled["prompts"]) == (1.0, 2) and sampled["tau"] >= 1.0
    assert [r["benchmark"] for r in sampled["benchmarks"]] == ["heldout"]
    assert summary["doctor"] is None  # the run's tiny target: no folder to check the export against
    for name in ("tau_by_step", "acceptance", "loss_vs_heldout", "tau_by_benchmark"):
        assert (out_dir / f"{name}.json").is_file()
        html = (out_dir / f"{name}.html").read_text()
        assert "<html>" in html and "cdn.plot.ly" not in html.split("<body>")[0]
