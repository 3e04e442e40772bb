"""Targets of every supported family, each a tiny random model saved by `save_pretrained` and reloaded from its
folder through our loader: features equal Hugging Face's own forward, documents stay apart in a packed row,
sliding windows stay inside their document, and `train -p target DIR` runs."""

from __future__ import annotations


import numpy as np
import pytest
import torch
import transformers

from dflash_lib.config import ConfigError, ModelConfig
from dflash_lib.data.batch import collate_packed, collate_padded
from dflash_lib.families.qwen3 import QWEN3_VOCAB
import dflash_lib.target.attention as target_module
from dflash_lib.target.attention import document_attention
from dflash_lib.target.local import TargetModel
from fp_tolerance import rounding_atol
from tiny_models import save_random_model, train_two_steps

WINDOW = 8  # tokens: every sliding layer's window, shorter than the documents so that it bites
SHAPE = dict(vocab_size=QWEN3_VOCAB, hidden_size=32, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, head_dim=8, intermediate_size=64)  # the real Qwen3 vocabulary: the corpus fits
HYBRID = dict(layer_types=["linear_attention", "full_attention"] * 2, linear_num_value_heads=4,
              linear_num_key_heads=2, linear_key_head_dim=8, linear_value_head_dim=8)
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=16)
FAMILIES = {
    "llama": lambda: transformers.LlamaConfig(**SHAPE),
    "qwen2": lambda: transformers.Qwen2Config(**SHAPE, use_sliding_window=True, sliding_window=WINDOW,
                                              max_window_layers=2),  # layers 2, 3 slide
    "qwen3": lambda: transformers.Qwen3Config(**SHAPE, use_sliding_window=True, sliding_window=WINDOW,
                                              max_window_layers=2),
    "mistral": lambda: transformers.MistralConfig(**SHAPE, sliding_window=WINDOW),  # every layer slides
    "qwen3_moe": lambda: transformers.Qwen3MoeConfig(**SHAPE, num_experts=4, num_experts_per_tok=2,
                                                     moe_intermediate_size=16),
    "gpt_oss": lambda: transformers.GptOssConfig(**SHAPE, num_local_experts=4, num_experts_per_tok=2,
                                                 sliding_window=WINDOW),  # sliding / full alternate, sinks
    # hybrids: gated-delta-net linear attention (a causal conv and a recurrent state) between full attention layers
    "qwen3_5": lambda: transformers.Qwen3_5TextConfig(**SHAPE, **HYBRID),
    "qwen3_5_moe": lambda: transformers.Qwen3_5MoeTextConfig(**SHAPE, **HYBRID, **MOE),
    "qwen3_next": lambda: transformers.Qwen3NextConfig(**SHAPE, **HYBRID, **MOE),
    # gemma-4: scaled embeddings, sliding layers with their own rotary base, per-layer embeddings, the last layer
    # reusing an earlier one's keys and values, soft-capped final logits
    "gemma4": lambda: transformers.Gemma4TextConfig(
        **SHAPE, sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention"] * 2,
        hidden_size_per_layer_input=8, vocab_size_per_layer_input=QWEN3_VOCAB, num_kv_shared_layers=1,
        global_head_dim=16, final_logit_softcapping=30.0),
    # MLA (DeepSeek-V3 shapes: Kimi-K2.5, GLM-5): low-rank queries and keys/values, values narrower than keys
    "deepseek_v3": lambda: transformers.DeepseekV3Config(
        **{**SHAPE, "num_key_value_heads": 4, "head_dim": 4}, q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8,
        qk_rope_head_dim=4, v_head_dim=6, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
        moe_intermediate_size=16, first_k_dense_replace=1, n_group=1, topk_group=1),
    "minimax_m2": lambda: transformers.MiniMaxM2Config(**SHAPE, num_local_experts=4, num_experts_per_tok=2),
}



@pytest.fixture(scope="session", params=sorted(FAMILIES))
def family(request, tmp_path_factory):
    """(family name, its saved folder, HF's own model loaded from it at the family's attention implementation)."""
    name = request.param
    directory = tmp_path_factory.mktemp(name)
    save_random_model(directory, FAMILIES[name](), spread=(0.3, 0.5))  # every layer matters
    reference = transformers.AutoModelForCausalLM.from_pretrained(directory, local_files_only=True).eval()
    return name, directory, reference


def _load(directory, **fields) -> TargetModel:
    return TargetModel.from_model_config(ModelConfig(target=str(directory), **fields), device="cpu")


def _docs(lengths, seed=0):
    rng = np.random.default_rng(seed)
    return [(rng.integers(0, 1000, n), rng.random(n) < 0.7) for n in lengths]


def test_features_equal_hf_forward_on_one_document(family):
    name, directory, reference = family
    target = _load(directory, num_features=3, target_layer_ids=[0, 1, 2])  # HF's last entry is final-normed
    assert reference.config._attn_implementation == ("eager" if name == "gpt_oss" else "sdpa")
    (doc,) = _docs([3 * WINDOW + 5])  # longer than the window: a sliding layer differs from a full one
    feats = target.features(collate_padded([doc], pad_id=0))[0]  # (T, 3H)
    with torch.no_grad():
        hs = reference.model(torch.as_tensor(doc[0])[None], output_hidden_states=True).hidden_states
    want = torch.cat([hs[i + 1][0] for i in range(3)], dim=-1)
    assert want.std() > 0.1  # the layers are not near identity
    torch.testing.assert_close(feats, want, atol=_tol(want), rtol=0)


def _tol(ref: torch.Tensor, extra_layers: int = 0) -> float:
    """Two fp32 forwards of these 4-layer targets (widest sum: the MLP's 64) in other shapes or kernels."""
    return rounding_atol(ref, terms=SHAPE["intermediate_size"], depth=SHAPE["num_hidden_layers"] + extra_layers)


def test_a_packed_row_equals_its_documents_alone(family):
    name, directory, _ = family
    target = _load(directory, num_features=2, target_layer_ids=[1, 3])
    docs = _docs([WINDOW + 7, 5, 2 * WINDOW + 3], seed=1)  # windows would reach into the previous document
    batch = collate_packed(docs, 0, row_len=64)
    feats = target.features(batch)
    assert (batch.doc_ids[0] >= 0).sum() == sum(len(t) for t, _ in docs)  # one row holds them all
    for d, doc in enumerate(docs):
        alone = target.features(collate_padded([doc], 0))[0]  # (L, 2H)
        torch.testing.assert_close(feats[batch.doc_ids == d], alone, atol=_tol(alone), rtol=0)


def test_fixed_shapes_run_the_padding_apart_from_the_documents(family):
    """With gather off (`static_shapes`) every slot of a padded batch runs, the padding as runs of its own: the
    documents' features equal those of the gathered real tokens (no window, convolution or state reaches from a
    padding run into a document), zero on the padding."""
    name, directory, _ = family
    gathered = _load(directory, num_features=2, target_layer_ids=[1, 3])
    every = TargetModel(gathered.model, gathered.layer_ids, gathered.backend, gather=False)
    batch = collate_padded(_docs([WINDOW + 7, 5, 2 * WINDOW + 3], seed=5), 0)
    want, got = gathered.features(batch), every.features(batch)
    torch.testing.assert_close(got, want, atol=_tol(want), rtol=0)
    assert not got[batch.doc_ids < 0].any()


def test_the_kv_cache_decoder_equals_one_forward(family):
    """The evaluation's `TargetCache` (transformers' own masks over its KV cache, windows and sinks included)
    gives the logits and features of one forward over the whole sequence."""
    from dflash_lib.evaluate.acceptance import TargetCache

    name, directory, _ = family
    target = _load(directory, num_features=1, target_layer_ids=[2])
    ids = torch.as_tensor(_docs([2 * WINDOW + 4], seed=2)[0][0])
    whole = target.step(ids)
    cache = TargetCache(target)
    first, rest = cache.forward(ids[:WINDOW + 3]), cache.forward(ids[WINDOW + 3:])
    torch.testing.assert_close(torch.cat([first.logits, rest.logits]), whole.logits, atol=_tol(whole.logits, 1),
                               rtol=0)
    torch.testing.assert_close(torch.cat([first.features, rest.features]), whole.features,
                               atol=_tol(whole.features), rtol=0)


def test_the_kv_cache_decoder_drops_rejected_positions_exactly(family):
    """A verification of 4 tokens, then a crop keeping 0 or 2 of them (a linear layer's state, a sliding layer past
    its window: restored and run again), then 3 more tokens: the logits of one forward over what was kept."""
    from dflash_lib.evaluate.acceptance import TargetCache

    name, directory, _ = family
    target = _load(directory, num_features=1, target_layer_ids=[2])
    ids = torch.as_tensor(_docs([2 * WINDOW + 12], seed=3)[0][0])
    prefix, verify, after = ids[:2 * WINDOW], ids[2 * WINDOW:2 * WINDOW + 4], ids[2 * WINDOW + 4:2 * WINDOW + 7]
    for kept in (0, 2):
        cache = TargetCache(target)
        cache.forward(prefix)
        cache.forward(verify)
        cache.crop(len(prefix) + kept)
        assert cache.length == len(prefix) + kept
        got = cache.forward(after)
        whole = target.step(torch.cat([prefix, verify[:kept], after]))
        torch.testing.assert_close(got.logits, whole.logits[-3:], atol=_tol(whole.logits, 1), rtol=0)
        torch.testing.assert_close(got.features, whole.features[-3:], atol=_tol(whole.features), rtol=0)


class _HalfRight:
    """A drafter whose first draft is the target's greedy token and the others wrong: every cycle accepts one."""

    def __init__(self, sequence, block=4):
        self.sequence, self.block = sequence, block

    def draft(self, features, anchor_pos, anchor_token):
        true = int(self.sequence[anchor_pos + 1])
        return [true] + [(true + 1 + k) % 1000 for k in range(self.block - 2)]


def test_speculative_decoding_equals_greedy_on_every_family(family):
    """Our in-process speculative decoding over the family's cache (a crop after every verification) gives the
    target's greedy answer token for token."""
    from dflash_lib.evaluate.acceptance import acceptance_length, greedy_decode

    name, directory, _ = family
    target = _load(directory, num_features=1, target_layer_ids=[2])
    prompt = [int(t) for t in _docs([WINDOW + 5], seed=4)[0][0]]
    greedy = greedy_decode(target, [prompt], 2 * WINDOW).outputs[0]
    result = acceptance_length(target, _HalfRight(prompt + greedy), [prompt], 2 * WINDOW)
    assert result.outputs[0] == greedy
    assert set(result.histogram) == {2} and result.cycles == (2 * WINDOW - 1 + 1) // 2  # one draft accepted a cycle


@pytest.mark.parametrize("window,sinks", [(None, True), (3, False), (3, True), (40, True)])
def test_document_attention_is_the_masked_softmax_it_names(window, sinks):
    """Window w: query i sees keys i - w < j <= i; a sink adds exp(s_h) to head h's denominator; chunked so that
    few scores exist at once (a budget of 60 forces chunks of 1 .. 3 queries here)."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, h, 13, 8, generator=g, dtype=torch.float64) for h in (4, 2, 2))
    s = torch.randn(4, generator=g, dtype=torch.float64) if sinks else None
    i, j = torch.arange(13)[:, None], torch.arange(13)[None, :]
    seen = (j <= i) & ((i - j < window) if window else True)  # (13, 13)
    scores = (q @ k.repeat_interleave(2, 1).transpose(-1, -2)) / 8 ** 0.5  # (1, 4, 13, 13)
    weights = scores.masked_fill(~seen, float("-inf")).exp()
    denom = weights.sum(-1, keepdim=True) + (s.exp().view(1, 4, 1, 1) if sinks else 0)
    want = (weights / denom) @ v.repeat_interleave(2, 1)
    budget = target_module.SCORE_BUDGET
    target_module.SCORE_BUDGET = 60
    try:
        got = document_attention(q, k, v, None, window, s)
    finally:
        target_module.SCORE_BUDGET = budget
    torch.testing.assert_close(got, want, atol=1e-12, rtol=0)


def test_what_our_attention_cannot_run_is_refused_in_one_line():
    """A layer kind we do not run, chunked attention, sinks on flash-attn 2, gemma's softcap: ConfigError, one line."""
    def model(name, **overrides):
        return transformers.AutoModelForCausalLM.from_config(FAMILIES[name]() if not overrides else
                                                             type(FAMILIES[name]())(**{**SHAPE, **overrides}))

    cases = [(model("qwen3", layer_types=["chunked_attention"] + ["full_attention"] * 3), "sdpa",
              r"layer types \['chunked_attention'\] are not run by our per-document attention"),
             (model("llama", attention_chunk_size=16), "sdpa", "chunked attention .attention_chunk_size 16."),
             (model("gpt_oss"), "flash", "attention sinks are not run by flash-attn 2")]
    for hf_model, backend, why in cases:
        with pytest.raises(ConfigError, match=why) as e:
            TargetModel(hf_model, [1], backend)
        assert "\n" not in str(e.value)
    q = torch.zeros(1, 4, 3, 8)
    with pytest.raises(ConfigError, match=r"attention with \{'softcap': 50.0\} is not implemented"):
        target_module.sdpa_varlen_attention(torch.nn.Module(), q, q, q, None, dflash_segments=[(0, 3)], softcap=50.0)


def test_weights_that_do_not_match_the_config_name_the_folder_and_keys(family, tmp_path):
    """transformers itself only warns about missing weights and reinitialises a weight of another shape: our
    loader refuses both, naming the folder and the keys."""
    import shutil

    from safetensors.torch import load_file, save_file

    _, directory, _ = family
    shutil.copytree(directory, tmp_path, dirs_exist_ok=True)
    weights = load_file(str(directory / "model.safetensors"))
    norm = weights.pop("model.norm.weight")
    save_file(weights, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ConfigError, match=rf"{tmp_path}.*missing from the checkpoint \['model.norm.weight'\]"):
        _load(tmp_path, num_features=1)
    save_file(weights | {"model.norm.weight": norm[:7]}, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ConfigError, match=rf"{tmp_path}.*of another shape \['model.norm.weight'\]"):
        _load(tmp_path, num_features=1)


def test_a_sharded_folder_loads_the_same_target(family, tmp_path):
    """save_pretrained's index of several safetensors files (what published checkpoints are) loads as one file does."""
    name, directory, reference = family
    reference.save_pretrained(tmp_path, max_shard_size="4MB")
    assert (tmp_path / "model.safetensors.index.json").is_file() and len(list(tmp_path.glob("*.safetensors"))) > 2
    docs = _docs([11, 6], seed=3)
    batch = collate_padded(docs, 0)
    want = _load(directory, num_features=1, target_layer_ids=[2]).features(batch)
    # the same weights: equal, but for the order an MoE's grouped experts or a linear-attention kernel sums in
    torch.testing.assert_close(_load(tmp_path, num_features=1, target_layer_ids=[2]).features(batch), want,
                               atol=_tol(want), rtol=0)


@pytest.mark.slow
def test_train_smoke_from_the_family_folder(family, tmp_path):
    from dflash_lib.doctor import diagnose

    _, directory, _ = family
    drafter = train_two_steps(directory, tmp_path / "run")
    assert drafter["hidden_size"] == 32 and drafter["num_target_layers"] == 4
    report = diagnose(tmp_path / "run" / "drafter", directory, {"doctor_samples": 2})
    # every rule of the export passes; the chat-template rule alone fails, naming what this weights-only folder
    # lacks (the engines render prompts with the target's own template)
    assert report.failed() == ["chat_template"], report.lines()
    assert "chat_template" in report.lines()[-1] and "into the target folder" in report.lines()[-1]


@pytest.mark.parametrize("leak", ["state", "convolution"])
@pytest.mark.parametrize("name", ["qwen3_5", "qwen3_next"])
def test_a_planted_state_leak_across_documents_is_caught(name, leak, monkeypatch):
    """The packed-equals-alone check sees a linear-attention layer read across a document boundary: its delta rule
    run over the whole packed sequence at once (the recurrent state carried on), or its convolution's taps reaching
    into the previous document; the documents after the first change."""
    from dflash_lib.models import linear_attention

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(FAMILIES[name]())
        for p in model.parameters():
            p.data.normal_(0.0, 0.3 if p.dim() > 1 else 0.5)
    target = TargetModel(model, [1, 3])
    docs = _docs([WINDOW + 7, 5, 2 * WINDOW + 3], seed=1)
    batch = collate_packed(docs, 0, row_len=64)

    def worst_gap() -> float:  # in units of the packed-equals-alone check's rounding tolerance
        feats = target.features(batch)
        return max((feats[batch.doc_ids == d] - alone).abs().max().item() / _tol(alone)
                   for d, doc in enumerate(docs) for alone in [target.features(collate_padded([doc], 0))[0]])

    assert worst_gap() <= 1.0  # rounding only
    if leak == "state":
        real = linear_attention.varlen_rule
        monkeypatch.setattr(linear_attention, "varlen_rule", lambda q, k, v, g, beta, documents, *a, **kw: real(
            q, k, v, g, beta, [(documents[0][0], documents[-1][1])], *a, **kw))
    else:
        real_conv = linear_attention.varlen_causal_conv
        monkeypatch.setattr(linear_attention, "varlen_causal_conv", lambda x, w, b, act, documents, *a, **kw: real_conv(
            x, w, b, act, [(documents[0][0], documents[-1][1])], *a, **kw))
    assert 1.0 < worst_gap()  # the fault fails the check


def test_an_unrunnable_config_is_refused_before_any_weight_is_read(tmp_path):
    """`trainable_target_config` reads config.json only: a folder without a single weight gets the one-line reason
    (a layer kind, bidirectional attention, a distribution loss on soft-capped logits), not 'no safetensors'."""
    from dflash_lib.target.local import trainable_target_config

    cases = [(transformers.Qwen3Config(**SHAPE, layer_types=["chunked_attention"] + ["full_attention"] * 3), {},
              r"layer types \['chunked_attention'\] are not run"),
             (FAMILIES["gemma4"](), {"loss": "kl"}, r"loss 'kl' reads the target's distribution, whose final logits "
                                                    r"are soft-capped \(final_logit_softcapping 30.0\)"),
             (transformers.Gemma4TextConfig(**SHAPE, use_bidirectional_attention="all"), {},
              "bidirectional attention")]
    for i, (hf_cfg, fields, why) in enumerate(cases):
        folder = tmp_path / str(i)
        hf_cfg.save_pretrained(folder)  # config.json only
        with pytest.raises(ConfigError, match=why) as e:
            trainable_target_config(ModelConfig(target=str(folder), **fields))
        assert "\n" not in str(e.value) and str(folder) in str(e.value)
    with pytest.raises(ConfigError, match="no model.safetensors"):  # a runnable config reaches the weights' check
        trainable_target_config(ModelConfig(target=str(tmp_path / "1")))


def test_the_drafter_embeds_gemma_blocks_as_the_engine_does(family):
    """vLLM's DFlash drafter embeds its block with the target's embedding rows, without gemma's sqrt(hidden) scale
    (the target's own model applies that): ours too, whatever the target's embedding module multiplies."""
    from dflash_lib.models import DFlashDrafter, DrafterConfig

    name, directory, _ = family
    cfg = ModelConfig(target=str(directory), num_features=1, target_layer_ids=[1], mask_id=5)
    target = TargetModel.from_model_config(cfg)
    drafter = DFlashDrafter(DrafterConfig.from_model_config(cfg, target), target, attention="dense")
    ids = torch.tensor([3, 5, 11])
    rows = target.embed_tokens.weight[ids]
    torch.testing.assert_close(drafter._embed(ids), rows, atol=0, rtol=0)
    scaled = target.embed_tokens(ids)
    if name == "gemma4":  # the module scales, the engine's drafter does not
        torch.testing.assert_close(scaled, rows * 32 ** 0.5, atol=1e-5, rtol=1e-5)
    else:
        torch.testing.assert_close(scaled, rows, atol=0, rtol=0)


def test_a_qwen3_5_vision_language_folder_runs_its_text_model_alone(tmp_path):
    """Qwen3.5 checkpoints are vision-language wrappers (`model_type` qwen3_5, the text weights under
    model.language_model.*): the target is the text model alone, its config the text config (what the dry run,
    the refusals and the drafter read), its features those of the wrapper's own language model."""
    from dflash_lib.models.target_config import local_hf_config

    vision = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32, patch_size=4,
                  spatial_merge_size=1, temporal_patch_size=1)
    cfg = transformers.Qwen3_5Config(text_config=FAMILIES["qwen3_5"]().to_dict(), vision_config=vision)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        wrapper = transformers.Qwen3_5ForConditionalGeneration(cfg).eval()
        for p in wrapper.parameters():
            p.data.normal_(0.0, 0.3 if p.dim() > 1 else 0.5)
    wrapper.save_pretrained(tmp_path)
    text = local_hf_config(tmp_path)
    assert type(text).__name__ == "Qwen3_5TextConfig" and text.layer_types == HYBRID["layer_types"]
    target = _load(tmp_path, num_features=2, target_layer_ids=[0, 1])
    assert not any("visual" in n for n, _ in target.model.named_parameters())
    doc = _docs([2 * WINDOW + 3], seed=4)[0]
    with torch.no_grad():
        hs = wrapper.model.language_model(torch.as_tensor(doc[0])[None], output_hidden_states=True).hidden_states
    torch.testing.assert_close(target.features(collate_padded([doc], 0))[0],
                               torch.cat([hs[1][0], hs[2][0]], dim=-1), atol=1e-5, rtol=0)


def test_a_hybrid_target_on_cuda_without_flash_linear_attention_is_refused_in_one_line(monkeypatch):
    """On CUDA the linear-attention layers run flash-linear-attention's varlen kernel: without the package the
    target is refused at construction, naming it (the per-document torch rule would be correct but crawl)."""
    from dflash_lib.models import linear_attention

    model = transformers.AutoModelForCausalLM.from_config(FAMILIES["qwen3_5"]())
    monkeypatch.setattr(linear_attention, "HAS_FLA", False)
    monkeypatch.setattr(TargetModel, "device", property(lambda self: torch.device("cuda")))
    with pytest.raises(ConfigError, match="linear-attention layers run on CUDA.*pip install flash-linear-attention"):
        TargetModel(model, [1])
