"""The CSP pipeline: order, no loss or duplication, bounded queues, failures named and fast, threads joined."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dflash_lib.config import PipelineConfig
from dflash_lib.data.batch import collate_padded
from dflash_lib.train.pipeline import BoundedQueue, Pipeline, PipelineError

STAGES_3 = ["sampler", "collate", "target[0]", "target[1]", "target[2]"]


def cfg(prefetch: int = 2, hs: int = 1, recheck: float = 60.0, close: float = 10.0) -> PipelineConfig:
    # recheck = 60 s: every stop must come from the abort wake-up, not from the safety-net timeout.
    return PipelineConfig(prefetch=prefetch, hs_queue=hs, queue_timeout_s=recheck, close_timeout_s=close)


def pipeline_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("pipeline-")]


class Probe:
    """Counts items leaving the sampler and reaching the caller; records the largest gap between them."""

    def __init__(self) -> None:
        self.produced = 0
        self.consumed = 0
        self.max_ahead = 0
        self.lock = threading.Lock()

    def source(self, n: int, delay: float = 0.0):
        for i in range(n):
            if delay:
                time.sleep(delay)
            with self.lock:
                self.produced += 1
                self.max_ahead = max(self.max_ahead, self.produced - self.consumed)
            yield i

    def took(self) -> None:
        with self.lock:
            self.consumed += 1


def make_workers(n: int, delay: float = 0.0, fail_at: int | None = None, fail_worker: int = -1):
    def work(w: int):
        def fn(x):
            if delay:
                time.sleep(delay * (1 + w) / n)  # workers of different speeds
            if w == fail_worker and x == fail_at:
                raise ValueError(f"injected failure on item {x}")
            return (w, x * 10)
        return fn
    return [work(w) for w in range(n)]


@pytest.mark.parametrize("n_workers", [1, 3])
def test_order_preserved_no_loss_no_duplicates(n_workers):
    items = list(range(40))
    with Pipeline(items, lambda x: x + 1, make_workers(n_workers, delay=0.002), cfg()) as p:
        out = list(p)
    assert [x for _, x in out] == [(i + 1) * 10 for i in items]
    assert [w for w, _ in out] == [i % n_workers for i in items]  # round-robin dispatch
    assert not pipeline_threads()


@settings(max_examples=12, deadline=None)
@given(n=st.integers(0, 25), n_workers=st.integers(1, 4), prefetch=st.integers(1, 3), hs=st.integers(1, 3),
       seed=st.integers(0, 1000))
def test_order_property(n, n_workers, prefetch, hs, seed):
    rng = np.random.default_rng(seed)
    delays = rng.uniform(0, 0.002, size=n).tolist()

    def worker(x):
        time.sleep(delays[x])
        return x

    with Pipeline(range(n), lambda x: x, [worker] * n_workers, cfg(prefetch, hs)) as p:
        assert list(p) == list(range(n))


@pytest.mark.parametrize("slow", ["sampler", "collate", "target", "consumer"])
def test_injected_delay_no_deadlock_and_bounds_hold(slow):
    n, n_workers, c = 30, 3, cfg(prefetch=2, hs=1)
    d = 0.004
    probe = Probe()
    collate = (lambda x: (time.sleep(d), x)[1]) if slow == "collate" else (lambda x: x)
    workers = make_workers(n_workers, delay=d if slow == "target" else 0.0)
    seen_depths = []
    with Pipeline(probe.source(n, d if slow == "sampler" else 0.0), collate, workers, c) as p:
        got = []
        for w, x in p:
            if slow == "consumer":
                time.sleep(d)
            probe.took()
            got.append(x)
            seen_depths.append(p.depths())
    assert got == [i * 10 for i in range(n)]
    # Bounded queues: no queue ever held more than its capacity...
    assert p._q_idx.high_water <= c.prefetch
    assert all(q.high_water <= c.prefetch for q in p.q_pre)
    assert all(q.high_water <= c.hs_queue for q in p.q_hs)
    assert all(len(d_["q_pre"]) == n_workers and len(d_["q_hs"]) == n_workers for d_ in seen_depths)
    # ... and the sampler never ran further ahead of the caller than the queues plus one item in the hands of
    # each stage (sampler, collate, every worker) and of the caller.
    capacity = c.prefetch + n_workers * (c.prefetch + c.hs_queue) + (2 + n_workers) + 1
    assert probe.max_ahead <= capacity
    if slow == "consumer":
        assert probe.max_ahead == capacity  # a slow caller fills everything, and backpressure stops the rest


class Trip:
    """Marks the moment an injected failure is raised."""

    def __init__(self) -> None:
        self.event = threading.Event()
        self.at = 0.0

    def fire(self, message: str) -> ValueError:
        self.at = time.monotonic()
        self.event.set()
        return ValueError(message)


def _fail_in(stage: str, n_workers: int = 3) -> tuple[Pipeline, Trip]:
    """A pipeline whose `stage` raises (sampler/collate on item 5, worker w on its first item)."""
    trip = Trip()

    def source():
        for i in range(50):
            if stage == "sampler" and i == 5:
                raise trip.fire("injected failure in the sampler")
            yield i

    def collate(x):
        if stage == "collate" and x == 5:
            raise trip.fire("injected failure in collate")
        return x

    def work(w):
        def fn(x):
            if stage == f"target[{w}]":
                raise trip.fire(f"injected failure in worker {w}")
            return x
        return fn

    return Pipeline(source(), collate, [work(w) for w in range(n_workers)], cfg()), trip


@pytest.mark.parametrize("stage", STAGES_3)
@pytest.mark.parametrize("consumer", ["reading", "stalled"])
def test_stage_failure_surfaces_naming_the_stage(stage, consumer):
    p, trip = _fail_in(stage)
    with pytest.raises(PipelineError) as info:
        with p:
            if consumer == "stalled":
                assert trip.event.wait(10)  # caller busy while the other stages fill their queues and fail
            for _ in p:
                pass
    caught = time.monotonic()
    assert info.value.stage == stage
    assert f"stage {stage!r} failed" in str(info.value)
    assert isinstance(info.value.__cause__, ValueError)
    assert not pipeline_threads()
    # The stop is an immediate wake-up (the safety-net re-check is 60 s), so it lands well inside 5 s.
    assert caught - trip.at < 5.0


def test_failure_while_caller_blocked_on_another_worker():
    """Worker 1 fails while the caller waits on worker 0's (empty) queue: the caller must still wake up."""
    gate = threading.Event()

    def slow0(x):
        gate.wait(30)
        return x

    def fail1(x):
        raise KeyError("boom")

    p = Pipeline(range(10), lambda x: x, [slow0, fail1], cfg())
    t0 = time.monotonic()
    with pytest.raises(PipelineError, match=r"stage 'target\[1\]' failed: KeyError"):
        with p:
            try:
                next(iter(p))
            finally:
                gate.set()  # let worker 0 finish its call so close() can join it
    assert time.monotonic() - t0 < 5.0
    assert not pipeline_threads()


def test_close_mid_stream_joins_every_thread():
    before = set(threading.enumerate())
    p = Pipeline(range(1000), lambda x: x, make_workers(3), cfg(prefetch=2, hs=1)).start()
    it = iter(p)
    assert [next(it)[1] for _ in range(3)] == [0, 10, 20]
    assert len(pipeline_threads()) == 5 and list(p.threads) == STAGES_3
    p.close()
    assert set(threading.enumerate()) == before
    with pytest.raises(PipelineError, match="closed"):
        p.start()


def test_unread_failure_raised_by_close():
    p = Pipeline((1 / 0 for _ in range(3)), lambda x: x, make_workers(1), cfg()).start()
    p.threads["sampler"].join(5)  # it fails on its first item
    assert p.failure is not None and p.failure.stage == "sampler"
    with pytest.raises(PipelineError, match="'sampler' failed: ZeroDivisionError"):
        p.close()
    assert not pipeline_threads()


def test_caller_exception_is_not_masked():
    with pytest.raises(RuntimeError, match="caller bug"):
        with Pipeline(range(10), lambda x: x, make_workers(2), cfg()) as p:
            next(iter(p))
            raise RuntimeError("caller bug")
    assert not pipeline_threads()


def test_stuck_stage_reported_by_close():
    gate, entered = threading.Event(), threading.Event()

    def stuck(x):
        entered.set()
        gate.wait(30)
        return x

    p = Pipeline(range(5), lambda x: x, [stuck], cfg(close=0.2)).start()
    assert entered.wait(5)
    with pytest.raises(PipelineError, match=r"did not stop.*pipeline-target\[0\]"):
        p.close()
    gate.set()
    for t in pipeline_threads():
        t.join(10)
    assert not pipeline_threads()


def test_data_wait_accounting_with_synthetic_clock():
    ticks = iter(range(10_000))
    clock = lambda: float(next(ticks))  # noqa: E731 - each call advances one second
    with Pipeline(range(7), lambda x: x, make_workers(2), cfg(), clock=clock) as p:
        out = list(p)
    assert len(out) == 7
    assert p.last_wait_s == 1.0  # two clock reads per item
    assert p.wait_s == 7.0


def test_collates_real_batches_and_pins_when_asked():
    store = [(np.arange(n) + 1, np.ones(n, bool)) for n in (3, 5, 2, 7, 4, 6)]
    sampler = [[0, 1], [2, 3], [4, 5]]
    pinned = []

    class PinProbe:
        def __init__(self, batch):
            self.batch = batch

        def pin_memory(self):
            pinned.append(self.batch.indices)
            return self.batch

    collate = lambda idx: PinProbe(collate_padded([store[i] for i in idx], pad_id=0, indices=idx))  # noqa: E731
    with Pipeline(sampler, collate, [lambda b: (b, b.input_ids.float().sum())], cfg(), pin_memory=True) as p:
        out = list(p)
    assert [b.indices for b, _ in out] == sampler
    assert pinned == sampler
    assert [b.input_ids.shape for b, _ in out] == [torch.Size([2, 5]), torch.Size([2, 7]), torch.Size([2, 6])]
    assert [b.real_tokens for b, _ in out] == [8, 9, 10]


def test_bounded_queue_abort_wakes_a_blocked_put():
    q = BoundedQueue(1, "q", recheck_s=60.0)
    q.put(1)
    result = []

    def blocked():
        try:
            q.put(2)
        except Exception as e:  # noqa: BLE001 - recorded for the assertion
            result.append(type(e).__name__)

    t = threading.Thread(target=blocked)
    t.start()
    q.abort()
    t.join(5)
    assert not t.is_alive() and result == ["Aborted"]
    assert q.qsize() == 0
    with pytest.raises(ValueError, match="maxsize"):
        BoundedQueue(0, "bad")


def test_target_worker_threads_are_set_per_thread_and_leave_the_caller_alone():
    """torch's intra-op thread count is per calling thread: a CPU target worker can get its own budget while the
    drafter's thread keeps all of its threads."""
    from dflash_lib.train.feed import Collated, Work, make_target_workers

    seen = []

    class Target:
        device = torch.device("cpu")

        def segments(self, host_doc_ids):
            return {}

        def context_features(self, batch, segments=None):  # the feed's call: (C, F*H) of the real tokens
            seen.append(torch.get_num_threads())
            return torch.zeros(int((batch.doc_ids >= 0).sum()), 4)

    batch = collate_padded([(np.arange(5), np.ones(5, bool))], pad_id=0)
    before = torch.get_num_threads()
    for threads, want in ((0, before), (1, 1)):  # (a thread started after a set_num_threads inherits its count)
        (work,) = make_target_workers([Target()], 1, torch.device("cpu"), threads=threads)
        t = threading.Thread(target=lambda: work(Collated(Work(0, 0, 0, True, [0]), batch, ())))
        t.start()
        t.join()
        assert seen[-1] == want
    assert torch.get_num_threads() == before
