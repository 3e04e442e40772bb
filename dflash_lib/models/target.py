"""The frozen target LLM: selected hidden layers for the drafter, plus next-token logits for verification.

`TargetModel` wraps a Hugging Face causal LM of the Llama/Qwen family (a base model exposing `embed_tokens`,
`layers`, `norm`, `rotary_emb`). It runs the decoder layers itself so that it can stop after the last layer
the drafter needs and never applies the LM head to every position. Documents never attend to each other: the
rows are flattened into one sequence whose segments are the documents, attended with flash-attn's varlen kernel
on CUDA, else with one causal SDPA call per document (`sdpa_varlen_attention`). Either way attention costs the
sum over documents of len^2, never R * T^2: a packed 8K row on CPU runs 13x faster than under a block-diagonal
mask (LOG.md, 2026-11-29).
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

import torch
import torch.nn.functional as F
import transformers
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from dflash_lib.batch import Batch
from dflash_lib.config import ConfigError
from dflash_lib.models.masks import document_segments, segment_cu_seqlens

if TYPE_CHECKING:
    from dflash_lib.config import ModelConfig

QWEN3_VOCAB = 151936  # Qwen3 embedding rows (the tokenizer's ids and the reserved MASK 151669 fit)


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


def feature_layer_ids(num_layers: int, num_features: int) -> list[int]:
    """Target layers whose outputs feed the drafter (dflash.md): spread evenly over 1 .. num_layers-3.

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


SDPA_VARLEN = "per_document_sdpa"  # sdpa_varlen_attention registered with transformers (a name with "flash" in it
# would be taken for a flash-attn kernel to download)
IMPLEMENTATION = {"sdpa": SDPA_VARLEN, "flash": "flash_attention_2"}  # backend -> HF attn_implementation


def sdpa_varlen_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                          attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                          dflash_segments: Sequence[tuple[int, int]] | None = None, **kwargs
                          ) -> tuple[torch.Tensor, None]:
    """A Hugging Face attention function: causal SDPA over each [start, end) segment of one flattened sequence.

    query (1, Hq, N, D), key and value (1, Hkv, N, D) (grouped-query heads are shared, not copied) ->
    ((1, N, Hq, D), None). Slots outside every segment (padding) get zeros. Called without `dflash_segments`
    (the wrapped model used directly, e.g. `generate`) it is plain HF SDPA.
    """
    if dflash_segments is None:
        return ALL_ATTENTION_FUNCTIONS["sdpa"](module, query, key, value, attention_mask, scaling=scaling,
                                               dropout=dropout, **kwargs)
    out = query.new_zeros(query.shape[0], query.shape[2], query.shape[1], query.shape[3])  # (1, N, Hq, D)
    gqa = query.shape[1] != key.shape[1]
    for s, e in dflash_segments:
        o = F.scaled_dot_product_attention(query[:, :, s:e], key[:, :, s:e], value[:, :, s:e], is_causal=True,
                                           scale=scaling, enable_gqa=gqa)  # (1, Hq, e - s, D)
        out[:, s:e] = o.transpose(1, 2)
    return out, None


ALL_ATTENTION_FUNCTIONS.register(SDPA_VARLEN, sdpa_varlen_attention)


@dataclass
class TargetStep:
    """One verification forward over a single sequence (no batch dimension)."""

    features: torch.Tensor  # (T, num_features * H) selected layers at every position
    logits: torch.Tensor  # (T - logits_from, V) next-token logits from position `logits_from` on


class TargetModel(torch.nn.Module):
    """A frozen causal LM that returns the drafter's feature layers.

    Attributes: `layer_ids` (0-based decoder layers, feature i = output of layer layer_ids[i], i.e. HF
    `hidden_states[id + 1]`), `hidden_size`, `vocab_size`, `num_layers`, `num_features`, `embed_tokens` and
    `lm_head` (frozen, shared with the drafter), `backend` ("sdpa" or "flash").
    """

    def __init__(self, model: transformers.PreTrainedModel, layer_ids: Sequence[int], backend: str = "sdpa"):
        super().__init__()
        base = getattr(model, getattr(model, "base_model_prefix", "model"), None)
        needed = ("embed_tokens", "layers", "norm", "rotary_emb")
        if base is None or not all(hasattr(base, n) for n in needed):
            raise ConfigError(f"target {type(model).__name__}: expected a decoder base model with {needed}")
        cfg = model.config
        kinds = set(getattr(cfg, "layer_types", None) or ["full_attention"])
        if kinds != {"full_attention"}:
            raise ConfigError(f"target {type(model).__name__}: layer types {sorted(kinds)} are not supported "
                              "(only full attention; sliding windows would need their own mask)")
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
        self.layer_ids = layer_ids
        self.hidden_size = int(cfg.hidden_size)
        self.vocab_size = int(model.get_input_embeddings().num_embeddings)
        self.num_features = len(layer_ids)
        self.embed_tokens: torch.nn.Embedding = model.get_input_embeddings()
        self.lm_head: torch.nn.Linear = model.get_output_embeddings()
        self.name_or_path = str(getattr(cfg, "_name_or_path", "") or "")

    @classmethod
    def from_model_config(cls, cfg: "ModelConfig", device: torch.device | str = "cpu",
                          dtype: torch.dtype = torch.float32, seed: int = 0) -> "TargetModel":
        """cfg.target == "tiny": a random tiny Qwen3 (cfg.target_layers, cfg.hidden_size, real Qwen3 vocab)
        seeded by `seed`; otherwise a LOCAL Hugging Face model directory (nothing is downloaded)."""
        backend = resolve_backend(cfg.attn_backend, device)
        if cfg.target == "tiny":
            hf_cfg = tiny_qwen3_config(hidden_size=cfg.hidden_size, num_layers=cfg.target_layers)
            return cls.from_hf_config(hf_cfg, cfg.num_features, cfg.target_layer_ids or None, device, dtype, seed,
                                      backend)
        if not os.path.isdir(cfg.target):
            raise ConfigError(f"target {cfg.target!r} is neither 'tiny' nor a local model directory")
        model = transformers.AutoModelForCausalLM.from_pretrained(
            cfg.target, local_files_only=True, dtype=dtype,
            attn_implementation=IMPLEMENTATION[backend])
        ids = cfg.target_layer_ids or feature_layer_ids(model.config.num_hidden_layers, cfg.num_features)
        return cls(model.to(device), ids, backend)

    @classmethod
    def from_hf_config(cls, hf_cfg: transformers.PretrainedConfig, num_features: int,
                       layer_ids: Sequence[int] | None = None, device: torch.device | str = "cpu",
                       dtype: torch.dtype = torch.float32, seed: int = 0, backend: str = "sdpa") -> "TargetModel":
        """Random weights from `hf_cfg` (seeded; the caller's global RNG is left untouched)."""
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = transformers.AutoModelForCausalLM.from_config(hf_cfg, attn_implementation="sdpa")
        ids = list(layer_ids) if layer_ids else feature_layer_ids(hf_cfg.num_hidden_layers, num_features)
        return cls(model.to(device=device, dtype=dtype), ids, backend)

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    def train(self, mode: bool = True) -> "TargetModel":
        return super().train(False)  # frozen: always eval (no dropout), whatever a caller asks

    def _run_layers(self, input_ids: torch.Tensor, position_ids: torch.Tensor, doc_ids: torch.Tensor,
                    upto: int) -> list[torch.Tensor]:
        """Hidden states after each of the first `upto` decoder layers, each (R, T, H)."""
        h = self.embed_tokens(input_ids)  # (R, T, H)
        rope = self.base.rotary_emb(h, position_ids)  # cos, sin: (R, T, head_dim)
        # One flattened sequence (1, R*T) whose segments are the documents: no (R, T, T) mask is ever built.
        R, T = input_ids.shape
        h, rope = h.reshape(1, R * T, -1), tuple(x.reshape(1, R * T, -1) for x in rope)
        position_ids = position_ids.reshape(1, R * T)
        if self.backend == "flash":  # padding runs ride along as segments of their own
            cu, longest = segment_cu_seqlens(doc_ids)
            extra: dict = dict(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=longest, max_length_k=longest)
        else:
            extra = dict(dflash_segments=document_segments(doc_ids))
        out = []
        for layer in self.base.layers[:upto]:
            h = layer(h, attention_mask=None, position_ids=position_ids, position_embeddings=rope, **extra)
            out.append(h.reshape(input_ids.shape + h.shape[-1:]))
        return out

    @torch.no_grad()
    def features(self, batch: Batch) -> torch.Tensor:
        """Selected layers concatenated: (R, T, num_features * H); zero on padding slots."""
        b = batch.to(self.device)
        hidden = self._run_layers(b.input_ids, b.position_ids, b.doc_ids, max(self.layer_ids) + 1)
        feats = torch.cat([hidden[i] for i in self.layer_ids], dim=-1)  # (R, T, F*H)
        return feats * (b.doc_ids >= 0).unsqueeze(-1).to(feats.dtype)

    @torch.no_grad()
    def step(self, input_ids: torch.Tensor, logits_from: int = 0) -> TargetStep:
        """Full forward over one sequence `input_ids` (T,): features everywhere, logits only from
        position `logits_from` on (the verification window), never over the whole prefix."""
        ids = input_ids.to(self.device).reshape(1, -1)  # (1, T)
        T = ids.shape[1]
        pos = torch.arange(T, device=self.device).unsqueeze(0)  # (1, T)
        hidden = self._run_layers(ids, pos, torch.zeros_like(ids), self.num_layers)
        feats = torch.cat([hidden[i] for i in self.layer_ids], dim=-1)[0]  # (T, F*H)
        last = self.base.norm(hidden[-1][0, logits_from:])  # (T - logits_from, H)
        return TargetStep(feats, self.lm_head(last))

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

    def identity(self) -> dict:
        """The fields a saved drafter records to recognise its target."""
        cfg = self.model.config
        return dict(model_type=str(getattr(cfg, "model_type", "")), name_or_path=self.name_or_path,
                    num_hidden_layers=self.num_layers, hidden_size=self.hidden_size, vocab_size=self.vocab_size)
