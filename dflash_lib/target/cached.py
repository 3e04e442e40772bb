"""The target's features of a token store captured once from the engine and read for many epochs:
`python -m dflash_lib capture ... --out CACHE`, then `train -p hidden_cache CACHE` (docs/scale.md).

A cache is a folder: manifest.json (`CacheIdentity`: the target, its config.json's sha256 and its weights'
fingerprint, the feature layers, the dtype the engine ran and the cache holds, the token store's key; each shard
written with its sha256) and shards of `SHARD_SAMPLES` samples, each one safetensors file: `features` [tokens, F*H],
`offsets` [n+1] int64, `keys` [n, 20] uint8, the sha1 of each sample's token ids, by which a document of any batch
finds its rows, and for a loss reading the target's final states (`final_states`) `last` [tokens, H], the last
layer's output before the final norm. A shard is written whole (temporary name, then renamed) before the manifest
names it, so a killed capture resumes at the first shard it does not name. A reader checks a shard's sha256 at its
first read and every document's rows against its tokens.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from dflash_lib.config import ConfigError, reads_final_states
from dflash_lib.data import build_token_store_from_config
from dflash_lib.models.export import file_sha256
from dflash_lib.serve.engine_plugins.model_identity import config_sha256, weights_fingerprint
from dflash_lib.serve.hidden_states import HiddenStatesClient
from dflash_lib.target.facts import TargetFacts, read_facts
from dflash_lib.target.served import engine_files, served_dtype, target_engine_url

MANIFEST = "manifest.json"
FORMAT = 3  # 3: whether the last layer's states are held; 2: a sha256 per shard, the target's weights fingerprint,
# the dtype the engine runs (1: none of them)
SHARD_SAMPLES = 256  # samples per shard file
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
SHARD_FIELDS = ("shard", "file", "samples", "tokens", "sha256")  # what the manifest records of each shard


def token_key(ids: Sequence[int] | np.ndarray | torch.Tensor) -> bytes:
    """The 20-byte sha1 of a document's token ids (as little-endian uint32): its key in a cache."""
    arr = ids.numpy() if isinstance(ids, torch.Tensor) else np.asarray(ids)
    return hashlib.sha1(arr.astype("<u4").tobytes()).digest()


@dataclass(frozen=True)
class CacheIdentity:
    """What a cache was captured for: a cache is read only by a run whose identity is the same."""

    target: str  # the target folder (resolved)
    target_config_sha256: str  # of its config.json
    layer_ids: tuple[int, ...]  # our feature layers, in concatenation order
    hidden_size: int
    dtype: str  # float32 | bfloat16: what the engine ran and the shards hold (`served.served_dtype`)
    store_key: str  # the token store's settings key (its meta.json)
    target_weights_fingerprint: str  # `model_identity.weights_fingerprint` of the folder (weights replaced in place
    # differ here)
    final_states: bool  # each shard also holds `last` (the last layer's output): a run of loss kl / ce+kl

    @classmethod
    def of(cls, config: Any, layer_ids: Sequence[int], hidden_size: int, store_key: str,
           device: torch.device) -> "CacheIdentity":
        folder = Path(config.model.target).resolve()
        return cls(str(folder), config_sha256(folder), tuple(int(i) for i in layer_ids), int(hidden_size),
                   served_dtype(config, device), str(store_key), weights_fingerprint(folder),
                   reads_final_states(config.model.loss))

    def refuse_other(self, other: "CacheIdentity", where: Path) -> None:
        """ConfigError in one line naming the first setting in which `other` (the cache's) differs."""
        for name, mine in asdict(self).items():
            theirs = getattr(other, name)
            if (list(mine) if isinstance(mine, tuple) else mine) != (list(theirs) if isinstance(theirs, tuple)
                                                                      else theirs):
                raise ConfigError(f"{where}: captured for another {name.replace('_', ' ')} ({theirs!r}; this run: "
                                  f"{mine!r}): capture again into another folder")


def read_manifest(cache: str | Path) -> dict[str, Any] | None:
    """The cache's manifest (None when the folder holds none yet); ConfigError naming a broken one."""
    path = Path(cache) / MANIFEST
    if not path.is_file():
        return None
    try:
        doc = json.loads(path.read_text())
        fmt = doc.get("format")
    except (OSError, ValueError, AttributeError) as e:
        raise ConfigError(f"{path}: not a hidden-states cache manifest ({type(e).__name__}: {e})") from None
    if fmt != FORMAT:  # before its fields: another format names others
        raise ConfigError(f"{path}: cache format {fmt!r}, this version reads format {FORMAT} only (what a cache "
                          "vouches for changed): capture again into another folder")
    try:
        identity_of(doc)
        for shard in doc["shards"]:
            if missing := [name for name in SHARD_FIELDS if name not in shard]:
                raise KeyError(f"a shard without {missing}")
    except (ValueError, KeyError, TypeError) as e:
        raise ConfigError(f"{path}: not a hidden-states cache manifest ({type(e).__name__}: {e})") from None
    return doc


def identity_of(doc: dict[str, Any]) -> CacheIdentity:
    """The identity a manifest records (every field required: a missing one is a KeyError)."""
    fields = {name: doc["identity"][name] for name in CacheIdentity.__dataclass_fields__}
    return CacheIdentity(**{**fields, "layer_ids": tuple(fields["layer_ids"])})


def _write_manifest(cache: Path, doc: dict[str, Any]) -> None:
    tmp = cache / (MANIFEST + ".part")
    tmp.write_text(json.dumps(doc, indent=1))
    os.replace(tmp, cache / MANIFEST)


def capture(store: Any, identity: CacheIdentity, out: str | Path, fetch: Callable[[list[list[int]]], list[torch.Tensor]],
            pick: torch.Tensor, say: Callable[[str], None] = print, progress: bool = True,
            last: int | None = None) -> dict[str, Any]:
    """Write the features of every sample of `store` into the cache folder `out`: `fetch(documents)` gives each
    document's (len, aux layers, H) hidden states (the engine's), `pick` the aux layer of each feature layer,
    `last` the aux layer of the last layer's output (required by an identity with `final_states`).
    Resumes an unfinished cache of the same identity; refuses another's. Prints the bytes per token and the
    projected total first. Returns the manifest."""
    out = Path(out)
    doc = read_manifest(out)
    if doc is not None:
        identity.refuse_other(identity_of(doc), out)
    else:
        out.mkdir(parents=True, exist_ok=True)
        doc = {"format": FORMAT, "identity": {**asdict(identity), "layer_ids": list(identity.layer_ids)},
               "shard_samples": SHARD_SAMPLES, "samples": len(store), "shards": [], "complete": False}
        _write_manifest(out, doc)
    if identity.final_states and last is None:
        raise ValueError("a cache of the final states needs the aux layer of the last layer's output (`last`)")
    dtype = DTYPES[identity.dtype]
    layers = len(identity.layer_ids) + identity.final_states
    per_token = layers * identity.hidden_size * dtype.itemsize
    lengths = np.asarray(store.lengths)
    say(f"capture: {layers} layers x {identity.hidden_size} in {identity.dtype} = {per_token:,} "
        f"bytes a token; {int(lengths.sum()):,} tokens of {len(store):,} samples -> "
        f"{per_token * int(lengths.sum()) / 2**30:.2f} GiB in {out}")
    shards = -(-len(store) // SHARD_SAMPLES)
    done = {s["shard"] for s in doc["shards"]}
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=shards, initial=len(done), desc="capture", unit="shard")
    for k in range(shards):
        if k in done:
            continue
        first = k * SHARD_SAMPLES
        ids = [store[i][0] for i in range(first, min(len(store), first + SHARD_SAMPLES))]
        states = fetch([d.tolist() for d in ids])
        for i, (d, st) in enumerate(zip(ids, states, strict=True)):  # before a byte is written
            if st.shape[0] != len(d):
                raise ConfigError(f"capture into {out}: sample {first + i} has {len(d)} tokens but the engine gave "
                                  f"{st.shape[0]} rows of hidden states")
            if st.dtype not in (dtype, torch.float32):  # stored as the label says, never widened under it
                raise ConfigError(f"capture into {out}: the engine gave {st.dtype} hidden states (sample "
                                  f"{first + i}) for a cache of {identity.dtype}: serve the target in {identity.dtype}")
        feats = torch.cat([s[:, pick].reshape(s.shape[0], -1) for s in states]).to(dtype)
        offsets = torch.from_numpy(np.concatenate([[0], np.cumsum([len(d) for d in ids])]).astype(np.int64))
        keys = torch.from_numpy(np.frombuffer(b"".join(token_key(d) for d in ids), np.uint8).reshape(-1, 20).copy())
        name = f"shard-{k:05d}.safetensors"
        part = out / (name + ".part")
        tensors = {"features": feats.contiguous(), "offsets": offsets, "keys": keys}
        if identity.final_states:
            tensors["last"] = torch.cat([s[:, last] for s in states]).to(dtype).contiguous()  # (tokens, H)
        save_file(tensors, str(part))
        sha = file_sha256(part)
        os.replace(part, out / name)
        doc["shards"].append({"shard": k, "file": name, "samples": len(ids), "tokens": int(offsets[-1]),
                              "sha256": sha})
        _write_manifest(out, doc)  # named only once whole
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()
    doc["complete"] = True
    _write_manifest(out, doc)
    return doc


class CapturedFeatures:
    """A complete cache opened for reading: `get(ids)` -> (len, F*H) features of a document, or None (and
    `get_last(ids)` -> (len, H), the last layer's output, from a cache of the final states). Opening
    reads each shard's header, offsets and keys (the index); a shard's sha256 is checked at the first `get` that
    reads it (a shard of a big cache is GBs: opening stays fast), and every document's rows against its tokens."""

    def __init__(self, cache: str | Path) -> None:
        self.path = Path(cache)
        doc = read_manifest(self.path)
        if doc is None or not doc.get("complete"):
            raise ConfigError(f"{self.path}: not a complete hidden-states cache (run `capture` into it, or let it "
                              "finish: it resumes)")
        self.identity = identity_of(doc)
        self.shards = doc["shards"]
        width = len(self.identity.layer_ids) * self.identity.hidden_size
        self.index: dict[bytes, tuple[int, int, int, int]] = {}  # key -> (shard, document in it, start, end row)
        self.files = []
        for k, shard in enumerate(self.shards):
            path = self.path / shard["file"]
            try:
                f = safe_open(str(path), framework="pt")
                offsets, keys = f.get_tensor("offsets"), f.get_tensor("keys").numpy()
                rows = f.get_slice("features").get_shape()
                last = f.get_slice("last").get_shape() if self.identity.final_states else [int(shard["tokens"]),
                                                                                             self.identity.hidden_size]
            except Exception as e:  # noqa: BLE001 - safetensors words a broken file in several types
                raise ConfigError(f"{path}: not a readable safetensors file ({type(e).__name__}: "
                                  f"{' '.join(str(e).split())}): a broken shard, capture again into another folder"
                                  ) from None
            n = int(shard["samples"])
            why = _shard_fault(keys.shape, offsets, rows, n, int(shard["tokens"]), width)
            if not why and list(last) != [int(shard["tokens"]), self.identity.hidden_size]:
                why = f"last {list(last)}, the manifest's {[int(shard['tokens']), self.identity.hidden_size]}"
            if why:
                raise ConfigError(f"{path}: {why}: a broken shard, capture again into another folder")
            offsets = offsets.tolist()
            for j in range(n):
                self.index.setdefault(keys[j].tobytes(), (k, j, offsets[j], offsets[j + 1]))
            self.files.append(f)
        self.checked = [False] * len(self.shards)  # sha256 verified (once per shard and process)
        self.locks = [threading.Lock() for _ in self.shards]  # target workers read in threads

    def get(self, ids: Sequence[int] | torch.Tensor) -> torch.Tensor | None:
        """The (len(ids), F*H) features of the document `ids`, in the cache's dtype; None when it is not cached.
        ConfigError in one line naming the shard when its sha256 is not the manifest's or the document's rows
        are not its tokens."""
        return self._rows(ids, "features")

    def get_last(self, ids: Sequence[int] | torch.Tensor) -> torch.Tensor | None:
        """The (len(ids), H) last layer's output (before the final norm) of the document `ids`, as `get`; a cache
        of the final states only (`identity.final_states`)."""
        if not self.identity.final_states:
            raise ConfigError(f"{self.path}: holds the feature layers only, not the last layer's states: capture "
                              "again with loss kl or ce+kl into another folder")
        return self._rows(ids, "last")

    def _rows(self, ids: Sequence[int] | torch.Tensor, tensor: str) -> torch.Tensor | None:
        hit = self.index.get(token_key(ids))
        if hit is None:
            return None
        k, j, s, e = hit
        self._check(k)
        if e - s != len(ids):
            raise ConfigError(f"{self.path / self.shards[k]['file']}: document {j} of the shard has {e - s} rows in "
                              f"its offsets but {len(ids)} tokens: a broken shard, capture again into another folder")
        return self.files[k].get_slice(tensor)[s:e]

    def _check(self, k: int) -> None:
        """Shard k's bytes against the manifest's sha256, once (the first read of the shard)."""
        if self.checked[k]:
            return
        with self.locks[k]:
            if self.checked[k]:
                return
            path, want = self.path / self.shards[k]["file"], self.shards[k]["sha256"]
            got = file_sha256(path)
            if got != want:
                raise ConfigError(f"{path}: sha256 {got[:16]}... is not the manifest's {want[:16]}... (the shard "
                                  "changed after capture: a flipped bit, a partial copy): capture again into another "
                                  "folder")
            self.checked[k] = True


def _shard_fault(keys: Sequence[int], offsets: torch.Tensor, rows: Sequence[int], samples: int, tokens: int,
                 width: int) -> str:
    """What is wrong with a shard's keys (shape), offsets [n+1] and features (shape) against its manifest entry
    (`samples`, `tokens`) and the identity's feature width F*H; "" when nothing is."""
    if tuple(keys) != (samples, 20) or tuple(offsets.shape) != (samples + 1,):
        return f"keys {tuple(keys)} and offsets {tuple(offsets.shape)} for the manifest's {samples} samples"
    if int(offsets[0]) != 0 or bool((offsets[1:] < offsets[:-1]).any()) or int(offsets[-1]) != tokens:
        return f"offsets {int(offsets[0])} .. {int(offsets[-1])} not ascending from 0 to the manifest's {tokens} tokens"
    if list(rows) != [tokens, width]:
        return f"features {list(rows)}, the manifest's {[tokens, width]}"
    return ""


def run_capture(config: Any, out: str | Path, progress: bool = True) -> dict[str, Any]:
    """`python -m dflash_lib capture`: the token store of `config.data` captured through the engine serving
    `config.model.target` (`target_engine_url`, else started here, its log in out/engine/) into `out`."""
    m = config.model
    if not Path(m.target).is_dir():
        raise ConfigError(f"capture serves a LOCAL model folder, got target {m.target!r}")
    facts = read_facts(m)
    store = build_token_store_from_config(config.data, progress=progress)
    cuda = config.train.device == "cuda" or (config.train.device == "auto" and torch.cuda.is_available())
    device = torch.device("cuda" if cuda else "cpu")  # the trainer's: with the target, the engine's dtype
    identity = CacheIdentity.of(config, facts.layer_ids, facts.hidden_size, store.meta["key"], device)
    existing = read_manifest(out)  # refused before an engine starts
    if existing is not None:
        identity.refuse_other(identity_of(existing), Path(out))
        if existing.get("complete"):  # nothing left to capture: no engine started
            return existing
    with target_engine_url(config, facts, Path(out) / "engine", device) as url:
        files = engine_files(config, facts, Path(out) / "engine", device, str(Path(out).resolve()))
        client = HiddenStatesClient(url, files, facts.hidden_size, max(1, config.pipeline.target_workers) * 4)
        try:
            final = identity.final_states
            return capture(store, identity, out, client.fetch, facts.engine_pick(final), progress=progress,
                           last=facts.engine_last() if final else None)
        finally:
            client.close()


def open_cache(config: Any, facts: TargetFacts, store_key: str, device: torch.device) -> CapturedFeatures:
    """`config.model.hidden_cache` opened for this run (its target's `facts`), refused in one line when it was
    captured for another target (its config.json, its weights' fingerprint), layer set, dtype
    (`served.served_dtype`) or token store."""
    cache = CapturedFeatures(config.model.hidden_cache)
    CacheIdentity.of(config, facts.layer_ids, facts.hidden_size, store_key, device).refuse_other(cache.identity,
                                                                                                cache.path)
    return cache
