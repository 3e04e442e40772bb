"""The dry run's stand-in for a mixture-of-experts block's experts: BALANCED routing, priced without its values.

transformers' "grouped_mm" experts have shapes that do not depend on the routing and run as they are (FLOPs:
`grouped_mm_flops`); the "eager" loop routes with data-dependent shapes that `FakeTensorMode` cannot produce, so
`install_balanced_experts` keeps its module and replaces only its forward: every expert gets N*k/E of the
assignments and runs what the eager loop runs for them. Why that prices the real step: docs/scale.md, "Larger
targets on several GPUs: `dryrun --world-size`".
"""

from __future__ import annotations

import types
from typing import Any, Sequence

import torch
import torch.nn.functional as F


def is_routed_experts(module: torch.nn.Module) -> bool:
    """True for an experts module of the fused Qwen3-MoE layout (3-D gate_up_proj and down_proj parameters)."""
    gu, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
    return (isinstance(gu, torch.nn.Parameter) and isinstance(down, torch.nn.Parameter) and gu.dim() == 3
            and down.dim() == 3 and gu.shape[0] == down.shape[0] and gu.shape[1] == 2 * down.shape[2])


def balanced_counts(assignments: int, num_experts: int) -> list[int]:
    """(token, expert) assignments each expert gets under balanced routing: as equal as integers allow."""
    base, extra = divmod(assignments, num_experts)
    return [base + (e < extra) for e in range(num_experts)]


def _balanced_forward(self: torch.nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                      top_k_weights: torch.Tensor) -> torch.Tensor:
    """hidden_states (N, H), top_k_index (N, k), top_k_weights (N, k) -> (N, H), the routing balanced (module
    docstring); `top_k_index` gives only the shape (its values are never read)."""
    N, k = top_k_index.shape
    out = torch.zeros_like(hidden_states)  # (N, H)
    weights = top_k_weights.reshape(-1)  # (N*k,) assignment j = (token j // k, its (j % k)-th expert)
    start = 0
    for e, m in enumerate(balanced_counts(N * k, self.gate_up_proj.shape[0])):
        if m == 0:
            continue
        slots = torch.arange(start, start + m, device=hidden_states.device)  # (m,) this expert's assignments
        start += m
        tokens = slots // k
        gate, up = F.linear(hidden_states[tokens], self.gate_up_proj[e]).chunk(2, dim=-1)  # (m, I) each
        y = F.linear(self.act_fn(gate) * up, self.down_proj[e])  # (m, H)
        out.index_add_(0, tokens, (y * weights[slots, None]).to(out.dtype))
    return out


FAKE_RUNNABLE = ("grouped_mm", "batched_mm")  # experts implementations with routing-independent shapes


def install_balanced_experts(model: torch.nn.Module, force: bool = False) -> int:
    """Replace the forward of every routed-experts module of `model` whose implementation fake tensors cannot run
    (not one of FAKE_RUNNABLE; every one with `force`) by the balanced stand-in (module docstring); returns how
    many were replaced. The parameters stay as they are."""
    n = 0
    for module in model.modules():
        impl = getattr(getattr(module, "config", None), "_experts_implementation", None)
        if is_routed_experts(module) and (force or impl not in FAKE_RUNNABLE):
            module.forward = types.MethodType(_balanced_forward, module)
            n += 1
    return n


def grouped_mm_flops(a: Sequence[int], b: Sequence[int], *_: Any, out_shape: Any = None, **__: Any) -> int:
    """FLOPs of `torch._grouped_mm` on shapes a (S, K) and b (E, K, N) (every row of a meets one group's (K, N)
    matrix, whatever the offsets): 2 * S * K * N. `FlopCounterMode` has no formula for it (it would count 0)."""
    return 2 * a[0] * a[-1] * b[-1]
