"""A trainer run's checkpoint read back without train/: its folder names (`ckpt-<step>/`: `dcp/` the tensors,
`objects.pt` the rest of the state, `rank-<r>.pt` each rank's own, `manifest.json` written last), its manifest
(`Manifest`, `read_manifest`), its verification (`verify_checkpoint`: sizes and sha256) and its state loaded whole
in this process (`load_checkpoint`: every tensor full and plain, for export and inspection), the state's layout
(`split_state` / `join_state`: tensors for DCP, placeholders in objects.pt). One pickle is read, DCP's
dcp/.metadata, and only once its sha256 is the manifest's (trust only checkpoints you made). The writer, the
resharded load and the resume: `train.checkpoint`. docs/runs.md, "Runs that survive: resume, stop, torchrun".
"""

from __future__ import annotations

import dataclasses
import errno
import hashlib
import json
import re
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

CHECKPOINT_NAME = re.compile(r"^ckpt-(\d{8,})$")  # a checkpoint folder: ckpt-<step, 8 digits at least>
MANIFEST_FILE = "manifest.json"  # plain JSON metadata and checksums: the completion marker, written last
FORMAT_VERSION = 2  # bump when the on-disk layout changes; loads refuse other versions (2: DCP shards)
DCP_DIR = "dcp"  # torch.distributed.checkpoint folder of the state's tensors
OBJECTS_FILE = "objects.pt"  # the state without its tensors (placeholders name them)
RANK_FILE = "rank-{rank}.pt"  # one rank's own state
_HASH_CHUNK = 1 << 20  # bytes read per sha256 update
TENSOR_KEY = "__dcp_tensor__"  # placeholder key in objects.pt: {TENSOR_KEY: "<key of the tensor in dcp/>"}


class CheckpointError(RuntimeError):
    """A checkpoint could not be written, or one on disk is missing, partial, corrupt or unreadable."""


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
    def from_json(cls, text: str, where: Path) -> Manifest:
        """Parse a manifest, refusing anything malformed with a CheckpointError naming `where`."""
        try:
            raw = json.loads(text)
        except ValueError as e:
            raise CheckpointError(f"{where}: manifest is not valid JSON ({e})") from None
        if not isinstance(raw, dict) or set(raw) != set(_MANIFEST_TYPES):
            raise CheckpointError(f"{where}: manifest is not an object with the keys {sorted(_MANIFEST_TYPES)}")
        for key, typ in _MANIFEST_TYPES.items():
            if type(raw[key]) is not typ:
                raise CheckpointError(f"{where}: manifest field {key!r} must be {typ.__name__}, got {raw[key]!r}")
        if raw["format_version"] != FORMAT_VERSION:
            raise CheckpointError(f"{where}: checkpoint format version {raw['format_version']} is not the "
                                  f"supported version {FORMAT_VERSION}")
        try:
            files = {name: FileEntry(**entry) for name, entry in raw["files"].items()}
        except TypeError:
            raise CheckpointError(f"{where}: manifest file entries are not {{sha256, bytes}} objects") from None
        return cls(**{**raw, "files": files})


_MANIFEST_TYPES = {"format_version": int, "step": int, "config_hash": str, "world_size": int, "files": dict,
                   "meta": dict, "created_utc": str}


def list_checkpoints(ckpt_dir: str | Path) -> list[Path]:
    """The `ckpt-<step>` directories in `ckpt_dir`, oldest step first (temp directories are never listed)."""
    ckpt_dir = Path(ckpt_dir)
    if not ckpt_dir.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in ckpt_dir.iterdir() if (m := CHECKPOINT_NAME.match(p.name)) and p.is_dir()]
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


def split_state(state: Any, path: str = "") -> tuple[Any, dict[str, torch.Tensor]]:
    """(the state with every tensor replaced by {TENSOR_KEY: key}, {key: tensor}); keys are the '/'-joined paths."""
    if isinstance(state, torch.Tensor):
        return {TENSOR_KEY: path}, {path: state}
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
    """Inverse of `split_state`; a placeholder whose tensor `tensors` lacks becomes None."""
    if isinstance(objects, dict):
        if set(objects) == {TENSOR_KEY}:
            return tensors.get(objects[TENSOR_KEY])
        return {k: join_state(v, tensors) for k, v in objects.items()}
    if isinstance(objects, (list, tuple)):
        items = [join_state(v, tensors) for v in objects]
        return items if isinstance(objects, list) else tuple(items)
    return objects


def os_error(e: BaseException | None) -> OSError | None:
    """The OSError behind a failed write: itself, its cause, or the one a DCP CheckpointException wraps."""
    for _ in range(10):
        if e is None or isinstance(e, OSError):
            return e
        failures = getattr(e, "failures", None)  # a DCP CheckpointException: {rank: (exception, traceback)}
        for exc, _ in failures.values() if isinstance(failures, dict) else ():
            if (found := os_error(exc)) is not None:
                return found
        e = e.__cause__ or e.__context__
    return None


def describe_error(e: BaseException) -> str:
    """One line naming why a checkpoint's I/O failed: the OSError behind it (strerror, errno name, file), else the
    exception's last line."""
    os_err = os_error(e)
    if os_err is not None:
        code = errno.errorcode.get(os_err.errno, str(os_err.errno)) if os_err.errno else "?"
        return f"{os_err.strerror or os_err} [{code}] (file {os_err.filename or '?'})"
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[-1] if text else ''}"


def single_process_intended() -> None:
    """Silence DCP's "assuming the intent is to save (load) in a single process" warning, which it gives
    whenever no process group is active (from an async save's background thread too): one process is what we
    intend. The filter stays for the process; adding it again is a no-op."""
    warnings.filterwarnings("ignore", message=".*assuming the intent is to (save|load) in a single process")


def file_entry(path: Path) -> FileEntry:
    """The file's sha256 and size (bytes), as a manifest records them."""
    sha, size = hashlib.sha256(), 0
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            sha.update(chunk)
            size += len(chunk)
    return FileEntry(sha.hexdigest(), size)


def verify_checkpoint(path: str | Path, checksums: bool = True) -> Manifest:
    """Check that every file the manifest lists exists with its recorded size and (`checksums`) sha256; return
    the manifest."""
    path = Path(path)
    manifest = read_manifest(path)
    m = CHECKPOINT_NAME.match(path.name)
    if m and int(m.group(1)) != manifest.step:
        raise CheckpointError(f"{path / MANIFEST_FILE} records step {manifest.step}, not the directory's step")
    for name, entry in manifest.files.items():
        fpath = path / name
        try:
            size = fpath.stat().st_size
            if size != entry.bytes:
                raise CheckpointError(f"{fpath} has {size} bytes, the manifest records {entry.bytes} (truncated?)")
            got = file_entry(fpath) if checksums else entry
        except FileNotFoundError:
            raise CheckpointError(f"{fpath} is missing") from None
        except OSError as e:
            raise CheckpointError(f"{fpath} cannot be read: {e}") from None
        if got.sha256 != entry.sha256:
            raise CheckpointError(f"{fpath} fails its checksum (sha256 {got.sha256[:12]}... != recorded "
                                  f"{entry.sha256[:12]}...): the file is corrupt")
    return manifest


def _load_small(path: Path) -> Any:
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise CheckpointError(f"{path} is missing") from None
    except Exception as e:  # noqa: BLE001 - torch raises many types for unreadable files; name the file
        raise CheckpointError(f"{path} cannot be loaded with weights_only=True: "
                              f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from None


def load_objects(path: str | Path) -> dict[str, Any]:
    """The non-tensor part of a checkpoint's state (tensors still as placeholders)."""
    return _load_small(Path(path) / OBJECTS_FILE)


def load_rank_state(path: str | Path, rank: int) -> dict[str, Any] | None:
    """Rank `rank`'s own state saved alongside (None when the writing run had no such rank)."""
    p = Path(path) / RANK_FILE.format(rank=rank)
    return _load_small(p) if p.is_file() else None


def check_dcp_metadata(path: Path) -> None:
    """CheckpointError unless dcp/.metadata is the file the manifest records (its size and sha256): DCP reads it
    with pickle, which runs whatever code the file names, so a file swapped in is refused before torch reads it.
    (A checkpoint made elsewhere vouches for itself: its manifest is its author's; docs/runs.md.)"""
    name = f"{DCP_DIR}/.metadata"
    entry = read_manifest(path).files.get(name)
    if entry is None:
        raise CheckpointError(f"{path / MANIFEST_FILE} records no {name}: its tensors are not read unchecked")
    try:
        got = file_entry(path / name)
    except OSError as e:
        raise CheckpointError(f"{path / name} cannot be read: {e}") from None
    if (got.sha256, got.bytes) != (entry.sha256, entry.bytes):
        raise CheckpointError(f"{path / name} is not the file its manifest records (sha256 {got.sha256[:12]}..., "
                              f"{got.bytes} bytes; recorded {entry.sha256[:12]}..., {entry.bytes} bytes): refused "
                              "before it is unpickled")


def dcp_read(path: Path, read: Callable[[Any], None]) -> None:
    """`read(reader)` of the checkpoint's dcp/ folder once its pickled .metadata is the manifest's
    (`check_dcp_metadata`), DCP's failures as a CheckpointError naming it."""
    import torch.distributed.checkpoint as dcp  # heavy to import; only checkpoint I/O needs it

    single_process_intended()
    check_dcp_metadata(path)
    try:
        read(dcp.FileSystemReader(str(path / DCP_DIR)))
    except KeyboardInterrupt:
        raise
    except BaseException as e:  # noqa: BLE001 - CheckpointException is a BaseException
        raise CheckpointError(f"{path / DCP_DIR} cannot be read: {describe_error(e)}") from None


def load_checkpoint(path: str | Path, map_location: str | torch.device = "cpu") -> tuple[dict[str, Any], Manifest]:
    """Verify one checkpoint directory and load its whole state in THIS process, every tensor full and plain
    (a DTensor shard of any world size comes back as the full tensor). For export and inspection; the trainer
    reads into its own sharding with `load_into`."""
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict  # what dcp_to_torch_save uses

    path = Path(path)
    manifest = verify_checkpoint(path)
    objects = load_objects(path)
    flat: dict[str, Any] = {}  # the planner fills it with every tensor of the checkpoint
    dcp_read(path, lambda reader: _load_state_dict(flat, storage_reader=reader,
                                                    planner=_EmptyStateDictLoadPlanner(), no_dist=True))
    return join_state(objects, {k: v.to(map_location) for k, v in flat.items()}), manifest
