"""Bad data and bad steps are skipped and counted, never allowed to crash (or silently poison) a long run.

`validate_sample` says why one tokenized sample cannot be trained on (or None when it can); `SkipCounter`
tallies those reasons for the run summary; `BadStepGuard` skips optimizer steps whose loss is not finite and
aborts after too many in a row.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch

from dflash_lib.checkpoint import list_checkpoints

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


class NonFiniteLossError(RuntimeError):
    """Too many optimizer steps in a row had a NaN or infinite loss: the run is aborted."""


class NothingTrainedError(RuntimeError):
    """No sample fit for training in a whole epoch of batches, or in any batch of the run: nothing to learn from,
    so the run fails instead of writing a drafter that was never trained."""


@dataclass
class BadStepGuard:
    """Decides, per step, whether the loss is finite enough to step on; aborts after `max_in_a_row` bad ones.

    Under DDP every rank must take the same decision: pass the globally reduced loss (or any rank's flag summed).
    """

    max_in_a_row: int  # consecutive non-finite losses that abort the run
    in_a_row: int = 0  # current streak of non-finite losses
    total: int = 0  # non-finite losses over the whole run
    last_bad_step: int = -1  # step of the most recent non-finite loss (-1 = none)
    checkpoints: Path | None = None  # the run's checkpoint folder: the abort says what a rerun resumes from

    def __post_init__(self) -> None:
        if type(self.max_in_a_row) is not int or self.max_in_a_row < 1:
            raise ValueError(f"max_in_a_row (max_bad_steps) must be an int >= 1, got {self.max_in_a_row!r}")

    def ok(self, loss: float | torch.Tensor, step: int) -> bool:
        """True when `loss` is finite (take the step); False to skip it. Raises NonFiniteLossError when this is
        the `max_in_a_row`-th non-finite loss in a row."""
        value = float(loss.detach().float().sum()) if isinstance(loss, torch.Tensor) else float(loss)
        if math.isfinite(value):
            self.in_a_row = 0
            return True
        self.in_a_row += 1
        self.total += 1
        self.last_bad_step = step
        if self.in_a_row >= self.max_in_a_row:
            raise NonFiniteLossError(f"loss was {value} for {self.in_a_row} steps in a row (up to step {step}); "
                                     f"aborting (max_bad_steps={self.max_in_a_row}){self._resume_note()}")
        return False

    def _resume_note(self) -> str:
        """'; ' + what a rerun resumes from: the newest checkpoint in `checkpoints` (a skipped step leaves the
        weights as they were, so any checkpoint holds finite ones), or that there is none ("" without a folder)."""
        if self.checkpoints is None:
            return ""
        saved = list_checkpoints(self.checkpoints)
        return (f"; the newest checkpoint, {saved[-1]}, is intact" if saved else
                f"; no checkpoint was written yet (none in {self.checkpoints}): a rerun starts from step 0")

    def state_dict(self) -> dict[str, int]:
        return {"in_a_row": self.in_a_row, "total": self.total, "last_bad_step": self.last_bad_step}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.in_a_row, self.total, self.last_bad_step = (int(state[k]) for k in ("in_a_row", "total",
                                                                                  "last_bad_step"))
