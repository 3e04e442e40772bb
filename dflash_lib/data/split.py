"""The held-out split: a sample is held out when the hash of its CONTENT (its token ids, `HASH_RULE`) falls below
`heldout_fraction` of the hash range. The choice depends on the sample alone, not on its index, so the same
conversations are held out whatever the corpus order, in every run; duplicates fall on the same side (no leak of
a training sample into the held-out set); and a larger fraction holds out a superset of a smaller one's samples.
The tokens depend on the tokenizer, template and max_len, so changing those may move a few samples.
The trainer's sampler is built on the training part only (`SubsetStore`); the split is recorded in the run
folder as heldout.json (`HeldOutSplit.record`); the trainer's evaluation on it is train/heldout.py.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

import numpy as np

HASH_PREFIX = b"dflash-heldout-v1:"
HASH_RULE = ("u = first 8 bytes of sha256(b'dflash-heldout-v1:' + token ids as uint32 little-endian), read as a "
             "little-endian uint64; held out iff u < fraction * 2**64")


def sample_hash(tokens: np.ndarray) -> int:
    """The HASH_RULE value (0 <= u < 2**64) of one sample's token ids."""
    digest = hashlib.sha256(HASH_PREFIX + np.ascontiguousarray(tokens, dtype="<u4").tobytes()).digest()
    return int.from_bytes(digest[:8], "little")


def sample_hashes(store: Any) -> np.ndarray:
    """(N,) uint64 HASH_RULE value of every sample of `store` (store[i] -> (tokens, loss_mask))."""
    return np.array([sample_hash(store[i][0]) for i in range(len(store))], dtype=np.uint64)


@dataclass(frozen=True)
class HeldOutSplit:
    """Which samples of a store are held out. Indices are store indices."""

    fraction: float
    train: np.ndarray  # (N - H,) int64, ascending
    heldout: np.ndarray  # (H,) int64, in ascending hash order (the evaluation takes the first ones)
    hashes: np.ndarray  # (H,) uint64 hash of each held-out sample, same order

    def record(self, total: int) -> dict[str, Any]:
        """heldout.json: the rule, the counts, and every held-out sample's store index and hash (hex)."""
        return dict(fraction=self.fraction, hash_rule=HASH_RULE, samples=int(total), heldout=len(self.heldout),
                    train=len(self.train), indices=[int(i) for i in self.heldout],
                    hashes=[f"{int(h):016x}" for h in self.hashes])


def split_store(store: Any, fraction: float) -> HeldOutSplit:
    """Hold out the samples whose hash is below `fraction` of the range (0 = none held out)."""
    if not 0.0 <= fraction < 1.0:
        raise ValueError(f"heldout_fraction must be in [0, 1), got {fraction}")
    if fraction == 0.0:
        return HeldOutSplit(0.0, np.arange(len(store), dtype=np.int64), np.zeros(0, np.int64),
                            np.zeros(0, np.uint64))
    hashes = sample_hashes(store)  # (N,)
    cut = min(int(fraction * 2.0 ** 64), 2 ** 64 - 1)
    held = hashes < np.uint64(cut)  # (N,)
    out = np.flatnonzero(held)
    order = np.argsort(hashes[out], kind="stable")
    return HeldOutSplit(float(fraction), np.flatnonzero(~held).astype(np.int64), out[order].astype(np.int64),
                        hashes[out][order])


class SubsetStore:
    """A view of `store` holding only `indices`: view[i] = store[indices[i]]. The trainer's sampler and batches
    index the view; `source_index` maps back to the store."""

    def __init__(self, store: Any, indices: np.ndarray) -> None:
        self.store, self.indices = store, np.asarray(indices, dtype=np.int64)
        self.path, self.meta = getattr(store, "path", None), getattr(store, "meta", {})

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        return self.store[int(self.indices[i])]

    def source_index(self, i: int) -> int:
        return int(self.indices[i])
