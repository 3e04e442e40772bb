"""Tolerances for two floating-point computations of the same quantity that may run different kernels (another
batch shape, row count, code path, ISA or thread count): derived from the dtype's machine epsilon, the magnitude
and the shapes, never a number measured on one CPU.

A dot product of K terms rounded in two different orders differs by about eps * |x| * sqrt(K) (the roundings of
its partial sums add up like a random walk); a network of `depth` such layers (normalised residual blocks, whose
Jacobians are O(1)) adds that up per layer. `c` covers the constant of the random walk (2: a few standard
deviations of it); a real fault (a token seen across a document boundary, a wrong mask) moves the result by orders
of magnitude more (the planted faults below move it by > 1e-2 * |x|)."""

from __future__ import annotations

import math

import torch


def rounding_atol(ref: torch.Tensor, *, terms: int, depth: int = 1, dtype: torch.dtype | None = None,
                  c: float = 2.0) -> float:
    """c * eps(dtype) * max|ref| * sqrt(terms) * depth: the absolute gap two fp computations of `ref` may show."""
    eps = torch.finfo(dtype or ref.dtype).eps
    return c * eps * float(ref.detach().abs().max()) * math.sqrt(terms) * depth
