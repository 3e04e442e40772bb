"""The evaluation's records: one drafter's speculative decoding against plain decoding (`DecodeReport`, the last
stdout line of `python -m dflash_lib evaluate`), one drafter of a training run (`DrafterMeasurement`), the whole run
(`RunEvaluation`), a report's lines (`summary`) and notebook 05's summary.json (`run_summary`). docs/serving.md.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from dflash_lib.benchmark_report import AcceptanceSlice, BenchmarkRow, PromptDecode, benchmark_table, slice_line
from dflash_lib.evaluate.served import ServedReport
from dflash_lib.rundir import JsonRecord, omitted
from dflash_lib.rundir.records import BUDGET_FIGURES


RUN_SUMMARY_KEYS = ("tau_trained", "tau_untrained", "tau_by_step", "speedup", "loss_first", "loss_last",
                    "heldout_loss_last", "export")  # notebook 05's summary.json, at least


@dataclass
class DecodeReport(JsonRecord):
    """One drafter's speculative decoding of the prompt sets against plain decoding of the same prompts, greedy or
    sampled at `temperature` > 0 (`decode`): the JSON line of `python -m dflash_lib evaluate`, what `evaluate`
    returns, `RunEvaluation.final`."""

    tau: float  # acceptance length: mean tokens per drafting cycle (accepted drafts + the target's own), 1 .. B
    histogram: dict[str, int]  # tokens per cycle ("1" .. str(B)) -> cycles
    per_position: list[float]  # (B-1,) [k-1]: share of cycles that accepted draft position k
    target_calls_per_token: float  # target forwards per output token (prefills included; plain decoding: 1)
    tokens_per_s: float  # output tokens per second of speculative decoding (wall clock, prefills included)
    baseline_tokens_per_s: float  # the same for plain greedy decoding with a KV cache
    speedup: float  # tokens_per_s / baseline_tokens_per_s
    prompts: int  # prompts decoded, over every prompt set (each turn of a multi-turn question counted)
    max_new_tokens: int  # output tokens per prompt at most
    min_new_tokens: int  # output tokens before the end-of-turn token may end an answer
    cycles: int  # drafting cycles over all prompts
    output_tokens: int  # tokens generated over all prompts
    # prompts whose output equals plain greedy decoding's (all, barring bf16 ties); None when sampling
    # (temperature > 0): two samples of the same distribution are not compared token for token
    outputs_equal_baseline: int | None
    block_size: int  # B: the drafter's block (anchor + B-1 drafts)
    device: str  # torch device the target and drafter ran on
    drafter: str  # the saved drafter folder evaluated
    target: str  # the target: "tiny" or a model folder
    prompt_source: str  # which split and which samples the prompts are, in words
    prompt_indices: list[int]  # token-store index of each held-out prompt's sample ([] without `heldout`)
    # Per prompt set (`-p prompts_from`) and thinking mode, and the breakdowns (dflash_lib.benchmark_report); the
    # figures above are over all of them (absent from reports written before these existed: empty)
    benchmarks: list[BenchmarkRow] = field(default_factory=list)  # one row per prompt set x thinking mode
    by_context: list[AcceptanceSlice] = field(default_factory=list)  # cycles by context length (CONTEXT_EDGES)
    by_turn: list[AcceptanceSlice] = field(default_factory=list)  # cycles by the turn of their question
    by_thinking: list[AcceptanceSlice] = field(default_factory=list)  # cycles by thinking mode
    per_prompt: list[PromptDecode] = field(default_factory=list)  # every decoded prompt: set, id, turn, tau
    temperature: float = 0.0  # sampling temperature of both decodings (`-p temperature`); 0 = greedy
    top_p: float = 1.0  # nucleus mass of both decodings when temperature > 0 (`-p top_p`)
    sample_seed: int = 0  # seed of the CPU generator each decoding samples from (`-p sample_seed`)
    # `-p engine vllm`: the same prompts served by the engine, per set beside these figures (`evaluate.served`)
    served: ServedReport | None = omitted()


@dataclass
class DrafterMeasurement(JsonRecord):
    """One drafter of a training run decoded on the run's held-out prompts (`RunEvaluation.by_step`, notebook 05's
    by_step.json)."""

    step: int  # training step of the drafter (0 = the untrained one the run started from)
    drafter: str  # which: "untrained (the run's seed)", a checkpoint folder (relative to the run) or the final one
    tau: float  # acceptance length (tokens per cycle, `DecodeReport.tau`)
    histogram: dict[str, int]  # tokens per cycle -> cycles
    per_position: list[float]  # (B-1,) share of cycles accepting each draft position
    cycles: int  # drafting cycles over all prompts
    outputs_equal_baseline: int | None  # prompts whose output equals plain greedy decoding's; None when sampling
    tokens_per_s: float  # output tokens per second of speculative decoding
    # `-p engine vllm`: this drafter served by the engine on the same prompts (`evaluate.served.ServedReport`) and its
    # tau over every set (tokens per drafting step, the engine's own counters)
    served_tau: float | None = omitted()
    served: ServedReport | None = omitted()


@dataclass
class RunEvaluation(JsonRecord):
    """What a training run bought (`evaluate_run`, notebook 05): every drafter of the run on the same held-out
    prompts against the same target, and the run's losses from its metrics.jsonl (`loss_figures`)."""

    tau_trained: float  # the final drafter's acceptance length (tokens per cycle)
    tau_untrained: float  # the untrained drafter's (step 0)
    tau_by_step: dict[str, float]  # str(step) -> tau, step order (0 = untrained)
    speedup: float  # the final drafter's tokens/s over plain greedy decoding's
    loss_first: float  # mean training loss (nats) of the first loss_window steps
    loss_last: float  # mean training loss (nats) of the last loss_window steps
    loss_window: int  # steps averaged at each end: max(1, min(LOSS_WINDOW, steps // 4))
    heldout_loss_first: float | None  # held-out loss (nats) of the first evaluation; None when the run logged none
    heldout_loss_last: float | None  # held-out loss (nats) of the last evaluation; None when the run logged none
    heldout_steps: list[int]  # the steps evaluated on the held-out samples
    export: str | None  # the serving folder the final drafter was exported to (bf16); None without out_dir
    export_files: list[str]  # its files
    export_config: dict[str, Any]  # its config.json
    final: DecodeReport  # the final drafter (drafter/), decoded in full
    by_step: list[DrafterMeasurement]  # every drafter measured, step order
    steps: int  # optimizer steps of the run (its summary.json)
    # How full the run's batches were in each budget, from its summary.json (`RunSummary`: means over its steps);
    # None where the run had no such figure:
    token_fill: float | None  # token cost / token budget (padding counted, as the budget counts it)
    query_fill: float | None  # drafter query tokens / block budget
    bound_tokens: float | None  # share of the batches the token budget closed
    bound_blocks: float | None  # share of the batches the block budget closed
    run: str  # the run folder given (a notebook-04 run or a trainer run folder)
    train_dir: str  # the trainer run folder in it
    prompts: int  # prompts decoded by every drafter (every prompt set, each turn counted)
    max_new_tokens: int  # output tokens per prompt at most
    min_new_tokens: int  # output tokens before the end-of-turn token may end an answer
    block_size: int  # B of the run's drafter
    prompt_source: str  # which split and which samples the prompts are, in words
    prompt_indices: list[int]  # token-store index of each prompt's sample
    # The final drafter once more, sampled at `sampled_temperature` against plain sampling (None: not asked for,
    # or the main evaluation is already at that temperature)
    sampled: DecodeReport | None = None
    # The serving doctor on the export against the target folder (`doctor.DoctorReport.to_json`, plus its `lines`);
    # None without an export or when the target is not a local folder ("tiny")
    doctor: dict[str, Any] | None = None
    # The best drafter of the run (`best_drafter`): by served tau with `-p engine vllm`, else by our tau
    best_step: int = 0  # its step
    best_drafter: str = ""  # which (`DrafterMeasurement.drafter`)
    best_by: str = "tau"  # "served tau" (the engine's counters) or "tau" (in-process decoding)
    best_tau: float = 0.0  # its tau by that measure (tokens per cycle)


def run_summary(evaluation: RunEvaluation) -> dict[str, Any]:
    """Notebook 05's summary.json: RUN_SUMMARY_KEYS and the final drafter's decoding figures (no per-step
    detail, no config dump)."""
    report = evaluation.to_json()
    final = report["final"]
    extra = {k: final[k] for k in ("histogram", "per_position", "target_calls_per_token", "tokens_per_s",
                                   "baseline_tokens_per_s", "outputs_equal_baseline", "cycles", "benchmarks",
                                   "by_context", "by_turn", "by_thinking")}
    keep = ("loss_window", "heldout_loss_first", "heldout_steps", "steps", "prompts", "max_new_tokens",
            "min_new_tokens", "block_size", *BUDGET_FIGURES,
            "prompt_source", "prompt_indices", "run", "train_dir", "export_files", "best_step", "best_drafter",
            "best_by", "best_tau")
    sampled = report.get("sampled")
    if sampled is not None:
        sampled = {k: sampled[k] for k in ("temperature", "top_p", "sample_seed", "tau", "speedup", "tokens_per_s",
                                           "baseline_tokens_per_s", "per_position", "cycles", "prompts",
                                           "benchmarks")}
    served = {str(r["step"]): r["served_tau"] for r in report["by_step"] if r.get("served_tau") is not None}
    return {**{k: report[k] for k in RUN_SUMMARY_KEYS}, **{k: report[k] for k in keep if k in report}, **extra,
            "target": final["target"], "device": final["device"], "sampled": sampled, "doctor": report.get("doctor"),
            **({"served_tau_by_step": served, "served": final.get("served"),
                "sampled_served": (report.get("sampled") or {}).get("served")} if served else {})}


def summary(r: DecodeReport) -> str:
    """The human-readable lines of a report: the figures over every prompt, then the per-benchmark table and the
    breakdowns by turn, thinking mode and context length (`benchmark_report`)."""
    hist = ", ".join(f"{k}:{v}" for k, v in r.histogram.items())
    pos = " ".join(f"{p:.2f}" for p in r.per_position)
    table = [benchmark_table(r.benchmarks), slice_line("turn", r.by_turn), slice_line("thinking mode", r.by_thinking),
             slice_line("context length (tokens)", r.by_context)] if r.benchmarks else []
    plain = "plain greedy" if r.temperature == 0 else f"plain sampling (temperature {r.temperature}, top_p {r.top_p})"
    same = (f"{r.outputs_equal_baseline}/{r.prompts} outputs identical" if r.outputs_equal_baseline is not None else
            "sampling: outputs are not compared token for token")
    return "\n".join([
        f"tau {r.tau:.3f} tokens per cycle over {r.cycles} cycles (block size {r.block_size})",
        f"tokens per cycle -> cycles: {hist}",
        f"acceptance by draft position 1..{r.block_size - 1}: {pos}",
        f"target forwards per output token {r.target_calls_per_token:.3f} (plain decoding: 1)",
        f"{r.tokens_per_s:.1f} tokens/s vs {r.baseline_tokens_per_s:.1f} {plain} with a KV cache: "
        f"speedup {r.speedup:.2f}x; {same}",
        *table,
    ])
