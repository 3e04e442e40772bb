"""Crash-safe distributed checkpoints on `torch.distributed.checkpoint` (DCP): every rank writes its own shard.

On disk, one checkpoint is one directory `ckpt-<step:08d>/` in a checkpoint folder:
```
ckpt-00000120/
  dcp/            DCP: .metadata + __<rank>_<i>.distcp, the TENSORS of the state, each rank writing its part
                  (FSDP shards are disjoint; replicated DDP tensors are spread over the ranks by DCP's dedup)
  objects.pt      the rest of the state (numbers, strings, lists, dicts; torch.save by rank 0, read weights_only)
  rank-<r>.pt     each rank's own state (its RNG streams), saved alongside by that rank
  manifest.json   the completion marker, written LAST: format, step, config hash, world size, size and sha256
                  of every file above (each rank hashes the files it wrote), JSON meta
```
A save writes everything into a hidden temp directory in the same folder (named by rank 0, shared by all
ranks), fsyncs each file, then rank 0 writes the manifest, fsyncs it and the directory, renames the directory
to `ckpt-<step>` and fsyncs the folder: a reader sees either the whole checkpoint or none of it, a folder without
its manifest is skipped, and `kill -9` at any moment leaves the previous ones untouched. Older checkpoints are
deleted only after the new one is durable. With `async_save` the tensors are staged in host memory and written by
a background thread; `PendingSave.wait()` (the trainer calls it at the next save and at the end) commits.

Loads verify sizes and checksums first. `load_checkpoint` reads a whole checkpoint as plain tensors in one
process (export, tests); `load_into` reads the tensors in place into a template of another sharding (DCP
reshards: a checkpoint of W ranks loads at any world size, DDP or FSDP). Nothing is ever unpickled: objects and
rank files are read with `torch.load(weights_only=True)`. Every rank must see the same folder (a shared
filesystem across nodes).

Every random stream a run draws from is captured and restored with it (`capture_rng`, `restore_rng`), in a
form a weights_only checkpoint can hold. Covered: python `random`, numpy's global state, torch CPU, torch CUDA (every device, when available) and any
named generator the caller owns (the anchor `torch.Generator`, a sampler's `np.random.Generator`). Torch
states stay uint8 tensors; python and numpy states become JSON strings (exact for numpy's 128-bit integers),
so `torch.load(weights_only=True)` reads the result back without unpickling any object.

`export_source` (the `export` command) finds a run's newest checkpoint and hands its drafter weights to
models/export.py, which writes the serving layout.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as _dt
import errno
import hashlib
import json
import logging
import os
import random
import re
import secrets
import shutil
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Union

import numpy as np
import torch
import torch.distributed as dist

from dflash_lib.config import TrainConfig
from dflash_lib.train import distributed

log = logging.getLogger(__name__)

FORMAT_VERSION = 2  # bump when the on-disk layout changes; loads refuse other versions (2: DCP shards)
DCP_DIR = "dcp"  # torch.distributed.checkpoint folder of the state's tensors
OBJECTS_FILE = "objects.pt"  # the state without its tensors (placeholders name them)
RANK_FILE = "rank-{rank}.pt"  # one rank's own state
MANIFEST_FILE = "manifest.json"  # plain JSON metadata and checksums: the completion marker, written last
_CKPT_RE = re.compile(r"^ckpt-(\d{8,})$")
_TEMP_RE = re.compile(r"^\.(?:tmp|trash)-.*-(\d+)-[0-9a-f]{8}$")  # .tmp-<name>-<pid>-<hex>, .trash-<name>-<pid>-<hex>
_RANK_RE = re.compile(r"^rank-(\d+)\.pt$")
_HASH_CHUNK = 1 << 20  # bytes read per sha256 update
_TENSOR = "__dcp_tensor__"  # placeholder key in objects.pt: {_TENSOR: "<key of the tensor in dcp/>"}

# TEST HOOK, used only by the fault-injection tests (tests/test_faults.py, tests/test_torchrun.py): when set, every
# save pauses this many seconds after every rank wrote its files and before the manifest and the rename (rank 0,
# announced on stderr), so that a test can `kill -9` the job in the middle of a save. Never set it in a real run.
SAVE_DELAY_ENV = "DFLASH_TEST_SAVE_DELAY_S"


class CheckpointError(RuntimeError):
    """A checkpoint could not be written, or one on disk is missing, partial, corrupt or unreadable."""


class CheckpointMismatchError(CheckpointError):
    """The checkpoints in a folder belong to another config: resuming would mix two runs. `manifest`: the
    mismatching checkpoint's (its meta records that run's config; None when not at hand)."""

    def __init__(self, message: str, manifest: Manifest | None = None) -> None:
        super().__init__(message)
        self.manifest = manifest


RNG_FORMAT = 1  # bump when the captured layout changes
NamedGenerator = Union[torch.Generator, np.random.Generator]


class RngStateError(ValueError):
    """A captured RNG state does not match the generators it is being restored into."""


@dataclass(frozen=True)
class FileEntry:
    sha256: str  # hex digest of the file's bytes
    bytes: int  # file size in bytes


@dataclass(frozen=True)
class Manifest:
    format_version: int  # FORMAT_VERSION of the writer
    step: int  # optimizer steps completed when the checkpoint was taken
    config_hash: str  # the run's resume hash (`resume.resume_config_hash`)
    world_size: int  # number of processes of the run that wrote it (a resume may have another)
    files: dict[str, FileEntry]  # path inside the checkpoint directory ("dcp/__0_0.distcp") -> checksum and size
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
            parts = name.split("/")
            if name.startswith("/") or any(p in ("", ".", "..") for p in parts) or name == MANIFEST_FILE \
                    or len(parts) > 2:
                raise CheckpointError(f"{where}: manifest names an invalid file {name!r}")
            files[name] = FileEntry(entry["sha256"], entry["bytes"])
        for required in (OBJECTS_FILE, f"{DCP_DIR}/.metadata"):
            if required not in files:
                raise CheckpointError(f"{where}: manifest does not list {required}")
        return cls(**{**raw, "files": files})


def _expect(where: Path, key: str, value: Any, typ: type) -> None:
    if type(value) is not typ:
        raise CheckpointError(f"{where}: manifest field {key!r} must be {typ.__name__}, got {value!r}")


# ---------------------------------------------------------------------------------------------------------
# The state: tensors for DCP, everything else for objects.pt


def split_state(state: Any, path: str = "") -> tuple[Any, dict[str, torch.Tensor]]:
    """(the state with every tensor replaced by {_TENSOR: key}, {key: tensor}); keys are the '/'-joined paths."""
    if isinstance(state, torch.Tensor):
        return {_TENSOR: path}, {path: state}
    if isinstance(state, dict):
        out, tensors = {}, {}
        for k, v in state.items():
            out[k], sub = split_state(v, f"{path}/{k}" if path else str(k))
            tensors.update(sub)
        return out, tensors
    if isinstance(state, (list, tuple)):
        pairs = [split_state(v, f"{path}/{i}") for i, v in enumerate(state)]
        items = [p[0] for p in pairs]
        tensors = {k: t for _, sub in pairs for k, t in sub.items()}
        return (items if isinstance(state, list) else tuple(items)), tensors
    return state, {}


def join_state(objects: Any, tensors: dict[str, torch.Tensor]) -> Any:
    """Inverse of `split_state`."""
    if isinstance(objects, dict):
        if set(objects) == {_TENSOR}:
            return tensors[objects[_TENSOR]]
        return {k: join_state(v, tensors) for k, v in objects.items()}
    if isinstance(objects, (list, tuple)):
        items = [join_state(v, tensors) for v in objects]
        return items if isinstance(objects, list) else tuple(items)
    return objects


def _tensor_keys(objects: Any) -> list[str]:
    if isinstance(objects, dict):
        if set(objects) == {_TENSOR}:
            return [objects[_TENSOR]]
        return [k for v in objects.values() for k in _tensor_keys(v)]
    if isinstance(objects, (list, tuple)):
        return [k for v in objects for k in _tensor_keys(v)]
    return []


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
        f"numpy scalars with .item(), RNG states with dflash_lib.train.checkpoint.capture_rng)")


# ---------------------------------------------------------------------------------------------------------
# Saving


def _rank_world(group: Any) -> tuple[int, int]:
    if group is None or not (dist.is_available() and dist.is_initialized()):
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def _all_gather(value: Any, group: Any) -> list[Any]:
    """Every rank's JSON-able `value` (the group's timeout bounds the wait); [value] in one process."""
    if _rank_world(group)[1] == 1:
        return [value]
    out: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, value, group=group)
    return out


def _os_error(e: BaseException) -> OSError | None:
    """The OSError behind a failed write: itself, its cause, or the one a DCP CheckpointException wraps."""
    seen = 0
    while e is not None and seen < 10:
        if isinstance(e, OSError):
            return e
        failures = getattr(e, "failures", None)
        if isinstance(failures, dict):
            for exc, _ in failures.values():
                if (found := _os_error(exc)) is not None:
                    return found
        e, seen = e.__cause__ or e.__context__, seen + 1
    return None


def _describe(e: BaseException) -> str:
    os_err = _os_error(e)
    if os_err is not None:
        code = errno.errorcode.get(os_err.errno, str(os_err.errno)) if os_err.errno else "?"
        return f"{os_err.strerror or os_err} [{code}] (file {os_err.filename or '?'})"
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[-1] if text else ''}"


class PendingSave:
    """A checkpoint whose files are being written; `wait()` finishes it (every rank calls it) and returns the
    checkpoint directory. Raises CheckpointError on every rank when any rank failed; the partial files are then
    removed and earlier checkpoints are untouched."""

    def __init__(self, ckpt_dir: Path, tmp: Path, final: Path, step: int, manifest: Callable[[dict], "Manifest"],
                 keep_last: int, group: Any, future: Any, error: str | None,
                 cause: BaseException | None) -> None:
        self.ckpt_dir, self.tmp, self.final, self.step = ckpt_dir, tmp, final, step
        self._manifest, self.keep_last, self.group = manifest, keep_last, group
        self._future, self._error, self._cause = future, error, cause
        self.done: Path | None = None

    def wait(self) -> Path:
        if self.done is not None:
            return self.done
        rank, world = _rank_world(self.group)
        error, cause = self._error, self._cause
        if self._future is not None and error is None:
            try:
                result = self._future
                getattr(result, "upload_completion", result).result()  # async_save: Future or AsyncSaveResponse
            except BaseException as e:  # noqa: BLE001 - DCP raises CheckpointException (a BaseException)
                if isinstance(e, KeyboardInterrupt):
                    raise
                error, cause = _describe(e), e
        entries: dict[str, dict] = {}
        if error is None:
            try:
                entries = _hash_own_files(self.tmp, rank)
            except OSError as e:
                error, cause = _describe(e), e
        gathered = _all_gather({"error": error, "files": entries}, self.group)
        errors = [g["error"] if world == 1 else f"rank {r}: {g['error']}" for r, g in enumerate(gathered) if g["error"]]
        outcome: str | None = None
        if rank == 0:
            try:
                if errors:
                    raise CheckpointError("; ".join(errors))
                files = {k: v for g in gathered for k, v in g["files"].items()}
                _test_pause(self.step, self.tmp)
                manifest = self._manifest({k: FileEntry(**v) for k, v in sorted(files.items())})
                _write_durable(self.tmp / MANIFEST_FILE, manifest.to_json().encode())  # the completion marker
                _fsync_dir(self.tmp)
                _install(self.tmp, self.final)
            except (OSError, CheckpointError) as e:
                shutil.rmtree(self.tmp, ignore_errors=True)
                if isinstance(e, OSError):
                    cause = e
                detail = str(e) if isinstance(e, CheckpointError) else _describe(e)
                previous = [p.name for p in list_checkpoints(self.ckpt_dir) if p != self.final]
                outcome = (f"could not write the checkpoint of step {self.step} to {self.ckpt_dir}: {detail}; the "
                           f"partial files were removed and the previous checkpoints "
                           f"({', '.join(previous[-1:]) or 'none'}) are untouched")
        if world > 1:
            outcome = _all_gather(outcome, self.group)[0]  # rank 0's verdict, on every rank
        if outcome is not None:
            raise CheckpointError(outcome) from (_os_error(cause) or cause if cause is not None else None)
        if rank == 0:
            try:
                _prune(self.ckpt_dir, self.keep_last)
            except OSError as e:  # the new checkpoint is durable; failing to delete old ones must not fail the save
                log.warning("checkpoint %s saved, but pruning older checkpoints in %s failed: %s", self.final,
                            self.ckpt_dir, e)
        self.done = self.final
        return self.final


def start_save(ckpt_dir: str | Path, state: dict[str, Any], step: int, *, config_hash: str,
               keep_last: int = 3, meta: dict[str, Any] | None = None, rank_state: dict[str, Any] | None = None,
               async_save: bool = False, group: Any = None) -> PendingSave:
    """Begin writing `state` as `<ckpt_dir>/ckpt-<step:08d>/`; `.wait()` on the result commits it and keeps the
    newest `keep_last` checkpoints. A collective when `group` (a process group) is given: every rank calls it
    with the same structure of `state` (its tensors may be DTensor shards or replicas), its own `rank_state`,
    and the same step.

    `state` may hold tensors (written by DCP, each rank its part) and what `torch.load(weights_only=True)` reads
    back: bool/int/float/str/None and lists/tuples/dicts (optimizer `state_dict()`s qualify; convert RNG states
    with `dflash_lib.train.checkpoint.capture_rng` and numpy arrays with `torch.from_numpy`); its non-tensor part is written
    by rank 0. `meta` is stored as JSON in the manifest. `async_save`: DCP stages the tensors in host memory and
    writes them in a background thread (`dcp.async_save`); this call returns once staged.
    """
    import torch.distributed.checkpoint as dcp  # heavy to import; only checkpoint I/O needs it

    ckpt_dir = Path(ckpt_dir)
    if type(step) is not int or step < 0:
        raise CheckpointError(f"step must be an int >= 0, got {step!r}")
    if type(keep_last) is not int or keep_last < 1:
        raise CheckpointError(f"keep_last must be an int >= 1, got {keep_last!r}")
    if not isinstance(config_hash, str) or not config_hash:
        raise CheckpointError(f"config_hash must be a non-empty string, got {config_hash!r}")
    if not isinstance(state, dict):
        raise CheckpointError(f"state must be a dict, got {type(state).__name__}")
    check_loadable(state)
    if rank_state is not None:
        check_loadable(rank_state, "rank_state")
    meta = {} if meta is None else meta
    try:
        meta = json.loads(json.dumps(meta, allow_nan=False))  # a JSON-faithful copy, refused early if not JSON
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"meta must be plain JSON (dict of str/int/float/bool/None/lists/dicts): {e}") from None
    if not isinstance(meta, dict):
        raise CheckpointError(f"meta must be a dict, got {type(meta).__name__}")
    rank, world = _rank_world(group)
    objects, tensors = split_state(state)
    if not tensors:  # DCP writes its .metadata for any state; an empty one keeps the layout uniform
        tensors = {"_": torch.zeros(1)}
    final = ckpt_dir / f"ckpt-{step:08d}"

    name, error = None, None
    if rank == 0:  # rank 0 names the temp directory and creates it; every rank writes into it
        tmp = ckpt_dir / f".tmp-{final.name}-{os.getpid()}-{secrets.token_hex(4)}"
        try:
            ckpt_dir.mkdir(parents=True, exist_ok=True)
            _remove_stale_temps(ckpt_dir)
            (tmp / DCP_DIR).mkdir(parents=True)
            name = tmp.name
        except OSError as e:
            shutil.rmtree(tmp, ignore_errors=True)
            error = _describe(e)
            previous = [p.name for p in list_checkpoints(ckpt_dir)] if ckpt_dir.is_dir() else []
            msg = (f"could not write the checkpoint of step {step} to {ckpt_dir}: {error}; the partial files were "
                   f"removed and the previous checkpoints ({', '.join(previous[-1:]) or 'none'}) are untouched")
            if world == 1:
                raise CheckpointError(msg) from e
            name = "!" + msg
    if world > 1:
        name = _all_gather(name, group)[0]
    if name.startswith("!"):
        raise CheckpointError(name[1:])
    tmp = ckpt_dir / name
    manifest = lambda files: Manifest(FORMAT_VERSION, step, config_hash, world, files, meta,  # noqa: E731
                                      _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"))
    error, cause, future = None, None, None
    try:
        if rank_state is not None:
            _save_durable(tmp / RANK_FILE.format(rank=rank), rank_state)
        if rank == 0:
            _save_durable(tmp / OBJECTS_FILE, objects)
    except (OSError, RuntimeError) as e:  # torch.save wraps some OSErrors in RuntimeError
        error, cause = _describe(e), e
    writer = dcp.FileSystemWriter(str(tmp / DCP_DIR), sync_files=True)
    kwargs = {"process_group": group} if group is not None else {"no_dist": True}
    if async_save and group is None:
        _ignore_one_process_warning_everywhere()  # before _quiet(), whose exit restores the filters
    try:
        with _quiet():
            if async_save:
                future = dcp.async_save(tensors, storage_writer=writer, **kwargs)
            else:
                dcp.save(tensors, storage_writer=writer, **kwargs)
    except BaseException as e:  # noqa: BLE001 - DCP raises CheckpointException (a BaseException) on every rank
        if isinstance(e, KeyboardInterrupt):
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        error, cause = error or _describe(e), cause or e
    return PendingSave(ckpt_dir, tmp, final, step, manifest, keep_last, group, future, error, cause)


def save_checkpoint(ckpt_dir: str | Path, state: dict[str, Any], step: int, *, config_hash: str,
                    keep_last: int = 3, meta: dict[str, Any] | None = None,
                    rank_state: dict[str, Any] | None = None, group: Any = None) -> Path:
    """`start_save(...).wait()`: write `state` atomically as `<ckpt_dir>/ckpt-<step:08d>/` and return it.

    Raises CheckpointError (naming the folder) when the disk refuses the write (full disk, quota, file-size
    limit); the temp files are then removed and earlier checkpoints are untouched. An existing checkpoint of the
    same step is replaced.
    """
    pending = start_save(ckpt_dir, state, step, config_hash=config_hash, keep_last=keep_last, meta=meta,
                         rank_state=rank_state, group=group)
    try:
        return pending.wait()
    except BaseException:  # KeyboardInterrupt, a signal handler's exception: leave no temp behind
        shutil.rmtree(pending.tmp, ignore_errors=True)
        raise


@contextlib.contextmanager
def _quiet() -> Any:
    """Silence DCP's "assuming the intent is to save in a single process" warning: one process is intended. (An
    async save warns from its background thread, outside this context: `_ONE_PROCESS` is filtered there too.)"""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_ONE_PROCESS)
        yield


def _ignore_one_process_warning_everywhere() -> None:
    warnings.filterwarnings("ignore", message=_ONE_PROCESS)


_ONE_PROCESS = ".*assuming the intent is to (save|load) in a single process"


def _save_durable(path: Path, obj: Any) -> None:
    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


def _sha256(path: Path) -> FileEntry:
    sha, size = hashlib.sha256(), 0
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            sha.update(chunk)
            size += len(chunk)
    return FileEntry(sha.hexdigest(), size)


def _hash_own_files(tmp: Path, rank: int) -> dict[str, dict]:
    """{relative path: {sha256, bytes}} of the files this rank wrote (DCP names them __<rank>_<i>.distcp; rank 0
    also owns .metadata and objects.pt): the ranks hash in parallel, each reading back only its own bytes."""
    out = {}
    mine = [tmp / RANK_FILE.format(rank=rank)]
    if rank == 0:
        mine += [tmp / OBJECTS_FILE, tmp / DCP_DIR / ".metadata"]
    mine += sorted((tmp / DCP_DIR).glob(f"__{rank}_*"))
    for p in mine:
        if p.is_file():
            out[str(p.relative_to(tmp))] = dataclasses.asdict(_sha256(p))
    return out


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
    try:  # a zombie (killed, not yet reaped: a torchrun rank whose agent died with it) saves nothing
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
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
            got = _sha256(fpath)
        except FileNotFoundError:
            raise CheckpointError(f"{fpath} is missing") from None
        except OSError as e:
            raise CheckpointError(f"{fpath} cannot be read: {e}") from None
        if got.sha256 != entry.sha256:
            raise CheckpointError(f"{fpath} fails its checksum (sha256 {got.sha256[:12]}... != recorded "
                                  f"{entry.sha256[:12]}...): the file is corrupt")
    return manifest


def check_compatible(manifest: Manifest, path: Path, config_hash: str) -> None:
    """Refuse (CheckpointMismatchError) a checkpoint of another config. Another world size is fine: DCP
    reshards the tensors and the trainer's data position is global."""
    if manifest.config_hash != config_hash:
        raise CheckpointMismatchError(
            f"run folder {path.parent} holds checkpoints of another config (hash {manifest.config_hash} != "
            f"{config_hash}); use --fresh or another --run-dir", manifest)


def _load_small(path: Path) -> Any:
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise CheckpointError(f"{path} is missing") from None
    except Exception as e:  # noqa: BLE001 - torch raises many types for unreadable files; name the file
        raise CheckpointError(f"{path} cannot be loaded with weights_only=True: "
                              f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from None


def load_objects(path: str | Path) -> Any:
    """The non-tensor part of a checkpoint's state (tensors still as placeholders)."""
    objects = _load_small(Path(path) / OBJECTS_FILE)
    if not isinstance(objects, dict):
        raise CheckpointError(f"{Path(path) / OBJECTS_FILE} holds a {type(objects).__name__}, not a state dict")
    return objects


def load_rank_state(path: str | Path, rank: int) -> dict[str, Any] | None:
    """Rank `rank`'s own state saved alongside (None when the writing run had no such rank)."""
    p = Path(path) / RANK_FILE.format(rank=rank)
    return _load_small(p) if p.is_file() else None


def load_checkpoint(path: str | Path, map_location: str | torch.device = "cpu") -> tuple[dict[str, Any], Manifest]:
    """Verify one checkpoint directory and load its whole state in THIS process, every tensor full and plain
    (a DTensor shard of any world size comes back as the full tensor). For export and inspection; the trainer
    reads into its own sharding with `load_into`."""
    import torch.distributed.checkpoint as dcp  # heavy to import; only checkpoint I/O needs it
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict  # what dcp_to_torch_save uses

    path = Path(path)
    manifest = verify_checkpoint(path)
    objects = load_objects(path)
    flat: dict[str, Any] = {}
    try:
        with _quiet():
            _load_state_dict(flat, storage_reader=dcp.FileSystemReader(str(path / DCP_DIR)),
                             planner=_EmptyStateDictLoadPlanner(), no_dist=True)
    except BaseException as e:  # noqa: BLE001 - CheckpointException is a BaseException
        if isinstance(e, KeyboardInterrupt):
            raise
        raise CheckpointError(f"{path / DCP_DIR} cannot be read: {_describe(e)}") from None
    missing = [k for k in _tensor_keys(objects) if k not in flat]
    if missing:
        raise CheckpointError(f"{path / DCP_DIR} lacks the tensors {missing[:5]}")
    tensors = {k: v.to(map_location) for k, v in flat.items() if isinstance(v, torch.Tensor)}
    return join_state(objects, tensors), manifest


def load_into(path: str | Path, template: dict[str, Any], group: Any = None) -> dict[str, Any]:
    """The checkpoint's state with its tensors read IN PLACE into `template`'s tensors (same structure; plain
    tensors or DTensor shards of this run's sharding, on any device). A collective when `group` is given. The
    checkpoint must have been verified by the caller (`find_latest` on rank 0)."""
    import torch.distributed.checkpoint as dcp  # heavy to import; only checkpoint I/O needs it

    path = Path(path)
    objects = load_objects(path)
    _, flat = split_state(template)
    saved = set(_tensor_keys(objects))
    missing = sorted(set(flat) - saved)
    if missing:
        raise CheckpointError(f"checkpoint {path} lacks {len(missing)} tensor(s) this run needs: {missing[:5]}")
    try:
        kwargs = {"process_group": group} if group is not None else {"no_dist": True}
        with _quiet():
            dcp.load(flat, storage_reader=dcp.FileSystemReader(str(path / DCP_DIR)), **kwargs)
    except BaseException as e:  # noqa: BLE001
        if isinstance(e, KeyboardInterrupt):
            raise
        raise CheckpointError(f"{path / DCP_DIR} cannot be read: {_describe(e)}") from None
    return join_state(objects, {**{k: None for k in saved}, **flat})


def find_latest(ckpt_dir: str | Path, config_hash: str) -> tuple[Manifest, Path] | None:
    """The newest checkpoint in `ckpt_dir` that verifies (sizes and sha256 of every file); None when the folder
    holds no checkpoint. A corrupt or partial one is skipped with a warning naming the file and the reason, and
    the one before it is tried. Raises CheckpointMismatchError when a checkpoint belongs to another config hash,
    and CheckpointError when checkpoints exist but none verifies."""
    ckpt_dir = Path(ckpt_dir)
    skipped: list[str] = []
    for path in reversed(list_checkpoints(ckpt_dir)):
        try:
            check_compatible(read_manifest(path), path, config_hash)
            manifest = verify_checkpoint(path)
            load_objects(path)
        except CheckpointMismatchError:
            raise
        except CheckpointError as e:
            log.warning("skipping checkpoint %s: %s", path.name, e)
            skipped.append(f"{path.name}: {e}")
            continue
        if skipped:
            log.warning("resuming from %s after skipping %d newer checkpoint(s)", path.name, len(skipped))
        return manifest, path
    if skipped:
        raise CheckpointError(f"no loadable checkpoint in {ckpt_dir}; refused: " + "; ".join(skipped)
                              + ". Use --fresh to start over or another --run-dir")
    return None


def load_latest(ckpt_dir: str | Path, config_hash: str,
                map_location: str | torch.device = "cpu") -> tuple[dict[str, Any], Path] | None:
    """`find_latest`, then `load_checkpoint` of it: (the whole state as plain tensors, its directory) or None."""
    found = find_latest(ckpt_dir, config_hash)
    if found is None:
        return None
    _, path = found
    state, _ = load_checkpoint(path, map_location)
    return state, path


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


# -- a training run's checkpoints ------------------------------------------------------------------------------


class TrainingCheckpoints:
    """The checkpoints of one training run in `ckpt_dir`: the drafter's weights and AdamW state in torch's
    distributed layout (`get_state_dict`: the plain drafter's parameter names whatever the engine, DTensor shards
    under FSDP; DCP reshards them on load), every rank's RNG streams, and the trainer's own state (a dict of
    plain values, the same on every rank). `settings`: the run's train section (keep_checkpoints, async_ckpt,
    dist_timeout_s); `resume_hash` and `run_config` (the run's `Config.to_dict()`) go into every manifest.
    Every rank calls `save`, `finish` and `load` at the same point."""

    def __init__(self, ckpt_dir: str | Path, drafter: torch.nn.Module, opt: torch.optim.Optimizer,
                 settings: TrainConfig, resume_hash: str, run_config: dict[str, Any]) -> None:
        self.ckpt_dir, self.drafter, self.opt, self.settings = Path(ckpt_dir), drafter, opt, settings
        self.resume_hash, self.run_config = resume_hash, run_config
        self.saved_step = -1  # step of the newest checkpoint written, started or loaded
        self.latest: Path | None = None  # the newest checkpoint this invocation committed
        self.pending: PendingSave | None = None  # an async save not yet committed
        self._save_t0 = 0.0

    def timeout_s(self) -> float:
        """The checkpoint collectives' timeout: fp32 weights + two AdamW moments (12 bytes per trainable
        parameter), sized by `distributed.checkpoint_timeout_s`."""
        numel = sum(p.numel() for p in self.drafter.parameters() if p.requires_grad)
        return distributed.checkpoint_timeout_s(12.0 * numel, distributed.info().world_size,
                                                self.settings.dist_timeout_s)

    def model_state(self) -> dict[str, Any]:
        """{"drafter": weights, "optimizer": AdamW state} as `get_state_dict` lays them out."""
        # heavy to import; only checkpoint I/O needs it
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model, optim = get_state_dict(self.drafter, self.opt)
        return {"drafter": model, "optimizer": optim}

    def save(self, step: int, epoch: int, trainer_state: Callable[[], dict[str, Any]],
             say: Callable[[str], None]) -> None:
        """Checkpoint optimizer step `step` (of data epoch `epoch`): every rank writes its part (DCP) and its RNG
        state, rank 0 `trainer_state()` and, once every rank is done, the manifest; a previous async save is
        committed first. With `async_ckpt` the tensors are staged and written in the background (committed at
        the next save or `finish`). A failed write (full disk) raises CheckpointError on every rank, the previous
        checkpoint intact."""
        tc = self.settings
        self.finish(say)
        group = distributed.checkpoint_group(self.timeout_s())
        trainer = trainer_state()  # may be a collective (every rank's skip counts): after the group exists
        state = {"step": step, **self.model_state(), "trainer": trainer}
        meta = {"epoch": epoch, "resume_hash": self.resume_hash, "config": self.run_config}
        self._save_t0 = time.perf_counter()
        self.pending = start_save(self.ckpt_dir, state, step, config_hash=self.resume_hash,
                                  keep_last=tc.keep_checkpoints, meta=meta, rank_state={"rng": capture_rng()},
                                  async_save=tc.async_ckpt, group=group)
        self.saved_step = step
        if not tc.async_ckpt:
            self.finish(say)

    def finish(self, say: Callable[[str], None]) -> None:
        """Commit the pending save, if any, and `say` where it went."""
        if self.pending is None:
            return
        pending, self.pending = self.pending, None
        self.latest = pending.wait()
        say(f"checkpoint step {pending.step}: {self.latest} ({time.perf_counter() - self._save_t0:.2f} s)")

    def load(self, path: str | Path, step: int) -> None:
        """Read the weights and AdamW state of the checkpoint of `step` at `path` (verified beforehand,
        `resume.prepare_run_dir`) in place, at this run's world size and engine, whatever sharding wrote them."""
        # heavy to import; only checkpoint I/O needs it
        from torch.distributed.checkpoint.state_dict import set_state_dict

        group = distributed.checkpoint_group(self.timeout_s())
        state = load_into(path, self.model_state(), group)
        set_state_dict(self.drafter, self.opt, model_state_dict=state["drafter"],
                       optim_state_dict=state["optimizer"])
        self.saved_step = step

    def load_rng(self, path: str | Path, saved_world_size: int) -> None:
        """This rank's RNG streams from the checkpoint at `path`; a rank the writing run (of `saved_world_size`
        ranks) did not have takes rank (r mod W)'s."""
        rank = distributed.info().rank % saved_world_size
        mine = load_rank_state(path, rank)
        if mine is None:
            raise CheckpointError(f"checkpoint {path}: no rank state for rank {rank}")
        restore_rng(mine["rng"])


def capture_rng(generators: dict[str, NamedGenerator] | None = None) -> dict[str, Any]:
    """Snapshot every global random stream plus the named `generators` (e.g. {"anchors": torch.Generator}).

    Returns a dict of tensors, strings, ints and lists only (safe for `torch.load(weights_only=True)`).
    """
    out: dict[str, Any] = {
        "format": RNG_FORMAT,
        "python": _python_to_json(random.getstate()),
        "numpy": _numpy_global_to_json(np.random.get_state()),
        "torch_cpu": torch.get_rng_state(),  # (5056,) uint8
        "torch_cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],  # [(816,) uint8] per GPU
        "generators": {},
    }
    for name, gen in (generators or {}).items():
        if isinstance(gen, torch.Generator):
            out["generators"][name] = {"kind": "torch", "device": str(gen.device), "state": gen.get_state()}
        elif isinstance(gen, np.random.Generator):
            out["generators"][name] = {"kind": "numpy", "state": json.dumps(gen.bit_generator.state)}
        else:
            raise RngStateError(f"generator {name!r} is a {type(gen).__name__}; expected torch.Generator or "
                                f"np.random.Generator")
    return out


def restore_rng(state: dict[str, Any], generators: dict[str, NamedGenerator] | None = None) -> None:
    """Put every stream captured by `capture_rng` back; the named `generators` must be the same set of names.

    Raises RngStateError (naming the stream) on a missing or extra generator name, a generator of another kind
    or device, a different number of CUDA devices, or a state of another format.
    """
    if not isinstance(state, dict) or state.get("format") != RNG_FORMAT:
        got = state.get("format") if isinstance(state, dict) else type(state).__name__
        raise RngStateError(f"RNG state format {got!r} is not the supported format {RNG_FORMAT}")
    generators = generators or {}
    saved = state["generators"]
    if set(saved) != set(generators):
        raise RngStateError(f"RNG state holds generators {sorted(saved)} but {sorted(generators)} were given")
    cuda_states = state["torch_cuda"]
    if cuda_states and (not torch.cuda.is_available() or torch.cuda.device_count() != len(cuda_states)):
        have = torch.cuda.device_count() if torch.cuda.is_available() else 0
        raise RngStateError(f"RNG state was captured with {len(cuda_states)} CUDA device(s); this process has {have}")
    for name, gen in generators.items():  # check everything before changing anything
        kind = ("torch" if isinstance(gen, torch.Generator)
                else "numpy" if isinstance(gen, np.random.Generator) else None)
        if kind != saved[name]["kind"]:
            raise RngStateError(f"generator {name!r} was captured as {saved[name]['kind']}, got {type(gen).__name__}")
        if kind == "torch" and str(gen.device) != saved[name]["device"]:
            raise RngStateError(f"generator {name!r} was captured on {saved[name]['device']}, got one on {gen.device}")

    random.setstate(_python_from_json(state["python"]))
    np.random.set_state(_numpy_global_from_json(state["numpy"]))
    torch.set_rng_state(state["torch_cpu"])
    if cuda_states:
        torch.cuda.set_rng_state_all(cuda_states)
    for name, gen in generators.items():
        if isinstance(gen, torch.Generator):
            gen.set_state(saved[name]["state"])
        else:
            gen.bit_generator.state = json.loads(saved[name]["state"])


def _python_to_json(st: tuple) -> str:
    version, internal, gauss_next = st  # internal: 624 uint32 words + position
    return json.dumps([version, list(internal), gauss_next])


def _python_from_json(text: str) -> tuple:
    version, internal, gauss_next = json.loads(text)
    return version, tuple(internal), gauss_next


def _numpy_global_to_json(st: tuple) -> str:
    name, keys, pos, has_gauss, cached = st  # keys: (624,) uint32
    return json.dumps([name, keys.tolist(), int(pos), int(has_gauss), float(cached)])


def _numpy_global_from_json(text: str) -> tuple:
    name, keys, pos, has_gauss, cached = json.loads(text)
    return name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached
