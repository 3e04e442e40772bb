"""Acceptance per benchmark, as the paper's table, and broken down by context length, turn and thinking mode.

Computed from the decodings `evaluate.decode` ran, one `GroupDecode` per (prompt set, thinking mode, turn): each
prompt's drafting cycles (`AcceptanceResult.cycle_log`), outputs and seconds, and the greedy baseline's. A cycle
that produced k tokens accepted k-1 drafts, so tau over any set of cycles is the mean of k; context bins:
`CONTEXT_EDGES`. The report's fields: docs/evaluation.md, "The report".
"""

from __future__ import annotations

import bisect
from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from dflash_lib.rundir import JsonRecord

CONTEXT_EDGES = (256, 512, 1024, 2048, 4096, 8192)  # tokens: the lower edges of the context-length bins after 0
CycleLog = Sequence[Sequence[tuple[int, int]]]  # per prompt, per cycle: (context length, tokens produced 1 .. B)


@dataclass
class GroupDecode:
    """One prompt set in one thinking mode at one turn, decoded by a drafter and by the baseline."""

    benchmark: str  # the prompt set ("heldout", "humaneval", "mt-bench", a FILE.jsonl)
    thinking: str  # the template's thinking mode the prompts were rendered in ("on", "off", "keep")
    turn: int  # 1-based turn of the questions (2: asked after the target's own first answer)
    names: list[str]  # prompt id of each prompt
    prompt_tokens: list[int]  # length of each prompt (tokens)
    spec: Any  # acceptance.AcceptanceResult of the prompts (cycle_log, outputs, seconds, target_calls)
    baseline: Any  # acceptance.DecodeResult of the same prompts (outputs, seconds)


@dataclass
class BenchmarkRow(JsonRecord):
    """One prompt set in one thinking mode, every turn: a row of the paper's table."""

    benchmark: str  # the prompt set
    thinking: str  # thinking mode of the prompts' rendering
    prompts: int  # questions decoded
    turns: int  # prompts decoded (questions x their turns)
    tau: float  # mean tokens per drafting cycle (accepted drafts + 1), 1 .. B
    per_position: list[float]  # (B-1,) [k-1]: share of cycles that accepted draft position k
    histogram: dict[str, int]  # tokens per cycle ("1" .. str(B)) -> cycles
    cycles: int  # drafting cycles
    output_tokens: int  # tokens generated
    tokens_per_s: float  # output tokens per second of speculative decoding (prefills included)
    baseline_tokens_per_s: float  # the same prompts by plain greedy decoding with a KV cache
    speedup: float  # tokens_per_s / baseline_tokens_per_s
    target_calls_per_token: float  # target forwards per output token (prefills included)
    outputs_equal_baseline: int | None  # prompts whose output equals the baseline's; None when sampling


@dataclass
class AcceptanceSlice(JsonRecord):
    """The cycles of one context-length bin, one turn or one thinking mode, over every prompt set."""

    label: str  # "0-255" (context tokens), "turn 2", "thinking on"
    cycles: int  # drafting cycles in the slice
    tokens: int  # tokens those cycles produced
    tau: float  # tokens / cycles (nan when no cycle)


@dataclass
class PromptDecode(JsonRecord):
    """One decoded prompt: which question, which turn, how long, how well the drafter did."""

    benchmark: str  # the prompt set
    prompt_id: str  # the question's id in its set (the token-store index for held-out samples)
    thinking: str  # thinking mode of the rendering
    turn: int  # 1-based turn
    prompt_tokens: int  # prompt length (tokens)
    output_tokens: int  # tokens generated
    cycles: int  # drafting cycles
    tau: float  # mean tokens per cycle (nan: the answer was the prefill's one token)


def cycle_figures(logs: CycleLog, block_size: int) -> tuple[float, dict[str, int], list[float], int]:
    """(tau, histogram {"k": cycles}, per_position (B-1,), cycles) of the cycles in `logs`; per_position[k-1] is
    the share of cycles that produced more than k tokens (accepted draft k). nan figures when there is no cycle."""
    produced = [k for prompt in logs for _, k in prompt]
    n = len(produced)
    hist = Counter(produced)
    tau = sum(produced) / n if n else float("nan")
    per_position = [sum(v for k, v in hist.items() if k > j) / n if n else float("nan")
                    for j in range(1, block_size)]
    return tau, {str(k): hist[k] for k in sorted(hist)}, per_position, n


def context_label(lo: int, hi: int | None) -> str:
    return f"{lo}-{hi - 1}" if hi is not None else f">={lo}"


def by_context(logs: CycleLog, edges: Sequence[int] = CONTEXT_EDGES) -> list[AcceptanceSlice]:
    """The cycles binned by the context length they drafted from: [0, e_1), [e_1, e_2), ..., [e_last, inf);
    the bins holding a cycle, in order."""
    bounds = [0, *edges]
    cycles, tokens = Counter(), Counter()
    for prompt in logs:
        for context, k in prompt:
            b = bisect.bisect_right(bounds, context) - 1
            cycles[b] += 1
            tokens[b] += k
    out = []
    for b in sorted(cycles):
        hi = bounds[b + 1] if b + 1 < len(bounds) else None
        out.append(AcceptanceSlice(context_label(bounds[b], hi), cycles[b], tokens[b], tokens[b] / cycles[b]))
    return out


def slices(groups: Sequence[GroupDecode], key: Callable[[GroupDecode], str]) -> list[AcceptanceSlice]:
    """The cycles of every group, summed per `key(group)` (first-seen order)."""
    cycles: dict[str, int] = {}
    tokens: dict[str, int] = {}
    for g in groups:
        label = key(g)
        produced = [k for prompt in g.spec.cycle_log for _, k in prompt]
        cycles[label] = cycles.get(label, 0) + len(produced)
        tokens[label] = tokens.get(label, 0) + sum(produced)
    return [AcceptanceSlice(label, n, tokens[label], tokens[label] / n if n else float("nan"))
            for label, n in cycles.items()]


def _rate(tokens: int, seconds: float) -> float:
    return tokens / seconds if seconds > 0 else float("nan")


def merged_figures(groups: Sequence[GroupDecode], block_size: int) -> dict[str, Any]:
    """The figures of `groups` taken together: tau, histogram, per_position, cycles, output_tokens,
    tokens_per_s, baseline_tokens_per_s, speedup, target_calls_per_token, outputs_equal_baseline, turns."""
    logs = [prompt for g in groups for prompt in g.spec.cycle_log]
    tau, hist, per_position, cycles = cycle_figures(logs, block_size)
    tokens = sum(len(o) for g in groups for o in g.spec.outputs)
    base_tokens = sum(len(o) for g in groups for o in g.baseline.outputs)
    speed = _rate(tokens, sum(g.spec.seconds for g in groups))
    base_speed = _rate(base_tokens, sum(g.baseline.seconds for g in groups))
    calls = sum(g.spec.target_calls for g in groups)
    sampled = any(getattr(g.spec, "temperature", 0.0) > 0 for g in groups)  # two samples: nothing to compare
    same = None if sampled else sum(a == b for g in groups for a, b in zip(g.spec.outputs, g.baseline.outputs))
    return dict(tau=tau, histogram=hist, per_position=per_position, cycles=cycles, output_tokens=tokens,
                tokens_per_s=speed, baseline_tokens_per_s=base_speed,
                speedup=speed / base_speed if base_speed > 0 else float("nan"),
                target_calls_per_token=calls / tokens if tokens else float("nan"), outputs_equal_baseline=same,
                turns=sum(len(g.names) for g in groups))


def benchmark_rows(groups: Sequence[GroupDecode], block_size: int) -> list[BenchmarkRow]:
    """One row per (prompt set, thinking mode) in first-seen order, every turn of its questions together."""
    keys = list(dict.fromkeys((g.benchmark, g.thinking) for g in groups))
    rows = []
    for bench, thinking in keys:
        mine = [g for g in groups if (g.benchmark, g.thinking) == (bench, thinking)]
        figures = merged_figures(mine, block_size)
        questions = max(len(g.names) for g in mine if g.turn == min(x.turn for x in mine))
        rows.append(BenchmarkRow(benchmark=bench, thinking=thinking, prompts=questions, **figures))
    return rows


def prompt_records(groups: Sequence[GroupDecode]) -> list[PromptDecode]:
    """One record per decoded prompt, group order."""
    out = []
    for g in groups:
        for name, length, output, log in zip(g.names, g.prompt_tokens, g.spec.outputs, g.spec.cycle_log):
            produced = [k for _, k in log]
            out.append(PromptDecode(g.benchmark, name, g.thinking, g.turn, length, len(output), len(produced),
                                    sum(produced) / len(produced) if produced else float("nan")))
    return out


def benchmark_table(rows: Sequence[BenchmarkRow]) -> str:
    """The rows as the paper's table: benchmark | thinking | prompts | tau | speedup | tokens/s | cycles, then the
    per-position acceptance of each row."""
    head = f"{'benchmark':<24} {'thinking':>8} {'prompts':>7} {'turns':>5} {'tau':>6} {'speedup':>8} " \
           f"{'tok/s':>8} {'base tok/s':>10} {'cycles':>7}"
    lines = [head, "-" * len(head)]
    for r in rows:
        name = r.benchmark if len(r.benchmark) <= 24 else "..." + r.benchmark[-21:]
        lines.append(f"{name:<24} {r.thinking:>8} {r.prompts:>7} {r.turns:>5} {r.tau:>6.3f} {r.speedup:>7.2f}x "
                     f"{r.tokens_per_s:>8.1f} {r.baseline_tokens_per_s:>10.1f} {r.cycles:>7}")
    for r in rows:
        lines.append(f"{r.benchmark} ({r.thinking}): acceptance by draft position "
                     + " ".join(f"{p:.2f}" for p in r.per_position))
    return "\n".join(lines)


def slice_line(what: str, parts: Sequence[AcceptanceSlice]) -> str:
    """One line: 'tau by turn: turn 1 3.20 (40 cycles), turn 2 2.80 (35 cycles)'."""
    return f"tau by {what}: " + ", ".join(f"{s.label} {s.tau:.2f} ({s.cycles} cycles)" for s in parts)
