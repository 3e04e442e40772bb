"""Fuzzing: parameter validation and the corpus readers meet random keys, values, bytes and JSON. Only the clear
error classes (ConfigError, DataError) or clean, counted skips are allowed; never another exception, a hang, or a
half-built token store that looks complete. Bugs found in modules owned elsewhere are pinned by strict xfails
at the end (they start failing, as a reminder to drop the marker, once fixed)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dflash_lib.config import FLAT_FIELDS, Config, ConfigError, coerce, from_params
from dflash_lib.data import DataError, build_token_store, load_conversations
from dflash_lib.data import readers
from dflash_lib.data import store as store_mod

REPO = Path(__file__).resolve().parent.parent
FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])

# -- parameters ------------------------------------------------------------------------------------------------

scalars = st.one_of(st.none(), st.booleans(), st.integers(-10 ** 300, 10 ** 300), st.floats(), st.text(max_size=30),
                    st.binary(max_size=8))
values = st.one_of(scalars, st.lists(scalars, max_size=5), st.dictionaries(st.text(max_size=5), scalars, max_size=3),
                   st.tuples(scalars, scalars))
keys = st.one_of(st.sampled_from(sorted(FLAT_FIELDS)), st.text(max_size=12))


@pytest.mark.timeout(120)
@FUZZ
@given(st.dictionaries(keys, values, max_size=6))
def test_from_params_accepts_or_refuses_with_config_error_only(params):
    try:
        config = from_params(params)
    except ConfigError as e:
        assert str(e)  # a message, naming the parameter
        return
    assert isinstance(config, Config)
    assert isinstance(from_params(config.to_params()), Config)  # what was accepted stays valid


@pytest.mark.timeout(120)
@FUZZ
@given(key=st.sampled_from(sorted(FLAT_FIELDS)), text=st.text(max_size=40))
def test_command_line_strings_parse_or_refuse_with_config_error_only(key, text):
    try:
        value = coerce(key, text)
    except ConfigError as e:
        assert key in str(e)
        return
    assert coerce(key, value) == value or value != value  # idempotent (NaN aside)


# -- corpus readers --------------------------------------------------------------------------------------------

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-10 ** 12, 10 ** 12) | st.floats(allow_nan=False) | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12)
turns = st.fixed_dictionaries(
    {}, optional={"from": st.sampled_from(["human", "gpt", "system", "robot"]) | json_values,
                  "role": st.sampled_from(["user", "assistant"]) | json_values,
                  "value": st.text(max_size=30) | json_values, "content": st.text(max_size=30)})
conversations = st.fixed_dictionaries(
    {}, optional={"conversations": st.lists(turns, max_size=4) | json_values,
                  "messages": st.lists(turns, max_size=4), "id": json_values})
records = st.lists(st.one_of(conversations, json_values), max_size=8)


def read(path: Path) -> tuple[int | DataError, readers.LoadReport]:
    """(conversations read, report), or (the DataError raised, the report so far); anything else fails the test."""
    stream = load_conversations(str(path))
    try:
        n = sum(1 for _ in stream)
    except DataError as e:
        assert str(path) in str(e) or path.name in str(e)
        return e, stream.report
    report = stream.report
    assert report.records_kept == n and report.records_seen == n + sum(report.skipped.values())
    assert set(report.skipped) <= set(readers.SKIP_REASONS)
    return n, report


def _check_jsonl(data: bytes, out: int | DataError, report: readers.LoadReport) -> None:
    """Every non-blank line is one record; each that json cannot decode is a BAD_ENCODING skip, each it cannot
    parse an INVALID_JSON skip."""
    lines = [line for line in data.split(b"\n") if line.strip()]
    invalid = bad_encoding = 0
    for line in lines:
        try:
            json.loads(line)
        except UnicodeDecodeError:
            bad_encoding += 1
        except (ValueError, RecursionError):
            invalid += 1
    assert report.records_seen == len(lines) and report.skipped.get(readers.INVALID_JSON, 0) == invalid
    assert report.skipped.get(readers.BAD_ENCODING, 0) == bad_encoding
    if isinstance(out, DataError):
        assert f"no usable conversation among {len(lines)} records" in str(out)


@pytest.mark.timeout(120)
@FUZZ
@given(data=st.binary(max_size=2000), suffix=st.sampled_from([".json", ".jsonl", ".parquet"]))
def test_readers_on_random_bytes(tmp_path_factory, data, suffix):
    path = tmp_path_factory.mktemp("bytes") / f"corpus{suffix}"
    path.write_bytes(data)
    out, report = read(path)
    if suffix == ".jsonl":
        _check_jsonl(data, out, report)
    elif suffix == ".parquet":  # no valid Parquet file without the PAR1 magic at both ends
        assert isinstance(out, DataError) and "cannot read as Parquet" in str(out)
    else:
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as e:
            if not (e.end == len(data) and e.reason == "unexpected end of data"):  # a character cut by the end
                assert isinstance(out, DataError) and "not valid UTF-8" in str(out)
                return
            text = data[:e.start].decode("utf-8")
        if not text.lstrip().startswith("["):
            assert isinstance(out, DataError) and "expected a JSON array" in str(out)
            return
        try:
            whole = json.loads(text)
        except (ValueError, RecursionError):
            whole = None
        if isinstance(whole, list):  # a complete array: every element is a record
            assert report.records_seen == len(whole) and report.trailing_bytes == len(data) - len(text.encode())
        assert not isinstance(out, DataError) or "no usable conversation" in str(out) or "cannot be parsed" in str(out)


@pytest.mark.timeout(120)
@FUZZ
@given(recs=records, cut=st.floats(0.0, 1.0), truncate=st.booleans())
def test_readers_on_random_json_whole_or_truncated(tmp_path_factory, recs, cut, truncate):
    folder = tmp_path_factory.mktemp("json")
    pieces = [json.dumps(r).encode() for r in recs]
    array = json.dumps(recs).encode()
    assert array == b"[" + b", ".join(pieces) + b"]"
    ends = [1 + sum(len(p) for p in pieces[:i + 1]) + 2 * i for i in range(len(recs))]  # past each record
    lines = b"".join(p + b"\n" for p in pieces)
    c = int(len(array) * cut) if truncate else len(array)
    path = folder / "corpus.json"
    path.write_bytes(array[:c])
    out, report = read(path)
    if c == 0:
        assert isinstance(out, DataError) and "expected a JSON array" in str(out)
    else:
        # complete: records that end before the cut; one touching the cut only if a final digit cannot be lost
        n = sum(e < c or (e == c and not pieces[i][-1:].isdigit()) for i, e in enumerate(ends))
        rest = array[ends[n - 1] if n else 1:c].lstrip(b", ")
        tail = len(rest[1:]) if rest.startswith(b"]") else len(rest)
        if report.records_seen == n + 1:  # a number cut after '.', 'e' or '-' still parses as a shorter number
            assert pieces[n][:1] in b"-0123456789" and c < ends[n]
        else:
            assert (report.records_seen, report.trailing_bytes) == (n, tail)
        if not truncate or c == len(array):
            assert (report.records_seen, report.trailing_bytes) == (len(recs), 0)
        if isinstance(out, DataError):
            assert f"no usable conversation among {report.records_seen} records" in str(out)
    path = folder / "corpus.jsonl"
    data = lines[:int(len(lines) * cut)] if truncate else lines
    path.write_bytes(data)
    out, report = read(path)
    _check_jsonl(data, out, report)
    if not truncate:
        assert report.records_seen == len(recs)  # every record accounted for: kept or skipped by reason


def _parquet(path: Path, n: int = 50) -> Path:
    rows = [{"id": str(i), "conversations": [{"from": "human", "value": f"question {i}"},
                                             {"from": "gpt", "value": f"answer {i}"}]} for i in range(n)]
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


@pytest.mark.timeout(120)
@FUZZ
@given(cut=st.floats(0.0, 0.999))
def test_truncated_parquet_is_a_data_error(tmp_path_factory, cut):
    path = _parquet(tmp_path_factory.mktemp("pq") / "corpus.parquet")
    data = path.read_bytes()
    path.write_bytes(data[:int(len(data) * cut)])  # the footer is gone
    out, _ = read(path)
    assert isinstance(out, DataError) and "cannot read as Parquet" in str(out)


# -- token stores: a failed or killed build leaves nothing that looks complete --------------------------------------


def _complete_stores(cache: Path) -> list[Path]:
    return [p for p in cache.rglob(store_mod.META_FILE)] if cache.exists() else []


def test_a_corrupt_corpus_mid_build_leaves_no_store(tmp_path, monkeypatch):
    """Valid records, then bytes that are not UTF-8: the reader fails after the first records were tokenized and
    written (tiny read and tokenize chunks make sure of it)."""
    monkeypatch.setattr(readers, "READ_CHUNK_BYTES", 512)
    monkeypatch.setattr(store_mod, "CHUNK_CHARS", 64)
    good = [{"conversations": [{"from": "human", "value": f"q{i} " * 10}, {"from": "gpt", "value": f"a{i} " * 10}]}
            for i in range(40)]
    body = json.dumps(good).encode()
    path = tmp_path / "corpus.json"
    path.write_bytes(body[:-1] + b", \xff\xfe{\"conversations\": []}]")
    cache = tmp_path / "cache"
    with pytest.raises(DataError, match="not valid UTF-8"):
        build_token_store(str(path), max_len=256, cache_dir=cache, progress=False, workers=1)
    assert _complete_stores(cache) == [] and list(cache.iterdir()) == []  # not even a temp directory remains
    path.write_bytes(body)  # repaired: the same call now builds and opens a complete store
    store = build_token_store(str(path), max_len=256, cache_dir=cache, progress=False, workers=1)
    assert len(store) == 40 and _complete_stores(cache) == [store.path / store_mod.META_FILE]


BUILD = """
import sys
from dflash_lib.data import build_token_store
build_token_store(sys.argv[1], max_len=4096, cache_dir=sys.argv[2], progress=False, workers=1)
print("BUILT", flush=True)
"""


@pytest.mark.slow
def test_kill_9_during_a_store_build_leaves_nothing_that_looks_complete(tmp_path):
    corpus = tmp_path / "corpus.jsonl"
    with open(corpus, "w") as f:
        for i in range(30_000):
            f.write(json.dumps({"conversations": [{"from": "human", "value": f"question {i} " * 8},
                                                  {"from": "gpt", "value": f"answer {i} " * 12}]}) + "\n")
    cache = tmp_path / "cache"
    proc = subprocess.Popen([sys.executable, "-c", BUILD, str(corpus), str(cache)], cwd=REPO,
                            env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:  # wait until the build has written tokens into its temp directory
            written = [p for p in cache.rglob(store_mod.TOKENS_FILE) if p.stat().st_size > 0] if cache.exists() else []
            if written or proc.poll() is not None:
                break
            time.sleep(0.01)
        assert proc.poll() is None, "the build finished before it could be killed: make the corpus larger"
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.stdout.close()
    assert _complete_stores(cache) == []  # a partial build never carries meta.json
    assert all(p.name.startswith(".") for p in cache.iterdir())  # only under its temporary (hidden) name
    store = build_token_store(str(corpus), max_len=4096, cache_dir=cache, progress=False, workers=1)
    assert len(store) == 30_000


# -- regressions: inputs that once escaped as other exceptions (found by the fuzzing above) -----------------------


@pytest.mark.parametrize("call", [
    pytest.param(lambda: from_params({1: 2}), id="non-str key"),
    pytest.param(lambda: from_params([("steps", 1)]), id="params not a dict"),
    pytest.param(lambda: from_params({"lr": 10 ** 400}), id="int too large for a float"),
    pytest.param(lambda: from_params({"lr": float("nan")}), id="nan lr"),
    pytest.param(lambda: coerce("lr", "Infinity"), id="infinite lr"),
    pytest.param(lambda: coerce("edges", "[" * 100_000), id="deep literal"),
    pytest.param(lambda: coerce("steps", "9" * 5000), id="5000-digit int"),
])
def test_parameter_validation_refuses_hostile_values_with_config_error(call):
    with pytest.raises(ConfigError):
        call()


@pytest.mark.parametrize("name, data, skipped", [
    pytest.param("deep.jsonl", b"[" * 100_000 + b"\n" + b'{"conversations": []}\n', 1, id="jsonl deep nesting"),
    pytest.param("digits.jsonl", b'{"id": ' + b"9" * 5000 + b"}\n", 1, id="5000-digit int"),
    pytest.param("deep.json", b"[" + b"[" * 100_000 + b"]" * 100_000 + b"]", None, id="json deep nesting"),
])
def test_readers_turn_hostile_records_into_skips_or_data_errors(tmp_path, name, data, skipped):
    path = tmp_path / name
    path.write_bytes(data)
    out, report = read(path)
    if skipped is None:
        assert isinstance(out, DataError) and "cannot be parsed" in str(out)
    else:
        assert report.skipped.get(readers.INVALID_JSON) == skipped


def test_corrupt_parquet_pages_are_a_data_error(tmp_path):
    path = _parquet(tmp_path / "corpus.parquet", n=200)
    data = bytearray(path.read_bytes())
    for i in range(40, len(data) // 2, 97):  # garble the data pages, leave the footer readable
        data[i] ^= 0x5A
    path.write_bytes(bytes(data))
    out, _ = read(path)
    assert isinstance(out, DataError) and "cannot be read" in str(out)
