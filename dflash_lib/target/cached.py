"""A cache of the target's features, captured once from the engine (`target/capture.py`: `python -m dflash_lib
capture ... --out CACHE`) and read for many epochs (`train -p hidden_cache CACHE`): its identity and manifest
(`CacheIdentity`), its shard format and its reader. The folder's files: docs/scale.md (the capture).
"""

from __future__ import annotations

import hashlib
import json
import threading
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch
from safetensors import safe_open

from dflash_lib.config import ConfigError, reads_final_states
from dflash_lib.models.export import file_sha256
from dflash_lib.serve.engine_plugins.model_identity import config_sha256, weights_fingerprint
from dflash_lib.target.facts import TargetFacts
from dflash_lib.target.fp8_rows import FP8, decode_rows
from dflash_lib.target.served import served_dtype

MANIFEST = "manifest.json"
FORMAT = 4  # 4: the dtype the shards hold (fp8 with scales, or the engine's), the samples per shard, the samples left
# out as training leaves them out; 3: whether the last layer's states are held; 2: a sha256 per shard, the target's
# weights fingerprint, the dtype the engine runs (1: none of them)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}  # the dtypes an engine runs the target in
STORED = {**DTYPES, "float8_e4m3fn": FP8}  # the dtypes a shard holds its features in
FILE_DTYPES = {"float32": "F32", "bfloat16": "BF16", "float8_e4m3fn": "F8_E4M3"}  # as safetensors names them
SHARD_FIELDS = ("shard", "file", "samples", "tokens", "sha256")  # what the manifest records of each shard
FIELDS = ("identity", "stored", "shard_samples", "samples", "tokens", "skipped", "shards", "complete")  # of a manifest


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
        if missing := [name for name in FIELDS if name not in doc]:
            raise KeyError(f"no {missing}")
        if doc["stored"] not in STORED:
            raise ValueError(f"stored dtype {doc['stored']!r} is none of {sorted(STORED)}")
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
        self.stored = str(doc["stored"])  # the dtype the shards hold; `get` gives the engine's (identity.dtype)
        self.shards = doc["shards"]
        self.index: dict[bytes, tuple[int, int, int, int]] = {}  # key -> (shard, document in it, start, end row)
        self.files = []
        for k, shard in enumerate(self.shards):
            path = self.path / shard["file"]
            want = shard_tensors(self.identity, self.stored, int(shard["tokens"]))
            try:
                f = safe_open(str(path), framework="pt")
                offsets, keys = f.get_tensor("offsets"), f.get_tensor("keys").numpy()
                held = {name: (list(f.get_slice(name).get_shape()), f.get_slice(name).get_dtype())
                        for name in want if name in f.keys()}
            except Exception as e:  # noqa: BLE001 - safetensors words a broken file in several types
                raise ConfigError(f"{path}: not a readable safetensors file ({type(e).__name__}: "
                                  f"{' '.join(str(e).split())}): a broken shard, capture again into another folder"
                                  ) from None
            n = int(shard["samples"])
            why = _shard_fault(keys.shape, offsets, n, int(shard["tokens"]), held, want)
            if why:
                raise ConfigError(f"{path}: {why}: a broken shard, capture again into another folder")
            offsets = offsets.tolist()
            for j in range(n):
                self.index.setdefault(keys[j].tobytes(), (k, j, offsets[j], offsets[j + 1]))
            self.files.append(f)
        self.checked = [False] * len(self.shards)  # sha256 verified (once per shard and process)
        self.locks = [threading.Lock() for _ in self.shards]  # target workers read in threads

    def get(self, ids: Sequence[int] | torch.Tensor) -> torch.Tensor | None:
        """The (len(ids), F*H) features of the document `ids`, in the engine's dtype (`identity.dtype`: a cache of
        float8_e4m3fn decoded to it); None when it is not cached.
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
        rows = self.files[k].get_slice(tensor)[s:e]
        if self.stored not in DTYPES:  # e4m3 with a scale per token and layer
            return decode_rows(rows, self.files[k].get_slice(tensor + "_scale")[s:e], DTYPES[self.identity.dtype])
        return rows

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


def shard_tensors(identity: CacheIdentity, stored: str, tokens: int) -> dict[str, tuple[list[int], str]]:
    """The row tensors a shard of `tokens` tokens holds besides its offsets and keys: name -> (shape, dtype as
    safetensors names it): `features` [tokens, F*H] and, for the final states, `last` [tokens, H], in `stored`; in
    float8_e4m3fn their float32 scales, one per token and layer (`fp8_rows`)."""
    F, H = len(identity.layer_ids), identity.hidden_size
    out = {"features": ([tokens, F * H], FILE_DTYPES[stored])}
    if identity.final_states:
        out["last"] = ([tokens, H], FILE_DTYPES[stored])
    if stored not in DTYPES:
        out |= {f"{name}_scale": ([tokens, shape[1] // H], "F32") for name, (shape, _) in out.items()}
    return out


def _shard_fault(keys: Sequence[int], offsets: torch.Tensor, samples: int, tokens: int,
                 held: dict[str, tuple[list[int], str]], want: dict[str, tuple[list[int], str]]) -> str:
    """What is wrong with a shard's keys (shape), offsets [n+1] and row tensors (`held`: name -> shape, dtype)
    against its manifest entry (`samples`, `tokens`) and what the identity and the stored dtype make of it (`want`,
    `shard_tensors`); "" when nothing is."""
    if tuple(keys) != (samples, 20) or tuple(offsets.shape) != (samples + 1,):
        return f"keys {tuple(keys)} and offsets {tuple(offsets.shape)} for the manifest's {samples} samples"
    if int(offsets[0]) != 0 or bool((offsets[1:] < offsets[:-1]).any()) or int(offsets[-1]) != tokens:
        return f"offsets {int(offsets[0])} .. {int(offsets[-1])} not ascending from 0 to the manifest's {tokens} tokens"
    for name, (shape, dtype) in want.items():
        if name not in held:
            return f"no {name} tensor"
        if held[name][0] != shape:
            return f"{name} {held[name][0]}, the manifest's {shape}"
        if held[name][1] != dtype:
            return f"{name} in {held[name][1]}, the manifest's {dtype}"
    return ""


def open_cache(config: Any, facts: TargetFacts, store_key: str, device: torch.device) -> CapturedFeatures:
    """`config.model.hidden_cache` opened for this run (its target's `facts`), refused in one line when it was
    captured for another target (its config.json, its weights' fingerprint), layer set, dtype
    (`served.served_dtype`) or token store."""
    cache = CapturedFeatures(config.model.hidden_cache)
    CacheIdentity.of(config, facts.layer_ids, facts.hidden_size, store_key, device).refuse_other(cache.identity,
                                                                                                cache.path)
    return cache
