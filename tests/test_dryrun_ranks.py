"""The dry run on several ranks: under torch's fake process group, FSDP2 leaves rank 0 holding half of each
decoder layer on two ranks, the step's all-gathers move exactly the gathered layers' bytes, and the fit verdict
follows the per-rank peak; the interconnect arithmetic and `target_parallel`."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from dflash_lib.config import ConfigError, from_params
from dflash_lib import dryrun
from dflash_lib.dryrun.fake_ranks import fake_process_group
from dflash_lib.target.sharded import shard_layers

VOCAB = 1000


def _tiny():
    return from_params(dict(hidden_size=64, target_layers=4, num_features=2, drafter_layers=2, block_size=4,
                            num_anchors=8, token_budget=256, max_len=128, mask_id=VOCAB - 1))


@pytest.fixture(scope="module")
def two_ranks():
    """One tiny worst batch measured as rank 0 of 2, target replicated and FSDP2-sharded, no reserve."""
    cfg = _tiny()
    settings = dryrun.StepSettings("blocks", 0)
    worst = [dryrun.worst_bucket_batch(0, 0, 64, cfg, block_budget=80)]
    none = dryrun.Reserve(reserve_gib=0.0, fragmentation=0.0)
    out = {tp: dryrun.measure_batches(cfg, worst, settings, 80.0, reserve=none, ranks=dryrun.Ranks(2, tp))[0]
           for tp in ("replicate", "fsdp")}
    hf = dryrun.target_hf_config(cfg.model)
    layers = dryrun.build_step_models(cfg, hf, settings, fake=True).target.base.layers
    per_layer = [sum(p.numel() * p.element_size() for p in layer.parameters()) for layer in layers]
    return cfg, worst, settings, out, per_layer


def test_fsdp_rank_holds_half_of_every_decoder_layer(two_ranks):
    _, _, _, out, per_layer = two_ranks
    rep, fsdp = out["replicate"], out["fsdp"]
    assert rep.target_bytes - fsdp.target_bytes == sum(per_layer) // 2  # even shapes: no shard padding
    assert rep.figures.memory["parameters"] - fsdp.figures.memory["parameters"] == sum(per_layer) // 2
    assert not dist.is_initialized()  # the fake group is gone after the measurement


def test_all_gathers_move_the_layers_the_feature_pass_runs(two_ranks):
    """Features of layers [1, 1] (4 layers, 2 features): layers 0 and 1 run, each gathered once per forward; the
    drafter's fp32 gradients are all-reduced once; the replicated target moves nothing."""
    cfg, _, _, out, per_layer = two_ranks
    rep, fsdp = out["replicate"], out["fsdp"]
    assert fsdp.figures.comm["all_gather"] == sum(per_layer[:2]) and "all_gather" not in rep.figures.comm
    grads = 4 * sum(p.numel() for p in dryrun.build_step_models(cfg, dryrun.target_hf_config(cfg.model),
                                                                dryrun.StepSettings("blocks", 0), True).params)
    assert rep.figures.comm["all_reduce"] == fsdp.figures.comm["all_reduce"] == grads
    assert fsdp.figures.flops == rep.figures.flops  # sharding moves bytes, not FLOPs
    # ring on 2 ranks at the default 450 GB/s: half of each all-gather, the whole all-reduce (2 x 1/2) per link
    assert fsdp.comm_s == pytest.approx((0.5 * sum(per_layer[:2]) + grads) / 450e9)
    record = fsdp.record()
    assert record.ktok_s == pytest.approx(2 * record.real_tokens / fsdp.step_s / 1000, rel=1e-3)  # both ranks


def test_under_loss_kl_the_sharded_pass_gathers_every_layer(two_ranks):
    """Loss kl reads the final states: the pass runs all 4 layers, each gathered once, against layers 0 and 1 under
    ce; the target's FLOPs are those of the 4 layers, the same sharded or not."""
    cfg, worst, settings, out, per_layer = two_ranks
    cfg = from_params({"loss": "kl"}, cfg)
    kl = {tp: dryrun.measure_batches(cfg, worst, settings, 80.0, ranks=dryrun.Ranks(2, tp))[0]
          for tp in ("replicate", "fsdp")}
    assert kl["fsdp"].figures.comm["all_gather"] == sum(per_layer) > out["fsdp"].figures.comm["all_gather"]
    assert "all_gather" not in kl["replicate"].figures.comm
    assert kl["fsdp"].figures.flops == kl["replicate"].figures.flops
    # four layers of one shape instead of two: twice the target's matmul FLOPs (the norm counts none)
    assert kl["fsdp"].figures.flops["target_forward"] == 2 * out["fsdp"].figures.flops["target_forward"]


@pytest.mark.parametrize("final", [False, True])
def test_the_prefetch_chain_gathers_the_layers_of_the_pass_once_per_pass(final):
    """The trainer's FSDP2 wrapping (`shard_layers`) on a fake 2-rank group, 4 layers, features of layers 0 and 1:
    every pass, the first one included, all-gathers exactly the layers it runs (2, or all 4 when it also gives the
    final states), one all-gather each; nothing is prefetched past the pass's last layer."""
    import numpy as np

    from dflash_lib.data.batch import collate_padded
    from dflash_lib.models import tiny_qwen3_config
    from dflash_lib.target.local import TargetModel
    from dflash_lib.dryrun.fake_ranks import CommTally
    from dflash_lib.target.sharded import pass_depth, shard_layers

    target = TargetModel.from_hf_config(tiny_qwen3_config(hidden_size=64, num_layers=4, vocab_size=VOCAB), 2,
                                        layer_ids=[0, 1], seed=0)
    per_layer = [sum(p.numel() * p.element_size() for p in layer.parameters()) for layer in target.base.layers]
    batch = collate_padded([(np.arange(10), np.ones(10, np.uint8))], 0)
    depth = pass_depth(target, final)
    assert depth == (4 if final else 2)
    with fake_process_group(2) as mesh:
        root = shard_layers(target, mesh, final)
        run = (lambda: target.context_features_and_final(batch, torch.tensor([3]))) if final else (
            lambda: target.context_features(batch))
        for _ in range(3):
            with CommTally() as tally:
                root(run)
            assert (tally.calls, tally.bytes["all_gather"]) == (depth, sum(per_layer[:depth]))


def _prefetch_every_layer(target, mesh, final=False):
    """A wrong chain: every layer prefetches the next, also past the pass's last layer."""
    root = shard_layers(target, mesh, final)
    layers = list(target.base.layers)
    for layer, following in zip(layers[:-1], layers[1:]):
        layer.set_modules_to_forward_prefetch([following])
    return root


def test_the_dry_run_reports_what_a_prefetch_past_the_pass_gathers_and_holds(two_ranks, monkeypatch):
    """The trainer's chain gathers nothing a pass does not run (idle 0). A chain prefetching layer 2 after the
    pass's last layer 1: its all-gather is issued once (the first pass) and never consumed, so FSDP2 holds the
    gathered layer for the run: the dry run reports that layer as idle, and its peak holds it; the steady step's
    all-gathers are the same layers as before (the held one is not gathered again)."""
    cfg, worst, settings, out, per_layer = two_ranks
    assert out["fsdp"].idle_gather_bytes == 0 and out["replicate"].idle_gather_bytes == 0
    from dflash_lib.dryrun import step as step_module

    monkeypatch.setattr(step_module, "shard_layers", _prefetch_every_layer)  # where build_step_models looks it up
    none = dryrun.Reserve(reserve_gib=0.0, fragmentation=0.0)
    bad = dryrun.measure_batches(cfg, worst, settings, 80.0, reserve=none, ranks=dryrun.Ranks(2, "fsdp"))[0]
    assert bad.idle_gather_bytes == per_layer[2]
    assert bad.figures.comm["all_gather"] == out["fsdp"].figures.comm["all_gather"] == sum(per_layer[:2])
    assert bad.figures.peak_bytes - out["fsdp"].figures.peak_bytes == per_layer[2]
    assert bad.record().all_gather_gib == out["fsdp"].record().all_gather_gib


@pytest.mark.slow  # a second fake dry run on two ranks (make test runs it)
def test_fit_verdict_flips_between_the_two_peaks(two_ranks):
    cfg, worst, settings, out, _ = two_ranks
    rep, fsdp = out["replicate"].figures.peak_bytes, out["fsdp"].figures.peak_bytes
    assert fsdp < rep
    between = (rep + fsdp) / 2 / dryrun.GIB
    none = dryrun.Reserve(reserve_gib=0.0, fragmentation=0.0)
    fits = {tp: dryrun.measure_batches(cfg, worst, settings, between, reserve=none,
                                       ranks=dryrun.Ranks(2, tp))[0].fits for tp in ("replicate", "fsdp")}
    assert fits == {"replicate": False, "fsdp": True}


def test_comm_seconds_are_ring_collectives():
    r = dryrun.Ranks(8, "fsdp", link_gbs=400.0)
    assert r.comm_seconds({"all_gather": 8e9}) == pytest.approx(7 / 8 * 8e9 / 400e9)
    assert r.comm_seconds({"all_reduce": 8e9}) == pytest.approx(2 * 7 / 8 * 8e9 / 400e9)
    assert dryrun.Ranks(1).comm_seconds({"all_reduce": 8e9}) == 0.0
    with pytest.raises(ConfigError):
        dryrun.Ranks(0)


def test_target_parallel_is_checked():  # the auto rule the dry run shares with the trainer: test_target_parallel
    assert from_params({}).train.target_parallel == "auto"
    with pytest.raises(ConfigError, match="target_parallel"):
        from_params({"target_parallel": "tensor"})


def test_a_second_process_group_is_refused():
    with fake_process_group(2):
        with pytest.raises(ConfigError, match="no other process group"):
            with fake_process_group(2):
                pass
    assert not dist.is_initialized()
