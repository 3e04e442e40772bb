"""An independent DFlash2 drafting step built from the installed vLLM's own CPU path: its grouped convolution
(`_grouped_conv`) and its selector's edge scores (`_score_edges`) from vllm/model_executor/models/qwen3_dflash2.py,
called directly, composed as its `DFlash2Qwen3DecoderLayer.forward` and `DFlash2Speculator` do, around a plain
torch Qwen3 layer written here (not dflash_lib's). Run by the ENGINE's Python (tests/test_dflash2.py):

    python vllm_dflash2_reference.py IN.pt OUT.pt [IN2.pt OUT2.pt ...]

IN.pt: {"cfg": dict, "weights": {served name: tensor}, "embed": (V, H), "head": (V, H), "blocks": [dict(features
(a, F*H), anchor_token)]}; OUT.pt: per block {"logits": (B, V), "ids": (B-1, K), "scores": (B-1, K, K),
"tokens": [B-1 ints]}. Everything in float64. Several pairs share one start (vLLM's import is most of its time).
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F
from vllm.model_executor.models.qwen3_dflash2 import _grouped_conv, _score_edges


def rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def rope(x: torch.Tensor, pos: torch.Tensor, theta: float) -> torch.Tensor:
    """x (heads, N, d) rotated at positions pos (N,), the rotate-half convention."""
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    ang = pos.double()[:, None] * inv[None, :]
    cos, sin = torch.cat([ang, ang], -1).cos(), torch.cat([ang, ang], -1).sin()
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return x * cos + torch.cat([-x2, x1], -1) * sin


def conv(y: torch.Tensor, delta: torch.Tensor, base: torch.Tensor, c: dict) -> torch.Tensor:
    """vLLM's CPU grouped convolution of one side: y (Q, H), delta (Q, taps, G), base (taps, H)."""
    G = c["hidden"] // c["group"]
    return _grouped_conv(y, delta, base, c["block"], G, c["group"], c["taps"])


def block_step(c: dict, w: dict, embed: torch.Tensor, head: torch.Tensor, feats: torch.Tensor,
               anchor_token: int) -> dict:
    B, H, taps, G = c["block"], c["hidden"], c["taps"], c["hidden"] // c["group"]
    heads, kv, d, eps, theta = c["heads"], c["kv_heads"], c["head_dim"], c["eps"], c["theta"]
    a = feats.shape[0]
    ctx = rms(feats @ w["fc.weight"].T, w["hidden_norm.weight"], eps)  # (a, H)
    ids = torch.tensor([anchor_token] + [c["mask"]] * (B - 1))
    x = embed[ids] * c["input_embedding_scale"]  # (B, H)
    q_pos, k_pos = torch.arange(a, a + B), torch.arange(a + B)
    for i in range(c["layers"]):
        p = f"layers.{i}."
        h = rms(x, w[p + "input_layernorm.weight"], eps)
        delta = (h @ w[p + "attention_conv.kernel_projection.weight"].T).reshape(B, 2, taps, G)
        base = w[p + "attention_conv.base_kernel"]
        h = conv(h, delta[:, 0], base[0], c)
        q = (h @ w[p + "self_attn.q_proj.weight"].T).reshape(B, heads, d).transpose(0, 1)
        both = torch.cat([ctx, h])  # the context's keys and values come from the same projections
        k = (both @ w[p + "self_attn.k_proj.weight"].T).reshape(a + B, kv, d).transpose(0, 1)
        v = (both @ w[p + "self_attn.v_proj.weight"].T).reshape(a + B, kv, d).transpose(0, 1)
        q = rope(rms(q, w[p + "self_attn.q_norm.weight"], eps), q_pos, theta)
        k = rope(rms(k, w[p + "self_attn.k_norm.weight"], eps), k_pos, theta)
        k, v = k.repeat_interleave(heads // kv, 0), v.repeat_interleave(heads // kv, 0)
        att = torch.softmax(q @ k.transpose(1, 2) / d ** 0.5, -1) @ v  # (heads, B, d): the block sees all
        o = att.transpose(0, 1).reshape(B, heads * d) @ w[p + "self_attn.o_proj.weight"].T
        x = x + conv(o, delta[:, 1], base[1], c)
        h = rms(x, w[p + "post_attention_layernorm.weight"], eps)
        delta = (h @ w[p + "mlp_conv.kernel_projection.weight"].T).reshape(B, 2, taps, G)
        base = w[p + "mlp_conv.base_kernel"]
        h = conv(h, delta[:, 0], base[0], c)
        m = (F.silu(h @ w[p + "mlp.gate_proj.weight"].T) * (h @ w[p + "mlp.up_proj.weight"].T)) @ w[
            p + "mlp.down_proj.weight"].T
        x = x + conv(m, delta[:, 1], base[1], c)
    final = rms(x, w["norm.weight"], eps)  # (B, H)
    logits = final @ head.T  # (B, V)
    K, S = c["top_k"], B - 1
    values, cand = logits[1:].topk(K, dim=-1)  # (S, K) the drafted positions' candidates, best first
    unary = values * c["output_multiplier"]
    if c["final_logit_softcapping"] > 0:
        unary = torch.tanh(unary / c["final_logit_softcapping"]) * c["final_logit_softcapping"]
    hidden = final[1:] @ w["candidate_selector.hidden_projection.weight"].T  # (S, r)
    scores = _score_edges(w["candidate_selector.predecessor_codebook"], w["candidate_selector.successor_codebook"],
                          cand[None], unary[None], hidden[None], torch.tensor([anchor_token]), K)[0]  # (S, K, K)
    tokens, previous = [], 0  # the speculator's walk at temperature 0: row `previous` of each step
    for s in range(S):
        previous = int(scores[s, previous].argmax())
        tokens.append(int(cand[s, previous]))
    return {"logits": logits, "ids": cand, "scores": scores, "tokens": tokens}


def main(src: str, dst: str) -> None:
    data = torch.load(src, weights_only=True)
    w = {k: v.double() for k, v in data["weights"].items()}
    embed, head = data["embed"].double(), data["head"].double()
    out = [block_step(data["cfg"], w, embed, head, b["features"].double(), int(b["anchor_token"]))
           for b in data["blocks"]]
    torch.save(out, dst)


if __name__ == "__main__":
    for i in range(1, len(sys.argv), 2):
        main(sys.argv[i], sys.argv[i + 1])
