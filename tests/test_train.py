"""The trainer: schedules, step planning, accumulation with a global normaliser, the loop's outputs."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dflash_lib.config import ConfigError, TrainConfig, from_params, preset
from dflash_lib.data import LoadReport
from dflash_lib.data.batch import collate_padded
from dflash_lib.models import DFlashDrafter, DrafterConfig
from dflash_lib.target.local import TargetModel
from dflash_lib.models.export import read_drafter
from dflash_lib.train.build import TrainingParts
from dflash_lib.train.feed import Item, Work, epoch_batches, make_collate
from dflash_lib.train.loop import run_training
from dflash_lib.rundir.records import BUDGET_FIGURES, HELDOUT_KEYS, RunSummary
from dflash_lib.train.metrics import StepMetrics, format_duration
from dflash_lib.train.pipeline import PipelineError
from dflash_lib.train.schedule import lr_at, count_steps, warmup_steps
from dflash_lib.train.state import BadStepGuard
from dflash_lib.train.step import build_optimizer, train_step
from run_folder import metrics_rows

JSONL_KEYS = {"step", "epoch", "loss", "acc", "lr", "noise", "real_tokens", "padded_tokens", "ktok_s",
              "data_wait_pct", "q_pre", "q_hs", "bucket", "eta_s", "run_eta_s", "full_run_eta_s", "steady",
              "acc_per_pos", "eal", "time"}
SUMMARY_KEYS = {"steps", "empty_batches", "real_tokens", "final_loss", "mean_loss", "final_acc", "steady_ktok_s",
                "steady", "steady_start_step", "data_wait_pct", "padding_efficiency", "full_run_eta_s", "wall_s",
                "config_hash"}


# -- schedules ---------------------------------------------------------------------------------------------------


def test_lr_schedule_exact_values():
    cfg = TrainConfig(lr=1e-3, warmup_ratio=0.1, min_lr_ratio=0.0)
    assert warmup_steps(100, cfg) == 10
    assert [lr_at(s, 100, cfg) for s in (0, 4, 9)] == pytest.approx([1e-4, 5e-4, 1e-3])  # (s+1)/W
    assert lr_at(10, 100, cfg) == pytest.approx(1e-3)  # cosine starts at the peak
    assert lr_at(55, 100, cfg) == pytest.approx(5e-4)  # half-way through the cosine
    assert lr_at(100, 100, cfg) == pytest.approx(0.0, abs=1e-15)
    floor = TrainConfig(lr=1e-3, warmup_ratio=0.1, min_lr_ratio=0.1)
    assert lr_at(55, 100, floor) == pytest.approx(1e-4 + 9e-4 * 0.5)
    assert lr_at(10_000, 100, floor) == pytest.approx(1e-4)  # past an estimated total: the floor
    steps = TrainConfig(lr=1e-3, warmup_ratio=0.1, warmup_steps=5)  # steps override the ratio
    assert warmup_steps(100, steps) == 5 and lr_at(0, 100, steps) == pytest.approx(2e-4)
    assert warmup_steps(6, TrainConfig(warmup_ratio=0.04)) == 1  # ceil: never zero steps of warm-up by ratio
    with pytest.raises(ValueError, match="total_steps"):
        lr_at(0, 0, cfg)


def test_wsd_schedule_exact_values():
    """Warm-up, stable at the peak, then linear to the floor over the last ceil(decay_ratio * total) steps."""
    cfg = TrainConfig(lr=1e-3, warmup_ratio=0.1, lr_schedule="wsd", decay_ratio=0.2, min_lr_ratio=0.1)
    assert [lr_at(s, 100, cfg) for s in (0, 9)] == pytest.approx([1e-4, 1e-3])  # the same warm-up
    assert [lr_at(s, 100, cfg) for s in (10, 50, 80)] == pytest.approx([1e-3] * 3)  # stable through step 80
    assert lr_at(90, 100, cfg) == pytest.approx(1e-4 + 9e-4 * 10 / 20)  # half-way down the decay
    assert lr_at(99, 100, cfg) == pytest.approx(1e-4 + 9e-4 / 20)  # the last step: one decay step above the floor
    assert lr_at(100, 100, cfg) == lr_at(10_000, 100, cfg) == pytest.approx(1e-4)  # past the total: the floor
    steps = [lr_at(s, 100, cfg) for s in range(100)]
    assert all(a >= b for a, b in zip(steps[10:], steps[11:]))  # never rises after the warm-up
    with pytest.raises(ConfigError, match="decay_ratio"):
        TrainConfig(lr_schedule="wsd", decay_ratio=0.0)


def test_muon_takes_the_drafters_matrices_and_adamw_the_rest():
    """`optimizer muon`: torch's Muon on every trainable 2-D parameter (fc, projections), AdamW on the norms; a
    step with both changes every parameter; fsdp (which shards the matrices Muon orthogonalises) is refused."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16, bias=False), torch.nn.LayerNorm(16), torch.nn.Linear(16, 4))
    params = list(model.parameters())
    muon, adamw = build_optimizer(params, TrainConfig(optimizer="muon", lr=1e-2), torch.device("cpu"))
    assert isinstance(muon, torch.optim.Muon) and isinstance(adamw, torch.optim.AdamW)
    assert muon.param_groups[0]["adjust_lr_fn"] == "match_rms_adamw"  # AdamW's RMS: one lr and schedule for both
    in_muon = {id(p) for g in muon.param_groups for p in g["params"]}
    assert in_muon == {id(p) for p in params if p.ndim == 2}
    assert {id(p) for g in adamw.param_groups for p in g["params"]} == {id(p) for p in params if p.ndim != 2}
    (only,) = build_optimizer(params, TrainConfig(), torch.device("cpu"))
    assert isinstance(only, torch.optim.AdamW)
    before = [p.detach().clone() for p in params]
    model(torch.randn(5, 8)).square().sum().backward()
    for o in (muon, adamw):
        o.step()
    assert all(not torch.equal(b, p) for b, p in zip(before, params))
    with pytest.raises(ConfigError, match="optimizer muon .* parallel fsdp"):
        TrainConfig(optimizer="muon", parallel="fsdp")


@settings(max_examples=40, deadline=None)
@given(total=st.integers(1, 500), ratio=st.floats(0.0, 0.5), floor=st.floats(0.0, 0.9))
def test_lr_schedule_shape(total, ratio, floor):
    cfg = TrainConfig(lr=1e-3, warmup_ratio=ratio, min_lr_ratio=floor)
    lrs = [lr_at(s, total, cfg) for s in range(total)]
    w = warmup_steps(total, cfg)
    assert all(0 < x <= 1e-3 + 1e-15 for x in lrs)
    assert all(x >= floor * 1e-3 - 1e-15 for x in lrs[w:])  # after warm-up never below the floor
    assert all(a <= b + 1e-15 for a, b in zip(lrs[:w], lrs[1:w]))  # warm-up rises
    assert all(a + 1e-15 >= b for a, b in zip(lrs[w:], lrs[w + 1:]))  # cosine falls


def test_training_feeds_blocks_masked_at_the_configured_noise(tmp_path, data):
    """What the drafter is fed, seen where it embeds its blocks (the target's embedding rows): with blocks of 4 tokens,
    noise = 1 masks all 3 positions after the anchor, noise = 1/3 exactly one of them (plus the positions past a
    document's end, always MASK: a few blocks near the end). metrics.jsonl records the noise of every step."""
    store, lengths = data
    for noise, masked in ((1.0, 3), (1 / 3, 1)):
        config = tiny_config(noise=noise, steps=2)
        target, drafter = tiny_models(config)
        mask_id, B = config.model.mask_id, config.model.block_size
        fed = []  # (n, B) token ids of the blocks embedded for the drafter

        embed = drafter._embed

        def keep_blocks(ids, embed=embed, fed=fed):
            if (ids == mask_id).any():  # the corpus (ids < 2000) never holds MASK: these are drafter blocks
                fed.append(ids.detach().reshape(-1, B).clone())
            return embed(ids)

        drafter._embed = keep_blocks
        sampler = ListSampler([list(range(i, i + 4)) for i in range(0, len(store), 4)])
        parts = TrainingParts(store, lengths, sampler, [target], drafter, pad_id=0, packed=False, row_len=0,
                              edges=[30, 45, 60])
        try:
            run_training(config, parts, tmp_path / f"noise{masked}")
        finally:
            del drafter._embed
        rows = metrics_rows(tmp_path / f"noise{masked}")
        assert [r["noise"] for r in rows] == [pytest.approx(noise)] * 2
        blocks = torch.cat(fed)  # (n, B)
        assert len(blocks) >= 2 * 8 and (blocks[:, 0] < 2000).all()  # 2 steps of >= 8 blocks; anchors are real
        n_mask = (blocks[:, 1:] == mask_id).sum(dim=1)  # (n,)
        assert (n_mask >= masked).all()
        assert (n_mask == masked).float().mean() > 0.75, n_mask.tolist()


def test_count_steps():
    assert count_steps(TrainConfig(steps=7), 100, 10_000, 1) == (7, None)
    assert count_steps(TrainConfig(epochs=1.5), 10, 10_000, 1) == (15, 15)
    assert count_steps(TrainConfig(epochs=2.0, accum_tokens=300), 20, 1000, 1) == (7, 40)  # ceil(2000 / 300)
    assert count_steps(TrainConfig(epochs=2.0, accum_tokens=300), 20, 1000, 2) == (4, 40)  # per rank
    with pytest.raises(ConfigError, match="no batch"):
        count_steps(TrainConfig(epochs=1.0), 0, 0, 1)


def test_collate_labels_a_padded_batch_with_the_bucket_of_its_longest_sample():
    store = [(np.arange(n), np.ones(n, dtype=bool)) for n in (3, 8, 9)]  # samples of 3, 8 and 9 tokens
    to_edge = make_collate(store, packed=False, pad_id=0, row_len=0, edges=[4, 8, 16], pad_to_edge=True)
    batches = [to_edge(Work(0, 0, 0, True, idx)).batch for idx in ([0], [0, 1], [2])]
    assert [(b.bucket, b.input_ids.shape[1]) for b in batches] == [(0, 4), (1, 8), (2, 16)]  # 8 is edge 8's
    assert make_collate(store, packed=False, pad_id=0, row_len=0)(Work(0, 0, 0, True, [0, 2])).batch.bucket == -1


# -- small stand-ins for the store and the sampler -----------------------------------------------------------------


class ListSampler:
    """Fixed batches, reordered per epoch by a seeded permutation (the batch-sampler protocol the loop needs)."""

    def __init__(self, batches: list[list[int]]) -> None:
        self.batches, self.epoch, self.epochs_seen = batches, 0, []

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        self.epochs_seen.append(epoch)

    def __len__(self) -> int:
        return len(self.batches)

    def __iter__(self):
        order = np.random.default_rng(self.epoch).permutation(len(self.batches))
        return iter([self.batches[i] for i in order])


def test_epoch_batches_cycles_epochs_and_stops():
    s = ListSampler([[0], [1], [2]])
    out = list(epoch_batches(s, 7))
    assert [w.epoch for w in out] == [0, 0, 0, 1, 1, 1, 2]
    assert [w.step for w in out] == [0, 1, 2, 0, 1, 2, 0]
    assert sorted(i for w in out if w.epoch == 1 for i in w.indices) == [0, 1, 2]
    assert s.epochs_seen == [0, 1, 2]
    resumed = list(epoch_batches(ListSampler([[0], [1], [2]]), 7, start=(1, 2), done=5))  # 5 consumed before
    assert [(w.epoch, w.step, w.indices) for w in resumed] == [(w.epoch, w.step, w.indices) for w in out[5:]]
    with pytest.raises(ValueError, match="no batch in epoch 0"):
        next(epoch_batches(ListSampler([]), None))


def make_store(n: int = 32, seed: int = 0) -> tuple[list, np.ndarray]:
    rng = np.random.default_rng(seed)
    lengths = rng.integers(12, 60, size=n)
    store = []
    for length in lengths:
        mask = np.zeros(length, np.uint8)
        mask[length // 3:] = 1  # the last two thirds are the "assistant" part
        store.append((rng.integers(0, 2000, size=length), mask))
    return store, lengths.astype(np.int64)


def tiny_config(**params):
    base = dict(target_layers=2, hidden_size=32, num_features=1, num_anchors=8, block_size=4, steps=6,
                log_every=2, prefetch=2, hs_queue=1, wandb_mode="disabled", full_run_epochs=2.0)
    return from_params({**base, **params}, preset("smoke"))


def tiny_models(config, seed: int = 0) -> tuple[TargetModel, DFlashDrafter]:
    target = TargetModel.from_model_config(config.model, seed=seed)
    torch.manual_seed(seed)
    return target, DFlashDrafter(DrafterConfig.from_model_config(config.model, target), target)


@pytest.fixture(scope="module")
def data():
    return make_store()


# -- one step ---------------------------------------------------------------------------------------------------


def _item(target: TargetModel, drafter: DFlashDrafter, store, indices, gen: torch.Generator,
          samples=None) -> Item:
    """A ready micro-batch: host batch, features and the drafter layout of anchors drawn from `gen`."""
    batch = collate_padded(samples or [store[i] for i in indices], pad_id=0, indices=indices)
    layout = drafter.layout(batch, drafter.sample_anchors(batch, gen))
    return Item(0, batch, batch, target.features(batch), layout=layout, device_layout=layout)


def test_accumulated_step_equals_one_big_batch(data):
    """Two micro-batches normalised by their JOINT weight sum give the update of one batch holding both."""
    store, _ = data
    config = tiny_config()
    updates = []
    for split in ([[0, 1, 2], [3, 4]], [[0, 1, 2, 3, 4]]):
        target, drafter = tiny_models(config)
        params = [p for p in drafter.parameters() if p.requires_grad]
        before = [p.detach().clone() for p in params]
        opt = torch.optim.SGD(params, lr=1.0)
        gen = torch.Generator().manual_seed(3)  # one stream in document order: the same anchors either way
        items = [_item(target, drafter, store, idx, gen) for idx in split]
        res = train_step(drafter, items, params, opt, lr=1.0, grad_clip=0.0, autocast=False,
                         guard=BadStepGuard(3), step=1)
        updates.append((torch.cat([(p.detach() - b).flatten() for p, b in zip(params, before)]), res))
    (u_split, r_split), (u_one, r_one) = updates
    assert r_split.weight_sum == pytest.approx(r_one.weight_sum)
    assert r_split.loss == pytest.approx(r_one.loss, rel=1e-5)
    assert r_split.real_tokens == r_one.real_tokens == sum(len(store[i][0]) for i in range(5))
    assert u_one.abs().max() > 0
    torch.testing.assert_close(u_split, u_one, rtol=1e-4, atol=1e-7)


def test_step_without_scored_tokens_is_skipped(data):
    store, _ = data
    config = tiny_config()
    target, drafter = tiny_models(config)
    params = [p for p in drafter.parameters() if p.requires_grad]
    before = [p.detach().clone() for p in params]
    silent = [(tok, np.zeros_like(mask)) for tok, mask in store[:2]]  # no assistant token at all
    item = _item(target, drafter, store, [0, 1], torch.Generator(), samples=silent)
    res = train_step(drafter, [item], params, torch.optim.AdamW(params), 1e-3, 1.0, False, BadStepGuard(3), 1)
    assert res.skipped and math.isnan(res.loss) and res.weight_sum == 0.0
    assert all(torch.equal(p, b) for p, b in zip(params, before))


# -- the loop ---------------------------------------------------------------------------------------------------


def run_loop(tmp_path, data, **params):
    store, lengths = data
    config = tiny_config(**params)
    target, drafter = tiny_models(config)
    sampler = ListSampler([list(range(i, i + 4)) for i in range(0, len(store), 4)])
    parts = TrainingParts(store, lengths, sampler, [target], drafter, pad_id=0, packed=False, row_len=0,
                          edges=[30, 45, 60])
    return run_training(config, parts, tmp_path), config, target


def test_loop_writes_metrics_summary_and_drafter(tmp_path, data, capsys):
    summary, config, target = run_loop(tmp_path, data, target_workers=2)
    rows = metrics_rows(tmp_path)
    assert [r["step"] for r in rows] == list(range(1, 7))
    assert all(JSONL_KEYS <= set(r) for r in rows)
    assert all(len(r["q_pre"]) == 2 and len(r["q_hs"]) == 2 for r in rows)  # one queue per target worker
    assert all(r["bucket"] in (0, 1, 2) for r in rows)
    assert [r["lr"] for r in rows] == pytest.approx([lr_at(s, 6, config.train) for s in range(6)])
    assert sum(r["real_tokens"] for r in rows) == summary.real_tokens
    assert summary.padding_efficiency == pytest.approx(summary.real_tokens / summary.padded_tokens)
    assert SUMMARY_KEYS <= set(summary.to_json()) and summary.steps == 6
    assert json.loads((tmp_path / "summary.json").read_text())["steps"] == 6
    assert not summary.steady and summary.steady_ktok_s is None  # 6 steps: too short to call steady
    # the files hold exactly the records' fields, less the held-out figures (no held-out split: no evaluation) and
    # the budget figures (a list of batches fills by no budget)
    heldout = {"heldout_step", *HELDOUT_KEYS}
    assert all(set(r) == set(StepMetrics.json_keys()) - heldout - set(BUDGET_FIGURES) for r in rows)
    assert all(getattr(summary, k) is None for k in BUDGET_FIGURES)  # no step had them
    assert all(StepMetrics.from_json(r).to_json() == r for r in rows)
    doc = json.loads((tmp_path / "summary.json").read_text())
    assert set(doc) == set(RunSummary.json_keys()) - heldout - {"target_cache"}  # no cache asked for
    assert RunSummary.from_json(tmp_path / "summary.json") == summary and summary.to_json() == doc
    read_drafter(tmp_path / "drafter", target)  # the saved drafter loads back on its target
    printed = [line for line in capsys.readouterr().out.splitlines() if line.startswith("step ")]
    assert [int(line.split()[1]) for line in printed] == [2, 4, 6]  # log_every = 2
    assert not (tmp_path / "wandb").exists()


def test_loop_accumulates_by_real_tokens(tmp_path, data):
    summary, _, _ = run_loop(tmp_path, data, accum_tokens=300, steps=3)
    rows = metrics_rows(tmp_path)
    assert all(r["micro_batches"] >= 2 and r["real_tokens"] >= 300 for r in rows)  # 4 samples < 240 tokens
    assert summary.steps == 3


def test_loop_by_epochs_ends_with_the_data(tmp_path, data):
    summary, _, _ = run_loop(tmp_path, data, steps=0, epochs=1.5)
    assert summary.steps == summary.planned_steps == 12  # 8 batches per epoch x 1.5
    assert summary.last_epoch == 1


class ReportedStore(list):
    """A stand-in store with a token store's LoadReport."""

    report = LoadReport(source="c.jsonl", records_seen=40, records_kept=32, complete=True,
                        skipped={"no_assistant_within_max_len": 6, "invalid_json": 2},
                        examples={"no_assistant_within_max_len": ["line 3", "line 9"], "invalid_json": ["line 12"]})


def test_loop_says_what_the_data_skipped_first_and_keeps_it_in_the_summary(tmp_path, data, capsys):
    store, lengths = data
    summary, _, _ = run_loop(tmp_path, (ReportedStore(store), lengths), steps=1)  # the report precedes every step
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == ("data: 40 records read, 32 kept; skipped: no_assistant_within_max_len 6 (line 3, line 9, "
                        "...), invalid_json 2 (line 12, ...)")
    assert summary.data_records == ReportedStore.report.counts()
    assert json.loads((tmp_path / "summary.json").read_text())["data_records"]["skipped"] == {
        "no_assistant_within_max_len": 6, "invalid_json": 2}
    assert run_loop(tmp_path / "plain", data, steps=1)[0].data_records is None  # a store without a report


def test_log_line_eta_is_this_invocations_and_the_full_runs_is_named_apart(tmp_path, data, capsys):
    """stop_at_step 3 of 6 planned steps: `eta_s` (the log line's ETA) runs to step 3, `run_eta_s` to step 6 and
    `full_run_eta_s` to the end of `full_run_epochs` (2) over the corpus, all at the same throughput."""
    summary, _, _ = run_loop(tmp_path, data, steps=6, stop_at_step=3)
    rows = metrics_rows(tmp_path)
    assert [r["step"] for r in rows] == [1, 2, 3] and summary.complete is False
    done = np.cumsum([r["real_tokens"] for r in rows])  # (3,) real tokens trained after each step
    for k, (r, d) in enumerate(zip(rows, done), start=1):
        per_step = d / k
        assert r["eta_s"] == pytest.approx(r["run_eta_s"] * (3 - k) / (6 - k), rel=1e-9)
        assert r["full_run_eta_s"] == pytest.approx(r["run_eta_s"] * (summary.full_run_tokens - d)
                                                    / ((6 - k) * per_step), rel=1e-9)
    assert rows[-1]["eta_s"] == 0.0 and rows[-1]["run_eta_s"] > 0
    printed = [line for line in capsys.readouterr().out.splitlines() if line.startswith("step 2 |")]
    assert len(printed) == 1 and f"| ETA ~{format_duration(rows[1]['eta_s'])} |" in printed[0]


def silenced(store: list, indices) -> list:
    """`store` with the samples at `indices` left without an assistant token (each fails validation)."""
    return [(tok, np.zeros_like(mask)) if i in indices else (tok, mask) for i, (tok, mask) in enumerate(store)]


def test_a_read_without_a_sample_to_train_on_is_no_step(tmp_path, data, capsys):
    """Batches 1 and 2 (samples 4..11) hold no sample fit for training: reading them makes no update, no metrics
    row and no step; the 6 steps are trained on the other batches, on the schedule of 6 steps."""
    store, lengths = data
    summary, config, _ = run_loop(tmp_path, (silenced(store, range(4, 12)), lengths), steps=6)
    rows = metrics_rows(tmp_path)
    assert [r["step"] for r in rows] == list(range(1, 7))
    assert all(r["real_tokens"] > 0 and math.isfinite(r["loss"]) and not r["skipped"] for r in rows)
    assert [r["lr"] for r in rows] == pytest.approx([lr_at(s, 6, config.train) for s in range(6)])
    trained = empty = 0  # the reads of ListSampler's epoch-0 order of the 8 batches, up to the 6th step
    for batch in np.random.default_rng(0).permutation(8):
        if trained == 6:
            break
        empty, trained = (empty + 1, trained) if batch in (1, 2) else (empty, trained + 1)
    assert summary.steps == 6 and summary.empty_batches == empty > 0
    assert summary.skipped_samples == {"no_assistant_token": 4 * empty}
    said = [line for line in capsys.readouterr().out.splitlines() if "nothing to score" in line]
    pattern = (r"epoch 0, sampler step \d: nothing to score \(samples failing validation: no_assistant_token \(sample "
               r"\d+\)(, no_assistant_token \(sample \d+\)){3}\); not a training step \(no update, \d steps so far\)")
    assert len(said) == empty and all(re.fullmatch(pattern, line) for line in said), said


@pytest.mark.parametrize("length, message", [
    (dict(steps=0, epochs=0.5), "trained on nothing: none of the 4 sampler steps read had a token to score "
                                r"\(skipped 16 samples: no_assistant_token 16"),  # the data ends first
    (dict(steps=6), r"nothing to train on in a whole epoch \(8 sampler step\(s\) in a row without a token to "
                    r"score\) after 0 training steps: skipped 32 samples"),  # steps: epoch after epoch of them
])
def test_a_run_with_nothing_to_train_on_fails_and_writes_no_drafter(tmp_path, data, length, message):
    from dflash_lib.train.feed import NothingTrainedError

    store, lengths = data
    with pytest.raises(NothingTrainedError, match=message):
        run_loop(tmp_path, (silenced(store, range(len(store))), lengths), **length)
    assert not (tmp_path / "drafter").exists() and not (tmp_path / "summary.json").exists()
    assert (tmp_path / "metrics.jsonl").read_text() == ""  # no step row


class BrokenStore(list):
    """A store whose sample 5 cannot be read (as a truncated memmap would fail)."""

    def __getitem__(self, i):
        if i == 5:
            raise OSError("sample 5: read failed")
        return super().__getitem__(i)


def test_unreadable_sample_surfaces_as_a_named_stage_error(tmp_path, data):
    store, lengths = data
    with pytest.raises(PipelineError, match="stage 'collate' failed: OSError: sample 5: read failed"):
        run_loop(tmp_path, (BrokenStore(store), lengths))


# -- end to end on the real pieces (token store, samplers, models) ---------------------------------------------------


def test_smoke_preset_leaves_a_complete_run_folder(tmp_path):
    from dflash_lib.data import build_token_store_from_config
    from dflash_lib.data.readers import NO_ASSISTANT_WITHIN_MAX_LEN
    from dflash_lib.train.loop import train

    run_dir = tmp_path / "run"
    summary = train(preset("smoke"), run_dir)
    written = {p.name for p in run_dir.iterdir()}
    assert {"config.json", "env.json", "metrics.jsonl", "summary.json", "drafter"} <= written
    rows = metrics_rows(run_dir)
    assert len(rows) == summary.steps == preset("smoke").train.steps
    assert all(JSONL_KEYS <= set(r) for r in rows)
    assert all(r["bucket"] >= 0 for r in rows)  # the smoke preset trains on buckets
    assert 0 < summary.padding_efficiency <= 1 and math.isfinite(summary.final_loss)
    assert json.loads((run_dir / "config.json").read_text())["config_hash"] == summary.config_hash
    assert not (run_dir / "wandb").exists()  # WANDB_MODE=disabled in tests
    assert "no_assistant_token" not in summary.skipped_samples  # dropped by the store, not skipped each epoch
    report = build_token_store_from_config(preset("smoke").data, progress=False).report
    assert summary.data_records == report.counts() and report.skipped[NO_ASSISTANT_WITHIN_MAX_LEN] > 0


@pytest.mark.parametrize("strategy,static", [("sorted", False), ("random", False), ("packed", False),
                                             ("packed", True)])
def test_command_line_trains_every_strategy(tmp_path, strategy, static):
    from dflash_lib.__main__ import main
    from dflash_lib.data.batch import packed_row_len
    from dflash_lib.plan.sampler import resolve_block_budget

    run_dir = tmp_path / strategy
    assert main(["train", "--preset", "smoke", "--run-dir", str(run_dir), "-p", "steps", "2",
                 "-p", "strategy", strategy, "-p", "static_shapes", str(static).lower()]) == 0
    rows = metrics_rows(run_dir)
    assert [r["step"] for r in rows] == [1, 2]
    summary = json.loads((run_dir / "summary.json").read_text())
    smoke = preset("smoke")  # token budget 2048; block budget 4 rows x 8 anchors x 4 = 128 query tokens
    blocks = resolve_block_budget(smoke.sampler, smoke.buckets, smoke.model, smoke.data.max_len)
    assert blocks == 128
    for r in rows:  # how full each step's batch is in both budgets, and which one closed it (plan's record)
        tokens = r["real_tokens"] if strategy == "packed" else r["rows"] * r["row_len"]  # padding counted
        assert r["token_fill"] == pytest.approx(tokens / smoke.sampler.token_budget)
        assert r["query_fill"] == pytest.approx(r["blocks"] * smoke.model.block_size / blocks)
        assert r["bound_tokens"] in (0.0, 1.0) and r["bound_blocks"] in (0.0, 1.0)
        assert r["bound_tokens"] or r["bound_blocks"] or r["token_fill"] < 1 and r["query_fill"] < 1
    for key in BUDGET_FIGURES:  # the run's figures: the means of its rows
        assert summary[key] == pytest.approx(np.mean([r[key] for r in rows]), abs=1e-12), key
    if strategy == "packed":  # one row per step, as long as its tokens rounded up to 64 (static: the budget)
        budget = smoke.sampler.token_budget
        assert all(r["bucket"] == -1 and r["rows"] == 1 for r in rows)
        assert [r["row_len"] for r in rows] == [packed_row_len(r["real_tokens"], budget, 0 if static else 64)
                                                for r in rows]
        assert summary["padded_tokens"] == sum(r["row_len"] for r in rows)


def test_static_shapes_pad_every_batch_to_its_bucket_edge_within_the_budget(tmp_path):
    from dflash_lib.data import build_token_store_from_config
    from dflash_lib.train.build import bucket_edges, static_batch_sizes
    from dflash_lib.train.loop import train

    assert static_batch_sizes([100, 500, 2048], 2048) == [20, 4, 1]
    assert static_batch_sizes([100, 500], 2048, q=100.0) == [10, 1]  # costs 100 + 100^2/100 and 500 + 2500
    with pytest.raises(ConfigError, match="static_shapes needs strategy 'bucketed'"):
        from_params({"strategy": "sorted", "static_shapes": True}, preset("smoke"))
    config = from_params({"static_shapes": True, "steps": 4}, preset("smoke"))
    run_dir = tmp_path / "static"
    train(config, run_dir)
    rows = metrics_rows(run_dir)
    edges = bucket_edges(config, np.asarray(build_token_store_from_config(config.data, progress=False).lengths))
    sizes = static_batch_sizes(edges, config.sampler.token_budget)
    for r in rows:  # (a batch may lose rows to validation, never gain any)
        assert r["row_len"] == edges[r["bucket"]] and r["rows"] <= sizes[r["bucket"]]
        assert r["rows"] * r["row_len"] <= config.sampler.token_budget


def two_ranks(tmp_path: Path, script_text: str, run_dir: Path) -> tuple[list[dict], str]:
    """Run `script_text` under torchrun on 2 CPU ranks (argument: run_dir): each rank's rank<r>.json in rank order,
    and what the job printed."""
    import os
    import subprocess
    import sys

    script = tmp_path / "two_ranks.py"
    script.write_text(script_text)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(script),
           str(run_dir)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)], proc.stdout


DDP_SCRIPT = """
import json, sys
from pathlib import Path
from dflash_lib.config import from_params, preset
from dflash_lib.train import distributed
from dflash_lib.train.build import build_parts
from dflash_lib.train.loop import run_training

config = from_params({"steps": 3, "log_every": 1}, preset("smoke"))
dist = distributed.init_distributed(timeout_s=60, device="cpu")
parts = build_parts(config, dist.device)
first = [parts.sampler.epoch_plan(0).batch(s, dist.rank) for s in range(3)]  # this rank's first batches
summary = run_training(config, parts, Path(sys.argv[1]))
checksum = sum(float(p.detach().double().sum()) for p in parts.drafter.parameters() if p.requires_grad)
tokens = [int(parts.lengths[b].sum()) for b in first]
result = {"rank": dist.rank, "checksum": checksum, "steps": summary.steps, "tokens": tokens}
(Path(sys.argv[1]).parent / f"rank{dist.rank}.json").write_text(json.dumps(result))  # not stdout: ranks interleave
distributed.destroy()  # as train() does: a process group left to interpreter exit can abort (SIGABRT) there
"""


@pytest.mark.slow
def test_two_ranks_stay_in_sync(tmp_path):
    """torchrun, 2 gloo ranks on different shards: statistics are summed over ranks, gradients too (the two
    drafters end identical), and rank 0 alone logs and writes."""
    run_dir = tmp_path / "run"
    results, stdout = two_ranks(tmp_path, DDP_SCRIPT, run_dir)
    assert [r["rank"] for r in results] == [0, 1] and all(r["steps"] == 3 for r in results)
    assert results[0]["checksum"] == pytest.approx(results[1]["checksum"], rel=1e-12)
    rows = metrics_rows(run_dir)
    served = [r["real_tokens"] + r["skipped_tokens"] for r in rows]  # samples failing validation are left out
    assert served == [a + b for a, b in zip(results[0]["tokens"], results[1]["tokens"])]
    assert results[0]["tokens"] != results[1]["tokens"]  # the ranks really saw different data
    assert json.loads((run_dir / "summary.json").read_text())["world_size"] == 2
    log_lines = [line for line in stdout.splitlines() if line.startswith("step ") and " | loss " in line]
    assert len(log_lines) == 3  # printed by rank 0 only


DDP_EMPTY_SCRIPT = """
import json, sys
from pathlib import Path
import numpy as np
from dflash_lib.config import from_params, preset
from dflash_lib.train import distributed
from dflash_lib.train.build import build_parts
from dflash_lib.train.loop import run_training


class Silenced:
    # the training view with the samples in `indices` left without an assistant token

    def __init__(self, store, indices):
        self.store, self.indices = store, set(indices)

    def __len__(self):
        return len(self.store)

    def __getitem__(self, i):
        tok, mask = self.store[i]
        return (tok, np.zeros_like(mask)) if i in self.indices else (tok, mask)


config = from_params({"steps": 3, "log_every": 1}, preset("smoke"))
dist = distributed.init_distributed(timeout_s=60, device="cpu")
parts = build_parts(config, dist.device)
plan = parts.sampler.epoch_plan(0)
# sampler step 1: nothing on either shard (no step); sampler step 2: nothing on shard 1 only (a step)
parts.store = Silenced(parts.store, plan.batch(1, 0) + plan.batch(1, 1) + plan.batch(2, 1))
summary = run_training(config, parts, Path(sys.argv[1]))
checksum = sum(float(p.detach().double().sum()) for p in parts.drafter.parameters() if p.requires_grad)
result = {"rank": dist.rank, "checksum": checksum, "steps": summary.steps, "empty": summary.empty_batches,
          "step2_tokens": [int(parts.lengths[plan.batch(2, d)].sum()) for d in (0, 1)]}
(Path(sys.argv[1]).parent / f"rank{dist.rank}.json").write_text(json.dumps(result))
distributed.destroy()
"""


@pytest.mark.slow
def test_two_ranks_agree_that_a_sampler_step_with_nothing_to_score_is_no_step(tmp_path):
    """torchrun, 2 gloo ranks: sampler step 1 has nothing to score on either rank, so neither steps (the run's
    3 steps are sampler steps 0, 2 and 3); sampler step 2 has nothing on rank 1 only, a step both take (rank 1
    joins the gradient reduction with its filler): the two drafters end identical."""
    run_dir = tmp_path / "run"
    results, stdout = two_ranks(tmp_path, DDP_EMPTY_SCRIPT, run_dir)
    assert [(r["steps"], r["empty"]) for r in results] == [(3, 1), (3, 1)]
    assert results[0]["checksum"] == pytest.approx(results[1]["checksum"], rel=1e-12)
    rows = metrics_rows(run_dir)
    assert [r["step"] for r in rows] == [1, 2, 3] and not any(r["skipped"] for r in rows)
    shard0, shard1 = results[0]["step2_tokens"]  # step 2 = sampler step 2: rank 1's samples all left out
    assert rows[1]["real_tokens"] + rows[1]["skipped_tokens"] == shard0 + shard1
    assert 0 < rows[1]["real_tokens"] <= shard0 and rows[1]["skipped_tokens"] >= shard1
    said = [line for line in stdout.splitlines() if "nothing to score" in line]
    assert len(said) == 1 and said[0].startswith("epoch 0, sampler step 1: nothing to score")  # rank 0 says it


def test_epoch_batches_split_the_same_global_steps_over_any_world_size():
    """The sampler is planned for D = 2 data shards; 1, 2 or 3 ranks take the same (step, shard, batch) work and
    cut the same optimizer steps (a rank with no shard gets one empty item per sampler step)."""
    from dflash_lib.plan.sampler import RandomShuffleSampler
    from dflash_lib.train.distributed import rank_shards

    lengths = np.random.default_rng(0).integers(20, 200, size=120)
    sampler = RandomShuffleSampler(lengths, 600, seed=3, rank=0, world_size=2)

    def work(world: int, rank: int) -> list:
        return list(epoch_batches(sampler, 30, shards=rank_shards(rank, world, 2), lengths=lengths,
                                  accum_tokens=700, data_shards=2))

    one = work(1, 0)
    assert {w.shard for w in one} == {0, 1} and len(one) == 60
    ends = [(w.epoch, w.step) for w in one if w.step_end]
    assert 1 < len(ends) < 30  # several sampler steps per optimizer step
    for world in (2, 3):
        per_rank = [work(world, r) for r in range(world)]
        served = sorted((w.epoch, w.step, w.shard, tuple(w.indices)) for ws in per_rank for w in ws if w.shard >= 0)
        assert served == sorted((w.epoch, w.step, w.shard, tuple(w.indices)) for w in one)
        for ws in per_rank:
            assert [(w.epoch, w.step) for w in ws if w.step_end] == ends  # the same steps on every rank
            assert sum(w.last_shard for w in ws) == 30  # one per sampler step
    idle = work(3, 2)
    assert [w.shard for w in idle] == [-1] * 30 and all(w.indices == [] for w in idle)


def test_precision_bf16_runs_the_target_in_bf16_and_the_drafter_under_autocast_on_cpu(tmp_path):
    """`-p precision bf16` on a CPU: the frozen target's weights in bf16, the drafter's fp32 master weights
    trained under bf16 autocast; its first loss within bf16 rounding of fp32's, both finite (same seed, same
    batches); "auto" on a CPU is fp32."""
    from dflash_lib.config import uses_bf16
    from dflash_lib.train.build import build_parts

    assert not uses_bf16("auto", "cpu") and uses_bf16("auto", torch.device("cuda", 0))
    assert uses_bf16("bf16", "cpu") and not uses_bf16("fp32", "cuda")
    first = {}
    for precision in ("fp32", "bf16"):
        config = from_params(dict(precision=precision, steps=2), preset("smoke"))
        parts = build_parts(config, torch.device("cpu"))
        want = torch.bfloat16 if precision == "bf16" else torch.float32
        assert {p.dtype for p in parts.targets[0].parameters()} == {want}
        assert {p.dtype for p in parts.drafter.parameters() if p.requires_grad} == {torch.float32}
        run_training(config, parts, tmp_path / precision)
        rows = metrics_rows(tmp_path / precision)
        assert len(rows) == 2 and all(math.isfinite(r["loss"]) for r in rows)
        first[precision] = rows[0]["loss"]
    assert first["bf16"] != first["fp32"]  # the drafter ran in bf16: not the fp32 result to the last bit
    assert first["bf16"] == pytest.approx(first["fp32"], rel=0.05)
