"""Training refuses at start a tokenizer or MASK id its target cannot embed, takes a target folder's own
tokenizer unless `-p tokenizer` says otherwise, and fails (exit 1, no drafter) when nothing is fit for training."""

from __future__ import annotations

import json

import pytest

from dflash_lib import rundir
from dflash_lib.__main__ import main
from dflash_lib.config import from_params, preset
from dflash_lib.data.tokenizers import MappedVocab, load_tokenizer
from dflash_lib.lab import runs
from tiny_models import save_tiny_qwen3, tiny_chatml_tokenizer

NB04 = rundir.REPO_ROOT / "notebooks" / "04_train.ipynb"
QWEN_IDS = 151851  # ids the bundled Qwen BPE emits, its special tokens included


def save_target(directory, vocab_size: int):
    """A random 4-layer Qwen3 of hidden size 32 over `vocab_size` ids, saved as a local Hugging Face folder."""
    save_tiny_qwen3(directory, hidden_size=32, num_layers=4, vocab_size=vocab_size)
    return directory


@pytest.fixture(scope="module")
def small_target(tmp_path_factory):
    """The issue's case: a local target of 1,000 ids and no tokenizer of its own."""
    return save_target(tmp_path_factory.mktemp("target_1000"), 1000)


@pytest.fixture(scope="module")
def target_with_tokenizer(tmp_path_factory):
    """A local target folder that ships its tokenizer: a byte-level BPE of ~400 ids with the ChatML specials
    trained here, and a model with one more row than it has ids (the MASK row). Returns (folder, vocab_size)."""
    hf = tiny_chatml_tokenizer()
    folder = tmp_path_factory.mktemp("target_with_tokenizer")
    hf.save_pretrained(folder)
    vocab = len(hf) + 1
    save_target(folder, vocab)
    return folder, vocab


def _error_line(capsys) -> str:
    """The one `error: ` line on stderr (a token store built on the way draws its progress bar there too)."""
    err = capsys.readouterr().err.strip().splitlines()
    errors = [line for line in err if line.startswith("error: ")]
    assert len(errors) == 1 and err[-1] == errors[0], err
    return errors[0]


def test_a_tokenizer_whose_ids_the_target_cannot_embed_is_refused_before_the_run_folder(tmp_path, small_target,
                                                                                     capsys):
    run_dir = tmp_path / "run"
    code = main(["train", "--preset", "smoke", "--run-dir", str(run_dir), "-p", "target", str(small_target),
                 "-p", "mask_id", "999"])
    line = _error_line(capsys)
    assert code == 2 and not run_dir.exists()
    assert (f"tokenizer 'qwen' emits ids up to {QWEN_IDS - 1} ({QWEN_IDS} ids) but target {str(small_target)!r} "
            "has vocab_size 1000: pass the target's own tokenizer with -p tokenizer DIR") in line


def test_a_mask_id_outside_the_target_vocabulary_is_refused_before_the_run_folder(tmp_path, capsys):
    run_dir = tmp_path / "run"
    code = main(["train", "--preset", "smoke", "--run-dir", str(run_dir), "-p", "mask_id", "151936"])
    line = _error_line(capsys)
    assert code == 2 and not run_dir.exists()
    assert ("mask_id 151936 is outside target 'tiny''s vocabulary [0, 151936): pass -p mask_id N with N < 151936, "
            f"e.g. 151935: a row the tokenizer (ids < {QWEN_IDS}) never emits") in line


def test_a_new_target_folder_brings_its_tokenizer_unless_one_is_given(target_with_tokenizer, tmp_path):
    folder, _ = target_with_tokenizer
    smoke = preset("smoke")
    assert from_params({"target": str(folder)}, smoke).data.tokenizer == str(folder)
    assert from_params({"target": str(folder), "tokenizer": "qwen"}, smoke).data.tokenizer == "qwen"
    on_it = from_params({"target": str(folder)}, smoke)
    assert from_params({"steps": 3}, on_it).data.tokenizer == str(folder)  # laid over: it stays
    assert from_params({"target": str(folder)}, from_params({"tokenizer": "qwen"}, on_it)).data.tokenizer == "qwen"
    assert from_params({"target": str(tmp_path)}, smoke).data.tokenizer == "qwen"  # a folder without a tokenizer
    # a notebook receives its parameters cell's tokenizer unless the target brings one
    assert runs.resolve_params(NB04, {"target": str(folder)})["tokenizer"] == str(folder)
    assert runs.resolve_params(NB04, {"target": str(folder), "tokenizer": "qwen"})["tokenizer"] == "qwen"
    # the demo target's folder is a tokenizer through its mapped vocabulary (dflash_vocab.json)
    qwen = load_tokenizer("qwen")
    MappedVocab("qwen", (qwen.special_id("<|im_start|>"), qwen.special_id("<|im_end|>"), qwen.pad_id)).write(tmp_path)
    assert from_params({"target": str(tmp_path)}, smoke).data.tokenizer == str(tmp_path)


def test_training_on_a_target_folder_uses_its_tokenizer_and_says_so(target_with_tokenizer, tmp_path, capsys):
    folder, vocab = target_with_tokenizer
    run_dir = tmp_path / "run"
    assert main(["train", "--preset", "smoke", "--run-dir", str(run_dir), "-p", "target", str(folder),
                 "-p", "mask_id", str(vocab - 1), "-p", "steps", "2"]) == 0
    out = capsys.readouterr().out
    assert (f"tokenizer {str(folder)!r} (the target folder's own): {vocab - 1} ids, target {str(folder)!r}: "
            f"vocab_size {vocab}, mask_id {vocab - 1}") in out
    recorded = json.loads((run_dir / "config.json").read_text())["config"]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert recorded["data"]["tokenizer"] == str(folder) and summary["steps"] == 2 and summary["real_tokens"] > 0
    assert "token_out_of_vocab" not in summary["skipped_samples"]  # every id fits the target
    # `-p tokenizer qwen` overrides the folder's: its ids do not fit this target, refused
    code = main(["train", "--preset", "smoke", "--run-dir", str(tmp_path / "qwen"), "-p", "target", str(folder),
                 "-p", "tokenizer", "qwen", "-p", "mask_id", str(vocab - 1)])
    assert code == 2 and f"has vocab_size {vocab}: pass the target's own tokenizer" in _error_line(capsys)


def test_a_corpus_with_no_sample_fit_for_training_is_refused_at_start(tmp_path, capsys):
    """max_len 8 keeps the start of each conversation, its long user turn: no sample has an assistant token. The
    token store drops them all at build time, so the run is refused before its folder exists (exit 2)."""
    source = tmp_path / "chats.jsonl"
    question = " ".join(["why is the sky blue"] * 10)
    source.write_text("".join(json.dumps({"id": str(i), "conversations": [
        {"from": "human", "value": f"{i}: {question}"}, {"from": "gpt", "value": "Rayleigh scattering."}]}) + "\n"
        for i in range(20)))
    run_dir = tmp_path / "run"
    code = main(["train", "--preset", "smoke", "--run-dir", str(run_dir), "-p", "source", str(source),
                 "-p", "max_len", "8", "-p", "steps", "2", "-p", "strategy", "sorted", "-p", "heldout_fraction", "0.0",
                 "-p", "cache_dir", str(tmp_path / "cache")])
    line = _error_line(capsys)
    assert code == 2 and line.startswith(f"error: source {str(source)!r}: no sample left") and \
        "'no_assistant_within_max_len': 20" in line
    assert not run_dir.exists()


def test_a_run_that_trained_on_nothing_exits_1(tmp_path, capsys, monkeypatch):
    """Samples that pass the store but fail validation every step end in NothingTrainedError (the loop's own test
    covers when); the command line reports it in one line with exit code 1."""
    import dflash_lib.train.loop
    from dflash_lib.train.feed import NothingTrainedError

    def nothing(*args, **kwargs):
        raise NothingTrainedError("trained on nothing: none of the 4 sampler steps read had a token to score")

    monkeypatch.setattr(dflash_lib.train.loop, "train", nothing)
    code = main(["train", "--preset", "smoke", "--run-dir", str(tmp_path / "run")])
    assert code == 1 and _error_line(capsys) == ("error: NothingTrainedError: trained on nothing: none of the 4 "
                                                 "sampler steps read had a token to score")