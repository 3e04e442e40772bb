"""`python -m dflash_lib evaluate`: a saved drafter's acceptance measured by real speculative decoding.

    python -m dflash_lib evaluate --drafter DIR --target DIR|tiny [-p prompts N] [-p max_new_tokens M] [-p KEY V]

DIR is a saved drafter folder or a trainer run folder (its `drafter/`; the run's recorded config is then the
base that `-p` overrides, so `--target tiny` rebuilds the run's own tiny target and data settings). Decodes N
prompts greedily with the target's and the drafter's KV caches (`models.acceptance`), then the same prompts with
the target alone (the baseline), and checks the two outputs agree. Prints a summary to stderr and, as the LAST
stdout line, one JSON object (`REPORT_KEYS`). For a notebook: `evaluate(...)` returns the same dict.

Prompts: until the held-out split exists, the first user turn of the LAST N conversations of the configured
corpus (`-p source`), rendered with the chat template (`-p template`) followed by its generation prompt and
tokenized with `-p tokenizer`; the report says so (`prompt_source`).
"""

from __future__ import annotations

import dataclasses
import json
import sys
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

import torch

from dflash_lib.config import FLAT_FIELDS, Config, ConfigError, from_params

REPORT_KEYS = ("tau", "histogram", "per_position", "target_calls_per_token", "tokens_per_s", "baseline_tokens_per_s",
               "speedup", "prompts", "max_new_tokens")


@dataclass
class EvalConfig:
    prompts: int = 8  # prompts decoded (the last N conversations of the corpus)
    max_new_tokens: int = 64  # tokens generated per prompt (fewer when the turn ends, see stop_at_eos)
    stop_at_eos: bool = True  # end a prompt's generation at the tokenizer's end-of-turn token
    warmup: bool = True  # decode a few tokens once before timing (first-call overheads stay out of tokens/s)

    def __post_init__(self) -> None:
        for name in ("prompts", "max_new_tokens"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")


EVAL_FIELDS = {f.name: f.type for f in dataclasses.fields(EvalConfig)}  # these -p keys are the evaluation's


def _eval_value(key: str, text: Any) -> Any:
    want = EVAL_FIELDS[key]
    if not isinstance(text, str):
        return text
    if want in ("bool", bool):
        if text.lower() in ("true", "false"):
            return text.lower() == "true"
        raise ConfigError(f"parameter {key!r}: expected true or false, got {text!r}")
    try:
        return int(text)
    except ValueError:
        raise ConfigError(f"parameter {key!r}: expected an integer, got {text!r}") from None


def find_drafter(path: str | Path) -> tuple[Path, dict[str, Any] | None]:
    """(the drafter folder, the trainer run's recorded flat config or None) for a drafter or run folder."""
    p = Path(path)
    if not p.is_dir():
        raise ConfigError(f"--drafter {str(p)!r}: no such directory")
    run_dir, drafter_dir = (p, p / "drafter") if (p / "drafter").is_dir() else (p.parent, p)
    recorded = None
    cfg = run_dir / "config.json"
    if cfg.is_file():
        doc = json.loads(cfg.read_text())
        if isinstance(doc, dict) and isinstance(doc.get("config"), dict):  # a trainer run's config.json
            recorded = {k: v for sec in doc["config"].values() if isinstance(sec, dict) for k, v in sec.items()}
    return drafter_dir, recorded


def build_configs(params: Mapping[str, Any], target: str,
                  recorded: Mapping[str, Any] | None = None) -> tuple[Config, EvalConfig, list[str]]:
    """Split `-p` pairs into the evaluation's own keys and Config fields (laid over a run's recorded config,
    whose keys this version no longer has are dropped and listed)."""
    own = {k: _eval_value(k, v) for k, v in params.items() if k in EVAL_FIELDS}
    rest = {k: v for k, v in params.items() if k not in EVAL_FIELDS}
    dropped: list[str] = []
    base = None
    if recorded:
        dropped = sorted(k for k in recorded if k not in FLAT_FIELDS)
        base = from_params({k: v for k, v in recorded.items() if k in FLAT_FIELDS})
    config = from_params({**rest, "target": target}, base)
    return config, EvalConfig(**own), dropped


def heldout_prompts(config: Config, n: int) -> tuple[list[list[int]], str, Any]:
    """(N prompts as token ids, where they came from, the tokenizer). Each prompt is the first user turn of one
    of the last N conversations that have one, rendered with the template and its generation prompt, cut to its
    last `max_len` tokens."""
    from dflash_lib.data.readers import load_conversations
    from dflash_lib.data.templates import IM_START, Segment, get_template
    from dflash_lib.data.tokenizers import load_tokenizer

    data = config.data
    tokenizer = load_tokenizer(data.tokenizer)
    template = get_template(data.template, tokenizer)
    last: deque[str] = deque(maxlen=n)
    for conv in load_conversations(data.source):
        user = next((c for r, c in conv.turns if r == "user"), None)
        if user is not None:
            last.append(tokenizer.prepare(user))
    prompts = []
    for text in last:
        if data.template == "chatml":
            segments = template.segments((("user", text),)) + [Segment(IM_START, True), Segment("assistant\n")]
        else:  # a Hugging Face template: its own generation prompt, special tokens split out as it renders them
            hf = template._hf
            full = hf.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                          add_generation_prompt=True)
            segments = [Segment(piece, piece in template.special_tokens) for piece in template._split.split(full)
                        if piece]
        ids, _ = tokenizer.encode_segments(segments)
        prompts.append([int(i) for i in ids[-data.max_len:]])
    where = (f"no held-out split yet: the first user turn of the last {len(prompts)} conversations of "
             f"{data.source!r} (template {data.template!r}, with its generation prompt)")
    return prompts, where, tokenizer


def evaluate(drafter: str | Path, target: str, params: Mapping[str, Any] | None = None,
             say: Callable[[str], None] = lambda s: print(s, file=sys.stderr)) -> dict[str, Any]:
    """Load, decode, time and compare; returns the report (REPORT_KEYS and more). ConfigError on user errors."""
    from dflash_lib.data.readers import DataError
    from dflash_lib.models import DFlashDrafter, TargetModel
    from dflash_lib.models.acceptance import acceptance_length, greedy_decode

    drafter_dir, recorded = find_drafter(drafter)
    config, ev, dropped = build_configs(dict(params or {}), target, recorded)
    if recorded is not None:
        say(f"run config from {drafter_dir.parent / 'config.json'}"
            + (f" (dropped keys this version lacks: {dropped})" if dropped else ""))
    device_name = config.train.device
    if device_name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device='cuda' was asked for but CUDA is not available")
    device = torch.device("cuda" if device_name != "cpu" and torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32  # as the trainer runs the target
    tgt = TargetModel.from_model_config(config.model, device=device, dtype=dtype, seed=config.train.seed)
    try:
        model = DFlashDrafter.load(drafter_dir, tgt)
        prompts, where, tokenizer = heldout_prompts(config, ev.prompts)
    except (FileNotFoundError, DataError) as e:
        raise ConfigError(str(e)) from None
    too_big = [i for p in prompts for i in p if i >= tgt.vocab_size]
    if too_big:
        raise ConfigError(f"tokenizer {config.data.tokenizer!r} gives ids up to {max(too_big)}, beyond the target's "
                          f"{tgt.vocab_size} embedding rows")
    model.eval()
    stops = [tokenizer.eos_id] if ev.stop_at_eos else []
    say(f"{where}; {len(prompts)} prompts of {min(map(len, prompts))}..{max(map(len, prompts))} tokens, "
        f"max_new_tokens {ev.max_new_tokens}, device {device}, target {config.model.target!r} ({dtype}), "
        f"block size {model.cfg.block_size}")
    if ev.warmup:
        few = min(ev.max_new_tokens, 2 * model.cfg.block_size)
        acceptance_length(tgt, model, prompts[:1], few)
        greedy_decode(tgt, prompts[:1], few)
    spec = acceptance_length(tgt, model, prompts, ev.max_new_tokens, stops)
    base = greedy_decode(tgt, prompts, ev.max_new_tokens, stops)
    same = sum(a == b for a, b in zip(spec.outputs, base.outputs))
    report = {
        "tau": spec.tau,
        "histogram": {str(k): v for k, v in spec.histogram.items()},
        "per_position": spec.per_position,
        "target_calls_per_token": spec.target_calls_per_token,
        "tokens_per_s": spec.tokens_per_s,
        "baseline_tokens_per_s": base.tokens_per_s,
        "speedup": spec.tokens_per_s / base.tokens_per_s,
        "prompts": len(prompts),
        "max_new_tokens": ev.max_new_tokens,
        "cycles": spec.cycles,
        "output_tokens": spec.output_tokens,
        "outputs_equal_baseline": same,
        "block_size": model.cfg.block_size,
        "device": str(device),
        "drafter": str(drafter_dir),
        "target": config.model.target,
        "prompt_source": where,
    }
    say(summary(report))
    if same != len(prompts):
        say(f"warning: {len(prompts) - same} of {len(prompts)} outputs differ from plain greedy decoding "
            "(expected only from low-precision ties, e.g. bf16 on CUDA)")
    return report


def summary(r: Mapping[str, Any]) -> str:
    """The human-readable lines of a report."""
    hist = ", ".join(f"{k}:{v}" for k, v in r["histogram"].items())
    pos = " ".join(f"{p:.2f}" for p in r["per_position"])
    return "\n".join([
        f"tau {r['tau']:.3f} tokens per cycle over {r['cycles']} cycles (block size {r['block_size']})",
        f"tokens per cycle -> cycles: {hist}",
        f"acceptance by draft position 1..{r['block_size'] - 1}: {pos}",
        f"target forwards per output token {r['target_calls_per_token']:.3f} (plain decoding: 1)",
        f"{r['tokens_per_s']:.1f} tokens/s vs {r['baseline_tokens_per_s']:.1f} plain greedy with a KV cache: "
        f"speedup {r['speedup']:.2f}x; {r['outputs_equal_baseline']}/{r['prompts']} outputs identical",
    ])
