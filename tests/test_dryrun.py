"""The dry run: a fake-mode step equals a real one (FLOPs exactly, memory within a stated tolerance), worst-case batches
honour both budgets, FlexAttention's tile count, the command line's JSON and exit codes, the qwen3-8b preset."""

from __future__ import annotations

import json
from dataclasses import fields

import numpy as np
import pytest
import torch

from dflash_lib.config import from_params, preset
from dflash_lib.models.target_config import tiny_qwen3_config
from dflash_lib import dryrun

VOCAB = 1000
PEAK_TOLERANCE = 0.01  # fake vs real peak: the same ops allocate the same bytes; 1 % leaves room for kernel outputs
# whose fake metadata rounds differently (measured: 32 bytes apart at these shapes)


def _tiny(**params):
    base = dict(hidden_size=64, target_layers=4, num_features=2, drafter_layers=2, block_size=4, num_anchors=8,
                token_budget=256, max_len=128, mask_id=VOCAB - 1)
    return from_params({**base, **params})


@pytest.mark.slow
@pytest.mark.parametrize("attention,checkpointing", [("dense", False), ("blocks", True), ("blocks", False)])
def test_fake_step_matches_a_real_step(attention, checkpointing):
    cfg = _tiny()
    hf = tiny_qwen3_config(hidden_size=64, num_layers=4, vocab_size=VOCAB)
    settings = dryrun.StepSettings(attention, checkpointing)
    worst = dryrun.worst_bucket_batch(0, 0, 64, cfg, block_budget=80)
    assert worst.docs == 4 and worst.anchors == (8, 8, 4, 0)  # 256 // 64 documents; 80 / 4 = 20 anchors in all
    figures = {}
    for fake in (False, True):
        models = dryrun.build_step_models(cfg, hf, settings, fake)
        batch = dryrun.host_batch(worst, VOCAB, cfg.model.mask_id)
        figures[fake] = dryrun.measure_step(models, batch, seed=0)
    real, fake = figures[False], figures[True]
    assert fake.flops == real.flops and real.flops_total > 0
    assert all(v > 0 for v in real.flops.values())
    assert abs(fake.peak_bytes - real.peak_bytes) <= PEAK_TOLERANCE * real.peak_bytes
    for name in ("parameters", "optimizer", "activations"):
        assert fake.memory[name] == pytest.approx(real.memory[name], rel=PEAK_TOLERANCE), name
    # the figures are what the shapes say: fp32 drafter + AdamW state (2 moments); bf16 target weights
    drafter = sum(p.numel() for p in models.params)
    target = sum(p.numel() for p in models.target.parameters())
    assert real.memory["parameters"] == 4 * drafter + 2 * target
    assert real.memory["optimizer"] >= 8 * drafter
    # the LM head + CE: logits and their gradient, 2 x 2 x H x V per scored position of the layout
    from dflash_lib.models.layout import build_layout

    batch = dryrun.host_batch(worst, VOCAB, cfg.model.mask_id)
    layout = build_layout(batch, models.drafter.sample_anchors(batch, torch.Generator().manual_seed(0)), attention)
    assert real.flops["head_ce"] == 4 * 64 * VOCAB * layout.num_scored
    if attention == "dense":  # the mask-blind kernel: every query against every key, per head
        pairs = real.attention_pairs["computed"]
        assert pairs == worst.drafter_queries * (worst.target_tokens + worst.drafter_queries)
        assert real.kernel_allowance > 0


@pytest.mark.slow
def test_a_muon_dry_run_holds_the_trainers_optimizer_state():
    """`-p optimizer muon`: the dry run builds the trainer's optimizers (train.step.build_optimizer), so its
    optimizer memory is Muon's one momentum per matrix plus AdamW's two moments per norm weight, fake = real."""
    cfg = _tiny(optimizer="muon")
    hf = tiny_qwen3_config(hidden_size=64, num_layers=4, vocab_size=VOCAB)
    worst = dryrun.worst_bucket_batch(0, 0, 64, cfg, block_budget=80)
    figures = {}
    for fake in (False, True):
        models = dryrun.build_step_models(cfg, hf, dryrun.StepSettings("dense", False), fake)
        assert [type(o).__name__ for o in models.optimizer] == ["Muon", "AdamW"]
        figures[fake] = dryrun.measure_step(models, dryrun.host_batch(worst, VOCAB, cfg.model.mask_id), seed=0)
    matrices = sum(p.numel() for p in models.params if p.ndim == 2)
    norms = sum(p.numel() for p in models.params if p.ndim != 2)
    assert figures[True].memory["optimizer"] == pytest.approx(figures[False].memory["optimizer"], rel=PEAK_TOLERANCE)
    assert figures[False].memory["optimizer"] >= 4 * matrices + 8 * norms
    assert figures[False].memory["optimizer"] < 8 * (matrices + norms)  # less than AdamW's two moments of all


def _packed_flex_layout():
    """The flex layout of a worst packed row of a tiny config (blocks of 8, 40 anchors a document)."""
    from dflash_lib.models.layout import build_layout

    cfg = _tiny(num_anchors=40, block_size=8, token_budget=900, max_len=300)
    batch = dryrun.host_batch(dryrun.worst_packed_batch(cfg, block_budget=None), VOCAB, cfg.model.mask_id)
    models = dryrun.build_step_models(cfg, tiny_qwen3_config(hidden_size=64, num_layers=4, vocab_size=VOCAB),
                                      dryrun.StepSettings("flex", True), fake=True)
    return build_layout(batch, models.drafter.sample_anchors(batch, torch.Generator().manual_seed(0)), "flex")


def _mask_tiles(mask: torch.Tensor) -> int:
    """Brute force: the FLEX_TILE x FLEX_TILE tiles of a (Q, K) bool mask holding at least one True."""
    Q, K = mask.shape
    t = dryrun.FLEX_TILE
    padded = torch.zeros(-(-Q // t) * t, -(-K // t) * t, dtype=torch.bool)
    padded[:Q, :K] = mask
    return int(padded.reshape(Q // t + (Q % t > 0), t, -1, t).any(dim=(1, 3)).sum())


def test_flex_tiles_equal_the_tiles_of_the_dense_mask():
    from dflash_lib.models.attention import dense_mask

    layout = _packed_flex_layout()
    want = _mask_tiles(dense_mask(layout))  # (Q, C + Q)
    assert dryrun.flex_tiles(layout) == want > 0


@pytest.mark.parametrize("window, causal", [(1, True), (3, True), (40, True), (3, False), (1, False), (0, True)])
def test_a_sliding_layers_flex_tiles_equal_the_tiles_of_its_windowed_mask(window, causal):
    """The tiles a sliding or causal layer's block mask keeps: those of the dense mask AND its position rule (brute
    force over every query and key); fewer than the full layer's for a narrow causal window, as many once the window
    covers every document."""
    from dflash_lib.models.attention import dense_mask, position_mask

    layout = _packed_flex_layout()
    q_pos = layout.block_pos.reshape(-1)
    want = _mask_tiles(dense_mask(layout) & position_mask(q_pos, torch.cat([layout.ctx_pos, q_pos]), window, causal))
    assert dryrun.flex_tiles(layout, window=window, causal=causal) == want > 0
    assert want < dryrun.flex_tiles(layout) if causal and 0 < window < 40 else want <= dryrun.flex_tiles(layout)
    assert dryrun.flex_tiles(layout, window=10_000, causal=causal) == dryrun.flex_tiles(layout, causal=causal)


def test_a_sliding_drafters_flex_flops_count_each_layer_kinds_tiles():
    """One sliding (window 3) and one full drafter layer on the flex path: the attention FLOPs are the full
    layer's tiles plus the sliding layer's, each 4 x heads x head_dim per pair forward and 2.5 times that backward."""
    from dflash_lib.models.layout import build_layout

    cfg = _tiny(target_layers=2, num_features=1, drafter_layers=2, token_budget=512, max_len=256,
                drafter_layer_types=["sliding_attention", "full_attention"], drafter_window=3)
    models = dryrun.build_step_models(cfg, tiny_qwen3_config(hidden_size=64, num_layers=2, vocab_size=VOCAB),
                                      dryrun.StepSettings("flex", False), fake=True)
    batch = dryrun.host_batch(dryrun.worst_bucket_batch(0, 0, 256, cfg, block_budget=200), VOCAB, cfg.model.mask_id)
    fig = dryrun.measure_step(models, batch, seed=0)
    layout = build_layout(batch, models.drafter.sample_anchors(batch, torch.Generator().manual_seed(0)), "flex")
    full, sliding = (dryrun.flex_tiles(layout, window=w) * dryrun.FLEX_TILE ** 2 for w in (0, 3))
    assert 0 < sliding < full
    c = models.drafter.cfg
    assert fig.flops["drafter_attention"] == 4 * c.num_heads * c.head_dim * (full + sliding) * (1 + 2.5)


def test_flex_attention_flops_are_those_of_the_kept_tiles():
    """The flex stand-in's FLOPs: per layer, 4 x heads x head_dim per (query, key) pair of the 128 x 128 tiles the
    block mask keeps (2 matmuls) in the forward, 2.5 times that in the backward (5 matmuls)."""
    from dflash_lib.models.layout import build_layout

    cfg = _tiny(target_layers=2, num_features=1, drafter_layers=1)  # few ops: fake dispatch dominates the time
    models = dryrun.build_step_models(cfg, tiny_qwen3_config(hidden_size=64, num_layers=2, vocab_size=VOCAB),
                                      dryrun.StepSettings("flex", False), fake=True)
    batch = dryrun.host_batch(dryrun.worst_bucket_batch(0, 0, 64, cfg, block_budget=80), VOCAB, cfg.model.mask_id)
    fig = dryrun.measure_step(models, batch, seed=0)
    layout = build_layout(batch, models.drafter.sample_anchors(batch, torch.Generator().manual_seed(0)), "flex")
    pairs = dryrun.flex_tiles(layout) * dryrun.FLEX_TILE ** 2
    assert pairs > 0 and fig.attention_pairs["computed"] == pairs
    c = models.drafter.cfg
    per_layer = 4 * c.num_heads * c.head_dim * pairs * (1 + 2.5)  # forward + backward
    assert fig.flops["drafter_attention"] == per_layer  # 1 drafter layer, no recomputation
    assert fig.kernel_allowance == 0


def test_a_fake_step_runs_the_target_on_the_real_tokens_of_a_padded_batch():
    """The dry run hands the target its gather plan as fake tensors and the drafter the real tokens as its context:
    a padded batch's FLOPs (target, drafter layers, attention, head) are those of its documents in one row without
    padding."""
    from dflash_lib.data.batch import collate_packed, collate_padded

    cfg = _tiny(target_layers=2, num_features=1, drafter_layers=1)
    hf = tiny_qwen3_config(hidden_size=64, num_layers=2, vocab_size=VOCAB)
    rng = np.random.default_rng(0)
    docs = [(rng.integers(0, VOCAB - 1, n), np.arange(n) >= 2) for n in (60, 20, 33)]
    padded, unpadded = collate_padded(docs, 0), collate_packed(docs, 0, row_len=113)
    settings = dryrun.StepSettings("blocks", False)
    fake = dryrun.build_step_models(cfg, hf, settings, fake=True)
    figures = {name: dryrun.measure_step(fake, b) for name, b in (("padded", padded), ("unpadded", unpadded))}
    assert figures["padded"].flops["target_forward"] == figures["unpadded"].flops["target_forward"] > 0
    assert figures["padded"].flops == figures["unpadded"].flops
    # no padded feature tensor either: the step's activations are those of the documents alone
    assert figures["padded"].memory["activations"] == figures["unpadded"].memory["activations"] > 0


def test_required_memory_is_peak_with_fragmentation_plus_kernel_allowance_plus_reserve():
    """required = peak x (1 + fragmentation) + kernel_allowance + reserve_gib, the figure a batch's fit is judged
    by; the dense kernel's allowance is one (Q, K) bf16 mask, K padded to a multiple of 16."""
    GIB = dryrun.GIB
    assert dryrun.Reserve(reserve_gib=2.0, fragmentation=0.25).required_bytes(4 * GIB, GIB) == 8 * GIB
    assert dryrun.Reserve().required_bytes(10 * GIB, 0.5 * GIB) == pytest.approx(13.0 * GIB, rel=1e-12)

    cfg = _tiny(target_layers=2, num_features=1, drafter_layers=1)
    worst = dryrun.worst_bucket_batch(0, 0, 64, cfg, block_budget=80)
    (r,) = dryrun.measure_batches(cfg, [worst], dryrun.StepSettings("dense", False), device_gib=80.0)
    Q, C = worst.drafter_queries, worst.target_tokens  # 80 block queries; 4 x 64 context slots
    allowance = r.figures.kernel_allowance
    assert allowance == Q * (-(-(C + Q) // 16) * 16) * 2 > 0
    assert r.required_bytes == pytest.approx(r.figures.peak_bytes * 1.1 + allowance + 1.5 * GIB, rel=1e-12)
    assert r.fits and r.record().required_gib == round(r.required_bytes / GIB, 3)


def test_worst_batches_honour_token_and_block_budgets():
    cfg = _tiny(num_anchors=16, block_size=4, token_budget=1000, max_len=200)
    worst = dryrun.worst_batches(cfg, [50, 120, 200], block_budget=150)
    assert [w.docs for w in worst[:3]] == [20, 8, 5]  # token_budget // edge
    assert [w.anchors[:3] for w in worst[:3]] == [(16, 16, 5), (16, 16, 5), (16, 16, 5)]  # 150 // 4 = 37 anchors
    assert all(w.drafter_queries == 148 and w.target_tokens <= 1000 for w in worst)
    packed = worst[-1]
    assert packed.row_len == 1000 and sum(packed.lengths) == 1000 and packed.bucket == -1
    assert packed.anchors[:3] == (16, 16, 5) and max(packed.lengths) <= 200
    # the host batch really has those anchors: every valid position is drawn
    models = dryrun.build_step_models(cfg, tiny_qwen3_config(hidden_size=64, num_layers=4, vocab_size=VOCAB),
                                      dryrun.StepSettings("blocks", True), fake=True)
    for w in (worst[1], packed):
        batch = dryrun.host_batch(w, VOCAB, cfg.model.mask_id)
        anchors = models.drafter.sample_anchors(batch, torch.Generator().manual_seed(1))
        per_doc = np.bincount(anchors.doc[anchors.valid].numpy(), minlength=w.docs)
        assert tuple(per_doc) == w.anchors and batch.padded_tokens == w.target_tokens


def _cli(capsys, *args):
    from dflash_lib.__main__ import main

    code = main(["dryrun", *args])
    out = capsys.readouterr().out.strip().splitlines()
    return code, out, json.loads(out[-1])


@pytest.mark.slow
def test_cli_prints_the_table_and_one_json_line_last(capsys):
    code, out, report = _cli(capsys, "--preset", "smoke", "-p", "drafter_attention", "blocks")
    assert code == 0 and report["fits"] is True and report["device_gib"] == 80
    assert any(line.lstrip().startswith("bucket 0") for line in out[:-1])
    edges = report["edges"]
    assert len(report["buckets"]) == len(edges) == 4 and edges[-1] == 512
    keys = {"bucket", "edge", "docs", "target_tokens", "drafter_queries", "peak_gib", "tflops"}
    for i, b in enumerate(report["buckets"]):
        assert keys <= set(b) and b["bucket"] == i and b["edge"] == edges[i]
        assert b["docs"] == 2048 // b["edge"] and b["peak_gib"] > 0 and b["tflops"] > 0
        assert b["drafter_queries"] <= report["block_budget"]
    assert keys <= set(report["packed"]) and report["packed"]["target_tokens"] == 2048
    assert report["attention"] == "blocks" and report["checkpointing"] == 1  # smoke: 1 drafter layer, all on CUDA
    assert report["eta"]["corpus_samples"] > 0 and report["eta"]["seconds"]["bucketed"] > 0
    # the line holds exactly the report's fields (`compare` only with --compare), each batch a BatchRecord's
    assert set(report) == {f.name for f in fields(dryrun.DryRunReport)} - {"compare"}
    assert all(set(b) == {f.name for f in fields(dryrun.BatchRecord)} for b in [*report["buckets"], report["packed"]])
    assert dryrun.DryRunReport.from_json(report).to_json() == report


def _made_up_report(attention: str) -> dryrun.DryRunReport:
    """A dry-run report of made-up figures: what `run_cli` prints of one is under test, not a measurement."""
    batch = dryrun.BatchRecord(0, 0, 64, 4, 256, 250, 80, 0.5, 2.1, True, 0.01,
                               {"target_forward": 0.004, "drafter_layers": 0.005, "drafter_attention": 0.0005,
                                "head_ce": 0.0005}, {"parameters": 0.1}, 0.0, 0.1, 2.5)
    eta = dryrun.DryRunEta(300, "given", 1.0, {"bucketed": [3], "packed": 2}, {"bucketed": 60.0, "packed": 50.0},
                           {"bucketed": 0.0, "packed": 0.0}, dryrun.PAPER_SAMPLES, {"bucketed": 1.0, "packed": 0.9})
    assumptions = dryrun.DryRunAssumptions("H200", 989.0, 0.4, 1.5, 0.1, "fake", "upper bound")
    return dryrun.DryRunReport(80.0, True, attention, True, "tiny", 4, 64, 2, 4, 8, 128, 256, 80, [64], [batch], batch,
                               assumptions, eta, 0.5)


def test_cli_json_line_holds_compare_only_when_asked(capsys, monkeypatch):
    """`--compare`: the report gains `compare`, one BackendComparison per other backend; without it the key is
    absent (not null)."""
    def fake_dry_run(config, device_gib, mfu, corpus_samples, attention=None, *args, **kwargs):
        return _made_up_report(attention or "flex")

    from dflash_lib.dryrun import report as report_module

    monkeypatch.setattr(report_module, "dry_run", fake_dry_run)  # where the command line looks it up
    code, _, plain = _cli(capsys, "--preset", "smoke")
    assert code == 0 and "compare" not in plain and plain == _made_up_report("flex").to_json()
    code, _, report = _cli(capsys, "--preset", "smoke", "--compare")
    assert code == 0 and list(report) == [*plain, "compare"] and list(report["compare"]) == ["dense", "blocks"]
    assert all(set(c) == {f.name for f in fields(dryrun.BackendComparison)} for c in report["compare"].values())
    back = dryrun.DryRunReport.from_json(report)
    assert isinstance(back.compare["dense"], dryrun.BackendComparison) and back.to_json() == report


@pytest.mark.slow
def test_cli_exits_1_when_a_batch_does_not_fit(capsys):
    code, _, report = _cli(capsys, "--preset", "smoke", "-p", "drafter_attention", "dense", "--device-gib", "1")
    assert code == 1 and report["fits"] is False
    assert all(not b["fits"] and b["required_gib"] > 1 for b in report["buckets"])  # the 1.5 GiB reserve alone


def test_qwen3_8b_preset_is_the_paper_recipe():
    cfg = preset("qwen3-8b")
    m, t = cfg.model, cfg.train
    assert (m.drafter_layers, m.block_size, m.num_anchors, m.num_features, m.mask_id) == (5, 16, 512, 5, 151669)
    assert m.target_layer_ids == [1, 9, 17, 25, 33] and cfg.data.max_len == 3072
    assert (t.lr, t.warmup_ratio, t.grad_clip, t.epochs) == (6e-4, 0.04, 1.0, 6.0)
    assert (m.drafter_attention, m.drafter_checkpointing) == ("auto", "auto")
    assert dryrun.for_cuda(cfg) == dryrun.StepSettings("flex", 5)  # every drafter layer checkpointed on CUDA


@pytest.mark.parametrize("name,layers,hidden,billions", [("qwen3-8b", 36, 4096, 8.19), ("qwen3-32b", 64, 5120, 32.76),
                                                          ("qwen3-30b-a3b", 48, 2048, 30.53),
                                                          ("qwen3-235b-a22b", 94, 4096, 235.09),
                                                          # the text models (the vision tower and MTP layer aside)
                                                          ("qwen3.5-9b", 32, 4096, 8.954), ("qwen3.6-27b", 64, 5120, 26.896),
                                                          ("qwen3.5-35b-a3b", 40, 2048, 34.661),
                                                          ("qwen3.5-122b-a10b", 48, 3072, 122.112)])
def test_larger_presets_are_the_paper_recipe_on_the_published_shapes(name, layers, hidden, billions):
    """Each preset: qwen3-8b's recipe, the target's own five feature layers by the layer-id rule, and published
    shapes whose parameter count is the model card's (built on the meta device; Qwen3.5 / 3.6: the size in the
    name, their cards giving no exact count)."""
    import transformers

    from dflash_lib.models.shapes import NAMED_SHAPES
    from dflash_lib.models.target_config import feature_layer_ids, target_hf_config

    cfg, paper = preset(name), preset("qwen3-8b")
    hf = target_hf_config(cfg.model)
    assert (hf.num_hidden_layers, hf.hidden_size) == (layers, hidden) and cfg.model.target == name
    assert cfg.model.target_layer_ids == feature_layer_ids(layers, 5)
    same = lambda c: (c.model.drafter_layers, c.model.block_size, c.model.num_anchors, c.data.max_len,  # noqa: E731
                      c.sampler.token_budget, c.train.lr, c.train.epochs)
    assert same(cfg) == same(paper)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(NAMED_SHAPES[name]())
    assert sum(p.numel() for p in model.parameters()) / 1e9 == pytest.approx(billions, abs=0.01)


@pytest.mark.slow
def test_qwen3_8b_shapes_reduced_depth(capsys):
    """The real Qwen3-8B widths, the target cut at layer 5 and a 2-layer drafter, two buckets: fast enough to run
    every time; the figures follow from the shapes."""
    code, _, report = _cli(capsys, "--preset", "qwen3-8b", "-p", "target_layer_ids", "[1, 2, 3, 4, 5]",
                           "-p", "drafter_layers", "2", "-p", "k", "2")
    assert code == 0 and report["fits"] and report["hidden_size"] == 4096 and report["target_layers"] == 36
    assert report["block_budget"] == 5 * 512 * 16
    for b in [*report["buckets"], report["packed"]]:
        assert b["drafter_queries"] == 40960
        m = b["memory_gib"]
        # bf16 Qwen3-8B (8.19 B parameters) + fp32 drafter (2 layers: 2 x 193 M + fc 84 M + norms)
        assert m["parameters"] == pytest.approx((2 * 8.19e9 + 4 * 0.47e9) / 2**30, rel=0.02)
        assert m["optimizer"] == pytest.approx(8 * 0.47e9 / 2**30, rel=0.02)
        scored = 5 * (512 * 15 - sum(range(15)))  # anchors at the end: the last 15 blocks reach past the document
        assert b["tflops_split"]["head_ce"] == pytest.approx(4 * 4096 * 151936 * scored / 1e12, rel=1e-4)


@pytest.mark.slow
def test_qwen3_8b_dry_run_fits_80_gib(capsys):
    """The whole paper configuration (about 40 s on 2 cores): every bucket fits 80 GiB on the flex path."""
    code, _, report = _cli(capsys, "--preset", "qwen3-8b")
    assert code == 0 and report["fits"] and report["attention"] == "flex"
    assert len(report["buckets"]) == 6 and all(b["required_gib"] <= 80 for b in report["buckets"])


@pytest.mark.slow
def test_measure_plan_gives_every_bucket_its_measured_peak():
    """Notebook 02's check: every bucket of a plan gets the peak of its worst batch, measured in fake mode."""
    from dflash_lib.plan.buckets import optimal_boundaries

    cfg = _tiny(token_budget=1024, max_len=256, num_anchors=16, block_size=4)
    lengths = np.random.default_rng(0).integers(20, 257, 500)
    plan = optimal_boundaries(lengths, 3, max_len=256, token_budget=1024)
    records = dryrun.measure_plan(plan, cfg)
    assert [r.bucket for r in records] == [0, 1, 2] and [r.edge for r in records] == list(plan.edges)
    assert [r.docs for r in records] == [1024 // e for e in plan.edges]
    block_budget = 1024 // 256 * 16 * 4  # derived: 4 rows of max_len x 16 anchors x block 4
    assert all(0 < r.drafter_queries <= block_budget for r in records)
    params_gib = (2 * 151936 * 64 * 2) / 2**30  # at least the bf16 embedding and LM head of the tiny target
    assert all(r.peak_gib > params_gib and r.fits for r in records)


def _hybrid_config():
    """A tiny Qwen3.5 text config: gated-delta-net layers (4 key heads grouped under 8 value heads) between full
    attention layers."""
    import transformers

    return transformers.Qwen3_5TextConfig(
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, intermediate_size=128, layer_types=["linear_attention", "full_attention"] * 2,
        linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=16, linear_value_head_dim=8)


def test_the_chunk_rule_flops_are_the_reference_rules_matmuls_plus_its_triangular_solves():
    """`chunk_rule_flops` against transformers' own torch rule counted by FlopCounterMode (its matmuls: Q K^T and
    K K^T per chunk, the state read, update and output), plus what its triangular solves do uncounted: the inverse
    (c^3 / 3 multiply-adds) and its products with the keys and values (w, u)."""
    from torch.utils.flop_counter import FlopCounterMode
    from transformers.models.qwen3_5 import modeling_qwen3_5
    from dflash_lib.models.linear_attention import CHUNK, chunk_rule_flops

    rule = getattr(modeling_qwen3_5.torch_chunk_gated_delta_rule, "dflash_original",
                   modeling_qwen3_5.torch_chunk_gated_delta_rule)
    n, heads, dk, dv = 3 * CHUNK, 2, 16, 8
    q, k, v = torch.randn(1, n, heads, dk), torch.randn(1, n, heads, dk), torch.randn(1, n, heads, dv)
    g, beta = -torch.rand(1, n, heads), torch.rand(1, n, heads)
    with FlopCounterMode(display=False) as counter:
        rule(q, k, v, g=g, beta=beta, use_qk_l2norm_in_kernel=True)
    c = CHUNK
    solves = 2 * c * c * dk + 2 * c * c * dv + 2 * c ** 3 // 3
    assert chunk_rule_flops(dk, dv) == counter.get_total_flops() // (3 * heads) + solves


def test_a_hybrid_targets_linear_layers_are_priced_as_their_cuda_kernel_runs(monkeypatch):
    """A Qwen3.5-shaped target in the dry run: every linear-attention layer it runs costs one call of the
    flash-linear-attention stand-in over all documents (their chunks, each document's last one whole, x value heads
    x `chunk_rule_flops`), and a padded batch costs what its documents cost in one row without padding."""
    from dflash_lib.data.batch import collate_packed, collate_padded
    from dflash_lib.models import linear_attention

    cfg = _tiny(target_layers=4, num_features=2, drafter_layers=1)
    hf = _hybrid_config()
    rng = np.random.default_rng(0)
    docs = [(rng.integers(0, VOCAB - 1, n), np.arange(n) >= 2) for n in (60, 20, 70)]
    padded, unpadded = collate_padded(docs, 0), collate_packed(docs, 0, row_len=150)
    models = dryrun.build_step_models(cfg, hf, dryrun.StepSettings("blocks", False), fake=True)
    figures = {name: dryrun.measure_step(models, b) for name, b in (("padded", padded), ("unpadded", unpadded))}
    assert figures["padded"].flops == figures["unpadded"].flops
    assert figures["padded"].memory["activations"] == figures["unpadded"].memory["activations"] > 0
    monkeypatch.setattr(linear_attention, "chunk_rule_flops", lambda dk, dv: 0)
    without = dryrun.measure_step(models, padded).flops["target_forward"]
    kinds = models.target.layer_kinds[:max(models.target.layer_ids) + 1]
    chunks = 1 + 1 + 2  # 60, 20 and 70 tokens in chunks of 64
    per_layer = chunks * 8 * (2 * 64 * 64 * (3 * 16 + 2 * 8) + 6 * 64 * 16 * 8 + 2 * 64 ** 3 // 3)  # 8 value heads
    assert kinds.count("linear_attention") >= 1
    assert figures["padded"].flops["target_forward"] - without == kinds.count("linear_attention") * per_layer


def test_a_served_target_leaves_the_rank_the_drafter_its_embedding_and_head_and_the_features(tmp_path):
    """`-p target_engine vllm` in the dry run: the rank runs no target layer (target FLOPs 0, the drafter's the
    same), holds only the target's embedding and LM head of its weights, and receives the features (C x F x H in
    bf16) the engine hands over."""
    from dflash_lib.data.batch import collate_padded

    hf = tiny_qwen3_config(hidden_size=64, num_layers=4, vocab_size=VOCAB)
    hf.save_pretrained(tmp_path)  # a folder: the served target's config
    rng = np.random.default_rng(0)
    docs = [(rng.integers(0, VOCAB - 1, n), np.arange(n) >= 2) for n in (60, 20, 33)]
    batch = collate_padded(docs, 0)
    settings = dryrun.StepSettings("blocks", False)
    figures, models = {}, {}
    for engine in ("local", "vllm"):
        cfg = _tiny(target_layers=4, num_features=2, drafter_layers=1, target=str(tmp_path), target_engine=engine)
        models[engine] = dryrun.build_step_models(cfg, hf, settings, fake=True)
        figures[engine] = dryrun.measure_step(models[engine], batch)
    local, served = figures["local"], figures["vllm"]
    assert served.flops["target_forward"] == 0 < local.flops["target_forward"]
    assert {k: v for k, v in served.flops.items() if k != "target_forward"} == \
        {k: v for k, v in local.flops.items() if k != "target_forward"}
    target, shared = models["local"].target, 2 * VOCAB * 64 * 2  # embedding and LM head, bf16
    assert models["vllm"].held == [models["vllm"].target.embed_tokens, models["vllm"].target.lm_head]
    assert local.memory["parameters"] - served.memory["parameters"] == \
        sum(p.numel() for p in target.parameters()) * 2 - shared
    cfg = _tiny(target_layers=4, num_features=2, drafter_layers=1, target=str(tmp_path), target_engine="vllm")
    worst = dryrun.worst_bucket_batch(0, 0, 64, cfg, block_budget=80)
    (result,) = dryrun.measure_batches(cfg, [worst], settings, 80.0, ranks=dryrun.Ranks(1, "served"))
    assert result.figures.comm["hidden_states"] == sum(worst.lengths) * 2 * 64 * 2  # C x F x H, bf16
    assert result.target_bytes == shared  # what the rank holds of the target
