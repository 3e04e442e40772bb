"""The GGUF conversion's folder (`lab.gguf`) under concurrency and damage, with a tiny model standing in for the
GGUF's load: two conversions at once neither crash nor leave a folder that looks complete beside partial
weights, a second process waits for the first's folder, and a corrupt gguf_source.json means "convert again"."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest
import transformers

from dflash_lib.lab import gguf
from dflash_lib.lab import real_target as rt
from dflash_lib.models.target_config import tiny_qwen3_config
from tiny_models import tiny_chatml_tokenizer


@pytest.fixture
def tiny_gguf(tmp_path, monkeypatch):
    """A 'GGUF file' whose load is a tiny random Qwen3 and a ChatML tokenizer; returns the file."""
    path = tmp_path / "model.gguf"
    path.write_bytes(b"GGUF stand-in")

    def load(_):
        model = transformers.AutoModelForCausalLM.from_config(tiny_qwen3_config(hidden_size=32, num_layers=2,
                                                                                vocab_size=64))
        return model, tiny_chatml_tokenizer()

    monkeypatch.setattr(gguf, "load_gguf", load)
    return path


def test_two_conversions_at_once_each_leave_a_complete_folder(tiny_gguf, tmp_path, monkeypatch):
    """A second conversion of the same folder runs while the first is writing its weights (here: from inside the
    first's save): neither crashes, and the folder in place is a whole conversion (every file at the size its
    gguf_source.json records)."""
    out = tmp_path / "cache" / "tiny"
    real_save = transformers.PreTrainedModel.save_pretrained
    nested, started = [], []

    def save(self, folder, *a, **k):
        real_save(self, folder, *a, **k)
        if not started:  # the first conversion, half done: another one starts and finishes
            started.append(1)
            nested.append(gguf.convert_gguf(tiny_gguf, out))

    monkeypatch.setattr(transformers.PreTrainedModel, "save_pretrained", save)
    assert gguf.convert_gguf(tiny_gguf, out) == out and nested == [out]
    source = json.loads((out / gguf.SOURCE_FILE).read_text())
    assert source["files"] and all((out / n).stat().st_size == size for n, size in source["files"].items())
    assert gguf.is_converted(out, tiny_gguf)
    assert sorted(p.name for p in out.parent.iterdir()) == ["tiny"]  # no temporary folder left
    (out / "model.safetensors").write_bytes(b"partial")  # weights cut short beside the marker: not complete
    assert not gguf.is_converted(out, tiny_gguf)


@pytest.mark.parametrize("text", ["{not json", "[1, 2]", '{"files": 3}', ""])
def test_a_corrupt_source_record_means_convert_again(tiny_gguf, tmp_path, text):
    out = gguf.convert_gguf(tiny_gguf, tmp_path / "tiny")
    (out / gguf.SOURCE_FILE).write_text(text)
    assert not gguf.is_converted(out, tiny_gguf)


def test_a_second_process_waits_for_the_first_conversion_and_uses_its_folder(tiny_gguf, tmp_path, monkeypatch):
    """`ensure_real_target` converts under a lock: of two at once, one converts and the other finds its folder."""
    monkeypatch.setattr(rt, "packaged_file", lambda model=rt.SMOLLM2: tiny_gguf)
    real, running, most, calls = gguf.convert_gguf, [], [], []

    def slow(src, out, readme=""):
        running.append(1)
        most.append(len(running))
        calls.append(out)
        time.sleep(0.3)
        try:
            return real(src, out, readme)
        finally:
            running.pop()

    monkeypatch.setattr(rt, "convert_gguf", slow)
    got = []
    threads = [threading.Thread(target=lambda: got.append(rt.ensure_real_target(cache_dir=tmp_path, say=str)))
               for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert got == [tmp_path / rt.SMOLLM2.name] * 2 and len(calls) == 1 and max(most) == 1
