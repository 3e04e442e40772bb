"""A drafter's acceptance measured by real speculative decoding on HELD-OUT prompts.

    python -m dflash_lib evaluate --drafter DIR [--target DIR|tiny] [-p prompts N] [-p max_new_tokens M] [-p KEY V]

DIR: a saved drafter or a trainer run folder. `evaluate(...)` decodes with the drafter (`models.acceptance`,
`models.sampling`) and the target alone: `DecodeReport`, the last stdout line; `evaluate_run(...)` every checkpoint
of a run. docs/serving.md, "Measuring a drafter: speculative decoding on held-out prompts"; the prompts
(`-p prompts_from`, `data.prompts`): docs/evaluation.md.
"""

from __future__ import annotations

import json
import math
import sys
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Sequence

import httpx
import pandas as pd
import torch

from dflash_lib.benchmark_report import (AcceptanceSlice, BenchmarkRow, GroupDecode, PromptDecode, benchmark_rows,
                                         benchmark_table, by_context, merged_figures, prompt_records, slice_line,
                                         slices)
from dflash_lib.config import FLAT_FIELDS, Config, ConfigError, from_params
from dflash_lib.doctor import diagnose
from dflash_lib.data.benchmarks import HELDOUT
from dflash_lib.data.prompts import PromptGroup, PromptSets, next_turn, prompt_sets, thinking_modes
from dflash_lib.export import export_source
from dflash_lib.families import text_config
from dflash_lib.models import TargetModel, export
from dflash_lib.models.acceptance import acceptance_length, greedy_decode
from dflash_lib.models.drafters import drafter_kind
from dflash_lib.models.export import DTYPES, export_drafter, init_from, read_drafter
from dflash_lib.models.target import target_hf_config
from dflash_lib.rundir import JsonRecord, omitted
from dflash_lib.serve.client import EngineClient
from dflash_lib.evaluate.served import ServedReport, serve_passes, served_table
from dflash_lib.serve.measure import ServedPass, ServedSet, check_served_model
from dflash_lib.serve.server import engine_python
from dflash_lib.serve.vllm import engine_dtype
from dflash_lib.train.checkpoint import CheckpointError, list_checkpoints, read_manifest
from dflash_lib.train.loop import RunSummary
from dflash_lib.train.metrics import BUDGET_FIGURES, load_metrics

RUN_SUMMARY_KEYS = ("tau_trained", "tau_untrained", "tau_by_step", "speedup", "loss_first", "loss_last",
                    "heldout_loss_last", "export")  # notebook 05's summary.json, at least
SERVING_DIR = "serving"  # evaluate_run exports the final drafter to <out_dir>/serving/
Say = Callable[[str], None]

LOSS_WINDOW = 5  # steps averaged at each end for loss_first / loss_last (at most a quarter of the run)


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


def _stderr(text: str) -> None:
    print(text, file=sys.stderr)


# -- where the drafter, the run and the config are -------------------------------------------------------------
def find_drafter(path: str | Path) -> tuple[Path, Path | None, dict[str, Any] | None]:
    """(the drafter folder, the trainer run folder or None, the run's recorded flat config or None) for a
    drafter folder or a trainer run folder (`drafter/` inside it)."""
    p = Path(path)
    if not p.is_dir():
        raise ConfigError(f"--drafter {str(p)!r}: no such directory")
    run_dir, drafter_dir = (p, p / "drafter") if (p / "drafter").is_dir() else (p.parent, p)
    cfg = run_dir / "config.json"
    if cfg.is_file():
        doc = json.loads(cfg.read_text())
        if isinstance(doc, dict) and isinstance(doc.get("config"), dict):  # a trainer run's config.json
            recorded = {k: v for sec in doc["config"].values() if isinstance(sec, dict) for k, v in sec.items()}
            return drafter_dir, run_dir, recorded
    return drafter_dir, None, None


def build_config(params: Mapping[str, Any], target: str | None,
                 recorded: Mapping[str, Any] | None = None) -> tuple[Config, list[str]]:
    """`-p` pairs (config fields, the evaluation's included) laid over a run's recorded config; the recorded keys
    this version no longer has are dropped and listed. `target` None: `-p target`, else the run's recorded one
    (ConfigError when there is neither)."""
    dropped: list[str] = []
    base = None
    if recorded:
        dropped = sorted(k for k in recorded if k not in FLAT_FIELDS)
        base = from_params({k: v for k, v in recorded.items() if k in FLAT_FIELDS})
    if target is None:
        target = params.get("target", (recorded or {}).get("target"))
        if target is None:
            raise ConfigError("--target is required: the drafter is not in a trainer run folder (config.json), so "
                              "no target is recorded; give --target tiny or a local model folder")
    return from_params({**params, "target": target}, base), dropped


# -- set-up shared by `evaluate` and `evaluate_run` ----------------------------------------------------------------
@dataclass
class Setup:
    config: Config
    drafter_dir: Path  # the saved drafter (a run's final drafter/)
    run_dir: Path | None  # the trainer run folder, when the drafter came from one
    target: Any  # TargetModel
    drafter: Any  # the saved drafter on the target, in eval mode
    prompts: PromptSets

    @property
    def stop_ids(self) -> list[int]:
        return [self.prompts.eos_id] if self.config.evaluate.stop_at_eos else []

    @property
    def min_new_tokens(self) -> int:
        """Output tokens before the end-of-turn token may end an answer (`regenerate.min_new_tokens`)."""
        return self.config.regenerate.min_new_tokens

    def sampling(self) -> dict[str, Any]:
        """The decoders' sampling arguments: `-p temperature` and `top_p` (the regenerate section's, the same
        quantity: how the target answers) and a fresh CPU generator seeded `-p sample_seed` (each decoding
        draws the same stream)."""
        r = self.config.regenerate
        return {"temperature": r.temperature, "top_p": r.top_p,
                "generator": torch.Generator().manual_seed(self.config.evaluate.sample_seed)}


def prepare(drafter: str | Path, target: str | None, params: Mapping[str, Any] | None = None,
            say: Say = _stderr) -> Setup:
    """Config (a run's recorded one under `params`), target (bf16 on CUDA, fp32 on CPU, as the trainer runs
    it), the saved drafter on it (refused first when it does not fit) and the held-out prompts, every vocabulary
    id checked against the target. `target` None: the run's recorded one (`build_config`)."""
    drafter_dir, run_dir, recorded = find_drafter(drafter)
    config, dropped = build_config(dict(params or {}), target, recorded)
    if run_dir is not None:
        say(f"run config from {run_dir / 'config.json'}" + (f" (dropped keys this version lacks: {dropped})"
                                                             if dropped else ""))
        was = (recorded or {}).get("target")
        if was is not None and was != config.model.target:
            say(f"note: the run trained against target {was!r}; evaluating against {config.model.target!r}")
    device_name = config.train.device
    if device_name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device='cuda' was asked for but CUDA is not available")
    device = torch.device("cuda" if device_name != "cpu" and torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32  # as the trainer runs the target
    check_fit(drafter_dir, config)  # before the target is built: its own checks would blame the wrong setting
    check_engine(config)
    tgt = TargetModel.from_model_config(config.model, device=device, dtype=dtype, seed=config.train.seed)
    model = load_drafter(drafter_dir, tgt)
    prompts = prompt_sets(config, run_dir)
    _check_vocabulary(prompts.prompts, tgt, config)
    for group in prompts.groups:
        check_positions(group, target_positions(tgt), config.regenerate.max_new_tokens, model.cfg.block_size)
    if config.evaluate.enable_thinking and all(g.benchmark == HELDOUT for g in prompts.groups):
        say("note: enable_thinking renders benchmark prompts only; the held-out prompts keep the token store's "
            f"rendering (thinking {config.data.thinking!r})")
    if config.data.template == "chatml" and len(thinking_modes(config)) > 1:
        say("note: template 'chatml' has no thinking mode: 'on' and 'off' render the same prompts "
            "(-p template qwen3 or hf for a Qwen3 target)")
    lengths = [len(p) for p in prompts.prompts]
    say(f"prompts: {prompts.source}; {len(lengths)} prompts of {min(lengths)}..{max(lengths)} tokens, "
        f"max_new_tokens {config.regenerate.max_new_tokens}, device {device}, target {config.model.target!r} "
        f"({dtype})")
    return Setup(config, drafter_dir, run_dir, tgt, model, prompts)


def check_engine(config: Config) -> None:
    """`-p engine vllm` needs the target as a local folder (the engine serves a folder) and an engine: a running
    server (`engine_url`) serving that target (`check_served_model`) or a Python with vllm (`serve.engine_python`).
    ConfigError before any weight is read."""
    e = config.evaluate
    if e.engine == "none":
        return
    if not Path(config.model.target).expanduser().is_dir():
        raise ConfigError(f"engine {e.engine}: the engine serves a local target folder; target "
                          f"{config.model.target!r} is not one (-p target DIR)")
    if not e.engine_url:
        engine_python(e.engine_python or None)
        return
    client = EngineClient(e.engine_url)
    try:
        check_served_model(client, config.model.target, 0)  # another target's server: refused before any load
    except httpx.HTTPError as err:
        raise ConfigError(f"engine_url {e.engine_url}: no answer to /v1/models ({type(err).__name__}: {err})") from None
    finally:
        client.close()


def target_positions(target: Any) -> int | None:
    """The target's RoPE positions (`max_position_embeddings` of its text config); None when it names none."""
    hf = target.hf
    text = text_config(hf)
    n = getattr(text, "max_position_embeddings", None)
    return int(n) if n else None


def check_positions(group: PromptGroup, positions: int | None, max_new_tokens: int, block_size: int) -> None:
    """Refuse a prompt group whose decoding could run past the target's `positions` (its max_position_embeddings):
    a prompt of P tokens needs P + max_new_tokens + block_size positions (the answer, then one draft block past
    it). Past them RoPE extrapolates without an error and the figures would measure a model outside its range.
    ConfigError naming the set, turn, longest prompt and the -p that fits it; None `positions`: no check."""
    if positions is None:
        return
    over = [(len(p), name) for p, name in zip(group.prompts, group.names)
            if len(p) + max_new_tokens + block_size > positions]
    if over:
        n, name = max(over)
        fit = positions - n - block_size
        raise ConfigError(
            f"prompt set {group.benchmark!r} (turn {group.turn}, thinking {group.thinking}): {len(over)} of "
            f"{len(group.prompts)} prompts need more than the target's {positions} positions "
            f"(max_position_embeddings): the longest, {name}, has {n} tokens + max_new_tokens {max_new_tokens} + a "
            f"block of {block_size} = {n + max_new_tokens + block_size}; "
            + (f"-p max_new_tokens {fit} or fewer fits it, " if fit > 0 else "")
            + "or leave that set out of -p prompts_from")


def _check_vocabulary(prompts: Sequence[Sequence[int]], target: Any, config: Config) -> None:
    too_big = [i for p in prompts for i in p if i >= target.vocab_size]
    if too_big:
        raise ConfigError(f"tokenizer {config.data.tokenizer!r} gives ids up to {max(too_big)}, beyond the target's "
                          f"{target.vocab_size} embedding rows")


def check_fit(drafter_dir: Path, config: Config) -> None:
    """Refuse a drafter made for another target shape than `config`'s target has, from the drafter's config.json
    and the target's (no weights): hidden size, decoder layers, fused feature layers, each named with the
    drafter's and the target's value and the -p that sets it. DFlashDrafter.load checks the rest (vocabulary,
    the exact layer ids) once the target is built."""
    try:
        mine = export.drafter_config(export.read_doc(drafter_dir), str(drafter_dir / export.CONFIG_FILE))
    except FileNotFoundError as e:
        raise ConfigError(str(e)) from None
    m = config.model
    theirs = target_hf_config(m)
    tiny = m.target == "tiny"  # its shape is set by -p; any other target's is its own
    rows = [("hidden size", mine.hidden_size, "the target's", theirs.hidden_size, "hidden_size" if tiny else ""),
            ("target layers", mine.target_num_layers, "the target has", theirs.num_hidden_layers,
             "target_layers" if tiny else ""),
            ("fused features", len(mine.target_layer_ids), "num_features is", len(m.target_layer_ids) or m.num_features,
             "num_features")]
    bad = [f"{what} {a} ({whose} {b}" + (f"; -p {key} {a})" if key else ")")
           for what, a, whose, b, key in rows if a != b]
    if bad:
        raise ConfigError(f"drafter {drafter_dir} does not fit target {m.target!r}: drafter " + ", ".join(bad))


def load_drafter(directory: str | Path, target: Any) -> Any:
    """A saved/exported drafter on `target`, in eval mode; ConfigError for a missing folder."""
    try:
        model = read_drafter(directory, target)
    except FileNotFoundError as e:
        raise ConfigError(str(e)) from None
    return model.eval()


def initial_drafter(config: Config, target: Any) -> Any:
    """The drafter a training run of `config` starts from (`build.build_parts`): built after
    `torch.manual_seed(seed)` on the target's device, then `init_from` when set. The caller's RNG is untouched."""
    devices = [target.device] if target.device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(config.train.seed)
        drafter = drafter_kind(config.model.drafter_kind).build(config.model, target)
    if config.model.init_from:
        init_from(drafter, config.model.init_from)
    return drafter.eval()


@contextmanager
def decode_threads(setup: Setup) -> Iterator[None]:
    """torch's intra-op threads set to `decode_threads` (when > 0 and the target is on the CPU), then restored."""
    n, before = setup.config.evaluate.decode_threads, torch.get_num_threads()
    if n > 0 and setup.target.device.type == "cpu":
        torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


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
    our target ran (fp32 on the CPU: greedy must then agree exactly; `engine_dtype`: bf16 for a linear-attention
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
        setup.stop_ids, setup.min_new_tokens, engine_dtype(c.model.target, setup.target.device.type == "cpu"),
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


# -- a whole training run: every checkpoint, the untrained and the final drafter (notebook 05) ---------------------
def trainer_folder(run: str | Path) -> Path:
    """The trainer run folder of `run`: a notebook-04 run folder (its `train/`) or a trainer folder itself."""
    p = Path(run)
    for candidate in (p / "train", p):
        doc = candidate / "config.json"
        if doc.is_file() and isinstance(json.loads(doc.read_text()).get("config"), dict):
            return candidate
    raise ConfigError(f"run {str(p)!r}: not a notebook-04 run folder (train/config.json) nor a trainer run folder "
                      f"(config.json with the run's config)")


def run_checkpoints(train_dir: Path) -> list[tuple[int, Path]]:
    """(step, folder) of every checkpoint of a trainer run, oldest first, through `dflash_lib.train.checkpoint`."""
    out = []
    for path in list_checkpoints(train_dir / "checkpoints"):
        try:
            out.append((int(read_manifest(path).step), path))
        except CheckpointError as e:
            raise ConfigError(f"checkpoint {path}: {e}") from None
    return out


def checkpoint_drafter(ckpt: Path, setup: Setup, scratch: Path) -> Any:
    """The drafter of one checkpoint, read the way `python -m dflash_lib export` reads it (fp32, so exact)."""
    out = export_source(ckpt, scratch / ckpt.name, DTYPES["fp32"])
    return load_drafter(out, setup.target)


def _same_weights(a: Any, b: Any) -> bool:
    pa, pb = dict(a.named_parameters()), dict(b.named_parameters())
    return pa.keys() == pb.keys() and all(torch.equal(pa[k], pb[k]) for k in pa)


@dataclass
class _Measured:
    """One drafter of a run as decoded in process, kept for the engine."""

    step: int
    what: str
    folder: Path  # an export folder the engine can serve
    done: list[GroupDecode]


def best_drafter(by_step: Sequence[DrafterMeasurement]) -> tuple[DrafterMeasurement, str, float]:
    """(the best drafter, by what, its tau): the highest served tau when every drafter was served (ties: our tau,
    then the later step), else the highest tau of our decoding (ties: the later step)."""
    if by_step and all(r.served_tau is not None for r in by_step):
        best = max(by_step, key=lambda r: (r.served_tau, r.tau, r.step))
        return best, "served tau", float(best.served_tau)
    best = max(by_step, key=lambda r: (r.tau, r.step))
    return best, "tau", best.tau


def evaluate_run(run: str | Path, target: str | None, params: Mapping[str, Any] | None = None,
                 out_dir: str | Path | None = None, say: Say = _stderr) -> RunEvaluation:
    """Every drafter of a training run on the SAME held-out prompts against the same target: the untrained one
    (step 0, `initial_drafter`), each saved checkpoint's, and the final `drafter/` (decoded in full: histogram,
    per-position acceptance, speedup against plain greedy decoding, timed once for all). With `-p engine vllm`
    each of them is also served by the engine (one start each; the final one at `sampled_temperature` too, and
    the target alone once for the engine's speedup), and the best drafter is named by served tau. With `out_dir`
    the final drafter is exported there in the serving layout (`SERVING_DIR`, bf16) and the engine's logs go to
    its engine/. Training and held-out losses come from the run's metrics.jsonl (`evaluate.loss_figures`)."""
    if (params or {}).get("engine_url"):
        raise ConfigError("engine_url: a running server serves one drafter, and a run's evaluation serves each of "
                          "its drafters; give -p engine_python (or none: .venv-engine) and the engine is started "
                          "for each")
    train_dir = trainer_folder(run)
    setup = prepare(train_dir, target, params, say)
    final_model = setup.drafter
    if not (train_dir / "summary.json").is_file():
        raise ConfigError(f"run {train_dir}: no summary.json, so the run did not finish (its drafter/ is written at "
                          f"the end; rerun the training to resume it)")
    try:
        trained = RunSummary.from_json(train_dir / "summary.json")
    except ValueError as e:  # written by a trainer of another version
        raise ConfigError(str(e)) from None
    final_step = trained.steps
    engine = setup.config.evaluate.engine != "none"
    with decode_threads(setup), tempfile.TemporaryDirectory(prefix="dflash-eval-") as scratch:
        _warm(setup, final_model)
        baseline = _baseline(setup)
        by_step: list[DrafterMeasurement] = []
        measured: list[_Measured] = []

        def measure(step: int, model: Any, what: str, folder: Path) -> DecodeReport:
            done = decode_groups(setup, model, baseline)
            r = decode_report(setup, model, done)
            _warn_differ(r, say, f" ({what})")
            by_step.append(DrafterMeasurement(step, what, r.tau, r.histogram, r.per_position, r.cycles,
                                              r.outputs_equal_baseline, r.tokens_per_s))
            measured.append(_Measured(step, what, folder, done))
            say(f"step {step:>6} ({what}): tau {r.tau:.3f} over {r.cycles} cycles")
            return r

        untrained = initial_drafter(setup.config, setup.target)
        untrained_dir = Path(scratch) / "untrained"
        if engine:
            export_drafter(untrained, untrained_dir, DTYPES["fp32"])
        measure(0, untrained, "untrained (the run's seed)", untrained_dir)
        for step, ckpt in run_checkpoints(train_dir):
            model = checkpoint_drafter(ckpt, setup, Path(scratch))
            if step == final_step and _same_weights(model, final_model):
                continue  # the final drafter itself: decoded once, below
            measure(step, model, str(ckpt.relative_to(train_dir)), Path(scratch) / ckpt.name)
        final = measure(final_step, final_model, "final (drafter/)", setup.drafter_dir)
        hot = sampled_setup(setup)
        hot_done: list[GroupDecode] = []
        hot_base = None
        sampled = None
        if hot is not None:
            hot_base = _baseline(hot)
            hot_done = decode_groups(hot, final_model, hot_base)
            sampled = decode_report(hot, final_model, hot_done)
            say(f"sampled at temperature {hot.config.regenerate.temperature}: tau {sampled.tau:.3f}, speedup "
                f"{sampled.speedup:.2f}x over plain sampling")
        if engine:
            log_dir = (Path(out_dir) / "engine" if out_dir is not None
                       else Path(tempfile.mkdtemp(prefix="dflash-engine-")))
            g = setup.sampling()
            for m, row in zip(measured, by_step):
                passes = [ServedPass(served_sets(baseline.groups, m.done), g["temperature"], g["top_p"],
                                     setup.config.evaluate.sample_seed)]
                is_final = m.folder == setup.drafter_dir
                if is_final and hot is not None and hot_base is not None:
                    h = hot.sampling()
                    passes.append(ServedPass(served_sets(hot_base.groups, hot_done), h["temperature"], h["top_p"],
                                             hot.config.evaluate.sample_seed))
                reports = serve_drafter(setup, m.folder, passes, log_dir, f"engine-step-{m.step}", is_final, say)
                row.served, row.served_tau = reports[0], overall_served_tau(reports[0])
                if is_final:
                    final.served = reports[0]
                    if sampled is not None:
                        sampled.served = reports[1]
    by_step.sort(key=lambda r: r.step)
    metrics = load_metrics(train_dir)
    losses = loss_figures(metrics)
    export, export_files, export_config = None, [], {}
    if out_dir is not None:
        folder = export_source(setup.drafter_dir, Path(out_dir) / SERVING_DIR, DTYPES["bf16"])
        export = str(folder)
        export_files = sorted(p.name for p in folder.iterdir())
        export_config = json.loads((folder / "config.json").read_text())
    doctor = run_doctor(export, setup.config, say)
    best, best_by, best_tau = best_drafter(by_step)
    say(f"best drafter by {best_by}: step {best.step} ({best.drafter}), {best_by} {best_tau:.3f}")
    report = RunEvaluation(
        tau_trained=final.tau, tau_untrained=by_step[0].tau, tau_by_step={str(r.step): r.tau for r in by_step},
        speedup=final.speedup, **losses, export=export, export_files=export_files, export_config=export_config,
        final=final, by_step=by_step, steps=final_step, **{k: getattr(trained, k) for k in BUDGET_FIGURES},
        run=str(Path(run)), train_dir=str(train_dir),
        prompts=final.prompts, max_new_tokens=final.max_new_tokens, min_new_tokens=final.min_new_tokens,
        block_size=final.block_size, prompt_source=setup.prompts.source, prompt_indices=setup.prompts.indices,
        sampled=sampled, doctor=doctor, best_step=best.step, best_drafter=best.drafter, best_by=best_by,
        best_tau=best_tau)
    say(summary(final))
    return report


def sampled_setup(setup: Setup) -> Setup | None:
    """The setup at `sampled_temperature` (the regenerate section's top_p, `sample_seed`); None when it is 0 or
    the setup already decodes at that temperature."""
    t = setup.config.evaluate.sampled_temperature
    if t == 0 or t == setup.config.regenerate.temperature:
        return None
    return replace(setup, config=from_params({"temperature": t}, setup.config))


def run_doctor(export: str | None, config: Config, say: Say = _stderr) -> dict[str, Any] | None:
    """The serving doctor (`doctor.diagnose`, `doctor_samples` conversations) on the exported folder against the
    config's target folder: its JSON record and `lines`; None without an export or a local target folder."""
    target = config.model.target
    if export is None or not Path(target).expanduser().is_dir():
        return None
    report = diagnose(export, target, {"doctor_samples": config.evaluate.doctor_samples})
    for line in report.lines():
        say(f"doctor: {line}")
    say(f"doctor: {report.count_line()}")
    return {**report.to_json(), "lines": report.lines()}


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


def _number(value: Any) -> float | None:
    """A finite float, or None (JSON has no NaN)."""
    try:
        value = float(value)
    except (TypeError, ValueError):
        return None
    return value if math.isfinite(value) else None


def loss_figures(metrics: pd.DataFrame, window: int = LOSS_WINDOW) -> dict[str, Any]:
    """From a run's metrics frame (`train.metrics.load_metrics`; rows of skipped steps left out):
    loss_first / loss_last = mean training loss (nats) over the first / last `loss_window` steps, where
    loss_window = max(1, min(window, steps // 4)) so the two windows never overlap; heldout_loss_first /
    heldout_loss_last = the held-out loss of the first / last evaluation (None when the run logged none) and
    heldout_steps = the steps evaluated."""
    if window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    rows = metrics
    if "skipped" in rows:
        rows = rows[~rows["skipped"].fillna(False).astype(bool)]
    losses = rows[["step", "loss"]].dropna()
    if losses.empty:
        raise ValueError("metrics: no step with a training loss")
    w = max(1, min(window, len(losses) // 4))
    out: dict[str, Any] = {"loss_first": float(losses["loss"].iloc[:w].mean()),
                           "loss_last": float(losses["loss"].iloc[-w:].mean()), "loss_window": w,
                           "heldout_loss_first": None, "heldout_loss_last": None, "heldout_steps": []}
    if "heldout_loss" in metrics:
        held = metrics[["step", "heldout_loss"]].dropna()
        if not held.empty:
            out["heldout_loss_first"] = _number(held["heldout_loss"].iloc[0])
            out["heldout_loss_last"] = _number(held["heldout_loss"].iloc[-1])
            out["heldout_steps"] = [int(s) for s in held["step"]]
    return out
