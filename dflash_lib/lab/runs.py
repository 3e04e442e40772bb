"""Headless notebook execution into run folders (the folders themselves: `rundir`).

A run is one immutable folder `runs/<UTC-timestamp>_<stem>[_<tag>]/` holding the executed notebook, the
parameters it ran with (`params.json`), where and with what it ran (`env.json`) and whatever the notebook wrote.
"""

from __future__ import annotations

import ast
import logging
import os
from pathlib import Path
from typing import Any, Callable, Mapping

from dflash_lib.config import (FLAT_FIELDS, Config, ConfigError, coerce, from_params, new_target_tokenizer,
                               preset as get_preset)
from dflash_lib.rundir import REPO_ROOT, environment, new_run_dir, write_json


def notebook_parameters(notebook: Path) -> dict[str, Any]:
    """The defaults of the notebook's cell tagged `parameters` ({name: literal value})."""
    import nbformat  # the notebook stack: only notebook runs need it

    nb = nbformat.read(notebook, as_version=4)
    cells = [c for c in nb.cells if "parameters" in c.get("metadata", {}).get("tags", [])]
    if len(cells) != 1:
        raise ConfigError(f"{notebook}: expected exactly one cell tagged 'parameters', found {len(cells)}")
    out: dict[str, Any] = {}
    for node in ast.parse(cells[0].source).body:
        if not (isinstance(node, (ast.Assign, ast.AnnAssign))):
            raise ConfigError(f"{notebook}: the parameters cell may hold only `name = literal` lines")
        target = node.targets[0] if isinstance(node, ast.Assign) else node.target
        try:
            out[target.id] = ast.literal_eval(node.value)
        except (ValueError, AttributeError):
            raise ConfigError(f"{notebook}: parameter {getattr(target, 'id', '?')!r} is not a flat literal") from None
    return out


PRESET = "preset"  # the parameter a notebook declares when it builds its config (`notebook_config`) from a preset


def builds_config(declared: dict[str, Any]) -> bool:
    """Whether a notebook with these parameters builds its whole config from a preset (it declares `preset`)."""
    return PRESET in declared


def accepted_parameters(notebook: Path) -> set[str]:
    """The names `-p` may set for `notebook`: the ones its parameters cell declares and, for a notebook that
    builds its config from a preset (`notebook_config`), every flat config field."""
    declared = notebook_parameters(notebook)
    return set(declared) | (set(FLAT_FIELDS) if builds_config(declared) else set())


def resolve_params(notebook: Path, params: dict[str, Any], preset_name: str = "") -> dict[str, Any]:
    """Validate `params` (and a preset) for `notebook` BEFORE any kernel starts.

    A notebook declares config fields (and `preset`, when it builds its config with `notebook_config`). A key of
    `params` must be a name the notebook accepts (`accepted_parameters`); values are parsed and type-checked
    against the config dataclasses, and the whole combination must form a valid `Config`. `-p preset NAME` is
    the same as `preset_name`. A notebook declaring `preset` runs its own default preset when none is given.
    Returns the parameters to inject: the preset's values of the names the notebook declares, overlaid by
    `params`, plus `preset` for a notebook that builds its config from one.
    """
    declared = notebook_parameters(notebook)
    for key in declared:
        if key not in FLAT_FIELDS and key != PRESET:
            raise ConfigError(f"{notebook.name}: parameter {key!r} is not a config field")
    params = dict(params)
    if PRESET in params:
        if PRESET not in declared:
            raise ConfigError(f"parameter {PRESET!r} is not a parameter of {notebook.name} (it takes no preset)")
        given = str(params.pop(PRESET))
        if preset_name and given != preset_name:
            raise ConfigError(f"preset given twice: --preset {preset_name} and -p preset {given}")
        preset_name = given
    if builds_config(declared) and not preset_name:
        preset_name = str(declared[PRESET])
    base = get_preset(preset_name) if preset_name else None
    chosen: dict[str, Any] = {}
    if base is not None:
        chosen = {k: v for k, v in base.to_params().items() if k in declared}
    accepted = accepted_parameters(notebook)
    for key, value in params.items():
        if key not in accepted:
            hint = "" if key in FLAT_FIELDS else " and is not a config field"
            more = " and any config field" if builds_config(declared) else ""
            raise ConfigError(f"parameter {key!r} is not a parameter of {notebook.name}{hint}; "
                              f"it takes: {', '.join(sorted(declared))}{more}")
        chosen[key] = coerce(key, value)
    own = new_target_tokenizer(params, (base or Config()).model.target)  # as from_params would: the notebook
    if own is not None and "tokenizer" in accepted:  # receives its parameters cell's `tokenizer` otherwise
        chosen["tokenizer"] = own
    defaults = {k: coerce(k, v) for k, v in declared.items() if k != PRESET}
    if builds_config(declared):
        from_params({**defaults, **chosen}, base)  # the config the notebook will build: cross-field checks
        # a preset file by its absolute path: the kernel runs in another folder
        chosen[PRESET] = str(Path(preset_name).resolve()) if preset_name.endswith(".json") else preset_name
    else:
        from_params({**defaults, **chosen})
    return chosen


def notebook_settings(namespace: Mapping[str, Any]) -> dict[str, Any]:
    """The flat config fields defined in a notebook's namespace: its parameters cell and whatever papermill
    injected (also `-p` names the cell does not declare), {name: value}."""
    return {k: namespace[k] for k in FLAT_FIELDS if k in namespace}


def notebook_config(namespace: Mapping[str, Any], say: Callable[[str], None] = print) -> Config:
    """The config of a notebook run, from its namespace (`globals()` in the cell after the parameters cell):
    the preset the namespace's `preset` names, overlaid by every flat config field defined there (the
    parameters cell and the names papermill injected); a notebook-02 run folder as `plan` means its plan.json.
    Prints (`say`) the preset and the values that differ from it. No other cell of the notebook may bind a
    config field's name (tests/test_notebook_params.py): each parameter is written once, in its parameters cell."""
    if PRESET not in namespace:
        raise ConfigError(f"notebook_config: no {PRESET!r} in the notebook's namespace (declare it in the "
                          f"parameters cell)")
    name = namespace[PRESET]
    if not isinstance(name, str):
        raise ConfigError(f"parameter {PRESET!r} must be a preset name, got {type(name).__name__}: {name!r}")
    base = get_preset(name)
    settings = notebook_settings(namespace)
    plan = settings.get("plan")
    if isinstance(plan, str) and plan and Path(plan).is_dir():  # a notebook-02 run folder: its plan.json
        settings["plan"] = str(Path(plan) / "plan.json")
    cfg = from_params(settings, base)
    was, now = base.to_params(), cfg.to_params()
    changed = {k: now[k] for k in settings if now[k] != was[k]}
    say(f"config: preset {name}" + (f"; changed here: {', '.join(f'{k}={v!r}' for k, v in changed.items())}"
                                    if changed else ""))
    return cfg


def execute(notebook: str | Path, params: dict[str, Any] | None = None, *, preset_name: str = "", tag: str = "",
            root: str | Path | None = None) -> Path:
    """Execute `notebook` with papermill into a new run folder and return that folder.

    Parameters are validated first (a `ConfigError` before anything is created). The folder gets the executed
    notebook, `params.json`, `env.json` and whatever the notebook writes (it receives `out_dir` = the folder, so
    `params` may not hold one).
    """
    notebook = find_notebook(notebook)
    if "out_dir" in (params or {}):  # it would be overwritten below: refuse it rather than ignore it
        raise ConfigError(f"parameter 'out_dir' is not for `run`: {notebook.name} writes into the new run folder "
                          f"runs/<id>/ it makes (name it with --tag)")
    chosen = resolve_params(notebook, params or {}, preset_name)
    run_dir = new_run_dir(notebook.stem, tag, root)
    if "out_dir" in accepted_parameters(notebook):
        chosen["out_dir"] = str(run_dir.resolve())
    write_json(run_dir / "params.json", {"notebook": notebook.name, "preset": chosen.get(PRESET, preset_name),
                                         "params": chosen})
    write_json(run_dir / "env.json", environment())
    _quiet_kernel()
    import papermill as pm  # the notebook stack (heavy): only notebook runs need it

    pm.execute_notebook(str(notebook), str(run_dir / notebook.name), parameters=chosen, kernel_name="python3",
                        cwd=str(REPO_ROOT), progress_bar=False, log_output=False, report_mode=False,
                        kernel_manager_class=_ipc_kernel_manager())
    return run_dir


def notebook_names() -> list[str]:
    """The stems of the notebooks under notebooks/ (what `run NAME` takes), sorted."""
    return sorted(p.stem for p in (REPO_ROOT / "notebooks").glob("*.ipynb"))


def find_notebook(name: str | Path) -> Path:
    """A notebook by path, or by name (with or without .ipynb) under notebooks/."""
    path = Path(name)
    for candidate in (path, path.with_name(path.name + ".ipynb"), REPO_ROOT / "notebooks" / path.name,
                      REPO_ROOT / "notebooks" / (path.name + ".ipynb")):
        if candidate.is_file() and candidate.suffix == ".ipynb":
            return candidate
    raise ConfigError(f"notebook not found: {name} (give a path or a name under {REPO_ROOT / 'notebooks'})")


def _ipc_kernel_manager() -> type:
    """A kernel manager on local IPC sockets: no TCP ports, so no 'unencrypted TCP' warning and no port races."""
    from jupyter_client.manager import AsyncKernelManager  # the notebook stack: only notebook runs need it

    class IPCKernelManager(AsyncKernelManager):
        def __init__(self, **kwargs: Any) -> None:
            kwargs.setdefault("transport", "ipc")
            super().__init__(**kwargs)

    return IPCKernelManager


def _quiet_kernel() -> None:
    """Silence kernel start-up chatter (debugger and frozen-module warnings, papermill's INFO logging)."""
    os.environ.setdefault("PYDEVD_DISABLE_FILE_VALIDATION", "1")
    os.environ.setdefault("WANDB_SILENT", "true")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ["PYTHONWARNINGS"] = "ignore::DeprecationWarning"
    for name in ("papermill", "traitlets", "nbclient", "asyncio"):
        logging.getLogger(name).setLevel(logging.ERROR)
