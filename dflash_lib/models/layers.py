"""Drafter building blocks: Qwen3-style decoder layers whose keys/values also cover the target context.

Parameter names follow Hugging Face Qwen3 (`self_attn.q_proj`, `mlp.gate_proj`, `input_layernorm`, ...) so
that a serving engine can map them onto its own Qwen3 layer.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    """Root-mean-square norm over the last dimension, computed in float32."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


class Rotary(nn.Module):
    """Rotary position embedding (rotate-half convention) at absolute integer positions."""

    def __init__(self, head_dim: int, theta: float):
        super().__init__()
        inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)  # (d/2,)
        self.register_buffer("inv_freq", inv_freq.float(), persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions (R, N) -> cos, sin (R, N, head_dim)."""
        angles = positions.unsqueeze(-1).float() * self.inv_freq  # (R, N, d/2)
        angles = torch.cat([angles, angles], dim=-1)  # (R, N, d)
        return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (R, heads, N, d); cos, sin (R, N, d)."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)  # (R, heads, N, d)
    return x * cos.unsqueeze(1) + rotated * sin.unsqueeze(1)


def guarded_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """SDPA with a boolean mask (R, Q, K), True = attend. Query rows that may see no key (padding blocks)
    would give NaN; they attend to everything instead and their output is zeroed.

    q (R, h, Q, d); k, v (R, h, K, d) -> (R, h, Q, d).
    """
    if mask is None:
        return F.scaled_dot_product_attention(q, k, v)
    blind = ~mask.any(dim=-1)  # (R, Q)
    if not bool(blind.any()):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask.unsqueeze(1))
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=(mask | blind.unsqueeze(-1)).unsqueeze(1))
    return out.masked_fill(blind[:, None, :, None], 0.0)


class ContextAttention(nn.Module):
    """Block queries over keys/values of [context ; block], with the SAME k/v projections for both."""

    def __init__(self, hidden: int, heads: int, kv_heads: int, head_dim: int, eps: float):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.q_proj = nn.Linear(hidden, heads * head_dim, bias=False)
        self.k_proj = nn.Linear(hidden, kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(hidden, kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(heads * head_dim, hidden, bias=False)
        self.q_norm = RMSNorm(head_dim, eps)
        self.k_norm = RMSNorm(head_dim, eps)

    def forward(self, x: torch.Tensor, ctx: torch.Tensor, rope_q: tuple[torch.Tensor, torch.Tensor],
                rope_k: tuple[torch.Tensor, torch.Tensor], mask: torch.Tensor | None) -> torch.Tensor:
        """x (R, Q, H) normed block states; ctx (R, S, H) fused target context; rope_q over Q positions,
        rope_k over S + Q positions; mask (R, Q, S + Q) or None (all visible). Returns (R, Q, H)."""
        R, Q, _ = x.shape
        kv_in = torch.cat([ctx, x], dim=1)  # (R, S+Q, H)
        K = kv_in.shape[1]
        q = self.q_norm(self.q_proj(x).view(R, Q, self.heads, self.head_dim)).transpose(1, 2)  # (R, h, Q, d)
        k = self.k_norm(self.k_proj(kv_in).view(R, K, self.kv_heads, self.head_dim)).transpose(1, 2)  # (R, kv, K, d)
        v = self.v_proj(kv_in).view(R, K, self.kv_heads, self.head_dim).transpose(1, 2)  # (R, kv, K, d)
        q, k = apply_rotary(q, *rope_q), apply_rotary(k, *rope_k)
        groups = self.heads // self.kv_heads
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)  # (R, h, K, d)
        out = guarded_attention(q, k, v, mask)  # (R, h, Q, d)
        return self.o_proj(out.transpose(1, 2).reshape(R, Q, self.heads * self.head_dim))


class SwiGLU(nn.Module):
    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DraftLayer(nn.Module):
    """Pre-norm decoder layer; the context enters every layer's keys/values un-normed and is never updated."""

    def __init__(self, hidden: int, heads: int, kv_heads: int, head_dim: int, intermediate: int, eps: float):
        super().__init__()
        self.input_layernorm = RMSNorm(hidden, eps)
        self.self_attn = ContextAttention(hidden, heads, kv_heads, head_dim, eps)
        self.post_attention_layernorm = RMSNorm(hidden, eps)
        self.mlp = SwiGLU(hidden, intermediate)

    def forward(self, x: torch.Tensor, ctx: torch.Tensor, rope_q: tuple[torch.Tensor, torch.Tensor],
                rope_k: tuple[torch.Tensor, torch.Tensor], mask: torch.Tensor | None) -> torch.Tensor:
        """x (R, Q, H) -> (R, Q, H)."""
        x = x + self.self_attn(self.input_layernorm(x), ctx, rope_q, rope_k, mask)
        return x + self.mlp(self.post_attention_layernorm(x))
