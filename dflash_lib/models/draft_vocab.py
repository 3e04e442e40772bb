"""The draft vocabulary: the drafter's LM head cut to the N target tokens its training answers use most.

The head stays the target's own (frozen) rows of those N tokens, so a drafted token is a target token and
verification is as lossless as with the whole head; a label outside the N tokens is one the drafter cannot draft
(scored wrong, no loss). Served through vLLM's `draft_vocab_size` with `d2t` (target id = draft id + d2t[draft id])
and the drafter's own `lm_head.weight` (N rows): the engine's drafting step reads N rows instead of the whole
vocabulary. docs/dflash.md, "The draft vocabulary".
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from dflash_lib.config import ConfigError


def scored_token_counts(store: Any, vocab_size: int, chunk: int = 4096) -> np.ndarray:
    """(vocab_size,) int64: how often each token is a scored label (loss_mask 1) in `store` (store[i] ->
    (tokens (L,), loss_mask (L,))), read `chunk` samples at a time. ConfigError for an id outside the vocabulary."""
    counts = np.zeros(vocab_size, dtype=np.int64)
    for start in range(0, len(store), chunk):
        parts = [store[i] for i in range(start, min(start + chunk, len(store)))]
        ids = np.concatenate([np.asarray(t)[np.asarray(m) > 0] for t, m in parts] or [np.zeros(0, np.int64)])
        if ids.size and int(ids.max()) >= vocab_size:
            raise ConfigError(f"token store {getattr(store, 'path', '')}: label id {int(ids.max())} is outside the "
                              f"target vocabulary of {vocab_size}")
        counts += np.bincount(ids.astype(np.int64), minlength=vocab_size)
    return counts


def top_tokens(counts: np.ndarray, n: int) -> torch.Tensor:
    """(n,) int64 ascending: the n most frequent ids of `counts` (V,), ties and unseen ids by the lower id."""
    if not 0 < n <= len(counts):
        raise ConfigError(f"draft_vocab {n} must be in 1 .. {len(counts)} (the target's vocabulary)")
    order = np.lexsort((np.arange(len(counts)), -counts))  # by count descending, then id ascending
    return torch.from_numpy(np.sort(order[:n]).astype(np.int64))


def coverage(counts: np.ndarray, ids: torch.Tensor) -> float:
    """The fraction of scored labels whose token is in `ids` (1.0 with none counted)."""
    total = int(counts.sum())
    return float(counts[ids.numpy()].sum()) / total if total else 1.0


def to_d2t(ids: torch.Tensor) -> torch.Tensor:
    """vLLM's / EAGLE-3's offsets (N,) int64: target id = draft id + d2t[draft id]."""
    return ids.long() - torch.arange(len(ids), device=ids.device)


def from_d2t(d2t: torch.Tensor, vocab_size: int, where: str) -> torch.Tensor:
    """The draft vocabulary's target ids (N,) from vLLM's offsets; ConfigError (naming `where`, the first draft ids
    at fault and their target ids) unless they are inside the target vocabulary and strictly ascending (so
    distinct: two draft ids on one target token are refused)."""
    ids = d2t.long() + torch.arange(len(d2t), device=d2t.device)
    rule = f"(target id = draft id + d2t[draft id], strictly ascending in 0 .. {vocab_size - 1})"
    outside = ((ids < 0) | (ids >= vocab_size)).nonzero().flatten()
    if len(outside):
        i = int(outside[0])
        raise ConfigError(f"{where}: d2t maps draft id {i} to target id {int(ids[i])}, outside the vocabulary {rule}")
    down = (ids[1:] <= ids[:-1]).nonzero().flatten()  # strictly: equal neighbours are a duplicate
    if len(down):
        i = int(down[0])
        a, b = int(ids[i]), int(ids[i + 1])
        what = f"both to target id {a}" if a == b else f"to target ids {a} then {b}, not ascending"
        raise ConfigError(f"{where}: d2t maps draft ids {i} and {i + 1} {what} {rule}")
    return ids


def target_to_draft(ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """(vocab_size,) int64 on ids' device: the draft id of each target token, -1 outside the draft vocabulary."""
    t2d = torch.full((vocab_size,), -1, dtype=torch.long, device=ids.device)
    return t2d.index_copy_(0, ids, torch.arange(len(ids), device=ids.device))
