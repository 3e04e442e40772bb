"""The target worker's CUDA stream hand-over (feed.make_target_workers, Item.wait_ready, train_step).

No GPU here: on CPU the path must be a no-op (ready is None); the ORDER of the stream calls is checked with
stand-ins for torch.cuda.Stream / stream / Event / current_stream and Tensor.record_stream, forced on with
`streams=True` over a CPU target. What a real GPU adds (that the wait is enough) is benchmarks/gpu_check.py's."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dflash_lib.data.batch import collate_padded
from dflash_lib.models import DFlashDrafter, DrafterConfig, tiny_qwen3_config
from dflash_lib.target.local import TargetModel
from dflash_lib.train.feed import Collated, Item, Work, make_target_workers
from dflash_lib.train.state import BadStepGuard
from dflash_lib.train.step import train_step

VOCAB = 200


def _models():
    target = TargetModel.from_hf_config(tiny_qwen3_config(hidden_size=32, num_layers=4, vocab_size=VOCAB), 2)
    cfg = DrafterConfig(hidden_size=32, num_layers=1, num_heads=4, num_kv_heads=2, head_dim=8, intermediate_size=64,
                        vocab_size=VOCAB, target_layer_ids=target.layer_ids, target_num_layers=target.num_layers,
                        block_size=4, mask_id=VOCAB - 1, num_anchors=4)
    torch.manual_seed(0)
    return target, DFlashDrafter(cfg, target, attention="blocks")


def _collated(drafter, step: int) -> Collated:
    rng = np.random.default_rng(step)
    docs = [(rng.integers(0, VOCAB - 1, int(n)), np.arange(int(n)) >= 2) for n in (12, 20)]
    batch = collate_padded(docs, 0)
    layout = drafter.layout(batch, drafter.sample_anchors(batch, torch.Generator().manual_seed(step)))
    return Collated(Work(0, step, 0, True, [0, 1]), batch, (), layout)


def test_cpu_items_carry_no_event_and_waiting_is_a_no_op():
    target, drafter = _models()
    (work,) = make_target_workers([target], 1, torch.device("cpu"))
    c = _collated(drafter, 0)
    item = work(c)
    assert item.ready is None
    torch.testing.assert_close(item.features, target.context_features(c.batch), rtol=0, atol=0)
    assert item.features.shape[0] == c.batch.real_tokens == c.layout.num_context  # no padding slot
    item.wait_ready()  # must not touch torch.cuda on a CPU-only build
    assert item.ready is None


class _Log:
    def __init__(self):
        self.calls: list[tuple] = []
        self.current = 0  # the consumer's (default) stream id


@pytest.fixture
def fake_cuda(monkeypatch):
    log = _Log()

    class Stream:
        count = 0

        def __init__(self, device=None):
            Stream.count += 1
            self.id = Stream.count
            log.calls.append(("new_stream", self.id))

        def wait_event(self, ev):
            log.calls.append(("wait_event", self.id, ev.id))

    class StreamContext:
        def __init__(self, s):
            self.s = s

        def __enter__(self):
            log.calls.append(("enter", self.s.id))

        def __exit__(self, *exc):
            log.calls.append(("exit", self.s.id))

    class Event:
        count = 0

        def __init__(self, *a, **k):
            Event.count += 1
            self.id = 100 + Event.count

        def record(self, stream=None):
            log.calls.append(("record", self.id, None if stream is None else stream.id))

        def synchronize(self):  # a host sync: must never be called
            log.calls.append(("synchronize", self.id))

    consumer = Stream.__new__(Stream)
    consumer.id = 0
    monkeypatch.setattr(torch.cuda, "Stream", Stream)
    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "stream", StreamContext)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: consumer)
    monkeypatch.setattr(torch.Tensor, "record_stream",
                        lambda t, s: log.calls.append(("record_stream", t.data_ptr(), s.id)))
    return log


def test_worker_records_after_the_features_and_the_step_waits_before_use(fake_cuda):
    log = fake_cuda.calls
    target, drafter = _models()
    real_features, real_loss = target.context_features, drafter.loss

    def features(batch, segments=None):
        log.append(("features",))
        return real_features(batch, segments)

    def loss(*a, **k):
        log.append(("loss",))
        return real_loss(*a, **k)

    target.context_features = features  # instance attributes: the wrapped originals still run
    drafter.loss = loss
    (work,) = make_target_workers([target], 1, torch.device("cpu"), streams=True)
    items = [work(_collated(drafter, s)) for s in (0, 1)]
    names = [c[0] for c in log]
    # one stream for the worker, made once; each item: enter it, run the target, record, leave
    assert names.count("new_stream") == 1
    assert names[1:] == ["enter", "features", "record", "exit"] * 2
    worker_stream = log[0][1]
    for c in log:
        if c[0] in ("enter", "exit") or c[0] == "record":
            assert c[-1] == worker_stream  # copies, forward and the event all on the worker's stream
    events = [c[1] for c in log if c[0] == "record"]
    assert [it.ready.id for it in items] == events and len(set(events)) == 2

    del log[:]
    params = [p for p in drafter.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-3)
    res = train_step(drafter, items, params, opt, 1e-3, 1.0, False, BadStepGuard(3), 1)
    assert not res.skipped and res.blocks > 0
    first_use = next(i for i, c in enumerate(log) if c[0] == "loss")
    waits = [c for c in log[:first_use] if c[0] == "wait_event"]
    assert waits == [("wait_event", 0, e) for e in events]  # the consumer's stream waits on both, before use
    kept = {c[1] for c in log[:first_use] if c[0] == "record_stream" and c[2] == 0}
    for it in items:  # every device tensor of every item is marked as used by the consumer's stream
        assert {t.data_ptr() for t in it.device_tensors()} <= kept
        assert it.features.data_ptr() in kept and it.device_layout.block_ids.data_ptr() in kept
    assert "synchronize" not in [c[0] for c in log]
    assert all(it.ready is None for it in items)  # waited once


def test_no_event_for_an_all_invalid_item(fake_cuda):
    target, _ = _models()
    (work,) = make_target_workers([target], 1, torch.device("cpu"), streams=True)
    item = work(Collated(Work(0, 0, 0, True, [0]), None, (("empty", 0, 0),)))
    assert item.ready is None and item.features is None
    assert [c[0] for c in fake_cuda.calls] == []
