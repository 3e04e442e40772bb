"""Speculative decoding on KV caches (target's Hugging Face cache, drafter's per-layer context cache) and the
`evaluate` command: exact greedy output, cached drafting equal to the uncached reference, per-cycle work
independent of the prefix length, the command's JSON."""

from __future__ import annotations

import json
import shutil
from dataclasses import fields

import numpy as np
import pytest
import torch

from dflash_lib.__main__ import main
from dflash_lib.config import from_params
from dflash_lib.evaluate import DecodeReport, DrafterMeasurement, RunEvaluation
from dflash_lib.evaluate.acceptance import TargetCache, acceptance_length, greedy_decode
from dflash_lib.models import DFlashDrafter, tiny_qwen3_config
from dflash_lib.target.local import TargetModel
from fp_tolerance import assert_equal_but_near_ties
from tiny_models import SMALL_STORE, decode_drafter, decode_target, overfit_on_greedy, random_prompts, save_tiny_run

VOCAB, B, NEW = 256, 4, 16


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: tiny matmuls run faster on one thread


@pytest.fixture(scope="module")
def target() -> TargetModel:
    return decode_target(VOCAB)


def _drafter(target: TargetModel, seed: int = 0) -> DFlashDrafter:
    return decode_drafter(target, B, seed)


def _prompts(n: int, seed: int, longest: int = 8) -> list[list[int]]:
    return random_prompts(n, seed, VOCAB, longest)


@pytest.fixture(scope="module")
def overfit(target):
    """A drafter overfit on the target's own greedy continuations (what test_models_decode does)."""
    prompts = _prompts(4, seed=1)
    drafter = _drafter(target)
    _, _, conts, _ = overfit_on_greedy(target, drafter, prompts, NEW + B, steps=120)
    return drafter, prompts, conts


def test_target_cache_equals_the_full_forward(target):
    ids = torch.tensor(_prompts(1, seed=3, longest=30)[0] + list(range(20)))
    full = target.step(ids)
    tc = TargetCache(target)
    got = [tc.forward(ids[:9]), tc.forward(ids[9:13])]
    tc.crop(11)  # drop positions 11, 12: they are computed again below, against the cropped cache
    got.append(tc.forward(ids[11:]))
    feats = torch.cat([got[0].features, got[1].features[:2], got[2].features])
    logits = torch.cat([got[0].logits, got[1].logits[:2], got[2].logits])
    torch.testing.assert_close(feats, full.features, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(logits, full.logits, atol=1e-5, rtol=1e-5)
    assert tc.length == len(ids) and tc.cache.get_seq_length() == len(ids)


def test_cached_draft_equals_uncached_draft_logits(target):
    drafter = _drafter(target, seed=4)
    ids = torch.tensor(_prompts(1, seed=4, longest=2)[0] * 0 + list(range(3, 143)))  # (140,)
    feats = target.step(ids).features  # (140, F*H)
    cache, pos = drafter.context_cache(), 0
    for n in (1, 3, 4, 1, 57, 2, 70):  # crosses the buffer growth at 64 and 128 positions
        drafter.extend_context(cache, feats[pos:pos + n])
        pos += n
        block = torch.full((B,), VOCAB - 1)
        block[0] = int(ids[pos]) if pos < len(ids) else 0
        got = drafter.draft_logits_cached(cache, block)
        want = drafter.draft_logits(feats, pos, block)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        assert torch.equal(got.argmax(-1), want.argmax(-1))
        assert drafter.draft_cached(cache, int(block[0])) == drafter.draft(feats, pos, int(block[0]))
    assert cache.length == 138 and cache.keys[0].shape[2] == 256


def test_cached_decoding_is_the_targets_greedy_untrained_and_overfit(target, overfit):
    prompts = _prompts(3, seed=2)
    res = acceptance_length(target, _drafter(target, seed=3), prompts, NEW)
    base = greedy_decode(target, prompts, NEW)
    assert res.outputs == base.outputs == [target.greedy(p, NEW) for p in prompts]
    assert 1.0 <= res.tau < 1.5 and res.cycles == sum(res.histogram.values())
    assert res.target_calls == len(prompts) + res.cycles and len(res.per_position) == B - 1

    drafter, prompts, conts = overfit
    mixed = prompts + _prompts(1, seed=9)  # an unseen prompt: rejections mixed in
    res = acceptance_length(target, drafter, mixed, NEW + B)
    assert res.outputs == greedy_decode(target, mixed, NEW + B).outputs
    assert res.outputs[:len(prompts)] == [c[:NEW + B] for c in conts]
    assert res.tau >= 0.6 * B and 1 in res.histogram and B in res.histogram
    hist = res.histogram  # per-position acceptance: the share of cycles that accepted at least k drafts
    assert res.per_position == pytest.approx([sum(v for n, v in hist.items() if n > k) / res.cycles
                                              for k in range(1, B)])
    assert res.per_position == sorted(res.per_position, reverse=True)
    assert res.target_calls_per_token < 0.5


def test_stop_ids_end_the_output_the_same_way(target):
    prompt = _prompts(1, seed=6)[0]
    full = target.greedy(prompt, NEW)
    stop = full[5]
    res = acceptance_length(target, _drafter(target), [prompt], NEW, stop_ids=[stop])
    assert res.outputs == greedy_decode(target, [prompt], NEW, stop_ids=[stop]).outputs
    assert res.outputs[0] == full[:full.index(stop) + 1]


def test_greedy_masks_stop_ids_exactly_before_min_new_tokens():
    """Rows are output tokens first .. first+T-1; stop ids may win only from output token min_new_tokens on.
    Every row's argmax is the stop id 3 (runner-up 1): the expectation is written out, not computed by _greedy."""
    from dflash_lib.evaluate.acceptance import _greedy

    logits = torch.zeros(4, 5)
    logits[:, 3], logits[:, 1] = 2.0, 1.0  # (T=4, V=5)
    assert _greedy(logits, 5, 7, frozenset({3})) == [1, 1, 3, 3]  # output tokens 5, 6 masked; 7, 8 free
    assert _greedy(logits, 7, 7, frozenset({3})) == [3, 3, 3, 3]
    assert _greedy(logits, 0, 0, frozenset({3})) == [3, 3, 3, 3]
    assert _greedy(logits, 0, 9, frozenset({3})) == [1, 1, 1, 1]
    assert _greedy(logits, 0, 9, frozenset()) == [3, 3, 3, 3]
    assert logits[0, 3] == 2.0  # the caller's logits are left as they were


def test_min_new_tokens_keeps_stop_ids_out_of_the_first_tokens(target):
    """A stop id the target would emit early is masked out of the first min_new_tokens tokens, the same way by
    speculative and plain decoding; after them it stops the answer again."""
    prompt = _prompts(1, seed=6)[0]
    full = target.greedy(prompt, NEW)
    stop = full[2]
    assert full.index(stop) == 2
    free = greedy_decode(target, [prompt], NEW, stop_ids=[stop]).outputs[0]
    assert free == full[:3]
    for min_new in (NEW, 7):
        base = greedy_decode(target, [prompt], NEW, stop_ids=[stop], min_new_tokens=min_new).outputs[0]
        res = acceptance_length(target, _drafter(target), [prompt], NEW, stop_ids=[stop], min_new_tokens=min_new)
        assert res.outputs[0] == base
        assert stop not in base[:min_new]
        assert len(base) == NEW or base[-1] == stop and len(base) > min_new
    assert len(greedy_decode(target, [prompt], NEW, [stop], min_new_tokens=NEW).outputs[0]) == NEW


class _Scripted:
    """A real drafter doing all its work (context cache, block forward) whose proposals are then replaced by the
    target's true continuation with draft slot (cycle % B) corrupted: cycle c accepts exactly min(c % B, B-1)
    drafts, whatever the prefix, so two prefixes give the same cycles."""

    def __init__(self, drafter: DFlashDrafter, reference: list[int]):
        self.drafter, self.reference, self.cycle = drafter, reference, 0

    def context_cache(self):
        return self.drafter.context_cache()

    def extend_context(self, cache, features):
        self.drafter.extend_context(cache, features)

    def draft_cached(self, cache, anchor_token):
        self.drafter.draft_cached(cache, anchor_token)
        true = self.reference[cache.length + 1: cache.length + B]  # the anchor sits at position cache.length
        j, self.cycle = self.cycle % B, self.cycle + 1
        return [(t + 1) % VOCAB if i == j else t for i, t in enumerate(true)]


def test_work_per_cycle_does_not_grow_with_the_prefix(target):
    """Tokens the target's layers, the drafter's fusion (its context K/V input) and its layer-0 k projection run
    per call, at a 10- and a 200-token prefix."""
    rng = np.random.default_rng(7)
    work = {}
    for length in (10, 200):
        prompt = rng.integers(0, VOCAB - 1, length).tolist()
        reference = prompt + greedy_decode(target, [prompt], 4 * B).outputs[0]
        drafter = _Scripted(_drafter(target), reference)
        seen = {"target": [], "fc": [], "k_proj": []}
        mods = {"target": target.base.layers[0], "fc": drafter.drafter.fc,
                "k_proj": drafter.drafter.layers[0].self_attn.k_proj}
        hooks = [m.register_forward_pre_hook(lambda m, a, name=name: seen[name].append(a[0].shape[-2]))
                 for name, m in mods.items()]
        try:
            res = acceptance_length(target, drafter, [prompt], 3 * B)
        finally:
            for h in hooks:
                h.remove()
        assert res.outputs[0] == reference[length:length + 3 * B]
        assert seen["target"][0] == seen["fc"][0] == seen["k_proj"][0] == length  # prefill: the counters count
        want = [min(c % B, B - 1) + 1 for c in range(res.cycles)]  # tokens verified per cycle
        assert seen["target"][1:] == [B] * res.cycles  # each verification runs exactly the B new tokens
        assert seen["fc"][1:] == want  # the drafter fuses only the newly verified tokens
        # layer 0's k projection per cycle: an empty layer context (0), the block (B), the verified tokens
        assert seen["k_proj"][1:] == [n for w in want for n in (0, B, w)]
        work[length] = {k: v[1:] for k, v in seen.items()}
    assert work[10] == work[200]


def test_bf16_target_with_fp32_drafter_decodes(target):
    """A bf16 target: the verification forward (B rows) and greedy decoding's one-row forwards run other GEMM
    kernels and round bf16 differently, so the outputs are the greedy ones token for token up to the target's first
    near tie, if any (`assert_equal_but_near_ties`, judged on the full forward of the common prefix); a wrong
    token there is refused."""
    t16 = TargetModel.from_hf_config(tiny_qwen3_config(hidden_size=32, num_layers=4, vocab_size=VOCAB), 1, seed=0)
    t16.model.to(torch.bfloat16)
    drafter = _drafter(t16)
    prompts = _prompts(2, seed=8)
    res = acceptance_length(t16, drafter, prompts, 8)
    assert [len(o) for o in res.outputs] == [8, 8] and res.tau >= 1.0
    for prompt, got, want in zip(prompts, res.outputs, greedy_decode(t16, prompts, 8).outputs):
        def logits_at(i, prefix=prompt + want, start=len(prompt)):
            return t16.step(torch.tensor(prefix[:start + i])).logits[-1]  # (V,) after prompt + want[:i]
        assert_equal_but_near_ties(got, want, logits_at)
        wrong = want[:3] + [(want[3] + 1) % VOCAB] + want[4:]  # a token the target did not choose, accepted
        with pytest.raises(AssertionError, match="token 3 differs .* no near tie"):
            assert_equal_but_near_ties(wrong, want, logits_at)


def test_a_greedy_difference_passes_only_at_a_near_tie():
    """bf16 logits of max |logit| 2: a near tie is within 4 eps * 2 = 1/16 of the max (fp_tolerance.tie_atol)."""
    logits = torch.tensor([2.0, 2.0 - 2 ** -4, 2.0 - 2 ** -3, -2.0], dtype=torch.bfloat16)  # (V=4,)
    def at(i):
        return logits
    assert assert_equal_but_near_ties([3, 1, 0], [3, 1, 0], at) is None
    assert assert_equal_but_near_ties([3, 1, 3], [3, 0, 2], at) == 1  # 1 ties with 0; beyond it: not compared
    assert assert_equal_but_near_ties([3, 0], [3, 1], at) == 1
    for got, want in (([3, 2, 0], [3, 0, 0]), ([3, 3], [3, 0]), ([3, 2], [3, 1])):  # 2 and 3: no tie with the max
        with pytest.raises(AssertionError, match="token 1 differs .* no near tie"):
            assert_equal_but_near_ties(got, want, at)
    with pytest.raises(AssertionError, match="then 2 vs 3"):
        assert_equal_but_near_ties([3, 1], [3, 1, 0], at)  # one stopped early


def test_evaluate_command_prints_the_report_as_its_last_line(tmp_path, capsys):
    run, _ = save_tiny_run(tmp_path)
    args = ["evaluate", "--drafter", run, "--target", "tiny", "-p", "prompts", "2", "-p", "max_new_tokens", "6",
            "-p", "timing_warmup", "false"]
    assert main(args) == 0
    out, err = capsys.readouterr()
    report = json.loads(out.strip().splitlines()[-1])
    # the record's fields, every one but `served` (-p engine vllm only)
    assert set(report) == {f.name for f in fields(DecodeReport)} - {"served"}
    assert DecodeReport.from_json(report).to_json() == report
    assert report["prompts"] == 2 and report["max_new_tokens"] == 6 and report["outputs_equal_baseline"] == 2
    assert 1.0 <= report["tau"] <= 4 and len(report["per_position"]) == 3
    assert report["speedup"] == pytest.approx(report["tokens_per_s"] / report["baseline_tokens_per_s"])
    assert "held-out split of 'sharegpt' (heldout_fraction 0.01" in report["prompt_source"]
    assert report["prompt_source"] in err and "tau" in err and len(report["prompt_indices"]) == 2

    # Without --target: the run's recorded one.
    assert main(["evaluate", "--drafter", run, "-p", "prompts", "1", "-p", "max_new_tokens", "2",
                 "-p", "timing_warmup", "false"]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["target"] == "tiny"

    # The drafter folder outside its run: no run config, so the default tiny target (hidden 64, 2 features) does
    # not fit it; the message names each shape that differs, the drafter's value and the -p that sets it.
    alone = shutil.copytree(tmp_path / "drafter", tmp_path / "elsewhere" / "drafter")
    assert main(["evaluate", "--drafter", str(alone), "--target", "tiny", "-p", "prompts", "1"]) == 2
    assert capsys.readouterr().err == (f"error: drafter {alone} does not fit target 'tiny': drafter hidden size 32 "
                                       f"(the target's 64; -p hidden_size 32), fused features 1 (num_features is 2; "
                                       f"-p num_features 1)\n")
    assert main(["evaluate", "--drafter", str(alone), "--target", "tiny", "-p", "hidden_size", "32",
                 "-p", "target_layers", "2"]) == 2  # (a 2-layer target for 2 features: not the layer-id rule's fault)
    assert capsys.readouterr().err == (f"error: drafter {alone} does not fit target 'tiny': drafter target layers 4 "
                                       f"(the target has 2; -p target_layers 4), fused features 1 (num_features is 2; "
                                       f"-p num_features 1)\n")
    assert main(["evaluate", "--drafter", str(alone)]) == 2
    assert capsys.readouterr().err.startswith("error: --target is required: the drafter is not in a trainer run")
    for bad, message in ((["-p", "prompts", "0"], "prompts must be > 0"),
                         (["-p", "max_new_tokens", "x"], "parameter 'max_new_tokens': cannot parse"),
                         (["-p", "heldout_fraction", "0"], "heldout_fraction is 0"),
                         (["-p", "limit", "20", "-p", "prompts", "1"],  # 0.01 of 20 samples holds out none:
                          "heldout_fraction 0.01 of 20 samples holds out none; train and evaluate with a larger -p "
                          "heldout_fraction (e.g. 0.1)"),  # (not "e.g. 0.01", the value it has)
                         (["-p", "prompts", "400"], "prompts 400: the held-out split holds only"),
                         (["-p", "bogus", "1"], "unknown parameter 'bogus'")):
        assert main(["evaluate", "--drafter", run, "--target", "tiny", *bad]) == 2
        last = capsys.readouterr().err.strip().splitlines()[-1]  # (after "run config from ..." once it is read)
        assert last.startswith("error: ") and message in last
    assert main(["evaluate", "--drafter", str(tmp_path / "nowhere"), "--target", "tiny"]) == 2
    assert "no such directory" in capsys.readouterr().err


# -- held-out prompts and a whole run (notebook 05's library side) ------------------------------------------------
SMOKE_RUN = dict(SMALL_STORE, hidden_size=32, target_layers=2, num_features=1, num_anchors=8, block_size=4,
                 token_budget=2048, k=4, steps=4, ckpt_every=2, eval_every=2, eval_samples=4, log_every=1, prefetch=2,
                 wandb_mode="disabled", prompts=3, max_new_tokens=8, timing_warmup=False)


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory):
    """A real 4-step training run (checkpoints at steps 2 and 4, held-out evaluation at 2 and 4)."""
    from dflash_lib.train.loop import train

    run_dir = tmp_path_factory.mktemp("evaluate") / "train"
    config = from_params(SMOKE_RUN)
    train(config, run_dir)
    return run_dir, config


def test_prompts_are_heldout_samples_cut_before_their_first_assistant_token(smoke_run):
    """The prompts are the first held-out samples (hash order), none of them among the samples the run trained on,
    each a prefix of its sample that ends right before the sample's first loss-masked token."""
    from dflash_lib.data import build_token_store_from_config
    from dflash_lib.data.split import split_store
    from dflash_lib.data.prompts import heldout_prompts

    run_dir, config = smoke_run
    store = build_token_store_from_config(config.data, progress=False)
    split = split_store(store, config.data.heldout_fraction)
    recorded = json.loads((run_dir / "heldout.json").read_text())  # what the trainer held out of its sampler
    assert recorded["indices"] == split.heldout.tolist() and len(split.heldout) >= 3
    trained_on = set(range(len(store))) - set(recorded["indices"])
    assert trained_on == set(split.train.tolist())
    got = heldout_prompts(config, 3)
    from_run = heldout_prompts(config, 3, run_dir)  # the run's heldout.json: the same split
    assert got.indices == from_run.indices and got.prompts == from_run.prompts
    first, seen = [], set()  # the first held-out samples whose prompt is new (identical prompts decode once)
    for i in split.heldout.tolist():
        mask = store[i][1]
        cut = tuple(store[i][0][:int(mask.argmax())].tolist()) if mask.any() and not mask[0] else None
        if cut is not None and cut not in seen:
            first.append(i)
            seen.add(cut)
    assert got.indices == first[:3] and len(set(map(tuple, got.prompts))) == 3
    assert not trained_on & set(got.indices)
    for i, prompt in zip(got.indices, got.prompts):
        tokens, mask = store[i]
        assert prompt == tokens[:len(prompt)].tolist()  # a prefix of the held-out sample ...
        assert not mask[:len(prompt)].any() and mask[len(prompt)]  # ... ending right before its first answer token
    assert got.eos_id == store.meta["tokenizer"]["eos_id"] and got.heldout == len(split.heldout)


def test_the_larger_heldout_fraction_advised_holds_out_twice_the_prompts():
    from dflash_lib.data.prompts import larger_fraction

    assert larger_fraction(0.0, 3, 300) == 0.02 and larger_fraction(1e-6, 3, 1000) == 0.01  # 6 of 300, 10 of 1000
    assert larger_fraction(0.01, 8, 20) == 0.5  # none is enough: the largest above
    assert larger_fraction(0.5, 1, 10) is None  # nothing larger to advise


def test_a_run_whose_store_changed_or_without_a_split_is_refused(smoke_run, tmp_path):
    from dflash_lib.config import ConfigError
    from dflash_lib.data.prompts import heldout_prompts

    run_dir, config = smoke_run
    doc = json.loads((run_dir / "heldout.json").read_text())
    doc["hashes"][0] = f"{(int(doc['hashes'][0], 16) + 1) % 2 ** 64:016x}"
    (tmp_path / "heldout.json").write_text(json.dumps(doc))
    with pytest.raises(ConfigError, match=f"sample {doc['indices'][0]}'s tokens differ from the run's"):
        heldout_prompts(config, 3, tmp_path)
    with pytest.raises(ConfigError, match="heldout_fraction is 0: nothing is held out"):
        heldout_prompts(from_params({**SMOKE_RUN, "heldout_fraction": 0.0}), 3)
    with pytest.raises(ConfigError, match=r"heldout_fraction 1e-06 of \d+ samples holds out none"):
        heldout_prompts(from_params({**SMOKE_RUN, "heldout_fraction": 1e-6}), 3)


def test_untrained_drafter_is_the_one_training_starts_from(smoke_run):
    from dflash_lib.evaluate import initial_drafter
    from dflash_lib.train.build import build_parts

    _, config = smoke_run
    parts = build_parts(config, torch.device("cpu"))
    before = torch.get_rng_state()
    mine = initial_drafter(config, parts.targets[0])
    assert torch.equal(torch.get_rng_state(), before)  # the caller's RNG is left alone
    theirs = dict(parts.drafter.named_parameters())
    assert all(torch.equal(p, theirs[n]) for n, p in mine.named_parameters())


@pytest.mark.slow
def test_evaluate_run_decodes_every_checkpoint_and_exports_the_final_drafter(smoke_run, tmp_path):
    from dflash_lib.evaluate import (RUN_SUMMARY_KEYS, evaluate, evaluate_run, initial_drafter, loss_figures, prepare,
                                     run_summary)
    from dflash_lib.models.export import read_doc
    from dflash_lib.rundir.reader import load_metrics
    from dflash_lib.rundir.records import BUDGET_FIGURES

    run_dir, config = smoke_run
    notebook_run = tmp_path / "nb04"
    shutil.copytree(run_dir, notebook_run / "train")  # notebook 04's layout: the trainer folder is train/
    report = evaluate_run(notebook_run, "tiny", out_dir=tmp_path / "out", say=lambda s: None)
    assert [r.step for r in report.by_step] == [0, 2, 4] and list(report.tau_by_step) == ["0", "2", "4"]
    assert report.by_step[1].drafter == "checkpoints/ckpt-00000002"
    assert report.by_step[2].drafter == "final (drafter/)"  # the step-4 checkpoint IS the final drafter
    assert all(r.outputs_equal_baseline == 3 for r in report.by_step)
    doc = json.loads(json.dumps(report.to_json()))  # JSON-able, every field, and read back the same
    assert set(doc) == {f.name for f in fields(RunEvaluation)} and RunEvaluation.from_json(doc) == report
    # each figure equals decoding that drafter on its own
    setup = prepare(notebook_run / "train", "tiny", say=lambda s: None)
    untrained = acceptance_length(setup.target, initial_drafter(config, setup.target), setup.prompts.prompts, 8,
                                  setup.stop_ids)
    assert report.tau_untrained == untrained.tau == report.tau_by_step["0"]
    alone = evaluate(notebook_run / "train", "tiny", say=lambda s: None)
    assert report.tau_trained == alone.tau and report.final.histogram == alone.histogram
    assert report.prompt_indices == alone.prompt_indices
    # losses from metrics.jsonl; the export loads as a serving folder
    metrics = load_metrics(run_dir)
    assert {k: getattr(report, k) for k in loss_figures(metrics)} == loss_figures(metrics)
    assert report.heldout_steps == [2, 4] and report.heldout_loss_last == metrics["heldout_loss"].iloc[-1]
    assert report.export_files == ["README.md", "config.json", "model.safetensors"]
    assert read_doc(report.export)["torch_dtype"] == "bfloat16" == report.export_config["torch_dtype"]
    summary = run_summary(report)
    assert set(RUN_SUMMARY_KEYS) <= set(summary) and json.loads(json.dumps(summary)) == summary
    assert "served_tau_by_step" not in summary and all(r.served_tau is None for r in report.by_step)  # no engine
    assert (report.best_by, report.best_step) == ("tau", max(report.by_step, key=lambda r: (r.tau, r.step)).step)
    trained = json.loads((run_dir / "summary.json").read_text())  # the run's batch fill, as its trainer summed it up
    assert {k: summary[k] for k in BUDGET_FIGURES} == {k: trained[k] for k in BUDGET_FIGURES}
    assert 0 < summary["token_fill"] <= 1 and 0 < summary["query_fill"] <= 1
    # the final drafter once more, sampled at sampled_temperature 1.0: what `evaluate -p temperature 1` gives it
    hot = evaluate(notebook_run / "train", "tiny", {"temperature": 1.0}, say=lambda s: None)
    s = report.sampled
    assert (s.temperature, s.top_p, s.outputs_equal_baseline, s.prompts) == (1.0, 1.0, None, 3)
    assert (s.tau, s.histogram, s.cycles) == (hot.tau, hot.histogram, hot.cycles)
    assert summary["sampled"]["tau"] == s.tau and summary["sampled"]["benchmarks"][0]["tau"] == s.tau
    assert report.doctor is None and summary["doctor"] is None  # the tiny target is no folder to check against
    quiet = evaluate_run(notebook_run, "tiny", {"sampled_temperature": 0}, say=lambda s: None)
    assert quiet.sampled is None and quiet.tau_trained == report.tau_trained


def test_loss_figures_average_the_ends_and_take_the_heldout_rows():
    import pandas as pd

    from dflash_lib.evaluate import loss_figures

    rows = [{"step": s, "loss": 10.0 - s, "skipped": False} for s in range(1, 21)]
    rows[4]["heldout_loss"], rows[19]["heldout_loss"] = 9.5, 2.5
    rows[0]["skipped"] = True  # a skipped step's loss is not a training loss
    got = loss_figures(pd.DataFrame(rows))
    assert got["loss_window"] == 4  # 19 steps // 4
    assert got["loss_first"] == pytest.approx(sum(10.0 - s for s in (2, 3, 4, 5)) / 4)
    assert got["loss_last"] == pytest.approx(sum(10.0 - s for s in (17, 18, 19, 20)) / 4)
    assert (got["heldout_loss_first"], got["heldout_loss_last"], got["heldout_steps"]) == (9.5, 2.5, [5, 20])
    none = loss_figures(pd.DataFrame([{"step": 1, "loss": 3.0}, {"step": 2, "loss": 1.0}]))
    assert none["loss_window"] == 1 and (none["loss_first"], none["loss_last"]) == (3.0, 1.0)
    assert none["heldout_loss_last"] is None and none["heldout_steps"] == []


def test_evaluation_figures_show_what_they_are_given():
    from dflash_lib.lab.report.evaluation import acceptance, tau_by_step

    by_step = [DrafterMeasurement(step, f"drafter {step}", tau, {}, [], 0, 0, 0.0)
               for step, tau in ((0, 1.0), (20, 1.5), (40, 2.25))]
    fig = tau_by_step(by_step, block_size=8)
    assert list(fig.data[0].x) == [0, 20, 40] and list(fig.data[0].y) == [1.0, 1.5, 2.25]
    fig = acceptance({"1": 6, "3": 2}, [0.25, 0.25, 0.0], block_size=4)
    assert list(fig.data[0].x) == [1, 2, 3, 4] and list(fig.data[0].y) == [0.75, 0.0, 0.25, 0.0]
    assert list(fig.data[1].y) == [0.25, 0.25, 0.0]
    with pytest.raises(ValueError, match="empty histogram"):
        acceptance({}, [], block_size=4)


def test_decoding_runs_on_decode_threads_and_restores_torchs_count(tmp_path, monkeypatch):
    import dflash_lib.evaluate.decoding as evaluate_mod  # evaluate's decoding binds the decoders at import
    import dflash_lib.evaluate.acceptance as acceptance
    from dflash_lib.evaluate import evaluate

    run, _ = save_tiny_run(tmp_path)
    seen = []
    for name in ("acceptance_length", "greedy_decode"):
        real = getattr(acceptance, name)
        monkeypatch.setattr(evaluate_mod, name, lambda *a, real=real, **k: (seen.append(torch.get_num_threads()),
                                                                           real(*a, **k))[1])
    torch.set_num_threads(2)
    try:
        report = evaluate(run, "tiny", {"prompts": 1, "max_new_tokens": 4, "decode_threads": 1}, say=lambda s: None)
        assert seen == [1, 1, 1, 1] and torch.get_num_threads() == 2  # warm-up pair, then the timed pair
        assert report.outputs_equal_baseline == 1
        seen.clear()
        evaluate(run, "tiny", {"prompts": 1, "max_new_tokens": 4, "decode_threads": 0, "timing_warmup": False},
                 say=lambda s: None)
        assert seen == [2, 2]  # 0: torch's own count
    finally:
        torch.set_num_threads(1)  # the module's one_thread fixture


def test_the_judgement_of_an_engine_run_needs_no_engine():
    """`evaluate.served.judge_run`: what `serve.measure.decode_passes` measured, judged beside our decoding with no
    engine at hand: greedy fp32 equal answers and counts PASS; a parted answer FAILs and names the doctor's
    rules; a failed request is a FAIL line with no rows."""
    from dflash_lib.evaluate.served import judge_run
    from dflash_lib.serve.client import ServedDecode, SpecCounters
    from dflash_lib.serve.measure import EngineRun, ServedPass, ServedSet

    ours = ServedSet("s", [[1, 2]], [[5, 6, 7]], [[(2, 2), (4, 1)]])  # 2 cycles: 2 tokens, then 1 (tau 1.5)
    counters = SpecCounters(2, 6, 1, (1, 0, 0))  # the engine: 2 drafts, 1 accepted -> 1.5
    same = ServedDecode([[5, 6, 7]], counters, [counters], 0.5)
    plain = ServedDecode([[5, 6, 7]], SpecCounters(0, 0, 0, ()), [], 1.0)
    passes = [ServedPass([ours])]
    (good,) = judge_run(EngineRun("vllm", "py", "0.31.0", "e.log", served=[[same]], plain=[[plain]]), passes, 4, "float32",
                        "export", "target")
    assert good.lines == ["PASS served s: served tau 1.500 vs ours 1.500 over 2 / 2 cycles (must be equal: greedy "
                          "fp32), answers equal 1/1"]
    assert good.speedup == pytest.approx(2.0) and good.log == "e.log" and good.exact
    parted = ServedDecode([[5, 6, 8]], counters, [counters], 0.5)
    (bad,) = judge_run(EngineRun("vllm", "py", "0.31.0", "", served=[[parted]], plain=[[None]]), passes, 4, "float32",
                       "export", "target", doctor=lambda: ["mask_token_id"])
    assert bad.lines[0].startswith("FAIL served s:") and "answers equal 0/1" in bad.lines[0]
    assert bad.lines[0].endswith("the doctor fails mask_token_id -> python -m dflash_lib doctor export --target target")
    assert bad.speedup is None
    (failed,) = judge_run(EngineRun("vllm", "py", "0.32.1", "", failure="HTTP 500", plain=[[None]]), [ServedPass([ours], 1.0)],
                          4, "float32", "export", "target")
    assert failed.rows == [] and failed.lines[0].startswith("FAIL served: the engine failed a request (HTTP 500)")
