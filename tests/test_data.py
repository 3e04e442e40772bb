"""dflash_lib.data: readers, templates + loss mask, tokenizers, the token store and length statistics."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

os.environ.setdefault("WANDB_MODE", "disabled")

from dflash_lib.config import ConfigError, DataConfig  # noqa: E402
from dflash_lib.data import (ChatMLTemplate, ChatTokenizer, DataError, LoadReport, TokenStore,  # noqa: E402
                             build_token_store, build_token_store_from_config, get_template, load_conversations,
                             load_tokenizer, readers, render, skip_table, store as store_mod, summarize_lengths,
                             summarize_store)
from dflash_lib.lab.report.lengths import length_histogram, length_tail  # noqa: E402
from tiny_models import tiny_chatml_tokenizer  # noqa: E402

CONV_A = {"id": "a", "conversations": [{"from": "system", "value": "Be brief."}, {"from": "human", "value": "Hi"},
                                       {"from": "gpt", "value": "Hello! ü"}]}
CONV_B = {"id": "b", "messages": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]}
CONV_C = {"id": "c", "conversations": [{"from": "human", "value": "Name a colour."},
                                       {"from": "chatgpt", "value": "Blue, with a long explanation " * 20}]}


def write_jsonl(path: Path, records: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


# ---------------------------------------------------------------------------------------------------------
# Readers


def test_sharegpt_json_array_maps_roles_and_keeps_system(tmp_path):
    path = tmp_path / "c.json"
    path.write_text(json.dumps([CONV_A, CONV_C]))
    stream = load_conversations(str(path))
    convs = list(stream)
    assert [c.id for c in convs] == ["a", "c"]
    assert convs[0].turns == (("system", "Be brief."), ("user", "Hi"), ("assistant", "Hello! ü"))
    assert convs[1].turns[1][0] == "assistant"
    assert stream.report.records_seen == 2 and stream.report.records_kept == 2
    assert stream.report.trailing_bytes == 0 and stream.report.complete


def test_json_array_across_tiny_read_chunks(tmp_path, monkeypatch):
    """Records and multi-byte characters split across refills parse exactly as with one big read."""
    monkeypatch.setattr(readers, "READ_CHUNK_BYTES", 7)
    records = [dict(CONV_A, id=f"r{i}", conversations=CONV_A["conversations"] + [
        {"from": "human", "value": "日本語 " * i}, {"from": "gpt", "value": "ok"}]) for i in range(12)]
    path = tmp_path / "c.json"
    path.write_text(json.dumps(records, ensure_ascii=False, indent=2))
    convs = list(load_conversations(str(path)))
    assert [c.id for c in convs] == [f"r{i}" for i in range(12)]
    assert convs[5].turns[3] == ("user", "日本語 " * 5)


# (head, separator, tail) of a JSON array as writers lay it out: compact, one record per line, spaced commas
ARRAY_LAYOUTS = [(b"[", b",", b"]"), (b"[\n ", b",\n ", b"\n]\n"), (b" [ ", b" , ", b" ] ")]


def json_array(records: list[dict], layout: tuple[bytes, bytes, bytes]) -> tuple[bytes, list[int]]:
    """The UTF-8 bytes of `records` as a JSON array, and the byte offset just past each record's closing brace."""
    head, sep, tail = layout
    data, ends = bytearray(head), []
    for i, record in enumerate(records):
        data += (sep if i else b"") + json.dumps(record, ensure_ascii=False).encode()
        ends.append(len(data))
    return bytes(data + tail), ends


def message_record(i: int, question: str, answer: str) -> dict:
    return {"id": f"r{i}", "messages": [{"role": "user", "content": question},
                                        {"role": "assistant", "content": answer}]}


def check_cut(path: Path, data: bytes, ends: list[int], records: list[dict], cut: int) -> None:
    """Read `data[:cut]`: exactly the records whose closing brace survived, in order and with their content, and
    every byte after the last one's separator counted as trailing (a closing bracket and blanks are not)."""
    path.write_bytes(data[:cut])
    stream = load_conversations(str(path))
    n = sum(end <= cut for end in ends)  # records that end inside the cut
    if b"[" not in data[:cut]:
        with pytest.raises(DataError, match="expected a JSON array"):
            list(stream)
        return
    if n == 0:
        with pytest.raises(DataError, match="no usable conversation among 0 records"):
            list(stream)
        return
    got = [(c.record, c.id, c.turns) for c in stream]
    expected = [(i, r["id"], tuple((t["role"], t["content"]) for t in r["messages"])) for i, r in enumerate(records)]
    assert got == expected[:n], f"cut at byte {cut} of {len(data)}"
    rest = data[ends[n - 1]:cut].lstrip(b" \n,")
    tail = len(rest[1:].strip()) if rest.startswith(b"]") else len(rest)
    assert (stream.report.records_seen, stream.report.trailing_bytes) == (n, tail), f"cut at byte {cut}"


@pytest.mark.parametrize("layout", ARRAY_LAYOUTS, ids=["compact", "lines", "spaced"])
@pytest.mark.parametrize("chunk", [3, 1 << 22], ids=["3-byte reads", "one read"])
def test_every_cut_of_a_small_array_keeps_exactly_the_complete_records(tmp_path, monkeypatch, layout, chunk):
    """Every byte position, including right after each closing brace, right after each separator and inside the
    2-, 3- and 4-byte characters (a cut character is tail, not a UTF-8 error)."""
    monkeypatch.setattr(readers, "READ_CHUNK_BYTES", chunk)
    records = [message_record(0, "2+2?", "4"), message_record(1, "ü?", "日本語 🙂"), message_record(2, "x", "}]")]
    data, ends = json_array(records, layout)
    for cut in range(len(data) + 1):
        check_cut(tmp_path / "t.json", data, ends, records, cut)


texts = st.text(st.characters(codec="utf-8"), max_size=12)


@settings(max_examples=40, deadline=None)
@given(pairs=st.lists(st.tuples(texts, texts), min_size=1, max_size=5), layout=st.sampled_from(ARRAY_LAYOUTS),
       chunk=st.sampled_from([4, 64, 1 << 22]), random_cuts=st.lists(st.integers(0, 10 ** 6), max_size=4))
def test_truncated_json_keeps_exactly_the_complete_records(tmp_path_factory, pairs, layout, chunk, random_cuts):
    """Random records and layouts; always cut right after each record's closing brace, right after the first
    byte of its separator and after the whole separator, one byte before the brace, and at random."""
    records = [message_record(i, q, a) for i, (q, a) in enumerate(pairs)]
    data, ends = json_array(records, layout)
    sep = len(layout[1])
    cuts = {c for end in ends for c in (end - 1, end, end + 1, end + sep)} | {c % (len(data) + 1) for c in random_cuts}
    path = tmp_path_factory.mktemp("trunc") / "t.json"
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(readers, "READ_CHUNK_BYTES", chunk)
        for cut in sorted(c for c in cuts if c <= len(data)):
            check_cut(path, data, ends, records, cut)


def test_a_number_cut_by_the_end_of_the_file_is_tail_not_a_record(tmp_path):
    """`[{...}, 123` cut to `[{...}, 12`: the 12 may have lost digits, so it is not read as a record."""
    path = tmp_path / "n.json"
    path.write_bytes(b"[" + json.dumps(CONV_B).encode() + b", 12")
    stream = load_conversations(str(path))
    assert [c.id for c in stream] == ["b"]
    assert (stream.report.records_seen, stream.report.trailing_bytes) == (1, 2)
    path.write_bytes(b"[" + json.dumps(CONV_B).encode() + b", 12]")  # closed: a complete (skipped) record
    stream = load_conversations(str(path))
    assert [c.id for c in stream] == ["b"]
    assert stream.report.records_seen == 2 and stream.report.skipped == {readers.NOT_AN_OBJECT: 1}


def test_bundled_corpus_is_truncated_and_every_complete_record_is_read():
    stream = load_conversations("sharegpt")
    kept = sum(1 for _ in stream)
    rep = stream.report
    assert rep.complete and rep.trailing_bytes > 0
    assert kept == rep.records_kept and rep.records_seen == kept + sum(rep.skipped.values())
    data = stream.resolved.path.read_bytes()
    tail = data[len(data) - rep.trailing_bytes:]
    assert tail.startswith(b"{") and b'"conversations"' in tail
    head = data[: len(data) - rep.trailing_bytes].rstrip().rstrip(b",")
    assert len(json.loads(head + b"]")) == rep.records_seen  # independent full parse of the complete part


def test_json_reader_memory_does_not_grow_with_file_size(tmp_path, monkeypatch):
    import tracemalloc

    monkeypatch.setattr(readers, "READ_CHUNK_BYTES", 1 << 15)
    record = dict(CONV_C, id="x")
    path = tmp_path / "big.json"
    path.write_text(json.dumps([record] * 3000))  # ~2 MB
    assert path.stat().st_size > 2_000_000
    tracemalloc.start()
    count = sum(1 for _ in load_conversations(str(path)))
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert count == 3000 and peak < path.stat().st_size / 10


def test_malformed_record_mid_array_is_refused_not_buffered(tmp_path, monkeypatch):
    monkeypatch.setattr(readers, "READ_CHUNK_BYTES", 64)
    monkeypatch.setattr(readers, "MAX_RECORD_CHARS", 2000)
    good = json.dumps(CONV_B)
    path = tmp_path / "bad.json"
    path.write_text("[" + good + ', {"id": "broken", ]x, ' + ", ".join([good] * 200) + "]")
    with pytest.raises(DataError, match="bad.json: the record at character 1[0-9]+ is not valid JSON"):
        list(load_conversations(str(path)))


def test_jsonl_conversations_and_messages_and_invalid_line(tmp_path):
    path = write_jsonl(tmp_path / "c.jsonl", [CONV_A, CONV_B, '{"id": "broken", "conv'])
    stream = load_conversations(str(path))
    convs = list(stream)
    assert [c.id for c in convs] == ["a", "b"]
    assert convs[1].turns == (("user", "2+2?"), ("assistant", "4"))
    assert stream.report.skipped == {readers.INVALID_JSON: 1}


def test_parquet_messages_and_conversations(tmp_path):
    msgs = pa.table({"id": ["b", "x"], "messages": [CONV_B["messages"], [{"role": "user", "content": "q"},
                                                                        {"role": "assistant", "content": "a"}]]})
    pq.write_table(msgs, tmp_path / "m.parquet")
    convs = list(load_conversations(str(tmp_path / "m.parquet")))
    assert [c.turns for c in convs] == [(("user", "2+2?"), ("assistant", "4")), (("user", "q"), ("assistant", "a"))]
    sharegpt = pa.table({"id": ["a"], "conversations": [CONV_A["conversations"]]})
    pq.write_table(sharegpt, tmp_path / "s.parquet")
    (conv,) = load_conversations(str(tmp_path / "s.parquet"))
    assert conv.turns[0] == ("system", "Be brief.")


def test_limit_reads_a_prefix(tmp_path):
    path = write_jsonl(tmp_path / "c.jsonl", [dict(CONV_B, id=str(i)) for i in range(10)])
    stream = load_conversations(str(path), limit=4)
    assert [c.id for c in stream] == ["0", "1", "2", "3"]
    assert stream.report.records_seen == 4 and not stream.report.complete


SKIP_CASES = {
    readers.INVALID_JSON: "{not json",
    readers.NOT_AN_OBJECT: [1, 2],
    readers.MISSING_CONVERSATION: {"id": "x", "text": "hello"},
    readers.NOT_A_LIST: {"conversations": "hello"},
    readers.EMPTY_CONVERSATION: {"conversations": []},
    readers.TURN_NOT_AN_OBJECT: {"conversations": ["hello"]},
    readers.MISSING_ROLE: {"conversations": [{"value": "hi"}]},
    readers.MISSING_CONTENT: {"conversations": [{"from": "human"}]},
    readers.UNKNOWN_ROLE: {"conversations": [{"from": "narrator", "value": "hi"}, {"from": "gpt", "value": "x"}]},
    readers.NON_STRING_CONTENT: {"messages": [{"role": "user", "content": ["hi"]}]},
    readers.NO_ASSISTANT_TURN: {"conversations": [{"from": "human", "value": "hi"}]},
}


def test_every_skip_reason_is_counted(tmp_path):
    records = [r if isinstance(r, str) else json.dumps(r) for r in SKIP_CASES.values()] + [json.dumps(CONV_B)]
    stream = load_conversations(str(write_jsonl(tmp_path / "bad.jsonl", records)))
    assert len(list(stream)) == 1
    assert stream.report.skipped == {reason: 1 for reason in SKIP_CASES}
    assert stream.report.records_seen == len(SKIP_CASES) + 1


def test_skips_name_their_line_the_role_seen_and_bad_encoding(tmp_path):
    """JSONL skips keep their 1-based line (blank lines count), an unknown role is named, and a line that is not
    UTF-8 is bad_encoding, not invalid_json; the one-line report says all of it."""
    tool = {"messages": [{"role": "user", "content": "q"}, {"role": "tool", "content": "x"}]}
    lines = [json.dumps(CONV_B).encode(), b"", b"{not json", json.dumps(tool).encode(),
             b'{"messages": [{"role": "user", "content": "caf\xe9"}]}', json.dumps(CONV_A).encode()]
    path = tmp_path / "c.jsonl"
    path.write_bytes(b"\n".join(lines) + b"\n")
    stream = load_conversations(str(path))
    assert [(c.id, c.record, c.line, c.where) for c in stream] == [("b", 0, 1, "line 1"), ("a", 4, 6, "line 6")]
    rep = stream.report
    assert rep.skipped == {readers.INVALID_JSON: 1, readers.UNKNOWN_ROLE: 1, readers.BAD_ENCODING: 1}
    assert rep.examples == {readers.INVALID_JSON: ["line 3"], readers.UNKNOWN_ROLE: ["role 'tool' at line 4"],
                            readers.BAD_ENCODING: ["line 5"]}
    assert rep.summary_line() == ("data: 5 records read, 2 kept; skipped: bad_encoding 1 (line 5), invalid_json 1 "
                                  "(line 3), unknown_role 1 (role 'tool' at line 4)")
    assert rep.counts()["skipped"] == rep.skipped and rep.counts()["examples"] == rep.examples


def test_skips_in_a_json_array_name_the_record_and_keep_the_first_few(tmp_path):
    records = [CONV_B] + [{"conversations": []}] * (readers.SKIP_EXAMPLES + 2) + [{"messages": [{"role": 7}]}]
    path = tmp_path / "c.json"
    path.write_text(json.dumps(records))
    stream = load_conversations(str(path))
    assert len(list(stream)) == 1
    rep = stream.report
    assert rep.examples[readers.EMPTY_CONVERSATION] == [f"record {i}" for i in range(1, readers.SKIP_EXAMPLES + 1)]
    assert rep.skipped == {readers.EMPTY_CONVERSATION: readers.SKIP_EXAMPLES + 2, readers.MISSING_CONTENT: 1}
    assert rep.summary_line() == ("data: 9 records read, 1 kept; skipped: empty_conversation 7 (record 1, record 2, "
                                  "record 3, record 4, record 5, ...), missing_content 1 (record 8)")
    assert LoadReport(source="x", records_seen=2, records_kept=2).summary_line() == (
        "data: 2 records read, 2 kept; nothing skipped")


def test_zero_usable_records_names_the_source(tmp_path):
    path = write_jsonl(tmp_path / "allbad.jsonl", [{"conversations": []}, "nope"])
    with pytest.raises(DataError, match="allbad.jsonl.*no usable conversation"):
        list(load_conversations(str(path)))


def test_bad_sources_are_named(tmp_path):
    with pytest.raises(DataError, match="missing.json.*no such file"):
        load_conversations(str(tmp_path / "missing.json"))
    (tmp_path / "shards.jsonl").mkdir()  # a folder, even one named like a corpus file, is not "no such file"
    with pytest.raises(DataError, match=r"source '.*shards.jsonl' is a directory; give one .json/.jsonl/.parquet file"):
        load_conversations(str(tmp_path / "shards.jsonl"))
    (tmp_path / "c.csv").write_text("a,b\n")
    with pytest.raises(DataError, match="unsupported file type '.csv'"):
        load_conversations(str(tmp_path / "c.csv"))
    (tmp_path / "obj.json").write_text(json.dumps(CONV_A))
    with pytest.raises(DataError, match="obj.json: expected a JSON array"):
        list(load_conversations(str(tmp_path / "obj.json")))
    pq.write_table(pa.table({"text": ["x"]}), tmp_path / "t.parquet")
    with pytest.raises(DataError, match="no 'conversations' or 'messages' column"):
        list(load_conversations(str(tmp_path / "t.parquet")))


# ---------------------------------------------------------------------------------------------------------
# Template, tokenizer and loss mask


KNOWN_TURNS = (("system", "You are a helpful assistant."), ("user", "Hi!"), ("assistant", "Hello! How can I help?"),
               ("user", "2+2?"), ("assistant", "\n\n4"))
# Qwen ids of KNOWN_TURNS in ChatML: 151644 <|im_start|>, 151645 <|im_end|>, 198 "\n", 8948 "system",
# 872 "user", 77091 "assistant", 1406 "\n\n\n" (the header's newline merged with the content's two).
KNOWN_IDS = [151644, 8948, 198, 2610, 525, 264, 10950, 17847, 13, 151645, 198,
             151644, 872, 198, 13048, 0, 151645, 198,
             151644, 77091, 198, 9707, 0, 2585, 646, 358, 1492, 30, 151645, 198,
             151644, 872, 198, 17, 10, 17, 30, 151645, 198,
             151644, 77091, 1406, 19, 151645, 198]
KNOWN_TRAINED = list(range(21, 29)) + [41, 42, 43]  # "Hello! How can I help?<|im_end|>", "\n\n\n4<|im_end|>"


def test_chatml_known_conversation_exact_ids_and_mask(qwen_tokenizer):
    segs = ChatMLTemplate().segments(KNOWN_TURNS)
    ids, mask = qwen_tokenizer.encode_segments(segs)
    assert ids.tolist() == KNOWN_IDS
    assert np.flatnonzero(mask).tolist() == KNOWN_TRAINED
    assert qwen_tokenizer._qwen.encode(render(segs)) == KNOWN_IDS  # the whole string with specials allowed
    assert qwen_tokenizer.decode(ids[mask.astype(bool)]) == "Hello! How can I help?<|im_end|>\n\n\n4<|im_end|>"
    assert (qwen_tokenizer.eos_id, qwen_tokenizer.pad_id, qwen_tokenizer.vocab_size) == (151645, 151643, 151936)
    assert qwen_tokenizer.n_vocab <= qwen_tokenizer.vocab_size


def _conversations(source: str, limit: int) -> list:
    return list(load_conversations(source, limit=limit))


def test_real_records_whole_string_equals_segment_path_and_fast_path(qwen_tokenizer):
    template = ChatMLTemplate()
    convs = _conversations("sharegpt", 60)
    segs = [template.segments(tuple((r, qwen_tokenizer.prepare(c)) for r, c in conv.turns)) for conv in convs]
    fast = qwen_tokenizer.encode_conversations(segs)  # one tiktoken call for the whole chunk
    slow = ChatTokenizer.encode_conversations(qwen_tokenizer, segs)  # per text segment
    np.testing.assert_array_equal(fast.ids, slow.ids)
    np.testing.assert_array_equal(fast.mask, slow.mask)
    np.testing.assert_array_equal(fast.lengths, slow.lengths)
    starts = np.cumsum(fast.lengths) - fast.lengths
    for i in range(0, len(convs), 7):
        whole = qwen_tokenizer._qwen.encode(render(segs[i]))
        assert fast.ids[starts[i]: starts[i] + fast.lengths[i]].tolist() == whole, convs[i].id


@settings(max_examples=30, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["system", "user", "assistant"]),
                          st.lists(st.sampled_from(list(" \n\tab1é日<|>_") + ["<|im_end|>", "  \n", "e\u0301"]),
                                   max_size=30).map("".join)),
                min_size=1, max_size=5))
def test_fast_path_equals_segment_path_on_any_text(qwen_tokenizer, turns):
    """Including text that spells special tokens: it must stay plain text on both paths."""
    segs = [ChatMLTemplate().segments(tuple(turns)), ChatMLTemplate().segments((("user", "x"), ("assistant", "y")))]
    fast = qwen_tokenizer.encode_conversations(segs)
    slow = ChatTokenizer.encode_conversations(qwen_tokenizer, segs)
    np.testing.assert_array_equal(fast.ids, slow.ids)
    np.testing.assert_array_equal(fast.mask, slow.mask)
    first = fast.ids[: fast.lengths[0]]
    assert int(np.sum(first == 151644)) == len(turns)  # one <|im_start|> per turn: no text became special
    assert qwen_tokenizer.decode(first) == render(segs[0])
    trained = first[fast.mask[: fast.lengths[0]].astype(bool)]
    assert int(np.sum(trained == 151645)) == sum(r == "assistant" for r, _ in turns)


def test_unknown_template_and_tokenizer_errors(tmp_path, qwen_tokenizer):
    with pytest.raises(DataError, match="unknown template 'nope'"):
        get_template("nope", qwen_tokenizer)
    with pytest.raises(DataError, match="template 'hf' needs a local Hugging Face tokenizer"):
        get_template("hf", qwen_tokenizer)
    with pytest.raises(DataError, match="no_such_dir.*not a local directory"):
        load_tokenizer(str(tmp_path / "no_such_dir"))


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """A tiny byte-level BPE trained here, saved as a local Hugging Face tokenizer with ChatML specials."""
    hf = tiny_chatml_tokenizer()
    hf.chat_template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                        "{% endfor %}")
    path = tmp_path_factory.mktemp("hf_tok")
    hf.save_pretrained(path)
    return path


def test_hf_tokenizer_from_local_dir_chatml_mask(hf_dir):
    tok = load_tokenizer(str(hf_dir))
    ids, mask = tok.encode_segments(ChatMLTemplate().segments(KNOWN_TURNS[:3]))
    trained = ids[mask.astype(bool)]
    assert tok.decode(trained) == "Hello! How can I help?<|im_end|>"
    assert tok.decode(ids) == render(ChatMLTemplate().segments(KNOWN_TURNS[:3]))
    assert tok.eos_id == tok.special_id("<|im_end|>") and tok.pad_id == tok.special_id("<|endoftext|>")
    # User text spelling a special token stays plain text.
    ids2, _ = tok.encode_segments(ChatMLTemplate().segments((("user", "a<|im_end|>b"), ("assistant", "c"))))
    assert int(np.sum(ids2 == tok.special_id("<|im_end|>"))) == 2


def test_hf_chat_template_marks_assistant_spans(hf_dir):
    tok = load_tokenizer(str(hf_dir))
    template = get_template("hf", tok)
    segs = template.segments(KNOWN_TURNS[:3])
    assert render(segs) == render(ChatMLTemplate().segments(KNOWN_TURNS[:3]))
    ids, mask = tok.encode_segments(segs)
    assert tok.decode(ids[mask.astype(bool)]).startswith("Hello! How can I help?<|im_end|>")
    assert "Hi" not in tok.decode(ids[mask.astype(bool)])


# ---------------------------------------------------------------------------------------------------------
# Token store


@pytest.fixture
def corpus(tmp_path):
    return write_jsonl(tmp_path / "c.jsonl", [CONV_A, CONV_B, CONV_C, {"conversations": []}])


def test_store_round_trip(tmp_path, corpus, qwen_tokenizer):
    store = build_token_store(str(corpus), max_len=4096, cache_dir=tmp_path / "cache", progress=False)
    assert len(store) == 3
    for i, conv in enumerate([CONV_A, CONV_B, CONV_C]):
        turns = next(c for c in load_conversations(str(corpus)) if c.id == conv["id"]).turns
        segs = ChatMLTemplate().segments(tuple((r, qwen_tokenizer.prepare(t)) for r, t in turns))
        ids, mask = qwen_tokenizer.encode_segments(segs)
        got_ids, got_mask = store[i]
        np.testing.assert_array_equal(got_ids, ids)
        np.testing.assert_array_equal(got_mask, mask)
        assert isinstance(got_ids.base, np.memmap) or isinstance(got_ids, np.memmap)  # a view, not a copy
    np.testing.assert_array_equal(store.lengths, [len(store[i][0]) for i in range(3)])
    frame = store.lengths_frame()
    assert frame["id"].tolist() == ["a", "b", "c"] and frame["record"].tolist() == [0, 1, 2]
    np.testing.assert_array_equal(frame["assistant_tokens"], [int(store[i][1].sum()) for i in range(3)])
    rep = store.report
    assert rep.skipped == {readers.EMPTY_CONVERSATION: 1} and rep.records_kept == 3
    assert rep.total_tokens == int(store.lengths.sum()) == store.num_tokens
    assert store.meta["tokenizer"]["vocab_size"] == 151936
    assert store[-1][0].tolist() == store[2][0].tolist()
    with pytest.raises(IndexError, match="sample 3 out of range"):
        store[3]


def test_store_cache_hit_and_key_changes(tmp_path, corpus, monkeypatch):
    cache = tmp_path / "cache"
    first = build_token_store(str(corpus), max_len=4096, cache_dir=cache, progress=False)

    def no_tokenizer(spec):
        raise AssertionError("a cache hit must not load the tokenizer")

    monkeypatch.setattr(store_mod, "load_tokenizer", no_tokenizer)
    again = build_token_store(str(corpus), max_len=4096, cache_dir=cache, progress=False, workers=1)
    assert again.path == first.path and again.meta["key"] == first.meta["key"]
    monkeypatch.undo()
    other = build_token_store(str(corpus), max_len=16, cache_dir=cache, progress=False)
    assert other.path != first.path
    stat = corpus.stat()
    os.utime(corpus, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))  # the source changed
    assert build_token_store(str(corpus), max_len=4096, cache_dir=cache, progress=False).path != first.path
    assert sorted(p.name for p in cache.iterdir() if p.name.startswith(".")) == []  # no temp dirs left


def test_truncate_and_drop_policies_are_counted(tmp_path, corpus):
    cache = tmp_path / "cache"
    full = build_token_store(str(corpus), max_len=4096, cache_dir=cache, progress=False)
    max_len = int(np.sort(full.lengths)[1])  # the longest sample is over, the others fit
    cut = build_token_store(str(corpus), max_len=max_len, policy="truncate", cache_dir=cache, progress=False)
    assert cut.lengths.max() == max_len and cut.report.truncated_max_len == 1
    np.testing.assert_array_equal(cut.lengths_frame()["raw_length"], full.lengths)
    longest = int(np.argmax(full.lengths))
    np.testing.assert_array_equal(cut[longest][0], full[longest][0][:max_len])
    drop = build_token_store(str(corpus), max_len=max_len, policy="drop", cache_dir=cache, progress=False)
    assert len(drop) == 2 and drop.report.skipped[readers.OVER_MAX_LEN] == 1
    assert drop.report.examples[readers.OVER_MAX_LEN] == [f"line {longest + 1}"]
    rep = drop.report
    assert rep.records_seen == rep.records_kept + sum(rep.skipped.values())
    with pytest.raises(DataError, match="no sample left.*max_len=2"):
        build_token_store(str(corpus), max_len=2, policy="drop", cache_dir=cache, progress=False)


def test_samples_with_no_assistant_token_within_max_len_are_dropped_at_build(tmp_path, monkeypatch):
    """A long question cut before its answer leaves nothing to learn: the store drops the sample once, counts and
    locates it (kept in a cached store too), and the before-truncation figures still count it."""
    long_question = {"id": "long", "messages": [{"role": "user", "content": "why " * 60},
                                                {"role": "assistant", "content": "because"}]}
    path = write_jsonl(tmp_path / "c.jsonl", [CONV_B, long_question, CONV_C])
    cache = tmp_path / "cache"
    full = build_token_store(str(path), max_len=4096, cache_dir=cache, progress=False)
    max_len = int(full.lengths[1]) - 10  # cuts the long question's answer (a few tokens), keeps CONV_C's start
    assert full.lengths[2] > max_len and full.lengths_frame()["assistant_tokens"][1] < 10
    store = build_token_store(str(path), max_len=max_len, cache_dir=cache, progress=False)
    assert len(store) == 2 and store.lengths_frame()["id"].tolist() == ["b", "c"]
    assert all(store[i][1].any() for i in range(len(store)))  # every stored sample trains on something
    np.testing.assert_array_equal(store[1][0], full[2][0][:max_len])  # the tokens of the dropped one are gone
    rep = store.report
    assert rep.skipped == {readers.NO_ASSISTANT_WITHIN_MAX_LEN: 1} and rep.records_kept == 2
    assert rep.examples == {readers.NO_ASSISTANT_WITHIN_MAX_LEN: ["line 2"]} and rep.truncated_max_len == 1
    assert rep.total_tokens == store.num_tokens == int(full.lengths[0]) + max_len
    assert store.dropped_frame().to_dict("list") == {"record": [1], "id": ["long"], "raw_length": [full.lengths[1]]}
    np.testing.assert_array_equal(store.raw_lengths(), full.lengths[[0, 2, 1]])
    s = summarize_store(store)  # before truncation: all three samples; after: the two the store holds
    assert (s.samples, s.dropped, s.above_max_len, s.share_above_max_len) == (2, 1, 2, pytest.approx(2 / 3))
    assert s.raw_tokens == int(full.lengths.sum()) and s.total_tokens == store.num_tokens

    monkeypatch.setattr(store_mod, "load_tokenizer", lambda spec: pytest.fail("a cache hit loads no tokenizer"))
    cached = build_token_store(str(path), max_len=max_len, cache_dir=cache, progress=False)
    assert cached.path == store.path and cached.report.summary_line() == rep.summary_line()
    assert "no_assistant_within_max_len 1 (line 2)" in rep.summary_line()


def test_store_format_is_part_of_the_key_and_an_old_store_is_refused(tmp_path, corpus, monkeypatch):
    store = build_token_store(str(corpus), max_len=4096, cache_dir=tmp_path, progress=False)
    meta = json.loads((store.path / "meta.json").read_text())
    assert meta["format"] == store_mod.STORE_FORMAT_VERSION
    (store.path / "meta.json").write_text(json.dumps(dict(meta, format=store_mod.STORE_FORMAT_VERSION - 1)))
    with pytest.raises(DataError, match="store format .* rebuild it"):
        TokenStore.open(store.path)
    settings = store_mod.StoreSettings(str(corpus), "qwen", "chatml", 4096, "truncate", 0)
    key = settings.key()
    monkeypatch.setattr(store_mod, "STORE_FORMAT_VERSION", store_mod.STORE_FORMAT_VERSION - 1)
    assert settings.key() != key  # a store of the older format lives under another key: never opened as this one


def test_failed_build_leaves_no_store(tmp_path, corpus, monkeypatch):
    def explode(*args, **kwargs):
        raise RuntimeError("disk full")

    monkeypatch.setattr(store_mod, "_write_chunk", explode)
    cache = tmp_path / "cache"
    with pytest.raises(RuntimeError, match="disk full"):
        build_token_store(str(corpus), cache_dir=cache, progress=False)
    assert list(cache.iterdir()) == []
    with pytest.raises(DataError, match="not a complete token store"):
        TokenStore.open(cache)


def test_a_folder_is_published_whole_and_a_lost_race_keeps_the_winner(tmp_path):
    """publish_folder (the token store's and the demo target's): build aside, rename into place."""
    def build(out):
        (out / "done").write_text("mine")

    def complete(folder):
        return (folder / "done").is_file()

    final = tmp_path / "key"
    for name in "abc":
        (tmp_path / name).mkdir()
    store_mod.publish_folder(tmp_path / "a", final, build, complete)
    assert (final / "done").read_text() == "mine" and not (tmp_path / "a").exists()
    (final / "done").write_text("winner")  # another process got there first: its complete folder stays
    store_mod.publish_folder(tmp_path / "b", final, build, complete)
    assert (final / "done").read_text() == "winner" and not (tmp_path / "b").exists()
    (final / "done").rename(final / "half")  # an incomplete folder under the final name is no winner: refused
    with pytest.raises(OSError):
        store_mod.publish_folder(tmp_path / "c", final, build, complete)
    assert not (tmp_path / "c").exists() and sorted(p.name for p in final.iterdir()) == ["half"]


def test_parameter_validation_names_the_parameter(tmp_path, corpus):
    kw = dict(cache_dir=tmp_path, progress=False)
    with pytest.raises(ConfigError, match="policy must be one of"):
        build_token_store(str(corpus), policy="cut", **kw)
    with pytest.raises(ConfigError, match="max_len must be > 0"):
        build_token_store(str(corpus), max_len=0, **kw)
    with pytest.raises(ConfigError, match="limit must be >= 0"):
        build_token_store(str(corpus), limit=-1, **kw)
    with pytest.raises(ConfigError, match="workers must be > 0"):
        build_token_store(str(corpus), workers=0, **kw)
    with pytest.raises(DataError, match="unknown template 'zephyr'"):
        build_token_store(str(corpus), template="zephyr", **kw)
    with pytest.raises(DataError, match="nowhere.jsonl.*no such file"):
        build_token_store(str(tmp_path / "nowhere.jsonl"), **kw)


def test_store_from_config_with_hf_tokenizer(tmp_path, corpus, hf_dir):
    cfg = DataConfig(source=str(corpus), tokenizer=str(hf_dir), template="hf", max_len=512,
                     cache_dir=str(tmp_path / "cache"), workers=1)
    store = build_token_store_from_config(cfg, progress=False)
    tok = load_tokenizer(str(hf_dir))
    assert len(store) == 3 and store.meta["tokenizer"]["name"] == str(hf_dir)
    ids, mask = store[1]  # CONV_B: "2+2?" -> "4"
    assert tok.decode(ids[mask.astype(bool)]).startswith("4<|im_end|>")


def test_template_errors_are_skipped_and_counted(tmp_path, corpus, hf_dir):
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(hf_dir), local_files_only=True)
    hf.chat_template = ("{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('no system') }}"
                        "{% endif %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}")
    strict = tmp_path / "strict_tok"
    hf.save_pretrained(strict)
    store = build_token_store(str(corpus), tokenizer=str(strict), template="hf", max_len=512,
                              cache_dir=tmp_path / "cache", progress=False)
    assert store.lengths_frame()["id"].tolist() == ["b", "c"]  # CONV_A has a system prompt
    assert store.report.skipped == {readers.TEMPLATE_ERROR: 1, readers.EMPTY_CONVERSATION: 1}
    assert store.report.examples == {readers.TEMPLATE_ERROR: ["line 1"], readers.EMPTY_CONVERSATION: ["line 4"]}
    assert store.report.records_kept == 2 and store.report.records_seen == 4


# ---------------------------------------------------------------------------------------------------------
# Length statistics and figures


def test_summarize_lengths_numbers():
    s = summarize_lengths(np.array([10, 20, 30, 40]), np.array([10, 20, 30, 90]), np.array([5, 5, 10, 20]), 40)
    assert (s.samples, s.total_tokens, s.raw_tokens, s.assistant_tokens) == (4, 100, 150, 40)
    assert s.assistant_share == pytest.approx(0.4) and s.mean == 25.0 and (s.min, s.max) == (10, 40)
    assert s.percentiles["p50"] == 25.0 and s.raw_percentiles["p99"] == pytest.approx(88.2)
    assert s.above_max_len == 1 and s.share_above_max_len == 0.25 and s.dropped == 0
    d = summarize_lengths(np.array([10, 40]), np.array([10, 90]), np.array([5, 20]), 40, np.array([50, 30]))
    assert (d.samples, d.dropped, d.total_tokens, d.raw_tokens, d.assistant_tokens) == (2, 2, 50, 180, 25)
    assert d.above_max_len == 2 and d.share_above_max_len == 0.5 and d.mean == 25.0
    with pytest.raises(ValueError, match="equal, non-empty"):
        summarize_lengths(np.array([1]), np.array([1, 2]), np.array([1]), 4)


def test_skip_table_and_store_summary(tmp_path, corpus):
    store = build_token_store(str(corpus), max_len=4096, cache_dir=tmp_path, progress=False)
    table = skip_table(store.report)
    assert table["outcome"].tolist() == ["kept", readers.EMPTY_CONVERSATION]
    assert table["records"].tolist() == [3, 1] and table["share"].sum() == pytest.approx(1.0)
    s = summarize_store(store)
    assert s.samples == 3 and s.total_tokens == store.num_tokens and s.max_len == 4096
    assert skip_table(LoadReport(source="x", records_seen=2, records_kept=2))["records"].tolist() == [2]


def test_length_figures():
    lengths = np.array([5, 50, 60, 500, 900, 4000])
    fig = length_histogram(lengths, max_len=1000, bins=10)
    assert fig.layout.xaxis.type == "log"
    hist, cdf, line = fig.data
    assert sum(hist.y[::2]) == len(lengths)  # each bin drawn twice (step line)
    assert cdf.y[-1] == 1.0 and list(cdf.x) == sorted(cdf.x) and cdf.yaxis == "y2"
    assert "16.7% above" in line.name
    tail = length_tail(lengths, max_len=1000, quantile=0.5)
    assert sorted(tail.data[0].x) == [500, 900, 4000]
    with pytest.raises(ValueError, match="quantile"):
        length_tail(lengths, quantile=1.0)
