"""The held-out split and the trainer's evaluation on it.

Split: a sample is held out when the hash of its CONTENT (its token ids, `HASH_RULE`) falls below
`heldout_fraction` of the hash range. The choice depends on the sample alone, not on its index, so the same
conversations are held out whatever the corpus order, in every run; duplicates fall on the same side (no leak of
a training sample into the held-out set); and a larger fraction holds out a superset of a smaller one's samples.
The tokens depend on the tokenizer, template and max_len, so changing those may move a few samples.
The trainer's sampler is built on the training part only (`SubsetStore`); the split is recorded in the run
folder as heldout.json (`HeldOutSplit.record`).

Evaluation: the first `eval_samples` held-out samples in hash order, batched once (fixed batches within the
token budget) with anchors drawn once from a reserved seed (`EVAL_SHARD`), fed all MASK (noise 1, as at
inference). Every evaluation therefore runs the same blocks and the figures of two evaluations are comparable.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import torch

from dflash_lib.batch import Batch, collate_padded
from dflash_lib.models.layout import DraftLayout
from dflash_lib.models.loss import expected_acceptance, stats_size
from dflash_lib.rng import capture_rng, restore_rng
from dflash_lib.validate import validate_sample

HASH_PREFIX = b"dflash-heldout-v1:"
HASH_RULE = ("u = first 8 bytes of sha256(b'dflash-heldout-v1:' + token ids as uint32 little-endian), read as a "
             "little-endian uint64; held out iff u < fraction * 2**64")
HELDOUT_FILE = "heldout.json"
EVAL_SHARD = -1  # `feed.anchor_seed` shard of the evaluation's anchors: training shards are >= 0
HELDOUT_KEYS = ("heldout_loss", "heldout_acc", "heldout_acc_per_pos", "heldout_tau", "heldout_eal_marginal",
                "heldout_blocks", "heldout_samples")


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


@dataclass
class EvalSet:
    """Fixed evaluation batches: host batches and their host layouts (anchors drawn once)."""

    batches: list[Batch]
    layouts: list[DraftLayout]
    indices: list[int]  # store indices of the samples evaluated

    @property
    def samples(self) -> int:
        return len(self.indices)


def build_eval_set(store: Any, indices: Sequence[int], drafter: Any, pad_id: int, token_budget: int,
                   seed: int, max_samples: int) -> EvalSet:
    """The first `max_samples` of `indices` (store indices, hash order) that pass validation, in padded batches
    of at most `token_budget` token slots (rows x longest, at least one row), shortest first; anchors from
    `feed.anchor_seed(seed, EVAL_SHARD, 0, batch number)`, every block position after the anchor fed MASK."""
    from dflash_lib.feed import anchor_seed

    vocab = drafter.cfg.vocab_size
    chosen = [int(i) for i in indices if validate_sample(*store[int(i)], vocab) is None][:max_samples]
    by_length = sorted(chosen, key=lambda i: len(store[i][0]))  # stable: ties keep hash order
    groups: list[list[int]] = []
    for i in by_length:
        length = len(store[i][0])
        if groups and (len(groups[-1]) + 1) * length <= token_budget:
            groups[-1].append(i)
        else:
            groups.append([i])
    batches, layouts = [], []
    for b, group in enumerate(groups):
        batch = collate_padded([store[i] for i in group], pad_id, group)
        gen = torch.Generator().manual_seed(anchor_seed(seed, EVAL_SHARD, 0, b))
        batches.append(batch)
        layouts.append(drafter.layout(batch, drafter.sample_anchors(batch, gen, 1.0)))
    return EvalSet(batches, layouts, chosen)


def evaluate(drafter: Any, target: Any, eval_set: EvalSet, autocast: bool) -> dict[str, Any]:
    """The drafter on `eval_set` without gradients, under the training autocast: the HELDOUT_KEYS figures
    (loss in nats and top-1 accuracy weighted as in training, acc_per_pos unweighted, tau the EXACT acceptance
    length from each block's own flags, eal_marginal the marginal-product estimate). One device-to-host
    transfer at the end. Global RNG streams and the drafter's train/eval mode are left as they were, so an
    evaluation never changes the training trajectory."""
    device = target.device
    n_pos = drafter.cfg.block_size - 1
    rng, was_training = capture_rng(), drafter.training
    stats = torch.zeros(stats_size(n_pos + 1), dtype=torch.float64, device=device)
    weight = 0.0
    drafter.eval()
    try:
        with torch.no_grad():
            for batch, layout in zip(eval_set.batches, eval_set.layouts):
                if layout.weight_sum == 0:
                    continue
                features = target.features(batch)  # (R, T, F*H); from the HOST batch: no device read
                dev_batch = batch.to(device)
                with torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=autocast):
                    out = drafter.loss(dev_batch, features, layout.to(device))
                stats = stats + out.stats()
                weight += layout.weight_sum
    finally:
        drafter.train(was_training)
        restore_rng(rng)
    host = stats.tolist()
    ce, correct = host[0], host[1]
    pos_correct, pos_count = host[2:2 + n_pos], host[2 + n_pos:2 + 2 * n_pos]
    tau_sum, blocks = host[2 + 2 * n_pos], host[3 + 2 * n_pos]
    acc_per_pos = [c / n if n else math.nan for c, n in zip(pos_correct, pos_count)]
    return dict(heldout_loss=ce / weight if weight > 0 else math.nan,
                heldout_acc=correct / weight if weight > 0 else math.nan, heldout_acc_per_pos=acc_per_pos,
                heldout_tau=tau_sum / blocks if blocks > 0 else math.nan,
                heldout_eal_marginal=expected_acceptance(acc_per_pos), heldout_blocks=int(blocks),
                heldout_samples=eval_set.samples)
