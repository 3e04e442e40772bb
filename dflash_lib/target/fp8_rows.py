"""Features held in float8 e4m3 with a float32 scale per row (`-p hidden_cache_dtype float8_e4m3fn`): a row is one
token's output of one layer (H values), divided by its absolute maximum over E4M3_MAX so that it spans e4m3's range.
One byte a value and 4 a row: H + 4 bytes where bf16 takes 2H (0.502 of bf16 at H 576, 0.5005 at 4096). e4m3 keeps 3
mantissa bits (a value rounds by at most 1/16 of itself); values under 2^-6 / 448 of their row's maximum lose
precision (subnormals) and under 2^-9 / 448 of it become 0. Casts only (no scaled matmul): what torch has done
on every device since 2.1. Its loss against bf16: docs/scale.md, "Cached: generate once, train many epochs".
"""

from __future__ import annotations

import torch

FP8 = torch.float8_e4m3fn
E4M3_MAX = 448.0  # the largest finite e4m3fn value


def encode_rows(x: torch.Tensor, out: torch.Tensor, scale: torch.Tensor) -> None:
    """x (n, R, H), any float dtype -> `out` (n, R, H) float8_e4m3fn and `scale` (n, R) float32, written in place
    (views into a shard's buffers: nothing of the size of a shard is allocated here). A row of zeros has scale 1."""
    amax = x.abs().amax(dim=-1, keepdim=True).float()  # (n, R, 1)
    s = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
    out.copy_((x.float() / s).clamp_(-E4M3_MAX, E4M3_MAX))  # the clamp: a quotient rounded past 448 stays finite
    scale.copy_(s.squeeze(-1))


def decode_rows(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """q (n, R*H) float8_e4m3fn and its scales (n, R) float32 -> (n, R*H) in `dtype`."""
    n, rows = scale.shape
    return (q.float().view(n, rows, -1) * scale[:, :, None]).reshape(n, -1).to(dtype)
