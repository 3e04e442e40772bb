"""The serving doctor: a fresh export against a target folder whose tokenizer and chat template match training passes
every rule; each planted fault fails its own rule and no other; the command's lines and exit codes."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from dflash_lib.__main__ import main
from dflash_lib.config import ConfigError
from dflash_lib.data.tokenizers import QWEN, MappedVocab
from dflash_lib.doctor import TargetReading, config_rules, diagnose, engine_layer_ids, safetensors_header
from dflash_lib.models import DFlashDrafter, DrafterConfig, tiny_qwen3_config
from dflash_lib.target.local import TargetModel
from dflash_lib.models.export import drafter_config, export_drafter, read_doc, read_weights
from tiny_models import tiny_chatml_tokenizer

LAYERS, H = 6, 32
QWEN3_JINJA = json.loads((Path(__file__).parent / "fixtures" / "qwen3" / "tokenizer_config.json").read_text())[
    "chat_template"]
CHATML_JINJA = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
CONVERSATIONS = [
    [("user", "Hi there"), ("assistant", "Hello! How can I help?")],
    [("system", "Be brief."), ("user", "2+2?"), ("assistant", "4")],
    [("user", "Hi"), ("assistant", "Hello."), ("user", "2+2?"), ("assistant", "4, I think.")],
]
RULES = ["architecture", "hidden_act", "hidden_size", "vocab_size", "block_size", "target_layer_ids",
         "engine_layer_ids", "mask_token_id", "weights", "no_embedding", "dtype", "trained_as", "causality",
         "chat_template"]
WATCHED = {"dflash_target_layer_ids", "dflash_mask_token_id", "dflash_block_size", "block_size"}  # trained_as's


def _target_folder(folder: Path, chat_template: str | None) -> Path:
    """A target folder the doctor reads: a tiny Qwen3's config.json (one row past the tokenizer's ids: the MASK
    row) and a byte-level BPE with the Qwen3 specials (<think> and </think> special, as Qwen3's) and
    `chat_template`."""
    hf = tiny_chatml_tokenizer()
    hf.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<think>", "</think>"]})
    hf.chat_template = chat_template
    hf.save_pretrained(folder)
    tiny_qwen3_config(hidden_size=H, num_layers=LAYERS, vocab_size=len(hf) + 1).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """(export folder, target folder, corpus file): a drafter exported the way training records it (template
    qwen3, the target's tokenizer, thinking off, the corpus) on a target with Qwen3's chat template."""
    root = tmp_path_factory.mktemp("doctor")
    target_dir = _target_folder(root / "target", QWEN3_JINJA)
    corpus = root / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"messages": [{"role": r, "content": c} for r, c in turns]}) + "\n"
                              for turns in CONVERSATIONS))
    hf_cfg = tiny_qwen3_config(hidden_size=H, num_layers=LAYERS,
                               vocab_size=json.loads((target_dir / "config.json").read_text())["vocab_size"])
    target = TargetModel.from_hf_config(hf_cfg, 2, layer_ids=[1, 3], seed=0)
    cfg = DrafterConfig(hidden_size=H, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, intermediate_size=64,
                        vocab_size=target.vocab_size, target_layer_ids=[1, 3], target_num_layers=LAYERS,
                        block_size=4, mask_id=target.vocab_size - 1)
    torch.manual_seed(0)
    export_drafter(DFlashDrafter(cfg, target), root / "export", torch.bfloat16, template="qwen3",
                   target_name=str(target_dir),
                   data={"tokenizer": str(target_dir), "thinking": "off", "corpus": str(corpus)})
    return root / "export", target_dir, corpus


def _copy(export: Path, tmp_path: Path, **changes) -> Path:
    """A copy of the export folder with config.json's top-level `changes` (dflash_config keys as dflash_<key>)."""
    out = tmp_path / "export"
    shutil.copytree(export, out)
    doc = json.loads((out / "config.json").read_text())
    for key, value in changes.items():
        if key.startswith("dflash_"):
            doc["dflash_config"][key[len("dflash_"):]] = value
        else:
            doc[key] = value
    (out / "config.json").write_text(json.dumps(doc))
    return out


def _rewrite_weights(folder: Path, edit) -> None:
    weights = read_weights(folder)
    edit(weights)
    save_file({k: v.contiguous() for k, v in weights.items()}, str(folder / "model.safetensors"))


def _failed(report) -> list[str]:
    return [r.name for r in report.rules if r.ok is False]


def test_a_fresh_export_passes_every_rule(setup):
    export, target_dir, corpus = setup
    report = diagnose(export, target_dir, {"doctor_samples": 3})
    assert [r.name for r in report.rules] == RULES
    assert report.ok, report.lines()
    template = report.rules[-1].detail
    assert template.startswith(f"3 samples of {str(corpus)!r}") and "template 'qwen3' (export)" in template
    assert "thinking 'off' (export)" in template
    assert "sglang [1, 3], vllm [1, 3], vllm before its DFlash fix [1, 3]" in report.rules[6].detail
    header = safetensors_header(export / "model.safetensors")
    assert header["fc.weight"] == ("BF16", (H, 2 * H)) and len(header) == 3 + 2 * 11


@pytest.mark.parametrize("changes, rule, says", [
    (dict(eagle_aux_hidden_state_layer_ids=[3, 5]), "engine_layer_ids",
     "sglang [1, 3], vllm [2, 4], vllm before its DFlash fix [2, 4]"),
    (dict(dflash_target_layer_ids=[2, 4]), "engine_layer_ids",
     "sglang [2, 4], vllm [1, 3], vllm before its DFlash fix [1, 3]"),
    (dict(hidden_act="gelu"), "hidden_act", "hidden_act 'gelu'"),
    (dict(vocab_size=151936), "vocab_size", "drafter vocab_size 151936, target 302"),
    (dict(dflash_mask_token_id=10_000), "mask_token_id", "mask_token_id 10000"),
    (dict(dflash_block_size=8), "block_size", "they disagree"),
    (dict(block_size=1, dflash_block_size=1), "block_size", "not an integer >= 2"),  # no draft token at all
    (dict(dflash_mask_token_id=302), "mask_token_id", "mask_token_id 302"),  # one past the last row of both
    (dict(architectures=["Qwen3ForCausalLM"]), "architecture", "['Qwen3ForCausalLM']"),
    (dict(torch_dtype="float32", dtype="float32"), "dtype", "tensors stored as ['BF16']"),
])
def test_each_planted_config_fault_fails_its_rule_only(setup, tmp_path, changes, rule, says):
    """Its own rule, and `trained_as` too where the field changed is one training fixed."""
    export, target_dir, _ = setup
    report = diagnose(_copy(export, tmp_path, **changes), target_dir, {"doctor_samples": 1})
    assert _failed(report) == [rule] + (["trained_as"] if WATCHED & set(changes) else [])
    failed = next(r for r in report.rules if r.name == rule)
    assert says in failed.detail and failed.line().startswith(f"FAIL {rule}: ") and " -> " in failed.line()


@pytest.mark.parametrize("below, missing", [(0, []), (1, ["d2t", "lm_head.weight"])])
def test_a_draft_vocabulary_is_one_below_the_vocabulary_size(setup, tmp_path, below, missing):
    """config.json's draft_vocab_size equal to vocab_size (302 tokens) is no draft vocabulary: the plain export's
    weights pass; one token fewer is one, whose d2t and lm_head this file lacks. The export's reader counts alike."""
    export, target_dir, _ = setup
    vocab = json.loads((export / "config.json").read_text())["vocab_size"]
    folder = _copy(export, tmp_path, draft_vocab_size=vocab - below)
    report = diagnose(folder, target_dir, {"doctor_samples": 1})
    assert _failed(report) == (["weights"] if missing else []), report.lines()
    assert (f"missing {missing}" in report.rules[RULES.index("weights")].detail) == bool(missing)
    assert drafter_config(read_doc(folder)).draft_vocab_size == (vocab - below if below else 0)


def test_a_layer_id_past_the_target_fails_both_layer_rules(setup, tmp_path):
    export, target_dir, _ = setup
    report = diagnose(_copy(export, tmp_path, dflash_target_layer_ids=[3, 6]), target_dir, {"doctor_samples": 1})
    assert _failed(report) == ["target_layer_ids", "engine_layer_ids", "trained_as"]
    assert "[6] outside the target's layers 0 .. 5" in report.rules[5].detail


def test_what_each_engine_reads_with_and_without_the_vllm_ids(setup, tmp_path):
    doc = {"dflash_config": {"target_layer_ids": [1, 3]}}
    assert engine_layer_ids(doc) == {"sglang": [1, 3], "vllm": [1, 3], "vllm before its DFlash fix": [0, 2]}
    assert engine_layer_ids({**doc, "eagle_aux_hidden_state_layer_ids": [2, 5]}) == {
        "sglang": [1, 3], "vllm": [1, 4], "vllm before its DFlash fix": [1, 4]}
    export, target_dir, _ = setup  # a published folder without them: fine for SGLang, not for older vLLM builds
    folder = _copy(export, tmp_path)
    doc = json.loads((folder / "config.json").read_text())
    doc.pop("eagle_aux_hidden_state_layer_ids")
    (folder / "config.json").write_text(json.dumps(doc))
    report = diagnose(folder, target_dir, {"doctor_samples": 1})
    assert _failed(report) == ["engine_layer_ids"]
    assert "vLLM builds before its DFlash fix take target_layer_ids as layer boundaries" in report.rules[6].detail


@pytest.mark.parametrize("edit, rule, says", [
    (lambda w: w.pop("fc.weight"), "weights", "missing ['fc.weight']"),
    (lambda w: w.update({"fc.weight": w["fc.weight"][:, :H]}), "weights", "fc.weight (32, 32) (expected (32, 64))"),
    (lambda w: w.update({"embed_tokens.weight": torch.zeros(4, H, dtype=torch.bfloat16)}), "no_embedding",
     "['embed_tokens.weight']"),
    (lambda w: w.update({"norm.weight": w["norm.weight"].float()}), "dtype", "tensors stored as ['BF16', 'F32']"),
])
def test_each_planted_weight_fault_fails_its_rule_only(setup, tmp_path, edit, rule, says):
    """Its own rule, and `trained_as` (the weights file is not the one exported)."""
    export, target_dir, _ = setup
    folder = _copy(export, tmp_path)
    _rewrite_weights(folder, edit)
    report = diagnose(folder, target_dir, {"doctor_samples": 1})
    assert _failed(report) == [rule, "trained_as"]
    assert says in next(r for r in report.rules if r.name == rule).detail


def _swap_fc_halves(w):
    fc = w["fc.weight"]
    w["fc.weight"] = torch.cat([fc[:, H:], fc[:, :H]], dim=1)  # the two fused layers' columns exchanged


@pytest.mark.parametrize("changes, edit, says", [
    (dict(dflash_target_layer_ids=[2, 4], eagle_aux_hidden_state_layer_ids=[3, 5]), None,
     "target_layer_ids [2, 4] (trained [1, 3])"),  # shifted by one in both fields: every engine agrees, wrongly
    (dict(dflash_mask_token_id=0), None, "mask_token_id 0 (trained 301)"),  # an ordinary row
    (dict(block_size=8, dflash_block_size=8), None, "block_size 8 (trained 4)"),  # both agree, on 8
    ({}, _swap_fc_halves, "model.safetensors is not the file the export wrote"),  # same shapes: loads
])
def test_faults_every_other_rule_passes_fail_trained_as(setup, tmp_path, changes, edit, says):
    """The faults the real engine serves without a word (docs/serving.md: each served, acceptance off) and that no
    shape or range rule can see: the export's own record of what training fixed names them."""
    export, target_dir, _ = setup
    folder = _copy(export, tmp_path, **changes)
    if edit is not None:
        _rewrite_weights(folder, edit)
    report = diagnose(folder, target_dir, {"doctor_samples": 1})
    assert _failed(report) == ["trained_as"]
    rule = next(r for r in report.rules if r.name == "trained_as")
    assert rule.detail.startswith("changed since export: ") and says in rule.detail
    assert "python -m dflash_lib export" in rule.fix


def test_a_folder_without_the_training_record_makes_trained_as_not_applicable(setup, tmp_path):
    export, target_dir, _ = setup
    folder = _copy(export, tmp_path)
    doc = json.loads((folder / "config.json").read_text())
    del doc["dflash_config"]["training"]["trained_as"]
    (folder / "config.json").write_text(json.dumps(doc))
    report = diagnose(folder, target_dir, {"doctor_samples": 1})
    assert report.ok and report.not_applicable() == ["trained_as", "causality"]


@pytest.mark.parametrize("changes, says", [
    (dict(dflash_causal=True), "vLLM runs layers causal [True, True], training ran [False, False]"),
    (dict(is_causal=True, dflash_causal=None), "vLLM runs layers causal [True, True], training ran [False, False]"),
    (dict(dflash_causal=None, layer_types=["sliding_attention", "full_attention"], sliding_window=4),
     "vLLM runs layers causal [True, False], training ran [False, False]"),  # vLLM's default for each kind
    (dict(is_causal="false"), "is_causal is no true/false"),  # bool("false") is True
    (dict(is_causal=False, dflash_causal=True), "they disagree (vLLM 0.32 takes is_causal"),
])
def test_a_folder_served_with_other_causality_than_trained_fails_the_causality_rule(setup, tmp_path, changes, says):
    """The export of two full non-causal layers states dflash_config.causal false; an edit that makes vLLM run
    other layers causal, or a field it reads otherwise than meant, fails `causality`."""
    export, target_dir, _ = setup
    assert json.loads((export / "config.json").read_text())["dflash_config"]["causal"] is False
    report = diagnose(_copy(export, tmp_path, **changes), target_dir, {"doctor_samples": 1})
    assert _failed(report) == ["causality"], report.lines()
    rule = next(r for r in report.rules if r.name == "causality")
    assert says in rule.detail and "-p drafter_causal" in rule.fix


def test_the_doctors_reading_of_the_layer_kinds_without_layer_types_is_qwen3s():
    """No layer_types: Qwen3's config makes layers sliding from max_window_layers on when use_sliding_window (and a
    window) is set; an empty list makes none causal."""
    from dflash_lib.doctor import served_causal

    doc = {"num_hidden_layers": 3, "use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1}
    assert served_causal(doc) == [False, True, True]
    assert served_causal({**doc, "sliding_window": None}) == served_causal({**doc, "use_sliding_window": False}) \
        == served_causal({**doc, "layer_types": []}) == [False] * 3
    assert served_causal({**doc, "dflash_config": {"causal": False}, "is_causal": None}) == [False] * 3


TARGET = TargetReading("target", H, LAYERS, 302)


def _rule(doc: dict, name: str, target: TargetReading = TARGET) -> bool | None:
    """The verdict of config rule `name` alone on config.json `doc`."""
    return next(r for r in config_rules(doc, target) if r.name == name).ok


@pytest.mark.parametrize("target_vocab, drafter_vocab, mask, ok", [
    (302, 302, 301, True), (302, 302, 302, False),  # the last row of both, and one past it
    (302, 400, 301, True), (302, 400, 302, False),  # the target's embedding bounds it
    (400, 302, 301, True), (400, 302, 302, False),  # the drafter's vocabulary bounds it
    (302, 302, 0, True), (302, 302, -1, False), (302, 302, True, False), (302, 302, "301", False),
    (302, 302, None, False),
])
def test_the_mask_rule_alone_holds_at_its_boundaries(target_vocab, drafter_vocab, mask, ok):
    doc = {"vocab_size": drafter_vocab, "dflash_config": {"mask_token_id": mask}}
    assert _rule(doc, "mask_token_id", TargetReading("target", H, LAYERS, target_vocab)) is ok


def test_the_mask_rule_refuses_an_id_the_target_emits(tmp_path):
    """The MASK must be no eos, bos or pad id of the target (config.json and generation_config.json, every eos of
    a list): the drafter would read the end of a turn as MASK. The real demo target's 16 passes."""
    import transformers

    from dflash_lib.doctor import target_reading

    cfg = transformers.LlamaConfig(hidden_size=H, num_hidden_layers=LAYERS, num_attention_heads=2, vocab_size=302,
                                   intermediate_size=32, bos_token_id=1, eos_token_id=2, pad_token_id=None)
    cfg.save_pretrained(tmp_path)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7], "bos_token_id": 1}))
    facts = target_reading(tmp_path)
    assert facts.special_ids == (1, 2, 7)
    doc = {"vocab_size": 302, "dflash_config": {"mask_token_id": 7}}
    (rule,) = [r for r in config_rules(doc, facts) if r.name == "mask_token_id"]
    assert not rule.ok and "7 is one of the target's eos / bos / pad ids [1, 2, 7]" in rule.detail
    assert all(_rule({**doc, "dflash_config": {"mask_token_id": m}}, "mask_token_id", facts) is (m not in (1, 2, 7))
               for m in (0, 1, 2, 7, 16, 301))


@pytest.mark.parametrize("top, inner, ok", [
    (2, 2, True), (2, None, True), (None, 16, True), (1, 1, False), (1, None, False), (None, 1, False),
    (0, None, False), (True, None, False), (4.0, None, False), (4, 8, False), (None, None, False),
])
def test_the_block_size_rule_alone_needs_one_integer_of_at_least_two(top, inner, ok):
    """Block size 1 is an anchor and no draft token: nothing to serve."""
    doc = {k: v for k, v in (("block_size", top),) if v is not None}
    doc["dflash_config"] = {k: v for k, v in (("block_size", inner),) if v is not None}
    assert _rule(doc, "block_size") is ok


def _assistant_start(target_dir: Path) -> int:
    """Tokens of the first corpus conversation before its answer's body ("...<|im_start|>assistant\\n")."""
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(target_dir)
    return len(hf("<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)[
        "input_ids"])


def test_a_target_template_without_the_think_block_names_sample_and_position(setup, tmp_path):
    export, target_dir, _ = setup
    plain = _target_folder(tmp_path / "chatml_target", CHATML_JINJA)
    report = diagnose(export, plain, {"doctor_samples": 3})
    assert _failed(report) == ["chat_template"]
    m = report.mismatch
    assert (m.sample, m.record, m.part, m.position) == (0, "line 1", "conversation", _assistant_start(plain))
    # 4 tokens before, 5 from the difference: training's empty think block, the target's answer
    assert m.training_context == "'\\n<|im_start|>assistant\\n' | '<think>\\n\\n</think>\\n'"
    assert m.target_context == "'\\n<|im_start|>assistant\\n' | 'Hello! How can I'"
    assert (m.training_tokens, m.target_tokens) == (25, 19)
    assert report.rules[-1].detail.startswith("3 of 3 samples differ")
    doc = json.loads(json.dumps(report.to_json()))  # the record a notebook keeps
    assert (doc["ok"], doc["mismatch"]["position"], [r["name"] for r in doc["rules"] if not r["ok"]]) == (
        False, m.position, ["chat_template"])
    assert f"sample 0 (line 1), conversation, token {m.position}" in report.rules[-1].detail


def test_training_with_chatml_against_a_qwen3_target_fails_the_template_rule(setup):
    export, target_dir, _ = setup
    report = diagnose(export, target_dir, {"doctor_samples": 3, "template": "chatml"})
    assert _failed(report) == ["chat_template"]
    assert (report.mismatch.sample, report.mismatch.position) == (0, _assistant_start(target_dir))
    assert "template 'chatml' (-p)" in report.rules[-1].detail


def test_a_target_without_a_chat_template_fails_with_the_fix(setup, tmp_path):
    export, target_dir, _ = setup
    bare = tmp_path / "bare"
    bare.mkdir()
    shutil.copy(target_dir / "config.json", bare / "config.json")
    report = diagnose(export, bare, {"doctor_samples": 1})
    assert _failed(report) == ["chat_template"]
    assert f"{bare} holds no tokenizer" in report.rules[-1].detail and "chat_template" in report.rules[-1].fix
    no_template = _target_folder(tmp_path / "no_template", None)
    report = diagnose(export, no_template, {"doctor_samples": 1})
    assert _failed(report) == ["chat_template"]
    assert f"{no_template} has no chat template" in report.rules[-1].detail


def test_the_command_prints_one_line_per_rule_and_exits_1_on_a_failure(setup, tmp_path, capsys):
    export, target_dir, _ = setup
    assert main(["doctor", str(export), "--target", str(target_dir), "-p", "doctor_samples", "2"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert [line.split(":")[0] for line in out[:-1]] == [f"PASS {r}" for r in RULES]
    assert out[-1] == f"{len(RULES)} of {len(RULES)} rules pass"
    bad = _copy(export, tmp_path, hidden_act="gelu")
    assert main(["doctor", str(bad), "--target", str(target_dir), "-p", "doctor_samples", "1"]) == 1
    out = capsys.readouterr().out.strip().splitlines()
    assert out[1].startswith("FAIL hidden_act: hidden_act 'gelu'") and out[-1].endswith("failed: hidden_act")
    assert main(["doctor", str(tmp_path / "nowhere"), "--target", str(target_dir)]) == 2
    assert capsys.readouterr().err.startswith("error: ")
    assert main(["doctor", str(export), "--target", str(target_dir), "-p", "doctor_samples", "0"]) == 2


def test_a_mapped_vocabulary_target_makes_the_template_rule_not_applicable(setup, tmp_path, capsys):
    """A target whose tokenizer is a dflash_lib mapped vocabulary (the demo target's) has no serving template: the
    chat-template rule says N/A instead of failing, the report passes, the command exits 0 and counts it."""
    export, target_dir, _ = setup
    mapped = tmp_path / "mapped"
    mapped.mkdir()
    shutil.copy(target_dir / "config.json", mapped / "config.json")
    vocab_rows = json.loads((target_dir / "config.json").read_text())["vocab_size"]
    MappedVocab(QWEN, tuple(range(vocab_rows - 2))).write(mapped)  # kept ids + UNK + MASK = the target's rows
    report = diagnose(export, mapped, {"doctor_samples": 1})
    rule = report.rules[-1]
    assert (rule.name, rule.ok, rule.verdict, report.ok, report.failed(), report.not_applicable()) == (
        "chat_template", None, "N/A", True, [], ["chat_template"])
    assert rule.line().startswith("N/A chat_template: the target folder's tokenizer is a dflash_lib mapped "
                                  "vocabulary"), rule.line()
    assert report.count_line() == f"{len(RULES) - 1} of {len(RULES)} rules pass; 1 N/A (chat_template)"
    doc = json.loads(json.dumps(report.to_json()))
    assert [r["verdict"] for r in doc["rules"]] == ["PASS"] * (len(RULES) - 1) + ["N/A"]
    assert (doc["ok"], doc["summary"]) == (True, report.count_line())
    assert main(["doctor", str(export), "--target", str(mapped)]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert out[-2].startswith("N/A chat_template:") and out[-1] == report.count_line()
    bad = _copy(export, tmp_path, hidden_act="gelu")  # an N/A never hides a failure
    report = diagnose(bad, mapped, {"doctor_samples": 1})
    assert (report.ok, report.failed(), report.count_line()) == (
        False, ["hidden_act"], f"{len(RULES) - 2} of {len(RULES)} rules pass; 1 N/A (chat_template); failed: "
        "hidden_act")


def test_a_missing_folder_is_a_config_error(setup, tmp_path):
    export, _, _ = setup
    with pytest.raises(ConfigError, match="is not a local folder"):
        diagnose(export, tmp_path / "no_target")


def test_settings_come_from_p_then_the_export_then_the_target_folder_and_the_defaults(setup, tmp_path):
    export, target_dir, corpus = setup
    other = tmp_path / "other.jsonl"
    other.write_text(corpus.read_text().splitlines()[1] + "\n")
    report = diagnose(export, target_dir, {"source": str(other), "thinking": "on"})
    assert report.ok, report.lines()
    assert report.rules[-1].detail.startswith(f"1 samples of {str(other)!r}")
    assert f"source {str(other)!r} (-p)" in report.rules[-1].detail and "thinking 'on' (-p)" in report.rules[-1].detail
    folder = _copy(export, tmp_path)  # a run's drafter/ as the trainer writes it: template and source only
    doc = json.loads((folder / "config.json").read_text())
    for key in ("tokenizer", "thinking", "corpus"):
        doc["dflash_config"]["training"].pop(key)
    (folder / "config.json").write_text(json.dumps(doc))
    report = diagnose(folder, target_dir, {"source": str(corpus)})
    detail = report.rules[-1].detail
    assert report.ok and f"tokenizer {str(target_dir)!r} (target folder)" in detail, detail
    assert "template 'qwen3' (export)" in detail and "thinking 'off' (default)" in detail


def test_notebook_05s_doctor_is_the_command_on_its_export(setup):
    """evaluate.run_doctor (what notebook 05 records): diagnose's record and lines for a target folder, None for
    the tiny target or without an export."""
    from dflash_lib.config import from_params
    from dflash_lib.evaluate import run_doctor

    export, target_dir, _ = setup
    said = []
    doc = run_doctor(str(export), from_params({"target": str(target_dir), "doctor_samples": 2}), said.append)
    report = diagnose(export, target_dir, {"doctor_samples": 2})
    assert doc == {**json.loads(json.dumps(report.to_json())), "lines": report.lines()} and doc["ok"]
    assert said == [f"doctor: {line}" for line in report.lines()] + [f"doctor: {report.count_line()}"]
    assert run_doctor(str(export), from_params({}), said.append) is None  # target "tiny"
    assert run_doctor(None, from_params({"target": str(target_dir)}), said.append) is None


def test_a_dflash2_export_passes_and_each_of_its_planted_faults_fails_its_rule(setup, tmp_path):
    """The dflash2 rule and its tensors (vLLM's qwen3_dflash2 names and shapes) on a fresh DFlash2 export."""
    from dflash_lib.models.dflash2 import DFlash2Config, DFlash2Drafter

    export, target_dir, corpus = setup
    hf_cfg = tiny_qwen3_config(hidden_size=H, num_layers=LAYERS,
                               vocab_size=json.loads((target_dir / "config.json").read_text())["vocab_size"])
    target = TargetModel.from_hf_config(hf_cfg, 2, layer_ids=[1, 3], seed=0)
    cfg = DFlash2Config(hidden_size=H, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, intermediate_size=64,
                        vocab_size=target.vocab_size, target_layer_ids=[1, 3], target_num_layers=LAYERS,
                        block_size=4, mask_id=target.vocab_size - 1, conv_group_size=8, selector_rank=16)
    d2 = export_drafter(DFlash2Drafter(cfg, target), tmp_path / "d2", torch.bfloat16, template="qwen3",
                        target_name=str(target_dir),
                        data={"tokenizer": str(target_dir), "thinking": "off", "corpus": str(corpus)})
    report = diagnose(d2, target_dir, {"doctor_samples": 1})
    assert report.ok and [r.name for r in report.rules] == RULES[:5] + ["dflash2"] + RULES[5:], report.lines()
    assert "selector_top_k 16" in next(r for r in report.rules if r.name == "dflash2").detail
    for n, (changes, rules, says) in enumerate([
            (dict(dflash_conv_group_size=5), ["dflash2", "weights"], "does not divide hidden_size 32"),
            (dict(dflash_selector_top_k=10_000), ["dflash2"], "exceeds vocab_size"),
            (dict(dflash_selector_rank=0), ["dflash2", "weights"], "is not a positive int"),
            (dict(draft_vocab_size=64), ["dflash2", "weights"], "no d2t map")]):
        copy = _copy(d2, tmp_path / str(n), **changes)
        got = diagnose(copy, target_dir, {"doctor_samples": 1})
        assert _failed(got) == rules, (changes, got.lines())
        assert says in next(r for r in got.rules if r.name == "dflash2").detail
    copy = _copy(d2, tmp_path / "w")
    _rewrite_weights(copy, lambda w: w.pop("candidate_selector.successor_codebook"))
    assert _failed(diagnose(copy, target_dir, {"doctor_samples": 1})) == ["weights", "trained_as"]
