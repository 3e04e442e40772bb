"""The target sharded over the ranks (`target_parallel`, target/sharded.py): the setting and its auto rule
from the config's bytes, the target built on the host before it is sharded, the feed's passes per sampler step
and its stop handshake, and on 2 gloo ranks the sharded target's features against the replicated target's, its
shards and its load peak, and (loss kl: every layer in every pass) its final states at the scored rows. The
20-step run, the 8-step ce+kl run and kill/resume are in test_torchrun.py."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from dflash_lib.config import ConfigError, from_params, preset
from dflash_lib.data.batch import collate_padded
from dflash_lib.models import tiny_qwen3_config
from dflash_lib.target.local import TargetModel
from dflash_lib.target import sharded as target_shard
from dflash_lib.train.feed import Collated, Work, make_target_workers
from dflash_lib.train.pipeline import Pipeline, PipelineError
from dflash_lib.target.sharded import (load_sharded_target, move_outside_layers, pass_depth, per_step_passes,
                                           plan_target, resolve_target_parallel, target_footprint)
from tiny_models import HIDDEN, VOCAB, tiny_target

REPO = Path(__file__).resolve().parent.parent
GIB = 2**30


def test_a_bad_target_parallel_is_refused_naming_the_parameter():
    assert from_params({"target_parallel": "fsdp"}, preset("smoke")).train.target_parallel == "fsdp"
    with pytest.raises(ConfigError, match="target_parallel must be one of"):
        from_params({"target_parallel": "tensor"}, preset("smoke"))


@pytest.mark.parametrize("setting, weights, device, world, want", [
    ("auto", 30 * GIB, 80 * GIB, 8, "fsdp"),  # 30 GiB > 80 / 3
    ("auto", 26 * GIB, 80 * GIB, 8, "replicate"),  # 26 GiB <= 26.7
    ("auto", 30 * GIB, None, 2, "replicate"),  # CPU
    ("fsdp", 1, 80 * GIB, 2, "fsdp"),
    ("replicate", 100 * GIB, 80 * GIB, 2, "replicate"),
    ("fsdp", 100 * GIB, 80 * GIB, 1, "replicate"),  # one process: nothing to shard over
])
def test_the_auto_rule_shards_a_target_over_a_third_of_the_device(setting, weights, device, world, want):
    choice, why = resolve_target_parallel(setting, weights, device, world)
    assert choice == want and why
    with pytest.raises(ConfigError, match="target_parallel must be one of"):
        resolve_target_parallel("tp", weights, device, world)


def _outside_layers(target) -> list[torch.nn.Parameter]:
    inside = {id(p) for p in target.base.layers.parameters()}
    return [p for p in target.parameters() if id(p) not in inside]


@pytest.mark.parametrize("tied", [False, True])
def test_the_footprint_from_the_config_alone_equals_the_built_targets_parameters(tied):
    cfg = tiny_qwen3_config(hidden_size=HIDDEN, num_layers=4, vocab_size=VOCAB)
    cfg.tie_word_embeddings = tied
    target = tiny_target(4, 2) if not tied else TargetModel.from_hf_config(cfg, 2)
    foot = target_footprint(cfg, torch.float32)
    assert foot.weights == 4 * sum(p.numel() for p in target.parameters())  # tied weights once
    assert foot.replicated == 4 * sum(p.numel() for p in _outside_layers(target))
    assert foot.replicated == 4 * (VOCAB * HIDDEN * (1 if tied else 2) + HIDDEN)  # embedding (+ LM head), norm
    layer = 4 * sum(p.numel() for p in target.base.layers[0].parameters())
    assert (foot.largest_layer(), foot.shard_bytes(1), foot.shard_bytes(2)) == (layer, 4 * layer, 2 * layer)
    assert foot.load_peak_bytes(2) == 3 * layer + foot.replicated
    assert target_footprint(cfg, torch.bfloat16).weights * 2 == foot.weights


def test_a_shard_is_padded_to_the_first_ranks_rows():
    foot = target_shard.TargetFootprint(2, 0, 0, (((5, 3), (4, 1)), ((1, 8),)))  # rows 5, 4 and 1 over 2 ranks
    assert foot.shard_bytes(2) == 2 * (3 * 3 + 2 * 1 + 1 * 8)
    assert foot.largest_layer() == 2 * 19


def test_the_plan_is_made_from_the_config_before_a_weight_is_read():
    cfg = tiny_qwen3_config(hidden_size=HIDDEN, num_layers=4, vocab_size=VOCAB)
    foot = target_footprint(cfg, torch.bfloat16)
    plan = plan_target(cfg, "auto", 2, torch.bfloat16, device_bytes=3 * foot.weights - 1)  # weights > 1/3
    assert plan.parallel == "fsdp"
    peak = foot.load_peak_bytes(2) / 2**30
    assert plan.line.startswith("target sharded over 2 ranks with FSDP2 (auto: ")
    assert plan.line.endswith(f": 4 decoder layers, 1/2 of each per rank; embedding, norm and LM head replicated "
                              f"(peak while loading ~{peak:.2f} GiB per device)")
    assert plan_target(cfg, "auto", 2, torch.bfloat16, device_bytes=3 * foot.weights).parallel == "replicate"
    assert plan_target(cfg, "fsdp", 1, torch.bfloat16, None).line.startswith("target replicated on every rank")


def test_the_replicated_parts_move_to_the_device_and_the_layers_stay():
    cfg = tiny_qwen3_config(hidden_size=HIDDEN, num_layers=4, vocab_size=VOCAB)
    cfg.tie_word_embeddings = True
    target = TargetModel.from_hf_config(cfg, 2)
    move_outside_layers(target, torch.device("meta"))  # a device other than the host's, on any machine
    assert target.device == torch.device("meta")  # its embedding's: what the drafter is built on
    assert {p.device.type for p in _outside_layers(target)} == {"meta"}
    assert {b.device.type for b in target.base.rotary_emb.buffers()} == {"meta"}
    assert {p.device.type for p in target.base.layers.parameters()} == {"cpu"}  # fully_shard moves those
    assert target.lm_head.weight is target.embed_tokens.weight  # still tied


@pytest.mark.parametrize("loss, final", [("ce", False), ("kl", True), ("ce+kl", True)])
def test_under_fsdp_the_target_is_built_on_the_host_then_sharded_onto_the_device(monkeypatch, loss, final):
    """...and a loss that reads the target's final states gets a sharded target whose passes run every layer."""
    got = {}

    class Recorder:  # ShardedTarget's place: what load_sharded_target hands it
        def __init__(self, target, timeout_s, device, final):
            got.update(host=target.device, dtype=target.embed_tokens.weight.dtype, timeout=timeout_s,
                       device=device, backend=target.backend, final=final)

    monkeypatch.setattr(target_shard, "ShardedTarget", Recorder)
    model = dataclasses.replace(preset("smoke").model, attn_backend="sdpa", loss=loss)
    load_sharded_target(model, torch.device("cuda", 1), torch.bfloat16, 30.0)  # no CUDA needed: built on the host
    assert got == dict(host=torch.device("cpu"), dtype=torch.bfloat16, timeout=30.0, device=torch.device("cuda", 1),
                       backend="sdpa", final=final)


def test_a_pass_runs_every_layer_only_when_it_gives_the_final_states():
    target = tiny_target(6, 2)  # feature layers below the top: a ce pass stops at the deepest one
    assert (pass_depth(target, False), pass_depth(target, True)) == (max(target.layer_ids) + 1, 6)
    assert max(target.layer_ids) + 1 < 6


def test_every_rank_runs_the_most_shards_any_rank_takes_per_sampler_step():
    assert [per_step_passes(d, 2) for d in (1, 2, 3, 4)] == [1, 1, 2, 2]
    assert per_step_passes(2, 8) == 1  # a rank with no shard still runs one (a filler)


class CountingTarget:
    """A stand-in for a ShardedTarget: the real tiny target's passes, each counted, and the handshake's turns;
    `stop_at`: the turn (0-based) at which another rank's feed has left."""

    def __init__(self, stop_at: int = -1) -> None:
        self.target, self.stop_at = tiny_target(4, 2), stop_at
        self.passes, self.fillers, self.turns, self.leaves = 0, 0, 0, 0

    device = property(lambda self: self.target.device)

    def segments(self, doc_ids):
        return self.target.segments(doc_ids)

    def context_features(self, batch, segments=None):
        self.passes += 1
        return self.target.context_features(batch, segments)

    def filler(self):
        self.fillers += 1

    def turn(self) -> bool:
        if self.turns == self.stop_at:
            return False  # another rank's feed has left
        self.turns += 1
        return True

    def leave(self):
        self.leaves += 1


def _collated(step: int, shard: int, last: bool, valid: bool) -> Collated:
    tokens = np.arange(1, 6, dtype=np.int64)  # (5,)
    batch = collate_padded([(tokens, np.ones(5, np.uint8))], 0, [step]) if valid else None
    return Collated(Work(0, step, shard, last, [step] if valid else []), batch, ())


def test_the_sharded_feed_pads_each_sampler_step_to_the_same_number_of_passes():
    """Rank 1 of 2 with D = 3 takes one shard per step, rank 0 two: rank 1 runs a filler after each; a batch whose
    samples all failed validation runs a filler in its place."""
    target = CountingTarget()
    (run,) = make_target_workers([target], 1, torch.device("cpu"), passes_per_step=2)
    items = [run(_collated(0, 1, True, True)), run(_collated(1, 1, True, False))]
    assert (target.passes, target.fillers, target.turns) == (1, 3, 4)  # 2 steps x 2 passes, each after a turn
    assert items[0].features is not None and items[1].features is None
    with pytest.raises(ConfigError, match="one target worker per rank"):
        make_target_workers([target], 2, torch.device("cpu"), passes_per_step=2)


def test_a_peer_leaving_stops_the_feed_without_a_failure_and_a_reader_gets_an_error():
    target = CountingTarget(stop_at=2)
    workers = make_target_workers([target], 1, torch.device("cpu"), passes_per_step=1)
    source = [_collated(s, 0, True, True) for s in range(5)]
    pipeline = Pipeline(source, lambda c: c, workers)
    got = []
    with pytest.raises(PipelineError, match="closed while the caller was reading"):
        for item in pipeline:  # the third pass's turn: the peer has left (what was queued is dropped)
            got.append(item.step)
    pipeline.close()  # no failure to re-raise: the stop was not this rank's
    assert got == [0, 1][:len(got)] and (target.passes, target.leaves) == (2, 1)


SCRIPT = textwrap.dedent("""
    import json, os, sys, threading, weakref
    import numpy as np, torch
    sys.path.insert(0, os.environ["TESTS_DIR"])
    from tiny_models import HIDDEN, VOCAB, tiny_target
    from dflash_lib.data.batch import collate_padded
    from dflash_lib.models import tiny_qwen3_config
    from dflash_lib.train import distributed as D
    from dflash_lib.target.sharded import ShardedTarget, sharded_load_peak_bytes
    info = D.init_distributed(timeout_s=30.0, device="cpu")
    plain, host = tiny_target(6, 2), tiny_target(6, 2)
    full = [weakref.ref(p) for p in host.base.layers.parameters()]  # the layers' whole parameters, before
    sharded = ShardedTarget(host, 30.0, torch.device("cpu"))
    params = list(sharded.target.base.layers.parameters())
    inside = {id(p) for p in params}
    bytes_of = lambda ps: sum(p.numel() * p.element_size() for p in ps)
    largest = max(bytes_of(layer.parameters()) for layer in plain.base.layers)
    replicated = [p for p in sharded.target.parameters() if id(p) not in inside]
    peak = (sum(p.to_local().numel() * p.element_size() for p in params) + largest + bytes_of(replicated))
    rng = np.random.default_rng(0)
    docs = [(rng.integers(0, 300, n), np.ones(n, np.uint8)) for n in (7, 12, 5)]
    batches = [collate_padded(docs[:2], 0), collate_padded(docs[2:], 0)]  # a padded row, and one document
    want = [plain.context_features(b) for b in batches]
    mine = [0, 1] if info.rank == 0 else [1]  # rank 1: batch 1, then a filler; the passes pair all the same
    got, sums = {}, []
    def feed():
        for k in mine:
            got[k] = sharded.context_features(batches[k])
        if info.rank == 1:
            sharded.filler()
    thread = threading.Thread(target=feed)
    thread.start()
    for _ in range(20):  # the trainer thread's collectives on the default group, meanwhile
        sums.append(D.all_reduce_sum(1.0))
    thread.join()
    # loss kl / ce+kl: a second sharded target built with `final` runs every layer in every pass; rank 0 makes two
    # passes with final states, rank 1 one and then a bare feature pass (a filler's), and the all-gathers pair
    from dflash_lib.config import ConfigError
    from tiny_models import tiny_drafter
    try:
        sharded.context_features_and_final(batches[0], torch.zeros(1, dtype=torch.long))
        refused = ""
    except ConfigError as e:
        refused = str(e)
    drafter = tiny_drafter(plain, loss="kl", num_anchors=4)  # its layouts list the target rows
    layouts = [drafter.layout(b, drafter.sample_anchors(b, torch.Generator().manual_seed(k)))
               for k, b in enumerate(batches)]
    kl = ShardedTarget(tiny_target(6, 2), 30.0, torch.device("cpu"), final=True)
    want_kl = [plain.context_features_and_final(b, lay.target_rows) for b, lay in zip(batches, layouts)]
    kl_diff = []
    for k in mine:
        feats, final = kl.context_features_and_final(batches[k], layouts[k].target_rows)
        kl_diff += [float((feats - want_kl[k][0]).abs().max()), float((final - want_kl[k][1]).abs().max())]
    if info.rank == 1:
        kl_diff.append(float((kl.context_features(batches[0]) - want[0]).abs().max()))
    stops = []
    for turn in range(3):  # rank 0's feed leaves before its third pass: rank 1's stops at the same turn
        if info.rank == 0 and turn == 2:
            sharded.leave()
            break
        if not sharded.turn():
            stops.append(turn)
    out = dict(diff=max(float((got[k] - want[k]).abs().max()) for k in mine), sums=sums, stops=stops,
               layers=sorted({type(p).__name__ for p in params}),
               halves=all(2 * p.to_local().numel() == p.numel() for p in params),
               alive=sum(r() is not None for r in full), peak=peak,
               want_peak=sharded_load_peak_bytes(tiny_qwen3_config(hidden_size=HIDDEN, num_layers=6,
                                                                   vocab_size=VOCAB), 2, torch.float32),
               replicated=sorted({f"{type(p).__name__} {p.device}" for p in replicated}),
               device=str(sharded.device), refused=refused, kl_diff=kl_diff,
               rows=[int(lay.target_rows.numel()) for lay in layouts])
    with open(os.path.join(os.environ["RESULT_DIR"], f"rank{info.rank}.json"), "w") as f:
        json.dump(out, f)
    D.destroy()
""")


@pytest.mark.slow
def test_two_ranks_sharded_target_features_equal_the_replicated_targets(tmp_path: Path):
    script = tmp_path / "shard.py"
    script.write_text(SCRIPT)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(script)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "RESULT_DIR": str(tmp_path), "TESTS_DIR": str(REPO / "tests")}
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=180, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for r in results:
        assert r["diff"] <= 1e-6
        assert r["sums"] == [2.0] * 20
        assert r["layers"] == ["DTensor"] and r["halves"]  # every layer parameter sharded, 1/2 of it held here
        assert r["alive"] == 0  # no whole layer parameter outlives the sharding
        assert (r["replicated"], r["device"]) == (["Parameter cpu"], "cpu")  # embedding, norm, LM head whole
        assert r["peak"] == r["want_peak"]  # shards + the largest layer + the replicated parts, in bytes
    assert [r["stops"] for r in results] == [[], [2]]
    for r, passes in zip(results, (4, 3)):  # loss kl / ce+kl sharded: the whole target's features and final states
        assert "built for loss ce" in r["refused"] and min(r["rows"]) > 0
        assert len(r["kl_diff"]) == passes and max(r["kl_diff"]) <= 1e-6
