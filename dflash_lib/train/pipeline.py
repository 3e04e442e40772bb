"""The CSP training pipeline: sampler -> collate -> N target workers -> the drafter trainer (the caller).

    sampler ──q_idx──► collate ──q_pre[w]──► target[w] ──q_hs[w]──► caller (for item in pipeline)

Every arrow a `BoundedQueue`, every stage a thread; items come out in sampler order, and a stage that fails aborts
every queue so that the caller's next `next()` raises `PipelineError`. Order, failure model, why threads:
docs/architecture.md, "The training pipeline".
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Generic, Iterable, Iterator, Sequence, TypeVar

from dflash_lib.config import PipelineConfig

T = TypeVar("T")


class PipelineError(RuntimeError):
    """A pipeline stage failed (`stage` names it; the original exception is `__cause__`) or the pipeline is
    unusable (closed, or a stage did not stop)."""

    def __init__(self, message: str, stage: str = "") -> None:
        super().__init__(message)
        self.stage = stage


class Aborted(Exception):
    """Raised by a blocked queue operation when the pipeline is stopping; stages exit quietly on it."""


class Stopped(Aborted):
    """Raised by a stage that must stop the whole pipeline, not through a failure of its own (another rank's
    feed stopped: `target.sharded.ShardedTarget.turn`, raised by the feed): every queue is aborted, no failure is
    recorded, and a caller still reading gets PipelineError."""


class _EndOfStream:
    def __repr__(self) -> str:
        return "<end of stream>"


END = _EndOfStream()  # sentinel that follows the last item through every queue


class BoundedQueue:
    """A FIFO holding at most `maxsize` items whose blocked `put`/`get` wake immediately on `abort()`.

    `queue.Queue` cannot be woken early, so a stop would wait for a timeout; here `abort()` notifies both
    conditions. `recheck_s` bounds each wait anyway, so a waiter re-reads the abort flag at least that often.
    `high_water` is the largest depth ever held (for backpressure checks).
    """

    def __init__(self, maxsize: int, name: str, recheck_s: float = 5.0) -> None:
        if maxsize <= 0:
            raise ValueError(f"queue {name!r}: maxsize must be > 0, got {maxsize}")
        self.maxsize, self.name, self.recheck_s = maxsize, name, recheck_s
        self.high_water = 0
        self._items: deque[Any] = deque()
        self._lock = threading.Lock()
        self._not_empty = threading.Condition(self._lock)
        self._not_full = threading.Condition(self._lock)
        self._aborted = False

    def put(self, item: Any) -> None:
        """Append `item`, blocking while the queue is full; raises `Aborted` if the pipeline stops."""
        with self._not_full:
            while len(self._items) >= self.maxsize and not self._aborted:
                self._not_full.wait(self.recheck_s)
            if self._aborted:
                raise Aborted(self.name)
            self._items.append(item)
            self.high_water = max(self.high_water, len(self._items))
            self._not_empty.notify()

    def get(self) -> Any:
        """Pop the oldest item, blocking while the queue is empty; raises `Aborted` if the pipeline stops."""
        with self._not_empty:
            while not self._items and not self._aborted:
                self._not_empty.wait(self.recheck_s)
            if self._aborted:
                raise Aborted(self.name)
            item = self._items.popleft()
            self._not_full.notify()
            return item

    def abort(self) -> None:
        """Drop every queued item and wake every waiter (they raise `Aborted`)."""
        with self._lock:
            self._aborted = True
            self._items.clear()
            self._not_empty.notify_all()
            self._not_full.notify_all()

    def qsize(self) -> int:
        return len(self._items)


@dataclass
class StageFailure:
    stage: str  # stage name, e.g. "collate" or "target[1]"
    error: BaseException  # what it raised


class Pipeline(Generic[T]):
    """Run `source -> collate -> workers` in threads; iterate it to receive the workers' outputs in order.

    source:  an iterable of work items (index lists from a batch sampler), consumed in its own thread.
    collate: item -> batch (e.g. index list -> `Batch`); runs in one thread.
    workers: one callable per target worker (batch -> output, e.g. (batch, features)); worker w gets batches
             w, w+N, w+2N, ... (N = len(workers)).
    cfg:     queue capacities and the re-check timeout (`PipelineConfig`); `prefetch` bounds q_idx and each
             q_pre, `hs_queue` bounds each q_hs.
    pin_memory: pin each collated batch (CUDA only: lets the worker copy it with non_blocking=True).

    Use as a context manager (`with Pipeline(...) as p: for out in p: ...`); `close()` joins every thread.
    `wait_s` is the total time the caller spent blocked in `next()` (seconds), `last_wait_s` the latest.
    """

    def __init__(self, source: Iterable[Any], collate: Callable[[Any], Any], workers: Sequence[Callable[[Any], T]],
                 cfg: PipelineConfig | None = None, pin_memory: bool = False,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        if not workers:
            raise ValueError("Pipeline: needs at least one target worker")
        cfg = cfg or PipelineConfig()
        self.cfg, self._source, self._collate, self._workers = cfg, source, collate, list(workers)
        self._pin, self._clock = pin_memory, clock
        n = len(self._workers)
        self._q_idx = BoundedQueue(cfg.prefetch, "q_idx", cfg.queue_timeout_s)
        self.q_pre = [BoundedQueue(cfg.prefetch, f"q_pre[{w}]", cfg.queue_timeout_s) for w in range(n)]
        self.q_hs = [BoundedQueue(cfg.hs_queue, f"q_hs[{w}]", cfg.queue_timeout_s) for w in range(n)]
        self._threads: list[threading.Thread] = []
        self._failure: StageFailure | None = None
        self._failure_reported = False
        self._lock = threading.Lock()
        self._started = self._closed = self._done = False
        self._next_seq = 0
        self.wait_s = 0.0
        self.last_wait_s = 0.0

    # -- stages ------------------------------------------------------------------------------------------------

    def _sampler_stage(self) -> None:
        for seq, item in enumerate(self._source):
            self._q_idx.put((seq, item))
        self._q_idx.put(END)

    def _collate_stage(self) -> None:
        n = len(self._workers)
        while True:
            msg = self._q_idx.get()
            if msg is END:
                for q in self.q_pre:
                    q.put(END)
                return
            seq, item = msg
            batch = self._collate(item)
            if self._pin:
                batch = batch.pin_memory()
            self.q_pre[seq % n].put(batch)

    def _worker_stage(self, w: int) -> None:
        fn, q_in, q_out = self._workers[w], self.q_pre[w], self.q_hs[w]
        try:
            while True:
                batch = q_in.get()
                if batch is END:
                    q_out.put(END)
                    return
                q_out.put(fn(batch))
        finally:  # a worker with a `leave()` (a sharded target's) is told, in its thread, however it ends
            getattr(fn, "leave", lambda: None)()

    def _run(self, name: str, body: Callable[[], None]) -> None:
        try:
            body()
        except Stopped:
            self._abort()
        except Aborted:
            return
        except BaseException as exc:  # noqa: BLE001 - any failure must reach the caller, not die in the thread
            with self._lock:
                if self._failure is None:
                    self._failure = StageFailure(name, exc)
            self._abort()

    def _abort(self) -> None:
        for q in (self._q_idx, *self.q_pre, *self.q_hs):
            q.abort()

    # -- caller side ------------------------------------------------------------------------------------------

    def start(self) -> "Pipeline[T]":
        """Start the stage threads (idempotent)."""
        if self._closed:
            raise PipelineError("pipeline is closed")
        if self._started:
            return self
        self._started = True
        stages: list[tuple[str, Callable[[], None]]] = [("sampler", self._sampler_stage),
                                                         ("collate", self._collate_stage)]
        stages += [(f"target[{w}]", lambda w=w: self._worker_stage(w)) for w in range(len(self._workers))]
        for name, body in stages:
            t = threading.Thread(target=self._run, args=(name, body), name=f"pipeline-{name}", daemon=True)
            self._threads.append(t)
            t.start()
        return self

    @property
    def threads(self) -> dict[str, threading.Thread]:
        """The stage threads by stage name (empty before `start()`)."""
        return dict(zip(self.stage_names, self._threads))

    @property
    def stage_names(self) -> list[str]:
        return ["sampler", "collate"] + [f"target[{w}]" for w in range(len(self._workers))]

    def depths(self) -> dict[str, list[int]]:
        """Items waiting in each queue now: {"q_pre": [per worker], "q_hs": [per worker]}."""
        return {"q_pre": [q.qsize() for q in self.q_pre], "q_hs": [q.qsize() for q in self.q_hs]}

    def __iter__(self) -> Iterator[T]:
        self.start()
        return self

    def __next__(self) -> T:
        if self._done:
            raise StopIteration
        self.start()
        t0 = self._clock()
        try:
            out = self.q_hs[self._next_seq % len(self._workers)].get()
        except Aborted:
            self._raise_failure()
            raise PipelineError("pipeline was closed while the caller was reading it") from None
        if out is END:
            self._done = True
            raise StopIteration
        self._next_seq += 1
        self.last_wait_s = self._clock() - t0
        self.wait_s += self.last_wait_s
        return out

    def _raise_failure(self) -> None:
        with self._lock:
            failure = self._failure
        if failure is not None:
            self._failure_reported = True
            err = failure.error
            raise PipelineError(f"stage {failure.stage!r} failed: {type(err).__name__}: {err}",
                                stage=failure.stage) from err

    @property
    def failure(self) -> StageFailure | None:
        return self._failure

    def close(self, raise_failure: bool = True) -> None:
        """Stop every stage, drop queued items, join every thread.

        Raises `PipelineError` if a stage is still running after `cfg.close_timeout_s` (stuck in user code),
        or, when `raise_failure`, if a stage failed and the caller never saw that failure.
        """
        if self._closed:
            return
        self._closed = True
        self._abort()
        deadline = time.monotonic() + self.cfg.close_timeout_s
        stuck = []
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))
            if t.is_alive():
                stuck.append(t.name)
        if stuck:
            raise PipelineError(f"pipeline stages did not stop within {self.cfg.close_timeout_s} s: {stuck}")
        if raise_failure and not self._failure_reported:
            self._raise_failure()

    def __enter__(self) -> "Pipeline[T]":
        return self.start()

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        # Do not mask the caller's own exception with a stage failure it may have caused.
        self.close(raise_failure=exc_type is None)
