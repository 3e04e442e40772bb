"""The local target's attention, per document: `sdpa_varlen_attention` (registered with transformers as
SDPA_VARLEN: causal attention within each document of one flattened sequence, with each layer's sliding window and
gpt-oss' sinks), its chunked core (`document_attention`, `attention_with_sinks`), and which backend runs it
(`resolve_backend`: SDPA, or flash-attn's varlen kernel on CUDA). Shapes: (batch, heads, tokens, head dim).
"""

from __future__ import annotations

import importlib.util
from typing import Sequence

import torch
import torch.nn.functional as F
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from dflash_lib.config import ConfigError


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
