"""The DFlash drafter: one forward drafts a whole block, conditioned on the frozen target's hidden layers.

ctx = RMSNorm(fc(concat of the target feature layers)); every draft layer's keys/values are
[ctx ; block] through the same projections; the block is [anchor token, MASK x (B-1)] embedded with the
target's frozen embedding, at absolute (document-local) RoPE positions anchor .. anchor+B-1; the final norm
feeds the target's frozen LM head (or its rows of a draft vocabulary, draft_vocab.py). Only the drafter's own
layers, `fc` and the norms train.

Saved layout: the Hugging Face folder serving engines load, declared by the `dflash` drafter kind
(models/drafters/dflash.py) and written and read by models/export.py (`export_drafter`, `read_drafter`): the drafter
itself knows no files.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from dflash_lib.config import (ConfigError, ModelConfig, check_drafter_layer_types, check_loss_settings,
                               reads_final_states)
from dflash_lib.data.batch import Batch
from dflash_lib.models.anchors import Anchors, default_gamma, sample_anchors
from dflash_lib.models.attention import Attend, make_attend, position_mask, resolve_attention
from dflash_lib.models.causality import default_causal, layer_causal
from dflash_lib.models.layers import DraftLayer, RMSNorm, Rotary
from dflash_lib.models.layout import DraftLayout, build_layout
from dflash_lib.models.draft_vocab import target_to_draft
from dflash_lib.models.loss import DrafterLoss, LinearHead, LossSpec, weighted_loss
from dflash_lib.models.target_parts import TargetParts


@dataclass(frozen=True)
class DrafterShape:
    """The drafter's layer dimensions for a target (`drafter_shape`)."""

    num_heads: int  # query heads
    num_kv_heads: int  # key/value heads
    head_dim: int  # per-head width
    intermediate_size: int  # the dense SwiGLU width


def drafter_shape(hf: Any) -> DrafterShape:
    """The paper's dense drafter layer for the target config `hf` (a Hugging Face config): the target's attention
    shape (query heads, key/value heads, head_dim; hidden_size // heads when it names none) and a DENSE SwiGLU of
    the target's `intermediate_size`. A mixture-of-experts target gets the same dense layer, never experts:
    Qwen3-MoE configs list a dense `intermediate_size` (3 x hidden: 6144 for Qwen3-30B-A3B) beside their
    `moe_intermediate_size`, and the drafters z-lab publishes for MoE targets (Qwen3-Coder-30B-A3B) are dense
    Qwen3 layers of the target's hidden size; a config with no dense width (intermediate_size missing or 0, only
    moe_intermediate_size) gets 3 x hidden_size, the Qwen3 ratio (8B: 12288 / 4096)."""
    hidden, heads = int(hf.hidden_size), int(hf.num_attention_heads)
    dense = int(_full_attention_value(hf, "intermediate_size") or 0) or 3 * hidden
    return DrafterShape(num_heads=heads, num_kv_heads=int(_full_attention_value(hf, "num_key_value_heads") or heads),
                        head_dim=int(_full_attention_value(hf, "head_dim") or hidden // heads), intermediate_size=dense)


def _full_attention_value(hf: Any, name: str) -> Any:
    """`hf.name`, or None when absent; for a config whose layers differ (gemma-4's `per_layer_config`), the value
    of its first full-attention layer (the drafter's layers attend over the whole context)."""
    per_layer = getattr(hf, "per_layer_config", None)
    if per_layer:
        kinds = list(getattr(hf, "layer_types", None) or [])
        return getattr(per_layer[kinds.index("full_attention") if "full_attention" in kinds else 0], name, None)
    return getattr(hf, name, None)


@dataclass
class DrafterConfig:
    hidden_size: int  # H, equal to the target's
    num_layers: int  # draft decoder layers
    num_heads: int  # query heads
    num_kv_heads: int  # key/value heads (grouped-query attention)
    head_dim: int  # per-head width
    intermediate_size: int  # SwiGLU width
    vocab_size: int  # the target's vocabulary (embedding rows)
    target_layer_ids: list[int]  # target layers fused into the context, in concatenation order
    target_num_layers: int  # decoder layers of the target (bounds target_layer_ids)
    block_size: int = 8  # B, tokens per block including the anchor
    mask_id: int = 151669  # MASK token id fed at block positions 1..B-1
    gamma: float = 0.0  # loss decay w_k = exp(-(k-1)/gamma); 0 = default_gamma(block_size), resolved here
    num_anchors: int = 64  # anchors (blocks) per document per training step
    ce_chunk_blocks: int = 64  # blocks' worth of scored positions per LM-head + CE chunk; 0 = unchunked
    rms_norm_eps: float = 1e-6  # RMSNorm epsilon
    rope_theta: float = 1_000_000.0  # RoPE base
    initializer_range: float = 0.02  # std of the normal init of linear weights
    loss: str = "ce"  # "ce" | "kl" | "ce+kl" (ModelConfig.loss; docs/dflash.md)
    kl_weight: float = 1.0  # lambda of ce+kl: ce + lambda * T^2 * KL_T
    kl_temperature: float = 1.0  # T of the KL term
    position_weight: str = "decay"  # "decay" | "dpace"
    dpace_alpha: float = 0.5  # D-PACE smoothing, in [0, 1]
    loss_weighting: str = "token"  # "token" | "document": each document's weights sum to 1 (anchors.sample_anchors)
    layer_types: list[str] = dataclasses.field(default_factory=list)  # per layer; empty = all full_attention
    sliding_window: int = 0  # sliding layers: keys at p - w < j of a query at p (0 = none)
    causal: bool | None = None  # every layer causal in its block (True) or none (False); None = vLLM's default,
    # sliding layers causal and full ones not (models/causality.py); an override equal to the default is kept as None
    draft_vocab_size: int = 0  # N > 0: the head is the target's rows of N tokens (draft_vocab.py); 0 = all rows

    def __post_init__(self) -> None:
        check_drafter_layer_types(self.layer_types, self.sliding_window, self.num_layers)
        if self.causal is not None and [self.causal] * self.num_layers == default_causal(self.layer_types,
                                                                                         self.num_layers):
            self.causal = None
        if self.block_size < 2:
            raise ConfigError(f"block_size must be >= 2, got {self.block_size}")
        if not 0 <= self.mask_id < self.vocab_size:
            raise ConfigError(f"mask_id {self.mask_id} is outside the target vocabulary [0, {self.vocab_size})")
        if not self.target_layer_ids:
            raise ConfigError("target_layer_ids is empty")
        bad = [i for i in self.target_layer_ids if not 0 <= i < self.target_num_layers]
        if bad:
            raise ConfigError(f"target layer ids {bad} are outside [0, {self.target_num_layers}) "
                              f"(the target has {self.target_num_layers} layers)")
        for name in ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim", "intermediate_size",
                     "num_anchors"):
            if getattr(self, name) < 1:
                raise ConfigError(f"drafter {name} must be >= 1, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")
        if not 0 <= self.draft_vocab_size < self.vocab_size:  # N = V: every row, no draft vocabulary
            raise ConfigError(f"draft_vocab_size {self.draft_vocab_size} is outside 0 .. {self.vocab_size - 1} (below "
                              "the target's vocabulary; 0 = the whole head)")
        if self.ce_chunk_blocks < 0 or self.gamma < 0:
            raise ConfigError(f"ce_chunk_blocks ({self.ce_chunk_blocks}) and gamma ({self.gamma}) must be >= 0")
        if self.gamma == 0:
            self.gamma = default_gamma(self.block_size)
        check_loss_settings(self)

    @property
    def loss_spec(self) -> LossSpec:
        """The loss settings as `loss.weighted_loss` takes them."""
        return LossSpec(self.loss, self.kl_weight, self.kl_temperature, self.position_weight, self.dpace_alpha)

    @property
    def num_features(self) -> int:
        return len(self.target_layer_ids)

    @property
    def layer_windows(self) -> list[int]:
        """Per layer: its sliding window (positions), 0 for a full-attention layer."""
        kinds = self.layer_types or ["full_attention"] * self.num_layers
        return [self.sliding_window if k == "sliding_attention" else 0 for k in kinds]

    @property
    def layer_causal(self) -> list[bool]:
        """Per layer: attends causally inside its block (`causal`, else vLLM's default by layer kind)."""
        return layer_causal(self.layer_types, self.num_layers, self.causal)

    @property
    def layer_attention(self) -> list[tuple[int, bool]]:
        """Per layer: (its window, 0 for full attention; causal in its block) -- what its masks follow."""
        return list(zip(self.layer_windows, self.layer_causal))

    @classmethod
    def from_model_config(cls, cfg: "ModelConfig", target: TargetParts) -> "DrafterConfig":
        """Attention shape and MLP width by `drafter_shape`, RoPE base from the target, the rest from `cfg`."""
        hf = target.hf
        shape = drafter_shape(hf)
        rope = getattr(hf, "rope_parameters", None) or {}
        rope = rope.get("full_attention", rope)  # per layer kind (gemma): the full-attention layers' base
        return cls(
            hidden_size=target.hidden_size, num_layers=cfg.drafter_layers, **dataclasses.asdict(shape),
            vocab_size=target.vocab_size,
            target_layer_ids=list(target.layer_ids), target_num_layers=target.num_layers,
            block_size=cfg.block_size, mask_id=cfg.mask_id, gamma=cfg.gamma, num_anchors=cfg.num_anchors,
            ce_chunk_blocks=cfg.ce_chunk_blocks, rms_norm_eps=float(getattr(hf, "rms_norm_eps", 1e-6)),
            rope_theta=float(rope.get("rope_theta", getattr(hf, "rope_theta", 1_000_000.0))),
            loss=cfg.loss, kl_weight=cfg.kl_weight, kl_temperature=cfg.kl_temperature,
            position_weight=cfg.position_weight, dpace_alpha=cfg.dpace_alpha, loss_weighting=cfg.loss_weighting,
            layer_types=list(cfg.drafter_layer_types), sliding_window=cfg.drafter_window,
            causal={"auto": None, "causal": True, "non_causal": False}[cfg.drafter_causal],
            draft_vocab_size=cfg.draft_vocab,
        )

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass
class DraftContextCache:
    """Inference cache of one document's context in every draft layer: rotated keys and values of positions
    0 .. length-1, exact because the context is never updated by the layers. Buffers grow by doubling, so
    appending a position costs O(1) amortised, never a copy of the whole context per step."""

    keys: list[torch.Tensor]  # per layer (1, kv, capacity, d)
    values: list[torch.Tensor]  # per layer (1, kv, capacity, d)
    length: int = 0  # context positions held

    def reserve(self, size: int, num_layers: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Room for `size` positions in each of `num_layers` layers; k, v (1, kv, *, d) give shape, dtype and
        device of the buffers. The held positions are copied when a buffer grows (doubling: O(1) amortised)."""
        cap = self.keys[0].shape[2] if self.keys else 0
        if size <= cap:
            return
        cap = max(size, 2 * cap, 64)
        old = list(zip(self.keys, self.values)) or [(k, v)] * num_layers
        self.keys, self.values = [], []
        for ok, ov in old:
            nk = ok.new_empty(*ok.shape[:2], cap, ok.shape[3])  # (1, kv, cap, d)
            nv = ov.new_empty(*ov.shape[:2], cap, ov.shape[3])
            nk[:, :, :self.length] = ok[:, :, :self.length]
            nv[:, :, :self.length] = ov[:, :, :self.length]
            self.keys.append(nk)
            self.values.append(nv)


def _block_attend(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int, causal: bool) -> Attend:
    """Inference attention of one block: every key of [context ; block] (positions `k_pos`) for a full non-causal
    layer, those `position_mask` keeps for a query at p (`q_pos`) for a sliding (`window` w) or causal one."""
    mask = position_mask(q_pos, k_pos, window, causal) if window or causal else None

    def attend(q, kc, vc, kb, vb):
        k, v = torch.cat([kc, kb], dim=2), torch.cat([vc, vb], dim=2)
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask,
                                                                enable_gqa=q.shape[1] != k.shape[1])

    return attend


class DFlashDrafter(nn.Module):
    """Block drafter. The target is referenced, not owned: its weights are neither parameters nor saved here."""

    def __init__(self, cfg: DrafterConfig, target: TargetParts, attention: str = "auto",
                 checkpointing: bool | int = False):
        super().__init__()
        if cfg.hidden_size != target.hidden_size:
            raise ConfigError(f"drafter hidden_size {cfg.hidden_size} differs from the target's {target.hidden_size}")
        if cfg.vocab_size != target.vocab_size:
            raise ConfigError(f"drafter vocab_size {cfg.vocab_size} differs from the target's {target.vocab_size}")
        if cfg.target_num_layers != target.num_layers:
            raise ConfigError(f"drafter expects a {cfg.target_num_layers}-layer target, got {target.num_layers}")
        if list(cfg.target_layer_ids) != list(target.layer_ids):
            raise ConfigError(f"drafter target_layer_ids {cfg.target_layer_ids} differ from the target's "
                              f"feature layers {target.layer_ids}")
        self.cfg = cfg
        self.attention = attention  # drafter attention backend: auto | flex | blocks | dense (attention.py)
        if isinstance(checkpointing, bool):  # True: every layer (a bool is an int: check it first)
            checkpointing = cfg.num_layers if checkpointing else 0
        if not 0 <= checkpointing <= cfg.num_layers:
            raise ConfigError(f"checkpointing must be a layer count in 0..{cfg.num_layers}, got {checkpointing}")
        self.checkpointing = int(checkpointing)  # the first k layers are recomputed in the backward
        resolve_attention(attention, target.device)  # refuse an unknown backend now
        object.__setattr__(self, "target", target)  # plain attribute: keeps the target out of parameters()
        H = cfg.hidden_size
        with torch.device(target.device):  # built where it trains: no host copy of ~4 GB first at paper scale
            self.fc = nn.Linear(cfg.num_features * H, H, bias=False)
            self.hidden_norm = RMSNorm(H, cfg.rms_norm_eps)
            self.layers = nn.ModuleList(self._make_layer(cfg) for _ in range(cfg.num_layers))
            self.norm = RMSNorm(H, cfg.rms_norm_eps)
            self.rotary = Rotary(cfg.head_dim, cfg.rope_theta)
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, std=cfg.initializer_range)
        if cfg.draft_vocab_size:  # buffers: saved with the weights, never trained (`set_draft_vocab` fills them)
            head = target.lm_head
            if getattr(head, "bias", None) is not None:
                raise ConfigError("draft_vocab: the target's LM head has a bias, which the served draft head "
                                  "(vLLM's lm_head + d2t) has not; use -p draft_vocab 0")
            n = cfg.draft_vocab_size
            self.register_buffer("draft_ids", torch.arange(n, device=head.weight.device))  # (N,) target ids
            self.register_buffer("draft_head", head.weight[:n].detach().clone())  # (N, H) their head rows

    @staticmethod
    def _make_layer(cfg: DrafterConfig) -> nn.Module:
        """One draft decoder layer (a drafter kind with other layers overrides this)."""
        return DraftLayer(cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size,
                          cfg.rms_norm_eps)

    def begin_step(self, step: int) -> None:
        """The trainer's step (1-based) about to run; a kind whose loss changes with the step overrides this."""

    def set_draft_vocab(self, ids: torch.Tensor, rows: torch.Tensor | None = None) -> None:
        """Draft over the target tokens `ids` (N,) ascending, with head rows `rows` (N, H) (None: the target's own
        rows of those tokens)."""
        n = self.cfg.draft_vocab_size
        if not n or tuple(ids.shape) != (n,):
            raise ConfigError(f"set_draft_vocab: {tuple(ids.shape)} ids for a drafter of draft_vocab_size {n}")
        with torch.no_grad():
            self.draft_ids.copy_(ids)
            w = self.target.lm_head.weight
            self.draft_head.copy_(w.index_select(0, ids.to(w.device)) if rows is None else rows)

    def head(self) -> Any:
        """The frozen head the loss runs: the target's LM head, or the draft vocabulary's rows (`LinearHead`)."""
        return LinearHead(self.draft_head, None) if self.cfg.draft_vocab_size else self.target.lm_head

    def target_to_draft(self) -> torch.Tensor | None:
        """(V,) the draft id of each target token, -1 outside the draft vocabulary; None without one."""
        return target_to_draft(self.draft_ids, self.cfg.vocab_size) if self.cfg.draft_vocab_size else None

    # -- shared math ------------------------------------------------------------------------------------
    def fuse(self, features: torch.Tensor) -> torch.Tensor:
        """(..., F*H) target features in the target's dtype -> (..., H) context. Under autocast `fc` runs in the
        autocast dtype straight from the features; outside it they are cast to fc's dtype."""
        dev = self.fc.weight.device.type
        if not torch.is_autocast_enabled(dev):
            features = features.to(self.fc.weight.dtype)
        return self.hidden_norm(self.fc(features))

    def _head(self, h: torch.Tensor) -> torch.Tensor:
        """(..., H) drafter states -> (..., V) logits of the frozen head, in the head's dtype (bf16 head, fp32
        drafter); with a draft vocabulary -inf outside it, as vLLM scatters them."""
        if not self.cfg.draft_vocab_size:
            return self.target.lm_head(h.to(self.target.lm_head.weight.dtype))
        z = torch.nn.functional.linear(h.to(self.draft_head.dtype), self.draft_head)  # (..., N)
        out = z.new_full((*z.shape[:-1], self.cfg.vocab_size), float("-inf"))
        out[..., self.draft_ids] = z
        return out

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        """The target's frozen embedding ROWS of `ids` (...,) -> (..., H), as vLLM's DFlash drafter embeds: never
        the target's own embedding module, whose scale (gemma's sqrt(hidden)) the engine's drafter does not apply."""
        return torch.nn.functional.embedding(ids, self.target.embed_tokens.weight)

    def _layers(self, block_ids: torch.Tensor, block_pos: torch.Tensor, ctx: torch.Tensor, ctx_pos: torch.Tensor,
                attends: dict[int, Attend], checkpointing: int = 0) -> torch.Tensor:
        """block_ids, block_pos (Q,); ctx (C, H); ctx_pos (C,) -> (Q, H) final-normed block states; `attends`
        by (window, causal) (`cfg.layer_attention`); the first `checkpointing` layers are recomputed in the
        backward."""
        dtype = self.fc.weight.dtype
        x = self._embed(block_ids).to(dtype)  # (Q, H)
        rope_q = self.rotary(block_pos, dtype)  # (Q, d) each
        rope_ctx = self.rotary(ctx_pos, dtype)  # (C, d) each
        for i, (layer, kind) in enumerate(zip(self.layers, self.cfg.layer_attention)):
            attend = attends[kind]
            if i < checkpointing and torch.is_grad_enabled():
                x = checkpoint(layer, x, ctx, rope_q, rope_ctx, attend, use_reentrant=False)
            else:
                x = layer(x, ctx, rope_q, rope_ctx, attend)
        return self.norm(x)

    # -- training ---------------------------------------------------------------------------------------
    def sample_anchors(self, batch: Batch, generator: torch.Generator, noise: float = 1.0) -> Anchors:
        """Fresh anchors for one step (see `anchors.sample_anchors`)."""
        c = self.cfg
        return sample_anchors(batch, c.num_anchors, c.block_size, c.gamma, c.mask_id, generator, noise,
                              c.position_weight, c.loss_weighting)

    def attention_backend(self) -> str:
        """The attention backend this drafter runs (`auto` resolved for its device)."""
        return resolve_attention(self.attention, self.fc.weight.device)

    def layout(self, batch: Batch, anchors: Anchors) -> DraftLayout:
        """Host-side layout of a host batch and its anchors for this drafter's attention backend (with the target
        rows of the KL term when the loss is kl or ce+kl)."""
        return build_layout(batch.to("cpu"), anchors.to("cpu"), self.attention_backend(),
                            every_slot=not self.target.gather,  # the context the target's features cover
                            target_rows=reads_final_states(self.cfg.loss))

    @staticmethod
    def weight_sum(work: Anchors | DraftLayout) -> float:
        """Sum of a batch's loss weights, known before the forward (for global normalisation)."""
        return work.weight_sum if isinstance(work, DraftLayout) else float(work.weights.sum())

    def _as_layout(self, batch: Batch, work: Anchors | DraftLayout) -> DraftLayout:
        if isinstance(work, DraftLayout):
            return work
        return self.layout(batch, work).to(self.fc.weight.device)  # convenience for tests: syncs

    @staticmethod
    def context_features(features: torch.Tensor, layout: DraftLayout) -> torch.Tensor:
        """The layout's C context entries of `features`: (C, F*H) as given (`TargetModel.context_features`, already
        in the layout's order), or the (R, T, F*H) slots of `TargetModel.features` with the context's slots
        gathered (an index on the device: no sync). ValueError when the count differs from the layout's."""
        if features.dim() == 3:
            features = features.reshape(-1, features.shape[-1])  # (R*T, F*H)
            if layout.ctx_index is not None:
                features = features[layout.ctx_index]  # (C, F*H): the real tokens only
        if features.shape[0] != layout.num_context:
            raise ValueError(f"drafter: {features.shape[0]} context features for a layout of {layout.num_context} "
                             "context entries (a target with gather off needs a layout with every_slot)")
        return features

    def forward_hidden(self, batch: Batch, features: torch.Tensor, work: Anchors | DraftLayout) -> torch.Tensor:
        """Training forward of all real blocks of a padded or packed batch.

        features (C, F*H) from `TargetModel.context_features(batch)` (the trainer's: no padding slot), or
        (R, T, F*H) from `TargetModel.features(batch)`; `work` the device layout (or anchors, laid out here) ->
        final-normed states (n*B, H) of the layout's n blocks, in layout order. Runs tensor ops only; fuses and
        projects the layout's C context entries only (the real tokens unless the layout keeps every slot).
        """
        layout = self._as_layout(batch, work)
        if layout.num_blocks == 0:
            return torch.zeros(0, self.cfg.hidden_size, device=self.fc.weight.device, dtype=self.fc.weight.dtype)
        ctx = self.fuse(self.context_features(features, layout))  # (C, H)
        backend = self.attention_backend()
        attends = {(w, c): make_attend(layout, backend, w, c) for w, c in set(self.cfg.layer_attention)}
        return self._layers(layout.block_ids.reshape(-1), layout.block_pos.reshape(-1), ctx, layout.ctx_pos,
                            attends, self.checkpointing)

    def block_logits(self, batch: Batch, features: torch.Tensor, work: Anchors | DraftLayout) -> torch.Tensor:
        """All logits of a training forward, (n, B, V) in layout order: for tests (holds n*B x V floats)."""
        layout = self._as_layout(batch, work)
        h = self.forward_hidden(batch, features, layout)
        return self._head(h).reshape(layout.num_blocks, layout.block_size, -1)

    def loss(self, batch: Batch, features: torch.Tensor, work: Anchors | DraftLayout,
             normalizer: float | None = None, target_hidden: torch.Tensor | None = None) -> DrafterLoss:
        """sum(w * ce) / normalizer; normalizer None = this batch's own weight sum. The trainer passes the
        GLOBAL weight sum (all ranks, all accumulated micro-batches) so the update ignores the data split.
        Loss kl / ce+kl: `target_hidden` (u, H) from `TargetModel.context_features_and_final` at the layout's
        target rows; the per-position term is then a * ce + b * T^2 * KL_T (docs/dflash.md)."""
        layout = self._as_layout(batch, work)
        if layout.num_blocks == 0:
            # No block at all: a zero that still reaches every parameter, so distributed backward stays in step.
            z = sum(p.sum() for p in self.parameters() if p.requires_grad) * 0.0
            zeros = torch.zeros(self.cfg.block_size - 1, device=z.device)
            if normalizer is not None and not float(normalizer) > 0:
                raise ValueError(f"loss normalizer must be > 0, got {normalizer}")
            return DrafterLoss(z, 0.0, z.detach().float(), z.detach().float(), zeros, zeros.clone())
        return self._objective(self.forward_hidden(batch, features, layout), layout, normalizer, target_hidden)

    def _objective(self, hidden: torch.Tensor, layout: DraftLayout, normalizer: float | None,
                   target_hidden: torch.Tensor | None, top_k: int = 0) -> DrafterLoss:
        """The loss of the final-normed block states hidden (n*B, H) of `layout` (`loss`'s arguments); `top_k`:
        `weighted_loss`'s."""
        return weighted_loss(hidden, self.head(), layout, self.cfg.ce_chunk_blocks * self.cfg.block_size,
                             normalizer, self.cfg.loss_spec, target_hidden, self.target_to_draft(), top_k)

    # -- inference --------------------------------------------------------------------------------------
    def draft_logits(self, features: torch.Tensor, anchor_pos: int, block_ids: torch.Tensor) -> torch.Tensor:
        """Per-block inference forward for one document: the context is exactly the positions 0 .. anchor_pos-1
        and a full non-causal layer's block sees itself fully (no mask); a sliding or causal layer sees the keys
        `attention.position_mask` keeps (`_block_attend`). Runs under bf16 autocast on CUDA.

        features (>= anchor_pos, F*H) of the document; block_ids (B,) -> logits (B, V).
        """
        return self._head(self.draft_hidden(features, anchor_pos, block_ids)).float()

    def draft_hidden(self, features: torch.Tensor, anchor_pos: int, block_ids: torch.Tensor) -> torch.Tensor:
        """`draft_logits` before the head: the block's final-normed states (B, H)."""
        dev = self.fc.weight.device
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=dev.type == "cuda"):
            ctx = self.fuse(features[:anchor_pos].to(dev))  # (a, H)
            ctx_pos = torch.arange(anchor_pos, device=dev)  # (a,)
            B = block_ids.shape[0]
            block_pos = anchor_pos + torch.arange(B, device=dev)  # (B,)
            keys = torch.cat([ctx_pos, block_pos])  # (a + B,) positions of [context ; block]
            attends = {(w, c): _block_attend(block_pos, keys, w, c) for w, c in set(self.cfg.layer_attention)}
            return self._layers(block_ids.to(dev), block_pos, ctx, ctx_pos, attends)  # (B, H)

    @torch.no_grad()
    def draft(self, features: torch.Tensor, anchor_pos: int, anchor_token: int) -> list[int]:
        """Greedy draft of the B-1 tokens after `anchor_token` at `anchor_pos`, from [anchor, MASK ...]."""
        B = self.cfg.block_size
        ids = torch.full((B,), self.cfg.mask_id, dtype=torch.long)
        ids[0] = anchor_token
        return self.draft_logits(features, anchor_pos, ids)[1:].argmax(dim=-1).tolist()

    def context_cache(self) -> "DraftContextCache":
        """An empty context cache for one document (`extend_context`, `draft_logits_cached`)."""
        return DraftContextCache(keys=[], values=[])

    @torch.no_grad()
    def extend_context(self, cache: "DraftContextCache", features: torch.Tensor) -> None:
        """Append n context positions: features (n, F*H) of positions cache.length .. cache.length+n-1 are fused
        and projected to every layer's rotated keys and values, once; older positions are never recomputed."""
        dev = self.fc.weight.device
        n = features.shape[0]
        if n == 0:
            return
        start = cache.length
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=dev.type == "cuda"):
            ctx = self.fuse(features.to(dev))  # (n, H)
            rope = self.rotary(torch.arange(start, start + n, device=dev), self.fc.weight.dtype)  # (n, d) each
            kv = [layer.self_attn._kv(ctx, rope) for layer in self.layers]  # per layer (1, kv, n, d) each
        cache.reserve(start + n + self.cfg.block_size, len(self.layers), *kv[0])
        for keys, values, (k, v) in zip(cache.keys, cache.values, kv):
            keys[:, :, start:start + n] = k
            values[:, :, start:start + n] = v
        cache.length = start + n

    def draft_logits_cached(self, cache: "DraftContextCache", block_ids: torch.Tensor) -> torch.Tensor:
        """`draft_logits` with the anchor at position cache.length and the context taken from the cache: only the
        B block tokens run through the layers. block_ids (B,) -> logits (B, V). Needs a non-empty cache."""
        return self._head(self.draft_hidden_cached(cache, block_ids)).float()

    def draft_hidden_cached(self, cache: "DraftContextCache", block_ids: torch.Tensor) -> torch.Tensor:
        """`draft_logits_cached` before the head: the block's final-normed states (B, H)."""
        if not cache.keys:
            raise ValueError("draft_logits_cached: the context cache is empty (extend_context first)")
        dev = self.fc.weight.device
        a, B = cache.length, block_ids.shape[0]
        cache.reserve(a + B, len(self.layers), cache.keys[0], cache.values[0])
        dtype = self.fc.weight.dtype
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=dev.type == "cuda"):
            x = self._embed(block_ids.to(dev)).to(dtype)  # (B, H)
            rope_q = self.rotary(a + torch.arange(B, device=dev), dtype)  # (B, d) each
            no_ctx = x.new_zeros(0, x.shape[1])  # the context enters through the cache, not the layer
            rope_none = (rope_q[0][:0], rope_q[1][:0])
            q_pos = a + torch.arange(B, device=dev)  # (B,)
            masks = {(w, c): position_mask(q_pos, torch.arange(a + B, device=dev), w, c) if w or c else None
                     for w, c in set(self.cfg.layer_attention)}
            for layer, keys, values, kind in zip(self.layers, cache.keys, cache.values, self.cfg.layer_attention):
                def attend(q, kc, vc, kb, vb, keys=keys, values=values, mask=masks[kind]):
                    # The block's keys/values go in the slots after the context (scratch: the next extend
                    # overwrites them), so the queries attend one contiguous prefix view, nothing is copied.
                    keys[:, :, a:a + B] = kb
                    values[:, :, a:a + B] = vb
                    k, v = keys[:, :, :a + B], values[:, :, :a + B]  # (1, kv, a+B, d) views
                    gqa = q.shape[1] != k.shape[1]
                    return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)

                x = layer(x, no_ctx, rope_q, rope_none, attend)
            return self.norm(x)

    @torch.no_grad()
    def draft_cached(self, cache: "DraftContextCache", anchor_token: int) -> list[int]:
        """`draft` over the cached context: the B-1 greedy tokens after `anchor_token` at position cache.length."""
        B = self.cfg.block_size
        ids = torch.full((B,), self.cfg.mask_id, dtype=torch.long)
        ids[0] = anchor_token
        return self.draft_logits_cached(cache, ids)[1:].argmax(dim=-1).tolist()
