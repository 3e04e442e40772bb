"""The frozen target LLM: selected hidden layers for the drafter, plus next-token logits for verification.

`TargetModel` wraps a local Hugging Face causal LM that transformers loads itself (`load_pretrained`) and runs the
decoder layers itself: up to the deepest layer the drafter reads, over the batch's REAL tokens only, gathered into
one sequence whose segments are the documents (`context_features`: the drafter's context as it is). Which families
run and what is refused: docs/data.md, "Your own data, tokenizer and model"; what a batch then costs the target:
docs/batching.md, "What padding still costs".
"""

from __future__ import annotations

import importlib.util
import inspect
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

import torch
import torch.nn.functional as F
import transformers
from transformers.cache_utils import KVSharingDict
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from dflash_lib.config import ConfigError
from dflash_lib.data.batch import Batch
from dflash_lib.families import text_config
from dflash_lib.families.qwen3 import QWEN3_VOCAB
from dflash_lib.models import linear_attention
from dflash_lib.models.masks import RealTokens, real_tokens
from dflash_lib.models.shapes import NAMED_SHAPES
from dflash_lib.rundir import read_json_object

if TYPE_CHECKING:
    from torch._subclasses.fake_tensor import FakeTensorMode
    from dflash_lib.config import ModelConfig


def tiny_qwen3_config(hidden_size: int = 64, num_layers: int = 4, num_heads: int = 4, num_kv_heads: int = 2,
                      intermediate_size: int | None = None, vocab_size: int = QWEN3_VOCAB,
                      max_position_embeddings: int = 4096) -> transformers.Qwen3Config:
    """A small Qwen3 config for tests and the demo; `intermediate_size` None = 3 * hidden_size."""
    if hidden_size % num_heads:
        raise ConfigError(f"tiny target: hidden_size {hidden_size} is not a multiple of num_heads {num_heads}")
    if num_heads % num_kv_heads:
        raise ConfigError(f"tiny target: num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    return transformers.Qwen3Config(
        vocab_size=vocab_size, hidden_size=hidden_size, num_hidden_layers=num_layers,
        num_attention_heads=num_heads, num_key_value_heads=num_kv_heads, head_dim=hidden_size // num_heads,
        intermediate_size=intermediate_size or 3 * hidden_size, max_position_embeddings=max_position_embeddings,
        attn_implementation="sdpa",
    )


def target_hf_config(cfg: "ModelConfig") -> transformers.PretrainedConfig:
    """The target's Hugging Face config for `cfg.target`: "tiny" (cfg.target_layers, cfg.hidden_size), a name in
    NAMED_SHAPES (shapes only), or a LOCAL model directory (its config.json; no weight is read)."""
    if cfg.target == "tiny":
        return tiny_qwen3_config(hidden_size=cfg.hidden_size, num_layers=cfg.target_layers)
    if cfg.target in NAMED_SHAPES:
        return NAMED_SHAPES[cfg.target]()
    if not os.path.isdir(cfg.target):
        raise ConfigError(f"target {cfg.target!r} is neither 'tiny', a named shape {sorted(NAMED_SHAPES)} nor a local "
                          "model directory (give a local Hugging Face folder with -p target DIR; nothing is downloaded)")
    return local_hf_config(cfg.target)


def local_hf_config(directory: str | Path) -> transformers.PretrainedConfig:
    """The config of the local Hugging Face model folder `directory` (its config.json; no weight is read), the
    text model's for a vision-language wrapper. ConfigError naming the file when it is missing, is not a JSON
    object, or names a model_type that this transformers does not know."""
    path = Path(directory) / "config.json"
    doc = read_json_object(path, f"target {str(directory)!r}: no config.json (not a Hugging Face model folder)")
    model_type = doc.get("model_type")
    if not isinstance(model_type, str) or model_type not in transformers.CONFIG_MAPPING:
        raise ConfigError(f"{path}: model_type {model_type!r} is not a model type transformers "
                          f"{transformers.__version__} knows (a newer transformers, or not a causal LM folder?)")
    try:
        cfg = transformers.AutoConfig.from_pretrained(directory, local_files_only=True)
    except (OSError, ValueError) as e:  # what transformers raises for a config it cannot build
        raise ConfigError(f"{path}: {' '.join(str(e).split())}") from None
    text = text_config(cfg)
    if text is not cfg:
        text._name_or_path = cfg._name_or_path
    return text


def trainable_target_config(cfg: "ModelConfig") -> transformers.PretrainedConfig:
    """The target's config for training (`target_hf_config`, config.json only), refused as `check_trainable`
    refuses it. `train()` calls it before it makes a run folder."""
    hf_cfg = target_hf_config(cfg)  # refuses a path that is not a directory
    check_trainable(cfg, hf_cfg)
    return hf_cfg


def check_trainable(cfg: "ModelConfig", hf_cfg: transformers.PretrainedConfig) -> None:
    """Refuse, before loading a weight, what `TargetModel.from_model_config` would refuse of `cfg.target` whose
    config (read once by the caller, e.g. `target.facts.TargetFacts.hf`) is `hf_cfg`: a named shape (no weights),
    a folder that is not a causal LM (no `AutoModelForCausalLM` class for its model_type), that
    `refuse_unrunnable` refuses, or that holds no safetensors."""
    if cfg.target in NAMED_SHAPES:
        raise ConfigError(f"target {cfg.target!r} names the shapes of a model, not its weights: training needs "
                          f"a local Hugging Face folder of it (-p target DIR); the dry run needs none")
    if cfg.target != "tiny":
        if type(hf_cfg) not in transformers.MODEL_FOR_CAUSAL_LM_MAPPING:
            raise ConfigError(f"target {cfg.target!r}: model_type {hf_cfg.model_type!r} has no causal LM in "
                              f"transformers {transformers.__version__} (not a decoder-only language model)")
        refuse_unrunnable(hf_cfg, f"target {cfg.target!r} ({hf_cfg.model_type})", cfg.loss)
        weight_files(cfg.target)


def refuse_unrunnable(hf_cfg: transformers.PretrainedConfig, name: str, loss: str = "ce") -> None:
    """ConfigError in one line naming `name` and the missing piece when the config (no weight needed) asks for
    what the target cannot run exactly per document: a layer kind outside LAYER_KINDS, chunked or bidirectional
    attention, soft-capped attention logits; or, for a loss that reads the target's distribution (`loss` kl,
    ce+kl), soft-capped final logits (the shared LM head's logits are not capped in the loss)."""
    unrun = sorted(set(getattr(hf_cfg, "layer_types", None) or ["full_attention"]) - set(LAYER_KINDS))
    if unrun:
        raise ConfigError(f"{name}: layer types {unrun} are not run by our per-document attention (it runs "
                          f"{list(LAYER_KINDS)})")
    if getattr(hf_cfg, "attention_chunk_size", None):
        raise ConfigError(f"{name}: chunked attention (attention_chunk_size {hf_cfg.attention_chunk_size}) is not "
                          "run by our per-document attention")
    if getattr(hf_cfg, "use_bidirectional_attention", None):
        raise ConfigError(f"{name}: bidirectional attention (use_bidirectional_attention "
                          f"{hf_cfg.use_bidirectional_attention!r}) is not a causal target")
    if getattr(hf_cfg, "attn_logit_softcapping", None):
        raise ConfigError(f"{name}: soft-capped attention logits (attn_logit_softcapping "
                          f"{hf_cfg.attn_logit_softcapping}) are not run by our per-document attention")
    if loss != "ce" and getattr(hf_cfg, "final_logit_softcapping", None):
        raise ConfigError(f"{name}: loss {loss!r} reads the target's distribution, whose final logits are soft-capped "
                          f"(final_logit_softcapping {hf_cfg.final_logit_softcapping}); train with loss 'ce'")


def weight_files(directory: str | Path) -> list[str]:
    """The safetensors files of a local model folder (from model.safetensors.index.json, else model.safetensors);
    ConfigError when there is none (pickled .bin checkpoints are never loaded)."""
    root = Path(directory)
    index = root / "model.safetensors.index.json"
    if index.is_file():
        try:
            return sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise ConfigError(f"{index}: not an index of safetensors files ({type(e).__name__}: {e})") from None
    if (root / "model.safetensors").is_file():
        return ["model.safetensors"]
    raise ConfigError(f"target {str(root)!r}: no model.safetensors(.index.json); only safetensors checkpoints "
                      "are loaded (pickled .bin files are not)")


def feature_layer_ids(num_layers: int, num_features: int) -> list[int]:
    """Target layers whose outputs feed the drafter (docs/dflash.md): spread evenly over 1 .. num_layers-3.

    One feature: the middle layer. Python's `round` (half to even). A target too shallow for `num_features`
    distinct layers in that range gets repeated ids (e.g. 4 layers, 2 features -> [1, 1]); pass explicit ids
    to choose otherwise.
    """
    if num_features < 1:
        raise ConfigError(f"num_features must be >= 1, got {num_features}")
    if num_features == 1:
        return [num_layers // 2]
    if num_layers < 4:
        raise ConfigError(f"the layer-id rule needs a target of >= 4 layers for {num_features} features, "
                          f"got {num_layers}; set target_layer_ids explicitly")
    span = num_layers - 4
    return [round(1 + i * span / (num_features - 1)) for i in range(num_features)]


def chosen_layer_ids(ids: Sequence[int] | None, num_layers: int, num_features: int) -> list[int]:
    """The target layers whose outputs feed the drafter: the configured `ids` (`-p target_layer_ids`) when there
    are any, else `feature_layer_ids`' rule (docs/dflash.md) for a target of `num_layers` decoder layers."""
    return list(ids) if ids else feature_layer_ids(int(num_layers), num_features)


def flash_attn_available() -> bool:
    """True when the `flash_attn` package is importable (it only runs on CUDA)."""
    return importlib.util.find_spec("flash_attn") is not None


def resolve_backend(requested: str, device: torch.device | str) -> str:
    """"auto" -> "flash" on CUDA with flash-attn importable, else "sdpa". "flash" elsewhere is refused."""
    on_cuda = torch.device(device).type == "cuda"
    if requested == "auto":
        return "flash" if on_cuda and flash_attn_available() else "sdpa"
    if requested == "flash" and not (on_cuda and flash_attn_available()):
        raise ConfigError("attn_backend='flash' needs a CUDA device and the flash_attn package")
    if requested not in ("flash", "sdpa"):
        raise ConfigError(f"attn_backend must be 'auto', 'sdpa' or 'flash', got {requested!r}")
    return requested


SDPA_VARLEN = "per_document_attention"  # sdpa_varlen_attention registered with transformers (a name with "flash"
# in it would be taken for a flash-attn kernel to download, one with "sdpa" for the model's own SDPA support)
IMPLEMENTATION = {"sdpa": SDPA_VARLEN, "flash": "flash_attention_2"}  # backend -> HF attn_implementation
# flash-attn: transformers' own integration, which passes a layer's sliding window w to the varlen kernel as
# window_size (w - 1, w - 1) with causal=True, i.e. the keys i - w < j <= i, as ours; flash-attn 2 has no
# attention sinks (transformers drops them without a word), so `TargetModel` refuses a target with sinks there.
# the `config.layer_types` the target runs exactly: attention per document, linear attention per document too
LAYER_KINDS = ("full_attention", "sliding_attention", "linear_attention")
REFUSED_KWARGS = ("softcap",)  # settings an attention module may pass that our attention does not implement
SCORE_BUDGET = 1 << 24  # attention scores one windowed or sink chunk materialises at most (elements)


def sdpa_varlen_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                          attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                          dflash_segments: Sequence[tuple[int, int]] | None = None, sliding_window: int | None = None,
                          s_aux: torch.Tensor | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """A Hugging Face attention function: causal attention over each [start, end) segment of one flattened sequence.

    query (1, Hq, N, D), key (1, Hkv, N, D), value (1, Hkv, N, Dv) (grouped-query heads are shared, not copied;
    MLA's values are narrower than its keys) -> ((1, N, Hq, Dv), None). Slots outside every segment (padding) get
    zeros. The attention module passes its own `sliding_window` w (a query at i sees the keys j of its document
    with i - w < j <= i: transformers' `sliding_window_overlay`) and `s_aux` (gpt-oss' attention sinks: one logit
    per head, (Hq,), added to the softmax denominator only). Called without `dflash_segments` (the wrapped model
    used directly, e.g. `generate`) it attends under the mask transformers built (`sdpa_mask` is registered for
    this implementation).
    A setting in REFUSED_KWARGS (e.g. gemma's `softcap`) is refused rather than silently ignored.
    """
    refused = {k: kwargs[k] for k in REFUSED_KWARGS if kwargs.get(k) is not None}
    if refused:
        raise ConfigError(f"target {type(module).__name__}: attention with {refused} is not implemented by our "
                          "per-document attention")
    if dflash_segments is None:
        if s_aux is None:
            return ALL_ATTENTION_FUNCTIONS["sdpa"](module, query, key, value, attention_mask, scaling=scaling,
                                                   dropout=dropout, **kwargs)
        return attention_with_sinks(query, key, value, attention_mask, scaling, s_aux).transpose(1, 2), None
    out = query.new_zeros(query.shape[0], query.shape[2], query.shape[1], value.shape[3])  # (1, N, Hq, Dv)
    for s, e in dflash_segments:
        o = document_attention(query[:, :, s:e], key[:, :, s:e], value[:, :, s:e], scaling, sliding_window,
                               s_aux)  # (1, Hq, e - s, D)
        out[:, s:e] = o.transpose(1, 2)
    return out, None


def document_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float | None,
                       sliding_window: int | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention within ONE document: query (1, Hq, L, D), key (1, Hkv, L, D), value (1, Hkv, L, Dv) ->
    (1, Hq, L, Dv).

    `sliding_window` w: a query at i sees keys i - w < j <= i. `sinks` (Hq,): a per-head logit in the softmax
    denominator. Full causal attention is one SDPA call; a window that bites, or sinks, run in query chunks over
    only the keys the chunk can see, so at most SCORE_BUDGET scores exist at once (never L x L for a long
    document with a short window)."""
    L, Hq = query.shape[2], query.shape[1]
    gqa = Hq != key.shape[1]
    window = sliding_window if sliding_window is not None and sliding_window < L else None
    if window is None and sinks is None:
        return F.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scaling, enable_gqa=gqa)
    span = L if window is None else min(L, 2 * window)  # keys one chunk sees: its own plus the window before it
    chunk = max(1, min(L if window is None else window, SCORE_BUDGET // (Hq * span)))
    out = query.new_empty(*query.shape[:3], value.shape[3])  # (1, Hq, L, Dv)
    for a in range(0, L, chunk):
        b = min(L, a + chunk)
        lo = 0 if window is None else max(0, a - window + 1)  # the first key any query of the chunk sees
        i = torch.arange(a, b, device=query.device)[:, None]  # (b - a, 1) query positions
        j = torch.arange(lo, b, device=query.device)[None, :]  # (1, b - lo) key positions
        allowed = (j <= i) if window is None else (j <= i) & (i - j < window)  # (b - a, b - lo)
        q, k, v = query[:, :, a:b], key[:, :, lo:b], value[:, :, lo:b]
        if sinks is None:
            out[:, :, a:b] = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=scaling,
                                                            enable_gqa=gqa)
        else:
            out[:, :, a:b] = attention_with_sinks(q, k, v, allowed, scaling, sinks)
    return out


def attention_with_sinks(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None,
                         scaling: float | None, sinks: torch.Tensor) -> torch.Tensor:
    """Softmax attention with one sink logit per head (gpt-oss' eager attention, computed the same way):
    query (B, Hq, Lq, D), key and value (B, Hkv, Lk, D), `mask` True where a key is seen (broadcast to
    (B, Hq, Lq, Lk)), an additive float mask, or None (causal, the queries being the last Lq positions),
    sinks (Hq,) -> (B, Hq, Lq, Dv) (value's width). The sink takes its share of the softmax and contributes no
    value."""
    B, Hq, Lq, D = query.shape
    Hkv, Lk = key.shape[1], key.shape[2]
    scale = D ** -0.5 if scaling is None else scaling
    q = query.reshape(B, Hkv, Hq // Hkv, Lq, D)  # query heads grouped by the KV head they share
    scores = torch.einsum("bhgqd,bhkd->bhgqk", q, key).reshape(B, Hq, Lq, Lk) * scale  # (B, Hq, Lq, Lk)
    if mask is None:
        rows = torch.arange(Lk - Lq, Lk, device=query.device)[:, None]  # (Lq, 1) absolute query positions
        mask = torch.arange(Lk, device=query.device)[None, :] <= rows  # (Lq, Lk)
    scores = (scores.masked_fill(~mask, torch.finfo(scores.dtype).min) if mask.dtype == torch.bool
              else scores + mask)
    logits = torch.cat([scores, sinks.to(scores.dtype).reshape(1, Hq, 1, 1).expand(B, Hq, Lq, 1)], dim=-1)
    logits = logits - logits.amax(dim=-1, keepdim=True)  # as gpt-oss does: no overflow in bf16
    probs = F.softmax(logits, dim=-1, dtype=logits.dtype)[..., :-1].to(value.dtype)  # the sink's column dropped
    out = torch.einsum("bhgqk,bhkd->bhgqd", probs.reshape(B, Hkv, Hq // Hkv, Lq, Lk), value)
    return out.reshape(B, Hq, Lq, value.shape[3])


ALL_ATTENTION_FUNCTIONS.register(SDPA_VARLEN, sdpa_varlen_attention)
ALL_MASK_ATTENTION_FUNCTIONS.register(SDPA_VARLEN, sdpa_mask)  # the mask of a direct call: SDPA's


@dataclass
class TargetStep:
    """One verification forward over a single sequence (no batch dimension)."""

    features: torch.Tensor  # (T, num_features * H) selected layers at every position
    logits: torch.Tensor  # (T - logits_from, V) next-token logits from position `logits_from` on


class TargetModel(torch.nn.Module):
    """A frozen causal LM that returns the drafter's feature layers.

    Attributes: `layer_ids` (0-based decoder layers, feature i = output of layer layer_ids[i], i.e. HF
    `hidden_states[id + 1]`), `hidden_size`, `vocab_size`, `num_layers`, `num_features`, `embed_tokens` and
    `lm_head` (frozen, shared with the drafter), `backend` ("sdpa" or "flash"), `gather` (True: the layers run
    the real tokens only; False: every slot, fixed shapes for CUDA graphs or torch.compile, padding paid).
    """

    def __init__(self, model: transformers.PreTrainedModel, layer_ids: Sequence[int], backend: str = "sdpa",
                 gather: bool = True):
        super().__init__()
        base = getattr(model, getattr(model, "base_model_prefix", "model"), None)
        needed = ("embed_tokens", "layers", "norm", "rotary_emb")
        if base is None or not all(hasattr(base, n) for n in needed):
            raise ConfigError(f"target {type(model).__name__}: expected a decoder base model with {needed}")
        cfg = model.config
        refuse_unrunnable(cfg, f"target {type(model).__name__}")
        if backend == "flash" and any(name.endswith(".sinks") for name, _ in model.named_parameters()):
            raise ConfigError(f"target {type(model).__name__}: attention sinks are not run by flash-attn 2's varlen "
                              "kernel (transformers would drop them); use attn_backend 'sdpa'")
        self.num_layers = len(base.layers)
        layer_ids = [int(i) for i in layer_ids]
        bad = [i for i in layer_ids if not 0 <= i < self.num_layers]
        if bad or not layer_ids:
            raise ConfigError(f"target layer ids {layer_ids}: {bad or 'none given'} outside [0, {self.num_layers})")
        if cfg._attn_implementation != IMPLEMENTATION[backend]:
            model.set_attn_implementation(IMPLEMENTATION[backend])
        self.model = model.eval()
        self.model.requires_grad_(False)
        self.base = base
        self.backend = backend
        self.gather = gather
        self.layer_ids = layer_ids
        self.hidden_size = int(cfg.hidden_size)
        self.vocab_size = int(model.get_input_embeddings().num_embeddings)
        self.num_features = len(layer_ids)
        self.embed_tokens: torch.nn.Embedding = model.get_input_embeddings()
        self.lm_head: torch.nn.Linear = model.get_output_embeddings()
        self.name_or_path = str(getattr(cfg, "_name_or_path", "") or "")
        kinds = list(getattr(cfg, "layer_types", None) or ["full_attention"] * self.num_layers)
        self.layer_kinds: list[str] = kinds  # per decoder layer: full_attention | sliding_attention | linear_attention
        if "linear_attention" in kinds:  # its convolution and delta rule, run per document (`linear_attention`)
            if self.device.type == "cuda" and not linear_attention.HAS_FLA:
                raise ConfigError(f"target {type(model).__name__}: its linear-attention layers run on CUDA through "
                                  "flash-linear-attention's varlen kernel: pip install flash-linear-attention")
            linear_attention.install(importlib.import_module(type(base.layers[kinds.index("linear_attention")]
                                                                  .linear_attn).__module__))
        self.rotary_per_kind = "layer_type" in inspect.signature(base.rotary_emb.forward).parameters
        self.shares_kv = "shared_kv_states" in inspect.signature(type(base.layers[0]).forward).parameters

    @classmethod
    def from_model_config(cls, cfg: "ModelConfig", device: torch.device | str = "cpu",
                          dtype: torch.dtype = torch.float32, seed: int = 0, gather: bool = True,
                          hf_cfg: transformers.PretrainedConfig | None = None) -> "TargetModel":
        """cfg.target == "tiny": a random tiny Qwen3 (cfg.target_layers, cfg.hidden_size, real Qwen3 vocab)
        seeded by `seed`; otherwise a LOCAL Hugging Face model directory (nothing is downloaded), loaded straight
        onto `device` in `dtype` (`load_pretrained`). A named shape (e.g. "qwen3-8b") has no weights to train with.
        `gather`: see the class docstring (False for `sampler.static_shapes`). `hf_cfg`: the folder's config as the
        caller read and checked it once (`target.facts.TargetFacts.hf`, `check_trainable`); None: read here."""
        backend = resolve_backend(cfg.attn_backend, device)
        if cfg.target == "tiny":
            hf_cfg = tiny_qwen3_config(hidden_size=cfg.hidden_size, num_layers=cfg.target_layers)
            return cls.from_hf_config(hf_cfg, cfg.num_features, cfg.target_layer_ids or None, device, dtype, seed,
                                      backend, gather)
        hf_cfg = trainable_target_config(cfg) if hf_cfg is None else hf_cfg
        model = load_pretrained(cfg.target, hf_cfg, device, dtype, IMPLEMENTATION[backend])
        ids = chosen_layer_ids(cfg.target_layer_ids, model.config.num_hidden_layers, cfg.num_features)
        return cls(model, ids, backend, gather)

    @classmethod
    def from_hf_config(cls, hf_cfg: transformers.PretrainedConfig, num_features: int,
                       layer_ids: Sequence[int] | None = None, device: torch.device | str = "cpu",
                       dtype: torch.dtype = torch.float32, seed: int = 0, backend: str = "sdpa",
                       gather: bool = True) -> "TargetModel":
        """Random weights from `hf_cfg` (seeded; the caller's global RNG is left untouched)."""
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = transformers.AutoModelForCausalLM.from_config(hf_cfg, attn_implementation="sdpa")
        ids = chosen_layer_ids(layer_ids, hf_cfg.num_hidden_layers, num_features)
        return cls(model.to(device=device, dtype=dtype), ids, backend, gather)

    @classmethod
    def fake(cls, hf_cfg: transformers.PretrainedConfig, num_features: int, layer_ids: Sequence[int] | None,
             mode: "FakeTensorMode", device: torch.device | str = "cpu",
             dtype: torch.dtype = torch.bfloat16) -> "TargetModel":
        """The target at `hf_cfg`'s shapes with FAKE weights of `mode` (a `FakeTensorMode`): shapes, dtypes and
        devices only, no memory, no values (for the dry run). Use it only inside `mode`."""
        with mode, torch.device(device):
            model = transformers.AutoModelForCausalLM.from_config(hf_cfg, attn_implementation="sdpa", dtype=dtype)
        ids = chosen_layer_ids(layer_ids, hf_cfg.num_hidden_layers, num_features)
        return cls(model, ids, "sdpa")

    @property
    def hf(self) -> transformers.PretrainedConfig:
        """The model's transformers config."""
        return self.model.config

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    def train(self, mode: bool = True) -> "TargetModel":
        return super().train(False)  # frozen: always eval (no dropout), whatever a caller asks

    def segments(self, host_doc_ids: torch.Tensor) -> RealTokens:
        """The sequence the layers run and its documents (`masks.real_tokens`, gathered unless `gather` is off),
        computed on the HOST from a batch's doc_ids (R, T): reading a device tensor's values would cost a sync."""
        return real_tokens(host_doc_ids, self.gather)

    def _varlen_kwargs(self, real: RealTokens) -> dict[str, Any]:
        """The decoder layers' varlen arguments for the segments of the sequence run: flash-attn's cu_seqlens
        (moved to the device without a sync), or the per-document SDPA ranges (host ints)."""
        if self.backend == "flash":
            cu = real.cu_seqlens.to(self.device, non_blocking=True)
            return dict(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=real.longest, max_length_k=real.longest)
        return dict(dflash_segments=real.segments)

    def _run_layers(self, input_ids: torch.Tensor, position_ids: torch.Tensor, real: RealTokens,
                    upto: int, flat: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """Run the first `upto` decoder layers on the sequence `real` names (the gathered real tokens, or every
        slot) of input_ids, position_ids (R, T) -> (features of the feature layers among them, in the model's
        dtype: (R, T, F*H) with zeros on the padding slots not run, or with `flat` (N, F*H) over the sequence run
        only; the last layer's output (N, H) over the sequence run; N = R*T when every slot runs).
        Each feature layer's output is scattered into its slice of the feature tensor as it is produced, so no
        other layer's output outlives the next layer: at most the features, one layer's output and that layer's
        temporaries are alive at once."""
        R, T = input_ids.shape
        ids, pos = input_ids.reshape(1, R * T), position_ids.reshape(1, R * T)
        index = None if real.index is None else real.index.to(input_ids.device, non_blocking=True)  # (N,)
        if index is not None:  # one sequence of the real tokens only: padding never enters a layer
            ids, pos = ids[:, index], pos[:, index]  # (1, N)
        h = self.embed_tokens(ids)  # (1, N, H)
        H = h.shape[-1]
        scatter = index is not None and not flat  # back into the slots: the padding slots are never written
        feats = (h.new_zeros(R * T, self.num_features * H) if scatter
                 else h.new_empty(h.shape[1], self.num_features * H))  # (R*T or N, F*H)
        ropes = self._rotary(h, pos)  # per layer kind: cos, sin (1, N, head_dim)
        per_layer = self._per_layer_inputs(ids, h)  # gemma's per-layer embeddings (1, N, L, P), else None
        extra = self._varlen_kwargs(real)  # the documents as segments: no mask is ever built
        if self.shares_kv:  # gemma: later layers may reuse an earlier layer's keys/values (whole sequence, per kind)
            extra["shared_kv_states"] = KVSharingDict()
        linear = self._linear_kwargs(real, h.shape[1]) if "linear_attention" in self.layer_kinds[:upto] else {}
        for i, layer in enumerate(self.base.layers[:upto]):
            kind = self.layer_kinds[i]
            kw = dict(extra, per_layer_input=per_layer[:, :, i]) if per_layer is not None else extra
            kw = dict(kw, **linear) if kind == "linear_attention" else kw
            args = dict(attention_mask=None, position_ids=pos, position_embeddings=ropes.get(kind, ropes[None]), **kw)
            h = layer(h, **args)
            h = h[0] if isinstance(h, tuple) else h  # transformers 4 layers return (hidden, router logits, ...)
            for f, layer_id in enumerate(self.layer_ids):  # a repeated id fills every slice it names
                if layer_id == i:
                    if scatter:
                        feats[index, f * H:(f + 1) * H] = h[0]
                    else:
                        feats[:, f * H:(f + 1) * H] = h[0]
        return (feats if flat else feats.view(R, T, -1)), h[0]

    def _rotary(self, h: torch.Tensor, pos: torch.Tensor) -> dict[str | None, tuple[torch.Tensor, torch.Tensor]]:
        """The rotary cos, sin (1, N, head_dim) of positions `pos` (1, N): under None for a model with one
        rotary embedding, under each layer kind for one whose rotary takes the kind (gemma: sliding layers rotate
        with their own base)."""
        if not self.rotary_per_kind:
            return {None: self.base.rotary_emb(h, pos)}
        kinds = {k for k in self.layer_kinds if k != "linear_attention"}
        return {None: None, **{k: self.base.rotary_emb(h, pos, k) for k in kinds}}

    def _per_layer_inputs(self, ids: torch.Tensor, h: torch.Tensor) -> torch.Tensor | None:
        """Gemma's per-layer embeddings of `ids` (1, N) (its own two functions): (1, N, layers, P), or None for a
        model without them."""
        if not getattr(self.base, "hidden_size_per_layer_input", None):
            return None
        return self.base.project_per_layer_inputs(h, self.base.get_per_layer_inputs(ids, h))

    def _linear_kwargs(self, real: RealTokens, n: int) -> dict[str, Any]:
        """A linear-attention layer's arguments (`linear_attention`): the documents tiling the sequence run (n
        tokens), and on CUDA the same as cu_seqlens for flash-linear-attention."""
        cu = real.cu_seqlens.to(self.device, non_blocking=True) if self.device.type == "cuda" else None
        return {linear_attention.DOCUMENTS: linear_attention.tiling(real.segments, n),
                linear_attention.CU_SEQLENS: cu}

    @torch.no_grad()
    def features(self, batch: Batch, segments: RealTokens | None = None) -> torch.Tensor:
        """Selected layers concatenated: (R, T, num_features * H) in the model's dtype; zero on padding slots.
        Runs only the real tokens (every slot with `gather` off), only up to the deepest feature layer.
        `segments`: `self.segments(host doc_ids)`, default computed from `batch.doc_ids`: pass a HOST batch (the
        feed stage's), or the segments of a batch already on the device (the dry run's fake tensors hold no
        values to read them from)."""
        real = self.segments(batch.doc_ids) if segments is None else segments
        b = batch.to(self.device)
        feats, _ = self._run_layers(b.input_ids, b.position_ids, real, max(self.layer_ids) + 1)
        return feats.masked_fill_((b.doc_ids < 0).unsqueeze(-1), 0.0) if real.runs_padding else feats

    @torch.no_grad()
    def context_features(self, batch: Batch, segments: RealTokens | None = None) -> torch.Tensor:
        """The drafter's context: (C, num_features * H) in the model's dtype, the features of the sequence the
        layers ran, never scattered into the (R, T) slots: the real tokens in row-major order (C = N, the order of
        `DraftLayout.ctx_index`), or every slot when nothing is left out (no padding, or `gather` off: C = R*T,
        zero on padding). `segments`: as in `features`."""
        real = self.segments(batch.doc_ids) if segments is None else segments
        b = batch.to(self.device)
        feats, _ = self._run_layers(b.input_ids, b.position_ids, real, max(self.layer_ids) + 1, flat=True)
        return feats.masked_fill_((b.doc_ids.reshape(-1) < 0).unsqueeze(-1), 0.0) if real.runs_padding else feats

    @torch.no_grad()
    def context_features_and_final(self, batch: Batch, rows: torch.Tensor,
                                   segments: RealTokens | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """`context_features` plus the FINAL-NORMED last hidden states at `rows` (u,) int64 context entries
        (`DraftLayout.target_rows`; host or device): ((C, F*H), (u, H)), both in the model's dtype. Runs every
        decoder layer over the sequence (the layers after the deepest feature layer too: attention needs every
        position's keys), the final norm at the u rows only, never the LM head (the loss applies it chunk by chunk,
        next to the drafter's logits: loss kl / ce+kl)."""
        real = self.segments(batch.doc_ids) if segments is None else segments
        b = batch.to(self.device)
        feats, last = self._run_layers(b.input_ids, b.position_ids, real, self.num_layers, flat=True)
        if real.runs_padding:
            feats = feats.masked_fill_((b.doc_ids.reshape(-1) < 0).unsqueeze(-1), 0.0)
        final = self.base.norm(last[rows.to(self.device, non_blocking=True)])  # (u, H)
        return feats, final

    @torch.no_grad()
    def step(self, input_ids: torch.Tensor, logits_from: int = 0) -> TargetStep:
        """Full forward over one sequence `input_ids` (T,): features everywhere, logits only from
        position `logits_from` on (the verification window), never over the whole prefix."""
        ids = input_ids.to(self.device).reshape(1, -1)  # (1, T)
        T = ids.shape[1]
        pos = torch.arange(T, device=self.device).unsqueeze(0)  # (1, T)
        feats, last = self._run_layers(ids, pos, self.segments(torch.zeros(ids.shape, dtype=torch.long)),
                                       self.num_layers)  # one document, no padding: last is (T, H)
        last = self.base.norm(last[logits_from:])  # (T - logits_from, H)
        return TargetStep(feats[0], self.logits(last))

    def logits(self, final: torch.Tensor) -> torch.Tensor:
        """Next-token logits (..., V) of final-normed states (..., H): the LM head, soft-capped as the model's
        own forward caps them (gemma's final_logit_softcapping c: c * tanh(z / c))."""
        z = self.lm_head(final)
        cap = getattr(text_config(self.model.config), "final_logit_softcapping", None)
        return z if not cap else cap * torch.tanh(z / cap)

    @torch.no_grad()
    def greedy(self, prompt: Sequence[int], max_new_tokens: int) -> list[int]:
        """Reference greedy decoding, recomputing the full prefix per token (tiny scale only)."""
        seq = torch.tensor(list(prompt), dtype=torch.long)
        out: list[int] = []
        for _ in range(max_new_tokens):
            nxt = int(self.step(seq, len(seq) - 1).logits[-1].argmax())
            out.append(nxt)
            seq = torch.cat([seq, torch.tensor([nxt])])
        return out

    def close(self) -> None:
        """Nothing to release: its weights are this process's memory (a `target.protocol.FeatureSource`)."""

    def identity(self) -> dict:
        """The fields a saved drafter records to recognise its target."""
        cfg = self.model.config
        return dict(model_type=str(getattr(cfg, "model_type", "")), name_or_path=self.name_or_path,
                    num_hidden_layers=self.num_layers, hidden_size=self.hidden_size, vocab_size=self.vocab_size)


def load_pretrained(directory: str | Path, hf_cfg: transformers.PretrainedConfig, device: torch.device | str,
                    dtype: torch.dtype, attn_implementation: str = "sdpa") -> transformers.PreTrainedModel:
    """The local Hugging Face causal LM in `directory` (config `hf_cfg`) as transformers loads it
    (`from_pretrained`: sharded safetensors, its key conversions such as fused MoE experts, tied weights), in
    `dtype` on `device`. Nothing is downloaded and only safetensors are read. With `accelerate` installed the
    tensors go straight to `device` (`device_map`); without it transformers 5 refuses a device_map but reads the
    tensors as memory maps of the safetensors files, so the move to `device` copies each from the page cache and
    no anonymous host copy of the model is made when `dtype` is the checkpoint's (benchmarks/target_load.py); on
    CPU in that dtype the weights stay those maps, so the folder must not be rewritten while the target is in use.
    ConfigError naming the folder when its weights do not match its config (missing, or of another shape);
    weights the model does not use (e.g. a multi-token-prediction head) are ignored, as transformers does."""
    root = Path(directory)
    weight_files(root)  # pickled .bin checkpoints are never loaded
    device_map = {"": torch.device(device)} if importlib.util.find_spec("accelerate") else None
    try:
        model, info = transformers.AutoModelForCausalLM.from_pretrained(
            root, config=hf_cfg, dtype=dtype, device_map=device_map, attn_implementation=attn_implementation,
            local_files_only=True, use_safetensors=True, ignore_mismatched_sizes=True, output_loading_info=True)
    except (OSError, ValueError, RuntimeError) as e:  # what transformers raises for a folder it cannot load
        raise ConfigError(f"target {str(root)!r}: {' '.join(str(e).split())}") from None
    missing = sorted(info["missing_keys"])
    mismatched = sorted(str(k[0] if isinstance(k, tuple) else k) for k in info["mismatched_keys"])
    if missing or mismatched:
        raise ConfigError(f"target {str(root)!r}: its weights do not match its config.json: missing from the "
                          f"checkpoint {missing[:5]}, of another shape {mismatched[:5]}")
    model.config._name_or_path = str(directory)
    return model if device_map else model.to(device)
