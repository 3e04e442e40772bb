"""The demo target: a mapped (shrunk) vocabulary as a tokenizer, and a small Qwen3 trained on the corpus's training
split, cached atomically, loadable as a local target, and a drafter that trains against it."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from dflash_lib.config import ConfigError, ModelConfig, from_params, preset
from dflash_lib.data import build_token_store_from_config, get_template, load_tokenizer, tokenizer_identity
from dflash_lib.data.readers import DataError
from dflash_lib.data.split import split_store
from dflash_lib.data.tokenizers import MASK_MARKER, UNK_MARKER, MappedTokenizer, MappedVocab
from dflash_lib.lab import demo_target as dt
from dflash_lib.target.local import TargetModel
from run_folder import metrics_rows

# Tiny: a 32-hidden, 2-layer target, 25 steps of 512 tokens. vocab_size above the ids the training split holds,
# so every training id is kept and an id held-out samples alone contain can only be UNK.
SETTINGS = dt.DemoTargetSettings(vocab_size=16384, steps=25, tokens_per_step=512, seq_len=64, lr=1e-2,
                                 warmup_steps=3, eval_samples=6, log_every=10)


def demo_config(tmp):
    return from_params(dict(limit=200, cache_dir=str(tmp / "token_stores"), heldout_fraction=0.05), preset("smoke"))


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("demo_target")
    cfg = demo_config(tmp)
    folder = dt.ensure_demo_target(cfg, SETTINGS, progress=False)
    return cfg, folder, json.loads((folder / dt.TRAINING_FILE).read_text())


# -- the mapped tokenizer -------------------------------------------------------------------------------------------


def small_vocab_folder(tmp_path, base, text: str):
    """A mapped vocabulary keeping the chat specials and the first 5 base ids of `text` (the rest: UNK)."""
    specials = [base.special_id(t) for t in ("<|im_start|>", "<|im_end|>", "<|endoftext|>")]
    words = [int(i) for i in base.encode_texts([text], [None])[0][0]]
    kept = tuple(dict.fromkeys(specials + words[:5]))
    MappedVocab("qwen", kept, tokenizer_identity("qwen")).write(tmp_path)
    return kept, words


def test_mapped_tokenizer_round_trip_specials_unk_and_mask(tmp_path):
    base = load_tokenizer("qwen")
    text = "The cat sat on the mat, and then the dog barked loudly."
    kept, words = small_vocab_folder(tmp_path, base, text)
    tok = load_tokenizer(str(tmp_path))
    assert isinstance(tok, MappedTokenizer)
    assert (tok.unk_id, tok.mask_id, tok.n_vocab, tok.vocab_size) == (len(kept), len(kept) + 1, len(kept) + 1,
                                                                       len(kept) + 2)
    # specials keep their strings and map to their kept position; eos/pad mapped
    for s in ("<|im_start|>", "<|im_end|>"):
        assert tok.special_id(s) == kept.index(base.special_id(s))
    assert (tok.eos_id, tok.pad_id) == (kept.index(base.eos_id), kept.index(base.pad_id))
    assert "<|im_start|>" in tok.special_strings and "<|extra_0|>" not in tok.special_strings
    # a conversation: the same segmentation and loss mask as the base, ids mapped, rare ids -> UNK
    segments = get_template("chatml", tok).segments((("user", text), ("assistant", text)))
    ids, mask = tok.encode_segments(segments)
    base_ids, base_mask = base.encode_segments(segments)
    assert len(ids) == len(base_ids) and np.array_equal(mask, base_mask)
    expect = np.array([kept.index(int(i)) if int(i) in kept else len(kept) for i in base_ids])
    assert np.array_equal(ids, expect)
    assert (ids == tok.unk_id).sum() > 0 and (ids == tok.mask_id).sum() == 0 and ids.max() < tok.n_vocab
    # decode: kept runs exactly, UNK and MASK as visible markers
    kept_ids = [kept.index(w) for w in words[:5]]
    assert tok.decode(kept_ids) == base.decode(words[:5])
    assert tok.decode(kept_ids + [tok.unk_id, tok.mask_id]) == base.decode(words[:5]) + UNK_MARKER + MASK_MARKER
    with pytest.raises(DataError, match=str(tok.vocab_size)):
        tok.decode([tok.vocab_size])
    # identity: not the base's; another kept list is another identity
    ident = tokenizer_identity(str(tmp_path))
    assert ident["name"] == "mapped" and ident["base"] == tokenizer_identity("qwen")
    (tmp_path / "other").mkdir()
    MappedVocab("qwen", kept[:-1], tokenizer_identity("qwen")).write(tmp_path / "other")
    assert tokenizer_identity(str(tmp_path / "other")) != ident


def test_mapped_vocabulary_refuses_bad_files(tmp_path):
    (tmp_path / "dflash_vocab.json").write_text(json.dumps(dict(format="other", kept=[1])))
    with pytest.raises(DataError, match="dflash_vocab.json: format"):
        load_tokenizer(str(tmp_path))
    MappedVocab("qwen", (1, 2), tokenizer_identity("qwen")).write(tmp_path)  # no chat specials kept
    with pytest.raises(DataError, match="eos token"):
        load_tokenizer(str(tmp_path))


@pytest.mark.slow
def test_mapped_store_never_collides_with_the_base_store(built):
    cfg, folder, _ = built
    base_store = build_token_store_from_config(cfg.data, progress=False)
    mapped_store = build_token_store_from_config(from_params(dict(tokenizer=str(folder)), cfg).data, progress=False)
    assert mapped_store.path != base_store.path
    tok = load_tokenizer(str(folder))
    assert mapped_store.meta["tokenizer"]["vocab_size"] == tok.vocab_size
    assert np.array_equal(mapped_store.lengths, base_store.lengths)
    for i in (0, len(base_store) // 2, len(base_store) - 1):  # the same tokens, mapped id by id
        assert np.array_equal(mapped_store[i][0], tok.map_ids(base_store[i][0]))
        assert np.array_equal(mapped_store[i][1], base_store[i][1])


# -- the build ------------------------------------------------------------------------------------------------------


def test_trained_target_learns_and_records_its_build(built):
    cfg, folder, rec = built
    v = rec["vocab"]["size"]
    assert rec["steps"] == SETTINGS.steps and len(rec["history"]) == SETTINGS.steps
    assert rec["tokens"] == SETTINGS.steps * SETTINGS.tokens_per_step
    assert rec["loss_first"] == pytest.approx(math.log(v), abs=0.5)  # an untrained model: about uniform
    assert rec["loss_last"] < rec["loss_first"] - 1.0  # nats
    assert rec["heldout_loss_after"] < rec["heldout_loss_before"] - 1.0
    assert json.loads((folder / "config.json").read_text())["vocab_size"] == v == MappedVocab.read(folder).vocab_size


def test_heldout_samples_are_unseen_by_the_target(built):
    cfg, folder, rec = built
    store = build_token_store_from_config(cfg.data, progress=False)
    split = split_store(store, cfg.data.heldout_fraction)
    assert len(split.heldout) > 0
    assert (rec["data"]["train_samples"], rec["data"]["heldout_samples"]) == (len(split.train), len(split.heldout))
    assert rec["data"]["train_tokens"] == int(store.lengths[split.train].sum())
    train_ids = set(np.unique(np.concatenate([store[int(i)][0] for i in split.train])).tolist())
    held_ids = set(np.unique(np.concatenate([store[int(i)][0] for i in split.heldout])).tolist())
    kept = set(MappedVocab.read(folder).kept)
    assert len(kept) < SETTINGS.vocab_size - 2  # room to spare: every id the training split holds is kept ...
    assert train_ids <= kept
    only_held = held_ids - train_ids
    assert only_held and not only_held & kept  # ... and no id that only held-out samples hold


def test_build_is_cached_and_a_leftover_temp_folder_is_ignored(built, monkeypatch):
    cfg, folder, _ = built
    mtime = (folder / dt.TRAINING_FILE).stat().st_mtime_ns
    (folder.parent / f".{folder.name}.leftover").mkdir()  # a killed build's temp folder
    (folder.parent / f".{folder.name}.leftover" / "config.json").write_text("{}")
    calls = []
    monkeypatch.setattr(dt, "train_lm", lambda *a, **k: calls.append(1))
    assert dt.ensure_demo_target(cfg, SETTINGS, progress=False) == folder
    assert calls == [] and (folder / dt.TRAINING_FILE).stat().st_mtime_ns == mtime
    other = dt.DemoTargetSettings(**{**SETTINGS.__dict__, "seed": 1})
    assert dt.demo_target_key(cfg, other) != folder.name  # every setting is in the key


def test_a_killed_build_leaves_nothing_that_looks_cached(tmp_path, monkeypatch):
    cfg = demo_config(tmp_path)
    key = dt.demo_target_key(cfg, SETTINGS)
    stale = tmp_path / "demo_targets" / f".{key}.stale"  # a temp folder of an earlier killed build
    stale.mkdir(parents=True)

    def killed(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(dt, "train_lm", killed)
    with pytest.raises(KeyboardInterrupt):
        dt.ensure_demo_target(cfg, SETTINGS, progress=False)
    assert sorted(p.name for p in (tmp_path / "demo_targets").iterdir()) == [stale.name]


@pytest.mark.slow
def test_the_build_is_deterministic(built, tmp_path):
    cfg, folder, rec = built
    small = dt.DemoTargetSettings(**{**SETTINGS.__dict__, "steps": 4})
    a = dt.ensure_demo_target(cfg, small, cache_dir=tmp_path / "a", progress=False)
    b = dt.ensure_demo_target(cfg, small, cache_dir=tmp_path / "b", progress=False)
    ra, rb = (json.loads((p / dt.TRAINING_FILE).read_text()) for p in (a, b))
    assert [h["loss"] for h in ra["history"]] == [h["loss"] for h in rb["history"]]
    assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()


def test_settings_from_the_command_line_are_checked():
    assert dt.DemoTargetSettings.from_pairs([["steps", "7"], ["lr", "0.002"]]) == \
        dt.DemoTargetSettings(steps=7, lr=0.002)
    with pytest.raises(ConfigError, match="'stepz'"):
        dt.DemoTargetSettings.from_pairs([["stepz", "7"]])
    with pytest.raises(ConfigError, match="steps must be int"):
        dt.DemoTargetSettings.from_pairs([["steps", "7.5"]])
    with pytest.raises(ConfigError, match="vocab_size"):
        dt.DemoTargetSettings(vocab_size=4)


# -- the folder as a target -----------------------------------------------------------------------------------------


def test_folder_loads_as_a_local_target_with_the_loss_it_was_trained_to(built):
    cfg, folder, rec = built
    target = TargetModel.from_model_config(ModelConfig(target=str(folder), num_features=1))
    assert (target.vocab_size, target.hidden_size, target.num_layers) == (
        rec["vocab"]["size"], cfg.model.hidden_size, cfg.model.target_layers)
    store = build_token_store_from_config(cfg.data, progress=False)
    split = split_store(store, cfg.data.heldout_fraction)
    tok = load_tokenizer(str(folder))
    docs = [(tok.map_ids(store[int(i)][0]), store[int(i)][1]) for i in split.heldout[: SETTINGS.eval_samples]]
    after = dt.document_loss(target.model, docs, tok.unk_id)["loss"]
    assert after == pytest.approx(rec["heldout_loss_after"], rel=1e-5)
    assert dt.demo_target_params(folder) == dict(target=str(folder), tokenizer=str(folder),
                                                 mask_id=rec["vocab"]["mask_id"])


def test_drafter_trains_against_the_demo_target(built, tmp_path, capsys):
    from dflash_lib.data.validation import TOKEN_OUT_OF_VOCAB
    from dflash_lib.train.loop import train

    cfg, folder, rec = built
    config = from_params(dict(**dt.demo_target_params(folder), steps=3, eval_samples=0), cfg)
    summary = train(config, tmp_path / "run")
    rows = metrics_rows(tmp_path / "run")
    assert [r["step"] for r in rows] == [1, 2, 3] and all(math.isfinite(r["loss"]) for r in rows)
    assert math.isfinite(summary.final_loss)
    assert TOKEN_OUT_OF_VOCAB not in capsys.readouterr().out  # every id of the mapped store is in the target's range


def test_command_line_prints_the_cached_folder(built, capsys):
    from dflash_lib.__main__ import main

    cfg, folder, _ = built
    pairs = [x for k, v in SETTINGS.__dict__.items() if v != getattr(dt.DemoTargetSettings(), k)
             for x in ("--set", k, str(v))]
    assert main(["demo-target", "--preset", "smoke", "-p", "limit", "200", "-p", "cache_dir", cfg.data.cache_dir,
                 "-p", "heldout_fraction", "0.05", *pairs]) == 0
    assert capsys.readouterr().out.strip().splitlines()[-1] == str(folder)
    assert main(["demo-target", "--set", "stepz", "1"]) == 2



# -- the drafter's training data: the target's answers --------------------------------------------------------------


def test_answers_are_the_targets_own_exactly_n_tokens_and_cached(built, monkeypatch):
    """The first user turn of `records` conversations answered by the demo target, every answer exactly
    new_tokens long (the end of turn masked before), in the mapped tokenizer's tokens; a second call reuses it, a
    stopped build resumes."""
    from dflash_lib import regenerate as rg
    from dflash_lib.data import load_conversations
    from dflash_lib.regenerate import leading_assistant_turns

    cfg, folder, _ = built
    s = dt.DemoAnswerSettings(records=12, new_tokens=5, gen_batch=5, gen_tokens=4096)
    out = dt.ensure_demo_answers(cfg, folder, s, progress=False)
    assert out.parent == folder / "answers"
    recs = [json.loads(x) for x in out.read_text().split("\n") if x]  # (not splitlines: U+2028 may be in a text)
    opens_with_user = [c.record for c in load_conversations(cfg.data.source, 20) if not leading_assistant_turns(c)]
    assert len(opens_with_user) > 12 and [r["record"] for r in recs] == opens_with_user[:12]  # the others read past
    assert all(r["regen"]["completion_tokens"] == 5 and r["messages"][-1]["role"] == "assistant" for r in recs)
    assert all(sum(m["role"] == "assistant" for m in r["messages"]) == 1 for r in recs)  # first turn only
    report = json.loads(rg.report_path(out).read_text())
    assert report["settings"]["target"] == str(folder) and report["settings"]["min_new_tokens"] == 5
    assert report["run"]["skipped_leading_assistant"] == opens_with_user[11] + 1 - 12
    assert len(list(load_conversations(str(out)))) == 12  # a source a run reads

    mtime = out.stat().st_mtime_ns
    monkeypatch.setattr(dt, "regenerate", lambda *a, **k: pytest.fail("a complete file was regenerated"))
    assert dt.ensure_demo_answers(cfg, folder, s, progress=False) == out and out.stat().st_mtime_ns == mtime
    monkeypatch.undo()

    full = out.read_bytes()
    out.write_bytes(b"".join(full.splitlines(keepends=True)[:7]))  # a build stopped after 7 records ...
    rg.report_path(out).write_text(json.dumps({**report, "run": {"status": "running"}}))
    assert dt.ensure_demo_answers(cfg, folder, s, progress=False) == out
    assert out.read_bytes() == full  # ... resumes to the same file


def test_answer_settings_are_checked_and_change_the_file(built):
    cfg, folder, _ = built
    with pytest.raises(ConfigError, match="new_tokens"):
        dt.DemoAnswerSettings(new_tokens=0)
    with pytest.raises(ConfigError, match="heldout_fraction"):
        dt.DemoAnswerSettings(heldout_fraction=1.0)
    with pytest.raises(ConfigError, match="backend must be 'local' or 'vllm', got 'sglang'"):
        dt.DemoAnswerSettings(backend="sglang")
    with pytest.raises(ConfigError, match="max_len must be >= 0"):
        dt.DemoAnswerSettings(max_len=-1)
    with pytest.raises(ConfigError, match="concurrency must be > 0"):
        dt.DemoAnswerSettings(concurrency=0)
    # the engine serves a Hugging Face tokenizer's chat template, not the tiny target's mapped vocabulary: refused
    # before any server starts or file is written
    with pytest.raises(ConfigError, match="backend 'vllm' serves the target's own Hugging Face tokenizer"):
        dt.ensure_demo_answers(cfg, folder, dt.DemoAnswerSettings(backend="vllm"), progress=False)
    assert not list((folder / "answers").glob("*engine*"))
    free = dt.answers_config(cfg, folder, dt.DemoAnswerSettings(records=9, new_tokens=7, free_end=True, max_len=300,
                                                                backend="vllm", concurrency=3))
    assert (free.regenerate.max_new_tokens, free.regenerate.min_new_tokens, free.data.max_len) == (7, 0, 300)
    assert (free.regenerate.backend, free.regenerate.concurrency) == ("openai", 3)
    rc = dt.answers_config(cfg, folder, dt.DemoAnswerSettings(records=9, new_tokens=7))
    r = rc.regenerate
    assert (rc.data.limit, r.max_turns, r.max_new_tokens, r.min_new_tokens, r.temperature) == (
        dt.records_to_read(cfg.data.source, 9), 1, 7, 7, 0.0)
    assert rc.data.limit > 9  # 9 conversations that open with a user turn lie further in (records 4, 5 do not)
    assert (rc.model.target, rc.data.tokenizer) == (str(folder), str(folder))
