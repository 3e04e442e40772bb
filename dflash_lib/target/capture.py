"""Writing a cache of the target's features (`python -m dflash_lib capture ... --out CACHE`; its format and reader:
`target/cached.py`; docs/scale.md, "Cached: generate once, train many epochs").

A capture holds the folder's lock (`folder_lock`: a second capture into it is refused), keeps the samples training
reads (`data.validation.validate_sample` against the target's vocabulary; the others counted by reason), checks the
disk's free space against the bytes still to write before the first shard, then writes shards of SHARD_SAMPLES
samples: each built in one buffer per tensor (the shard is held once in host memory; the engine's states of a
document are dropped once copied in), written whole under a temporary name, synced, renamed and only then named in
manifest.json. A killed capture resumes at the first shard the manifest does not name; one whose disk fills stops
in one line, its manifest naming the whole shards only, and resumes once there is room.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.torch import save_file

from dflash_lib.config import ConfigError
from dflash_lib.data import build_token_store_from_config
from dflash_lib.data.validation import SkipCounter
from dflash_lib.models.export import file_sha256
from dflash_lib.serve.hidden_states import HiddenStatesClient
from dflash_lib.target.cached import (DTYPES, FORMAT, MANIFEST, STORED, CacheIdentity, identity_of, read_manifest,
                                      shard_tensors, token_key)
from dflash_lib.target.facts import read_facts
from dflash_lib.target.folder_lock import folder_lock
from dflash_lib.target.fp8_rows import encode_rows
from dflash_lib.target.served import engine_files, target_engine_url

SHARD_SAMPLES = 256  # samples per shard file (a resume refuses a manifest of another count)
SAMPLE_BYTES = 28  # a sample's key (20 bytes) and offset (8) in its shard
LOCK = "capture"  # out/capture.lock, held while a capture writes the folder
Fetch = Callable[[list[list[int]]], list[torch.Tensor]]  # documents' token ids -> their (len, aux layers, H) states


@dataclass(frozen=True)
class CapturePlan:
    """What a capture writes: the samples training reads, in store order, cut into shards of `shard_samples`."""

    kept: np.ndarray  # (n,) int64 store indices of the samples `validate_sample` passes
    lengths: np.ndarray  # (n,) int64 their tokens
    skipped: SkipCounter  # the others by reason (examples: store indices), as training counts them
    shard_samples: int
    bytes_per_token: int  # of the stored features and final states, their scales included

    @property
    def shards(self) -> int:
        return -(-len(self.kept) // self.shard_samples)

    def shard(self, k: int) -> np.ndarray:
        """The store indices of shard k's samples."""
        return self.kept[k * self.shard_samples:(k + 1) * self.shard_samples]

    def shard_bytes(self, k: int) -> int:
        """Bytes of shard k's tensors (its safetensors header aside)."""
        n = len(self.shard(k))
        tokens = int(self.lengths[k * self.shard_samples:k * self.shard_samples + n].sum())
        return tokens * self.bytes_per_token + n * SAMPLE_BYTES + 8


def plan_capture(store: Any, identity: CacheIdentity, stored: str, vocab_size: int,
                 shard_samples: int) -> CapturePlan:
    """The samples of `store` that training reads from a target of `vocab_size` token ids (the others counted by
    reason) and the bytes a token of them takes in `stored` (features, final states, scales)."""
    skipped, kept = SkipCounter(), []
    for i in range(len(store)):
        if skipped.check(*store[i], vocab_size, record=i):
            kept.append(i)
    index = np.asarray(kept, dtype=np.int64)
    per_token = sum(shape[1] * (4 if dtype == "F32" else STORED[stored].itemsize)
                    for shape, dtype in shard_tensors(identity, stored, 1).values())
    return CapturePlan(index, np.asarray(store.lengths, dtype=np.int64)[index], skipped, shard_samples, per_token)


class CaptureJob:
    """A capture of `store` into the folder `out` (`capture_into` makes one, holding the folder's lock): its
    manifest `doc` and `plan`; `write` fetches and writes every shard the manifest does not name."""

    def __init__(self, store: Any, out: Path, doc: dict[str, Any], plan: CapturePlan,
                 identity: CacheIdentity) -> None:
        self.store, self.out, self.doc, self.plan, self.identity = store, out, doc, plan, identity

    @property
    def complete(self) -> bool:
        return bool(self.doc["complete"])

    def remaining_bytes(self) -> int:
        """Bytes of the shards the manifest does not name yet."""
        done = {s["shard"] for s in self.doc["shards"]}
        return sum(self.plan.shard_bytes(k) for k in range(self.plan.shards) if k not in done)

    def check_room(self) -> None:
        """ConfigError in one line naming the folder when its disk has less free space than `remaining_bytes`."""
        need, free = self.remaining_bytes(), shutil.disk_usage(self.out).free
        if free < need:
            raise ConfigError(f"capture into {self.out}: {free / 2**30:.2f} GiB free on its disk, the capture writes "
                              f"{need / 2**30:.2f} GiB more ({int(self.plan.lengths.sum()):,} tokens x "
                              f"{self.plan.bytes_per_token:,} bytes a token in all): make room, or capture into a "
                              "folder on a bigger disk")

    def begin(self) -> None:
        """Before the first shard: `check_room`, then the manifest written (a failed write in one line)."""
        self.check_room()
        try:
            self.save_manifest()
        except OSError as e:
            raise self._write_error(MANIFEST, e) from None

    def write(self, fetch: Fetch, pick: torch.Tensor, last: int | None = None, progress: bool = True
              ) -> dict[str, Any]:
        """Every shard the manifest lacks: `fetch(documents)` gives each document's (len, aux layers, H) hidden
        states (the engine's), `pick` the aux layer of each feature layer, `last` the aux layer of the last
        layer's output (required by an identity with `final_states`). Returns the manifest, complete."""
        if self.identity.final_states and last is None:
            raise ValueError("a cache of the final states needs the aux layer of the last layer's output (`last`)")
        done = {s["shard"] for s in self.doc["shards"]}
        bar = None
        if progress:
            from tqdm.auto import tqdm

            bar = tqdm(total=self.plan.shards, initial=len(done), desc="capture", unit="shard")
        for k in range(self.plan.shards):
            if k in done:
                continue
            index = self.plan.shard(k)
            ids = [np.asarray(self.store[int(i)][0]) for i in index]
            states = fetch([d.tolist() for d in ids])
            self._check_states(index, ids, states)
            self._save(k, self._shard(ids, states, [int(p) for p in pick], last))  # `states` emptied
            if bar is not None:
                bar.update(1)
        if bar is not None:
            bar.close()
        self.doc["complete"] = True
        self.save_manifest()
        return self.doc

    def _check_states(self, index: np.ndarray, ids: list[np.ndarray], states: list[torch.Tensor]) -> None:
        """Every document's states against its tokens and the cache's dtype, before a byte is written."""
        dtype = DTYPES[self.identity.dtype]
        for i, d, st in zip(index, ids, states, strict=True):
            if st.shape[0] != len(d):
                raise ConfigError(f"capture into {self.out}: sample {int(i)} has {len(d)} tokens but the engine gave "
                                  f"{st.shape[0]} rows of hidden states")
            if st.dtype not in (dtype, torch.float32):  # stored as the label says, never widened under it
                raise ConfigError(f"capture into {self.out}: the engine gave {st.dtype} hidden states (sample "
                                  f"{int(i)}) for a cache of {self.identity.dtype}: serve the target in "
                                  f"{self.identity.dtype}")

    def _shard(self, ids: list[np.ndarray], states: list[torch.Tensor | None], pick: list[int],
               last: int | None) -> dict[str, torch.Tensor]:
        """The shard's tensors: each row tensor one buffer, filled document by document; each document's states
        are dropped from `states` once copied in (the fetch hands them over), so the shard exists once beside what
        is left of the engine's states."""
        stored, H = self.doc["stored"], self.identity.hidden_size
        want = shard_tensors(self.identity, stored, sum(len(d) for d in ids))
        out = {name: torch.empty(shape, dtype=torch.float32 if dtype == "F32" else STORED[stored])
               for name, (shape, dtype) in want.items()}
        layers = {"features": pick, **({"last": [last]} if "last" in out else {})}  # the aux layers of each tensor
        row = 0
        for j in range(len(states)):
            st, states[j] = states[j], None
            n = st.shape[0]
            for name, aux in layers.items():
                dst = out[name][row:row + n].view(n, len(aux), H)
                if name + "_scale" in out:  # e4m3 with a scale per token and layer
                    encode_rows(st[:, aux], dst, out[name + "_scale"][row:row + n])
                else:
                    for f, a in enumerate(aux):  # a layer at a time: no copy of the document's states
                        dst[:, f].copy_(st[:, a])
            row += n
            del st
        out["offsets"] = torch.from_numpy(np.concatenate([[0], np.cumsum([len(d) for d in ids])]).astype(np.int64))
        out["keys"] = torch.from_numpy(np.frombuffer(b"".join(token_key(d) for d in ids), np.uint8)
                                       .reshape(-1, 20).copy())
        return out

    def _save(self, k: int, tensors: dict[str, torch.Tensor]) -> None:
        """Shard k written under a temporary name, synced, renamed, then named in the manifest. A write that fails
        (a full disk) leaves neither the shard nor its temporary file and the manifest as it was, and raises
        ConfigError in one line naming the folder."""
        name = f"shard-{k:05d}.safetensors"
        part, path = self.out / (name + ".part"), self.out / name
        entry = {"shard": k, "file": name, "samples": len(tensors["keys"]), "tokens": int(tensors["offsets"][-1])}
        try:
            save_file(tensors, str(part))
            _sync(part)  # a write error the file system reports late (quota, NFS) comes here, before the rename
            entry["sha256"] = file_sha256(part)
            os.replace(part, path)
            self.doc["shards"].append(entry)
            self.save_manifest()
        except (OSError, SafetensorError) as e:
            if self.doc["shards"] and self.doc["shards"][-1] is entry:
                self.doc["shards"].pop()
            part.unlink(missing_ok=True)
            path.unlink(missing_ok=True)
            raise self._write_error(name, e) from None
        except BaseException:  # a killed capture: no temporary file left behind
            part.unlink(missing_ok=True)
            raise

    def save_manifest(self) -> None:
        """manifest.json replaced whole (temporary name, synced, renamed); its temporary file never left behind."""
        tmp = self.out / (MANIFEST + ".part")
        try:
            tmp.write_text(json.dumps(self.doc, indent=1))
            _sync(tmp)
            os.replace(tmp, self.out / MANIFEST)
        finally:
            tmp.unlink(missing_ok=True)

    def _write_error(self, name: str, e: BaseException) -> ConfigError:
        """A failed write of `name` (a full disk, a quota, an I/O error) in one line naming the folder."""
        free = shutil.disk_usage(self.out).free
        return ConfigError(f"capture into {self.out}: writing {name} failed ({type(e).__name__}: "
                           f"{' '.join(str(e).split())[:200]}); {len(self.doc['shards'])} of {self.plan.shards} "
                           f"shards are whole and named in its {MANIFEST}, {free / 2**30:.2f} GiB free: make room "
                           "and capture again (it resumes)")


def _sync(path: Path) -> None:
    """fsync `path`'s data."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def capture_into(store: Any, identity: CacheIdentity, out: str | Path, vocab_size: int, stored: str | None = None,
                 say: Callable[[str], None] = print) -> Iterator[CaptureJob]:
    """The folder `out` locked for a capture of `store` for `identity` into shards of `stored` (None: the engine's
    dtype, `identity.dtype`; or float8_e4m3fn), a new manifest or the one to resume. Prints the bytes per token,
    the samples kept and skipped and the projected total first. ConfigError in one line: another capture holds
    the folder; its manifest is another identity's, another stored dtype's (`hidden_cache_dtype`), another shard
    size's (`shard_samples`) or names another count of samples; its disk has less free space than the shards still
    to write."""
    out = Path(out)
    stored = stored or identity.dtype
    if stored not in STORED:
        raise ConfigError(f"capture into {out}: hidden_cache_dtype {stored!r} is none of {sorted(STORED)}")
    out.mkdir(parents=True, exist_ok=True)
    with folder_lock(out, LOCK):
        doc = read_manifest(out)
        if doc is not None:
            _refuse_other(doc, identity, stored, out / MANIFEST)
        plan = plan_capture(store, identity, stored, vocab_size, SHARD_SAMPLES)
        if doc is None:
            doc = {"format": FORMAT, "identity": {**asdict(identity), "layer_ids": list(identity.layer_ids)},
                   "stored": stored, "shard_samples": SHARD_SAMPLES, "samples": len(plan.kept),
                   "tokens": int(plan.lengths.sum()), "skipped": plan.skipped.counts, "shards": [], "complete": False}
        elif doc["samples"] != len(plan.kept):
            raise ConfigError(f"{out / MANIFEST}: names {doc['samples']} samples to capture, this store keeps "
                              f"{len(plan.kept)} of its {len(store)} ({plan.skipped.summary()}): capture into another "
                              "folder")
        job = CaptureJob(store, out, doc, plan, identity)
        if not job.complete:
            layers = len(identity.layer_ids) + identity.final_states
            say(f"capture: {layers} layers x {identity.hidden_size} in {stored} = {plan.bytes_per_token:,} bytes a "
                f"token; {int(plan.lengths.sum()):,} tokens of {len(plan.kept):,} samples ({plan.skipped.summary()} "
                f"as training skips them) -> {sum(map(plan.shard_bytes, range(plan.shards))) / 2**30:.2f} GiB in "
                f"{out}, {job.remaining_bytes() / 2**30:.2f} GiB of it still to write")
            job.begin()
        yield job


def _refuse_other(doc: dict[str, Any], identity: CacheIdentity, stored: str, path: Path) -> None:
    """ConfigError in one line naming the setting in which a manifest to resume differs from this capture's."""
    identity.refuse_other(identity_of(doc), path.parent)
    if doc["stored"] != stored:
        theirs = "engine" if doc["stored"] in DTYPES else doc["stored"]
        raise ConfigError(f"{path}: its shards hold {doc['stored']}, this capture writes {stored} "
                          f"(hidden_cache_dtype): resume with -p hidden_cache_dtype {theirs}, or capture into another "
                          "folder")
    if doc["shard_samples"] != SHARD_SAMPLES:
        raise ConfigError(f"{path}: captured in shards of {doc['shard_samples']} samples, this version writes shards "
                          f"of {SHARD_SAMPLES} (shard_samples): resume with the version that began it, or capture "
                          "into another folder")


def capture(store: Any, identity: CacheIdentity, out: str | Path, fetch: Fetch, pick: torch.Tensor, *,
            vocab_size: int, stored: str | None = None, say: Callable[[str], None] = print, progress: bool = True,
            last: int | None = None) -> dict[str, Any]:
    """Write the features of every sample of `store` that training reads from a target of `vocab_size` ids into
    the cache folder `out` (`capture_into`, then `CaptureJob.write`). Resumes an unfinished cache of the same
    identity, stored dtype and shard size; refuses another's. Returns the manifest."""
    with capture_into(store, identity, out, vocab_size, stored, say) as job:
        return job.write(fetch, pick, last, progress)


def run_capture(config: Any, out: str | Path, progress: bool = True) -> dict[str, Any]:
    """`python -m dflash_lib capture`: the token store of `config.data` captured through the engine serving
    `config.model.target` (`target_engine_url`, else started here, its log in out/engine/) into `out`, in
    `model.hidden_cache_dtype`. Every refusal comes before an engine starts; a complete cache starts none."""
    m = config.model
    if not Path(m.target).is_dir():
        raise ConfigError(f"capture serves a LOCAL model folder, got target {m.target!r}")
    facts = read_facts(m)
    store = build_token_store_from_config(config.data, progress=progress)
    cuda = config.train.device == "cuda" or (config.train.device == "auto" and torch.cuda.is_available())
    device = torch.device("cuda" if cuda else "cpu")  # the trainer's: with the target, the engine's dtype
    identity = CacheIdentity.of(config, facts.layer_ids, facts.hidden_size, store.meta["key"], device)
    stored = None if m.hidden_cache_dtype == "engine" else m.hidden_cache_dtype
    with capture_into(store, identity, out, facts.vocab_size, stored) as job:
        if job.complete:
            return job.doc
        with target_engine_url(config, facts, Path(out) / "engine", device) as url:
            files = engine_files(config, facts, Path(out) / "engine", device, str(Path(out).resolve()))
            client = HiddenStatesClient(url, files, facts.hidden_size, max(1, config.pipeline.target_workers) * 4)
            try:
                final = identity.final_states
                return job.write(client.fetch, facts.engine_pick(final), facts.engine_last() if final else None,
                                 progress)
            finally:
                client.close()
