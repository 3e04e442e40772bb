"""`make demo`: the study's notebooks executed in order on the bundled corpus, each a papermill run.

`run_demo(target=...)` first gives the chain a target, "real" (SmolLM2-135M-Instruct, `lab.real_target`),
"trained" (`lab.demo_target`, for tests and smoke runs) or "preset" (the preset's own), and the target's answers;
then each notebook of `CHAIN` runs in a run folder of its own, and `runs/<id>_demo/` gets `chain.json`,
`summary.json` and `report.html`. Parameters: docs/runs.md, "Running notebooks headlessly"; what it measures:
docs/data.md, "The demo's target: SmolLM2-135M-Instruct from a pip package, and its own answers".
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any, Callable

from dflash_lib.lab.demo_target import DemoAnswerSettings, demo_target_params, ensure_demo_answers, ensure_demo_target
from dflash_lib.lab.real_target import SMOLLM2, ensure_real_target, real_target_params
from dflash_lib.lab.report.demo import build_demo_report, demo_evaluation, write_demo_summary
from dflash_lib.lab.runs import accepted_parameters, execute
from dflash_lib.config import ConfigError
from dflash_lib.rundir import REPO_ROOT, load_config, new_run_dir, write_json
from dflash_lib.serve.server import engine_python

NOTEBOOKS = REPO_ROOT / "notebooks"

ANSWERS = "answers"  # the key of the target's answers (a JSONL) among a chain's inputs, when it has them


def train_link(prev: dict[str, Path]) -> dict[str, Any]:
    """Notebook 04: on the target's answers when the chain has them (buckets planned for that corpus), else on
    the bundled corpus with notebook 02's plan."""
    if ANSWERS in prev:
        return {"source": str(prev[ANSWERS]), "plan": "", "heldout_fraction": float(prev[ANSWERS + "_heldout"]),
                **({"max_len": prev[ANSWERS + "_max_len"]} if prev.get(ANSWERS + "_max_len") else {})}
    return {"plan": str(prev["02_bucket_optimization"] / "plan.json")}


# (notebook stem, parameters derived from the chain's inputs and the run folders of the notebooks before it)
Link = tuple[str, Callable[[dict[str, Any]], dict[str, Any]]]
CHAIN: list[Link] = [
    ("01_length_analysis", lambda prev: {}),
    ("02_bucket_optimization", lambda prev: {"lengths_from": str(prev["01_length_analysis"])}),
    ("03_throughput_probe", lambda prev: {"plan": str(prev["02_bucket_optimization"] / "plan.json")}),
    ("04_train", train_link),
    ("05_evaluate", lambda prev: {"run": str(prev["04_train"])}),
]

# (notebook stem, figure name): the figures the demo report embeds, in order (plotly JSON the notebooks wrote)
KEY_FIGURES = [
    ("03_throughput_probe", "throughput"),
    ("03_throughput_probe", "predicted_vs_realized"),
    ("02_bucket_optimization", "efficiency_vs_randomness"),
    ("02_bucket_optimization", "efficiency_vs_k"),
    ("02_bucket_optimization", "lengths_edges"),
    ("04_train", "loss_by_bucket"),
    ("04_train", "dashboard"),
    ("05_evaluate", "tau_by_step"),
    ("05_evaluate", "acceptance"),
    ("05_evaluate", "loss_vs_heldout"),
]


TARGETS = ("real", "trained", "preset")  # run_demo's target kinds (see the module doc)

# The real target's answers: 320 first turns of at most 128 tokens, ended where the model ends them, prompt and
# answer within 1024 tokens (their cost: docs/data.md, "The demo's target"); 5 % held out
REAL_ANSWERS = DemoAnswerSettings(records=320, new_tokens=128, free_end=True, heldout_fraction=0.05, max_len=1024)


def prepare_target(preset_name: str, overrides: dict[str, Any] | None, target_settings: Any = None,
                   answer_settings: DemoAnswerSettings | None = None, kind: str = "trained",
                   engine: bool = False) -> tuple[dict[str, Any], dict[str, Any]]:
    """The chain's target ("real" or "trained", built or cached) and its answers for the preset's data. Returns
    (the parameters that put every notebook on that target and tokenizer, the chain's inputs: {ANSWERS: the JSONL,
    ANSWERS + "_heldout" / "_max_len": the held-out fraction and max_len notebook 04 uses on it}). engine: the real target's answers come
    from vLLM's chat endpoint (else the local backend, slower: docs/data.md)."""
    cfg = load_config(dict(overrides or {}), preset_name)
    t0 = time.perf_counter()
    if kind == "real":
        print(f"[demo] real target {SMOLLM2.name} ...", flush=True)
        folder = ensure_real_target()
        params = real_target_params(folder)
        settings = replace(answer_settings or REAL_ANSWERS, backend="vllm" if engine else "local")
        cfg = load_config({**params, **(overrides or {})}, preset_name)  # a user's -p wins (draft_vocab 0, say)
        answers = ensure_demo_answers(cfg, folder, settings,  # what the user's -p set stays as set
                                      target_params={k: v for k, v in params.items() if k not in (overrides or {})})
    else:
        print("[demo] trained target ...", flush=True)
        settings = answer_settings or DemoAnswerSettings()
        folder = ensure_demo_target(cfg, target_settings)
        params = demo_target_params(folder)
        answers = ensure_demo_answers(cfg, folder, settings)
    print(f"[demo] target and its answers ready in {time.perf_counter() - t0:.0f} s -> {folder}", flush=True)
    inputs = {ANSWERS: answers, ANSWERS + "_heldout": settings.heldout_fraction, ANSWERS + "_max_len": settings.max_len,
              ANSWERS + "_settings": asdict(settings)}
    if settings.free_end:  # answers end where the target ends them: so do notebook 05's (the preset's length at most)
        return {**params, "min_new_tokens": 0}, inputs
    # answers of exactly n tokens: notebook 05 decodes them as the drafter's data was made
    return {**params, "max_new_tokens": settings.new_tokens, "min_new_tokens": settings.new_tokens}, inputs


def engine_available() -> bool:
    """Whether the serving engine is there (`serve.engine_python`: .venv-engine or $DFLASH_ENGINE_PYTHON)."""
    try:
        engine_python()
    except ConfigError:
        return False
    return True


def run_demo(preset_name: str = "demo", tag: str = "demo", root: str | Path | None = None,
             overrides: dict[str, Any] | None = None, target: str | None = None,
             target_settings: Any = None, answer_settings: DemoAnswerSettings | None = None,
             engine: str | None = None) -> Path:
    """Run every notebook of the chain with `preset_name` (plus `overrides` where a notebook takes them).

    target: one of TARGETS (see the module doc); None = "real" for the demo preset, else "preset". engine: notebook
    05's `engine` ("vllm": every drafter also served by vLLM; the real target's answers through it too); None =
    "vllm" for the demo preset on a real or trained target when `make engine` made .venv-engine, else "none".
    Returns the demo folder. A failing notebook raises; the folders of the notebooks before it stay intact.
    """
    target = target or ("real" if preset_name == "demo" else "preset")
    if target not in TARGETS:
        raise ConfigError(f"demo: target must be one of {', '.join(TARGETS)}, got {target!r}")
    if engine is None:
        engine = "vllm" if preset_name == "demo" and target != "preset" and engine_available() else "none"
    demo_dir = new_run_dir("demo", tag if tag != "demo" else "", root)
    done: dict[str, Path] = {}  # notebook stem -> its run folder
    inputs: dict[str, Any] = {}  # what the chain's first step made (the target's answers), for CHAIN's links
    record: dict[str, Any] = {"preset": preset_name, "runs": [], "engine": engine}
    if target != "preset":
        t0 = time.perf_counter()
        target_params, inputs = prepare_target(preset_name, overrides, target_settings, answer_settings, target,
                                               engine == "vllm")
        overrides = {**target_params, **(overrides or {})}
        record["target"] = {"kind": target, **target_params, "answers": str(inputs[ANSWERS]),
                            "answer_settings": inputs[ANSWERS + "_settings"],
                            "seconds": round(time.perf_counter() - t0, 1)}
    for stem, derive in CHAIN:
        notebook = NOTEBOOKS / f"{stem}.ipynb"
        accepted = accepted_parameters(notebook)  # a notebook building its config takes every config field
        params = {k: v for k, v in {**(overrides or {}), **derive({**inputs, **done})}.items() if k in accepted}
        if stem == "05_evaluate" and engine != "none":
            params["engine"] = engine
        t0 = time.perf_counter()
        print(f"[demo] {stem} ...", flush=True)
        run_dir = execute(notebook, params, preset_name=preset_name, tag=tag, root=root)
        done[stem] = run_dir
        record["runs"].append({"notebook": stem, "run_dir": str(run_dir), "params": params,
                               "seconds": round(time.perf_counter() - t0, 1)})
        print(f"[demo] {stem} done in {time.perf_counter() - t0:.0f} s -> {run_dir}", flush=True)
        write_json(demo_dir / "chain.json", record)
    build_report(demo_dir, done, record.get("target"))
    return demo_dir


def data_note(target: dict[str, Any] | None) -> str:
    """The report's sentence on what the drafter trained on (the chain record's `target`, or None)."""
    if not target:
        return ""
    what = (f"{SMOLLM2.name}, converted from its GGUF" if target.get("kind") == "real"
            else "a small Qwen3 the demo trained on the corpus")
    answers = target.get("answer_settings", {})
    n = answers.get("new_tokens", target.get("max_new_tokens"))
    size = f"at most {n} tokens each, ended where the target ends them" if answers.get("free_end") else f"{n} tokens each"
    return (f"Target: {target['target']} ({what}). The drafter trained on that target's own greedy answers "
            f"({target['answers']}, {size}) and is evaluated on held-out prompts of them.")


def build_report(demo_dir: Path, done: dict[str, Path], target: dict[str, Any] | None = None) -> Path:
    """summary.json (per strategy from the probe, the evaluation from notebook 05) and report.html for a finished
    chain (`target`: the chain record's entry for the target its first step made, when it made one)."""
    probe = json.loads((done["03_throughput_probe"] / "summary.json").read_text())
    evaluation = demo_evaluation(json.loads((done["05_evaluate"] / "summary.json").read_text()))
    write_demo_summary(demo_dir, probe["strategies"], evaluation)
    figures = [done[stem] / f"{name}.json" for stem, name in KEY_FIGURES]
    missing = [str(f) for f in figures if not f.is_file()]
    if missing:
        raise FileNotFoundError(f"the demo report needs figures its notebooks did not write: {missing}")
    return build_demo_report(demo_dir, done, probe["strategies"], figures, title="DFlash Lab demo",
                             evaluation=evaluation, data_note=data_note(target))
