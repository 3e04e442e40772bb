"""Command line: `python -m dflash_lib [--debug] COMMAND ...`; `COMMAND --help` for its options, README for the docs.

Data and training: regenerate, run (a notebook into runs/<id>/), train, capture, engine-command, params. Sizing:
dryrun, tune.
Serving: export, evaluate, doctor, engine-check. The study on the bundled corpus: demo, demo-target. Wherever a
preset name goes, a preset file does too (`--preset FILE.json`, {"preset": NAME, "params": {...}}: what `tune` writes).

A user error ends in ONE line `error: ...` on stderr and exit code 2; a run that fails (a stage, a checkpoint, a
peer, an engine) in one line and exit 1; anything else is a bug and keeps its traceback (`--debug`: every traceback).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from dflash_lib.config import SECTION_CLASSES, ConfigError, params_table
from dflash_lib.lab.runs import notebook_names

# Each command imports its stage when it runs (the package's only function-local imports): --help loads no torch.


def user_errors() -> tuple[type[BaseException], ...]:
    """The project's exceptions for bad input (settings, corpus, bucket or sampler requests, paths that do not
    exist): the command line reports them in one line with exit code 2."""
    from dflash_lib.data.readers import DataError
    from dflash_lib.lab.report.demo import DemoReportError
    from dflash_lib.plan.buckets import BucketError
    from dflash_lib.plan.costmodel import CostModelError
    from dflash_lib.plan.sampler import SamplerError

    return (ConfigError, DataError, BucketError, SamplerError, CostModelError, DemoReportError, FileNotFoundError,
            NotADirectoryError, IsADirectoryError)


def _user_error_message(e: BaseException) -> str | None:
    """One line for a user error, also one a notebook cell raised under papermill; None for anything else."""
    errors = user_errors()
    if isinstance(e, errors):
        return _one_line(e)
    names, todo = set(), list(errors)
    while todo:  # the classes and their subclasses, by name (a cell's exception reaches us as its name)
        cls = todo.pop()
        names.add(cls.__name__)
        todo += cls.__subclasses__()
    if type(e).__name__ == "PapermillExecutionError" and getattr(e, "ename", None) in names:
        return f"{e.ename}: {' '.join(str(e.evalue).split())} (notebook cell [{e.exec_count}])"
    return None


def _one_line(e: BaseException) -> str:
    """The message of `e` on one line (an OSError as '<reason>: <path>')."""
    if isinstance(e, OSError) and e.filename is not None and e.strerror:
        return f"{e.strerror}: {e.filename}"
    return " ".join(str(e).split()) or type(e).__name__


def _params(pairs: list[list[str]] | None) -> dict[str, str]:
    """The -p KEY VALUE pairs of a command as a dict (values still text); a key given twice is refused."""
    out: dict[str, str] = {}
    for key, value in pairs or []:
        if key in out:
            raise ConfigError(f"parameter {key!r} given twice")
        out[key] = value
    return out


def _train(args: argparse.Namespace) -> int:
    """The `train` subcommand: 0 when the run finished or stopped cleanly on SIGTERM/SIGINT (resumable),
    1 when training failed (the message names the checkpoint, stage or rank at fault, or says no sample was fit
    for training; --debug: its traceback)."""
    from dflash_lib.rundir import load_config
    from dflash_lib.rundir.checkpoints import CheckpointError
    from dflash_lib.serve.connection import EngineError
    from dflash_lib.train.distributed import DistributedError
    from dflash_lib.train.feed import NothingTrainedError
    from dflash_lib.train.loop import train
    from dflash_lib.train.pipeline import PipelineError
    from dflash_lib.train.state import NonFiniteLossError

    params = _params(args.param)
    if args.fresh:
        if "fresh" in params:
            raise ConfigError("give --fresh or -p fresh, not both")
        params["fresh"] = True
    config = load_config(params, args.preset)
    main_rank = os.environ.get("RANK", "0") == "0"  # under torchrun only rank 0 reports
    try:
        summary = train(config, Path(args.run_dir) if args.run_dir else None, tag=args.tag)
    except (CheckpointError, DistributedError, EngineError, NonFiniteLossError, NothingTrainedError,
            PipelineError) as e:
        if args.debug:
            raise
        print(f"error: {type(e).__name__}: {_one_line(e)}", file=sys.stderr)
        return 1
    if main_rank:  # (a stop by signal or stop_at_step was reported by the trainer, with its checkpoint)
        print(summary.run_dir)
    return 0


def _regenerate(args: argparse.Namespace) -> int:
    """The `regenerate` subcommand: 0 when the run went through the source (rejected records are counted and
    listed in the rejects file; a rerun tries them again), 1 when the backend failed or regen_on_error abort
    stopped at a record (the message names it; what was written stays and a rerun resumes)."""
    from dflash_lib.config import from_params, preset
    from dflash_lib.regenerate import RegenerateError, regenerate

    params = _params(args.param)
    for key, value in (("source", args.source), ("backend", args.backend)):
        if value and key in params:
            raise ConfigError(f"give --{key} or -p {key}, not both")
        if value:
            params[key] = value
    config = from_params(params, preset(args.preset))
    try:
        report = regenerate(config, args.out)
    except RegenerateError as e:
        if args.debug:
            raise
        print(f"error: {_one_line(e)}", file=sys.stderr)
        return 1
    totals = report["totals"]
    if totals["rejected"]:
        print(f"warning: {totals['rejected']} records could not be regenerated, listed in {report['rejects']} "
              "(a rerun tries them again)", file=sys.stderr)
    print(json.dumps(dict(out=report["out"], **totals,
                          skipped_leading_assistant=report["run"]["skipped_leading_assistant"]), indent=None))
    return 0


P_HELP = "set a config field (`python -m dflash_lib params` lists every key, its type and default)"



def _p(parser: argparse.ArgumentParser, help: str = P_HELP) -> None:
    parser.add_argument("-p", "--param", nargs=2, action="append", metavar=("KEY", "VALUE"), help=help)


def _preset(parser: argparse.ArgumentParser, default: str, help: str = "a named preset or a preset file (.json)"
            ) -> None:
    parser.add_argument("--preset", default=default, help=help)


# -- each command: its arguments, then what it runs (returns the exit code; None = 0) ------------------------------
def _run_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("notebook", help="path, or a name under notebooks/: " + (", ".join(notebook_names()) or "(none found)"))
    _p(p)
    _preset(p, "", "start from a named preset (smoke, demo, default, qwen3-8b; default: the notebook's own, demo) or "
               "a preset file (.json); -p sets any config field")
    p.add_argument("--tag", default="", help="suffix for the run folder name")


def _run(args: argparse.Namespace) -> None:
    from dflash_lib.lab.runs import execute

    print(execute(args.notebook, _params(args.param), preset_name=args.preset, tag=args.tag))


def _train_args(p: argparse.ArgumentParser) -> None:
    _preset(p, "default", "a named preset or a preset file (.json, e.g. tune's)")
    p.add_argument("--run-dir", default="", help="run folder (default: a new runs/<id>_train/)")
    _p(p)
    p.add_argument("--tag", default="")
    p.add_argument("--fresh", action="store_true",
                   help="delete the run folder's checkpoints and outputs and start over (same as -p fresh true)")


def _capture_args(p: argparse.ArgumentParser) -> None:
    _preset(p, "default")
    p.add_argument("--out", required=True, help="the cache folder (a killed capture resumes into it)")
    _p(p)


def _capture(args: argparse.Namespace) -> None:
    from dflash_lib.rundir import load_config
    from dflash_lib.target.capture import run_capture

    doc = run_capture(load_config(_params(args.param), args.preset), args.out)
    print(json.dumps({"cache": args.out, "samples": doc["samples"], "shards": len(doc["shards"]),
                      "tokens": sum(s["tokens"] for s in doc["shards"]), "stored": doc["stored"],
                      "skipped": doc["skipped"]}))


def _engine_command_args(p: argparse.ArgumentParser) -> None:
    _preset(p, "default")
    p.add_argument("--dir", required=True, help="the folder the server writes the features to, as the trainer sees "
                   "it (target_engine_dir)")
    _p(p)


def _engine_command(args: argparse.Namespace) -> None:
    import torch

    from dflash_lib.rundir import load_config
    from dflash_lib.target.facts import read_facts
    from dflash_lib.target.served import engine_command

    config = load_config(_params(args.param), args.preset)
    cuda = config.train.device == "cuda" or (config.train.device == "auto" and torch.cuda.is_available())
    print(engine_command(config, read_facts(config.model), args.dir, torch.device("cuda" if cuda else "cpu")))


def _demo_args(p: argparse.ArgumentParser) -> None:
    _preset(p, "demo")
    p.add_argument("--tag", default="demo")
    p.add_argument("--target", default="auto", choices=("auto", "real", "trained", "preset"),
                   help="the chain's target: SmolLM2-135M-Instruct (real), a tiny Qwen3 trained on the corpus "
                   "(trained) or the preset's own (preset); auto: real for the demo preset, else preset")
    p.add_argument("--engine", default="auto", choices=("auto", "vllm", "none"),
                   help="notebook 05 also serves every drafter with vLLM (auto: when `make engine` made .venv-engine)")


def _demo(args: argparse.Namespace) -> None:
    from dflash_lib.lab.demo import run_demo

    print(run_demo(preset_name=args.preset, tag=args.tag, target=None if args.target == "auto" else args.target,
                   engine=None if args.engine == "auto" else args.engine))


def _demo_target_args(p: argparse.ArgumentParser) -> None:
    _preset(p, "demo", "the data (-p source, limit, max_len, ...) and model shape (hidden_size, target_layers) come "
               "from this preset")
    _p(p)
    p.add_argument("--set", nargs=2, action="append", metavar=("KEY", "VALUE"),
                   help="a training setting of lab.demo_target.DemoTargetSettings (vocab_size, steps, lr, ...)")


def _demo_target(args: argparse.Namespace) -> None:
    from dflash_lib.lab.demo_target import run_cli as demo_target

    print(demo_target(args.preset, _params(args.param), args.set))


def _evaluate_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--drafter", required=True, help="a saved drafter folder or a trainer run folder")
    p.add_argument("--target", default=None, help="'tiny' or a local Hugging Face model folder (default: the target "
                   "a trainer run folder records)")
    _p(p, "prompts N, max_new_tokens M, stop_at_eos, timing_warmup, or any config field")


def _evaluate(args: argparse.Namespace) -> int:
    from dflash_lib.evaluate import evaluate

    report = evaluate(args.drafter, args.target, _params(args.param))
    print(json.dumps(report.to_json()))
    failed = [line for line in (report.served.lines if report.served is not None else []) if line.startswith("FAIL")]
    if failed:  # scripts and CI see a served verdict that failed
        print(f"error: {len(failed)} served verdict(s) FAIL (printed above)", file=sys.stderr)
        return 1
    return 0


def _export_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("src", help="a trainer run folder (newest checkpoint, else drafter/), a checkpoint folder, or a "
                   "saved drafter folder")
    p.add_argument("out_dir", help="the folder to write (config.json, model.safetensors, README.md)")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"], help="weights dtype (default bf16)")
    p.add_argument("--force", action="store_true", help="write into a non-empty OUT_DIR, replacing its config.json, "
                   "model.safetensors and README.md (never into a run folder's own files)")


def _export(args: argparse.Namespace) -> None:
    from dflash_lib.export import export_source
    from dflash_lib.models.export import DTYPES

    try:
        print(export_source(args.src, args.out_dir, DTYPES[args.dtype], force=args.force))
    except (OSError, ValueError) as e:  # ConfigError is a ValueError; safetensors raises OSError/ValueError
        raise ConfigError(f"export {args.src}: {' '.join(str(e).split())}") from None


def _regenerate_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--source", required=True, help="a corpus: 'sharegpt' or a local .json/.jsonl/.parquet file")
    p.add_argument("--out", required=True, help="the JSONL to write (rerunning with it resumes)")
    p.add_argument("--backend", default=None, choices=["local", "openai"], help="default: -p backend, else local")
    _preset(p, "default")
    _p(p)


def _fit_args(p: argparse.ArgumentParser) -> None:
    """What dryrun and tune share: the preset, -p, the device and the projection's MFU."""
    _preset(p, "qwen3-8b", "a named preset or a preset file (default qwen3-8b)")
    _p(p)
    p.add_argument("--device-gib", type=float, default=80.0, help="device memory in GiB (H100 80, H200 141)")
    p.add_argument("--mfu", type=float, default=0.4, help="model FLOPs utilisation the projection assumes")


def _dryrun_args(p: argparse.ArgumentParser) -> None:
    _fit_args(p)
    p.add_argument("--corpus-samples", type=int, default=0,
                   help="samples the ETA is for (0 = the bundled corpus; the paper used ~800K)")
    p.add_argument("--reserve-gib", type=float, default=None,
                   help="GiB no tracker sees: CUDA context, cuBLAS/NCCL workspaces (default dryrun.Reserve's)")
    p.add_argument("--fragmentation", type=float, default=None,
                   help="allocator overhead, a fraction of the measured peak (default dryrun.Reserve's)")
    p.add_argument("--compare", action="store_true", help="also run the other drafter attention backends (dense, "
                   "blocks, flex)")
    p.add_argument("--world-size", type=int, default=1, help="GPUs: rank 0 of them measured under a fake process "
                   "group, the target laid over them by -p target_parallel (replicate | fsdp | auto)")
    p.add_argument("--link-gbs", type=float, default=450.0,
                   help="per-GPU interconnect bandwidth, one direction, GB/s (default NVLink 4 on H100/H200: 450)")


def _dryrun(args: argparse.Namespace) -> int:
    from dflash_lib.dryrun import run_cli

    return run_cli(args, _params(args.param))


def _tune_args(p: argparse.ArgumentParser) -> None:
    _fit_args(p)
    p.add_argument("--world-size", type=int, default=1, help="GPUs the throughput is projected for")
    p.add_argument("--out", default="", help="folder for tune.json and preset.json (default: a new runs/<id>_tune/)")


def _tune(args: argparse.Namespace) -> int:
    from dflash_lib.dryrun.search import run_cli as tune

    return tune(args, _params(args.param))


def _doctor_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("export_dir", help="the exported drafter folder (config.json, model.safetensors)")
    p.add_argument("--target", required=True, help="the local Hugging Face target folder it will be served with "
                   "(its config.json, tokenizer and chat template)")
    _p(p, "source CORPUS, doctor_samples N, tokenizer/template/thinking (the training data when the export does not "
          "record it), or any config field")


def _doctor(args: argparse.Namespace) -> int:
    from dflash_lib.doctor import run_cli as doctor

    return doctor(args.export_dir, args.target, _params(args.param))


def _engine_check_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--python", default=None, help="the Python whose vllm is the engine (default: "
                   "$DFLASH_ENGINE_PYTHON, else .venv-engine/bin/python)")
    p.add_argument("--log", default=None, help="keep the engine's log in this file (default: a temporary one)")


def _engine_check(args: argparse.Namespace) -> None:
    from dflash_lib.evaluate.engine_check import engine_check

    print(engine_check(args.python, log=args.log))


def _params_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("section", nargs="?", default="", help="one section only: " + ", ".join(SECTION_CLASSES))


def _params_cmd(args: argparse.Namespace) -> None:
    print(params_table(args.section))


@dataclass(frozen=True)
class Command:
    """One subcommand: its name (and former names), its help line, its arguments and what it runs."""

    name: str
    help: str
    arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int | None]
    aliases: tuple[str, ...] = ()


COMMANDS = (
    Command("run", "execute a notebook headlessly into a new runs/<id>/ folder", _run_args, _run),
    Command("train", "train a drafter outside notebooks (same config and validation); resumes from the run folder's "
            "newest checkpoint of the same config", _train_args, _train),
    Command("capture", "the target's feature layers of a token store, served by vLLM, written once into a cache "
            "folder that `train -p hidden_cache` reads (resumable)", _capture_args, _capture),
    Command("engine-command", "the command that starts a vLLM server by hand for a run's served target (-p "
            "target_engine_url URL -p target_engine_dir DIR): its layers, dtype, our connector", _engine_command_args,
            _engine_command),
    Command("demo", "the whole study on the bundled corpus: a real target (SmolLM2-135M-Instruct) and a small "
            "drafter", _demo_args, _demo),
    Command("demo-target", "build (or find cached) the demo's target: a small Qwen3 trained on the corpus over a "
            "shrunk vocabulary; prints its folder (a -p target and -p tokenizer DIR)", _demo_target_args, _demo_target),
    Command("evaluate", "speculative decoding of held-out prompts with a saved drafter: tau, acceptance per position, "
            "tokens/s vs plain greedy (last stdout line: JSON); with -p engine vllm exit 1 when a served verdict "
            "FAILs", _evaluate_args, _evaluate),
    Command("export", "write a drafter in the Hugging Face layout SGLang/vLLM load", _export_args, _export),
    Command("regenerate", "answer every assistant turn of a corpus again with the target (local model or an "
            "OpenAI-compatible server); resumable", _regenerate_args, _regenerate),
    Command("dryrun", "one training step of a preset at its real shapes in fake mode: peak memory and FLOPs of every "
            "bucket's worst batch; exit 1 when one does not fit --device-gib", _dryrun_args, _dryrun),
    Command("tune", "the fastest token budget, block budget and checkpointed drafter layers that fit --device-gib, "
            "proven by the dry run; writes tune.json and a preset file; exit 1 when nothing fits", _tune_args, _tune,
            aliases=("plan",)),  # plan: its former name
    Command("doctor", "check an exported drafter against its target as SGLang and vLLM will read it (config, layer "
            "ids, weights, chat template): one PASS/FAIL line per rule; exit 1 on a FAIL", _doctor_args, _doctor),
    Command("engine-check", "the serving engine (vLLM, `make engine`) serves a DFlash drafter here: one greedy answer "
            "of a tiny target, equal to the target's own, with drafts", _engine_check_args, _engine_check),
    Command("params", "every config field -p sets: key, type, default and what it is", _params_args, _params_cmd),
)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dflash_lib", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--debug", action="store_true", help="show the traceback of every error (also after the command)")
    sub = ap.add_subparsers(dest="cmd", required=True)
    for command in COMMANDS:
        parser = sub.add_parser(command.name, help=command.help, aliases=list(command.aliases))
        command.arguments(parser)
        parser.set_defaults(command=command)
        # `--debug` also after the command name
        parser.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    try:
        return args.command.run(args) or 0
    except Exception as e:
        from dflash_lib.serve.connection import EngineError

        message = _user_error_message(e)
        if not args.debug and message is None and isinstance(e, EngineError):  # an engine's failure
            print(f"error: EngineError: {_one_line(e)}", file=sys.stderr)
            return 1
        if args.debug or message is None:
            raise
        print(f"error: {message}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
