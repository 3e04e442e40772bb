"""The target's features of a token store captured once from the engine and read for many epochs:
`python -m dflash_lib capture ... --out CACHE`, then `train -p hidden_cache CACHE` (docs/scale.md).

A cache is a folder: manifest.json (`CacheIdentity`: the target, its config.json's sha256, the feature layers, the
dtype, the token store's key; the shards written) and shards of `SHARD_SAMPLES` samples, each one safetensors file:
`features` [tokens, F*H], `offsets` [n+1] int64, `keys` [n, 20] uint8, the sha1 of each sample's token ids, by
which a document of any batch finds its rows. A shard is written whole (temporary name, then renamed) before the
manifest names it, so a killed capture resumes at the first shard it does not name.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from dflash_lib.config import ConfigError, uses_bf16
from dflash_lib.data import build_token_store_from_config
from dflash_lib.models.target import chosen_layer_ids, local_hf_config
from dflash_lib.serve.hidden_states import HiddenStatesClient, engine_layer_ids, target_engine_url

MANIFEST = "manifest.json"
FORMAT = 1
SHARD_SAMPLES = 256  # samples per shard file
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


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
    dtype: str  # float32 | bfloat16
    store_key: str  # the token store's settings key (its meta.json)

    @classmethod
    def of(cls, config: Any, layer_ids: Sequence[int], hidden_size: int, store_key: str,
           device: torch.device) -> "CacheIdentity":
        folder = Path(config.model.target).resolve()
        sha = hashlib.sha256((folder / "config.json").read_bytes()).hexdigest()
        dtype = "bfloat16" if uses_bf16(config.train.precision, device) else "float32"
        return cls(str(folder), sha, tuple(int(i) for i in layer_ids), int(hidden_size), dtype, str(store_key))

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
        CacheIdentity(**{**doc["identity"], "layer_ids": tuple(doc["identity"]["layer_ids"])})
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ConfigError(f"{path}: not a hidden-states cache manifest ({type(e).__name__}: {e})") from None
    if doc.get("format") != FORMAT:
        raise ConfigError(f"{path}: cache format {doc.get('format')!r}, this version reads {FORMAT}")
    return doc


def identity_of(doc: dict[str, Any]) -> CacheIdentity:
    return CacheIdentity(**{**doc["identity"], "layer_ids": tuple(doc["identity"]["layer_ids"])})


def _write_manifest(cache: Path, doc: dict[str, Any]) -> None:
    tmp = cache / (MANIFEST + ".part")
    tmp.write_text(json.dumps(doc, indent=1))
    os.replace(tmp, cache / MANIFEST)


def capture(store: Any, identity: CacheIdentity, out: str | Path, fetch: Callable[[list[list[int]]], list[torch.Tensor]],
            pick: torch.Tensor, say: Callable[[str], None] = print, progress: bool = True) -> dict[str, Any]:
    """Write the features of every sample of `store` into the cache folder `out`: `fetch(documents)` gives each
    document's (len, aux layers, H) hidden states (the engine's), `pick` the aux layer of each feature layer.
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
    dtype = DTYPES[identity.dtype]
    per_token = len(identity.layer_ids) * identity.hidden_size * dtype.itemsize
    lengths = np.asarray(store.lengths)
    say(f"capture: {len(identity.layer_ids)} layers x {identity.hidden_size} in {identity.dtype} = {per_token:,} "
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
        ids = [store[i][0] for i in range(k * SHARD_SAMPLES, min(len(store), (k + 1) * SHARD_SAMPLES))]
        states = fetch([d.tolist() for d in ids])
        feats = torch.cat([s[:, pick].reshape(s.shape[0], -1) for s in states]).to(dtype)
        offsets = torch.from_numpy(np.concatenate([[0], np.cumsum([len(d) for d in ids])]).astype(np.int64))
        keys = torch.from_numpy(np.frombuffer(b"".join(token_key(d) for d in ids), np.uint8).reshape(-1, 20).copy())
        name = f"shard-{k:05d}.safetensors"
        save_file({"features": feats.contiguous(), "offsets": offsets, "keys": keys}, str(out / (name + ".part")))
        os.replace(out / (name + ".part"), out / name)
        doc["shards"].append({"shard": k, "file": name, "samples": len(ids), "tokens": int(offsets[-1])})
        _write_manifest(out, doc)  # named only once whole
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()
    doc["complete"] = True
    _write_manifest(out, doc)
    return doc


class HiddenCache:
    """A complete cache opened for reading: `get(ids)` -> (len, F*H) features of a document, or None."""

    def __init__(self, cache: str | Path) -> None:
        self.path = Path(cache)
        doc = read_manifest(self.path)
        if doc is None or not doc.get("complete"):
            raise ConfigError(f"{self.path}: not a complete hidden-states cache (run `capture` into it, or let it "
                              "finish: it resumes)")
        self.identity = identity_of(doc)
        self.index: dict[bytes, tuple[int, int, int]] = {}  # key -> (shard, start row, end row)
        self.files = []
        for k, shard in enumerate(doc["shards"]):
            f = safe_open(str(self.path / shard["file"]), framework="pt")
            offsets, keys = f.get_tensor("offsets").tolist(), f.get_tensor("keys").numpy()
            for j in range(len(keys)):
                self.index.setdefault(keys[j].tobytes(), (k, offsets[j], offsets[j + 1]))
            self.files.append(f)

    def get(self, ids: Sequence[int] | torch.Tensor) -> torch.Tensor | None:
        hit = self.index.get(token_key(ids))
        if hit is None:
            return None
        k, s, e = hit
        return self.files[k].get_slice("features")[s:e]


def run_capture(config: Any, out: str | Path, progress: bool = True) -> dict[str, Any]:
    """`python -m dflash_lib capture`: the token store of `config.data` captured through the engine serving
    `config.model.target` (`target_engine_url`, else started here, its log in out/engine/) into `out`."""
    m = config.model
    if not Path(m.target).is_dir():
        raise ConfigError(f"capture serves a LOCAL model folder, got target {m.target!r}")
    hf = local_hf_config(m.target)
    ids = chosen_layer_ids(m.target_layer_ids, hf.num_hidden_layers, m.num_features)
    store = build_token_store_from_config(config.data, progress=progress)
    cuda = config.train.device == "cuda" or (config.train.device == "auto" and torch.cuda.is_available())
    device = torch.device("cuda" if cuda else "cpu")  # the trainer's: its precision is the cache's dtype
    identity = CacheIdentity.of(config, ids, int(hf.hidden_size), store.meta["key"], device)
    existing = read_manifest(out)  # refused before an engine starts
    if existing is not None:
        identity.refuse_other(identity_of(existing), Path(out))
    aux = engine_layer_ids(ids)
    with target_engine_url(config, Path(out) / "engine", device) as url:
        client = HiddenStatesClient(url, str(Path(m.target).resolve()), len(aux), int(hf.hidden_size),
                                    max(1, config.pipeline.target_workers) * 4)
        try:
            return capture(store, identity, out, client.fetch, torch.tensor([aux.index(i + 1) for i in ids]),
                           progress=progress)
        finally:
            client.close()


def open_cache(config: Any, store_key: str, device: torch.device) -> HiddenCache:
    """`config.model.hidden_cache` opened for this run, refused in one line when it was captured for another
    target, layer set, dtype or token store."""
    m = config.model
    hf = local_hf_config(m.target)
    ids = chosen_layer_ids(m.target_layer_ids, hf.num_hidden_layers, m.num_features)
    cache = HiddenCache(m.hidden_cache)
    CacheIdentity.of(config, ids, int(hf.hidden_size), store_key, device).refuse_other(cache.identity, cache.path)
    return cache
