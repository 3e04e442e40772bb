"""Peak host memory of `capture` writing one shard, as a multiple of the shard's feature bytes (issue 55).

    .venv/bin/python -P benchmarks/capture_memory.py                      # 256 samples x 256 tokens x 3 x 576, bf16
    .venv/bin/python -P benchmarks/capture_memory.py --tokens 128 --hidden 512 --layers 2 --samples 64

Each dtype is measured in a fresh process: a stand-in engine's states of one shard, (tokens, layers, hidden) per
document in the cache's dtype, are made first and handed over by the fetch (as `HiddenStatesClient.fetch` hands
over the engine's); `capture` (`dflash_lib/target/cached.py`) then writes the shard. The figure: the process's peak
resident memory during the capture above its resident memory before it, over the features' bytes in the shard.
A shard held once is ~1 (its buffer); each further copy (a concatenation, a per-document pick, a cast) adds 1.
One JSON line per dtype; `tests/test_hidden_cache.py` runs it small.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

from dflash_lib.target.cached import CacheIdentity, capture


def resident_bytes() -> int:
    """This process's resident memory now (bytes)."""
    return int(Path("/proc/self/statm").read_text().split()[1]) * resource.getpagesize()


class _Store:
    """`samples` documents of `tokens` ids (a token store as `capture` reads one)."""

    def __init__(self, samples: int, tokens: int) -> None:
        self.docs = [np.arange(i, i + tokens, dtype=np.uint32) % 1000 for i in range(samples)]
        self.lengths = np.full(samples, tokens)

    def __len__(self) -> int:
        return len(self.docs)

    def __getitem__(self, i: int):
        return self.docs[i], np.ones(len(self.docs[i]), np.uint8)


def measure(samples: int, tokens: int, layers: int, hidden: int, dtype: str, engine_dtype: str) -> dict:
    """One shard of `samples` documents written by `capture` in this process, a cache of `dtype` from an engine's
    states in `engine_dtype`: its peak resident memory above the resident memory before it, over the features'
    bytes (in `dtype`)."""
    store = _Store(samples, tokens)
    identity = CacheIdentity(target="/t", target_config_sha256="c", layer_ids=tuple(range(layers)),
                             hidden_size=hidden, dtype=dtype, store_key="k", target_weights_fingerprint="w",
                             final_states=False)
    held = [torch.empty(tokens, layers, hidden, dtype=getattr(torch, engine_dtype)).fill_(1.5) for _ in range(samples)]

    def fetch(documents):
        out = held[:len(documents)]
        del held[:len(documents)]  # handed over: the engine's files are read once
        return out

    with tempfile.TemporaryDirectory() as out:
        before = resident_bytes()
        capture(store, identity, out, fetch, torch.arange(layers), say=lambda _: None, progress=False)
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        shard = sum(p.stat().st_size for p in Path(out).glob("shard-*.safetensors"))
    feature_bytes = samples * tokens * layers * hidden * getattr(torch, dtype).itemsize
    return {"dtype": dtype, "engine_dtype": engine_dtype, "samples": samples, "tokens": tokens, "layers": layers,
            "hidden": hidden,
            "feature_mib": round(feature_bytes / 2**20, 1), "shard_file_mib": round(shard / 2**20, 1),
            "peak_above_before_mib": round((peak - before) / 2**20, 1),
            "times_the_shard": round((peak - before) / feature_bytes, 2)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", type=int, default=256)
    ap.add_argument("--tokens", type=int, default=256, help="tokens per document")
    ap.add_argument("--layers", type=int, default=3, help="feature layers")
    ap.add_argument("--hidden", type=int, default=576)
    ap.add_argument("--dtype", action="append", help="CACHE[:ENGINE] dtypes, e.g. bfloat16:float32 (repeatable; "
                    "default: bfloat16, float32, bfloat16:float32)")
    ap.add_argument("--child", action="store_true", help="measure one dtype in this process")
    a = ap.parse_args()
    if a.child:
        cache, _, engine = a.dtype[0].partition(":")
        print(json.dumps(measure(a.samples, a.tokens, a.layers, a.hidden, cache, engine or cache)))
        return 0
    for dtype in a.dtype or ["bfloat16", "float32", "bfloat16:float32"]:
        cmd = [sys.executable, "-P", __file__, "--child", "--samples", str(a.samples), "--tokens", str(a.tokens),
               "--layers", str(a.layers), "--hidden", str(a.hidden), "--dtype", dtype]
        print(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.strip(), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
