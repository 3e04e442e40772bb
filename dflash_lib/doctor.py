"""The serving doctor: will SGLang and vLLM run an exported drafter the way it was trained?

    python -m dflash_lib doctor EXPORT_DIR --target DIR [-p source CORPUS] [-p doctor_samples N] [-p KEY V]

prints `PASS`, `FAIL ... -> the fix` or `N/A` per rule, exit 1 when one fails; `diagnose(...)` returns the
`DoctorReport`. Config files, the safetensors header and the tokenizers are read, no model is built. The rules and
why each exists: docs/serving.md, "Doctor: will the engines serve it as it was trained?". The names (architectures,
model_type, files, a draft vocabulary's tensors) are the drafter kinds' declarations (models/drafters/); what the
engines accept is this module's own reading of their rules, never export's values.
"""

from __future__ import annotations

import json
import struct
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Mapping

from dflash_lib.config import MAPPED_VOCAB_FILE, ConfigError, DataConfig, from_params, target_tokenizer
from dflash_lib.data.readers import Conversation, DataError, load_conversations
from dflash_lib.data.templates import ChatTemplate, get_template
from dflash_lib.data.tokenizers import ChatTokenizer, is_mapped_tokenizer, load_tokenizer
from dflash_lib.models.causality import NESTED_FIELD, TOP_FIELD
from dflash_lib.models.drafters import KINDS, DrafterKind
from dflash_lib.models.drafters.kind import CONFIG_FILE, WEIGHTS_FILE
from dflash_lib.models.export import file_sha256
from dflash_lib.models.target_config import local_hf_config
from dflash_lib.rundir import read_json_object

DTYPE_NAMES = {"bfloat16": "BF16", "float16": "F16", "float32": "F32"}  # torch_dtype -> safetensors header dtype
FORBIDDEN = ("embed_tokens", "lm_head")  # tensor name parts the engines take from the target
CONTEXT_TOKENS = 4  # tokens shown before the first difference (and CONTEXT_TOKENS + 1 from it on)
DATA_KEYS = ("tokenizer", "template", "thinking")  # data settings of the training render; `source` = the corpus


@dataclass(frozen=True)
class RuleResult:
    """One rule's verdict: `ok` True (PASS), False (FAIL) or None (N/A: the rule does not apply to this target);
    `detail` says what was checked (and, when not ok, what is wrong or why it does not apply); `fix` what to do."""

    name: str
    ok: bool | None
    detail: str
    fix: str = ""

    @property
    def verdict(self) -> str:
        return {True: "PASS", False: "FAIL", None: "N/A"}[self.ok]

    def line(self) -> str:
        """`PASS name: detail`, `N/A name: detail` or `FAIL name: detail -> fix`."""
        if self.ok is False:
            return f"FAIL {self.name}: {self.detail}" + (f" -> {self.fix}" if self.fix else "")
        return f"{self.verdict} {self.name}: {self.detail}"


@dataclass(frozen=True)
class TemplateMismatch:
    """The first training sample whose two renderings differ: token `position` (0-based) of the rendering `part`
    ("conversation" or "prompt"); the decoded context around it in each rendering."""

    sample: int  # 0-based index among the samples compared
    record: str  # where it is in the corpus ("line 3", "record 0")
    part: str  # "conversation" (every turn) or "prompt" (the turns before the last answer + generation prompt)
    position: int  # first differing token (the shorter length when one is a prefix of the other)
    training_tokens: int  # tokens of the training rendering
    target_tokens: int  # tokens of the target's rendering
    training_context: str  # decoded tokens position-CONTEXT_TOKENS .. position+CONTEXT_TOKENS of training's ids
    target_context: str  # the same window of the target's ids


@dataclass
class DoctorReport:
    """Every rule's result for one export folder against one target folder (`ok`: all passed)."""

    export_dir: str
    target: str
    rules: list[RuleResult] = field(default_factory=list)
    mismatch: TemplateMismatch | None = None  # the chat-template rule's first differing sample, if any

    @property
    def ok(self) -> bool:
        """No rule failed (a rule that does not apply, N/A, is no failure)."""
        return not self.failed()

    def failed(self) -> list[str]:
        return [r.name for r in self.rules if r.ok is False]

    def not_applicable(self) -> list[str]:
        return [r.name for r in self.rules if r.ok is None]

    def lines(self) -> list[str]:
        return [r.line() for r in self.rules]

    def count_line(self) -> str:
        """`11 of 12 rules pass; 1 N/A (chat_template)` / `...; failed: a, b`."""
        failed, na = self.failed(), self.not_applicable()
        passed = len(self.rules) - len(failed) - len(na)
        return (f"{passed} of {len(self.rules)} rules pass" + (f"; {len(na)} N/A ({', '.join(na)})" if na else "")
                + (f"; failed: {', '.join(failed)}" if failed else ""))

    def to_json(self) -> dict[str, Any]:
        return {"export_dir": self.export_dir, "target": self.target, "ok": self.ok,
                "rules": [{**asdict(r), "verdict": r.verdict} for r in self.rules],
                "summary": self.count_line(), "mismatch": asdict(self.mismatch) if self.mismatch else None}


@dataclass(frozen=True)
class TargetReading:
    """What the rules read of the target folder's config.json: the doctor's own reading, kept apart from
    `target.facts.TargetFacts` on purpose (an independent reference for what training wrote)."""

    path: str
    hidden_size: int
    num_layers: int
    vocab_size: int  # embedding rows
    special_ids: tuple[int, ...] = ()  # ids the target emits or begins with: eos (every one), bos, pad (its
    # config.json and generation_config.json); the MASK must be none of them


def _ids(*values: Any) -> tuple[int, ...]:
    """The int ids among `values` (each an id, a list of ids or None), sorted, once each."""
    out = set()
    for v in values:
        for i in (v if isinstance(v, (list, tuple)) else [v]):
            if isinstance(i, int) and not isinstance(i, bool):
                out.add(i)
    return tuple(sorted(out))


# -- reading ---------------------------------------------------------------------------------------------------
def _read_json(path: Path) -> dict[str, Any]:
    return read_json_object(path, f"{path.parent}: no {path.name} (not an exported drafter folder)")


def safetensors_header(path: str | Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    """{tensor name: (dtype as the header writes it, e.g. "BF16", shape)} of a .safetensors file, from its JSON
    header alone (the first 8 bytes: the header's length, little-endian; no tensor byte is read)."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            if n > 100 * 2**20:
                raise ConfigError(f"{path}: a safetensors header of {n} bytes (not a safetensors file?)")
            header = json.loads(f.read(n))
    except FileNotFoundError:
        raise ConfigError(f"{path.parent}: no {path.name}") from None
    except (OSError, ValueError, struct.error) as e:
        raise ConfigError(f"{path}: not a readable safetensors header ({' '.join(str(e).split())})") from None
    return {k: (str(v.get("dtype")), tuple(int(d) for d in v.get("shape", ())))
            for k, v in header.items() if k != "__metadata__" and isinstance(v, dict)}


def target_reading(target: str | Path) -> TargetReading:
    """The target folder's shapes from its config.json (the text model's, for a multimodal config)."""
    path = Path(target)
    if not path.is_dir():
        raise ConfigError(f"--target {str(target)!r} is not a local folder (the doctor reads its config.json and "
                          "its tokenizer)")
    text = local_hf_config(path)  # the text model's (a vision-language wrapper's text_config)
    gen_file = path / "generation_config.json"
    gen = json.loads(gen_file.read_text()) if gen_file.is_file() else {}
    gen = gen if isinstance(gen, dict) else {}
    special = _ids(*(getattr(text, k, None) for k in ("eos_token_id", "bos_token_id", "pad_token_id")),
                   *(gen.get(k) for k in ("eos_token_id", "bos_token_id", "pad_token_id")))
    return TargetReading(str(path), int(text.hidden_size), int(text.num_hidden_layers), int(text.vocab_size), special)


def served_kinds() -> dict[str, DrafterKind]:
    """{architecture: its kind} of every drafter kind (the names its declaration gives)."""
    return {a: k for k in KINDS.values() for a in k.architectures}


def declared_kind(doc: Mapping[str, Any]) -> DrafterKind:
    """The kind a config.json names (its one architecture), else the first kind (the architecture rule fails)."""
    arch = doc.get("architectures")
    names = served_kinds()
    if isinstance(arch, list) and len(arch) == 1 and isinstance(arch[0], str) and arch[0] in names:
        return names[arch[0]]
    return next(iter(KINDS.values()))


def expected_tensors(doc: Mapping[str, Any]) -> dict[str, tuple[int, ...]]:
    """{name: shape} of every weight a DFlash drafter with config.json `doc` stores (Qwen3 names; a draft
    vocabulary's tensors named as its kind declares them)."""
    H, L = int(doc["hidden_size"]), int(doc["num_hidden_layers"])
    heads = int(doc["num_attention_heads"])
    kv = int(doc.get("num_key_value_heads") or heads)
    hd = int(doc.get("head_dim") or H // heads)
    inter = int(doc["intermediate_size"])
    n = len(doc["dflash_config"]["target_layer_ids"])
    out: dict[str, tuple[int, ...]] = {"fc.weight": (H, n * H), "hidden_norm.weight": (H,), "norm.weight": (H,)}
    for i in range(L):
        p = f"layers.{i}."
        out |= {p + "input_layernorm.weight": (H,), p + "post_attention_layernorm.weight": (H,),
                p + "self_attn.q_proj.weight": (heads * hd, H), p + "self_attn.k_proj.weight": (kv * hd, H),
                p + "self_attn.v_proj.weight": (kv * hd, H), p + "self_attn.o_proj.weight": (H, heads * hd),
                p + "self_attn.q_norm.weight": (hd,), p + "self_attn.k_norm.weight": (hd,),
                p + "mlp.gate_proj.weight": (inter, H), p + "mlp.up_proj.weight": (inter, H),
                p + "mlp.down_proj.weight": (H, inter)}
    if declared_kind(doc).name == "dflash2":  # vLLM's qwen3_dflash2: two convolutions a layer, the selector
        dc = doc["dflash_config"]
        taps, groups, rank = int(dc["conv_kernel_size"]), H // int(dc["conv_group_size"]), int(dc["selector_rank"])
        for i in range(L):
            for side in ("attention_conv", "mlp_conv"):
                p = f"layers.{i}.{side}."
                out |= {p + "base_kernel": (2, taps, H), p + "kernel_projection.weight": (2 * taps * groups, H)}
        V = int(doc["vocab_size"])
        out |= {"candidate_selector.predecessor_codebook": (V, rank), "candidate_selector.successor_codebook": (V, rank),
                "candidate_selector.hidden_projection.weight": (rank, H)}
    n_draft = draft_vocab_size(doc)
    if n_draft:  # a draft vocabulary: its own head rows and vLLM's d2t offsets
        names = declared_kind(doc).tensors
        out |= {names["draft_head"]: (n_draft, H), names["draft_ids"]: (n_draft,)}
    return out


def draft_vocab_size(doc: Mapping[str, Any]) -> int:
    """N of a draft vocabulary (draft_vocab_size below vocab_size), else 0 (the head is the target's)."""
    n = int(doc.get("draft_vocab_size") or 0)
    return n if n < int(doc.get("vocab_size") or 0) else 0


# -- the config rules ------------------------------------------------------------------------------------------
def _int_list(value: Any) -> list[int] | None:
    if isinstance(value, list) and value and all(isinstance(i, int) and not isinstance(i, bool) for i in value):
        return list(value)
    return None


def config_rules(doc: Mapping[str, Any], target: TargetReading) -> list[RuleResult]:
    """architecture, hidden_act, hidden_size, vocab_size, block_size, (a dflash2 drafter's) dflash2,
    target_layer_ids, engine_layer_ids, mask_token_id."""
    dc = doc.get("dflash_config") if isinstance(doc.get("dflash_config"), dict) else {}
    rules = []
    arch, mtype = doc.get("architectures"), doc.get("model_type")
    kinds = served_kinds()
    ok = any(arch == [a] and mtype == k.model_type for a, k in kinds.items())
    wanted = " or ".join(f"[{a!r}] and {k.model_type!r}" for a, k in kinds.items())
    fix = " or ".join(f"[{a!r}] and model_type to {k.model_type!r}" for a, k in kinds.items())
    rules.append(RuleResult("architecture", ok, f"architectures {arch!r}, model_type {mtype!r}" + (
        "" if ok else f" (the engines resolve a DFlash drafter from {wanted})"),
        f"set architectures to {fix} (python -m dflash_lib export writes both)"))
    act = doc.get("hidden_act", "silu")
    rules.append(RuleResult("hidden_act", act == "silu", f"hidden_act {act!r}" + (
        "" if act == "silu" else " (the drafter's MLP is SwiGLU: an engine would build another activation)"),
        "set hidden_act to 'silu'"))
    H = doc.get("hidden_size")
    rules.append(RuleResult("hidden_size", H == target.hidden_size,
                            f"drafter hidden_size {H!r}, target {target.hidden_size}",
                            "export a drafter trained on this target (its fc and the shared embedding need the "
                            "target's hidden size)"))
    V = doc.get("vocab_size")
    rules.append(RuleResult("vocab_size", V == target.vocab_size,
                            f"drafter vocab_size {V!r}, target {target.vocab_size}",
                            "set vocab_size to the target's (the drafter reads the target's embedding and LM head)"))
    rules.append(_block_size_rule(doc, dc))
    if declared_kind(doc).name == "dflash2":
        rules.append(_dflash2_rule(doc, dc))
    ids = _int_list(dc.get("target_layer_ids"))
    rules.append(_layer_ids_rule(doc, ids, target))
    rules.append(_engine_layers_rule(doc, ids))
    mask = dc.get("mask_token_id")
    ok = isinstance(mask, int) and not isinstance(mask, bool) and 0 <= mask < target.vocab_size
    vocab = doc.get("vocab_size")
    if ok and isinstance(vocab, int) and mask >= vocab:
        ok = False
    emitted = ok and mask in target.special_ids
    rules.append(RuleResult("mask_token_id", ok and not emitted,
                            f"dflash_config.mask_token_id {mask!r}, target embedding rows 0 .. "
                            f"{target.vocab_size - 1}, drafter vocab_size {vocab!r}" + (
                                f"; {mask} is one of the target's eos / bos / pad ids {list(target.special_ids)}: a "
                                "token the target emits, which the drafter would read as MASK" if emitted else ""),
                            f"train with a MASK below {target.vocab_size} that the target never emits (a reserved "
                            "or unused special token; an id at or past the vocabulary has no embedding row: the "
                            "engine reads another row or fails) and export again"))
    return rules


def _dflash2_rule(doc: Mapping[str, Any], dc: Mapping[str, Any]) -> RuleResult:
    """A dflash2 drafter's fields as vLLM's qwen3_dflash2 reads them: conv_kernel_size, conv_group_size (dividing
    hidden_size, else vLLM raises at load), selector_rank and selector_top_k (at most vocab_size) positive ints, and
    no draft vocabulary (its candidate walk returns head rows as token ids: no d2t map)."""
    keys = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")
    values = {k: dc.get(k) for k in keys}
    bad = [k for k, v in values.items() if not (isinstance(v, int) and not isinstance(v, bool) and v >= 1)]
    H, V = doc.get("hidden_size"), doc.get("vocab_size")
    problems = [f"dflash_config.{k} {values[k]!r} is not a positive int" for k in bad]
    if not bad and isinstance(H, int) and H % values["conv_group_size"]:
        problems.append(f"conv_group_size {values['conv_group_size']} does not divide hidden_size {H}")
    if not bad and isinstance(V, int) and values["selector_top_k"] > V:
        problems.append(f"selector_top_k {values['selector_top_k']} exceeds vocab_size {V}")
    if draft_vocab_size(doc):
        problems.append(f"draft_vocab_size {doc.get('draft_vocab_size')}: the engine's candidate walk has no d2t map")
    detail = ", ".join(f"{k} {v!r}" for k, v in values.items())
    return RuleResult("dflash2", not problems, detail + ("; " + "; ".join(problems) if problems else
                      "; vLLM serves it with its V2 model runner only (CUDA + Triton; its CPU build refuses it)"),
                      "export the drafter again from its run with -p drafter_kind dflash2 and the whole head")


def _block_size_rule(doc: Mapping[str, Any], dc: Mapping[str, Any]) -> RuleResult:
    top, inner = doc.get("block_size"), dc.get("block_size")
    given = [v for v in (top, inner) if v is not None]
    detail = f"block_size {top!r} (top level), {inner!r} (dflash_config)"
    fix = "write one integer block size >= 2 (the one training used) at the top level and in dflash_config"
    if not given:
        return RuleResult("block_size", False, detail + ": none given", fix)
    if any(not isinstance(v, int) or isinstance(v, bool) or v < 2 for v in given):
        return RuleResult("block_size", False, detail + ": not an integer >= 2", fix)
    if len(given) == 2 and top != inner:
        return RuleResult("block_size", False, detail + ": they disagree (the engines read different ones)", fix)
    return RuleResult("block_size", True, detail)


def _layer_ids_rule(doc: Mapping[str, Any], ids: list[int] | None, target: TargetReading) -> RuleResult:
    fix = ("write the 0-based target layers training fused (dflash_config.target_layer_ids; python -m dflash_lib "
           "export writes them) and num_target_layers of this target")
    if ids is None:
        return RuleResult("target_layer_ids", False, "dflash_config.target_layer_ids is missing or not a list of "
                          "integers (the engines' fallback guesses layers training did not use)", fix)
    bad = [i for i in ids if not 0 <= i < target.num_layers]
    problems = []
    if bad:
        problems.append(f"{bad} outside the target's layers 0 .. {target.num_layers - 1}")
    if len(set(ids)) != len(ids):
        problems.append("an id repeated")
    n = doc.get("num_target_layers")
    if n is not None and n != target.num_layers:
        problems.append(f"num_target_layers {n!r} but the target has {target.num_layers}")
    detail = f"dflash_config.target_layer_ids {ids} of a {target.num_layers}-layer target"
    return RuleResult("target_layer_ids", not problems, detail + (": " + "; ".join(problems) if problems else ""),
                      fix)


def engine_layer_ids(doc: Mapping[str, Any]) -> dict[str, list[int] | None]:
    """The 0-based target decoder layers whose outputs each engine feeds the drafter, as it reads config.json.
    SGLang: dflash_config.target_layer_ids. vLLM: eagle_aux_hidden_state_layer_ids when present, as layer
    boundaries (boundary j = the output of layer j - 1); without it, dflash_config.target_layer_ids + 1 since its
    DFlash fix (vllm-project/vllm PR 40727), and target_layer_ids read as boundaries before it (one layer too low).
    None where the fields are missing."""
    dc = doc.get("dflash_config") if isinstance(doc.get("dflash_config"), dict) else {}
    ids = _int_list(dc.get("target_layer_ids"))
    aux = _int_list(doc.get("eagle_aux_hidden_state_layer_ids"))
    if aux is not None:
        vllm = before = [j - 1 for j in aux]
    else:
        vllm, before = ids, None if ids is None else [i - 1 for i in ids]
    return {"sglang": ids, "vllm": vllm, "vllm before its DFlash fix": before}


def _engine_layers_rule(doc: Mapping[str, Any], ids: list[int] | None) -> RuleResult:
    read = engine_layer_ids(doc)
    shown = ", ".join(f"{k} {v}" for k, v in read.items())
    fix = ("write eagle_aux_hidden_state_layer_ids = [id + 1 for id in dflash_config.target_layer_ids] "
           "(python -m dflash_lib export does)")
    if ids is None:
        return RuleResult("engine_layer_ids", False, f"layers the engines read: {shown}", fix)
    if "eagle_aux_hidden_state_layer_ids" not in doc:
        return RuleResult("engine_layer_ids", False, f"layers the engines read: {shown}: no "
                          "eagle_aux_hidden_state_layer_ids, so vLLM builds before its DFlash fix take "
                          "target_layer_ids as layer boundaries, one layer below each", fix)
    ok = len({json.dumps(v) for v in read.values()}) == 1
    return RuleResult("engine_layer_ids", ok, f"layers the engines read: {shown}" + (
        "" if ok else " (eagle_aux_hidden_state_layer_ids - 1 != target_layer_ids: vLLM feeds other layers "
        "than SGLang)"), fix)


def weight_rules(doc: Mapping[str, Any], header: Mapping[str, tuple[str, tuple[int, ...]]]) -> list[RuleResult]:
    """weights, no_embedding, dtype: from the safetensors header `header` against config.json `doc`."""
    try:
        want = expected_tensors(doc)
    except (KeyError, TypeError, ValueError) as e:
        want = None
        why = f"config.json lacks what the tensor shapes follow from ({type(e).__name__}: {e})"
    vocab = set(declared_kind(doc).tensors.values())  # a draft vocabulary's head rows and d2t
    own = vocab if want is not None and vocab <= set(want) else set()
    forbidden = sorted(k for k in header if any(part in k for part in FORBIDDEN) and k not in own)
    rules = []
    if want is None:
        rules.append(RuleResult("weights", False, why, "export the drafter again (python -m dflash_lib export)"))
    else:
        missing = sorted(set(want) - set(header))
        unexpected = sorted(set(header) - set(want) - set(forbidden))
        wrong = [f"{k} {header[k][1]} (expected {want[k]})" for k in sorted(set(want) & set(header))
                 if header[k][1] != want[k]]
        problems = ([f"missing {missing[:4]}" + (f" and {len(missing) - 4} more" if len(missing) > 4 else "")]
                    if missing else []) + ([f"unexpected {unexpected[:4]}"] if unexpected else []) + (
                    [f"wrong shapes: {'; '.join(wrong[:3])}"] if wrong else [])
        fc = header.get("fc.weight", (None, None))[1]
        detail = (f"{len(header)} tensors, fc.weight {fc} (expected {want['fc.weight']}: hidden x "
                  f"{len(doc['dflash_config']['target_layer_ids'])} fused layers x hidden)")
        rules.append(RuleResult("weights", not problems, detail + (": " + "; ".join(problems) if problems else ""),
                                "export the drafter again from its run (python -m dflash_lib export RUN OUT): "
                                "the engines load these names and shapes exactly"))
    rules.append(RuleResult("no_embedding", not forbidden,
                            f"embedding / LM head tensors: {forbidden or 'none'}" + (
                                " (the engines share the target's; a copy here is loaded over them or refused)"
                                if forbidden else ""),
                            f"remove {forbidden[:3]} from {WEIGHTS_FILE}"))
    declared = doc.get("torch_dtype") or doc.get("dtype")
    stored = sorted({d for k, (d, _) in header.items() if k not in own})  # d2t: int64 offsets
    want_dtype = DTYPE_NAMES.get(str(declared))
    ok = want_dtype is not None and stored == [want_dtype]
    rules.append(RuleResult("dtype", ok, f"torch_dtype {declared!r}, tensors stored as {stored}",
                            "set torch_dtype to the stored dtype, or export again with --dtype bf16|fp32"))
    return rules


def trained_as_rule(doc: Mapping[str, Any], weights_file: Path) -> RuleResult:
    """The fields the engines read against dflash_config.training.trained_as (`DrafterKind.trained_as`): an edit
    after export, or a converter, that changed the layer ids, the MASK id, the block size or the weights serves
    with a drafter other than the one trained (measured: each served, none refused, acceptance off;
    docs/serving.md)."""
    dc = doc.get("dflash_config") if isinstance(doc.get("dflash_config"), dict) else {}
    record = (dc.get("training") or {}).get("trained_as") if isinstance(dc.get("training"), dict) else None
    if not isinstance(record, dict):
        return RuleResult("trained_as", None, "no dflash_config.training.trained_as (not exported by dflash_lib, "
                          "or before it recorded one): nothing to compare with")
    now = {"target_layer_ids": dc.get("target_layer_ids"), "mask_token_id": dc.get("mask_token_id"),
           "block_size": doc.get("block_size", dc.get("block_size")),
           "dflash_config.block_size": dc.get("block_size", doc.get("block_size"))}
    was = {**{k: record.get(k) for k in ("target_layer_ids", "mask_token_id", "block_size")},
           "dflash_config.block_size": record.get("block_size")}
    differ = [f"{k} {now[k]!r} (trained {was[k]!r})" for k in now if now[k] != was[k]]
    try:
        digest = file_sha256(weights_file)
    except OSError as e:
        digest = f"unreadable ({e})"
    if digest != record.get("weights_sha256"):
        differ.append(f"{weights_file.name} is not the file the export wrote (SHA-256 {digest[:12]}..., recorded "
                      f"{str(record.get('weights_sha256'))[:12]}...)")
    detail = ("layer ids, MASK id, block size and weights as trained" if not differ else
              "changed since export: " + "; ".join(differ))
    return RuleResult("trained_as", not differ, detail,
                      "export the drafter again from its run (python -m dflash_lib export RUN OUT); to serve other "
                      "settings, train with them")


def served_causal(doc: Mapping[str, Any]) -> list[bool]:
    """Per draft layer: whether vLLM runs it causal in its block, this module's reading of its rule (vLLM 0.32,
    `qwen3_dflash`): a top-level is_causal decides every layer, else dflash_config.causal; without either a
    sliding_attention layer is causal and the others not, the kinds being `layer_types` or, without it, Qwen3's
    (sliding from max_window_layers on when use_sliding_window); an empty `layer_types` makes none causal."""
    n = int(doc.get("num_hidden_layers") or 0)
    dc = doc.get("dflash_config") if isinstance(doc.get("dflash_config"), dict) else {}
    for value in (doc.get(TOP_FIELD), dc.get("causal")):
        if value is not None:
            return [bool(value)] * n
    kinds = doc.get("layer_types")
    if kinds is None:
        sliding = doc.get("use_sliding_window") and doc.get("sliding_window", 4096) is not None
        return [bool(sliding) and i >= int(doc.get("max_window_layers", 28)) for i in range(n)]
    return [k == "sliding_attention" for k in kinds] if kinds else [False] * n


def causality_rule(doc: Mapping[str, Any]) -> RuleResult:
    """The layers vLLM runs causal in their block (`served_causal`) against dflash_config.training.trained_as's
    layer_causal (what training ran); a causality field that is no bool, or two that disagree, fail on their own."""
    dc = doc.get("dflash_config") if isinstance(doc.get("dflash_config"), dict) else {}
    given = {TOP_FIELD: doc.get(TOP_FIELD), NESTED_FIELD: dc.get("causal")}  # the fields the kinds write
    shown = ", ".join(f"{k} {v!r}" for k, v in given.items())
    fix = ("export the drafter again (python -m dflash_lib export RUN OUT writes what vLLM must read), or train "
           "with -p drafter_causal as this folder states it")
    bad = [k for k, v in given.items() if v is not None and not isinstance(v, bool)]
    if bad:
        return RuleResult("causality", False, f"{shown}: {bad[0]} is no true/false (vLLM reads bool(value): any "
                          "non-empty string is causal)", fix)
    if len({v for v in given.values() if v is not None}) > 1:
        return RuleResult("causality", False, f"{shown}: they disagree (vLLM 0.32 takes {TOP_FIELD}; another "
                          "engine may take the other)", fix)
    served = served_causal(doc)
    training = dc.get("training") if isinstance(dc.get("training"), dict) else {}
    record = (training.get("trained_as") or {}).get("layer_causal") if isinstance(training, dict) else None
    detail = f"{shown}, layer_types {doc.get('layer_types')!r}: vLLM runs layers causal {served}"
    if not isinstance(record, list):
        return RuleResult("causality", None, detail + " (no dflash_config.training.trained_as.layer_causal to "
                          "compare with)")
    ok = served == record
    return RuleResult("causality", ok, detail + ("" if ok else f", training ran {record}"), fix)


# -- the chat-template rule ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class TrainingRender:
    """The data settings the training render uses and where each came from ("-p", "export", "default",
    "target folder")."""

    data: DataConfig
    origin: dict[str, str]


def training_render(doc: Mapping[str, Any], target: str, params: Mapping[str, Any]) -> TrainingRender:
    """Tokenizer, template, thinking and corpus of the training render: `-p` first, then what the export records
    in dflash_config.training, then (tokenizer) the target folder's own when it ships one, then the defaults."""
    recorded = (doc.get("dflash_config") or {}).get("training") or {}
    defaults = DataConfig()
    values, origin = {}, {}
    for key, recorded_key in (*((k, k) for k in DATA_KEYS), ("source", "corpus")):
        if key in params:
            values[key], origin[key] = params[key], "-p"
        elif isinstance(recorded.get(recorded_key), str) and recorded[recorded_key]:
            values[key], origin[key] = recorded[recorded_key], "export"
        elif key == "tokenizer" and target_tokenizer(target):
            values[key], origin[key] = target, "target folder"
        else:
            values[key], origin[key] = getattr(defaults, key), "default"
    data = from_params({**dict(params), **values}).data
    return TrainingRender(data, origin)


def _first_difference(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def _window(decode, ids: list[int], at: int) -> str:
    lo = max(0, at - CONTEXT_TOKENS)
    return repr(decode(ids[lo:at])) + " | " + repr(decode(ids[at: at + CONTEXT_TOKENS + 1]))


def _load_target_tokenizer(target: str):
    """(the target folder's Hugging Face tokenizer, None) or (None, why it cannot render a chat)."""
    from transformers import AutoTokenizer

    files = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
    if not any((Path(target) / f).is_file() for f in files):
        return None, f"the target folder {target} holds no tokenizer (none of {', '.join(files)})"
    try:
        hf = AutoTokenizer.from_pretrained(target, local_files_only=True)
    except (OSError, ValueError, TypeError) as e:
        return None, f"no tokenizer loads from {target} ({' '.join(str(e).split())[:200]})"
    if not getattr(hf, "chat_template", None):
        return None, f"the target folder {target} has no chat template (tokenizer_config.json chat_template or " \
                     "chat_template.jinja)"
    return hf, ""


def _compare(conv: Conversation, index: int, tok: ChatTokenizer, template: ChatTemplate, hf: Any,
             kwargs: dict[str, bool]) -> tuple[bool, TemplateMismatch | None]:
    """(was any rendering compared, the first difference) of corpus conversation `conv` (sample `index`): the whole
    conversation, then the generation prompt of its last answer, each rendered by training (`tok`, `template`)
    and by the target (`hf`'s chat template with `kwargs`, then its tokenizer, no special tokens added)."""
    turns = tuple((role, tok.prepare(content)) for role, content in conv.turns)
    last = max(i for i, (role, _) in enumerate(turns) if role == "assistant")  # a Conversation has one
    messages = [{"role": r, "content": c} for r, c in conv.turns]
    parts = {"conversation": (lambda: template.segments(turns),
                              lambda: hf.apply_chat_template(messages, tokenize=False, **kwargs)),
             "prompt": (lambda: template.prompt_segments(turns[:last]),
                        lambda: hf.apply_chat_template(messages[:last], tokenize=False, add_generation_prompt=True,
                                                       **kwargs))}
    rendered = False
    for part, (ours, theirs) in parts.items():
        try:
            a = [int(i) for i in tok.encode_segments(ours())[0]]
            b = [int(i) for i in hf(theirs(), add_special_tokens=False)["input_ids"]]
        except Exception:  # noqa: BLE001 - a template (Jinja or ours) may refuse a conversation: not compared
            continue
        rendered = True
        at = _first_difference(a, b)
        if at is not None:
            return True, TemplateMismatch(index, conv.where, part, at, len(a), len(b), _window(tok.decode, a, at),
                                          _window(hf.decode, b, at))
    return rendered, None


def chat_template_rule(doc: Mapping[str, Any], target: str, params: Mapping[str, Any],
                       samples: int) -> tuple[RuleResult, TemplateMismatch | None]:
    """Render `samples` corpus conversations as training did and with the target folder's tokenizer + chat
    template (the whole conversation, and the generation prompt of its last answer); compare the token ids."""
    name = "chat_template"
    render = training_render(doc, target, params)
    d = render.data
    settings = ", ".join(f"{k} {getattr(d, k)!r} ({render.origin[k]})" for k in (*DATA_KEYS, "source"))
    if is_mapped_tokenizer(target):
        return RuleResult(name, None, f"the target folder's tokenizer is a dflash_lib mapped vocabulary "
                          f"({MAPPED_VOCAB_FILE}: a base tokenizer over a shrunk set of ids, as the demo target's), "
                          "which neither engine loads: there is no serving chat template to compare with (training "
                          f"rendered with {settings})"), None
    hf, why = _load_target_tokenizer(target)
    if hf is None:
        return RuleResult(name, False, why, "copy the target model's own tokenizer files (tokenizer.json, "
                          "tokenizer_config.json with its chat_template, or chat_template.jinja) into the target "
                          "folder: the engines render prompts with it"), None
    try:
        tok = load_tokenizer(d.tokenizer)
        template = get_template(d.template, tok, d.thinking)
    except DataError as e:
        return RuleResult(name, False, f"the training render ({settings}) cannot be rebuilt: {e}",
                          "give the training data settings: -p tokenizer, -p template, -p thinking"), None
    kwargs = {} if d.thinking == "keep" else {"enable_thinking": d.thinking == "on"}
    compared, skipped, differing, first = 0, 0, 0, None
    for conv in load_conversations(d.source):
        if compared >= samples:
            break
        rendered, mismatch = _compare(conv, compared, tok, template, hf, kwargs)
        compared, skipped = compared + rendered, skipped + (not rendered)
        differing += mismatch is not None
        first = first or mismatch
    where = f"{compared} samples of {d.source!r}" + (f" ({skipped} not renderable)" if skipped
                                                      else "")
    if compared == 0:
        return RuleResult(name, False, f"no sample of {d.source!r} could be rendered both ways ({settings})",
                          "give a corpus of the training data: -p source FILE"), None
    if first is None:
        return RuleResult(name, True, f"{where}: token ids equal, conversation and generation prompt ({settings}; "
                          f"target {target})"), None
    m = first
    detail = (f"{differing} of {compared} samples differ ({settings}); first: sample {m.sample} ({m.record}), "
              f"{m.part}, token {m.position} of {m.training_tokens} (training) vs {m.target_tokens} (target): "
              f"training {m.training_context} / target {m.target_context}")
    fix = ("train with the target's own template (-p template hf -p tokenizer TARGET_DIR, or the built-in one "
           "that matches it, e.g. qwen3 for Qwen3 with its empty think block) and the thinking mode you serve "
           "with (-p thinking off|on), or serve with the chat template training used")
    return RuleResult(name, False, detail, fix), first


# -- the command -----------------------------------------------------------------------------------------------
def diagnose(export_dir: str | Path, target: str | Path, params: Mapping[str, Any] | None = None) -> DoctorReport:
    """Every rule for the export folder `export_dir` against the target folder `target`; `params`: flat config
    parameters (source, tokenizer, template, thinking: the training data when the export does not record it;
    doctor_samples). Raises ConfigError for a folder it cannot read at all."""
    params = dict(params or {})
    samples = from_params(params).evaluate.doctor_samples  # validates every key and value
    src = Path(export_dir)
    doc = _read_json(src / CONFIG_FILE)
    facts = target_reading(target)
    report = DoctorReport(str(src), str(target))
    report.rules += config_rules(doc, facts)
    report.rules += weight_rules(doc, safetensors_header(src / WEIGHTS_FILE))
    report.rules.append(trained_as_rule(doc, src / WEIGHTS_FILE))
    report.rules.append(causality_rule(doc))
    rule, report.mismatch = chat_template_rule(doc, str(target), params, samples)
    report.rules.append(rule)
    return report


def run_cli(export_dir: str, target: str, params: Mapping[str, Any]) -> int:
    """`python -m dflash_lib doctor`: one line per rule on stdout; 1 when a rule failed, else 0."""
    report = diagnose(export_dir, target, params)
    for line in report.lines():
        print(line)
    print(report.count_line())
    return 0 if report.ok else 1

