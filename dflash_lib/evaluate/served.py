"""Served acceptance judged beside ours: per prompt set, the engine's figures (`serve.measure.decode_passes`: its
counters, answers and tokens/s) against our decoding of the same prompts. Greedy in fp32 must agree exactly
(answers and counts); otherwise served tau may not fall below ours by more than 3 standard errors.
docs/serving.md, "The engine in the loop"."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

from dflash_lib.rundir import JsonRecord
from dflash_lib.serve.client import ServedDecode, SpecCounters
from dflash_lib.serve.measure import EngineRun, ServedPass, ServedSet, decode_passes
from dflash_lib.serve.server import engine_adapter

GAP_SIGMAS = 3.0  # a served tau this many standard errors below ours is a FAIL (sampling, bf16)
EXACT_TOL = 1e-9  # greedy fp32: counts agree exactly; only the divisions round


@dataclass
class ServedRow(JsonRecord):
    """One prompt set served by the engine next to our in-process decoding of the same prompts."""

    name: str  # the prompt set (and thinking mode)
    prompts: int  # prompts sent (every turn counted)
    tau: float  # ours: tokens per drafting cycle
    served_tau: float  # the engine's: 1 + accepted / drafts, from its counters
    per_position: list[float]  # ours: (B-1,) share of cycles accepting draft position k
    served_per_position: list[float]  # the engine's, the same share of its drafts
    cycles: int  # our drafting cycles
    served_drafts: int  # the engine's drafting steps
    bound: float  # how far served tau may fall below ours: 0 when exact (greedy fp32), else GAP_SIGMAS x SE
    outputs_equal: int | None  # served answers equal to ours, token for token (None when sampling)
    served_tokens_per_s: float  # the engine with the drafter, one prompt at a time (output tokens / s)
    plain_tokens_per_s: float | None  # the same engine without the drafter, same prompts (None: not measured)
    served_speedup: float | None  # served_tokens_per_s / plain_tokens_per_s
    ok: bool  # no train/serve gap beyond the bound (and, when exact, equal answers and counts)
    served_tokens: int = 0  # output tokens of one decoding of the set with the drafter
    plain_tokens: int | None = None  # the same without the drafter
    served_round_s: list[float] | None = None  # seconds of each timed decoding with the drafter (tokens/s: the median)
    plain_round_s: list[float] | None = None  # the same without the drafter
    speedup_range: list[float] | None = None  # [lowest, highest] speedup of one round with vs the same round without
    tau_along: float | None = None  # ours along the ENGINE's answers (greedy, when they part from ours): what the
    # bound then compares served tau with (`acceptance_length(answers=...)`); None: ours is on the same answers
    cycles_along: int | None = None  # our drafting cycles along the engine's answers (with `tau_along`)


@dataclass
class ServedReport(JsonRecord):
    """`evaluate -p engine vllm`: every prompt set served (`ServedRow`), and the verdict lines."""

    engine: str  # where the engine ran: its Python, or the URL of a running server
    version: str  # the engine's version (its /version)
    dtype: str  # the engine's dtype
    exact: bool  # greedy in fp32: served and in-process must agree exactly
    temperature: float  # sampling temperature of both (0 = greedy)
    rows: list[ServedRow]  # one per prompt set
    lines: list[str]  # one PASS/FAIL line per row (the gap alarm)
    log: str  # the engine's log file ("" for a running server)
    speedup: float | None = None  # every set together: tokens/s with over without the drafter (`pooled_speedup`)
    speedup_range: list[float] | None = None  # [lowest, highest] of the same per timed round


def tokens_per_cycle(cycle_log: Sequence[Sequence[tuple[int, int]]]) -> list[int]:
    return [n for prompt in cycle_log for _, n in prompt]


def histogram_tau_se(histogram: dict[int, float]) -> tuple[float, float]:
    """(mean, standard error of the mean) of tokens per cycle given {tokens: cycles}."""
    n = sum(histogram.values())
    if n == 0:
        return float("nan"), float("nan")
    mean = sum(k * c for k, c in histogram.items()) / n
    var = sum(c * (k - mean) ** 2 for k, c in histogram.items()) / n
    return mean, math.sqrt(var / n)


def served_histogram(counters: SpecCounters) -> dict[int, float]:
    """{tokens produced: drafting steps} of the engine's counters: a step accepting position k accepted every
    position before it (a prefix), so per-position counts give the histogram exactly."""
    pos = list(counters.per_position)
    out = {1: counters.drafts - (pos[0] if pos else 0.0)}
    for k in range(1, len(pos) + 1):
        out[k + 1] = pos[k - 1] - (pos[k] if k < len(pos) else 0.0)
    return out


def served_tau_se(rows: Sequence[ServedRow]) -> tuple[float, float]:
    """(served tau, its standard error) over every row's drafting steps together, from each row's share of steps
    accepting each draft position (`served_per_position`, the prefix rule of `served_histogram`)."""
    hist: dict[int, float] = {}
    for r in rows:
        counts = tuple(share * r.served_drafts for share in r.served_per_position)
        for k, c in served_histogram(SpecCounters(r.served_drafts, 0.0, sum(counts), counts)).items():
            hist[k] = hist.get(k, 0.0) + c
    return histogram_tau_se(hist)


def tau_se(cycle_log: Sequence[Sequence[tuple[int, int]]]) -> tuple[float, float]:
    """(tau, its standard error) over every cycle of `cycle_log` (per prompt, per cycle: (context, tokens))."""
    hist: dict[int, float] = {}
    for n in tokens_per_cycle(cycle_log):
        hist[n] = hist.get(n, 0) + 1
    return histogram_tau_se(hist)


def judge(row_set: ServedSet, served: ServedDecode, block_size: int, exact: bool, sampled: bool,
          plain: ServedDecode | None, along: Sequence[Sequence[tuple[int, int]]] | None = None) -> ServedRow:
    """The row of one set: our figures from its cycle log, the engine's from its counters, the bound and the
    verdict. `along`: our cycle log along the engine's own answers (not exact: greedy answers that parted from
    ours), what served tau is then judged against."""
    ours = tokens_per_cycle(row_set.cycle_log)
    tau, se = tau_se(row_set.cycle_log)
    tau_along = cycles_along = None
    if along is not None and not exact:
        tau_along, se = tau_se(along)
        cycles_along = len(tokens_per_cycle(along))
    served_tau, served_se = histogram_tau_se(served_histogram(served.counters))
    cycles = len(ours)
    per_position = [sum(n > k for n in ours) / cycles if cycles else float("nan") for k in range(1, block_size)]
    bound = 0.0 if exact else GAP_SIGMAS * math.hypot(se, served_se)
    equal = None if sampled else sum(a == b for a, b in zip(served.outputs, row_set.outputs))
    if not (served.counters.drafts > 0 and cycles > 0):  # nothing measured: no verdict can pass
        ok = False
    elif exact:
        ok = (equal == len(row_set.prompts) and abs(served_tau - tau) <= EXACT_TOL
              and served.counters.drafts == cycles)
    else:
        ok = served_tau >= (tau if tau_along is None else tau_along) - bound
    plain_rate = plain.tokens_per_s if plain is not None else None
    rounds = _round_speedups([served], [plain]) if plain is not None else []
    return ServedRow(name=row_set.name, prompts=len(row_set.prompts), tau=tau, served_tau=served_tau,
                     per_position=per_position, served_per_position=served.counters.acceptance, cycles=cycles,
                     served_drafts=int(served.counters.drafts), bound=bound, outputs_equal=equal,
                     served_tokens_per_s=served.tokens_per_s, plain_tokens_per_s=plain_rate,
                     served_speedup=served.tokens_per_s / plain_rate if plain_rate else None, ok=ok,
                     served_tokens=served.tokens, plain_tokens=None if plain is None else plain.tokens,
                     served_round_s=list(served.round_seconds or (served.seconds,)),
                     plain_round_s=None if plain is None else list(plain.round_seconds or (plain.seconds,)),
                     speedup_range=[min(rounds), max(rounds)] if rounds else None, tau_along=tau_along,
                     cycles_along=cycles_along)


def _round_speedups(served: Sequence[ServedDecode], plain: Sequence[ServedDecode]) -> list[float]:
    """Per timed round r: (tokens / seconds of round r with the drafter) over the same without it, every set of
    `served` / `plain` (paired) together."""
    def rounds(d: ServedDecode) -> tuple[float, ...]:
        return d.round_seconds or (d.seconds,)

    n = min(len(rounds(d)) for d in [*served, *plain])
    with_s = [sum(rounds(d)[r] for d in served) for r in range(n)]
    without_s = [sum(rounds(d)[r] for d in plain) for r in range(n)]
    tokens, plain_tokens = sum(d.tokens for d in served), sum(d.tokens for d in plain)
    return [tokens / a / (plain_tokens / b) for a, b in zip(with_s, without_s) if a > 0 and b > 0]


def pooled_speedup(served: Sequence[ServedDecode], plain: Sequence[ServedDecode]) -> tuple[float, list[float]]:
    """Every set together: (total tokens / total median seconds with the drafter over the same without it,
    [lowest, highest] of the per-round speedups)."""
    rate = sum(d.tokens for d in served) / sum(d.seconds for d in served)
    plain_rate = sum(d.tokens for d in plain) / sum(d.seconds for d in plain)
    rounds = _round_speedups(served, plain)
    return rate / plain_rate, [min(rounds), max(rounds)]


def verdict_line(row: ServedRow, exact: bool, suspects: Sequence[str], export: str, target: str) -> str:
    """PASS/FAIL for one row; a FAIL names the doctor's failing rules (`suspects`), the likeliest causes."""
    ours, cycles = f"ours {row.tau:.3f}", row.cycles
    if row.tau_along is not None:
        ours, cycles = f"ours along its answers {row.tau_along:.3f}", row.cycles_along
    figures = (f"served tau {row.served_tau:.3f} vs {ours} over {row.served_drafts} / {cycles} "
               f"cycles" + (" (must be equal: greedy fp32)" if exact else f" (bound {row.bound:.3f})"))
    if exact and row.outputs_equal is not None:
        figures += f", answers equal {row.outputs_equal}/{row.prompts}"
    if row.ok:
        return f"PASS served {row.name}: {figures}"
    if not row.served_drafts:
        return (f"FAIL served {row.name}: {figures}: the engine made no drafts (is it serving the drafter?); "
                + _cause(suspects, export, target))
    if not row.cycles:
        return f"FAIL served {row.name}: {figures}: our decoding made no drafting cycle, nothing to compare"
    return f"FAIL served {row.name}: {figures}: a train/serve gap; " + _cause(suspects, export, target)


def _cause(suspects: Sequence[str], export: str, target: str) -> str:
    cause = (f"the doctor fails {', '.join(suspects)}" if suspects else
             "the doctor passes every rule: compare what the engine reads of the export (docs/serving.md)")
    return f"{cause} -> python -m dflash_lib doctor {export} --target {target}"


def served_acceptance(target_dir: str, drafter_dir: str, sets: Sequence[ServedSet], block_size: int,
                      max_new_tokens: int, stop_ids: Sequence[int] = (), min_new_tokens: int = 0,
                      temperature: float = 0.0, top_p: float = 1.0, seed: int = 0, dtype: str = "float32",
                      python: str | None = None, url: str = "", log_dir: str | Path = ".",
                      start_timeout_s: float = 600.0, doctor: Callable[[], Sequence[str]] | None = None,
                      plain: bool = True) -> ServedReport:
    """`serve_passes` with one pass: `sets` decoded at `temperature`."""
    (report,) = serve_passes(target_dir, drafter_dir, [ServedPass(list(sets), temperature, top_p, seed)], block_size,
                             max_new_tokens, stop_ids, min_new_tokens, dtype, python, url, log_dir, start_timeout_s,
                             doctor, plain)
    return report


def serve_passes(target_dir: str, drafter_dir: str, passes: Sequence[ServedPass], block_size: int,
                 max_new_tokens: int, stop_ids: Sequence[int] = (), min_new_tokens: int = 0, dtype: str = "float32",
                 python: str | None = None, url: str = "", log_dir: str | Path = ".", start_timeout_s: float = 600.0,
                 doctor: Callable[[], Sequence[str]] | None = None, plain: bool = True,
                 log_name: str = "engine", rounds: int = 1,
                 along: Callable[[list[list[int]], list[list[int]]], list[list[tuple[int, int]]]] | None = None
                 ) -> list[ServedReport]:
    """The engine's decoding of every pass (`serve.measure.decode_passes`: `drafter_dir` on `target_dir`, one
    engine start; with `plain`, a second without the drafter) judged against ours (`judge_run`). One report per
    pass. `url`: a server already running (with this drafter): used as it is, no plain run. `doctor`: called
    once when a row fails, the doctor's failing rules (named by the FAIL lines). Logs: `log_dir`/`log_name`.log
    and `log_name`-plain.log. `rounds`: with the plain run, each set is timed that many times on each engine (the
    speedups from the median round, their range per round). `along(prompts, answers)`: our cycle log along the
    engine's answers, asked for a greedy set that is not exact (bf16) whose answers part from ours (`judge`)."""
    run = decode_passes(target_dir, drafter_dir, passes, block_size, max_new_tokens, stop_ids, min_new_tokens,
                        dtype, python, url, log_dir, start_timeout_s, plain, log_name, rounds)
    return judge_run(run, passes, block_size, dtype, drafter_dir, target_dir, doctor, along)


def judge_run(run: EngineRun, passes: Sequence[ServedPass], block_size: int, dtype: str, drafter_dir: str,
              target_dir: str, doctor: Callable[[], Sequence[str]] | None = None,
              along: Callable[[list[list[int]], list[list[int]]], list[list[tuple[int, int]]]] | None = None
              ) -> list[ServedReport]:
    """One report per pass of what the engine measured (`run`) against our decoding of the same prompts: a row
    per set (`judge`), its PASS/FAIL line, the pooled speedup. `doctor` and `along`: as in `serve_passes`."""
    failure, version, served, alone = run.failure, run.version, run.served, run.plain
    where, log_file = run.where, run.log

    def ours_along(p: ServedPass, s: ServedSet, d: ServedDecode) -> list[list[tuple[int, int]]] | None:
        greedy_inexact = not p.temperature > 0 and dtype != "float32"
        return along(s.prompts, d.outputs) if along is not None and greedy_inexact and d.outputs != s.outputs \
            else None

    rows = [[judge(s, d, block_size, not p.temperature > 0 and dtype == "float32", p.temperature > 0, a,
                   ours_along(p, s, d))
             for s, d, a in zip(p.sets, done, plain_done)]
            for p, done, plain_done in zip(passes, served or [[] for _ in passes], alone)]
    bad = bool(failure) or not all(r.ok for pass_rows in rows for r in pass_rows)
    suspects = list(doctor()) if doctor is not None and bad else []
    reports = []
    for p, pass_rows, done, plain_done in zip(passes, rows, served or [[] for _ in passes], alone):
        pooled = None
        if done and all(d is not None for d in plain_done):
            pooled = pooled_speedup(done, [d for d in plain_done if d is not None])
        exact = not p.temperature > 0 and dtype == "float32"
        lines = [verdict_line(r, exact, suspects, drafter_dir, target_dir) + (
            "" if r.ok else engine_adapter(run.engine).known_fault(version, p.temperature)) for r in pass_rows]
        if failure:
            lines.append(f"FAIL served: the engine failed a request ({failure}); "
                         + _cause(suspects, drafter_dir, target_dir))
        reports.append(ServedReport(engine=where, version=version, dtype=dtype, exact=exact,
                                    temperature=p.temperature, rows=pass_rows, lines=lines, log=log_file,
                                    speedup=None if pooled is None else pooled[0],
                                    speedup_range=None if pooled is None else pooled[1]))
    return reports


def served_table(report: ServedReport) -> str:
    """Served vs in-process per set: tau, per-position acceptance, the engine's tokens/s and speedup."""
    head = (f"{'served by':<32} {'tau':>6} {'served':>7} {'tok/s':>8} {'plain':>8} {'speedup':>8} {'rounds':>11}  "
            "per position ours / served")
    lines = [f"engine vLLM {report.version} ({report.dtype}, temperature {report.temperature:g})", head]
    for r in report.rows:
        plain = f"{r.plain_tokens_per_s:8.1f}" if r.plain_tokens_per_s is not None else f"{'-':>8}"
        speed = f"{r.served_speedup:7.2f}x" if r.served_speedup is not None else f"{'-':>8}"
        pos = " ".join(f"{a:.2f}/{b:.2f}" for a, b in zip(r.per_position, r.served_per_position))
        lines.append(f"{r.name[:32]:<32} {r.tau:6.3f} {r.served_tau:7.3f} {r.served_tokens_per_s:8.1f} {plain} "
                     f"{speed} {range_text(r.speedup_range):>11}  {pos}")
    if report.speedup is not None:
        lines.append(f"{'every set':<32} {'':>6} {'':>7} {'':>8} {'':>8} {report.speedup:7.2f}x "
                     f"{range_text(report.speedup_range):>11}  ({rounds_text(report)})")
    return "\n".join(lines)


def range_text(span: Sequence[float] | None) -> str:
    """'1.02-1.11x' for a [lowest, highest] speedup; '-' without one."""
    return "-" if not span else f"{span[0]:.2f}-{span[1]:.2f}x"


def rounds_text(report: ServedReport) -> str:
    """How the speedups were timed: rounds, tokens."""
    n = max((len(r.served_round_s or ()) for r in report.rows), default=0)
    tokens = sum(r.served_tokens for r in report.rows)
    return (f"{n} timed round{'s' if n != 1 else ''} of {tokens} tokens on each engine, one prompt at a time: the "
            f"median round's tokens/s, the range per round")
