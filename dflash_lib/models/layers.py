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
        """positions (N,) -> cos, sin (N, head_dim)."""
        angles = positions.unsqueeze(-1).float() * self.inv_freq  # (N, d/2)
        angles = torch.cat([angles, angles], dim=-1)  # (N, d)
        return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (1, heads, N, d); cos, sin (N, d)."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)  # (1, heads, N, d)
    return x * cos + rotated * sin


Rope = tuple[torch.Tensor, torch.Tensor]


class ContextAttention(nn.Module):
    """Block queries over keys/values of [context ; block], with the SAME k/v projections for both.

    Which keys a query sees is the `attend` callable's business (`attention.py`); this module only projects,
    norms and rotates, so every backend shares the same math."""

    def __init__(self, hidden: int, heads: int, kv_heads: int, head_dim: int, eps: float):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.q_proj = nn.Linear(hidden, heads * head_dim, bias=False)
        self.k_proj = nn.Linear(hidden, kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(hidden, kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(heads * head_dim, hidden, bias=False)
        self.q_norm = RMSNorm(head_dim, eps)
        self.k_norm = RMSNorm(head_dim, eps)

    def _kv(self, h: torch.Tensor, rope: Rope) -> tuple[torch.Tensor, torch.Tensor]:
        """h (N, H) -> rotated, normed keys and values, each (1, kv, N, d)."""
        N = h.shape[0]
        k = self.k_norm(self.k_proj(h).view(N, self.kv_heads, self.head_dim)).transpose(0, 1).unsqueeze(0)
        v = self.v_proj(h).view(N, self.kv_heads, self.head_dim).transpose(0, 1).unsqueeze(0)
        return apply_rotary(k, *rope), v

    def forward(self, x: torch.Tensor, ctx: torch.Tensor, rope_q: Rope, rope_ctx: Rope, attend) -> torch.Tensor:
        """x (Q, H) normed block states; ctx (C, H) fused target context (un-normed by this layer); rope_q over
        the Q block positions, rope_ctx over the C context positions; attend(q, kc, vc, kb, vb) -> (1, h, Q, d).
        Returns (Q, H)."""
        Q = x.shape[0]
        q = self.q_norm(self.q_proj(x).view(Q, self.heads, self.head_dim)).transpose(0, 1).unsqueeze(0)
        q = apply_rotary(q, *rope_q)  # (1, h, Q, d)
        kc, vc = self._kv(ctx, rope_ctx)  # (1, kv, C, d)
        kb, vb = self._kv(x, rope_q)  # (1, kv, Q, d)
        out = attend(q, kc, vc, kb, vb)  # (1, h, Q, d)
        return self.o_proj(out[0].transpose(0, 1).reshape(Q, self.heads * self.head_dim))


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

    def forward(self, x: torch.Tensor, ctx: torch.Tensor, rope_q: Rope, rope_ctx: Rope, attend) -> torch.Tensor:
        """x (Q, H) -> (Q, H); see ContextAttention.forward."""
        x = x + self.self_attn(self.input_layernorm(x), ctx, rope_q, rope_ctx, attend)
        return x + self.mlp(self.post_attention_layernorm(x))
