"""Loss kl / ce+kl against the target's own next-token distribution, and D-PACE position weights: the fused terms
against brute force over full logits (float64), gradients by gradcheck, the ce path as it was, ce+kl = ce + w*kl,
D-PACE against loops over blocks and positions, and the dry run counting the KL work."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from dflash_lib.data.batch import collate_packed, collate_padded
from dflash_lib.models import tiny_qwen3_config
from dflash_lib.target.local import TargetModel
from dflash_lib.models.anchors import decay_weights, position_weights
from dflash_lib.models.loss import _FusedHeadCEKL, dpace_weights, head_cross_entropy, subnormals_flushed
from tiny_models import HIDDEN, VOCAB, tiny_drafter

TOL = 1e-6


@pytest.fixture(scope="module")
def target64() -> TargetModel:
    """The tiny 6-layer, 2-feature target in float64: the fused loss and the brute force agree to ~1e-12."""
    hf = tiny_qwen3_config(hidden_size=HIDDEN, num_layers=6, vocab_size=VOCAB)
    return TargetModel.from_hf_config(hf, 2, dtype=torch.float64, seed=0)


def _docs(lengths=(21, 13, 9), seed=0):
    """Documents of random ids below MASK whose first 3 tokens are a prompt (never scored)."""
    rng = np.random.default_rng(seed)
    out = []
    for L in lengths:
        mask = np.ones(L, dtype=np.uint8)
        mask[:3] = 0
        out.append((rng.integers(0, VOCAB - 1, L), mask))
    return out


def _drafter64(target, **cfg):
    return tiny_drafter(target, **cfg).to(torch.float64)


def _work(drafter, target, batch, seed=0):
    """(layout, context features, target final states or None) as the target worker makes them."""
    layout = drafter.layout(batch, drafter.sample_anchors(batch, torch.Generator().manual_seed(seed)))
    if layout.target_rows is None:
        return layout, target.context_features(batch), None
    feats, final = target.context_features_and_final(batch, layout.target_rows)
    return layout, feats, final


def _brute_kl(drafter, target, batch, feats, layout, T):
    """(m,) KL(softmax(t/T) || softmax(z/T)) per scored position (layout order): t from the Hugging Face model's own
    full forward over each document (logits at EVERY position, row a + k - 1 for the label at a + k), z from the
    drafter's full (n, B, V) logits."""
    z = drafter.block_logits(batch, feats, layout)  # (n, B, V)
    doc_logits = {}
    for d in range(int(batch.doc_ids.max()) + 1):
        r, c = np.nonzero(batch.doc_ids.numpy() == d)
        with torch.no_grad():
            doc_logits[d] = target.model(input_ids=batch.input_ids[r[0], c].unsqueeze(0)).logits[0]  # (L, V)
    B, out = layout.block_size, []
    for s in layout.scored.tolist():
        i, k = divmod(s, B)
        t = doc_logits[int(layout.block_doc[i])][int(layout.anchor_pos[i]) + k - 1]  # (V,)
        log_p, log_q = F.log_softmax(t / T, dim=-1), F.log_softmax(z[i, k] / T, dim=-1)
        out.append(F.kl_div(log_q, log_p, log_target=True, reduction="sum"))
    return torch.stack(out)


@pytest.mark.parametrize("packed,T,gather", [(False, 1.0, True), (True, 2.5, True), (False, 1.5, False)])
def test_kl_term_equals_brute_force_over_full_logits(target64, packed, T, gather):
    """Padded and packed batches of the real tokens, and every slot run (gather off: static shapes)."""
    if not gather:
        target64 = TargetModel(target64.model, target64.layer_ids, gather=False)  # the same weights
    drafter = _drafter64(target64, loss="kl", kl_temperature=T, ce_chunk_blocks=3)  # chunks of 12 positions
    docs = _docs()
    batch = collate_packed(docs, 0, 64) if packed else collate_padded(docs, 0)
    layout, feats, final = _work(drafter, target64, batch)
    assert layout.num_scored > 40 and final.shape == (layout.target_rows.numel(), HIDDEN)
    assert layout.target_rows.numel() < layout.num_scored  # overlapping blocks share target rows
    out = drafter.loss(batch, feats, layout, target_hidden=final)
    kl = _brute_kl(drafter, target64, batch, feats, layout, T)
    expected = float((layout.weights.double() * T * T * kl).sum().detach()) / layout.weight_sum
    assert expected > 1e-3
    assert abs(out.loss.item() - expected) < TOL


def test_ce_plus_kl_is_ce_plus_weight_times_kl_in_value_and_gradient(target64):
    batch = collate_padded(_docs(), 0)
    w, T = 0.37, 1.7
    losses, grads = {}, {}
    for kind in ("ce", "kl", "ce+kl"):
        drafter = _drafter64(target64, loss=kind, kl_weight=w, kl_temperature=T)
        layout, feats, final = _work(drafter, target64, batch)
        if final is None:  # ce lays out no target rows and needs no final states
            assert layout.target_rows is None and layout.target_of is None
        out = drafter.loss(batch, feats, layout, target_hidden=final)
        out.loss.backward()
        losses[kind] = out.loss.item()
        grads[kind] = torch.cat([p.grad.reshape(-1) for p in drafter.parameters() if p.requires_grad])
    assert abs(losses["ce+kl"] - (losses["ce"] + w * losses["kl"])) < TOL
    assert torch.allclose(grads["ce+kl"], grads["ce"] + w * grads["kl"], atol=1e-7, rtol=0)  # ce: float32 logits


def test_fused_ce_kl_gradients_pass_gradcheck():
    g = torch.Generator().manual_seed(0)
    n, H, V, u = 7, 5, 11, 4
    hidden = torch.randn(n, H, dtype=torch.float64, generator=g, requires_grad=True)
    weight = torch.randn(V, H, dtype=torch.float64, generator=g)
    bias = torch.randn(V, dtype=torch.float64, generator=g)
    labels = torch.randint(0, V, (n,), generator=g)
    target_hidden = torch.randn(u, H, dtype=torch.float64, generator=g)
    target_of = torch.randint(0, u, (n,), generator=g)
    for a, b, T in ((1.0, 0.0, 1.0), (0.0, 1.0, 1.0), (1.0, 0.6, 2.0), (0.0, 1.0, 0.5)):
        def obj(h):
            return _FusedHeadCEKL.apply(h, weight, bias, labels, target_hidden, target_of, 3, a, b, T, True, 0)[0]
        assert torch.autograd.gradcheck(obj, (hidden,), eps=1e-6, atol=1e-7)


def test_ce_path_is_the_plain_fused_cross_entropy_bitwise(target64):
    """loss ce (the default) is sum(decay * ce) / weight sum through `head_cross_entropy` exactly as before: the same
    bits for the loss and every gradient, no target rows laid out, the decay weights untouched."""
    assert torch.equal(position_weights(8, 4.0, "decay"), decay_weights(8, 4.0))
    drafter = _drafter64(target64)  # loss ce, position_weight decay
    batch = collate_padded(_docs(), 0)
    layout, feats, final = _work(drafter, target64, batch)
    assert final is None and layout.target_rows is None
    out = drafter.loss(batch, feats, layout)
    out.loss.backward()
    got = [p.grad.clone() for p in drafter.parameters() if p.requires_grad]
    drafter.zero_grad()
    h = drafter.forward_hidden(batch, feats, layout).index_select(0, layout.scored)
    ce, _ = head_cross_entropy(h, target64.lm_head, layout.labels, drafter.cfg.ce_chunk_blocks * 4)
    ref = (layout.weights.float() * ce).sum() / layout.weight_sum
    ref.backward()
    assert torch.equal(out.loss, ref)
    assert all(torch.equal(a, p.grad) for a, p in zip(got, (p for p in drafter.parameters() if p.requires_grad)))


def _dpace_loops(q, scored, n, B, alpha):
    """D-PACE by loops: per block, s_k = (1 - alpha) q_k + alpha where scored (else 1), P_k = prod_{j<=k} s_j,
    weight_k = sum over scored j >= k of P_j."""
    qs = dict(zip(scored.tolist(), q.tolist()))
    w = {}
    for i in range(n):
        P, prefix = 1.0, {}
        for k in range(B):
            if i * B + k in qs:
                P *= (1 - alpha) * qs[i * B + k] + alpha
                prefix[k] = P
        for k in prefix:
            w[i * B + k] = sum(prefix[j] for j in prefix if j >= k)
    return torch.tensor([w[s] for s in scored.tolist()])


def test_dpace_weights_equal_the_loops_over_blocks_and_positions():
    g = torch.Generator().manual_seed(1)
    n, B = 9, 6
    keep = torch.rand(n, B, generator=g) < 0.7
    keep[:, 0] = False  # the anchor is never scored
    scored = torch.nonzero(keep.reshape(-1)).reshape(-1)
    q = torch.rand(scored.numel(), generator=g)
    for alpha in (0.0, 0.5, 1.0):
        got = dpace_weights(q, scored, n, B, alpha)
        assert torch.allclose(got.double(), _dpace_loops(q, scored, n, B, alpha).double(), atol=1e-6, rtol=0)
    # alpha = 1: every s_k = 1, so a position's weight is the number of scored positions at or after it
    full = dpace_weights(torch.rand(n * (B - 1), generator=g),
                         torch.tensor([i * B + k for i in range(n) for k in range(1, B)]), n, B, 1.0)
    assert full.reshape(n, B - 1)[0].tolist() == [5.0, 4.0, 3.0, 2.0, 1.0]


@pytest.mark.parametrize("kind", ["ce", "ce+kl", "kl"])
def test_dpace_loss_is_the_detached_dpace_weighted_objective(target64, kind):
    """Whatever the loss, the D-PACE weights come from the drafter's probability of the LABEL, exp(-ce), and weight
    the position's objective (ce, ce + w T^2 KL or T^2 KL; KL by brute force over full logits)."""
    w_kl, T = 0.37, 1.7
    drafter = _drafter64(target64, position_weight="dpace", dpace_alpha=0.3, loss=kind, kl_weight=w_kl,
                         kl_temperature=T)
    batch = collate_padded(_docs(), 0)
    layout, feats, final = _work(drafter, target64, batch)
    assert torch.all(layout.weights == 1.0)  # the static weights are the mask only: no decay
    out = drafter.loss(batch, feats, layout, target_hidden=final)
    z = drafter.block_logits(batch, feats, layout).reshape(-1, VOCAB)[layout.scored]  # (m, V)
    ce = F.cross_entropy(z, layout.labels, reduction="none")
    w = _dpace_loops(torch.exp(-ce.detach()), layout.scored, layout.num_blocks, layout.block_size, 0.3)
    objective = {"ce": lambda: ce, "ce+kl": lambda: ce + w_kl * T * T * _brute_kl(drafter, target64, batch, feats,
                                                                                   layout, T),
                 "kl": lambda: T * T * _brute_kl(drafter, target64, batch, feats, layout, T)}[kind]()
    expected = (w.double() * objective).sum() / layout.weight_sum
    assert abs(out.loss.item() - expected) < TOL
    assert out.acc == pytest.approx(float(out.correct_total) / layout.num_scored)  # accuracy is unweighted here


def test_loss_kl_without_target_states_is_refused(target64):
    drafter = _drafter64(target64, loss="kl")
    batch = collate_padded(_docs(), 0)
    layout, feats, _ = _work(drafter, target64, batch)
    with pytest.raises(ValueError, match="needs the target's final hidden states"):
        drafter.loss(batch, feats, layout)


def test_bad_loss_settings_name_the_parameter():
    from dflash_lib.config import ConfigError, from_params

    for key, value in (("loss", "mse"), ("position_weight", "linear"), ("kl_temperature", 0),
                       ("dpace_alpha", 1.5), ("kl_weight", -1)):
        with pytest.raises(ConfigError, match=key):
            from_params({key: value})


def test_dry_run_counts_the_kl_work():
    """`dryrun -p loss kl` runs the target's remaining layers, keeps the (u, H) final states and computes the target's
    logits in the fused loss. FLOPs, exactly: the target forward runs all 4 layers instead of the 2 up to the
    deepest feature layer (x 2), the head per scored position 2HV (drafter logits) + 2HV (target logits) + 2HV
    (gradient) + 4V (the two row dots of the KL) against 4HV. Peak, derived (LOG.md 2026-12-02): at the loss chunk
    the KL loop holds three float32 (c, V) buffers (z, log p, p) where the CE loop holds 2.5 (the previous chunk's
    logits, the new ones in bf16 and in float32), so + 2cV bytes, plus the bf16 (u, H) target states, the int64
    target rows and rows-of-scored indices, and (m,)-sized float vectors (at most 16 bytes per scored position)."""
    from dflash_lib.config import from_params
    from dflash_lib.models.layout import build_layout
    from dflash_lib import dryrun

    V, H = 8000, 64
    hf = tiny_qwen3_config(hidden_size=H, num_layers=4, vocab_size=V)
    figures = {}
    for loss in ("ce", "kl"):
        cfg = from_params(dict(hidden_size=H, target_layers=4, num_features=2, drafter_layers=2, block_size=4,
                               num_anchors=8, token_budget=256, max_len=128, mask_id=V - 1, ce_chunk_blocks=2,
                               loss=loss))
        worst = dryrun.worst_bucket_batch(0, 0, 64, cfg, block_budget=80)
        models = dryrun.build_step_models(cfg, hf, dryrun.StepSettings("blocks", False), fake=True)
        batch = dryrun.host_batch(worst, V, cfg.model.mask_id)
        figures[loss] = dryrun.measure_step(models, batch, seed=0)
    layout = build_layout(batch, models.drafter.sample_anchors(batch, torch.Generator().manual_seed(0)), "blocks",
                          target_rows=True)
    m, u, c = layout.num_scored, layout.target_rows.numel(), 2 * 4
    ce, kl = figures["ce"], figures["kl"]
    assert kl.flops["target_forward"] == 2 * ce.flops["target_forward"]
    assert ce.flops["head_ce"] == 4 * H * V * m and kl.flops["head_ce"] == (6 * H + 4) * V * m
    assert kl.flops["drafter_layers"] == ce.flops["drafter_layers"]
    derived = 2 * c * V + 2 * u * H + 8 * (u + m)
    assert derived <= kl.peak_bytes - ce.peak_bytes <= derived + 16 * m


@pytest.mark.slow
@pytest.mark.parametrize("settings", [dict(loss="kl"), dict(position_weight="dpace")])
def test_training_with_kl_or_dpace_learns(settings):
    """150 steps on the target's own greedy continuations (as the ce decoding tests train): the loss falls and
    the acceptance length of real speculative decoding rises well above the untrained drafter's (measured 1.0 ->
    3.3 with loss kl, 4.0 with dpace, of at most B = 4: LOG.md 2026-12-02)."""
    import dataclasses

    from dflash_lib.evaluate.acceptance import acceptance_length
    from tiny_models import decode_drafter, decode_target, overfit_on_greedy, random_prompts

    B, NEW = 4, 20
    target = decode_target(256)
    prompts = random_prompts(6, seed=1)
    untrained = acceptance_length(target, decode_drafter(target, B), prompts, NEW).tau
    drafter = decode_drafter(target, B)
    drafter.cfg = dataclasses.replace(drafter.cfg, **settings)
    losses: list[float] = []
    with subnormals_flushed(torch.device("cpu"), drafter.cfg.loss):  # what the trainer does (models.loss)
        overfit_on_greedy(target, drafter, prompts, NEW + B, steps=150, losses=losses)
    assert np.mean(losses[-10:]) < (0.1 if "loss" in settings else 0.9) * np.mean(losses[:10])
    tau = acceptance_length(target, drafter, prompts, NEW).tau
    assert untrained < 1.5 and tau > untrained + 1.5


def test_export_records_the_loss_settings_and_reads_them_back(target64, tmp_path):
    from dflash_lib.models.drafters.dflash import serving_config
    from dflash_lib.models.export import export_drafter, read_drafter

    drafter = _drafter64(target64, loss="ce+kl", kl_weight=0.25, kl_temperature=2.0, position_weight="dpace",
                         dpace_alpha=0.1)
    training = serving_config(drafter.cfg, torch.float32, 128)["dflash_config"]["training"]
    assert {k: training[k] for k in ("loss", "kl_weight", "kl_temperature", "position_weight", "dpace_alpha")} == dict(
        loss="ce+kl", kl_weight=0.25, kl_temperature=2.0, position_weight="dpace", dpace_alpha=0.1)
    back = read_drafter(export_drafter(drafter, tmp_path / "drafter", torch.float32), target64).cfg
    assert (back.loss, back.kl_weight, back.position_weight) == ("ce+kl", 0.25, "dpace")


def test_the_target_worker_hands_the_final_states_only_when_the_loss_needs_them(target64):
    from dflash_lib.train.feed import Collated, Work, make_target_workers

    batch = collate_padded(_docs(), 0)
    worker = make_target_workers([target64], 1, torch.device("cpu"))[0]
    for kind in ("ce", "kl"):
        drafter = _drafter64(target64, loss=kind)
        layout, feats, final = _work(drafter, target64, batch)
        item = worker(Collated(Work(0, 0, 0, True, [0, 1, 2]), batch, (), layout))
        assert torch.equal(item.features, feats)
        if kind == "ce":
            assert item.target_hidden is None and final is None
        else:
            assert torch.equal(item.target_hidden, final)
            assert any(t is item.target_hidden for t in item.device_tensors())  # the CUDA stream hand-over


def test_a_ddp_step_with_loss_kl_equals_one_process_and_its_filler_is_zero(tmp_path, monkeypatch):
    """train_step hands each item's (u, H) states to the wrapper: DDP over 2 micro-batches (1-rank gloo group) moves
    the drafter as one process holding both; the idle rank's filler lays out target rows too, and its loss and
    gradient are exactly zero."""
    import torch.distributed as dist

    from dflash_lib.train import distributed as D
    from dflash_lib.train.feed import Item
    from dflash_lib.train.state import BadStepGuard
    from dflash_lib.train.step import filler_item, train_step
    from tiny_models import decode_drafter, decode_target

    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    D.destroy()
    target = decode_target()
    docs = _docs((14, 21, 17, 12), seed=4)
    docs = [(t % 255, m) for t, m in docs]  # ids below the decoding target's MASK (255)

    def update(kind, split):
        drafter = decode_drafter(target, 4)
        drafter.cfg.loss, drafter.cfg.kl_temperature = "ce+kl", 1.5
        params = [p for p in drafter.parameters() if p.requires_grad]
        before = [p.detach().clone() for p in params]
        gen, items, lo = torch.Generator().manual_seed(3), [], 0
        for hi in split:
            batch = collate_padded(docs[lo:hi], 0, list(range(lo, hi)))
            layout = drafter.layout(batch, drafter.sample_anchors(batch, gen))
            feats, final = target.context_features_and_final(batch, layout.target_rows)
            items.append(Item(0, batch, batch, feats, layout=layout, device_layout=layout, target_hidden=final))
            lo = hi
        parallel = D.DrafterParallel(drafter, kind, 1, torch.device("cpu"))
        res = train_step(parallel, items, params, torch.optim.SGD(params, lr=1.0), lr=1.0, grad_clip=0.0,
                         autocast=False, guard=BadStepGuard(3), step=1)
        return torch.cat([(p.detach() - b).flatten() for p, b in zip(params, before)]), res, drafter

    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        want, one, drafter = update("single", [4])
        got, res, _ = update("ddp", [2, 4])
    finally:
        dist.destroy_process_group()
        D.destroy()
    assert want.abs().max() > 0 and one.loss > 0
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-7)
    assert res.loss == pytest.approx(one.loss, rel=1e-5)
    filler = filler_item(drafter, torch.device("cpu"))
    assert filler.layout.target_rows is not None and filler.target_hidden is not None
    drafter.zero_grad(set_to_none=True)
    out = drafter.loss(filler.device_batch, filler.features, filler.device_layout, 7.0, filler.target_hidden)
    out.loss.backward()
    assert out.loss.item() == 0.0 and all(not p.grad.any() for p in drafter.parameters() if p.requires_grad)


def test_subnormals_are_flushed_on_the_cpu_only_for_a_kl_loss():
    tiny = torch.tensor([1e-39], dtype=torch.float32)  # subnormal in float32 (the smallest normal is ~1.18e-38)
    cpu = torch.device("cpu")
    if not torch.set_flush_denormal(False):  # this CPU cannot flush: the context must then leave values as they are
        with subnormals_flushed(cpu, "kl"):
            assert float(tiny * 1.0) > 0
        return
    with subnormals_flushed(cpu, "ce"):
        assert float(tiny * 1.0) > 0  # ce: untouched
    for loss in ("kl", "ce+kl"):
        with subnormals_flushed(cpu, loss):
            assert float(tiny * 1.0) == 0.0
        assert float(tiny * 1.0) > 0  # restored
    with subnormals_flushed(torch.device("meta"), "kl"):
        assert float(tiny * 1.0) > 0  # not the CPU: nothing changes
