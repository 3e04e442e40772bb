"""The whole study chain (01 -> 02 -> 03 -> 04 -> 05) on smoke parameters, its demo folder, and the report in a real
headless browser."""

import json
from itertools import islice
from pathlib import Path

import pytest

from browser_check import check_page, unavailable_reason
from dflash_lib.data import load_conversations
from dflash_lib.lab import demo_target as dt
from dflash_lib.lab.demo import CHAIN, KEY_FIGURES, run_demo
from dflash_lib.lab.report.demo import EVALUATION_KEYS, STRATEGIES, SUMMARY_KEYS
from dflash_lib.regenerate import leading_assistant_turns
from html_check import external_references


@pytest.mark.slow
def test_demo_chain_on_smoke_parameters_with_the_real_target(tmp_path):
    # the demo's own first step at a tiny scale: the real target (SmolLM2-135M-Instruct, converted once into
    # .cache/real_targets) and its own answers to 16 conversations, at most 8 tokens each, ended where it ends them
    answers = dt.DemoAnswerSettings(records=16, new_tokens=8, free_end=True, gen_batch=16, heldout_fraction=0.25,
                                    max_len=512)
    demo_dir = run_demo(preset_name="smoke", tag="test", root=tmp_path,
                        overrides={"steps": 12, "probe_steps": 6, "limit": 300, "ckpt_every": 0,
                                   "eval_every": 6, "prompts": 2, "prompts_from": "heldout,humaneval,mt-bench",
                                   "doctor_samples": 2, "max_new_tokens": 8},
                        target="real", answer_settings=answers, engine="none")
    chain = json.loads((demo_dir / "chain.json").read_text())
    assert [r["notebook"] for r in chain["runs"]] == [stem for stem, _ in CHAIN]
    runs = {r["notebook"]: r["run_dir"] for r in chain["runs"]}
    made = chain["target"]
    assert made["kind"] == "real" and made["target"].endswith("SmolLM2-135M-Instruct")
    assert (made["template"], made["mask_id"], made["min_new_tokens"]) == ("hf", 16, 0)  # answers end freely
    for r in chain["runs"]:  # every notebook on the real target, its own tokenizer and chat template
        assert r["params"]["target"] == r["params"].get("tokenizer", made["tokenizer"]) == made["target"]
        assert r["params"].get("template", "hf") == "hf"
    train = chain["runs"][3]["params"]  # notebook 04: the target's answers, buckets planned for them, their max_len
    assert train["source"] == made["answers"] and train["plan"] == "" and train["heldout_fraction"] == 0.25
    assert train["max_len"] == 512 and chain["runs"][0]["params"].get("max_len", 512) == 512
    regen = [json.loads(x) for x in Path(made["answers"]).read_text().split("\n") if x]  # (U+2028 inside a record)
    asked = list(islice((c.record for c in load_conversations("sharegpt") if not leading_assistant_turns(c)), 16))
    assert [r["record"] for r in regen] == asked and all(0 < r["regen"]["completion_tokens"] <= 8 for r in regen)
    assert all(r["messages"][-1]["role"] == "assistant" and r["messages"][-1]["content"].strip() for r in regen)
    for stem, run in runs.items():
        assert (tmp_path / run.split("/")[-1] / f"{stem}.ipynb").is_file()
    # each notebook read the one before it
    assert chain["runs"][1]["params"]["lengths_from"] == runs["01_length_analysis"]
    assert chain["runs"][2]["params"]["plan"].startswith(runs["02_bucket_optimization"])
    plan = json.loads((Path(runs["02_bucket_optimization"]) / "plan.json").read_text())  # planned for 01's store,
    assert plan["corpus"]["store_key"] == json.loads((Path(runs["01_length_analysis"]) / "summary.json").read_text())[
        "store_key"]  # the one notebook 03 trained on (another key would have been refused)
    assert chain["runs"][4]["params"]["run"] == runs["04_train"]  # notebook 05 evaluates notebook 04's run
    assert chain["runs"][3]["params"]["eval_every"] == 6  # an override reaches every notebook declaring it
    doc = json.loads((demo_dir / "summary.json").read_text())
    summary, evaluation = doc["strategies"], doc["evaluation"]
    assert set(STRATEGIES) <= set(summary)
    for s in STRATEGIES:
        assert set(SUMMARY_KEYS) <= set(summary[s]) and summary[s]["ktok_s"] > 0
    assert summary["sorted"]["ratio_to_sorted"] == pytest.approx(1.0)
    assert summary["sorted"]["co_batch_recurrence"] == pytest.approx(1.0)  # frozen batches: the reference run's flaw
    assert summary["bucketed"]["co_batch_recurrence"] < 0.5
    # notebook 05: the untrained drafter at step 0 and notebook 04's final drafter (step 12; no checkpoint between)
    assert set(EVALUATION_KEYS) <= set(evaluation) and list(evaluation["tau_by_step"]) == ["0", "12"]
    assert evaluation["tau_untrained"] == evaluation["tau_by_step"]["0"] >= 1.0
    assert evaluation["tau_trained"] == evaluation["tau_by_step"]["12"] >= 1.0
    # 2 held-out prompts, 2 HumanEval ones, 2 MT-Bench questions asked both turns: a table row per set
    assert evaluation["prompts"] == 8 and evaluation["max_new_tokens"] == 8 and evaluation["speedup"] > 0
    rows = [(r["benchmark"], r["prompts"], r["turns"]) for r in evaluation["benchmarks"]]
    assert rows == [("heldout", 2, 2), ("humaneval", 2, 2), ("mt-bench", 2, 4)]
    sampled = evaluation["sampled"]  # the final drafter at temperature 1, every set
    assert sampled["temperature"] == 1.0 and [r["benchmark"] for r in sampled["benchmarks"]] == [
        "heldout", "humaneval", "mt-bench"]
    doctor = evaluation["doctor"]  # the export against the real target, its chat template included: passes
    assert doctor["ok"] and doctor["summary"] == "14 of 14 rules pass", doctor["lines"]
    page = (demo_dir / "report.html").read_text()
    assert "Evaluation: what training bought" in page
    assert "<h3>Per benchmark (final drafter)</h3>" in page and "<th>tau T=1</th>" in page
    assert "Serving doctor on the export: passes" in page
    assert f"trained on that target&#x27;s own greedy answers ({made['answers']}, at most 8 tokens each" in page
    assert "SmolLM2-135M-Instruct, converted from its GGUF" in page
    assert not external_references(page)
    for run in runs.values():
        assert run.split("/")[-1] in page  # every run folder is linked
    if reason := unavailable_reason():
        pytest.skip(f"report not opened in a browser: {reason}")
    plots = len(KEY_FIGURES)  # 10: notebook 05 adds tau by step, acceptance, loss vs held-out
    check = check_page(demo_dir / "report.html", expected_plots=plots)
    assert not check.problems(plots), check.problems(plots)
    assert check.plots_rendered == plots and not check.network_requests and not check.js_errors
