"""One training step makes a small, FIXED number of device-to-host syncs, whatever the batch size.

Counted on CPU with a dispatch mode: every op that must read device data on the host (`_local_scalar_dense`
behind .item()/float()/int()/bool(), nonzero, boolean-mask indexing, masked_select, bincount, unique,
repeat_interleave with tensor repeats) plus `Tensor.tolist` (which reads memory without dispatching)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from dflash_lib.data.batch import collate_padded
from dflash_lib.models import DFlashDrafter, DrafterConfig, tiny_qwen3_config
from dflash_lib.target.local import TargetModel
from dflash_lib.train.feed import Item
from dflash_lib.train.state import BadStepGuard
from dflash_lib.train.step import train_step

VOCAB = 200
SYNC_OPS = {"_local_scalar_dense", "nonzero", "masked_select", "bincount", "_unique2", "unique_dim",
            "unique_consecutive", "item"}


class SyncCounter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.syncs: list[str] = []
        self.paused = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._overloadpacket.__name__
        if self.paused:
            pass
        elif name in SYNC_OPS:
            self.syncs.append(name)
        elif name == "index" and any(isinstance(i, torch.Tensor) and i.dtype == torch.bool
                                     for i in (args[1] if len(args) > 1 else [])):
            self.syncs.append("index(bool)")
        elif name == "repeat_interleave" and isinstance(args[0], torch.Tensor) and len(args) > 1 \
                and isinstance(args[1], torch.Tensor):
            self.syncs.append("repeat_interleave(tensor)")
        return func(*args, **(kwargs or {}))


def _count(n_docs: int, backend: str, monkeypatch) -> list[str]:
    target = TargetModel.from_hf_config(tiny_qwen3_config(hidden_size=32, num_layers=4, vocab_size=VOCAB), 2)
    cfg = DrafterConfig(hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, intermediate_size=64,
                        vocab_size=VOCAB, target_layer_ids=target.layer_ids, target_num_layers=target.num_layers,
                        block_size=4, mask_id=VOCAB - 1, num_anchors=8, ce_chunk_blocks=2)
    torch.manual_seed(0)
    drafter = DFlashDrafter(cfg, target, attention=backend, checkpointing=True)
    rng = np.random.default_rng(n_docs)
    docs = [(rng.integers(0, VOCAB - 1, int(n)), np.arange(int(n)) >= 3) for n in rng.integers(10, 40, n_docs)]
    items = []
    for part in (docs[: n_docs // 2], docs[n_docs // 2:]):  # two micro-batches (gradient accumulation)
        batch = collate_padded(part, 0)
        layout = drafter.layout(batch, drafter.sample_anchors(batch, torch.Generator().manual_seed(1)))
        items.append(Item(0, batch, batch, target.features(batch), layout=layout, device_layout=layout))
    params = [p for p in drafter.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-3, foreach=True)
    counter = SyncCounter()
    real_tolist, real_step = torch.Tensor.tolist, opt.step
    monkeypatch.setattr(torch.Tensor, "tolist",
                        lambda t: counter.paused or counter.syncs.append("tolist") or real_tolist(t))

    def optimizer_step():  # AdamW's step counters are CPU tensors by design (fused on CUDA: on the device)
        counter.paused = True
        real_step()
        counter.paused = False

    opt.step = optimizer_step
    with counter:
        res = train_step(drafter, items, params, opt, 1e-3, 1.0, False, BadStepGuard(3), 1)
    monkeypatch.undo()
    assert not res.skipped and res.blocks > 0
    return counter.syncs


@pytest.mark.parametrize("backend", ["blocks", "dense"])
def test_sync_count_is_small_and_independent_of_the_batch(backend, monkeypatch):
    # two micro-batches of 1 + 1 and of 6 + 6 documents: the step's one transfer (statistics + grad norm)
    assert _count(2, backend, monkeypatch) == _count(12, backend, monkeypatch) == ["tolist"]


def test_the_counter_sees_a_planted_sync(monkeypatch):
    """The counter is not blind: an .item() in the loss (a per-micro-batch sync) is seen twice."""
    import dflash_lib.models.loss as loss_mod

    real = loss_mod.weighted_loss

    def syncing(*args, **kwargs):
        out = real(*args, **kwargs)
        float(out.ce_total)
        return out

    monkeypatch.setattr(loss_mod, "weighted_loss", syncing)
    import dflash_lib.models.drafter as drafter_mod
    monkeypatch.setattr(drafter_mod, "weighted_loss", syncing)
    syncs = _count(4, "blocks", monkeypatch)
    assert syncs.count("_local_scalar_dense") == 2 and syncs.count("tolist") == 1
