"""benchmarks/gpu_check.py --quick runs on CPU and prints one JSON summary whose sections report real figures
(parity, train, pipeline, drafting, fsdp, issue 25's kl, sampling and target_shard, issue 55's linear_conv and
sliding_flex, issue 54's dflash2), and says why issue 55's CUDA-only sections (linear_rule, connector) did not run."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SECTIONS = ["parity", "train", "pipeline", "drafting", "fsdp", "kl", "sampling", "target_shard", "linear_conv",
            "linear_rule", "sliding_flex", "connector", "dflash2"]


@pytest.mark.slow
def test_gpu_check_quick_on_cpu_prints_one_json_summary():
    env = dict(os.environ, PYTHONPATH=str(ROOT), CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--quick", "--device", "cpu"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["quick"] is True and summary["ok"] is True
    parity = summary["parity"]
    assert parity["ok"] and "flex" not in parity["backends"] and "CUDA" in parity["skipped_flex"]
    cases = {(c["precision"], c["batch"]) for c in parity["cases"]}
    assert cases == {(p, b) for p in ("fp32", "bf16") for b in ("padded", "packed")}
    assert all(c["rel_err_grads"] <= parity["tolerance"][c["precision"]] for c in parity["cases"])
    assert max(c["rel_err_hidden"] for c in parity["cases"] if c["precision"] == "fp32") < 1e-5
    train = summary["train"]
    assert train["steps"] == 3 and train["skipped_steps"] == 0 and train["real_tokens"] > 0
    assert math.isfinite(train["loss_last"]) and train["ktok_s"] > 0 and train["flops_per_real_token"] > 0
    assert train["mfu"] is None and "dryrun" in train  # available or the reason it is not
    assert summary["pipeline"]["items_with_ready_event"] == 0  # CPU: no stream hand-over
    assert summary["pipeline"]["sequential_ktok_s"] > 0 and summary["pipeline"]["pipeline_ktok_s"] > 0
    drafting = summary["drafting"]
    assert drafting["equals_target_greedy"] == [True] * drafting["prompts"] and 1 <= drafting["tau"]
    assert drafting["tie_gap_ulps"] == [None] * drafting["prompts"] and drafting["ok"]  # fp32 on the CPU: no ties
    kl = summary["kl"]  # on the CPU: fp32 is the reference itself, bf16 autocast is measured against it
    assert kl["ok"] and kl["target_rows"] > 0 and [c["precision"] for c in kl["cases"]] == ["fp32", "bf16"]
    fp32, bf16 = kl["cases"]
    assert fp32["rel_err_loss"] == fp32["rel_err_grads"] == 0.0
    assert 0 < bf16["rel_err_grads"] <= kl["tolerance"]["bf16"]
    sampling = summary["sampling"]
    assert sampling["ok"] and sampling["equals_cpu"] == [True] * sampling["prompts"] and sampling["tau"] >= 1
    assert sampling["rejected"] and min(sampling["per_position"]) < 1  # the residual resampling ran
    assert sampling["tau"] == sampling["tau_cpu"] and "the path only" in sampling["reference"]
    shard = summary["target_shard"]
    assert shard["ok"] and shard["bitwise_equal"] and shard["layer_params"] == ["DTensor"]
    assert shard["replicated_on"] == ["cpu"] and shard["target_rows"] > 0
    assert [k for k, v in summary.items() if isinstance(v, dict) and "section_s" in v] == SECTIONS  # each, timed
    conv = summary["linear_conv"]  # the padded convolution against the per-document rule, fp32 and bf16
    assert conv["status"] == "pass" and [c["dtype"] for c in conv["cases"]] == ["float32", "bfloat16"]
    assert all(0 < c["max_err"] <= c["tolerance"] < c["planted_err"] for c in conv["cases"])
    sliding = summary["sliding_flex"]  # flex's sliding windows against dense, forward only on the CPU
    assert sliding["status"] == "pass" and [c["precision"] for c in sliding["cases"]] == ["fp32"]
    assert sliding["max_err"] <= sliding["tolerance"] < sliding["cases"][0]["planted_err"]
    assert "backward" in sliding["not_run"] and sliding["seconds"] > 0
    for name, says in (("linear_rule", "CUDA"), ("connector", "vLLM on CUDA")):  # never a pass where it cannot run
        assert summary[name]["status"] == "skipped" and summary[name]["ok"] is None
        assert says in summary[name]["reason"] and summary["skipped"][name] == summary[name]["reason"]
    d2 = summary["dflash2"]  # the DFlash2 drafter trained as on the device against fp64 dense, fp32 and bf16
    assert d2["status"] == "pass" and [c["name"] for c in d2["cases"]] == ["drafter fp32", "selector gradients fp32",
                                                                          "drafter bf16"]
    assert all(0 < c["max_err"] <= c["tolerance"] for c in d2["cases"])
    assert d2["cases"][0]["planted_err"] > d2["cases"][0]["tolerance"] and d2["cases"][0]["walk_tokens_equal"] == 3
    assert summary["budget_s"] > 0 and summary["total_s"] > 0
