"""Whether a tokenized sample is fit for training (`validate_sample`: one of REASONS, or None) and the count of those
left out by reason (`SkipCounter`). The trainer's batches (`train/feed.py`), its held-out choice and the capture of
the target's features (`target/capture.py`) leave out the same samples: docs/architecture.md, "The training
pipeline".
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np
import torch

# Reasons a sample is skipped (stable strings: they are the keys of the skip counts in the run summary).
NOT_1D = "not_1d"  # tokens or loss mask is not a flat sequence
NOT_INTEGER = "not_integer"  # token ids are not integers
EMPTY = "empty"  # no tokens (e.g. nothing left after truncation)
MASK_LENGTH_MISMATCH = "mask_length_mismatch"  # loss mask and tokens differ in length
BAD_MASK = "bad_mask"  # loss mask values other than 0/1 (or False/True)
TOKEN_OUT_OF_VOCAB = "token_out_of_vocab"  # a token id < 0 or >= vocab_size
NO_ASSISTANT_TOKEN = "no_assistant_token"  # loss mask selects no token: nothing to learn from
REASONS = (NOT_1D, NOT_INTEGER, EMPTY, MASK_LENGTH_MISMATCH, BAD_MASK, TOKEN_OUT_OF_VOCAB, NO_ASSISTANT_TOKEN)

ArrayLike = Sequence[int] | np.ndarray | torch.Tensor


def _as_array(x: Any) -> np.ndarray | None:
    if isinstance(x, torch.Tensor):
        return x.detach().cpu().numpy()
    try:
        return np.asarray(x)
    except (ValueError, TypeError, OverflowError):  # ragged nesting and the like
        return None


def validate_sample(tokens: ArrayLike, loss_mask: ArrayLike, vocab_size: int) -> str | None:
    """Why this sample must be skipped (one of REASONS), or None when it is fit for training.

    tokens: (T,) token ids; loss_mask: (T,) 1/True where the token is an assistant token the loss counts;
    vocab_size: number of token ids the model embeds (valid ids are 0 .. vocab_size-1).
    """
    if type(vocab_size) is not int or vocab_size < 1:
        raise ValueError(f"vocab_size must be an int >= 1, got {vocab_size!r}")
    tok = _as_array(tokens)
    mask = _as_array(loss_mask)
    if tok is None or mask is None or tok.ndim != 1 or mask.ndim != 1:
        return NOT_1D
    if tok.size == 0:  # before the dtype check: an empty python list reads as float64
        return EMPTY
    if tok.dtype == object:
        if not all(isinstance(t, (int, np.integer)) and not isinstance(t, bool) for t in tok):
            return NOT_INTEGER
    elif not np.issubdtype(tok.dtype, np.integer):
        return NOT_INTEGER
    if mask.size != tok.size:
        return MASK_LENGTH_MISMATCH
    if mask.dtype == object or not (mask.dtype == np.bool_ or np.issubdtype(mask.dtype, np.number)):
        return BAD_MASK
    if mask.dtype != np.bool_ and not np.isin(mask, (0, 1)).all():
        return BAD_MASK
    lo, hi = (min(tok), max(tok)) if tok.dtype == object else (int(tok.min()), int(tok.max()))
    if lo < 0 or hi >= vocab_size:
        return TOKEN_OUT_OF_VOCAB
    if not mask.any():
        return NO_ASSISTANT_TOKEN
    return None


@dataclass
class SkipCounter:
    """Counts skipped samples by reason, keeping the first few record ids of each for the log."""

    max_examples: int = 3  # record ids remembered per reason
    counts: dict[str, int] = field(default_factory=dict)  # reason -> samples skipped
    examples: dict[str, list[str]] = field(default_factory=dict)  # reason -> first record ids

    def add(self, reason: str, record: object = None) -> None:
        """Count one skipped sample; `record` (an index or id) is kept as an example when there is room."""
        if not isinstance(reason, str) or not reason:
            raise ValueError(f"reason must be a non-empty string, got {reason!r}")
        self.counts[reason] = self.counts.get(reason, 0) + 1
        ex = self.examples.setdefault(reason, [])
        if record is not None and len(ex) < self.max_examples:
            ex.append(str(record))

    def check(self, tokens: ArrayLike, loss_mask: ArrayLike, vocab_size: int, record: object = None) -> bool:
        """Validate one sample; True when it may be used, else count it (with `record`) and return False."""
        reason = validate_sample(tokens, loss_mask, vocab_size)
        if reason is None:
            return True
        self.add(reason, record)
        return False

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def merge(self, other: "SkipCounter") -> None:
        """Add another counter's counts (e.g. from another worker) into this one."""
        for reason, n in other.counts.items():
            self.counts[reason] = self.counts.get(reason, 0) + n
            ex = self.examples.setdefault(reason, [])
            ex.extend(other.examples.get(reason, [])[: self.max_examples - len(ex)])

    def summary(self) -> str:
        """One line for the console, e.g. 'skipped 3 samples: token_out_of_vocab 2 (e.g. 17, 40), empty 1'."""
        if not self.counts:
            return "skipped 0 samples"
        parts = []
        for reason, n in sorted(self.counts.items(), key=lambda kv: (-kv[1], kv[0])):
            ex = self.examples.get(reason)
            parts.append(f"{reason} {n}" + (f" (e.g. {', '.join(ex)})" if ex else ""))
        return f"skipped {self.total} samples: " + ", ".join(parts)

    def state_dict(self) -> dict[str, Any]:
        """Plain dict (checkpoint- and JSON-safe)."""
        return {"counts": dict(self.counts), "examples": {k: list(v) for k, v in self.examples.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.counts = {str(k): int(v) for k, v in state["counts"].items()}
        self.examples = {str(k): [str(e) for e in v] for k, v in state["examples"].items()}
