"""Crash-safe checkpoints: atomic directory writes, sha256 manifests, verified loads with fallback.

On disk, one checkpoint is one directory `ckpt-<step:08d>/` in a checkpoint folder:
```
ckpt-00000120/
  state.pt        torch.save of the caller's state dict (tensors, numbers, strings, None, lists/tuples/dicts)
  manifest.json   format version, step, config hash, world size, sha256 and size of every file, JSON meta
```
A save writes everything into a hidden temp directory in the same folder, fsyncs each file and the directory,
then renames it to `ckpt-<step>` and fsyncs the folder: a reader sees either the whole checkpoint or none of
it, and `kill -9` at any moment leaves the previous ones untouched. Older checkpoints are deleted only after the
new one is durable. Loads use `torch.load(weights_only=True)`, so a checkpoint can never run code on load.
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import errno
import hashlib
import json
import logging
import os
import re
import secrets
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .config import Config

log = logging.getLogger(__name__)

FORMAT_VERSION = 1  # bump when the on-disk layout changes; loads refuse other versions
STATE_FILE = "state.pt"  # torch.save of the state dict
MANIFEST_FILE = "manifest.json"  # plain JSON metadata and checksums
_CKPT_RE = re.compile(r"^ckpt-(\d{8,})$")
_TEMP_RE = re.compile(r"^\.(?:tmp|trash)-.*-(\d+)-[0-9a-f]{8}$")  # .tmp-<name>-<pid>-<hex>, .trash-<name>-<pid>-<hex>
_HASH_CHUNK = 1 << 20  # bytes read per sha256 update when verifying

# Settings that may change between a stop and a resume without changing the batches, anchors or losses.
RESUME_NEUTRAL_KEYS = frozenset({
    "fresh", "ckpt_every", "keep_checkpoints", "log_every", "max_bad_steps", "dist_timeout_s", "wandb_mode",
    "wandb_project", "out_dir", "queue_timeout_s", "close_timeout_s", "prefetch", "hs_queue", "workers",
    "cache_dir", "full_run_epochs", "full_run_samples", "stop_at_step", "probe_steps", "probe_rounds",
    "target_threads", "eval_every", "eval_samples",  # held-out evaluation reads the drafter, never steers it
})
# TEST HOOK, used only by the fault-injection tests (tests/test_faults.py): when set, every save pauses this many
# seconds after writing state.pt and before the manifest and the rename, announcing it on stderr, so that a test
# can `kill -9` the process in the middle of a save. Never set it in a real run.
SAVE_DELAY_ENV = "DFLASH_TEST_SAVE_DELAY_S"


class CheckpointError(RuntimeError):
    """A checkpoint could not be written, or one on disk is missing, partial, corrupt or unreadable."""


class CheckpointMismatchError(CheckpointError):
    """The checkpoints in a folder belong to another config or world size: resuming would mix two runs."""


@dataclass(frozen=True)
class FileEntry:
    sha256: str  # hex digest of the file's bytes
    bytes: int  # file size in bytes


@dataclass(frozen=True)
class Manifest:
    format_version: int  # FORMAT_VERSION of the writer
    step: int  # optimizer steps completed when the checkpoint was taken
    config_hash: str  # the run's config hash (see resume_config_hash)
    world_size: int  # number of processes of the run that wrote it
    files: dict[str, FileEntry]  # file name inside the checkpoint directory -> checksum and size
    meta: dict[str, Any]  # free-form JSON the caller attached (e.g. the config as a dict, epoch)
    created_utc: str  # ISO-8601 time of the save

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=1, sort_keys=True)

    @classmethod
    def from_json(cls, text: str, where: Path) -> "Manifest":
        """Parse a manifest, refusing anything malformed with a CheckpointError naming `where`."""
        try:
            raw = json.loads(text)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{where}: manifest is not valid JSON ({e})") from None
        if not isinstance(raw, dict):
            raise CheckpointError(f"{where}: manifest must be a JSON object, got {type(raw).__name__}")
        want = {f.name: f.type for f in dataclasses.fields(cls)}
        if set(raw) != set(want):
            raise CheckpointError(f"{where}: manifest keys {sorted(raw)} differ from the expected {sorted(want)}")
        _expect(where, "format_version", raw["format_version"], int)
        if raw["format_version"] != FORMAT_VERSION:
            raise CheckpointError(f"{where}: checkpoint format version {raw['format_version']} is not the "
                                  f"supported version {FORMAT_VERSION}")
        _expect(where, "step", raw["step"], int)
        _expect(where, "config_hash", raw["config_hash"], str)
        _expect(where, "world_size", raw["world_size"], int)
        _expect(where, "meta", raw["meta"], dict)
        _expect(where, "created_utc", raw["created_utc"], str)
        _expect(where, "files", raw["files"], dict)
        files = {}
        for name, entry in raw["files"].items():
            if not isinstance(entry, dict) or set(entry) != {"sha256", "bytes"} \
                    or not isinstance(entry["sha256"], str) or type(entry["bytes"]) is not int:
                raise CheckpointError(f"{where}: manifest entry for file {name!r} is malformed: {entry!r}")
            if "/" in name or name in ("", ".", "..", MANIFEST_FILE):
                raise CheckpointError(f"{where}: manifest names an invalid file {name!r}")
            files[name] = FileEntry(entry["sha256"], entry["bytes"])
        if STATE_FILE not in files:
            raise CheckpointError(f"{where}: manifest does not list {STATE_FILE}")
        return cls(**{**raw, "files": files})


def _expect(where: Path, key: str, value: Any, typ: type) -> None:
    if type(value) is not typ:
        raise CheckpointError(f"{where}: manifest field {key!r} must be {typ.__name__}, got {value!r}")


# ---------------------------------------------------------------------------------------------------------
# Config hash for resume


def resume_config_hash(config: Config) -> str:
    """Short stable hash of every setting that shapes the training trajectory.

    Unlike `Config.hash()`, it leaves out RESUME_NEUTRAL_KEYS (logging cadence, queue sizes, `fresh`, ...), so a
    run stopped and resumed with, say, another `ckpt_every` is still the same run.
    """
    params = {k: v for k, v in config.to_params().items() if k not in RESUME_NEUTRAL_KEYS}
    return hashlib.sha256(json.dumps(params, sort_keys=True).encode()).hexdigest()[:16]


# ---------------------------------------------------------------------------------------------------------
# Saving


def save_checkpoint(ckpt_dir: str | Path, state: dict[str, Any], step: int, *, config_hash: str,
                    world_size: int = 1, keep_last: int = 3, meta: dict[str, Any] | None = None) -> Path:
    """Write `state` atomically as `<ckpt_dir>/ckpt-<step:08d>/` and keep the newest `keep_last` checkpoints.

    `state` may hold only what `torch.load(weights_only=True)` reads back: tensors, bool/int/float/str/None and
    lists/tuples/dicts of them (optimizer and scheduler `state_dict()`s qualify; convert RNG states with
    `dflash_lib.rng.capture_rng` and numpy arrays with `torch.from_numpy`). `meta` is stored as JSON in the
    manifest. An existing checkpoint of the same step is replaced. Returns the checkpoint directory.

    Raises CheckpointError (naming the folder) when the disk refuses the write (full disk, quota, file-size
    limit); the temp files are then removed and earlier checkpoints are untouched.
    """
    ckpt_dir = Path(ckpt_dir)
    if type(step) is not int or step < 0:
        raise CheckpointError(f"step must be an int >= 0, got {step!r}")
    if type(keep_last) is not int or keep_last < 1:
        raise CheckpointError(f"keep_last must be an int >= 1, got {keep_last!r}")
    if type(world_size) is not int or world_size < 1:
        raise CheckpointError(f"world_size must be an int >= 1, got {world_size!r}")
    if not isinstance(config_hash, str) or not config_hash:
        raise CheckpointError(f"config_hash must be a non-empty string, got {config_hash!r}")
    if not isinstance(state, dict):
        raise CheckpointError(f"state must be a dict, got {type(state).__name__}")
    check_loadable(state)
    meta = {} if meta is None else meta
    try:
        meta = json.loads(json.dumps(meta, allow_nan=False))  # a JSON-faithful copy, refused early if not JSON
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"meta must be plain JSON (dict of str/int/float/bool/None/lists/dicts): {e}") from None
    if not isinstance(meta, dict):
        raise CheckpointError(f"meta must be a dict, got {type(meta).__name__}")

    final = ckpt_dir / f"ckpt-{step:08d}"
    tmp = ckpt_dir / f".tmp-{final.name}-{os.getpid()}-{secrets.token_hex(4)}"
    try:
        ckpt_dir.mkdir(parents=True, exist_ok=True)
        _remove_stale_temps(ckpt_dir)
        tmp.mkdir()
        entry = _write_state(tmp / STATE_FILE, state)
        _test_pause(step, tmp)
        manifest = Manifest(FORMAT_VERSION, step, config_hash, world_size, {STATE_FILE: entry}, meta,
                            _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"))
        _write_durable(tmp / MANIFEST_FILE, manifest.to_json().encode())
        _fsync_dir(tmp)
        _install(tmp, final)
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        code = errno.errorcode.get(e.errno, str(e.errno)) if e.errno else "?"
        previous = [p.name for p in list_checkpoints(ckpt_dir) if p != final] if ckpt_dir.is_dir() else []
        raise CheckpointError(
            f"could not write the checkpoint of step {step} to {ckpt_dir}: {e.strerror or e} [{code}] "
            f"(file {e.filename or '?'}); the partial files were removed and the previous checkpoints "
            f"({', '.join(previous[-1:]) or 'none'}) are untouched") from e
    except BaseException:  # KeyboardInterrupt, a signal handler's exception: leave no temp behind
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    try:
        _prune(ckpt_dir, keep_last)
    except OSError as e:  # the new checkpoint is durable; failing to delete old ones must not fail the save
        log.warning("checkpoint %s saved, but pruning older checkpoints in %s failed: %s", final, ckpt_dir, e)
    return final


def _test_pause(step: int, tmp: Path) -> None:
    """The SAVE_DELAY_ENV test hook (a no-op unless the variable is set)."""
    raw = os.environ.get(SAVE_DELAY_ENV)
    if not raw:
        return
    try:
        delay = float(raw)
    except ValueError:
        raise CheckpointError(f"{SAVE_DELAY_ENV}={raw!r} must be a number of seconds") from None
    print(f"{SAVE_DELAY_ENV}: pausing {delay} s inside the save of step {step} ({tmp.name})", file=sys.stderr,
          flush=True)
    time.sleep(delay)


def check_loadable(state: Any, path: str = "state") -> None:
    """Refuse (CheckpointError naming the key path) any value `torch.load(weights_only=True)` would reject."""
    if state is None or isinstance(state, (bool, int, float, str, torch.Tensor, torch.Size, torch.dtype)):
        return
    if isinstance(state, dict):
        for k, v in state.items():
            if not isinstance(k, (str, int)) or isinstance(k, bool):
                raise CheckpointError(f"{path} has a key {k!r} of type {type(k).__name__}; keys must be str or int")
            check_loadable(v, f"{path}[{k!r}]")
        return
    if isinstance(state, (list, tuple)):
        for i, v in enumerate(state):
            check_loadable(v, f"{path}[{i}]")
        return
    raise CheckpointError(
        f"{path} is a {type(state).__module__}.{type(state).__qualname__}; a checkpoint holds only tensors, "
        f"bool/int/float/str/None and lists/tuples/dicts of them (convert numpy arrays with torch.from_numpy, "
        f"numpy scalars with .item(), RNG states with dflash_lib.rng.capture_rng)")


class _HashingWriter:
    """File wrapper for torch.save: hashes and counts the bytes, and remembers an OSError that torch would
    otherwise turn into an opaque RuntimeError."""

    def __init__(self, f: Any) -> None:
        self.f = f
        self.sha = hashlib.sha256()
        self.bytes = 0
        self.error: OSError | None = None

    def write(self, data: bytes) -> int:
        try:
            n = self.f.write(data)
        except OSError as e:
            self.error = e
            raise
        self.sha.update(data)
        self.bytes += len(data)
        return n

    def flush(self) -> None:
        self.f.flush()


def _write_state(path: Path, state: dict[str, Any]) -> FileEntry:
    with open(path, "wb") as f:
        writer = _HashingWriter(f)
        try:
            torch.save(state, writer)
        except RuntimeError:
            if writer.error is not None:
                raise writer.error from None
            raise
        f.flush()
        os.fsync(f.fileno())
    return FileEntry(writer.sha.hexdigest(), writer.bytes)


def _write_durable(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _install(tmp: Path, final: Path) -> None:
    """Rename the finished temp directory to its final name (the commit point) and make the rename durable."""
    parent = final.parent
    if final.exists():  # the same step saved again (e.g. after a resume): swap the old one out first
        trash = parent / f".trash-{final.name}-{os.getpid()}-{secrets.token_hex(4)}"
        os.replace(final, trash)
        os.replace(tmp, final)
        _fsync_dir(parent)
        shutil.rmtree(trash, ignore_errors=True)
    else:
        os.replace(tmp, final)
        _fsync_dir(parent)


def _pid_alive(pid: int) -> bool:
    if pid == os.getpid():
        return False  # our own leftovers: this process is not saving anything else right now
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _remove_stale_temps(ckpt_dir: Path) -> None:
    """Delete temp/trash directories left by saves that died (kill -9, power loss)."""
    for p in ckpt_dir.iterdir():
        m = _TEMP_RE.match(p.name)
        if m and not _pid_alive(int(m.group(1))):
            shutil.rmtree(p, ignore_errors=True)


def _prune(ckpt_dir: Path, keep_last: int) -> None:
    """Keep the newest `keep_last` checkpoints that look complete; delete every other checkpoint directory."""
    entries = list_checkpoints(ckpt_dir)
    complete = [p for p in entries if _looks_complete(p)]
    keep = set(complete[-keep_last:])
    for p in entries:
        if p in keep:
            continue
        if p not in complete:
            log.warning("deleting incomplete or corrupt checkpoint %s", p)
        trash = ckpt_dir / f".trash-{p.name}-{os.getpid()}-{secrets.token_hex(4)}"
        os.replace(p, trash)  # one atomic step out of sight, so a crash mid-delete leaves no half checkpoint
        shutil.rmtree(trash, ignore_errors=True)


def _looks_complete(path: Path) -> bool:
    """Cheap check (manifest parses, file sizes match) used for pruning; loads verify the sha256 too."""
    try:
        manifest = read_manifest(path)
        return all((path / n).stat().st_size == e.bytes for n, e in manifest.files.items())
    except (CheckpointError, OSError):
        return False


# ---------------------------------------------------------------------------------------------------------
# Loading


def list_checkpoints(ckpt_dir: str | Path) -> list[Path]:
    """The `ckpt-<step>` directories in `ckpt_dir`, oldest step first (temp directories are never listed)."""
    ckpt_dir = Path(ckpt_dir)
    if not ckpt_dir.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in ckpt_dir.iterdir() if (m := _CKPT_RE.match(p.name)) and p.is_dir()]
    return [p for _, p in sorted(found)]


def read_manifest(path: str | Path) -> Manifest:
    """Parse `<path>/manifest.json`; CheckpointError naming the file when missing or malformed."""
    mpath = Path(path) / MANIFEST_FILE
    try:
        text = mpath.read_bytes().decode("utf-8")
    except FileNotFoundError:
        raise CheckpointError(f"{mpath} is missing (an interrupted or foreign checkpoint)") from None
    except (OSError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{mpath} cannot be read: {e}") from None
    return Manifest.from_json(text, mpath)


def verify_checkpoint(path: str | Path) -> Manifest:
    """Check that every file the manifest lists exists with its recorded size and sha256; return the manifest."""
    path = Path(path)
    manifest = read_manifest(path)
    m = _CKPT_RE.match(path.name)
    if m and int(m.group(1)) != manifest.step:
        raise CheckpointError(f"{path / MANIFEST_FILE} records step {manifest.step}, not the directory's step")
    for name, entry in manifest.files.items():
        fpath = path / name
        try:
            size = fpath.stat().st_size
            if size != entry.bytes:
                raise CheckpointError(f"{fpath} has {size} bytes, the manifest records {entry.bytes} (truncated?)")
            sha = hashlib.sha256()
            with open(fpath, "rb") as f:
                while chunk := f.read(_HASH_CHUNK):
                    sha.update(chunk)
        except FileNotFoundError:
            raise CheckpointError(f"{fpath} is missing") from None
        except OSError as e:
            raise CheckpointError(f"{fpath} cannot be read: {e}") from None
        if sha.hexdigest() != entry.sha256:
            raise CheckpointError(f"{fpath} fails its checksum (sha256 {sha.hexdigest()[:12]}... != recorded "
                                  f"{entry.sha256[:12]}...): the file is corrupt")
    return manifest


def check_compatible(manifest: Manifest, path: Path, config_hash: str, world_size: int) -> None:
    """Refuse (CheckpointMismatchError) a checkpoint of another config or world size."""
    if manifest.config_hash != config_hash:
        raise CheckpointMismatchError(
            f"run folder {path.parent} holds checkpoints of another config (hash {manifest.config_hash} != "
            f"{config_hash}); use --fresh or another --run-dir")
    if manifest.world_size != world_size:
        raise CheckpointMismatchError(
            f"checkpoint {path} was written by {manifest.world_size} process(es) but this run has world size "
            f"{world_size}; resume with --nproc-per-node {manifest.world_size}, or use --fresh or another --run-dir")


def load_checkpoint(path: str | Path, map_location: str | torch.device = "cpu") -> tuple[dict[str, Any], Manifest]:
    """Verify one checkpoint directory and load its state with `weights_only=True`."""
    path = Path(path)
    manifest = verify_checkpoint(path)
    try:
        state = torch.load(path / STATE_FILE, map_location=map_location, weights_only=True)
    except Exception as e:  # noqa: BLE001 - torch raises many types for unreadable files; name the file
        raise CheckpointError(f"{path / STATE_FILE} cannot be loaded with weights_only=True: "
                              f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from None
    if not isinstance(state, dict):
        raise CheckpointError(f"{path / STATE_FILE} holds a {type(state).__name__}, not a state dict")
    return state, manifest


def load_latest(ckpt_dir: str | Path, config_hash: str, world_size: int = 1,
                map_location: str | torch.device = "cpu") -> tuple[dict[str, Any], Path] | None:
    """Load the newest checkpoint in `ckpt_dir` that verifies; None when the folder holds no checkpoint.

    A corrupt or partial checkpoint is skipped with a warning naming the file and the reason, and the one
    before it is tried. Raises CheckpointMismatchError when a checkpoint belongs to another config hash or
    world size, and CheckpointError when checkpoints exist but none verifies.
    """
    ckpt_dir = Path(ckpt_dir)
    skipped: list[str] = []
    for path in reversed(list_checkpoints(ckpt_dir)):
        try:
            check_compatible(read_manifest(path), path, config_hash, world_size)
            state, _ = load_checkpoint(path, map_location)
        except CheckpointMismatchError:
            raise
        except CheckpointError as e:
            log.warning("skipping checkpoint %s: %s", path.name, e)
            skipped.append(f"{path.name}: {e}")
            continue
        if skipped:
            log.warning("resuming from %s after skipping %d newer checkpoint(s)", path.name, len(skipped))
        return state, path
    if skipped:
        raise CheckpointError(f"no loadable checkpoint in {ckpt_dir}; refused: " + "; ".join(skipped)
                              + ". Use --fresh to start over or another --run-dir")
    return None


def fresh_run_dir(ckpt_dir: str | Path) -> int:
    """Delete every checkpoint (and temp leftover) in `ckpt_dir`, nothing else; returns how many were removed."""
    ckpt_dir = Path(ckpt_dir)
    if not ckpt_dir.is_dir():
        return 0
    removed = 0
    for p in ckpt_dir.iterdir():
        if (_CKPT_RE.match(p.name) or _TEMP_RE.match(p.name)) and p.is_dir():
            trash = ckpt_dir / f".trash-{p.name}-{os.getpid()}-{secrets.token_hex(4)}"
            os.replace(p, trash)  # out of sight first: a crash mid-delete leaves no half checkpoint behind
            shutil.rmtree(trash)
            removed += 1
    if removed:
        _fsync_dir(ckpt_dir)
    return removed

