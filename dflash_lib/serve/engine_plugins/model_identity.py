"""What names a model folder's contents, computed alike by the engine's connector (this folder is on its PYTHONPATH)
and by dflash_lib (`dflash_lib.serve.engine_plugins.model_identity`): standard library only, so both sides run the
same code. `config_sha256`: its config.json's bytes; `weights_fingerprint`: every *.safetensors file's name, size,
header and sampled bytes (docs/scale.md, "What a served or cached feature vouches for").
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

SAMPLES = 8  # byte ranges read per weight file, evenly spaced from its start to its end
SAMPLE_BYTES = 1 << 20  # bytes per range: 8 MiB a file, whatever its size


def config_sha256(folder: str | os.PathLike) -> str:
    """The sha256 (hex) of the folder's config.json; "" when it has none."""
    path = Path(folder) / "config.json"
    return hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else ""


def weights_fingerprint(folder: str | os.PathLike) -> str:
    """A sha256 (hex) over every *.safetensors file of the folder (sorted by name): its name, its size in bytes, its
    safetensors header (names, dtypes, shapes, offsets: the first range) and SAMPLES ranges of SAMPLE_BYTES spread
    over it. Not a hash of every byte (a 400 GB target would take minutes at every start): other weights (retrained,
    another checkpoint, a copy replaced in place) differ in the sampled ranges of any tensor they change widely;
    an edit confined to bytes between the ranges is not seen. "" for a folder without safetensors files."""
    h = hashlib.sha256()
    files = sorted(p for p in Path(folder).glob("*.safetensors") if p.is_file())
    for p in files:
        size = p.stat().st_size
        h.update(f"{p.name}\0{size}\0".encode())
        with open(p, "rb") as f:
            step = max(0, size - SAMPLE_BYTES) / max(1, SAMPLES - 1)
            for k in range(SAMPLES):
                f.seek(int(k * step))
                h.update(f.read(SAMPLE_BYTES))
    return h.hexdigest() if files else ""
