"""`make demo`: the study's notebooks executed in order on the bundled corpus, each a papermill run.

Every notebook gets a run folder of its own; a `runs/<id>_demo/` folder records the chain (`chain.json`: which
notebook ran in which folder, with what parameters), `summary.json` (the per-strategy figures of the throughput
probe under `strategies`, notebook 05's evaluation of the training run under `evaluation`), and `report.html`:
one self-contained page with both summaries, the key figures and links to every run.

Parameters a notebook receives: the preset's values of the names it declares, then `overrides` (every notebook
that accepts a name gets it: a notebook that builds its config from a preset takes every config field, e.g. a
target and tokenizer made by a first step for the whole chain), then what its CHAIN link derives from the folders
of the notebooks before it.

The demo preset first builds its TRAINED target (`lab.demo_target`: a small Qwen3 trained on the corpus over a
shrunk vocabulary, cached) and the target's own answers to the first user turn of 1024 conversations (cached
next to it): every notebook runs against that target and its tokenizer, notebooks 01-03 on the bundled corpus,
notebook 04 trains the drafter on the target's answers (with buckets planned for them) and notebook 05 decodes
held-out prompts of those answers. `trained_target=False` keeps the chain on the preset's own target (a random one
unless `target` is set); `True` with other presets builds one with `target_settings` / `answer_settings`.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Callable

from dflash_lib.lab.demo_target import DemoAnswerSettings, demo_target_params, ensure_demo_answers, ensure_demo_target
from dflash_lib.lab.report.demo import build_demo_report, demo_evaluation, write_demo_summary
from dflash_lib.lab.runs import accepted_parameters, execute
from dflash_lib.config import ConfigError
from dflash_lib.rundir import REPO_ROOT, load_config, new_run_dir, write_json
from dflash_lib.serve.server import engine_python

NOTEBOOKS = REPO_ROOT / "notebooks"

ANSWERS = "answers"  # the key of the target's answers (a JSONL) among a chain's inputs, when it has them


def _train_link(prev: dict[str, Path]) -> dict[str, Any]:
    """Notebook 04: on the target's answers when the chain has them (buckets planned for that corpus), else on
    the bundled corpus with notebook 02's plan."""
    if ANSWERS in prev:
        return {"source": str(prev[ANSWERS]), "plan": "", "heldout_fraction": float(prev[ANSWERS + "_heldout"])}
    return {"plan": str(prev["02_bucket_optimization"] / "plan.json")}


# (notebook stem, parameters derived from the chain's inputs and the run folders of the notebooks before it)
Link = tuple[str, Callable[[dict[str, Any]], dict[str, Any]]]
CHAIN: list[Link] = [
    ("01_length_analysis", lambda prev: {}),
    ("02_bucket_optimization", lambda prev: {"lengths_from": str(prev["01_length_analysis"])}),
    ("03_throughput_probe", lambda prev: {"plan": str(prev["02_bucket_optimization"] / "plan.json")}),
    ("04_train", _train_link),
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


def prepare_target(preset_name: str, overrides: dict[str, Any] | None, target_settings: Any = None,
                   answer_settings: Any = None) -> tuple[dict[str, Any], dict[str, Any]]:
    """The trained demo target and its answers for the preset's data (built or cached). Returns (the parameters
    that put every notebook on that target and tokenizer, the chain's inputs: {ANSWERS: the JSONL,
    ANSWERS + "_heldout": the held-out fraction notebook 04 uses on it})."""
    cfg = load_config(dict(overrides or {}), preset_name)
    answer_settings = answer_settings or DemoAnswerSettings()
    t0 = time.perf_counter()
    print("[demo] trained target ...", flush=True)
    folder = ensure_demo_target(cfg, target_settings)
    answers = ensure_demo_answers(cfg, folder, answer_settings)
    print(f"[demo] trained target ready in {time.perf_counter() - t0:.0f} s -> {folder}", flush=True)
    inputs = {ANSWERS: answers, ANSWERS + "_heldout": answer_settings.heldout_fraction}
    n = answer_settings.new_tokens  # notebook 05 decodes answers as the drafter's data was made: exactly n tokens
    return {**demo_target_params(folder), "max_new_tokens": n, "min_new_tokens": n}, inputs


def engine_available() -> bool:
    """Whether the serving engine is there (`serve.engine_python`: .venv-engine or $DFLASH_ENGINE_PYTHON)."""
    try:
        engine_python()
    except ConfigError:
        return False
    return True


def run_demo(preset_name: str = "demo", tag: str = "demo", root: str | Path | None = None,
             overrides: dict[str, Any] | None = None, trained_target: bool | None = None,
             target_settings: Any = None, answer_settings: Any = None, engine: str | None = None) -> Path:
    """Run every notebook of the chain with `preset_name` (plus `overrides` where a notebook takes them).

    trained_target: build (or reuse) the trained demo target and its answers first (see the module doc);
    None = only for the demo preset. engine: notebook 05's `engine` ("vllm": every drafter also served by vLLM);
    None = "vllm" for the demo preset on its trained target when `make engine` made .venv-engine, else "none".
    Returns the demo folder. A failing notebook raises; the folders of the notebooks before it stay intact.
    """
    demo_dir = new_run_dir("demo", tag if tag != "demo" else "", root)
    done: dict[str, Path] = {}  # notebook stem -> its run folder
    inputs: dict[str, Any] = {}  # what the chain's first step made (the target's answers), for CHAIN's links
    record: dict[str, Any] = {"preset": preset_name, "runs": []}
    if trained_target if trained_target is not None else preset_name == "demo":
        t0 = time.perf_counter()
        target_params, inputs = prepare_target(preset_name, overrides, target_settings, answer_settings)
        overrides = {**target_params, **(overrides or {})}
        record["trained_target"] = {**target_params, "answers": str(inputs[ANSWERS]),
                                    "seconds": round(time.perf_counter() - t0, 1)}
    if engine is None:
        engine = "vllm" if preset_name == "demo" and inputs and engine_available() else "none"
    record["engine"] = engine
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
    build_report(demo_dir, done, record.get("trained_target"))
    return demo_dir


def data_note(trained_target: dict[str, Any] | None) -> str:
    """The report's sentence on what the drafter trained on (the chain record's `trained_target`, or None)."""
    if not trained_target:
        return ""
    return (f"Target: {trained_target['target']} (a small Qwen3 the demo trained on the corpus). The drafter trained "
            f"on that target's own greedy answers ({trained_target['answers']}, {trained_target['max_new_tokens']} "
            "tokens each) and is evaluated on held-out prompts of them.")


def build_report(demo_dir: Path, done: dict[str, Path], trained_target: dict[str, Any] | None = None) -> Path:
    """summary.json (per strategy from the probe, the evaluation from notebook 05) and report.html for a finished
    chain (`trained_target`: the chain record's entry for its trained target, when it made one)."""
    probe = json.loads((done["03_throughput_probe"] / "summary.json").read_text())
    evaluation = demo_evaluation(json.loads((done["05_evaluate"] / "summary.json").read_text()))
    write_demo_summary(demo_dir, probe["strategies"], evaluation)
    figures = [done[stem] / f"{name}.json" for stem, name in KEY_FIGURES]
    missing = [str(f) for f in figures if not f.is_file()]
    if missing:
        raise FileNotFoundError(f"the demo report needs figures its notebooks did not write: {missing}")
    return build_demo_report(demo_dir, done, probe["strategies"], figures, title="DFlash Lab demo",
                             evaluation=evaluation, data_note=data_note(trained_target))
