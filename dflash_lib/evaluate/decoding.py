"""Speculative decoding of the setup's prompts in process (`evaluate.acceptance`) against plain decoding of the same
prompts, later turns asked after the target's own answers (`Baseline`); `evaluate`: one drafter, loaded, decoded,
timed and compared (`DecodeReport`), then served by the engine with `-p engine vllm` (`evaluate.engine`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from dflash_lib.benchmark_report import (GroupDecode, benchmark_rows, by_context, merged_figures, prompt_records,
                                         slices)
from dflash_lib.data.prompts import PromptGroup, next_turn
from dflash_lib.evaluate.acceptance import acceptance_length, greedy_decode
from dflash_lib.evaluate.engine import served
from dflash_lib.evaluate.reports import DecodeReport, summary
from dflash_lib.evaluate.setup import (Say, Setup, _check_vocabulary, _stderr, check_positions, decode_threads,
                                       prepare, target_positions)


def _warm(setup: Setup, drafter: Any) -> None:
    """First-call overheads (allocator, kernels) out of the timed decodes."""
    if setup.config.evaluate.timing_warmup:
        few = min(setup.config.regenerate.max_new_tokens, 2 * drafter.cfg.block_size)
        acceptance_length(setup.target, drafter, setup.prompts.prompts[:1], few, setup.stop_ids, setup.min_new_tokens,
                          **setup.sampling())
        greedy_decode(setup.target, setup.prompts.prompts[:1], few, setup.stop_ids, setup.min_new_tokens,
                      **setup.sampling())


@dataclass
class Baseline:
    """Plain decoding (greedy, or sampled at temperature > 0) of every prompt group, later turns included (made
    from these answers)."""

    groups: list[PromptGroup]  # every turn of every set x thinking mode: turn t+1 right after turn t
    results: list[Any]  # acceptance.DecodeResult of each group


def decode(setup: Setup, drafter: Any, baseline: Baseline) -> DecodeReport:
    """Speculative decoding of every prompt group of the `baseline` (the same prompts, later turns made from the
    baseline's answers, which are the target's own) with `drafter`, one `acceptance_length` per group; the
    figures over all groups, per prompt set x thinking mode (`benchmark_report`) and the breakdowns. The context
    fields (device, drafter folder, target, prompts, sampling) are the setup's; outputs are compared with the
    baseline's only when greedy."""
    return decode_report(setup, drafter, decode_groups(setup, drafter, baseline))


def decode_groups(setup: Setup, drafter: Any, baseline: Baseline) -> list[GroupDecode]:
    """`decode`'s speculative decodings, one per prompt group of the baseline."""
    n_new = setup.config.regenerate.max_new_tokens
    done = []
    for group, base in zip(baseline.groups, baseline.results):
        spec = acceptance_length(setup.target, drafter, group.prompts, n_new, setup.stop_ids, setup.min_new_tokens,
                                 **setup.sampling())
        done.append(GroupDecode(group.benchmark, group.thinking, group.turn, group.names,
                                [len(p) for p in group.prompts], spec, base))
    return done


def decode_report(setup: Setup, drafter: Any, done: list[GroupDecode]) -> DecodeReport:
    """`decode`'s report of the group decodings `done`."""
    sampling = setup.sampling()
    n_new = setup.config.regenerate.max_new_tokens
    block = drafter.cfg.block_size
    figures = merged_figures(done, block)
    prompts = figures.pop("turns")
    return DecodeReport(
        **figures, prompts=prompts, max_new_tokens=n_new, min_new_tokens=setup.min_new_tokens, block_size=block,
        device=str(setup.target.device), drafter=str(setup.drafter_dir), target=setup.config.model.target,
        prompt_source=setup.prompts.source, prompt_indices=setup.prompts.indices,
        benchmarks=benchmark_rows(done, block), by_context=by_context([p for g in done for p in g.spec.cycle_log]),
        by_turn=slices(done, lambda g: f"turn {g.turn}"), by_thinking=slices(done, lambda g: f"thinking {g.thinking}"),
        per_prompt=prompt_records(done), temperature=sampling["temperature"], top_p=sampling["top_p"],
        sample_seed=setup.config.evaluate.sample_seed)


def _baseline(setup: Setup) -> Baseline:
    """Plain decoding of each prompt group (greedy, or sampled as `Setup.sampling` says), then of its next turn,
    asked after these answers (`next_turn`)."""
    n_new = setup.config.regenerate.max_new_tokens
    groups, results = [], []
    for first in setup.prompts.groups:
        group: PromptGroup | None = first
        while group is not None:
            result = greedy_decode(setup.target, group.prompts, n_new, setup.stop_ids, setup.min_new_tokens,
                                   **setup.sampling())
            groups.append(group)
            results.append(result)
            group = next_turn(group, result.outputs, setup.prompts.eos_id, setup.prompts.decode_text)
            if group is not None:
                _check_vocabulary(group.prompts, setup.target, setup.config)
                check_positions(group, target_positions(setup.target), n_new, setup.drafter.cfg.block_size)
    return Baseline(groups, results)


def _warn_differ(report: DecodeReport, say: Say, what: str = "") -> None:
    n, same = report.prompts, report.outputs_equal_baseline
    if same is not None and same != n:
        say(f"warning{what}: {n - same} of {n} outputs differ from plain greedy decoding "
            "(expected only from low-precision ties, e.g. bf16 on CUDA)")


def evaluate(drafter: str | Path, target: str | None, params: Mapping[str, Any] | None = None,
             say: Say = _stderr) -> DecodeReport:
    """Load, decode, time and compare one drafter; returns the report. ConfigError on user errors."""
    setup = prepare(drafter, target, params, say)
    with decode_threads(setup):
        _warm(setup, setup.drafter)
        baseline = _baseline(setup)
        done = decode_groups(setup, setup.drafter, baseline)
    report = decode_report(setup, setup.drafter, done)
    say(summary(report))
    _warn_differ(report, say)
    if setup.config.evaluate.engine != "none":
        report.served = served(setup, baseline.groups, done, say)
    return report
