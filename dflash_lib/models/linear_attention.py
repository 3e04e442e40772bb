"""Gated-delta-net (linear-attention) layers of hybrid targets (Qwen3.5, Qwen3.5-MoE, Qwen3-Next) over a packed
sequence, no state crossing a document boundary: `install` wraps the causal convolution and the chunked delta rule
of a transformers modeling module so that a layer called with `DOCUMENTS` runs them per document (docs/data.md).
Without those arguments transformers' own functions run unchanged (its torch rules ignore `cu_seqlens`: a packed
call through them would leak state from one document into the next).
"""

from __future__ import annotations

import importlib.util
from types import ModuleType
from typing import Any, Callable, Sequence

import torch
import torch.nn.functional as F
from transformers.activations import ACT2FN

DOCUMENTS = "dflash_linear_documents"  # host [start, end) pairs tiling the sequence (padding runs included)
CU_SEQLENS = "dflash_linear_cu_seqlens"  # (S+1,) the same tiling on the device (flash-linear-attention's varlen)
CHUNK = 64  # flash-linear-attention's chunk of tokens
HAS_FLA = importlib.util.find_spec("fla") is not None


def padded_causal_conv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, activation: str | None,
                       documents: Sequence[tuple[int, int]]) -> torch.Tensor:
    """The depthwise causal convolution of x (1, D, N) with weight (D, W) over each document [start, end) alone
    (+ bias, activation), in x's dtype, as ONE convolution over the documents each preceded by W-1 zeros."""
    W, D = weight.shape[-1], x.shape[1]
    zeros = x.new_zeros(1, D, W - 1)
    padded = torch.cat([t for s, e in documents for t in (zeros, x[..., s:e])], dim=-1)  # (1, D, N + S(W-1))
    out = F.conv1d(padded.to(weight.dtype), weight.unsqueeze(1), bias, groups=D)  # out[i]: padded[i : i+W]
    out = torch.cat([out[..., s + k * (W - 1):e + k * (W - 1)] for k, (s, e) in enumerate(documents)], dim=-1)
    return (ACT2FN[activation](out) if activation else out).to(x.dtype)


def varlen_causal_conv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, activation: str | None,
                       documents: Sequence[tuple[int, int]], fallback: Callable, **kwargs: Any) -> torch.Tensor:
    """The causal convolution of each document alone: (1, D, N). One padded call on CUDA (`padded_causal_conv`),
    else transformers' own function once per document (its rounding to the bit: CPU kernels round by shape)."""
    if x.is_cuda:
        return padded_causal_conv(x, weight, bias, activation, documents)
    return torch.cat([fallback(x[..., s:e], weight, bias, activation=activation, **kwargs) for s, e in documents],
                     dim=-1)


def fla_rule(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
             cu_seqlens: torch.Tensor) -> torch.Tensor:
    """flash-linear-attention's chunked rule over every document at once (varlen, CUDA, bf16/fp16): (1, N, Hv, V)."""
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    rep = value.shape[2] // key.shape[2]  # grouped value heads: each query/key head serves `rep` of them
    if rep > 1:
        query, key = query.repeat_interleave(rep, dim=2), key.repeat_interleave(rep, dim=2)
    out, _ = chunk_gated_delta_rule(query, key, value, g=g, beta=beta, cu_seqlens=cu_seqlens.long(),
                                    use_qk_l2norm_in_kernel=True)
    return out


def varlen_rule(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                documents: Sequence[tuple[int, int]], cu_seqlens: torch.Tensor | None, fallback: Callable,
                **kwargs: Any) -> torch.Tensor:
    """The delta rule of each document alone: (1, N, Hv, V). flash-linear-attention's varlen kernel where it runs
    (CUDA, half precision, installed), else transformers' torch rule `fallback` once per document."""
    if HAS_FLA and cu_seqlens is not None and query.is_cuda and query.dtype != torch.float32:
        return fla_rule(query, key, value, g, beta, cu_seqlens)
    parts = [fallback(query[:, s:e], key[:, s:e], value[:, s:e], g=g[:, s:e], beta=beta[:, s:e], **kwargs)[0]
             for s, e in documents]
    return torch.cat(parts, dim=1)


def _conv(original: Callable) -> Callable:
    def causal_conv1d_fn(hidden_states, weight, bias=None, activation=None, **kwargs):
        if DOCUMENTS not in kwargs:
            return original(hidden_states, weight, bias, activation=activation, **kwargs)
        documents = kwargs.pop(DOCUMENTS)
        kwargs.pop(CU_SEQLENS, None)
        return varlen_causal_conv(hidden_states, weight, bias, activation, documents, original, **kwargs)

    causal_conv1d_fn.dflash_original = original
    return causal_conv1d_fn


def _rule(original: Callable) -> Callable:
    def torch_chunk_gated_delta_rule(query, key, value, g, beta, **kwargs):
        if DOCUMENTS not in kwargs:
            return original(query, key, value, g=g, beta=beta, **kwargs)
        documents, cu = kwargs.pop(DOCUMENTS), kwargs.pop(CU_SEQLENS, None)
        kwargs.pop("cu_seqlens", None)
        if kwargs.get("initial_state") is not None or kwargs.get("output_final_state"):
            raise ValueError("per-document linear attention runs without a cache (no initial or final state)")
        return varlen_rule(query, key, value, g, beta, documents, cu, original, **kwargs), None

    torch_chunk_gated_delta_rule.dflash_original = original
    return torch_chunk_gated_delta_rule


def install(module: ModuleType) -> None:
    """Wrap `module`'s (a transformers modeling module of a gated-delta-net family) causal_conv1d_fn and
    torch_chunk_gated_delta_rule, once; the layers look them up there at each call."""
    for name, wrap in (("causal_conv1d_fn", _conv), ("torch_chunk_gated_delta_rule", _rule)):
        fn = getattr(module, name, None)
        if fn is None:
            raise RuntimeError(f"{module.__name__} has no {name}: this transformers' gated delta net is not supported")
        if not hasattr(fn, "dflash_original"):
            setattr(module, name, wrap(fn))


def tiling(documents: Sequence[tuple[int, int]], n: int) -> tuple[tuple[int, int], ...]:
    """The documents [start, end) of a sequence of n tokens plus the runs between them (padding), in order."""
    out, at = [], 0
    for s, e in documents:
        if s > at:
            out.append((at, s))
        out.append((s, e))
        at = e
    if at < n:
        out.append((at, n))
    return tuple(out)


def chunk_rule_flops(key_dim: int, value_dim: int, chunk: int = CHUNK) -> int:
    """FLOPs of flash-linear-attention's chunked forward for one chunk of one value head: the chunk's K K^T, its
    triangular inverse, the w and u products, the state read, update and output (3 x c dk dv), and the intra-chunk
    Q K^T and its product with the new values: 2c^2 (3 dk + 2 dv) + 6 c dk dv + 2c^3 / 3."""
    c = chunk
    return 2 * c * c * (3 * key_dim + 2 * value_dim) + 6 * c * key_dim * value_dim + 2 * c ** 3 // 3
