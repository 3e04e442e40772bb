"""The other DFlash trainers beside ours (`make bench-peers`, benchmarks/peers/run.py): one `PeerRow` per trainer in
results.json, and docs/peers.md's table rendered from it (`peers_table`, between `TABLE_BEGIN` and `TABLE_END`),
never typed by hand. Tau here is the engine's: tokens per drafting step over a set's draft-verify cycles (1 +
accepted / drafts), every set together weighted by its drafts.
"""

from __future__ import annotations

import re
import statistics
from dataclasses import dataclass, field
from typing import Any, Sequence

from dflash_lib.rundir import JsonRecord
from dflash_lib.evaluate.served import ServedReport

PEER_NAMES = ("speculators", "specforge")  # the trainers beside ours
TABLE_BEGIN = "<!-- peers-table: begin (benchmarks/peers/run.py --table writes it from results.json) -->"
TABLE_END = "<!-- peers-table: end -->"
SPREAD_BEGIN = "<!-- spread-table: begin (benchmarks/peers/spread.py --table writes it from spread.json) -->"
SPREAD_END = "<!-- spread-table: end -->"


@dataclass
class PeerRow(JsonRecord):
    """One trainer on the shared job: how it trained, and its export served by vLLM and decoded by z-lab's loop."""

    trainer: str  # "ours" | "speculators" | "specforge"
    status: str  # "ran" | "refused" (`reason` says why: the trainer's or the engine's error)
    reason: str  # "" when it ran
    version: str  # the trainer package's version
    train_tokens: int | None = None  # document tokens trained on, as the trainer counted them (each is given the
    # job's epochs; a trainer that steps in whole rows or accumulation windows ends within a step of them)
    loop_s: float | None = None  # seconds of the training loop (the trainer's own clock, setup excluded)
    tokens_per_s: float | None = None  # train_tokens / loop_s
    tokens_per_cpu_s: float | None = None  # train_tokens / the loop's CPU seconds (every thread of the process): the
    # work a token costs, which a machine busy with other work does not move as it moves tokens_per_s
    wall_s: float | None = None  # seconds of the whole training process (setup and export included)
    peak_rss_gib: float | None = None  # the training process's peak resident memory (GNU time's maximum RSS, GiB)
    served: bool = False  # vLLM loaded the export and drafted with it
    served_tau: float | None = None  # every set: the engine's tokens per drafting step (drafts-weighted)
    served_tau_per_set: dict[str, float] = field(default_factory=dict)  # set name -> its served tau
    served_per_position: dict[str, list[float]] = field(default_factory=dict)  # set -> (B-1,) share accepting k
    served_speedup: float | None = None  # every set: vLLM's tokens/s with the drafter over without (median round)
    speedup_range: list[float] | None = None  # [lowest, highest] of the same per timed round
    outputs_equal: int | None = None  # served answers equal to plain greedy decoding's (greedy fp32: all of them)
    prompts: int = 0  # prompts served (every turn)
    zlab_tau: float | None = None  # z-lab's `spec_generate` on the same prompts: tokens per cycle, every set
    zlab_tau_per_set: dict[str, float] = field(default_factory=dict)
    zlab_reason: str = ""  # why z-lab's loop did not decode the export ("" when it did)
    unmatched: list[dict[str, Any]] = field(default_factory=list)  # settings the trainer could not be given
    patches: list[str] = field(default_factory=list)  # device-only patches the harness applied to run it here
    settings: dict[str, Any] = field(default_factory=dict)  # what the trainer was given


def peak_rss_gib(time_verbose: str) -> float | None:
    """GiB of "Maximum resident set size (kbytes)" in GNU time -v's report; None when it is not there."""
    m = re.search(r"Maximum resident set size \(kbytes\):\s*(\d+)", time_verbose)
    return int(m.group(1)) / 2**20 if m else None


def served_fields(report: ServedReport) -> dict[str, Any]:
    """A `PeerRow`'s served figures from one `serve_passes` report of the export."""
    drafts = sum(r.served_drafts for r in report.rows)
    return dict(served=drafts > 0,
                served_tau=sum(r.served_tau * r.served_drafts for r in report.rows) / drafts if drafts else None,
                served_tau_per_set={r.name: r.served_tau for r in report.rows},
                served_per_position={r.name: list(r.served_per_position) for r in report.rows},
                served_speedup=report.speedup, speedup_range=report.speedup_range,
                outputs_equal=sum(r.outputs_equal or 0 for r in report.rows), prompts=sum(r.prompts for r in report.rows))


def _f(x: float | None, fmt: str) -> str:
    return "—" if x is None else format(x, fmt)


def peers_table(rows: Sequence[PeerRow], sets: Sequence[str]) -> str:
    """The markdown table of docs/peers.md: a line per trainer (a refused one with its reason)."""
    head = (["trainer", "version", "status", "train tokens", "tokens/s", "tokens/CPU-s", "peak RSS GiB", "served tau"] + [f"tau {s}" for s in sets]
            + ["vLLM speedup", "z-lab tau", "answers = greedy"])
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        status = r.status if r.status == "ran" and not r.reason else f"{r.status}: {r.reason}"
        spread = f" ({r.speedup_range[0]:.2f}-{r.speedup_range[1]:.2f})" if r.speedup_range else ""
        zlab = _f(r.zlab_tau, ".3f") if not r.zlab_reason else f"— ({r.zlab_reason})"
        cells = ([r.trainer, r.version, status, _f(r.train_tokens, ",d"), _f(r.tokens_per_s, ".0f"), _f(r.tokens_per_cpu_s, ".0f"),
                  _f(r.peak_rss_gib, ".2f"),
                  _f(r.served_tau, ".3f")] + [_f(r.served_tau_per_set.get(s), ".3f") for s in sets]
                 + [_f(r.served_speedup, ".2f") + ("x" if r.served_speedup is not None else "") + spread, zlab,
                    f"{r.outputs_equal} of {r.prompts}" if r.prompts else "—"])
        out.append("| " + " | ".join(c.replace("|", "/") for c in cells) + " |")
    return "\n".join(out)


def with_table(doc: str, table: str, begin: str = TABLE_BEGIN, end: str = TABLE_END) -> str:
    """`doc` (docs/peers.md's text) with the block between `begin` and `end` replaced by `table`; ValueError when
    the markers are not there once each, in order."""
    a, b = doc.find(begin), doc.find(end)
    if doc.count(begin) != 1 or doc.count(end) != 1 or b < a:
        raise ValueError(f"docs/peers.md must hold the markers {begin!r} and {end!r} once each, in order")
    return doc[:a + len(begin)] + "\n" + table + "\n" + doc[b:]


@dataclass
class SpreadLine(JsonRecord):
    """One retraining on the peers' job (benchmarks/peers/spread.py): a trainer with a seed, or ours with one
    setting changed, its drafter decoded (ours, in process) or served (a peer's export, vLLM) on the same prompts."""

    tag: str  # "seed" (ours, settings as run.py's), a lever's name (ours, `overrides`), or the peer's name
    seed: int
    overrides: dict[str, str]  # our settings changed from run.py's ({} for a seed or a peer)
    train_tokens: int | None
    loop_s: float | None
    tau: float  # every set: tokens per drafting cycle
    tau_se: float  # its standard error over cycles
    cycles: int
    per_set: dict[str, float]  # set name -> tau


def loss_thirds(losses: Sequence[float]) -> tuple[float, float, float]:
    """The mean training loss over each third of a run's steps (`losses` one a step, in order; a third holds
    len // 3 or one more): how two trainers' runs compare along the way, not only at their last step."""
    n = len(losses)
    if n < 3:
        raise ValueError(f"loss_thirds: {n} steps; needs 3 or more")
    cuts = [i * n // 3 for i in range(4)]
    a, b, c = (statistics.fmean(losses[cuts[i]:cuts[i + 1]]) for i in range(3))
    return a, b, c


def mean_difference(taus: Sequence[float], base: Sequence[float]) -> tuple[float, float]:
    """mean(taus) - mean(base) and its standard error, Welch's (each group's own variance over its seeds): two
    seeds or more in each."""
    se = (statistics.variance(taus) / len(taus) + statistics.variance(base) / len(base)) ** 0.5
    return statistics.fmean(taus) - statistics.fmean(base), se


def _setting(key: str, value: object, seed: int) -> str:
    """One override of a spread line as the table shows it: a seed set to the run's own seed reads "= the seed", so
    the lines of one lever over several seeds share a setting (and a mean)."""
    return f"{key} = the seed" if key.endswith("seed") and str(value) == str(seed) else f"{key} {value}"


def spread_table(lines: Sequence[SpreadLine], reference: Sequence[PeerRow]) -> str:
    """The markdown table of docs/peers.md's seeds and levers: the reference run's rows (results.json) as seed 0 of
    each trainer, then every retraining; a last block gives each trainer's mean over its seeds, then the mean of
    each of our levers run with two seeds or more."""
    head = ["trainer", "setting", "seed", "tau", "+- SE", "cycles"]
    sets = sorted({name for ln in lines for name in ln.per_set} | {n for r in reference for n in r.served_tau_per_set})
    out = ["| " + " | ".join(head + [f"tau {n}" for n in sets]) + " |", "|" + "---|" * (len(head) + len(sets))]
    seeds: dict[str, list[float]] = {}
    levers: dict[str, list[float]] = {}
    for r in reference:
        if r.served_tau is not None:
            seeds.setdefault(r.trainer, []).append(r.served_tau)
            out.append("| " + " | ".join([r.trainer, "reference run (results.json)", "0", f"{r.served_tau:.3f}", "—",
                                          "—"] + [_f(r.served_tau_per_set.get(n), ".3f") for n in sets]) + " |")
    for ln in lines:
        trainer = ln.tag if ln.tag in PEER_NAMES else "ours"
        setting = ("the job's recipe" if trainer != "ours" or ln.tag == "seed" else
                   ", ".join(_setting(k, v, ln.seed) for k, v in ln.overrides.items()) or ln.tag)
        if setting == "the job's recipe":
            seeds.setdefault(trainer, []).append(ln.tau)
        else:
            levers.setdefault(setting, []).append(ln.tau)
        out.append("| " + " | ".join([trainer, setting, str(ln.seed), f"{ln.tau:.3f}", f"{ln.tau_se:.3f}",
                                      f"{ln.cycles:,}"] + [_f(ln.per_set.get(n), ".3f") for n in sets]) + " |")
    means = [(f"**{t}**", f"mean of {len(v)} seeds (SD across seeds)", v) for t, v in seeds.items()]
    means += [("**ours**", f"{k}: mean of {len(v)} seeds (SD across seeds)", v)
              for k, v in levers.items() if len(v) > 1]
    ours = seeds.get("ours", [])
    for who, what, taus in means:
        sd = statistics.stdev(taus) if len(taus) > 1 else float("nan")
        if taus is not ours and len(ours) > 1 and len(taus) > 1:
            diff, se = mean_difference(taus, ours)
            what += f"; {diff:+.3f} on ours' seeds, {diff / se:.1f} SE"
        out.append("| " + " | ".join([who, what, "—", f"**{statistics.fmean(taus):.3f}**", f"({sd:.3f})", "—"]
                                     + ["—"] * len(sets)) + " |")
    return "\n".join(out)
