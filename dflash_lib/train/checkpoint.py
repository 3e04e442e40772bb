"""Crash-safe distributed checkpoints on `torch.distributed.checkpoint` (DCP): every rank writes its own shard.

One checkpoint is `ckpt-<step:08d>/` (`dcp/` the tensors, `objects.pt` the rest of the state, `rank-<r>.pt` each
rank's RNG streams, `manifest.json` with checksums, written last), committed by a rename. `TrainingCheckpoints`
saves and loads for the trainer, `find_latest` verifies, `load_into` reads into this run's sharding; `capture_rng`
/ `restore_rng` carry every global random stream. A checkpoint's names, manifest, verification and whole-state load
(export) are the run folder's format, read without train/: `rundir.checkpoints`. Atomic commits, async saves;
one pickle, DCP's dcp/.metadata, read only once its sha256 is the manifest's: docs/runs.md, "Runs that survive:
resume, stop, torchrun".
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import io
import json
import logging
import os
import random
import re
import secrets
import shutil
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
import torch.distributed as dist

from dflash_lib.config import TrainConfig
from dflash_lib.rundir.checkpoints import (CHECKPOINT_NAME, DCP_DIR, FORMAT_VERSION, MANIFEST_FILE, OBJECTS_FILE,
                                           RANK_FILE, CheckpointError, FileEntry, Manifest, dcp_read, describe_error,
                                           file_entry, join_state, list_checkpoints, load_objects, load_rank_state,
                                           os_error, read_manifest, single_process_intended, split_state,
                                           verify_checkpoint)
from dflash_lib.train import distributed

log = logging.getLogger(__name__)

_TEMP_RE = re.compile(r"^\.(?:tmp|trash)-.*-(\d+)-[0-9a-f]{8}$")  # .tmp-<name>-<pid>-<hex>, .trash-<name>-<pid>-<hex>
RNG_FORMAT = 1  # bump when the captured RNG layout changes


class CheckpointMismatchError(CheckpointError):
    """The checkpoints in a folder belong to another config: resuming would mix two runs. `manifest`: the
    mismatching checkpoint's (its meta records that run's config; None when not at hand)."""

    def __init__(self, message: str, manifest: Manifest | None = None) -> None:
        super().__init__(message)
        self.manifest = manifest


class RngStateError(ValueError):
    """A captured RNG state does not fit this process (another format, another number of CUDA devices)."""


# -- saving ------------------------------------------------------------------------------------------------------


def _rank_world(group: Any) -> tuple[int, int]:
    if group is None or not (dist.is_available() and dist.is_initialized()):
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def _all_gather(value: Any, group: Any) -> list[Any]:
    """Every rank's picklable `value` (the group's timeout bounds the wait); [value] in one process."""
    if _rank_world(group)[1] == 1:
        return [value]
    out: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, value, group=group)
    return out


def _failure(ckpt_dir: Path, step: int, detail: str) -> str:
    previous = [p.name for p in list_checkpoints(ckpt_dir) if p.name != f"ckpt-{step:08d}"]
    return (f"could not write the checkpoint of step {step} to {ckpt_dir}: {detail}; the partial files were "
            f"removed and the previous checkpoints ({', '.join(previous[-1:]) or 'none'}) are untouched")


class PendingSave:
    """A checkpoint whose files are being written; `wait()` finishes it (every rank calls it) and returns the
    checkpoint directory. Raises CheckpointError on every rank when any rank failed; the partial files are then
    removed and earlier checkpoints are untouched."""

    def __init__(self, tmp: Path, final: Path, manifest: Manifest, keep_last: int, group: Any) -> None:
        self.tmp, self.final, self.manifest, self.keep_last, self.group = tmp, final, manifest, keep_last, group
        self.step = manifest.step
        self.future: Any = None  # DCP's async save, when one runs
        self.error: str | None = None  # this rank's first failure
        self.cause: BaseException | None = None
        self.done = False

    def fail(self, e: BaseException) -> None:
        if self.error is None:
            self.error, self.cause = describe_error(e), e

    def wait(self) -> Path:
        if self.done:
            return self.final
        rank, world = _rank_world(self.group)
        if self.future is not None and self.error is None:
            try:  # async_save returns a Future or an AsyncSaveResponse, by torch version
                getattr(self.future, "upload_completion", self.future).result()
            except KeyboardInterrupt:
                raise
            except BaseException as e:  # noqa: BLE001 - DCP raises CheckpointException (a BaseException)
                self.fail(e)
        files: dict[str, FileEntry] = {}
        if self.error is None:
            try:
                files = _hash_own_files(self.tmp, rank)
            except OSError as e:
                self.fail(e)
        gathered = _all_gather((self.error, files), self.group)
        verdict = None
        if rank == 0:
            errors = [err if world == 1 else f"rank {r}: {err}" for r, (err, _) in enumerate(gathered) if err]
            try:
                if errors:
                    raise CheckpointError("; ".join(errors))
                every = {name: entry for _, mine in gathered for name, entry in mine.items()}
                _commit(self.tmp, self.final, dataclasses.replace(self.manifest, files=every))
            except (OSError, CheckpointError) as e:
                shutil.rmtree(self.tmp, ignore_errors=True)
                if isinstance(e, OSError):
                    self.cause = e
                verdict = _failure(self.final.parent, self.step,
                                   str(e) if isinstance(e, CheckpointError) else describe_error(e))
        verdict = _all_gather(verdict, self.group)[0]  # rank 0's verdict, on every rank
        if verdict is not None:
            raise CheckpointError(verdict) from (os_error(self.cause) or self.cause)
        if rank == 0:
            try:
                _prune(self.final.parent, self.keep_last)
            except OSError as e:  # the new checkpoint is durable; failing to delete old ones must not fail the save
                log.warning("checkpoint %s saved, but pruning older checkpoints failed: %s", self.final, e)
        self.done = True
        return self.final


def start_save(ckpt_dir: str | Path, state: dict[str, Any], step: int, *, config_hash: str, keep_last: int = 3,
               meta: dict[str, Any] | None = None, rank_state: dict[str, Any] | None = None,
               async_save: bool = False, group: Any = None) -> PendingSave:
    """Begin writing `state` as `<ckpt_dir>/ckpt-<step:08d>/`; `.wait()` on the result commits it (replacing a
    checkpoint of the same step) and keeps the newest `keep_last` complete checkpoints. A collective when
    `group` (a process group) is given: every rank calls it with the same structure of `state` (its tensors may
    be DTensor shards or replicas), its own `rank_state`, and the same step.

    `state` holds tensors (written by DCP, each rank its part) and what `torch.load(weights_only=True)` reads
    back: bool/int/float/str/None and lists/tuples/dicts (optimizer `state_dict()`s qualify; RNG states as
    `capture_rng` gives them); rank 0 writes its non-tensor part. `meta` (plain JSON) goes into the manifest.
    `async_save`: DCP stages the tensors in host memory and writes them in a background thread; this call then
    returns once they are staged.
    """
    import torch.distributed.checkpoint as dcp  # heavy to import; only checkpoint I/O needs it

    ckpt_dir = Path(ckpt_dir)
    rank, world = _rank_world(group)
    final = ckpt_dir / f"ckpt-{step:08d}"
    name, error, cause = None, None, None
    if rank == 0:  # rank 0 names the temp directory and creates it; every rank writes into it
        tmp = ckpt_dir / f".tmp-{final.name}-{os.getpid()}-{secrets.token_hex(4)}"
        try:
            ckpt_dir.mkdir(parents=True, exist_ok=True)
            _remove_stale_temps(ckpt_dir)
            (tmp / DCP_DIR).mkdir(parents=True)
            name = tmp.name
        except OSError as e:
            shutil.rmtree(tmp, ignore_errors=True)
            error, cause = _failure(ckpt_dir, step, describe_error(e)), e
    name, error = _all_gather((name, error), group)[0]
    if error is not None:
        raise CheckpointError(error) from cause
    now = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
    pending = PendingSave(ckpt_dir / name, final, Manifest(FORMAT_VERSION, step, config_hash, world, {}, meta or {},
                                                           now), keep_last, group)
    objects, tensors = split_state(state)
    try:
        if rank_state is not None:
            _save_durable(pending.tmp / RANK_FILE.format(rank=rank), rank_state)
        if rank == 0:
            _save_durable(pending.tmp / OBJECTS_FILE, objects)
    except Exception as e:  # noqa: BLE001 - recorded, so that this rank still joins DCP's collectives below
        pending.fail(e)
    writer = dcp.FileSystemWriter(str(pending.tmp / DCP_DIR), sync_files=True)
    kwargs = {"process_group": group} if group is not None else {"no_dist": True}
    single_process_intended()
    tensors = tensors or {"_": torch.zeros(1)}  # DCP writes its .metadata for any state: one layout for all
    try:  # every rank joins DCP's collectives, even one that failed above: its peers would wait for it
        if async_save:
            pending.future = dcp.async_save(tensors, storage_writer=writer, **kwargs)
        else:
            dcp.save(tensors, storage_writer=writer, **kwargs)
    except KeyboardInterrupt:
        raise
    except BaseException as e:  # noqa: BLE001 - DCP raises CheckpointException (a BaseException) on every rank
        pending.fail(e)
    return pending


def _write_durable(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _save_durable(path: Path, obj: Any) -> None:
    buf = io.BytesIO()
    torch.save(obj, buf)
    _write_durable(path, buf.getvalue())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _hash_own_files(tmp: Path, rank: int) -> dict[str, FileEntry]:
    """{relative path: checksum} of the files this rank wrote (DCP names them __<rank>_<i>.distcp; rank 0 also
    owns .metadata and objects.pt): the ranks hash in parallel, each reading back only its own bytes."""
    mine = [tmp / RANK_FILE.format(rank=rank), *sorted((tmp / DCP_DIR).glob(f"__{rank}_*"))]
    if rank == 0:
        mine += [tmp / OBJECTS_FILE, tmp / DCP_DIR / ".metadata"]
    return {str(p.relative_to(tmp)): file_entry(p) for p in mine if p.is_file()}


def _commit(tmp: Path, final: Path, manifest: Manifest) -> None:
    """Write the manifest into the finished temp directory `tmp` and rename it to `final`: the commit point,
    made durable. A checkpoint of the same step already there (a save after a resume) is swapped out first."""
    _write_durable(tmp / MANIFEST_FILE, manifest.to_json().encode())
    _fsync_dir(tmp)
    old = _out_of_sight(final) if final.exists() else None
    os.replace(tmp, final)
    _fsync_dir(final.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _out_of_sight(path: Path) -> Path:
    """Rename checkpoint directory `path` to a hidden trash name in one atomic step, so that a crash while it is
    deleted leaves no half checkpoint listed (the next save removes the trash); returns the new path."""
    trash = path.parent / f".trash-{path.name}-{os.getpid()}-{secrets.token_hex(4)}"
    os.replace(path, trash)
    return trash


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
    """Keep the newest `keep_last` checkpoints whose files all have their recorded sizes; delete every other."""
    def complete(path: Path) -> bool:
        try:
            verify_checkpoint(path, checksums=False)  # loads verify the sha256 too
            return True
        except CheckpointError:
            return False

    entries = list_checkpoints(ckpt_dir)
    good = [p for p in entries if complete(p)]
    keep = set(good[-keep_last:])
    for p in [p for p in entries if p not in keep]:
        if p not in good:
            log.warning("deleting incomplete or corrupt checkpoint %s", p)
        shutil.rmtree(_out_of_sight(p), ignore_errors=True)


def fresh_run_dir(ckpt_dir: str | Path) -> int:
    """Delete every checkpoint (and temp leftover) in `ckpt_dir`, nothing else; returns how many were removed."""
    ckpt_dir = Path(ckpt_dir)
    if not ckpt_dir.is_dir():
        return 0
    found = [p for p in ckpt_dir.iterdir() if (CHECKPOINT_NAME.match(p.name) or _TEMP_RE.match(p.name)) and p.is_dir()]
    for p in found:
        shutil.rmtree(_out_of_sight(p))
    if found:
        _fsync_dir(ckpt_dir)
    return len(found)


# -- loading -----------------------------------------------------------------------------------------------------


def load_into(path: str | Path, template: dict[str, Any], group: Any = None) -> dict[str, Any]:
    """The checkpoint's state with its tensors read IN PLACE into `template`'s tensors (a part of its
    structure; plain tensors or DTensor shards of this run's sharding, on any device): DCP reshards, and refuses
    a template tensor the checkpoint lacks. Tensors outside the template come back as None. A collective when
    `group` is given. The checkpoint must have been verified by the caller (`find_latest` on rank 0)."""
    import torch.distributed.checkpoint as dcp  # heavy to import; only checkpoint I/O needs it

    path = Path(path)
    _, flat = split_state(template)
    kwargs = {"process_group": group} if group is not None else {"no_dist": True}
    dcp_read(path, lambda reader: dcp.load(flat, storage_reader=reader, **kwargs))
    return join_state(load_objects(path), flat)


def find_latest(ckpt_dir: str | Path, config_hash: str) -> tuple[Manifest, Path] | None:
    """The newest checkpoint in `ckpt_dir` that verifies (sizes and sha256 of every file, objects readable);
    None when the folder holds no checkpoint. A corrupt or partial one is skipped with a warning naming the file
    and the reason, and the one before it is tried. Raises CheckpointMismatchError when a checkpoint belongs to
    another config hash, and CheckpointError when checkpoints exist but none verifies. Another world size is
    fine: DCP reshards the tensors and the trainer's data position is global."""
    ckpt_dir = Path(ckpt_dir)
    skipped: list[str] = []
    for path in reversed(list_checkpoints(ckpt_dir)):
        try:
            manifest = read_manifest(path)
            if manifest.config_hash != config_hash:
                raise CheckpointMismatchError(
                    f"run folder {ckpt_dir} holds checkpoints of another config (hash {manifest.config_hash} != "
                    f"{config_hash}); use --fresh or another --run-dir", manifest)
            verify_checkpoint(path)
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


# -- a training run's checkpoints ------------------------------------------------------------------------------


class TrainingCheckpoints:
    """The checkpoints of one training run in `ckpt_dir`: the drafter's weights and AdamW state in torch's
    distributed layout (`get_state_dict`: the plain drafter's parameter names whatever the engine, DTensor shards
    under FSDP; DCP reshards them on load), every rank's RNG streams, and the trainer's own state (a dict of
    plain values, the same on every rank). `settings`: the run's train section (keep_checkpoints, async_ckpt,
    dist_timeout_s); `resume_hash` and `run_config` (the run's `Config.to_dict()`) go into every manifest.
    Every rank calls `save`, `finish` and `load` at the same point."""

    def __init__(self, ckpt_dir: str | Path, drafter: torch.nn.Module,
                 opt: torch.optim.Optimizer | tuple[torch.optim.Optimizer, ...],
                 settings: TrainConfig, resume_hash: str, run_config: dict[str, Any]) -> None:
        self.ckpt_dir, self.drafter, self.opt, self.settings = Path(ckpt_dir), drafter, opt, settings
        self.resume_hash, self.run_config = resume_hash, run_config
        self.saved_step = -1  # step of the newest checkpoint written, started or loaded
        self.latest: Path | None = None  # the newest checkpoint this invocation committed
        self.pending: PendingSave | None = None  # an async save not yet committed
        self._save_t0 = 0.0

    def timeout_s(self) -> float:
        """The checkpoint collectives' timeout: fp32 weights + two AdamW moments (12 bytes per trainable
        parameter; Muon keeps one), sized by `distributed.checkpoint_timeout_s`."""
        numel = sum(p.numel() for p in self.drafter.parameters() if p.requires_grad)
        return distributed.checkpoint_timeout_s(12.0 * numel, distributed.info().world_size,
                                                self.settings.dist_timeout_s)

    def model_state(self) -> dict[str, Any]:
        """{"drafter": weights, "optimizer": the optimizers' state (AdamW, Muon)} as `get_state_dict` lays them out."""
        from torch.distributed.checkpoint.state_dict import get_state_dict  # heavy; only checkpoint I/O needs it

        model, optim = get_state_dict(self.drafter, self.opt)
        return {"drafter": model, "optimizer": optim}

    def save(self, step: int, epoch: int, trainer_state: Callable[[], dict[str, Any]],
             say: Callable[[str], None]) -> None:
        """Checkpoint optimizer step `step` (of data epoch `epoch`): every rank writes its part (DCP) and its RNG
        state, rank 0 `trainer_state()` and, once every rank is done, the manifest; a previous async save is
        committed first. With `async_ckpt` the tensors are staged and written in the background (committed at
        the next save or `finish`). A failed write (full disk) raises CheckpointError on every rank, the previous
        checkpoint intact."""
        self.finish(say)
        group = distributed.checkpoint_group(self.timeout_s())
        trainer = trainer_state()  # may be a collective (every rank's skip counts): after the group exists
        state = {"step": step, **self.model_state(), "trainer": trainer}
        meta = {"epoch": epoch, "resume_hash": self.resume_hash, "config": self.run_config}
        self._save_t0 = time.perf_counter()
        self.pending = start_save(self.ckpt_dir, state, step, config_hash=self.resume_hash,
                                  keep_last=self.settings.keep_checkpoints, meta=meta,
                                  rank_state={"rng": capture_rng()}, async_save=self.settings.async_ckpt, group=group)
        self.saved_step = step
        if not self.settings.async_ckpt:
            self.finish(say)

    def finish(self, say: Callable[[str], None]) -> None:
        """Commit the pending save, if any, and `say` where it went."""
        if self.pending is None:
            return
        pending, self.pending = self.pending, None
        self.latest = pending.wait()
        say(f"checkpoint step {pending.step}: {self.latest} ({time.perf_counter() - self._save_t0:.2f} s)")

    def load(self, path: str | Path, step: int) -> None:
        """Read the weights and optimizer state of the checkpoint of `step` at `path` (verified beforehand,
        `resume.prepare_run_dir`) in place, at this run's world size and engine, whatever sharding wrote them."""
        from torch.distributed.checkpoint.state_dict import set_state_dict  # heavy; only checkpoint I/O needs it

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


# -- random streams ------------------------------------------------------------------------------------------


def capture_rng() -> dict[str, Any]:
    """Snapshot every global random stream, as tensors, strings, ints and lists (weights_only reads them)."""
    version, internal, gauss_next = random.getstate()  # internal: 624 uint32 words + position
    name, keys, pos, has_gauss, cached = np.random.get_state()  # keys: (624,) uint32
    return {
        "format": RNG_FORMAT,
        "python": json.dumps([version, list(internal), gauss_next]),
        "numpy": json.dumps([name, keys.tolist(), int(pos), int(has_gauss), float(cached)]),
        "torch_cpu": torch.get_rng_state(),  # (5056,) uint8
        "torch_cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],  # [(816,) uint8] per GPU
        "generators": {},  # RNG_FORMAT 1 also held named generators; nothing of the trainer needs them
    }


def restore_rng(state: dict[str, Any]) -> None:
    """Put every stream captured by `capture_rng` back. Raises RngStateError, changing nothing, on a state of
    another format or of another number of CUDA devices."""
    if not isinstance(state, dict) or state.get("format") != RNG_FORMAT:
        got = state.get("format") if isinstance(state, dict) else type(state).__name__
        raise RngStateError(f"RNG state format {got!r} is not the supported format {RNG_FORMAT}")
    cuda_states = state["torch_cuda"]
    have = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if cuda_states and have != len(cuda_states):
        raise RngStateError(f"RNG state was captured with {len(cuda_states)} CUDA device(s); this process has {have}")
    version, internal, gauss_next = json.loads(state["python"])
    random.setstate((version, tuple(internal), gauss_next))
    name, keys, pos, has_gauss, cached = json.loads(state["numpy"])
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch_cpu"])
    if cuda_states:
        torch.cuda.set_rng_state_all(cuda_states)
