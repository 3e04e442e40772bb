"""Graceful stop: SIGTERM and SIGINT become a request that the training loop honours at the next step boundary.

The first signal only sets `requested` (and says so on stderr): the loop finishes the step it is in, saves a
checkpoint, closes the pipeline and returns normally, so the command exits 0 and a rerun resumes. A second
signal aborts at once (KeyboardInterrupt) for a user who will not wait; checkpoint writes are atomic, so even
that leaves the last good checkpoint intact. Handlers can only be installed from the main thread; anywhere
else `StopRequest` stays inert and leaves the process's handlers alone.
"""

from __future__ import annotations

import signal
import sys
import threading
from types import FrameType
from typing import Any, Sequence

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)  # what a scheduler (preemption) or a user (Ctrl-C) sends


class StopRequest:
    """Context manager: while entered, STOP_SIGNALS set `requested` instead of killing the process.

    Outside the context (or when not entered at all) it is a request that never comes, which is what
    `run_training` uses when its caller installs no handlers.
    """

    def __init__(self, signals: Sequence[signal.Signals] = STOP_SIGNALS) -> None:
        self.signals = tuple(signals)
        self.signum: int | None = None  # the first signal received (None = no stop requested)
        self._previous: dict[int, Any] = {}

    @property
    def requested(self) -> bool:
        return self.signum is not None

    @property
    def reason(self) -> str | None:
        """The signal's name, e.g. "SIGTERM" (None when no stop was requested)."""
        return None if self.signum is None else signal.Signals(self.signum).name

    @property
    def installed(self) -> bool:
        return bool(self._previous)

    def __enter__(self) -> "StopRequest":
        if threading.current_thread() is threading.main_thread():
            for s in self.signals:
                self._previous[s] = signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        self._restore()

    def _restore(self) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous.clear()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        if self.signum is not None:
            self._restore()
            raise KeyboardInterrupt(f"second stop signal ({name}): aborting without waiting for the checkpoint")
        self.signum = signum
        print(f"received {name}: finishing the current step, then saving a checkpoint and exiting "
              f"(send it again to abort at once)", file=sys.stderr, flush=True)
