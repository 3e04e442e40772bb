"""The DFlash drafter: one forward drafts a whole block, conditioned on the frozen target's hidden layers.

ctx = RMSNorm(fc(concat of the target feature layers)); every draft layer's keys/values are
[ctx ; block] through the same projections; the block is [anchor token, MASK x (B-1)] embedded with the
target's frozen embedding, at absolute (document-local) RoPE positions anchor .. anchor+B-1; the final norm
feeds the target's frozen LM head. Only the drafter's own layers, `fc` and the norms train.

Saved layout (a directory; loading reads only JSON and safetensors, never pickles):
    config.json        {"format": "dflash-drafter", "format_version": 1, "drafter": {DrafterConfig fields},
                        "target": {model_type, name_or_path, num_hidden_layers, hidden_size, vocab_size}}
    model.safetensors  the trainable weights only, Hugging Face Qwen3 names:
                        fc.weight (H, F*H), hidden_norm.weight (H,), norm.weight (H,),
                        layers.{i}.input_layernorm.weight, layers.{i}.post_attention_layernorm.weight,
                        layers.{i}.self_attn.{q,k,v,o}_proj.weight, layers.{i}.self_attn.{q,k}_norm.weight,
                        layers.{i}.mlp.{gate,up,down}_proj.weight
The embedding and LM head are the target's (not saved); `target_layer_ids` says which target layers
(outputs of 0-based decoder layer i = HF hidden_states[i + 1]) are concatenated, in order, into fc's input.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from dflash_lib.batch import Batch
from dflash_lib.config import ConfigError
from dflash_lib.models.anchors import Anchors, default_gamma, sample_anchors
from dflash_lib.models.layers import DraftLayer, RMSNorm, Rotary
from dflash_lib.models.loss import DrafterLoss, weighted_loss
from dflash_lib.models.masks import drafter_attention_mask
from dflash_lib.models.regroup import document_view
from dflash_lib.models.target import TargetModel

if TYPE_CHECKING:
    from dflash_lib.config import ModelConfig

FORMAT = "dflash-drafter"
FORMAT_VERSION = 1


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

    def __post_init__(self) -> None:
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
        if self.ce_chunk_blocks < 0 or self.gamma < 0:
            raise ConfigError(f"ce_chunk_blocks ({self.ce_chunk_blocks}) and gamma ({self.gamma}) must be >= 0")
        if self.gamma == 0:
            self.gamma = default_gamma(self.block_size)

    @property
    def num_features(self) -> int:
        return len(self.target_layer_ids)

    @classmethod
    def from_model_config(cls, cfg: "ModelConfig", target: TargetModel) -> "DrafterConfig":
        """Attention shape, MLP width and RoPE base from the target (Qwen3 family), the rest from `cfg`."""
        hf = target.model.config
        heads = int(hf.num_attention_heads)
        rope = getattr(hf, "rope_parameters", None) or {}
        return cls(
            hidden_size=target.hidden_size, num_layers=cfg.drafter_layers, num_heads=heads,
            num_kv_heads=int(getattr(hf, "num_key_value_heads", None) or heads),
            head_dim=int(getattr(hf, "head_dim", None) or target.hidden_size // heads),
            intermediate_size=int(hf.intermediate_size), vocab_size=target.vocab_size,
            target_layer_ids=list(target.layer_ids), target_num_layers=target.num_layers,
            block_size=cfg.block_size, mask_id=cfg.mask_id, gamma=cfg.gamma, num_anchors=cfg.num_anchors,
            ce_chunk_blocks=cfg.ce_chunk_blocks, rms_norm_eps=float(getattr(hf, "rms_norm_eps", 1e-6)),
            rope_theta=float(rope.get("rope_theta", getattr(hf, "rope_theta", 1_000_000.0))),
        )

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any], source: str = "config") -> "DrafterConfig":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(f"{source}: unknown drafter config keys {unknown}")
        return cls(**data)


class DFlashDrafter(nn.Module):
    """Block drafter. The target is referenced, not owned: its weights are neither parameters nor saved here."""

    def __init__(self, cfg: DrafterConfig, target: TargetModel):
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
        object.__setattr__(self, "target", target)  # plain attribute: keeps the target out of parameters()
        H = cfg.hidden_size
        self.fc = nn.Linear(cfg.num_features * H, H, bias=False)
        self.hidden_norm = RMSNorm(H, cfg.rms_norm_eps)
        self.layers = nn.ModuleList(
            DraftLayer(H, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size, cfg.rms_norm_eps)
            for _ in range(cfg.num_layers))
        self.norm = RMSNorm(H, cfg.rms_norm_eps)
        self.rotary = Rotary(cfg.head_dim, cfg.rope_theta)
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, std=cfg.initializer_range)
        self.to(device=target.device)

    # -- shared math ------------------------------------------------------------------------------------
    def fuse(self, features: torch.Tensor) -> torch.Tensor:
        """(..., S, F*H) target features -> (..., S, H) context."""
        return self.hidden_norm(self.fc(features.to(self.fc.weight.dtype)))

    def _layers(self, block_ids: torch.Tensor, block_pos: torch.Tensor, ctx: torch.Tensor, ctx_pos: torch.Tensor,
                mask: torch.Tensor | None) -> torch.Tensor:
        """block_ids, block_pos (R, Q); ctx (R, S, H); ctx_pos (R, S); mask (R, Q, S+Q) -> (R, Q, H) normed."""
        x = self.target.embed_tokens(block_ids).to(ctx.dtype)  # (R, Q, H)
        rope_q = self.rotary(block_pos, x.dtype)  # (R, Q, d) each
        rope_k = self.rotary(torch.cat([ctx_pos, block_pos], dim=1), x.dtype)  # (R, S+Q, d) each
        for layer in self.layers:
            x = layer(x, ctx, rope_q, rope_k, mask)
        return self.norm(x)

    # -- training ---------------------------------------------------------------------------------------
    def sample_anchors(self, batch: Batch, generator: torch.Generator, noise: float = 1.0) -> Anchors:
        """Fresh anchors for one step (see `anchors.sample_anchors`)."""
        c = self.cfg
        return sample_anchors(batch, c.num_anchors, c.block_size, c.gamma, c.mask_id, generator, noise)

    @staticmethod
    def weight_sum(anchors: Anchors) -> float:
        """Sum of this batch's loss weights, known before the forward (for global normalisation)."""
        return float(anchors.weights.sum())

    def forward_hidden(self, batch: Batch, features: torch.Tensor, anchors: Anchors) -> torch.Tensor:
        """Training forward of all blocks of a padded or packed batch.

        Runs on the document-major view (`regroup`): each document's blocks attend over that document's
        context only, so a packed row costs what its documents cost, not (row tokens x row blocks).
        features (R, T, F*H) from `TargetModel.features(batch)` -> final-normed states (R, M*B, H), zero on
        padding blocks.
        """
        dev = self.fc.weight.device
        b, a = batch.to(dev), anchors.to(dev)
        R, M, B = a.block_ids.shape
        T = b.doc_ids.shape[1]
        if a.num_blocks == 0:
            return torch.zeros(R, M * B, self.cfg.hidden_size, device=dev, dtype=self.fc.weight.dtype)
        view = document_view(b.doc_ids, a)
        D, N = view.block_index.shape
        ctx = self.fuse(features.to(dev).reshape(R * T, -1)[view.ctx_index])  # (D, L, H)
        block_ids = a.block_ids.reshape(R * M, B)[view.block_index]  # (D, N, B)
        anchor_pos = a.pos.reshape(R * M)[view.block_index]  # (D, N)
        anchor_doc = torch.where(view.block_valid, torch.arange(D, device=dev).unsqueeze(1), -1)  # (D, N)
        block_pos = (anchor_pos.unsqueeze(-1) + torch.arange(B, device=dev)).reshape(D, N * B)  # (D, N*B)
        mask = drafter_attention_mask(view.ctx_doc, view.ctx_pos, anchor_doc, anchor_pos, view.block_valid,
                                      B)  # (D, N*B, L+N*B)
        h = self._layers(block_ids.reshape(D, N * B), block_pos, ctx, view.ctx_pos, mask)  # (D, N*B, H)
        out = h.new_zeros(R * M, B, h.shape[-1])  # (R*M, B, H)
        out[view.block_index[view.block_valid]] = h.reshape(D, N, B, -1)[view.block_valid]
        return out.reshape(R, M * B, -1)

    def block_logits(self, batch: Batch, features: torch.Tensor, anchors: Anchors) -> torch.Tensor:
        """All logits of a training forward, (R, M, B, V): for tests and inspection (holds M*B x V floats)."""
        R, M, B = anchors.block_ids.shape
        return self.target.lm_head(self.forward_hidden(batch, features, anchors)).reshape(R, M, B, -1)

    def loss(self, batch: Batch, features: torch.Tensor, anchors: Anchors,
             normalizer: float | None = None) -> DrafterLoss:
        """sum(w * ce) / normalizer; normalizer None = this batch's own weight sum. The trainer passes the
        GLOBAL weight sum (all ranks, all accumulated micro-batches) so the update ignores the data split."""
        hidden = self.forward_hidden(batch, features, anchors)  # (R, M*B, H)
        B = self.cfg.block_size
        out = weighted_loss(hidden, self.target.lm_head, anchors.labels, anchors.weights, B,
                            self.cfg.ce_chunk_blocks * B, normalizer)
        if anchors.num_blocks == 0:
            # No block at all: a zero that still reaches every parameter, so distributed backward stays in step.
            out.loss = sum(p.sum() for p in self.parameters() if p.requires_grad) * 0.0
        return out

    # -- inference --------------------------------------------------------------------------------------
    def draft_logits(self, features: torch.Tensor, anchor_pos: int, block_ids: torch.Tensor) -> torch.Tensor:
        """Per-block inference forward for one document: no mask, the context is exactly the positions
        0 .. anchor_pos-1 and the block sees itself fully.

        features (>= anchor_pos, F*H) of the document; block_ids (B,) -> logits (B, V).
        """
        dev = self.fc.weight.device
        ctx = self.fuse(features[:anchor_pos].to(dev)).unsqueeze(0)  # (1, a, H)
        ctx_pos = torch.arange(anchor_pos, device=dev).unsqueeze(0)  # (1, a)
        B = block_ids.shape[0]
        block_pos = (anchor_pos + torch.arange(B, device=dev)).unsqueeze(0)  # (1, B)
        h = self._layers(block_ids.to(dev).unsqueeze(0), block_pos, ctx, ctx_pos, None)  # (1, B, H)
        return self.target.lm_head(h[0])

    @torch.no_grad()
    def draft(self, features: torch.Tensor, anchor_pos: int, anchor_token: int) -> list[int]:
        """Greedy draft of the B-1 tokens after `anchor_token` at `anchor_pos`, from [anchor, MASK ...]."""
        B = self.cfg.block_size
        ids = torch.full((B,), self.cfg.mask_id, dtype=torch.long)
        ids[0] = anchor_token
        return self.draft_logits(features, anchor_pos, ids)[1:].argmax(dim=-1).tolist()

    # -- persistence ------------------------------------------------------------------------------------
    def save(self, directory: str | Path) -> None:
        """Write config.json + model.safetensors (layout in the module docstring)."""
        out = Path(directory)
        out.mkdir(parents=True, exist_ok=True)
        weights = {n: p.detach().contiguous().cpu() for n, p in self.named_parameters() if p.requires_grad}
        save_file(weights, str(out / "model.safetensors"), metadata={"format": FORMAT})
        doc = {"format": FORMAT, "format_version": FORMAT_VERSION, "drafter": self.cfg.to_dict(),
               "target": self.target.identity()}
        (out / "config.json").write_text(json.dumps(doc, indent=2))

    @classmethod
    def load(cls, directory: str | Path, target: TargetModel) -> "DFlashDrafter":
        """Rebuild a saved drafter on `target`, refusing a target that does not match the recorded one."""
        src = Path(directory)
        cfg_path, weights_path = src / "config.json", src / "model.safetensors"
        for p in (cfg_path, weights_path):
            if not p.is_file():
                raise FileNotFoundError(f"drafter checkpoint {src}: missing {p.name}")
        doc = json.loads(cfg_path.read_text())
        if doc.get("format") != FORMAT or doc.get("format_version") != FORMAT_VERSION:
            raise ConfigError(f"{cfg_path}: not a {FORMAT} v{FORMAT_VERSION} config "
                              f"(format={doc.get('format')!r}, version={doc.get('format_version')!r})")
        recorded, actual = doc.get("target", {}), target.identity()
        for key in ("model_type", "num_hidden_layers", "hidden_size", "vocab_size"):
            if recorded.get(key) != actual[key]:
                raise ConfigError(f"{cfg_path}: drafter was trained for a target with {key}={recorded.get(key)!r}, "
                                  f"this target has {actual[key]!r}")
        drafter = cls(DrafterConfig.from_dict(doc["drafter"], str(cfg_path)), target)
        state = load_file(str(weights_path), device=str(target.device))
        own = {n: p for n, p in drafter.named_parameters()}
        missing, unexpected = sorted(set(own) - set(state)), sorted(set(state) - set(own))
        if missing or unexpected:
            raise ConfigError(f"{weights_path}: missing weights {missing[:5]}, unexpected {unexpected[:5]}")
        with torch.no_grad():
            for name, p in own.items():
                if state[name].shape != p.shape:
                    raise ConfigError(f"{weights_path}: {name} has shape {tuple(state[name].shape)}, "
                                      f"expected {tuple(p.shape)}")
                p.copy_(state[name])
        return drafter.to(state[next(iter(own))].dtype)
