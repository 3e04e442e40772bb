"""Peak host memory of `capture` writing one shard, as a multiple of the shard's bytes (issue 55).

    .venv/bin/python -P benchmarks/capture_memory.py             # 256 samples x 256 tokens x 3 layers x 576, 4 cases
    .venv/bin/python -P benchmarks/capture_memory.py --case float32:bfloat16 --samples 64 --tokens 128

Each case (the engine's dtype : the shards') is measured in a fresh process: a stand-in engine's states of one
shard, (tokens, layers, hidden) per document, are made first and handed over by the fetch (as
`HiddenStatesClient.fetch` hands over the engine's); `capture` (`dflash_lib/target/capture.py`) then writes the
shard. The figure: the process's peak resident memory during the capture above its resident memory before it (a
tiny capture run first, so that the library code it runs is resident already), over the shard file's bytes. A
shard held once is at most ~1 (its buffers, while the engine's states are dropped as they are copied in); each
further copy (a concatenation, a per-document pick, a cast) adds 1, or 2 in fp32. One JSON line per case;
`tests/test_hidden_cache.py` runs one small. Measured (issue 55, 2 CPU cores): docs/scale.md.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

from dflash_lib.target.cached import DTYPES, STORED, CacheIdentity
from dflash_lib.target.capture import capture


VOCAB = 1000  # token ids of the stand-in store
CASES = ("bfloat16:bfloat16", "float32:float32", "float32:bfloat16", "bfloat16:float8_e4m3fn")


def resident_bytes(field: str = "VmRSS") -> int:
    """This process's resident memory now (VmRSS) or its peak (VmHWM), in bytes (/proc/self/status). The peak is this
    process's own: getrusage's ru_maxrss keeps the parent's across fork and exec (a test runner's hundreds of MB)."""
    line = next(x for x in Path("/proc/self/status").read_text().splitlines() if x.startswith(field + ":"))
    return int(line.split()[1]) * 1024


def reset_peak() -> None:
    """Set this process's peak resident memory (VmHWM) to its resident memory now (Linux >= 4.0)."""
    Path("/proc/self/clear_refs").write_text("5")


class _Store:
    """`samples` documents of `tokens` ids (a token store as `capture` reads one)."""

    def __init__(self, samples: int, tokens: int) -> None:
        self.docs = [np.arange(i, i + tokens, dtype=np.uint32) % VOCAB for i in range(samples)]
        self.lengths = np.full(samples, tokens)

    def __len__(self) -> int:
        return len(self.docs)

    def __getitem__(self, i: int):
        return self.docs[i], np.ones(len(self.docs[i]), np.uint8)


def measure(samples: int, tokens: int, layers: int, hidden: int, states: str, stored: str) -> dict:
    """One shard of `samples` documents written by `capture` in this process from an engine's states in `states`
    into shards of `stored` (the cache's engine dtype: `stored` when it is one, else `states`): its peak resident
    memory above the resident memory before it, over the shard file's bytes."""
    store = _Store(samples, tokens)
    engine = stored if stored in DTYPES else states
    identity = CacheIdentity(target="/t", target_config_sha256="c", layer_ids=tuple(range(layers)),
                             hidden_size=hidden, dtype=engine, store_key="k", target_weights_fingerprint="w",
                             final_states=False)
    held = [torch.empty(tokens, layers, hidden, dtype=STORED[states]).fill_(1.5) for _ in range(samples)]

    def fetch(documents):
        out = held[:len(documents)]
        del held[:len(documents)]  # handed over: the engine's files are read once
        return out

    with tempfile.TemporaryDirectory() as warm:  # every code path run once: the library pages they fault in
        # (more with a warm page cache) are resident before the measure, not counted as the shard's
        capture(_Store(2, 4), identity, warm, lambda docs: [torch.zeros(len(d), layers, hidden, dtype=STORED[states])
                                                            for d in docs], torch.arange(layers), vocab_size=VOCAB,
                stored=stored, say=lambda _: None, progress=False)
    with tempfile.TemporaryDirectory() as out:
        reset_peak()
        before = resident_bytes()
        capture(store, identity, out, fetch, torch.arange(layers), vocab_size=VOCAB, stored=stored,
                say=lambda _: None, progress=False)
        peak = resident_bytes("VmHWM")
        shard = sum(p.stat().st_size for p in Path(out).glob("shard-*.safetensors"))
    return {"states": states, "stored": stored, "samples": samples, "tokens": tokens, "layers": layers,
            "hidden": hidden, "shard_mib": round(shard / 2**20, 1),
            "peak_above_before_mib": round((peak - before) / 2**20, 1),
            "times_the_shard": round((peak - before) / shard, 2)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", type=int, default=256)
    ap.add_argument("--tokens", type=int, default=256, help="tokens per document")
    ap.add_argument("--layers", type=int, default=3, help="feature layers")
    ap.add_argument("--hidden", type=int, default=576)
    ap.add_argument("--case", action="append", help="STATES:STORED, the engine's dtype and the shards' (repeatable; "
                    f"default: {', '.join(CASES)})")
    ap.add_argument("--child", action="store_true", help="measure one case in this process")
    a = ap.parse_args()
    if a.child:
        print(json.dumps(measure(a.samples, a.tokens, a.layers, a.hidden, *a.case[0].split(":"))))
        return 0
    for case in a.case or CASES:
        cmd = [sys.executable, "-P", __file__, "--child", "--samples", str(a.samples), "--tokens", str(a.tokens),
               "--layers", str(a.layers), "--hidden", str(a.hidden), "--case", case]
        print(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.strip(), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
