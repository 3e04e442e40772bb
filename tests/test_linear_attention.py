"""The per-document pieces of models/linear_attention.py held on CPU against transformers' own Qwen3-Next gated delta
net functions run once per document: the CUDA path's one padded convolution, flash-linear-attention's input
preparation (grouped value heads) through a stand-in kernel, and the tiling of a row into documents and padding
runs against brute force."""

from __future__ import annotations

import itertools
import sys
import types

import pytest
import torch
from transformers.models.qwen3_next import modeling_qwen3_next as qwen3_next

from dflash_lib.models.linear_attention import fla_rule, padded_causal_conv, tiling


def _transformers(name: str):
    """transformers' own function `name` of Qwen3-Next's modeling module (the original where `install` wrapped it)."""
    fn = getattr(qwen3_next, name)
    return getattr(fn, "dflash_original", fn)


def _bounds(lengths) -> list[tuple[int, int]]:
    """Consecutive [start, end) of documents of `lengths` tokens, tiling 0 .. sum(lengths)."""
    ends = list(itertools.accumulate(lengths))
    return list(zip([0] + ends[:-1], ends))


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_the_cuda_paths_padded_convolution_is_transformers_convolution_of_each_document_alone(dtype):
    """`padded_causal_conv` (one conv1d over the documents each preceded by W-1 zeros: what CUDA runs) against
    transformers' causal_conv1d_fn over each document alone, silu after: (1, D, N) equal to rounding. Documents of
    1 and 2 tokens (< W-1) and a long one, so every tap reaching before a document's start must read zero."""
    D, W = 6, 4  # channels, taps (Qwen3-Next's linear_conv_kernel_dim)
    documents = _bounds([1, 7, 2, 13, 3])
    g = torch.Generator().manual_seed(0)
    N = documents[-1][1]
    x = torch.randn(1, D, N, generator=g).to(dtype)  # (1, D, N)
    weight = torch.randn(D, W, generator=g).to(dtype)  # (D, W)
    bias = torch.randn(D, generator=g).to(dtype)
    conv = _transformers("causal_conv1d_fn")
    want = torch.cat([conv(x[..., s:e], weight, bias, activation="silu") for s, e in documents], dim=-1)
    got = padded_causal_conv(x, weight, bias, "silu", documents)
    # each output sums W products and a bias: at most `bound` = the same sum of their magnitudes; W roundings of
    # it and the output's own in `dtype`, silu's slope below 1.1
    bound = torch.cat([conv(x[..., s:e].abs().double(), weight.abs().double(), bias.abs().double())
                       for s, e in documents], dim=-1)  # (1, D, N)
    assert got.shape == want.shape == (1, D, N) and got.dtype == dtype
    worst = float(((got.double() - want.double()).abs() / bound).max()) / torch.finfo(dtype).eps  # in eps
    assert worst <= 2 * (W + 1), f"a gap of {worst:.3g} eps of its bound"


def _tiles_by_brute_force(labels: list[int]) -> tuple[tuple[int, int], ...]:
    """The maximal runs of equal labels (a document's index, -1 on padding) of a row: (start, end) each."""
    cuts = [i for i in range(1, len(labels)) if labels[i] != labels[i - 1]]
    edges = [0] + cuts + [len(labels)] if labels else []
    return tuple(zip(edges[:-1], edges[1:]))


def test_the_tiling_is_every_document_and_every_padding_run_by_brute_force():
    """Every layout of a row of n <= 7 tokens, each token padding, the start of a document or the next token of
    the one before: `tiling` (the documents and the runs between them, in order) is the row cut where the label
    changes, final padding runs of one token included."""
    seen = 0
    for n in range(8):
        for states in itertools.product("psc", repeat=n):  # padding, start of a document, continue it
            if any(st == "c" and (i == 0 or states[i - 1] == "p") for i, st in enumerate(states)):
                continue
            labels, doc = [], -1
            for st in states:
                doc += st == "s"
                labels.append(doc if st != "p" else -1)
            documents = [(s, e) for s, e in _tiles_by_brute_force(labels) if labels[s] >= 0]
            assert tiling(documents, n) == _tiles_by_brute_force(labels), (states, documents)
            seen += 1
    assert seen == sum((1, 2, 5, 13, 34, 89, 233, 610))  # the layouts of n tokens: Fibonacci's F(2n+1)


def test_flash_linear_attentions_grouped_value_heads_are_those_of_transformers_rule(monkeypatch):
    """`fla_rule` (what CUDA runs) with flash-linear-attention's kernel replaced by a stand-in that runs
    transformers' recurrent (token by token) rule over each document of cu_seqlens, for 2 key heads serving 6 value
    heads (3 consecutive each): (1, N, 6, V) equal, to fp32 rounding, to transformers' chunked rule run on each
    document alone with the grouped heads as the layer passes them."""
    recurrent = _transformers("torch_recurrent_gated_delta_rule")
    seen = {}

    def chunk_gated_delta_rule(q, k, v, g, beta, cu_seqlens, use_qk_l2norm_in_kernel):
        seen.update(heads=(q.shape[2], k.shape[2], v.shape[2]), dtype=cu_seqlens.dtype)
        edges = cu_seqlens.tolist()
        out = [recurrent(q[:, s:e], k[:, s:e], v[:, s:e], g=g[:, s:e], beta=beta[:, s:e],
                         use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)[0] for s, e in zip(edges, edges[1:])]
        return torch.cat(out, dim=1), None

    kernel = types.ModuleType("fla.ops.gated_delta_rule")
    kernel.chunk_gated_delta_rule = chunk_gated_delta_rule
    for name, module in (("fla", types.ModuleType("fla")), ("fla.ops", types.ModuleType("fla.ops")),
                         ("fla.ops.gated_delta_rule", kernel)):
        monkeypatch.setitem(sys.modules, name, module)

    Hk, Hv, K, V = 2, 6, 8, 5  # key heads, value heads, their widths
    documents = _bounds([5, 70, 1, 13])  # one longer than the chunked rule's 64-token chunk
    N = documents[-1][1]
    gen = torch.Generator().manual_seed(0)
    q, k = torch.randn(1, N, Hk, K, generator=gen), torch.randn(1, N, Hk, K, generator=gen)
    v = torch.randn(1, N, Hv, V, generator=gen)
    g = -torch.nn.functional.softplus(torch.randn(1, N, Hv, generator=gen))  # log decay <= 0
    beta = torch.sigmoid(torch.randn(1, N, Hv, generator=gen))
    cu_seqlens = torch.tensor([0] + [e for _, e in documents], dtype=torch.int32)

    got = fla_rule(q, k, v, g, beta, cu_seqlens)
    chunked = _transformers("torch_chunk_gated_delta_rule")
    want = torch.cat([chunked(q[:, s:e], k[:, s:e], v[:, s:e], g=g[:, s:e], beta=beta[:, s:e],
                              use_qk_l2norm_in_kernel=True)[0] for s, e in documents], dim=1)
    assert seen == {"heads": (Hv, Hv, Hv), "dtype": torch.int64}  # one query/key head per value head, as fla reads
    assert got.shape == want.shape == (1, N, Hv, V)
    # fp32 roundings of sums over up to a chunk (64 tokens) of terms at most max|v| (unit keys and queries)
    atol = 64 * torch.finfo(torch.float32).eps * v.abs().max().item()
    torch.testing.assert_close(got, want, rtol=0, atol=atol)
