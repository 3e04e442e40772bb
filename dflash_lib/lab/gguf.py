"""A GGUF model file as a Hugging Face folder a trainer and an engine load: transformers' own GGUF reader
dequantizes it (fp32), and the folder holds plain safetensors weights, a config without the GGUF quantization
entry (vLLM refuses a folder that names one), the tokenizer with its chat template, and a README saying where the
weights came from. Needs the `gguf` package (and `accelerate`, which transformers' GGUF path imports)."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Iterator

import torch
import transformers

from dflash_lib.config import ConfigError
from dflash_lib.models.export import file_sha256

GGUF_FORMAT = 1  # bump when the folder's content changes (cached folders then stop matching)
SOURCE_FILE = "gguf_source.json"  # written last: what was converted (file, SHA-256, format, the files' sizes);
# marks a complete folder


def load_gguf(gguf_file: str | Path) -> tuple[transformers.PreTrainedModel, transformers.PreTrainedTokenizerBase]:
    """(model in fp32, tokenizer) as transformers reads the GGUF file (its reference conversion)."""
    path = Path(gguf_file)
    if not path.is_file():
        raise ConfigError(f"{path}: no such GGUF file")
    tokenizer = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    model = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    return model, tokenizer


def is_converted(folder: str | Path, gguf_file: str | Path) -> bool:
    """Whether `folder` is a complete conversion of this very file (its SHA-256) by this GGUF_FORMAT: its
    SOURCE_FILE readable and, where it lists them, every file of the folder at its recorded size. A missing,
    unreadable or corrupt SOURCE_FILE: not converted (it is converted again)."""
    doc = Path(folder) / SOURCE_FILE
    try:
        source = json.loads(doc.read_text())
        files = source.get("files") or {}
        sizes_ok = all((Path(folder) / name).stat().st_size == size for name, size in files.items())
    except (OSError, ValueError, AttributeError, TypeError):
        return False
    return sizes_ok and source.get("format") == GGUF_FORMAT and source.get("sha256") == file_sha256(gguf_file)


def convert_gguf(gguf_file: str | Path, out_dir: str | Path, readme: str = "") -> Path:
    """Write the Hugging Face folder of `gguf_file` to `out_dir` and return it: built in a temporary folder of its
    own beside it (two conversions at once never share one), every file synced, SOURCE_FILE (the files' sizes)
    written last, then renamed into place (a previous folder moved aside first). `readme`: text of its README.md
    (where the model comes from, its licence); the conversion's own paragraph is appended."""
    src, out = Path(gguf_file), Path(out_dir)
    loaded, tokenizer = load_gguf(src)
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # the weights below are plain fp32
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(loaded.state_dict(), strict=False)
    tied = set(getattr(model, "_tied_weights_keys", None) or {})
    if unexpected or set(missing) - tied:
        raise ConfigError(f"{src}: the GGUF's tensors do not fill a {type(model).__name__}: missing "
                          f"{sorted(set(missing) - tied)[:5]}, unexpected {unexpected[:5]}")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        os.chmod(tmp, 0o755)  # a model folder, as save_pretrained would make it (mkdtemp's is 0700)
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        doc = json.loads((tmp / "config.json").read_text())
        doc.pop("quantization_config", None)
        doc.pop("_name_or_path", None)
        (tmp / "config.json").write_text(json.dumps(doc, indent=2) + "\n")
        sha = file_sha256(src)
        (tmp / "README.md").write_text(
            (readme.rstrip() + "\n\n" if readme else "")
            + f"Converted from `{src.name}` (SHA-256 {sha}) by `dflash_lib.lab.gguf` (format {GGUF_FORMAT}): the "
            "GGUF tensors dequantized by transformers' own GGUF reader, saved in fp32 as safetensors with the "
            "tokenizer and chat template the GGUF carries.\n")
        files = {}
        for path in sorted(tmp.iterdir()):
            with open(path, "rb") as f:
                os.fsync(f.fileno())
            files[path.name] = path.stat().st_size
        (tmp / SOURCE_FILE).write_text(json.dumps({"file": str(src), "sha256": sha, "format": GGUF_FORMAT,
                                                   "files": files}) + "\n")
        if out.exists():  # moved aside, not deleted in place: no reader sees it half removed
            old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
            os.replace(out, old / out.name)
            shutil.rmtree(old, ignore_errors=True)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


@contextlib.contextmanager
def conversion_lock(out_dir: str | Path) -> Iterator[None]:
    """Held while `out_dir` is checked and converted: two conversions of one folder at once (`make demo` and
    `make test` share .cache/real_targets) take turns, the second finds the first's folder complete."""
    lock = Path(out_dir).with_name(Path(out_dir).name + ".lock")
    lock.parent.mkdir(parents=True, exist_ok=True)
    with open(lock, "a") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)
