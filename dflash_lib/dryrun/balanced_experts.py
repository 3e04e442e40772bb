"""The dry run's stand-in for a mixture-of-experts block's experts: BALANCED routing, priced without its values.

A Hugging Face MoE experts module (Qwen3-MoE's `Qwen3MoeExperts`: `gate_up_proj` (E, 2I, H), `down_proj` (E, H, I),
called as experts(hidden (N, H), top_k_index (N, k), top_k_weights (N, k)) -> (N, H)) runs one of transformers'
experts implementations (`config._experts_implementation`). "grouped_mm" (transformers 5's default) sorts the
N*k (token, expert) assignments by expert and runs them all in two `torch._grouped_mm` calls: shapes that do not
depend on the routing, so the dry run runs it as it is (its FLOPs: `grouped_mm_flops`). The "eager" loop (and
the per-expert loops of older transformers) routes with `nonzero` / `torch.where` on the router's choice: a
data-dependent shape that `FakeTensorMode` cannot produce. For it the stand-in keeps the module and its
parameters and replaces only its forward: BALANCED routing, every expert getting N*k/E of the assignments (the
first N*k mod E experts one more), the tokens in order, running what the eager loop runs for that many tokens,
one expert at a time: gather, the fused gate-up linear, SiLU x up, the down linear, the routing-weight scale,
`index_add_` into the output.

Why that prices the real step: the linear layers' FLOPs are linear in the tokens an expert gets, so the FLOPs of
any routing of N*k assignments are 2 * N*k * (H*2I + I*H), the stand-in's; the memory of an expert's temporaries
is that of its tokens, so balanced routing is the expected case of a router trained with a load-balancing loss,
not the worst one (one expert taking every token would hold N of them at once, k times the balanced figure).
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
