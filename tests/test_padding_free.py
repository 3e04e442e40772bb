"""No compute on padding: the target runs a batch's real tokens only (features and losses equal to the slot-by-slot
path it replaced, FLOPs proportional to real tokens), the drafter's context is those real tokens (hidden states,
losses and gradients equal to its every-slot path, FLOPs those of the documents alone), and packed rows are as long
as their documents."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from dflash_lib.config import ConfigError, from_params, preset
from dflash_lib.data.batch import Batch, collate_packed, collate_padded, packed_row_len
from dflash_lib.models import real_tokens, segment_cu_seqlens
from dflash_lib.models.attention import sdpa_flop_mapping
from dflash_lib.models.layout import build_layout
from dflash_lib.plan.sampler import packing_efficiency
from dflash_lib.train.feed import Work, make_collate
from test_step_syncs import SyncCounter
from fp_tolerance import rounding_atol
from tiny_models import VOCAB, tiny_drafter, tiny_target


@pytest.fixture(scope="module")
def target():
    return tiny_target(num_layers=6, num_features=3)


@pytest.fixture(scope="module")
def drafter(target):
    return tiny_drafter(target, attention="blocks")


def _docs(lengths, seed=0):
    rng = np.random.default_rng(seed)
    return [(rng.integers(0, VOCAB - 1, n), np.arange(n) >= 2) for n in lengths]


def _rows(rows: list[list[tuple[np.ndarray, np.ndarray]]], row_len: int) -> Batch:
    """Several packed rows of `row_len` slots in one batch (documents numbered across rows)."""
    parts = [collate_packed(docs, 0, row_len) for docs in rows]
    doc_ids, first = [], 0
    for p in parts:
        doc_ids.append(torch.where(p.doc_ids >= 0, p.doc_ids + first, -1))
        first += len(p.cu_seqlens) - 1
    lens = torch.cat([p.cu_seqlens[1:] - p.cu_seqlens[:-1] for p in parts])
    return Batch(torch.cat([p.input_ids for p in parts]), torch.cat([p.loss_mask for p in parts]),
                 torch.cat([p.position_ids for p in parts]), torch.cat(doc_ids),
                 torch.cat([torch.zeros(1, dtype=torch.int32), torch.cumsum(lens, 0).to(torch.int32)]), packed=True)


BATCHES = {  # name -> a batch with padding in it
    "padded": lambda: collate_padded(_docs([30, 7, 19, 2]), 0),
    "packed": lambda: collate_packed(_docs([9, 4, 13]), 0, row_len=40),
    "mixed": lambda: _rows([_docs([9, 14], 1), _docs([20], 2), _docs([3, 5, 6], 3)], row_len=24),
}


@torch.no_grad()
def reference_features(target, batch: Batch) -> torch.Tensor:
    """The target's path before it gathered the real tokens (kept here as the reference): all R*T slots run as one
    flattened sequence, per-document SDPA over the documents' slot ranges, padding zeroed afterwards."""
    cu, _ = segment_cu_seqlens(batch.doc_ids)
    bounds, starts = cu.tolist(), cu[:-1].long()
    keep = (batch.doc_ids.reshape(-1)[starts] >= 0).tolist()
    segments = [(bounds[i], bounds[i + 1]) for i, k in enumerate(keep) if k]
    h = target.embed_tokens(batch.input_ids)  # (R, T, H)
    R, T, H = h.shape
    feats = h.new_empty(R, T, target.num_features * H)
    rope = target.base.rotary_emb(h, batch.position_ids)
    h, rope = h.reshape(1, R * T, -1), tuple(x.reshape(1, R * T, -1) for x in rope)
    position_ids = batch.position_ids.reshape(1, R * T)
    for i, layer in enumerate(target.base.layers[:max(target.layer_ids) + 1]):
        h = layer(h, attention_mask=None, position_ids=position_ids, position_embeddings=rope,
                  dflash_segments=segments)
        for f, layer_id in enumerate(target.layer_ids):
            if layer_id == i:
                feats[..., f * H:(f + 1) * H] = h.reshape(R, T, H)
    return feats.masked_fill_((batch.doc_ids < 0).unsqueeze(-1), 0.0)


def test_real_tokens_gather_the_documents_of_every_row():
    doc = torch.tensor([[0, 0, 1, 1, 1, -1], [2, 2, 2, 3, -1, -1]])
    real = real_tokens(doc)
    assert real.index.tolist() == [0, 1, 2, 3, 4, 6, 7, 8, 9]  # row-major slots, padding left out
    assert real.cu_seqlens.tolist() == [0, 2, 5, 8, 9] and real.cu_seqlens.dtype == torch.int32
    assert real.segments == ((0, 2), (2, 5), (5, 8), (8, 9)) and real.longest == 3
    assert (real.num_real, real.slots, real.runs_padding) == (9, 12, False)
    every = real_tokens(doc, gather=False)  # fixed shapes: every slot, padding runs as segments of their own
    assert every.index is None and every.cu_seqlens.tolist() == [0, 2, 5, 6, 9, 10, 12]
    assert every.segments == ((0, 2), (2, 5), (6, 9), (9, 10)) and every.runs_padding
    full = real_tokens(torch.tensor([[0, 0, 1], [2, 2, 2]]))  # nothing to leave out: no gather
    assert full.index is None and full.segments == ((0, 2), (2, 3), (3, 6)) and not full.runs_padding


@pytest.mark.parametrize("name", sorted(BATCHES))
def test_features_and_losses_equal_the_slot_by_slot_reference(target, drafter, name):
    batch = BATCHES[name]()
    assert batch.real_tokens < batch.padded_tokens  # the case at stake: padding in the batch
    want = reference_features(target, batch)
    for gather in (True, False):  # real tokens only, and every slot (static shapes)
        target.gather = gather
        try:
            got = target.features(batch)
        finally:
            target.gather = True
        assert got.shape == want.shape and got.dtype == torch.float32
        torch.testing.assert_close(got, want, atol=1e-6, rtol=0)
        assert got[batch.doc_ids < 0].abs().max() == 0
        layout = drafter.layout(batch, drafter.sample_anchors(batch, torch.Generator().manual_seed(0)))
        with torch.no_grad():
            loss, ref = drafter.loss(batch, got, layout), drafter.loss(batch, want, layout)
        assert layout.num_scored > 0 and torch.isfinite(loss.loss)
        assert abs(float(loss.loss) - float(ref.loss)) <= 1e-6


@pytest.mark.parametrize("name", sorted(BATCHES))
def test_the_gather_is_planned_on_the_host_and_the_forward_reads_no_device_value(target, name):
    """The feed stage computes the segments from the HOST doc_ids; the forward on the device batch then makes no
    device-to-host sync (no nonzero, no boolean mask, no .item())."""
    batch = BATCHES[name]()
    segments = target.segments(batch.doc_ids)
    with SyncCounter() as counter:
        target.features(batch, segments)
    assert counter.syncs == []


def _flops(fn) -> int:
    with FlopCounterMode(display=False, custom_mapping=sdpa_flop_mapping()) as counter:
        fn()
    return counter.get_total_flops()


def test_target_flops_are_those_of_the_real_tokens_not_the_slots(target):
    docs = _docs([300, 40, 40, 20])
    alone = sum(_flops(lambda d=d: target.features(collate_padded([d], 0))) for d in docs)  # no padding at all
    padded, packed = collate_padded(docs, 0), collate_packed(docs, 0, row_len=1200)  # 1200 slots, 400 real
    for batch in (padded, packed):
        assert _flops(lambda: target.features(batch)) == pytest.approx(alone, rel=0.02)
        reference = _flops(lambda: reference_features(target, batch))
        assert reference > 1.5 * alone  # what the slot-by-slot path paid (3x on the linear layers)
        target.gather = False  # static shapes pay the slots again, as the reference did
        try:
            assert _flops(lambda: target.features(batch)) == pytest.approx(reference, rel=0.02)
        finally:
            target.gather = True


def _drafter_run(drafter, batch, feats, layout, backend, grad=True):
    """(hidden states (n*B, H), loss, {parameter: gradient}) of one drafter forward (+ backward) on `backend`."""
    drafter.attention = backend
    drafter.zero_grad(set_to_none=True)
    try:
        with torch.no_grad():
            hidden = drafter.forward_hidden(batch, feats, layout)
        if not grad:
            return hidden, None, {}
        out = drafter.loss(batch, feats, layout)
        out.loss.backward()
        return hidden, out.loss.detach(), {n: p.grad.clone() for n, p in drafter.named_parameters()
                                           if p.grad is not None}
    finally:
        drafter.attention = "blocks"
        drafter.zero_grad(set_to_none=True)


@pytest.mark.parametrize("backend", ["dense", "blocks", "flex"])
@pytest.mark.parametrize("name", sorted(BATCHES))
def test_the_drafter_on_the_real_tokens_equals_its_every_slot_path(target, drafter, name, backend):
    """The real-token context (the target's flat features, or its (R, T) slots gathered by the drafter) against the
    every-slot context the drafter ran before (kept as the `static_shapes` path): hidden states, loss and gradients
    within 1e-6 in fp32 (flex: the forward, which is all it runs on CPU)."""
    batch = BATCHES[name]()
    anchors = drafter.sample_anchors(batch, torch.Generator().manual_seed(0))
    real, every = build_layout(batch, anchors, backend), build_layout(batch, anchors, backend, every_slot=True)
    assert real.num_context == batch.real_tokens < every.num_context == batch.padded_tokens
    assert real.ctx_index.tolist() == torch.nonzero(batch.doc_ids.reshape(-1) >= 0).flatten().tolist()
    assert real.ctx_doc.min() >= 0 and every.ctx_index is None
    flat, slots = target.context_features(batch), target.features(batch)  # (C, F*H), (R, T, F*H)
    assert flat.shape == (batch.real_tokens, slots.shape[-1])
    grad = backend != "flex"
    want_h, want_loss, want_g = _drafter_run(drafter, batch, slots, every, backend, grad)
    assert want_h.shape == (real.num_queries, drafter.cfg.hidden_size)
    # the longest sum either path rounds: the MLP's, or attention / a weight gradient over every slot and query
    terms, depth = max(drafter.cfg.intermediate_size, every.num_context + every.num_queries), drafter.cfg.num_layers + 1
    for feats in (flat, slots):
        h, loss, g = _drafter_run(drafter, batch, feats, real, backend, grad)
        torch.testing.assert_close(h, want_h, atol=rounding_atol(want_h, terms=terms, depth=depth), rtol=0)
        if grad:
            assert abs(float(loss) - float(want_loss)) <= 1e-6
            assert g.keys() == want_g.keys() and "fc.weight" in g
            for n in g:
                torch.testing.assert_close(g[n], want_g[n], atol=rounding_atol(want_g[n], terms=terms, depth=depth),
                                           rtol=0, msg=n)
    with pytest.raises(ValueError, match="context features for a layout of"):  # flat features, every-slot layout
        drafter.forward_hidden(batch, flat, every)


def test_static_shapes_keep_the_every_slot_context(target, drafter):
    """A target with gather off (`static_shapes`) runs and hands over every slot; the drafter's layout follows it
    (every slot, padding slots of doc -1) and its loss equals the real-token path's."""
    batch = BATCHES["mixed"]()
    anchors = drafter.sample_anchors(batch, torch.Generator().manual_seed(0))
    target.gather = False
    try:
        layout, feats = drafter.layout(batch, anchors), target.context_features(batch)  # (R*T, F*H)
    finally:
        target.gather = True
    assert layout.ctx_index is None and layout.num_context == feats.shape[0] == batch.padded_tokens
    assert int((layout.ctx_doc < 0).sum()) == batch.padded_tokens - batch.real_tokens
    assert feats[batch.doc_ids.reshape(-1) < 0].abs().max() == 0
    real = drafter.layout(batch, anchors)
    assert real.num_context == batch.real_tokens
    with torch.no_grad():
        static, gathered = drafter.loss(batch, feats, layout), drafter.loss(batch, target.context_features(batch), real)
    assert abs(float(static.loss) - float(gathered.loss)) <= 1e-6


def test_drafter_flops_are_those_of_the_real_tokens_not_the_slots(target, drafter):
    """Counted with FlopCounterMode over a training forward + backward: the same four documents cost the drafter the
    same FLOPs padded (4 x 30 slots), packed into a padded row (80 slots) or alone in one row (58 slots); the
    every-slot context pays its padding in the fuse and the K/V projections, in proportion to the padding slots."""
    docs = _docs([30, 7, 19, 2])
    batches = dict(padded=collate_padded(docs, 0), packed=collate_packed(docs, 0, row_len=80),
                   alone=collate_packed(docs, 0, row_len=58))
    assert [b.padded_tokens for b in batches.values()] == [120, 80, 58]

    def counts(batch, every_slot):
        layout = build_layout(batch, drafter.sample_anchors(batch, torch.Generator().manual_seed(0)), "blocks",
                              every_slot=every_slot)
        feats = target.features(batch)
        with FlopCounterMode(display=False, custom_mapping=sdpa_flop_mapping()) as counter:
            drafter.loss(batch, feats, layout).loss.backward()
        drafter.zero_grad(set_to_none=True)
        kv = sum(sum(v.values()) for k, v in counter.get_flop_counts().items()
                 if k.endswith(("self_attn.k_proj", "self_attn.v_proj")))
        with FlopCounterMode(display=False) as fuse:
            drafter.fuse(drafter.context_features(feats, layout))
        return counter.get_total_flops(), kv, fuse.get_total_flops(), layout.num_blocks

    real = {k: counts(b, False) for k, b in batches.items()}
    every = {k: counts(b, True) for k, b in batches.items()}
    F_H, H = target.num_features * target.hidden_size, target.hidden_size
    assert real["alone"][3] > 0 and real["padded"] == real["packed"] == real["alone"] == every["alone"]
    assert real["padded"][2] == 2 * 58 * F_H * H  # the fuse runs the 58 real tokens
    for part in (0, 1, 2):  # the every-slot excess, total, K/V and fuse, grows with the padding slots
        extra = {k: every[k][part] - real["alone"][part] for k in ("padded", "packed")}
        assert extra["packed"] > 0 and extra["padded"] * (80 - 58) == extra["packed"] * (120 - 58)


def test_packed_rows_are_their_tokens_rounded_up_unless_static():
    docs = _docs([50, 31, 20])  # 101 tokens
    assert [packed_row_len(101, 256, m) for m in (0, 1, 64, 128, 512)] == [256, 101, 128, 128, 256]
    assert collate_packed(docs, 0, 256, multiple=64).input_ids.shape == (1, 128)
    assert collate_packed(docs, 0, 256).input_ids.shape == (1, 256)  # multiple 0: exactly row_len (static)
    store = docs + _docs([256], 1)
    for static, want in ((False, [(1, 128), (1, 256)]), (True, [(1, 256), (1, 256)])):
        collate = make_collate(store, True, 0, 256, pack_multiple=0 if static else 64)
        shapes = [tuple(collate(Work(0, s, 0, True, idx)).batch.input_ids.shape)
                  for s, idx in enumerate([[0, 1, 2], [3]])]
        assert shapes == want
    # the predicted token efficiency counts the rows' real lengths: (101 + 256) / (128 + 256)
    lengths = np.array([50, 31, 20, 256])
    assert packing_efficiency([[0, 1, 2], [3]], lengths, 256, 64) == pytest.approx(357 / 384)
    assert packing_efficiency([[0, 1, 2], [3]], lengths, 256) == pytest.approx(357 / 512)


def test_static_shapes_and_pack_multiple_settings():
    cfg = from_params({"strategy": "packed", "static_shapes": True}, preset("smoke"))
    assert cfg.sampler.static_shapes and cfg.sampler.pack_multiple == 64
    with pytest.raises(ConfigError, match="pack_multiple must be > 0"):
        from_params({"pack_multiple": 0}, preset("smoke"))
    with pytest.raises(ConfigError, match="static_shapes needs strategy 'bucketed' or 'packed'"):
        from_params({"strategy": "random", "static_shapes": True}, preset("smoke"))
