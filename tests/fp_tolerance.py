"""Tolerances for two floating-point computations of the same quantity that may run different kernels (another
batch shape, row count, code path, ISA or thread count): derived from the dtype's machine epsilon, the magnitude
and the shapes, never a number measured on one CPU.

A dot product of K terms rounded in two different orders differs by about eps * |x| * sqrt(K) (the roundings of
its partial sums add up like a random walk); a network of `depth` such layers (normalised residual blocks, whose
Jacobians are O(1)) adds that up per layer. `c` covers the constant of the random walk (2: a few standard
deviations of it); a real fault (a token seen across a document boundary, a wrong mask) moves the result by orders
of magnitude more (the planted faults below move it by > 1e-2 * |x|).

Greedy tokens of two such computations may differ where the target is at a near tie (its top two logits within a
few ulps: a random tiny target's bf16 logits tie exactly at ~2 % of its positions): `assert_equal_but_near_ties`
accepts a first difference only there."""

from __future__ import annotations

import math
from typing import Callable, Sequence

import torch


def rounding_atol(ref: torch.Tensor, *, terms: int, depth: int = 1, dtype: torch.dtype | None = None,
                  c: float = 2.0) -> float:
    """c * eps(dtype) * max|ref| * sqrt(terms) * depth: the absolute gap two fp computations of `ref` may show."""
    eps = torch.finfo(dtype or ref.dtype).eps
    return c * eps * float(ref.detach().abs().max()) * math.sqrt(terms) * depth


def tie_atol(logits: torch.Tensor, *, dtype: torch.dtype | None = None, k: float = 4.0) -> float:
    """k * eps(dtype) * max|logits|: how far apart two logits of one row may be and still swap order between two
    kernel paths. Each logit may move by up to ~2 eps * max|logits| from one path to another (one flipped rounding
    of the LM head's output, <= 1 ulp <= eps * |logit|, plus about as much from the roundings flipped in the layers
    before it); two paths' argmaxes a and b, seen from a third (the reference), then lie within 2 * 2 = 4 such units
    of each other and of its own max: k = 4."""
    eps = torch.finfo(dtype or logits.dtype).eps
    return k * eps * float(logits.detach().abs().max())


def assert_equal_but_near_ties(got: Sequence[int], want: Sequence[int], logits_at: Callable[[int], torch.Tensor], *,
                               dtype: torch.dtype | None = None, k: float = 4.0) -> int | None:
    """Two greedy decodings of one prompt by different kernel paths (a B-row verification against a one-row
    decode, say): equal token for token, or equal up to a first difference at position i where the target is at a
    near tie. `logits_at(i)` gives the reference logits (V,) of the token after the common prefix got[:i] ==
    want[:i]; both got[i] and want[i] must then be within `tie_atol` of its max (so its top1 - top2 gap is too).
    After a tie the two continue from different prefixes and are not compared. A wrong token (a draft accepted that
    the target did not choose) sits far below the max and fails; so does a length difference without a differing
    token. Returns i, or None when equal."""
    got, want = list(got), list(want)
    i = next((j for j, (a, b) in enumerate(zip(got, want)) if a != b), None)
    if i is None:
        assert len(got) == len(want), f"equal up to {min(len(got), len(want))} tokens, then {len(got)} vs {len(want)}"
        return None
    raw = logits_at(i)  # (V,)
    ref = raw.detach().float()
    atol = tie_atol(ref, dtype=dtype or raw.dtype, k=k)
    top = float(ref.max())
    below = {t: top - float(ref[t]) for t in (got[i], want[i])}
    assert max(below.values()) <= atol, (
        f"token {i} differs ({got[i]} vs {want[i]}) and is no near tie: below the reference's max logit by "
        + ", ".join(f"{t}: {d:.3g}" for t, d in below.items()) + f" (a tie is within {atol:.3g} = {k:g} eps * "
        f"max|logit| {float(ref.abs().max()):.3g})")
    return i
