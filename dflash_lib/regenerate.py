"""Response regeneration: the target answers every assistant turn of a corpus again (DFlash trains on what the
target would say, docs/dflash.md).

`regenerate` rewrites each conversation of `source` turn by turn through a backend, `LocalBackend` (the target
in-process, batched `generate`) or `OpenAIBackend` (a chat-completions server: SGLang, vLLM), into JSONL in the
`messages` format, resumable, with `<OUT stem>.rejects.jsonl` and `<OUT stem>.report.json` beside it. Options,
resume and rejects: docs/data.md, "Regenerate the data with your target".
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Protocol, Sequence

import httpx
import torch

from dflash_lib.config import Config, ConfigError
from dflash_lib.data.benchmarks import render_prompt
from dflash_lib.data.readers import Conversation, load_conversations, resolve_source
from dflash_lib.data.templates import THINK_END, THINK_START, get_template
from dflash_lib.data.tokenizers import load_tokenizer
from dflash_lib.serve.connection import http_client
from dflash_lib.target.local import TargetModel

# An answer that opens like this is flagged as a refusal (kept, counted); the target's own words for "no".
REFUSAL = re.compile(r"^\s*(I'm sorry|I am sorry|I apologi[sz]e|Sorry, (but )?I|I can(no|')t (help|assist|do|provide)|"
                     r"I'm (not able|unable) to|I am (not able|unable) to|As an AI)", re.IGNORECASE)


class RegenerateError(RuntimeError):
    """Regeneration cannot go on (the server unreachable or refusing every request, a corrupt OUT)."""


class RecordError(RegenerateError):
    """One request failed for good (a 4xx about its content, retries exhausted); names the record."""

    def __init__(self, message: str, attempts: int) -> None:
        super().__init__(message)
        self.attempts = attempts  # requests sent for it


# The statuses a server or its proxy answers when busy or restarting: retried. Any other 4xx/5xx is not.
RETRY_STATUS = frozenset({429, 500, 502, 503, 504})
# The URL, the API key or the model name is wrong: every record would get the same, so the run stops.
FATAL_STATUS = frozenset({401, 403, 404, 405})


@dataclass(frozen=True)
class Answer:
    text: str  # the assistant message as stored (reasoning inline as <think>...</think> when kept)
    finish_reason: str  # "stop", "length", "content_filter", ...
    completion_tokens: int  # tokens the target generated for it, its end-of-turn id included (OpenAI's usage)
    refusal: bool = False  # the server said so (OpenAI `refusal` field / content_filter)


@dataclass(frozen=True)
class Failure:
    """A turn the backend could not answer: its record goes to the rejects file."""

    error: str  # one line naming the record
    attempts: int  # requests (or generate calls) made for it


class Backend(Protocol):
    def answer(self, prompts: Sequence[tuple[tuple[str, str], ...]],
               records: Sequence[int]) -> list[Answer | Failure]:
        """One answer (or Failure) per conversation-so-far (turns ending before the assistant turn to write)."""
        ...


def is_refusal(answer: Answer) -> bool:
    text = answer.text.split(THINK_END)[-1] if THINK_END in answer.text else answer.text
    return answer.refusal or answer.finish_reason == "content_filter" or not text.strip() or bool(REFUSAL.match(text))


# ---------------------------------------------------------------------------------------------------------
# Local backend


class LocalBackend:
    """The target in this process: prompts rendered by the data template (`DataConfig.template`, `thinking`),
    left-padded into one batch, and `generate` (KV cache) greedy or sampled; stops at the tokenizer's eos."""

    def __init__(self, config: Config, target=None, tokenizer=None, device: str = "cpu") -> None:
        self.cfg = config.regenerate
        self.tok = tokenizer or load_tokenizer(config.data.tokenizer)
        self.template = get_template(config.data.template, self.tok, config.data.thinking)
        self.target = target or TargetModel.from_model_config(config.model, device=device)
        self.model = self.target.model
        self.max_positions = int(getattr(self.model.config, "max_position_embeddings", 1 << 30))
        self._torch = torch

    def prompt_ids(self, turns: tuple[tuple[str, str], ...]) -> list[int]:
        return render_prompt(self.tok, self.template, turns)

    def answer(self, prompts: Sequence[tuple[tuple[str, str], ...]],
               records: Sequence[int]) -> list[Answer | Failure]:
        cfg = self.cfg
        ids = [self.prompt_ids(p) for p in prompts]
        limit = self.max_positions - cfg.max_new_tokens
        answers: list[Answer | Failure | None] = [
            Failure(f"record {records[i]}: prompt of {len(x)} tokens + max_new_tokens {cfg.max_new_tokens} exceeds "
                    f"the target's {self.max_positions} positions (lower max_new_tokens or max_turns)", 0)
            if len(x) > limit else None for i, x in enumerate(ids)]
        fits = [i for i, a in enumerate(answers) if a is None]
        for group in length_groups([len(ids[i]) for i in fits], cfg.gen_tokens):
            group = [fits[j] for j in group]
            for i, answer in zip(group, self._generate([ids[i] for i in group], records[group[0]])):
                answers[i] = answer
        return answers  # type: ignore[return-value]

    def _generate(self, ids: list[list[int]], seed_record: int) -> list[Answer]:
        """One batched `generate` over prompts `ids` (left-padded); `seed_record` seeds sampling."""
        torch, cfg = self._torch, self.cfg
        width = max(len(x) for x in ids)
        pad = self.tok.pad_id
        input_ids = torch.tensor([[pad] * (width - len(x)) + x for x in ids], device=self.target.device)  # (N, W)
        mask = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in ids], device=self.target.device)  # (N, W)
        sample = cfg.temperature > 0
        kwargs = dict(do_sample=True, temperature=cfg.temperature, top_p=cfg.top_p) if sample else dict(
            do_sample=False, temperature=None, top_p=None, top_k=None)
        if sample:  # the same records sample the same answers on a resumed run
            torch.manual_seed(1_000_003 * int(seed_record) + len(ids))
        with torch.no_grad():  # the per-document attention attends under transformers' padding mask
            out = self.model.generate(input_ids=input_ids, attention_mask=mask, max_new_tokens=cfg.max_new_tokens,
                                      min_new_tokens=cfg.min_new_tokens or None, eos_token_id=self.tok.eos_id,
                                      pad_token_id=pad, **kwargs)  # (N, W + new)
        answers = []
        for row in out[:, width:].tolist():
            stop = row.index(self.tok.eos_id) if self.tok.eos_id in row else -1
            gen = row[:stop] if stop >= 0 else row
            answers.append(Answer(self.tok.decode(gen), "stop" if stop >= 0 else "length", len(gen) + (stop >= 0)))
        return answers


def length_groups(lengths: Sequence[int], max_tokens: int) -> list[list[int]]:
    """Indices of `lengths` sorted by length (stable), cut into consecutive groups whose rows x longest length
    stays within `max_tokens` (a group holds at least one index, however long)."""
    groups: list[list[int]] = []
    for i in sorted(range(len(lengths)), key=lambda j: lengths[j]):
        if groups and (len(groups[-1]) + 1) * lengths[i] <= max_tokens:
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


# ---------------------------------------------------------------------------------------------------------
# OpenAI-compatible backend


class OpenAIBackend:
    """A chat-completions endpoint (`base_url`/chat/completions). `thinking` goes to the server's chat template
    as `chat_template_kwargs.enable_thinking` (SGLang and vLLM pass it on; "keep" sends nothing). A reasoning
    parser's separate `reasoning_content` is put back inline as <think>...</think> unless thinking is "off".
    Transport errors and RETRY_STATUS are retried with doubling backoff; a record that still fails, or gets
    another status, is a Failure (rejected); FATAL_STATUS, or a refused connection after the retries, raises."""

    def __init__(self, config: Config) -> None:
        self.cfg = config.regenerate
        self.thinking = config.data.thinking
        self.url = self.cfg.base_url.rstrip("/")
        # One pooled client for every request thread (httpx.Client is thread-safe): a connection kept alive per
        # conversation in flight, so no request waits for a free one. Its key: an engine started here's, else
        # $OPENAI_API_KEY (servers started with --api-key); no proxy for a loopback address.
        pool = httpx.Limits(max_connections=self.cfg.concurrency, max_keepalive_connections=self.cfg.concurrency)
        self.client = http_client(self.url, self.cfg.request_timeout_s, env="OPENAI_API_KEY", limits=pool,
                                  follow_redirects=True)
        try:
            self.model = self.cfg.model or self._first_model()
        except BaseException:
            self.client.close()
            raise

    def close(self) -> None:
        """Close the pooled connections."""
        self.client.close()

    def _request(self, path: str, body: dict | None, what: str) -> dict:
        """The JSON answer of GET (body None) or POST `path`; RecordError when this request fails for good,
        RegenerateError when no request can succeed (FATAL_STATUS, the server refusing connections).
        (httpx's own transport retries cover connection errors only, at their own pace: not RETRY_STATUS.)"""
        cfg = self.cfg
        for attempt in range(cfg.retries + 1):
            refused = False
            try:
                resp = self.client.request("GET" if body is None else "POST", self.url + path, json=body)
                if resp.is_success:
                    return resp.json()
                detail = " ".join(resp.content[:500].decode(errors="replace").split())
                message = f"{what}: HTTP {resp.status_code} from {self.url + path}: {detail}"
                if resp.status_code in FATAL_STATUS:
                    raise RegenerateError(message)
                if resp.status_code not in RETRY_STATUS:
                    raise RecordError(message, attempt + 1)
                last = f"HTTP {resp.status_code}: {detail}"
            except (httpx.TransportError, json.JSONDecodeError) as e:  # (timeouts are transport errors)
                refused = _refused(e)
                last = f"{type(e).__name__}: {e}"
            if attempt < cfg.retries:
                time.sleep(cfg.retry_backoff_s * 2 ** attempt)
        message = f"{what}: {self.url + path} failed {cfg.retries + 1} times, last: {last}"
        if refused:  # the server is gone: every other record would wait out the same retries
            raise RegenerateError(message)
        raise RecordError(message, cfg.retries + 1)

    def _first_model(self) -> str:
        models = self._request("/models", None, "listing models").get("data") or []
        if not models:
            raise RegenerateError(f"{self.url}/models lists no model; give -p model NAME")
        return str(models[0]["id"])

    def complete(self, turns: tuple[tuple[str, str], ...], what: str) -> Answer:
        cfg = self.cfg
        if not any(role == "user" for role, _ in turns):  # _plan never asks this; a server would answer 400
            raise RecordError(f"{what}: no user turn to answer (refusing to send {len(turns)} messages)", 0)
        body: dict[str, Any] = dict(model=self.model, messages=[{"role": r, "content": c} for r, c in turns],
                                    max_tokens=cfg.max_new_tokens, temperature=cfg.temperature, top_p=cfg.top_p)
        if cfg.min_new_tokens:
            body["min_tokens"] = cfg.min_new_tokens  # SGLang's and vLLM's extension of the OpenAI API
        if self.thinking != "keep":
            body["chat_template_kwargs"] = {"enable_thinking": self.thinking == "on"}
        doc = self._request("/chat/completions", body, what)
        try:
            choice = doc["choices"][0]
            msg = choice["message"]
        except (KeyError, IndexError, TypeError):
            raise RecordError(f"{what}: the server's answer has no choices[0].message: {str(doc)[:300]}", 1) from None
        text = msg.get("content") or ""
        reasoning = msg.get("reasoning_content") or msg.get("reasoning") or ""
        if reasoning and self.thinking != "off":
            text = f"{THINK_START}\n{reasoning.strip()}\n{THINK_END}\n\n{text.lstrip()}"
        tokens = int((doc.get("usage") or {}).get("completion_tokens") or 0)
        return Answer(text, str(choice.get("finish_reason") or "stop"), tokens, bool(msg.get("refusal")))

    def answer(self, prompts: Sequence[tuple[tuple[str, str], ...]],
               records: Sequence[int]) -> list[Answer | Failure]:
        answers: list[Answer | Failure] = []
        for p, r in zip(prompts, records):
            try:
                answers.append(self.complete(p, f"record {r}"))
            except RecordError as e:
                answers.append(Failure(str(e), e.attempts))
        return answers


def _refused(error: BaseException | None) -> bool:
    """Whether `error` was caused by a refused connection (httpx keeps the socket's error in the chain)."""
    while error is not None:
        if isinstance(error, ConnectionRefusedError):
            return True
        error = error.__cause__ or error.__context__
    return False


# ---------------------------------------------------------------------------------------------------------
# Turn-by-turn driver


@dataclass
class _Work:
    conv: Conversation
    turns: list[tuple[str, str]]  # the conversation being rewritten (assistant turns replaced as they come)
    todo: list[int]  # indices of the assistant turns to answer, in order
    leading: int = 0  # assistant turns before the first user turn, kept verbatim (no prompt to answer)
    answers: list[Answer] = field(default_factory=list)
    failure: Failure | None = None  # set when a turn could not be answered: the record is rejected


def leading_assistant_turns(conv: Conversation) -> int:
    """Assistant turns of `conv` before its first user turn (0 when a user speaks before every assistant)."""
    first_user = next((i for i, (role, _) in enumerate(conv.turns) if role == "user"), len(conv.turns))
    return sum(role == "assistant" for role, _ in conv.turns[:first_user])


def _plan(conv: Conversation, max_turns: int) -> _Work:
    turns = list(conv.turns)
    assistant = [i for i, (role, _) in enumerate(turns) if role == "assistant"]  # (readers guarantee one)
    leading = leading_assistant_turns(conv)
    todo = assistant[leading:][:max_turns] if max_turns else assistant[leading:]
    # turns after the last assistant turn answered are dropped: nothing answers them
    return _Work(conv, turns[: (todo or assistant)[-1] + 1], todo, leading)


def regenerate_batch(backend: Backend, convs: Sequence[Conversation], max_turns: int = 0) -> list[_Work]:
    """Answer every planned assistant turn of `convs` in waves: wave k asks the backend for the k-th answer of
    every conversation that has one (one batched call), so later turns see the regenerated earlier ones."""
    works = [_plan(c, max_turns) for c in convs]
    while True:
        active = [w for w in works if w.failure is None and len(w.answers) < len(w.todo)]
        if not active:
            return works
        at = [w.todo[len(w.answers)] for w in active]
        answers = backend.answer([tuple(w.turns[:i]) for w, i in zip(active, at)], [w.conv.record for w in active])
        for w, i, a in zip(active, at, answers):
            if isinstance(a, Failure):
                w.failure = a
                continue
            w.turns[i] = ("assistant", a.text)
            w.answers.append(a)


def _record_line(work: _Work, count_tokens) -> bytes:
    source = [work.conv.turns[i][1] for i in work.todo]
    finish = [a.finish_reason for a in work.answers]
    regen = dict(finish=finish, truncated="length" in finish, refused=any(is_refusal(a) for a in work.answers),
                 leading_kept=work.leading,
                 completion_tokens=sum(a.completion_tokens for a in work.answers),
                 source_tokens=sum(count_tokens(t) for t in source),
                 answer_tokens=sum(count_tokens(a.text) for a in work.answers))
    rec = dict(id=work.conv.id, record=work.conv.record,
               messages=[{"role": r, "content": c} for r, c in work.turns], regen=regen)
    return (json.dumps(rec, ensure_ascii=False) + "\n").encode()


# ---------------------------------------------------------------------------------------------------------
# Output file: resume and atomic appends


def scan_output(path: Path) -> tuple[set[int], int]:
    """(source indices already written, bytes of the complete lines). Bytes after the last newline are a torn
    line (a kill mid-write): not counted; the caller cuts them off and redoes that record. A complete line
    that does not parse is not a kill's doing: RegenerateError."""
    done: set[int] = set()
    if not path.is_file():
        return done, 0
    lines = path.read_bytes().split(b"\n")  # lines[-1]: what follows the last newline (b"" unless torn)
    good = 0
    for n, line in enumerate(lines[:-1]):
        try:
            done.add(int(json.loads(line)["record"]))
        except (ValueError, KeyError, TypeError):
            raise RegenerateError(f"{path}: line {n + 1} is not a record of this command; refusing to append "
                                  "(give another --out)") from None
        good += len(line) + 1
    return done, good


class _Appender:
    """OUT opened for appending; each record goes down in one os.write of its whole line."""

    def __init__(self, path: Path, keep_bytes: int) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.is_file() and path.stat().st_size != keep_bytes:
            os.truncate(path, keep_bytes)  # cut the torn tail
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    def write(self, line: bytes) -> None:
        n = os.write(self.fd, line)
        if n != len(line):  # a short write leaves a torn line that the next run redoes
            raise RegenerateError(f"short write ({n} of {len(line)} bytes)")

    def close(self) -> None:
        os.fsync(self.fd)
        os.close(self.fd)


# ---------------------------------------------------------------------------------------------------------
# The command


@dataclass
class Progress:
    """records/s and generated tokens/s of this invocation (what the progress bar shows)."""

    records: int = 0
    tokens: int = 0
    start: float = field(default_factory=time.perf_counter)

    def rates(self) -> tuple[float, float]:
        dt = max(time.perf_counter() - self.start, 1e-9)
        return self.records / dt, self.tokens / dt


def report_path(out: str | Path) -> Path:
    out = Path(out)
    return out.with_name(out.stem + ".report.json")


def rejects_path(out: str | Path) -> Path:
    """`<OUT stem>.rejects.jsonl`: one line per record that could not be regenerated,
    {"record": <source index>, "id", "error": one line, "attempts": requests made}; absent when there is none."""
    out = Path(out)
    return out.with_name(out.stem + ".rejects.jsonl")


def read_rejects(path: Path) -> dict[int, dict]:
    """Source index -> its latest line of the rejects file `path` ({} when absent). A line that does not parse
    (a kill mid-write) is dropped: its record is not in OUT either, so the next run tries it again."""
    rejects: dict[int, dict] = {}
    if path.is_file():
        for line in path.read_bytes().split(b"\n"):
            try:
                entry = json.loads(line)
                rejects[int(entry["record"])] = entry
            except (ValueError, KeyError, TypeError):
                continue
    return rejects


def _prune_rejects(path: Path, written: set[int]) -> int:
    """Rewrite the rejects file with one line per record still rejected (not in `written`, the source indices
    in OUT), in source order; remove it when none is left. Returns how many are left."""
    rejects = read_rejects(path)
    left = [rejects[i] for i in sorted(rejects) if i not in written]
    if left:
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text("".join(json.dumps(e, ensure_ascii=False) + "\n" for e in left))
        os.replace(tmp, path)
    elif path.is_file():
        path.unlink()
    return len(left)


def _append_reject(path: Path, work: _Work) -> None:
    entry = dict(record=work.conv.record, id=work.conv.id, error=work.failure.error, attempts=work.failure.attempts)
    with open(path, "ab") as f:  # rare: opened per reject, one write of the whole line
        f.write((json.dumps(entry, ensure_ascii=False) + "\n").encode())


def _settings(config: Config, backend_name: str) -> dict[str, Any]:
    r = config.regenerate
    return dict(source=config.data.source, backend=backend_name, template=config.data.template,
                thinking=config.data.thinking, tokenizer=config.data.tokenizer,
                target=config.model.target if backend_name == "local" else r.model or r.base_url,
                max_new_tokens=r.max_new_tokens, min_new_tokens=r.min_new_tokens, temperature=r.temperature,
                top_p=r.top_p, max_turns=r.max_turns, leading_assistant=r.regen_leading_assistant,
                gen_batch=r.gen_batch if backend_name == "local" else 0,  # (local batches decide the numerics)
                gen_tokens=r.gen_tokens if backend_name == "local" else 0)


def _source(source: str, limit: int, stats: dict) -> Iterator[Conversation]:
    stream = load_conversations(source, limit)
    yield from stream
    stats["source_report"] = stream.report.to_dict()


def _without_leading_assistant(convs: Iterator[Conversation], counts: dict) -> Iterator[Conversation]:
    """`convs` less those with an assistant turn before their first user turn (counted, never written)."""
    for conv in convs:
        if leading_assistant_turns(conv):
            counts["skipped_leading_assistant"] += 1
        else:
            yield conv


def regenerate(config: Config, out: str | Path, backend: Backend | None = None, progress: bool = True,
               stop_after: int = 0) -> dict[str, Any]:
    """Regenerate `config.data.source` (first `config.data.limit` records) into `out`; returns the report.

    backend: None = build the one `config.regenerate.backend` names. stop_after: stop after writing this many
    records (0 = all; what a kill would do, without the kill). Resumes from what `out` holds. A record that
    fails goes to `rejects_path(out)` (or, with regen_on_error abort, raises RegenerateError after it is listed
    there); whatever ends the run, the report's `status` says so (`failed` with the error on an exception)."""
    from tqdm.auto import tqdm  # only the progress bar needs it

    out = Path(out)
    resolve_source(config.data.source)  # a missing or unreadable corpus is refused before OUT or its report exist
    r = config.regenerate
    settings = _settings(config, r.backend)
    rep_file, rej_file = report_path(out), rejects_path(out)
    if out.is_file() and rep_file.is_file():
        before = json.loads(rep_file.read_text()).get("settings", {})
        changed = {k: (before.get(k), v) for k, v in settings.items() if before.get(k) != v}
        if changed:
            raise ConfigError(f"{out} was written with other settings {changed} (old, new); "
                              f"give another --out or delete it")
    done, keep = scan_output(out)
    torn = (out.stat().st_size - keep) if out.is_file() else 0  # bytes of a torn last line, redone below
    built = backend is None  # (an openai backend built here is closed at the end)
    if built:
        backend = LocalBackend(config) if r.backend == "local" else OpenAIBackend(config)
    tok = getattr(backend, "tok", None)
    if tok is None:
        tok = load_tokenizer(config.data.tokenizer)
    count = lambda text: len(tok.encode_texts([text], [None])[0][0])  # noqa: E731 (tokens of plain text)
    stats: dict[str, Any] = {}
    counts = dict(rejected_now=0, skipped_leading_assistant=0)
    written = set(done)  # source indices in OUT
    status, error, works, appender = "failed", "", None, None
    # a clean rejects file to append to; its records are not in `done`, so they are tried again below
    _write_report(rep_file, settings, dict(status="running"), out, _prune_rejects(rej_file, written))
    prog = Progress()
    bar = tqdm(total=config.data.limit or None, initial=len(done), unit="rec", desc="regenerate",
               disable=not progress, smoothing=0.1)
    try:
        appender = _Appender(out, keep)
        convs = _source(config.data.source, config.data.limit, stats)
        if r.regen_leading_assistant == "skip":
            convs = _without_leading_assistant(convs, counts)
        if isinstance(backend, OpenAIBackend):
            works = _run_concurrent(backend, (c for c in convs if c.record not in done), r)
        else:
            works = _run_batched(backend, convs, done, r.gen_batch, r.max_turns)
        for work in works:
            bar.update(1)
            if work.failure is not None:
                _append_reject(rej_file, work)
                counts["rejected_now"] += 1
                if r.regen_on_error == "abort":
                    raise RegenerateError(f"{work.failure.error} (regen_on_error abort; the records before it "
                                          f"are written, a rerun resumes)")
                continue
            appender.write(_record_line(work, count))
            written.add(work.conv.record)
            prog.records += 1
            prog.tokens += sum(a.completion_tokens for a in work.answers)
            rec_s, tok_s = prog.rates()
            bar.set_postfix_str(f"{rec_s:.2f} rec/s, {tok_s:.0f} tok/s", refresh=False)
            if stop_after and prog.records >= stop_after:
                break
        status = "stopped" if stop_after and prog.records >= stop_after else "complete"
    except BaseException as e:  # (KeyboardInterrupt too: the report must not say "running")
        error = f"{type(e).__name__}: {' '.join(str(e).split())}"
        raise
    finally:
        if works is not None:
            works.close()  # a stopped generator cancels what is queued and joins the request threads
        bar.close()
        if built and isinstance(backend, OpenAIBackend):
            backend.close()
        if appender is not None:
            appender.close()
        seconds = time.perf_counter() - prog.start
        run = dict(status=status, **(dict(error=error) if error else {}), written_now=prog.records,
                   generated_tokens_now=prog.tokens, seconds=round(seconds, 3),
                   records_per_s=prog.records / max(seconds, 1e-9), tokens_per_s=prog.tokens / max(seconds, 1e-9),
                   already_done=len(done), torn_bytes_cut=torn, **counts, source_report=stats.get("source_report"))
        report = _write_report(rep_file, settings, run, out, _prune_rejects(rej_file, written))
    return report


def _run_batched(backend: Backend, convs: Iterator[Conversation], done: set[int], batch: int,
                 max_turns: int) -> Iterator[_Work]:
    """Batches of `batch` CONSECUTIVE valid conversations, the same ones on every run: a batch that a stopped
    run wrote in part is generated again whole and only its missing records are yielded, because a batch's
    padding changes the numerics, and a random target's greedy answers with them."""
    chunk: list[Conversation] = []
    for conv in convs:
        chunk.append(conv)
        if len(chunk) == batch:
            yield from _answer_missing(backend, chunk, done, max_turns)
            chunk = []
    if chunk:
        yield from _answer_missing(backend, chunk, done, max_turns)


def _answer_missing(backend: Backend, chunk: list[Conversation], done: set[int], max_turns: int) -> Iterator[_Work]:
    if all(c.record in done for c in chunk):
        return
    yield from (w for w in regenerate_batch(backend, chunk, max_turns) if w.conv.record not in done)


def _run_concurrent(backend: OpenAIBackend, pending: Iterator[Conversation], cfg) -> Iterator[_Work]:
    """Conversations on `concurrency` threads (each one's turns in order), yielded in SOURCE order: at most
    2 x concurrency conversations are in flight or waiting for an earlier one. A record that failed comes out
    as a work with its `failure`; on a fatal error the conversations before the failing one are still yielded
    (written), then the error is raised."""
    window = 2 * cfg.concurrency
    with cf.ThreadPoolExecutor(max_workers=cfg.concurrency, thread_name_prefix="regen") as pool:
        queue: list[cf.Future] = []  # source order
        exhausted = False
        try:
            while queue or not exhausted:
                while not exhausted and len(queue) < window:
                    conv = next(pending, None)
                    if conv is None:
                        exhausted = True
                        break
                    queue.append(pool.submit(regenerate_batch, backend, [conv], cfg.max_turns))
                if not queue:
                    break
                head = queue.pop(0)
                yield head.result()[0]  # raises the worker's error, in source order
        finally:
            for f in queue:
                f.cancel()


def _write_report(path: Path, settings: dict, run: dict, out: Path, rejected: int) -> dict[str, Any]:
    """The report over the WHOLE output file (earlier invocations included) plus this invocation's figures;
    `rejected`: the records in the rejects file now."""
    totals = dict(records=0, assistant_turns=0, truncated=0, refused=0, leading_kept=0, source_tokens=0,
                  answer_tokens=0, completion_tokens=0, rejected=rejected)
    if out.is_file():
        for line in out.read_bytes().split(b"\n"):
            try:
                rec = json.loads(line)
                g = rec["regen"]
            except (ValueError, KeyError, TypeError):
                continue
            totals["records"] += 1
            totals["assistant_turns"] += len(g["finish"])
            totals["truncated"] += bool(g["truncated"])
            totals["refused"] += bool(g["refused"])
            totals["leading_kept"] += int(g.get("leading_kept", 0))  # (absent in files of older versions)
            for k in ("source_tokens", "answer_tokens", "completion_tokens"):
                totals[k] += int(g[k])
    turns = max(totals["assistant_turns"], 1)
    doc = dict(out=str(out), rejects=str(rejects_path(out)), settings=settings, totals=totals,
               mean_answer_tokens_before=totals["source_tokens"] / turns,
               mean_answer_tokens_after=totals["answer_tokens"] / turns, run=run)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(doc, indent=1))
    os.replace(tmp, path)
    return doc
