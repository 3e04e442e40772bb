"""The drafter on disk: the Hugging Face folder (config.json, model.safetensors, README.md) that SGLang, vLLM and
the z-lab DFlash code load, and the ONLY drafter format. `export_drafter` writes it (fp32 for a training run:
nothing lost for fine-tuning; bf16 for serving), `export_folder` exports a run folder or checkpoint, and
`read_drafter` / `init_from` (`-p init_from`) read ours and published drafters alike. What differs by drafter kind
(config.json's fields, tensor names, dtypes) each kind declares once: models/drafters/.

The files and their fields: docs/serving.md, "Export for serving"; the rules a folder is checked by (`trained_as`
among them): docs/serving.md, "Doctor: will the engines serve it as it was trained?".
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch
import transformers
from safetensors import safe_open
from safetensors.torch import save_file

from dflash_lib.config import SECTION_CLASSES, Config, ConfigError, DataConfig, ModelConfig
from dflash_lib.models.draft_vocab import from_d2t, to_d2t
from dflash_lib.models.drafter import DFlashDrafter, DrafterConfig
from dflash_lib.models.drafters import drafter_kind, kind_of_drafter, kind_of_folder
from dflash_lib.models.drafters.kind import CONFIG_FILE, README_FILE, WEIGHTS_FILE, DrafterKind
from dflash_lib.models.target_config import chosen_layer_ids, tiny_qwen3_config
from dflash_lib.models.target_parts import TargetParts

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}  # --dtype choices


# -- writing -------------------------------------------------------------------------------------------------
def write_folder(kind: DrafterKind, cfg: Any, weights: dict[str, torch.Tensor], out_dir: str | Path,
                 dtype: torch.dtype, max_position_embeddings: int, training: dict[str, Any] | None = None) -> Path:
    """Write config.json, model.safetensors (every tensor in `dtype`) and README.md of a `kind` drafter of config
    `cfg` into `out_dir`; `training`: config.json's record of what it was trained for."""
    if dtype not in kind.dtypes:
        raise ConfigError(f"export dtype {dtype} is not one of {sorted(map(str, kind.dtypes))}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    # a draft vocabulary's target ids (the module's draft_ids) are stored as vLLM's offsets d2t
    weights = {kind.tensors.get(n, n): to_d2t(w) if n == "draft_ids" else w for n, w in weights.items()}
    if cfg.draft_vocab_size and set(kind.tensors.values()) - set(weights):
        raise ConfigError(f"export to {out}: a drafter of draft_vocab_size {cfg.draft_vocab_size} without its "
                          f"draft_ids and draft_head")
    tensors = {n: w.detach().to(device="cpu", dtype=dtype if w.is_floating_point() else None).contiguous()
               for n, w in weights.items()}
    save_file(tensors, str(out / WEIGHTS_FILE), metadata={"format": "pt"})
    record = {**(training or {}), "trained_as": kind.trained_as(cfg, file_sha256(out / WEIGHTS_FILE))}
    doc = kind.serving_config(cfg, dtype, max_position_embeddings, record)
    (out / CONFIG_FILE).write_text(json.dumps(doc, indent=2) + "\n")
    (out / README_FILE).write_text(kind.readme(doc))
    return out


def file_sha256(path: str | Path) -> str:
    """The SHA-256 of a file's bytes, hex (read into one 256 KiB buffer: a GB shard's hash holds no GB piece)."""
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _training_info(hf: transformers.PretrainedConfig, name: str, template: str, source: str,
                   data: dict[str, str] | None = None) -> dict[str, Any]:
    """config.json's record of what the drafter was trained for (its README is written from it); `data`: the
    tokenizer, thinking and corpus of the training data (`data_info`), recorded when known."""
    target = {"name": name, "model_type": str(getattr(hf, "model_type", "")),
              "num_hidden_layers": int(hf.num_hidden_layers), "hidden_size": int(hf.hidden_size),
              "vocab_size": int(hf.vocab_size)}
    return {"target": target, "template": template, "source": source,
            **{k: v for k, v in (data or {}).items() if v}}


def data_info(data: DataConfig) -> dict[str, str]:
    """What the doctor renders training samples with again: the data section's tokenizer, thinking mode and
    corpus (`source`), under the keys dflash_config.training records them."""
    return {"tokenizer": data.tokenizer, "thinking": data.thinking, "corpus": data.source}


def export_drafter(drafter: "DFlashDrafter", out_dir: str | Path, dtype: torch.dtype = torch.bfloat16,
                   template: str = "", source: str = "", target_name: str = "",
                   weights: dict[str, torch.Tensor] | None = None, data: dict[str, str] | None = None) -> Path:
    """Write `drafter` in the serving layout. `template`: the chat template it was trained with; `source`: where
    it came from (a run folder, a checkpoint); `target_name` default the target's path. `weights`: its full
    trainable weights by name (e.g. `DrafterParallel.full_weights`: plain tensors whatever wrapper trained it); None = the
    drafter's own trainable parameters. `data`: `data_info` of the training data (the doctor reads it)."""
    kind, target = kind_of_drafter(drafter), drafter.target
    if weights is None:
        weights = {n: p for n, p in drafter.named_parameters() if p.requires_grad}
    weights = {**weights, **{n: b for n, b in drafter.named_buffers() if n in kind.tensors}}
    hf = target.hf
    info = _training_info(hf, target_name or target.name_or_path or "an in-memory model (no path)", template,
                          source, data)
    return write_folder(kind, drafter.cfg, weights, out_dir, dtype,
                        int(getattr(hf, "max_position_embeddings", 0) or 0), info)


def save_drafter(drafter: "DFlashDrafter", directory: Path, weights: dict[str, torch.Tensor] | None = None,
                 **info: Any) -> Path:
    """The drafter in the serving layout in fp32 (`info`: its README's template, source, target_name; `weights`:
    see `export_drafter`) into a temporary sibling, then rename: a reader never sees half a folder."""
    tmp = directory.with_name(directory.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    export_drafter(drafter, tmp, torch.float32, weights=weights, **info)
    shutil.rmtree(directory, ignore_errors=True)
    os.replace(tmp, directory)
    return directory


# -- reading -------------------------------------------------------------------------------------------------
def read_doc(directory: str | Path) -> dict[str, Any]:
    """config.json of a drafter folder, refusing anything that is not a drafter of a kind we run
    (`kind_of_folder`) or that its kind cannot run (`DrafterKind.check_doc`)."""
    src = Path(directory)
    path = src / CONFIG_FILE
    for p in (path, src / WEIGHTS_FILE):
        if not p.is_file():
            raise FileNotFoundError(f"drafter folder {src}: missing {p.name}")
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"{path}: not readable JSON ({e})") from None
    if not isinstance(doc, dict):
        raise ConfigError(f"{path}: not a JSON object")
    if doc.get("format") == "dflash-drafter":
        raise ConfigError(f"{path}: an old dflash-lab drafter format (dflash-drafter v1), no longer read; export "
                          f"its run again: python -m dflash_lib export RUN_DIR OUT_DIR")
    kind_of_folder(doc, str(path)).check_doc(doc, path)
    return doc


def drafter_config(doc: dict[str, Any], where: str = CONFIG_FILE) -> Any:
    """The config of the drafter a serving config.json `doc` holds (its kind's `read_config`); training settings
    default when the folder has none."""
    return kind_of_folder(doc, where).read_config(doc, where)


def check_target(cfg: DrafterConfig, target: "TargetParts", where: str) -> None:
    """Refuse a target the drafter `cfg` was not made for, naming the field."""
    pairs = (("hidden_size", cfg.hidden_size, target.hidden_size), ("vocab_size", cfg.vocab_size, target.vocab_size),
             ("num_target_layers", cfg.target_num_layers, target.num_layers))
    for key, mine, theirs in pairs:
        if mine != theirs:
            raise ConfigError(f"{where}: {key} is {mine}, the target has {theirs}")
    bad = [i for i in cfg.target_layer_ids if not 0 <= i < target.num_layers]
    if bad:
        raise ConfigError(f"{where}: target_layer_ids {bad} are out of range for a {target.num_layers}-layer target")
    if not 0 <= cfg.mask_id < target.vocab_size:
        raise ConfigError(f"{where}: mask_token_id {cfg.mask_id} is not an embedding row of the target "
                          f"(0 .. {target.vocab_size - 1})")
    if list(cfg.target_layer_ids) != list(target.layer_ids):
        raise ConfigError(f"{where}: target_layer_ids {cfg.target_layer_ids} differ from the target's feature "
                          f"layers {target.layer_ids} (build the target with these ids: -p target_layer_ids)")


def read_weights(directory: str | Path, device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
    path = Path(directory) / WEIGHTS_FILE
    with safe_open(str(path), framework="pt", device=str(torch.device(device))) as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def copy_weights(drafter: "DFlashDrafter", state: dict[str, torch.Tensor], where: str,
                 vocabulary: bool = True) -> None:
    """Fill the drafter's trainable weights from `state` (names and shapes must match exactly; values are cast
    to each parameter's dtype) and, with `vocabulary`, its draft vocabulary from the file's d2t and lm_head
    (`init_from` keeps the run's own: its rows are the target's, chosen by the run's data)."""
    state, names = dict(state), kind_of_drafter(drafter).tensors
    d2t, rows = state.pop(names["draft_ids"], None), state.pop(names["draft_head"], None)
    n, H = drafter.cfg.draft_vocab_size, drafter.cfg.hidden_size
    if vocabulary and not n and (d2t is not None or rows is not None):
        raise ConfigError(f"{where}: holds an LM head or d2t, but its config.json sets no draft_vocab_size below "
                          f"vocab_size")
    if vocabulary and n:
        if d2t is None or rows is None or tuple(d2t.shape) != (n,) or tuple(rows.shape) != (n, H):
            shapes = [None if t is None else tuple(t.shape) for t in (d2t, rows)]
            raise ConfigError(f"{where}: draft_vocab_size {n} needs {names['draft_ids']} ({n},) and "
                              f"{names['draft_head']} ({n}, {H}), found {shapes[0]} and {shapes[1]}")
        ids = from_d2t(d2t, drafter.cfg.vocab_size, where)
        drafter.set_draft_vocab(ids.to(drafter.draft_ids.device), rows.to(drafter.draft_head))
    own = {n: p for n, p in drafter.named_parameters() if p.requires_grad}
    missing, unexpected = sorted(set(own) - set(state)), sorted(set(state) - set(own))
    if missing or unexpected:
        raise ConfigError(f"{where}: missing weights {missing[:5]}, unexpected {unexpected[:5]}")
    with torch.no_grad():
        for name, p in own.items():
            if state[name].shape != p.shape:
                raise ConfigError(f"{where}: {name} has shape {tuple(state[name].shape)}, expected {tuple(p.shape)}")
            p.copy_(state[name])


def read_drafter(directory: str | Path, target: "TargetParts", dtype: torch.dtype | None = None,
                 attention: str = "auto", checkpointing: bool = False) -> "DFlashDrafter":
    """Rebuild a saved or exported drafter (the serving layout, ours or a published one) on `target`,
    refusing a target whose shapes or layers differ (the message names the field). `dtype` None = the
    stored weights' dtype. Training settings absent from the folder take DrafterConfig's defaults."""
    src = Path(directory)
    where = str(src / CONFIG_FILE)
    doc = read_doc(src)
    kind = kind_of_folder(doc, where)
    cfg = kind.read_config(doc, where)
    check_target(cfg, target, where)
    drafter = kind.module_class(cfg, target, attention, checkpointing)
    state = read_weights(src, target.device)
    dtype = dtype or next(t.dtype for t in state.values() if t.is_floating_point())
    for p in drafter.parameters():  # parameters only: the rotary buffer stays fp32
        p.data = p.data.to(dtype)
    copy_weights(drafter, state, str(src / WEIGHTS_FILE))
    return drafter


def init_from(drafter: "DFlashDrafter", directory: str | Path) -> None:
    """`-p init_from DIR`: overwrite a freshly built drafter's weights with a saved or exported drafter's. The
    folder must hold the same architecture on the same target; the run's config keeps the training settings
    (block_size, mask_id, gamma, num_anchors)."""
    src = Path(directory)
    if not src.is_dir():
        raise ConfigError(f"init_from {str(src)!r} is not a folder")
    where = str(src / CONFIG_FILE)
    doc = read_doc(src)
    kind, theirs = kind_of_drafter(drafter), kind_of_folder(doc, where)
    if theirs is not kind:
        raise ConfigError(f"init_from {src}: a {theirs.name} drafter there, this config builds {kind.name} "
                          f"(set drafter_kind to match)")
    saved = kind.read_config(doc, where)
    check_target(saved, drafter.target, where)
    for key, param in kind.arch_fields.items():
        mine, theirs = getattr(drafter.cfg, key), getattr(saved, key)
        if mine != theirs:
            raise ConfigError(f"init_from {src}: {key} is {theirs} there, this config builds {mine} "
                              f"(set {param} to match)")
    copy_weights(drafter, read_weights(src, drafter.fc.weight.device), str(src / WEIGHTS_FILE), vocabulary=False)


# -- the `export` command --------------------------------------------------------------------------------------
class _ShapeOnlyTarget:
    """What a kind's `config_class.from_model_config` reads of a target, from its HF config alone (no weight
    loaded)."""

    def __init__(self, hf: transformers.PretrainedConfig, layer_ids: list[int]):
        self.hf = hf
        self.hidden_size, self.vocab_size = int(hf.hidden_size), int(hf.vocab_size)
        self.num_layers, self.layer_ids = int(hf.num_hidden_layers), layer_ids


def run_target_name(model: ModelConfig, seed: int) -> str:
    """The target a run of `model` trained against, as its README names it: the path, or the tiny random Qwen3
    that the run's `seed` (train.seed) built."""
    return (f"tiny (a random Qwen3 built from seed {seed}: hidden {model.hidden_size}, "
            f"{model.target_layers} layers)") if model.target == "tiny" else model.target


def run_info(model: ModelConfig, seed: int, template: str, source: str,
             data: DataConfig | None = None) -> dict[str, Any]:
    """The export_drafter keywords of a trainer run (template, source, target_name, data): `model` and `seed` its
    model section and train.seed (`run_target_name`), `template` its chat template (data.template), `data` its
    data section (recorded for the doctor when given)."""
    info: dict[str, Any] = {"template": template, "source": source, "target_name": run_target_name(model, seed)}
    if data is not None:
        info["data"] = data_info(data)
    return info


def _run_config(doc: dict[str, Any], where: str) -> "Config":
    """A run's Config from its nested dict (config.json or a checkpoint's meta); fields unknown today dropped."""
    try:
        return Config(**{sec: cls(**{k: v for k, v in (doc.get(sec) or {}).items()
                                     if k in {f.name for f in dataclasses.fields(cls)}})
                         for sec, cls in SECTION_CLASSES.items()})
    except (TypeError, ConfigError) as e:
        raise ConfigError(f"{where}: the recorded run config does not build ({e})") from None


def export_run_weights(doc: dict[str, Any], weights: dict[str, torch.Tensor], out_dir: str | Path,
                       dtype: torch.dtype, source: str, where: str) -> Path:
    """A trainer run's drafter weights in the serving layout, no target weight loaded: `doc` is the run's nested
    config (a checkpoint's meta), which gives the shapes (with a local target's config.json); `weights` the
    trainable tensors by name; `source` what its README names; `where` the record errors name."""
    config = _run_config(doc, where)
    m = config.model
    if m.target == "tiny":
        hf = tiny_qwen3_config(hidden_size=m.hidden_size, num_layers=m.target_layers)
    elif os.path.isdir(m.target):
        hf = transformers.AutoConfig.from_pretrained(m.target, local_files_only=True)  # its config.json only
    else:
        raise ConfigError(f"{where}: its target {m.target!r} is not a local folder here (its config.json "
                          f"gives the drafter's shapes)")
    ids = chosen_layer_ids(m.target_layer_ids, hf.num_hidden_layers, m.num_features)
    kind = drafter_kind(m.drafter_kind)
    cfg = kind.config_class.from_model_config(m, _ShapeOnlyTarget(hf, ids))
    info = _training_info(hf, run_target_name(m, config.train.seed), config.data.template, source,
                          data_info(config.data))
    return write_folder(kind, cfg, weights, out_dir, dtype, int(getattr(hf, "max_position_embeddings", 0) or 0),
                        info)


def export_folder(src: str | Path, out_dir: str | Path, dtype: torch.dtype = torch.bfloat16) -> Path:
    """A saved or exported drafter folder (or a run folder's drafter/) written again in the serving layout in
    `dtype`; its README keeps what it was trained for."""
    src = Path(src)
    folder = src / "drafter" if (src / "drafter" / CONFIG_FILE).is_file() else src
    if not (folder / CONFIG_FILE).is_file():
        raise ConfigError(f"{src} holds no checkpoint (checkpoints/ckpt-*), no drafter/ and no {CONFIG_FILE}")
    doc = read_doc(folder)
    kind = kind_of_folder(doc, str(folder / CONFIG_FILE))
    cfg = kind.read_config(doc, str(folder / CONFIG_FILE))
    training = kind.training(doc)
    training["source"] = training.get("source") or str(folder)
    return write_folder(kind, cfg, read_weights(folder), out_dir, dtype, int(doc.get("max_position_embeddings") or 0),
                        training)
