"""`make demo`: the study's notebooks executed in order on the bundled corpus, each a papermill run.

Every notebook gets a run folder of its own; a `runs/<id>_demo/` folder records the chain (`chain.json`: which
notebook ran in which folder, with what parameters), `summary.json` (the per-strategy figures of the throughput
probe under `strategies`, notebook 05's evaluation of the training run under `evaluation`), and `report.html`:
one self-contained page with both summaries, the key figures and links to every run.

Parameters a notebook receives: the preset's values of the names it declares, then `overrides` (every notebook
that accepts a name gets it: a notebook that builds its config from a preset takes every config field, e.g. a
target and tokenizer made by a first step for the whole chain), then what its CHAIN link derives from the folders
of the notebooks before it.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Callable

from .runs import REPO_ROOT, accepted_parameters, execute, new_run_dir, write_json

NOTEBOOKS = REPO_ROOT / "notebooks"

# (notebook stem, parameters derived from the run folders of the notebooks before it)
Link = tuple[str, Callable[[dict[str, Path]], dict[str, Any]]]
CHAIN: list[Link] = [
    ("01_length_analysis", lambda prev: {}),
    ("02_bucket_optimization", lambda prev: {"lengths_from": str(prev["01_length_analysis"])}),
    ("03_throughput_probe", lambda prev: {"plan": str(prev["02_bucket_optimization"] / "plan.json")}),
    ("04_train", lambda prev: {"plan": str(prev["02_bucket_optimization"] / "plan.json")}),
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


def run_demo(preset_name: str = "demo", tag: str = "demo", root: str | Path | None = None,
             overrides: dict[str, Any] | None = None) -> Path:
    """Run every notebook of the chain with `preset_name` (plus `overrides` where a notebook takes them).

    Returns the demo folder. A failing notebook raises; the folders of the notebooks before it stay intact.
    """
    demo_dir = new_run_dir("demo", tag if tag != "demo" else "", root)
    done: dict[str, Path] = {}
    record: dict[str, Any] = {"preset": preset_name, "runs": []}
    for stem, derive in CHAIN:
        notebook = NOTEBOOKS / f"{stem}.ipynb"
        accepted = accepted_parameters(notebook)  # a notebook building its config takes every config field
        params = {k: v for k, v in {**(overrides or {}), **derive(done)}.items() if k in accepted}
        t0 = time.perf_counter()
        print(f"[demo] {stem} ...", flush=True)
        run_dir = execute(notebook, params, preset_name=preset_name, tag=tag, root=root)
        done[stem] = run_dir
        record["runs"].append({"notebook": stem, "run_dir": str(run_dir), "params": params,
                               "seconds": round(time.perf_counter() - t0, 1)})
        print(f"[demo] {stem} done in {time.perf_counter() - t0:.0f} s -> {run_dir}", flush=True)
        write_json(demo_dir / "chain.json", record)
    build_report(demo_dir, done)
    return demo_dir


def build_report(demo_dir: Path, done: dict[str, Path]) -> Path:
    """summary.json (per strategy from the probe, the evaluation from notebook 05) and report.html for a finished
    chain."""
    from .report.demo import build_demo_report, demo_evaluation, write_demo_summary

    probe = json.loads((done["03_throughput_probe"] / "summary.json").read_text())
    evaluation = demo_evaluation(json.loads((done["05_evaluate"] / "summary.json").read_text()))
    write_demo_summary(demo_dir, probe["strategies"], evaluation)
    figures = [done[stem] / f"{name}.json" for stem, name in KEY_FIGURES]
    missing = [str(f) for f in figures if not f.is_file()]
    if missing:
        raise FileNotFoundError(f"the demo report needs figures its notebooks did not write: {missing}")
    return build_demo_report(demo_dir, done, probe["strategies"], figures, title="DFlash Lab demo",
                             evaluation=evaluation)
