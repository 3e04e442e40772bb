"""The local target (`TargetModel`): a frozen Hugging Face causal LM, loaded by transformers itself
(`load_pretrained`), whose decoder layers run here, up to the deepest layer the drafter reads, over the batch's
REAL tokens only, gathered into one sequence whose segments are the documents (`context_features`: the drafter's
context as it is); each layer's attention per document (`target.attention`: sliding windows and sinks), and what
it cannot run refused in one line (`refuse_unrunnable`). A `target.protocol.FeatureSource`; its config
without weights: `models.target_config`. Which families run: docs/data.md, "Your own data, tokenizer and model";
what a batch then costs the target: docs/batching.md, "What padding still costs".
"""

from __future__ import annotations

import importlib.util
import inspect
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

import torch
import transformers
from transformers.cache_utils import KVSharingDict

from dflash_lib.config import ConfigError
from dflash_lib.data.batch import Batch
from dflash_lib.families import text_config
from dflash_lib.models import linear_attention
from dflash_lib.models.masks import RealTokens, real_tokens
from dflash_lib.models.shapes import NAMED_SHAPES
from dflash_lib.models.target_config import chosen_layer_ids, target_hf_config, tiny_qwen3_config, weight_files
from dflash_lib.target.attention import IMPLEMENTATION, resolve_backend

if TYPE_CHECKING:
    from torch._subclasses.fake_tensor import FakeTensorMode
    from dflash_lib.config import ModelConfig


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


# the `config.layer_types` the target runs exactly: attention per document, linear attention per document too
LAYER_KINDS = ("full_attention", "sliding_attention", "linear_attention")


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
