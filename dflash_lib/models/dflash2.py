"""The DFlash2 drafter (`DFlash2Drafter`, `DFlash2Config`): DFlash (models/drafter.py) with a causal convolution
inside each block around every attention and MLP sublayer (`block_conv`, `BlockConv`), a candidate selector that
reranks the head's top-k by the token drafted before (`CandidateSelector`, the greedy `walk`), and its selector
loss. Its serving folder: models/drafters/dflash2.py. The method and its figures: docs/dflash.md, "DFlash2".
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from dflash_lib.config import ConfigError, ModelConfig
from dflash_lib.models.drafter import DFlashDrafter, DrafterConfig
from dflash_lib.models.layers import DraftLayer, Rope
from dflash_lib.models.layout import DraftLayout
from dflash_lib.models.loss import DrafterLoss
from dflash_lib.models.target_parts import TargetParts


@dataclass
class DFlash2Config(DrafterConfig):
    conv_kernel_size: int = 2  # taps of each block convolution (1 = the row itself)
    conv_group_size: int = 16  # hidden channels sharing one predicted kernel delta (divides hidden_size)
    selector_rank: int = 256  # rank of the selector's codebooks
    selector_top_k: int = 16  # head candidates the selector reranks per drafted position
    selector_weight: float = 1.0  # weight of the selector cross-entropy beside the drafter's loss
    selector_warmup: int = 0  # steps over which that weight ramps linearly from 0 (0 = full from the start)
    input_embedding_scale: float = 1.0  # the block's embeddings are multiplied by it (read from a folder)
    output_multiplier: float = 1.0  # the candidates' unary logits are multiplied by it (read from a folder)
    final_logit_softcapping: float = 0.0  # > 0: unary = cap * tanh(unary / cap) (read from a folder)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.draft_vocab_size:
            raise ConfigError("draft_vocab: a dflash2 drafter needs the whole head (vLLM's candidate walk returns "
                              "head rows as token ids, with no d2t map): use -p draft_vocab 0")
        for name in ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k"):
            if getattr(self, name) < 1:
                raise ConfigError(f"dflash2 {name} must be >= 1, got {getattr(self, name)}")
        if self.hidden_size % self.conv_group_size:
            raise ConfigError(f"dflash2 conv_group_size {self.conv_group_size} does not divide hidden_size "
                              f"{self.hidden_size}")
        if self.conv_kernel_size > self.block_size:
            raise ConfigError(f"dflash2 conv_kernel_size {self.conv_kernel_size} exceeds block_size "
                              f"{self.block_size} (a tap never reaches across a block's start)")
        if self.selector_top_k > self.vocab_size:
            raise ConfigError(f"dflash2 selector_top_k {self.selector_top_k} exceeds the vocabulary "
                              f"{self.vocab_size}")
        if not self.selector_weight >= 0 or self.selector_warmup < 0:
            raise ConfigError(f"dflash2 selector_weight ({self.selector_weight}) and selector_warmup "
                              f"({self.selector_warmup}) must be >= 0")
        if not self.input_embedding_scale > 0 or not self.output_multiplier > 0 or self.final_logit_softcapping < 0:
            raise ConfigError("dflash2 input_embedding_scale and output_multiplier must be > 0 and "
                              f"final_logit_softcapping >= 0, got {self.input_embedding_scale}, "
                              f"{self.output_multiplier}, {self.final_logit_softcapping}")

    @classmethod
    def from_model_config(cls, cfg: ModelConfig, target: TargetParts) -> "DFlash2Config":
        """DrafterConfig.from_model_config plus the model section's dflash2 settings."""
        base = DrafterConfig.from_model_config(cfg, target)
        return cls(**dataclasses.asdict(base), conv_kernel_size=cfg.conv_kernel_size,
                   conv_group_size=cfg.conv_group_size, selector_rank=cfg.selector_rank,
                   selector_top_k=cfg.selector_top_k, selector_weight=cfg.selector_weight,
                   selector_warmup=cfg.selector_warmup)


def _shift(x: torch.Tensor, t: int, block_size: int) -> torch.Tensor:
    """x (Q, ...) with blocks of `block_size` contiguous rows -> row p holds x[p - t] of its block, zeros where
    p - t falls before the block's start (t > 0) or after its end (t < 0)."""
    if t == 0:
        return x
    xb = x.reshape(-1, block_size, *x.shape[1:])  # (n, B, ...)
    zeros = xb.new_zeros(xb.shape[0], abs(t), *xb.shape[2:])
    out = torch.cat([zeros, xb[:, :block_size - t]], 1) if t > 0 else torch.cat([xb[:, -t:], zeros], 1)
    return out.reshape(x.shape)


class _BlockConv(torch.autograd.Function):
    """`block_conv` saving only its inputs (the shifted copies and the per-row kernels are rebuilt in the backward):
    a taps x (Q, H) kernel held per convolution, four a layer, is what a checkpointed layer's recompute would keep."""

    @staticmethod
    def forward(ctx, y: torch.Tensor, delta: torch.Tensor, base: torch.Tensor, block_size: int) -> torch.Tensor:
        ctx.save_for_backward(y, delta, base)
        ctx.block_size = block_size
        Q, H = y.shape
        taps, G = delta.shape[1], delta.shape[2]
        acc = torch.promote_types(torch.promote_types(y.dtype, delta.dtype), base.dtype)
        out = torch.zeros(Q, G, H // G, dtype=acc, device=y.device)
        for t in range(taps):
            shifted = _shift(y, t, block_size).to(acc).reshape(Q, G, H // G)  # (Q, G, g): y[p - t]
            out += (base[t].to(acc).reshape(G, H // G) + delta[:, t].to(acc).unsqueeze(-1)) * shifted
        return out.reshape(Q, H).to(y.dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        y, delta, base = ctx.saved_tensors
        B = ctx.block_size
        Q, H = y.shape
        taps, G = delta.shape[1], delta.shape[2]
        acc = torch.promote_types(torch.promote_types(grad.dtype, delta.dtype), base.dtype)
        g = grad.to(acc).reshape(Q, G, H // G)  # (Q, G, g)
        gy = torch.zeros(Q, G, H // G, dtype=acc, device=y.device)
        gdelta = torch.empty(Q, taps, G, dtype=acc, device=y.device)
        gbase = torch.empty(taps, H, dtype=acc, device=y.device)
        for t in range(taps):
            shifted = _shift(y, t, B).to(acc).reshape(Q, G, H // G)  # y[p - t]
            gdelta[:, t] = (g * shifted).sum(-1)
            gbase[t] = (g * shifted).sum(0).reshape(H)
            kernel = base[t].to(acc).reshape(G, H // G) + delta[:, t].to(acc).unsqueeze(-1)  # (Q, G, g) at row p
            gy += _shift(kernel * g, -t, B)  # row p - t receives row p's term
        return gy.reshape(Q, H).to(y.dtype), gdelta.to(delta.dtype), gbase.to(base.dtype), None


def block_conv(y: torch.Tensor, delta: torch.Tensor, base: torch.Tensor, block_size: int) -> torch.Tensor:
    """The causal in-block convolution. y (Q, H) with Q a multiple of `block_size` (blocks contiguous); delta
    (Q, taps, G) per-row kernel deltas of G channel groups; base (taps, H) -> (Q, H) in y's dtype, accumulated in
    the widest of the three: out[p] = sum over t <= p's place in its block of (base[t] + delta[p, t, group]) *
    y[p - t]."""
    return _BlockConv.apply(y, delta, base, block_size)


class BlockConv(nn.Module):
    """One sublayer's pair of block convolutions (before and after it) with kernels predicted from its input."""

    def __init__(self, hidden: int, taps: int, group_size: int, block_size: int):
        super().__init__()
        self.taps, self.groups, self.block_size = taps, hidden // group_size, block_size
        self.base_kernel = nn.Parameter(torch.zeros(2, taps, hidden))  # (side, tap, H): before, after
        self.kernel_projection = nn.Linear(hidden, 2 * taps * self.groups, bias=False)

    def reset(self) -> None:
        """The identity on both sides: tap 0 = 1, the rest and every predicted delta 0."""
        with torch.no_grad():
            self.base_kernel.zero_()
            self.base_kernel[:, 0] = 1.0
            self.kernel_projection.weight.zero_()

    def before(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """h (Q, H) -> (the convolved input (Q, H), the after-side deltas (Q, taps, G))."""
        delta = self.kernel_projection(h).reshape(h.shape[0], 2, self.taps, self.groups)
        return block_conv(h, delta[:, 0], self.base_kernel[0], self.block_size), delta[:, 1]

    def after(self, y: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        return block_conv(y, delta, self.base_kernel[1], self.block_size)


class DFlash2Layer(DraftLayer):
    """A DraftLayer whose attention and MLP are each wrapped in a `BlockConv`."""

    def __init__(self, hidden: int, heads: int, kv_heads: int, head_dim: int, intermediate: int, eps: float,
                 taps: int, group_size: int, block_size: int):
        super().__init__(hidden, heads, kv_heads, head_dim, intermediate, eps)
        self.attention_conv = BlockConv(hidden, taps, group_size, block_size)
        self.mlp_conv = BlockConv(hidden, taps, group_size, block_size)

    def forward(self, x: torch.Tensor, ctx: torch.Tensor, rope_q: Rope, rope_ctx: Rope, attend) -> torch.Tensor:
        """x (Q, H) -> (Q, H); as DraftLayer.forward, each sublayer between its two convolutions."""
        h, delta = self.attention_conv.before(self.input_layernorm(x))
        x = x + self.attention_conv.after(self.self_attn(h, ctx, rope_q, rope_ctx, attend), delta)
        h, delta = self.mlp_conv.before(self.post_attention_layernorm(x))
        return x + self.mlp_conv.after(self.mlp(h), delta)


class CandidateSelector(nn.Module):
    """Pairwise scores of head candidates given the token before them (module docstring)."""

    def __init__(self, hidden: int, vocab: int, rank: int, top_k: int):
        super().__init__()
        self.top_k = top_k
        self.predecessor_codebook = nn.Parameter(torch.empty(vocab, rank))  # (V, r)
        self.successor_codebook = nn.Parameter(torch.zeros(vocab, rank))  # (V, r): 0 = no edge term (DFlash)
        self.hidden_projection = nn.Linear(hidden, rank, bias=False)
        for table in (self.predecessor_codebook, self.successor_codebook):
            table.lookup_table = True  # rows gathered by token id, as an embedding's: AdamW, never Muon

    def edges(self, h: torch.Tensor, previous: torch.Tensor, candidates: torch.Tensor) -> torch.Tensor:
        """h (N, H) hidden states; previous (N, P) predecessor ids; candidates (N, K) ids -> (N, P, K) edge terms
        < P[previous] * W h , S[candidate] >, in the codebooks' dtype whatever autocast is on (a few N x K x r
        products; a softmax over K scores reads them in training)."""
        dtype = self.successor_codebook.dtype
        with torch.autocast(h.device.type, enabled=False):
            q = F.linear(h.to(dtype), self.hidden_projection.weight.to(dtype))  # (N, r)
            pred = self.predecessor_codebook[previous] * q[:, None]  # (N, P, r)
            return torch.einsum("npr,nkr->npk", pred, self.successor_codebook[candidates])


class DFlash2Drafter(DFlashDrafter):
    """The DFlash2 drafter (module docstring); everything else as DFlashDrafter."""

    cfg: DFlash2Config
    walks_candidates = True  # drafts by the selector's walk, not from its logits: sampled decoding proposes the walk

    def __init__(self, cfg: DFlash2Config, target: TargetParts, attention: str = "auto",
                 checkpointing: bool | int = False):
        super().__init__(cfg, target, attention, checkpointing)  # its layers from `_make_layer`
        with torch.device(target.device):
            self.candidate_selector = CandidateSelector(cfg.hidden_size, cfg.vocab_size, cfg.selector_rank,
                                                        cfg.selector_top_k)
        nn.init.normal_(self.candidate_selector.hidden_projection.weight, std=cfg.initializer_range)
        nn.init.normal_(self.candidate_selector.predecessor_codebook, std=cfg.initializer_range)
        for layer in self.layers:  # a fresh DFlash2 drafts as DFlash
            layer.attention_conv.reset()
            layer.mlp_conv.reset()
        self.selector_scale = 1.0 if cfg.selector_warmup == 0 else 0.0  # the warm-up's factor (`begin_step`)

    @staticmethod
    def _make_layer(cfg: DFlash2Config) -> nn.Module:  # type: ignore[override]
        return DFlash2Layer(cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size,
                            cfg.rms_norm_eps, cfg.conv_kernel_size, cfg.conv_group_size, cfg.block_size)

    def begin_step(self, step: int) -> None:
        """The trainer's step (1-based) about to run: sets the selector loss's warm-up factor."""
        w = self.cfg.selector_warmup
        self.selector_scale = 1.0 if w == 0 else min(1.0, max(step, 0) / w)

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        return super()._embed(ids) * self.cfg.input_embedding_scale

    # -- the candidates --------------------------------------------------------------------------------
    def _unary(self, logits: torch.Tensor) -> torch.Tensor:
        """Head logits -> the selector's unary scores: times output_multiplier, then soft-capped."""
        z = logits.float() * self.cfg.output_multiplier
        cap = self.cfg.final_logit_softcapping
        return cap * torch.tanh(z / cap) if cap > 0 else z

    def candidates(self, h: torch.Tensor, chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
        """h (N, H) -> the head's top-k token ids (N, K), best first, and their unary scores (N, K) float32, a chunk
        of rows of logits at a time, without gradient (drafting; training takes them from the loss's head pass)."""
        K = self.cfg.selector_top_k
        ids, values = [], []
        with torch.no_grad():
            for i in range(0, h.shape[0], max(chunk, 1)):
                top = self._head(h[i:i + chunk]).float().topk(K, dim=-1)
                ids.append(top.indices)
                values.append(top.values)
        if not ids:
            return h.new_zeros(0, K, dtype=torch.long), h.new_zeros(0, K, dtype=torch.float32)
        return torch.cat(ids), self._unary(torch.cat(values))

    def selector_scores(self, h: torch.Tensor, previous: torch.Tensor, ids: torch.Tensor,
                        unary: torch.Tensor) -> torch.Tensor:
        """h (N, H), previous (N, P), ids and their unary scores (N, K) -> (N, P, K): unary[k] + edge(previous[p],
        ids[k])."""
        return unary[:, None, :] + self.candidate_selector.edges(h, previous, ids).float()

    def walk(self, h: torch.Tensor, anchor_token: int) -> list[int]:
        """Greedy draft of one block's B-1 positions from their final-normed states h (B-1, H): at each position
        the best-scored candidate after the token picked before it (the anchor first)."""
        ids, unary = self.candidates(h, h.shape[0])  # (B-1, K) each
        anchor = torch.full((1, 1), int(anchor_token), dtype=torch.long, device=h.device)
        previous = torch.cat([anchor.expand(1, ids.shape[1]), ids[:-1]])  # (B-1, K): every candidate before
        scores = self.selector_scores(h, previous, ids, unary)  # (B-1, K, K): [s, p, c] = c after candidate p
        picked, p = [], 0  # the anchor's row: every row of the first position is the anchor's
        for s in range(h.shape[0]):
            p = int(scores[s, p].argmax())
            picked.append(int(ids[s, p]))
        return picked

    # -- drafting ---------------------------------------------------------------------------------------
    @torch.no_grad()
    def draft(self, features: torch.Tensor, anchor_pos: int, anchor_token: int) -> list[int]:
        ids = self._block(anchor_token)
        return self.walk(self.draft_hidden(features, anchor_pos, ids)[1:], anchor_token)

    @torch.no_grad()
    def draft_cached(self, cache: Any, anchor_token: int) -> list[int]:
        return self.walk(self.draft_hidden_cached(cache, self._block(anchor_token))[1:], anchor_token)

    def _block(self, anchor_token: int) -> torch.Tensor:
        ids = torch.full((self.cfg.block_size,), self.cfg.mask_id, dtype=torch.long)
        ids[0] = anchor_token
        return ids

    # -- training ---------------------------------------------------------------------------------------
    def _objective(self, hidden: torch.Tensor, layout: DraftLayout, normalizer: float | None,
                   target_hidden: torch.Tensor | None) -> DrafterLoss:
        """The drafter's loss plus selector_weight x warm-up x the selector cross-entropy (normalised alike)."""
        scale = self.cfg.selector_weight * self.selector_scale
        out = super()._objective(hidden, layout, normalizer, target_hidden,
                                 top_k=self.cfg.selector_top_k if scale else 0)  # the candidates from its head pass
        if scale == 0 or layout.num_scored == 0 or out.top is None:
            return out
        h = hidden.index_select(0, layout.scored)  # (m, H)
        ids, unary = out.top[0], self._unary(out.top[1])  # (m, K) each, no gradient
        y = layout.labels  # (m,)
        hit = (ids == y[:, None]).any(1)  # (m,)
        ids = torch.cat([ids[:, :-1], torch.where(hit, ids[:, -1], y)[:, None]], dim=1)  # the label in the set
        with torch.no_grad():  # the label's own unary score, where it took the last place
            head = self.target.lm_head
            z = (h.to(head.weight.dtype) * head.weight[y]).sum(-1).float()  # (m,)
            last = self._unary(z if getattr(head, "bias", None) is None else z + head.bias[y].float())
        unary = torch.cat([unary[:, :-1], torch.where(hit, unary[:, -1], last)[:, None]], dim=1)
        place = (ids == y[:, None]).float().argmax(dim=1)  # (m,) the label's candidate
        scores = self.selector_scores(h, layout.previous[:, None], ids, unary)[:, 0]  # (m, K)
        ce = F.cross_entropy(scores, place, reduction="none")  # (m,)
        norm = layout.weight_sum if normalizer is None else float(normalizer)
        return dataclasses.replace(out, loss=out.loss + scale * (layout.weights.float() * ce).sum() / norm)
