"""The prompts decoded in process, served by the engine too (`-p engine vllm`): as the engine's prompt sets
(`served_sets`), one drafter folder served and judged (`serve_drafter`, through `evaluate.served.serve_passes`),
the tau of a whole report (`overall_served_tau`). docs/serving.md.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Sequence

from dflash_lib.benchmark_report import GroupDecode
from dflash_lib.data.prompts import PromptGroup
from dflash_lib.doctor import diagnose
from dflash_lib.evaluate.acceptance import acceptance_length
from dflash_lib.evaluate.served import ServedReport, serve_passes, served_table
from dflash_lib.evaluate.setup import Say, Setup, _stderr, load_drafter
from dflash_lib.serve.measure import ServedPass, ServedSet
from dflash_lib.serve.server import engine_adapter


def served_sets(groups: Sequence[PromptGroup], done: Sequence[GroupDecode]) -> list[ServedSet]:
    """The prompt `groups` and their decodings `done` as the engine's prompt sets: one per (set, thinking mode),
    every turn together."""
    out: dict[tuple[str, str], ServedSet] = {}
    for group, g in zip(groups, done):
        name = f"{g.benchmark} (thinking {g.thinking})"
        s = out.setdefault((g.benchmark, g.thinking), ServedSet(name, [], [], []))
        s.prompts += [list(p) for p in group.prompts]
        s.outputs += g.spec.outputs
        s.cycle_log += g.spec.cycle_log
    return list(out.values())


def served(setup: Setup, groups: Sequence[PromptGroup], done: Sequence[GroupDecode],
           say: Say = _stderr) -> ServedReport:
    """The decoded prompts served by the engine (`serve_drafter`): the saved drafter, its log in the run's engine/
    folder (a temporary one for a drafter outside a run), the target alone too (the engine's speedup)."""
    log_dir = (setup.run_dir / "engine" if setup.run_dir is not None
               else Path(tempfile.mkdtemp(prefix="dflash-engine-")))
    s = setup.sampling()
    (report,) = serve_drafter(setup, setup.drafter_dir, [ServedPass(served_sets(groups, done), s["temperature"],
                                                                    s["top_p"], setup.config.evaluate.sample_seed)],
                              log_dir, "engine", True, say)
    return report


def serve_drafter(setup: Setup, folder: Path, passes: Sequence[ServedPass], log_dir: Path, log_name: str,
                  plain: bool, say: Say = _stderr) -> list[ServedReport]:
    """`evaluate.served.serve_passes` of the drafter `folder` (an export) on the setup's target folder, in the dtype
    our target ran (fp32 on the CPU: greedy must then agree exactly; the adapter's `dtype`: bf16 for a linear-attention
    target, which vLLM's CPU build runs in bf16 only; in bf16 our drafter's cycles along the engine's answers are
    what its tau is judged against); the doctor names the suspects of a FAIL.
    Prints each pass's table and verdict lines."""
    c = setup.config

    def doctor() -> list[str]:
        return diagnose(folder, c.model.target, {"doctor_samples": c.evaluate.doctor_samples}).failed()

    def along(prompts: list[list[int]], answers: list[list[int]]) -> list[list[tuple[int, int]]]:
        drafter = setup.drafter if Path(folder) == Path(setup.drafter_dir) else load_drafter(folder, setup.target)
        return acceptance_length(setup.target, drafter, prompts, c.regenerate.max_new_tokens, setup.stop_ids,
                                 setup.min_new_tokens, answers=answers).cycle_log

    say(f"engine {c.evaluate.engine}: serving {folder} on {c.model.target}" + (
        f" at {c.evaluate.engine_url}" if c.evaluate.engine_url else f" (log {log_dir / (log_name + '.log')})"))
    reports = serve_passes(
        c.model.target, str(folder), passes, setup.drafter.cfg.block_size, c.regenerate.max_new_tokens,
        setup.stop_ids, setup.min_new_tokens,
        engine_adapter(c.evaluate.engine).dtype(c.model.target, setup.target.device.type == "cpu"),
        c.evaluate.engine_python or None, c.evaluate.engine_url, log_dir, c.evaluate.engine_start_timeout_s, doctor,
        plain, log_name, c.evaluate.engine_rounds, along)
    for report in reports:
        say(served_table(report))
        for line in report.lines:
            say(line)
    return reports


def overall_served_tau(report: ServedReport) -> float:
    """Tokens per drafting step over every row of `report` (the engine's drafts weighting each set's tau)."""
    drafts = sum(r.served_drafts for r in report.rows)
    return sum(r.served_tau * r.served_drafts for r in report.rows) / drafts if drafts else float("nan")
