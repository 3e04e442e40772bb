"""Regeneration: the local backend on a tiny target (deterministic, resumable, torn line redone) and the openai
backend against a chat-completions server this test starts on 127.0.0.1 (concurrency, which statuses are retried,
failing records rejected and retried on a rerun, leading assistant turns never sent, the report's status)."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from dflash_lib.config import from_params
from dflash_lib.data import load_conversations
from dflash_lib.regenerate import (LocalBackend, OpenAIBackend, RecordError, RegenerateError, read_rejects,
                                   regenerate, rejects_path, report_path, scan_output)
from loopback import free_port

TINY = dict(hidden_size=32, target_layers=2, num_features=1, template="qwen3", max_new_tokens=6, gen_batch=3)
CONVS = [
    {"id": "a", "conversations": [{"from": "human", "value": "Hello"}, {"from": "gpt", "value": "Hi there, friend."},
                                  {"from": "human", "value": "A joke?"}, {"from": "gpt", "value": "No."}]},
    {"id": "b", "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"},
                             {"role": "assistant", "content": "4"}, {"role": "user", "content": "unanswered"}]},
    {"id": "c", "conversations": [{"from": "human", "value": "CANNED poem"}, {"from": "gpt", "value": "Roses."}]},
    {"id": "d", "conversations": [{"from": "human", "value": "FAIL500 once"}, {"from": "gpt", "value": "ok"}]},
    {"id": "e", "conversations": [{"from": "human", "value": "Why?"}, {"from": "gpt", "value": "Because."},
                                  {"from": "human", "value": "Sure?"}, {"from": "gpt", "value": "Yes."}]},
    {"id": "f", "conversations": [{"from": "human", "value": "CANNED bye"}, {"from": "gpt", "value": "Bye."}]},
]


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    path = tmp_path_factory.mktemp("src") / "src.jsonl"
    path.write_text("".join(json.dumps(c) + "\n" for c in CONVS))
    return path


@pytest.fixture(scope="module")
def backend(source):
    return LocalBackend(from_params(dict(TINY, source=str(source))))


def _cfg(source, **kw):
    return from_params(dict(TINY, source=str(source), **kw))


@pytest.fixture(scope="module")
def reference(source, backend, tmp_path_factory):
    out = tmp_path_factory.mktemp("ref") / "out.jsonl"
    report = regenerate(_cfg(source), out, backend=backend, progress=False)
    return out, report


def test_local_greedy_output_is_deterministic_and_readable(source, backend, reference, tmp_path):
    out, report = reference
    again = tmp_path / "again.jsonl"
    regenerate(_cfg(source), again, backend=backend, progress=False)
    assert again.read_bytes() == out.read_bytes()
    recs = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["id"] for r in recs] == list("abcdef") and [r["record"] for r in recs] == list(range(6))
    # turn by turn: record b's trailing user turn is dropped; every assistant turn is the target's own
    assert [m["role"] for m in recs[1]["messages"]] == ["system", "user", "assistant"]
    assert recs[0]["messages"][1]["content"] != "Hi there, friend."
    assert all(r["regen"]["completion_tokens"] == 6 * len(r["regen"]["finish"]) for r in recs)  # never stops
    convs = list(load_conversations(str(out)))
    assert [c.id for c in convs] == list("abcdef")
    t = report["totals"]
    assert (t["records"], t["assistant_turns"], t["truncated"]) == (6, 8, 6)
    assert report["mean_answer_tokens_before"] == pytest.approx(t["source_tokens"] / 8)
    assert json.loads(report_path(out).read_text())["totals"] == t


def test_the_second_turn_sees_the_regenerated_first_answer(source, backend, reference):
    """Answer 2 of record a equals what the target says to [user, ITS answer 1, user]."""
    recs = [json.loads(line) for line in reference[0].read_text().splitlines()]
    turns = tuple((m["role"], m["content"]) for m in recs[0]["messages"][:3])
    assert backend.answer([turns], [0])[0].text == recs[0]["messages"][3]["content"]


def test_resume_after_a_stop_and_a_torn_line_gives_the_same_file(source, backend, reference, tmp_path):
    out = tmp_path / "out.jsonl"
    first = regenerate(_cfg(source), out, backend=backend, progress=False, stop_after=4)
    assert first["run"]["status"] == "stopped" and len(out.read_text().splitlines()) == 4
    lines = out.read_bytes().splitlines(keepends=True)
    out.write_bytes(b"".join(lines[:2]) + lines[2][: len(lines[2]) // 2])  # a kill in the middle of record 2
    assert scan_output(out)[0] == {0, 1}
    second = regenerate(_cfg(source), out, backend=backend, progress=False)
    assert out.read_bytes() == reference[0].read_bytes()
    assert second["run"]["already_done"] == 2 and second["run"]["written_now"] == 4
    assert second["run"]["torn_bytes_cut"] == len(lines[2]) // 2
    out.write_bytes(out.read_bytes() + b"not json\n")
    with pytest.raises(RegenerateError, match="line 7"):
        regenerate(_cfg(source), out, backend=backend, progress=False)


# -- openai backend ------------------------------------------------------------------------------------------


SLOW_S = 0.5  # seconds the server takes to answer a "SLOW" prompt


class ChatServer:
    """A chat-completions server on 127.0.0.1: answers from the tiny target (or canned text for "CANNED"
    prompts, finish "stop"), a 500 on the first "FAIL500" request, a 400 for "BAD400" (while `bad400`), HTTP
    <code> on the first request of a "STATUS<code>" prompt (then canned text; always while `canned`), canned text
    after SLOW_S seconds for a "SLOW" prompt, and, like vLLM and SGLang, a 400 for no messages and a 404 for a
    model it does not serve."""

    def __init__(self, backend):
        self.backend, self.lock = backend, threading.Lock()
        self.inflight = self.max_inflight = self.requests = 0
        self.failed_once, self.bad400, self.canned = False, True, False
        self.seen: list[list[dict]] = []  # the messages of every chat request
        self.status_hits: dict[str, int] = {}  # "STATUS<code>" prompt -> requests received
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _send(self, code, doc):
                body = json.dumps(doc).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self):
                self._send(200, {"data": [{"id": "tiny-qwen3"}]})

            def do_POST(self):
                req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                self._send(*server.handle(req))

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"
        self.thread = threading.Thread(target=self.httpd.serve_forever, kwargs=dict(poll_interval=0.02), daemon=True)
        self.thread.start()

    def handle(self, req):
        with self.lock:
            self.requests += 1
            self.inflight += 1
            self.max_inflight = max(self.max_inflight, self.inflight)
            self.seen.append(req["messages"])
        try:
            time.sleep(0.05)  # let concurrent requests overlap
            assert req["chat_template_kwargs"] == {"enable_thinking": False}
            if req["model"] != "tiny-qwen3":
                return 404, {"error": {"message": f"the model {req['model']} does not exist"}}
            if not req["messages"]:
                return 400, {"error": {"message": "messages: list should have at least 1 item"}}
            last = req["messages"][-1]["content"]
            if last.startswith("STATUS"):
                with self.lock:
                    self.status_hits[last] = self.status_hits.get(last, 0) + 1
                    if self.status_hits[last] == 1:
                        return int(last[6:]), {"error": {"message": f"status {last[6:]}"}}
            if last == "SLOW":
                time.sleep(SLOW_S)
            if "BAD400" in last and self.bad400:
                return 400, {"error": {"message": "context too long"}}
            if "FAIL500" in last and not self.failed_once:
                self.failed_once = True
                return 500, {"error": {"message": "overloaded"}}
            if self.canned or "CANNED" in last or last.startswith(("STATUS", "SLOW")):
                text, finish, n = "A canned answer.", "stop", 4
            else:
                turns = tuple((m["role"], m["content"]) for m in req["messages"])
                with self.lock:  # one generate at a time on the shared model
                    a = self.backend.answer([turns], [0])[0]
                text, finish, n = a.text, a.finish_reason, a.completion_tokens
            return 200, {"choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                                      "finish_reason": finish}], "usage": {"completion_tokens": n}}
        finally:
            with self.lock:
                self.inflight -= 1

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join(5)


@pytest.fixture
def server(backend):
    s = ChatServer(backend)
    yield s
    s.close()


def test_openai_backend_concurrent_retried_and_counted(source, server, reference, tmp_path):
    out = tmp_path / "out.jsonl"
    cfg = _cfg(source, backend="openai", base_url=server.url, concurrency=3, retry_backoff_s=0.01)
    report = regenerate(cfg, out, progress=False)
    assert 1 < server.max_inflight <= 3
    assert server.failed_once and server.requests == 8 + 1  # 8 answers + the retried 500
    recs = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["id"] for r in recs] == list("abcdef")
    ref = [json.loads(line) for line in reference[0].read_text().splitlines()]
    for got, want in zip(recs, ref):  # the same turns kept; the target's answers, not the source's
        assert [m["role"] for m in got["messages"]] == [m["role"] for m in want["messages"]]
        assert [m["content"] for m in got["messages"] if m["role"] == "assistant"] != [
            t["value"] for t in CONVS[got["record"]].get("conversations", []) if t["from"] == "gpt"]
    assert recs[2]["messages"][1]["content"] == "A canned answer." and recs[2]["regen"]["finish"] == ["stop"]
    assert report["totals"]["truncated"] == 4 and report["totals"]["assistant_turns"] == 8


def _bad_source(tmp_path):
    """Canned a, b, then x (record 2, answered 400 "context too long" while the server's `bad400`), then c."""
    bad = tmp_path / "bad.jsonl"
    rows = [{"id": i, "conversations": [{"from": "human", "value": f"CANNED {i}"}, {"from": "gpt", "value": "?"}]}
            for i in "abc"]
    rows.insert(2, {"id": "x", "conversations": [{"from": "human", "value": "BAD400"}, {"from": "gpt", "value": "?"}]})
    bad.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return bad


def _openai(source, server, **kw):
    return _cfg(source, **dict(dict(backend="openai", base_url=server.url, concurrency=2, retry_backoff_s=0.01,
                                    model="tiny-qwen3"), **kw))


def _served(cfg, out, local):
    """regenerate(cfg, out) through the openai backend, counting tokens with `local`'s tokenizer (loaded once)."""
    served = OpenAIBackend(cfg)
    served.tok = local.tok
    try:
        return regenerate(cfg, out, backend=served, progress=False)
    finally:
        served.close()


def test_openai_a_failing_record_is_rejected_the_run_goes_on_and_a_rerun_retries_it(server, backend, tmp_path):
    out, bad = tmp_path / "out.jsonl", _bad_source(tmp_path)
    report = _served(_openai(bad, server), out, backend)
    assert [json.loads(line)["id"] for line in out.read_text().splitlines()] == ["a", "b", "c"]
    (rej,) = read_rejects(rejects_path(out)).values()
    assert (rej["record"], rej["id"], rej["attempts"]) == (2, "x", 1)  # a 400 is not retried
    assert rej["error"].startswith("record 2: HTTP 400 ") and "context too long" in rej["error"]
    assert (report["run"]["status"], report["run"]["rejected_now"], report["totals"]["rejected"]) == ("complete", 1, 1)
    assert json.loads(report_path(out).read_text())["totals"]["rejected"] == 1

    asked = sum("BAD400" in m[-1]["content"] for m in server.seen)
    again = _served(_openai(bad, server), out, backend)  # still failing: tried once more, listed once
    assert sum("BAD400" in m[-1]["content"] for m in server.seen) == asked + 1
    assert again["run"]["written_now"] == 0 and again["totals"]["rejected"] == 1
    assert len(rejects_path(out).read_text().splitlines()) == 1

    server.bad400 = False  # fixed: the rerun writes it (after the others: its "record" says where it belongs)
    fixed = _served(_openai(bad, server), out, backend)
    assert [json.loads(line)["record"] for line in out.read_text().splitlines()] == [0, 1, 3, 2]
    assert (fixed["run"]["written_now"], fixed["totals"]["rejected"]) == (1, 0) and not rejects_path(out).exists()


def test_openai_abort_on_error_stops_at_the_record_and_the_report_says_failed(server, backend, tmp_path):
    out, bad = tmp_path / "out.jsonl", _bad_source(tmp_path)
    with pytest.raises(RegenerateError, match=r"record 2: HTTP 400 .*context too long"):
        _served(_openai(bad, server, regen_on_error="abort"), out, backend)
    assert [json.loads(line)["id"] for line in out.read_text().splitlines()] == ["a", "b"]  # written, in order
    assert list(read_rejects(rejects_path(out))) == [2]
    run = json.loads(report_path(out).read_text())["run"]
    assert run["status"] == "failed" and "HTTP 400" in run["error"] and run["written_now"] == 2


def test_cli_counts_rejects_and_abort_exits_1_naming_the_record(server, tmp_path, capsys):
    from dflash_lib.__main__ import main

    out, bad = tmp_path / "out.jsonl", _bad_source(tmp_path)
    args = ["regenerate", "--source", str(bad), "--out", str(out), "--backend", "openai", "-p", "base_url",
            server.url, "-p", "model", "tiny-qwen3", "-p", "retry_backoff_s", "0.01", "-p", "template", "qwen3"]
    assert main(args) == 0
    std = capsys.readouterr()
    summary = json.loads(std.out.strip().splitlines()[-1])
    assert (summary["records"], summary["rejected"], summary["skipped_leading_assistant"]) == (3, 1, 0)
    assert f"1 records could not be regenerated, listed in {rejects_path(out)}" in std.err
    assert main(args + ["-p", "regen_on_error", "abort"]) == 1
    assert "error: record 2: HTTP 400 " in capsys.readouterr().err


def test_cli_a_missing_source_is_one_line_and_writes_nothing(tmp_path, capsys):
    """A corpus that is not there leaves no OUT and no report behind (a later run with other settings would be
    refused as "written with other settings")."""
    from dflash_lib.__main__ import main

    out = tmp_path / "out.jsonl"
    assert main(["regenerate", "--source", str(tmp_path / "nope.jsonl"), "--out", str(out)]) == 2
    assert capsys.readouterr().err.strip() == (f"error: source {str(tmp_path / 'nope.jsonl')!r}: no such file "
                                               "(expected 'sharegpt' or a local .json/.jsonl/.parquet file)")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("code", [429, 500, 502, 503, 504, 400, 404, 422])
def test_openai_retries_exactly_the_transient_statuses(source, server, code):
    """A status the server or its proxy answers when busy is retried (the second request succeeds); any other
    is not (one request): a record-level RecordError, or a RegenerateError that stops the run for a URL/key/model
    error every record would get."""
    b = OpenAIBackend(_openai(source, server, retry_backoff_s=0.0))
    turns = (("user", f"STATUS{code}"),)
    if code in (429, 500, 502, 503, 504):
        assert b.complete(turns, "record 7").text == "A canned answer."
        assert server.status_hits[f"STATUS{code}"] == 2
    else:
        with pytest.raises(RegenerateError, match=f"record 7: HTTP {code} ") as e:
            b.complete(turns, "record 7")
        assert server.status_hits[f"STATUS{code}"] == 1
        assert isinstance(e.value, RecordError) == (code != 404)


def test_openai_a_server_refusing_connections_stops_the_run(source):
    """After its retries a refused connection is not one record's failure (every record would wait them out)."""
    port = free_port()  # nothing listens on it
    b = OpenAIBackend(_cfg(source, backend="openai", base_url=f"http://127.0.0.1:{port}/v1", model="m", retries=1,
                           retry_backoff_s=0.0))
    with pytest.raises(RegenerateError, match="record 3: .* failed 2 times, last: ConnectError") as e:
        b.complete((("user", "hi"),), "record 3")
    assert not isinstance(e.value, RecordError)


def test_openai_a_request_past_its_timeout_is_retried_then_the_record_rejected(source, server):
    """A server slower than request_timeout_s: each request times out (a transport error: retried), and once the
    retries are spent the record fails on its own (RecordError); the server is up, so the run would go on."""
    b = OpenAIBackend(_openai(source, server, request_timeout_s=SLOW_S / 5, retries=1, retry_backoff_s=0.0))
    with pytest.raises(RecordError, match="record 5: .* failed 2 times, last: ReadTimeout") as e:
        b.complete((("user", "SLOW"),), "record 5")
    assert e.value.attempts == 2  # (the server may see the second request after the client gave up on it)
    b.close()


def test_a_fatal_error_ends_the_run_as_failed_not_running(source, server, backend, tmp_path):
    """A model the server does not serve (404: every record would get it) stops the run, rejecting nothing; any
    exception leaves the report `failed` with the error."""
    out = tmp_path / "out.jsonl"
    with pytest.raises(RegenerateError, match="record 0: HTTP 404 .*does not exist"):
        _served(_openai(source, server, model="other"), out, backend)
    run = json.loads(report_path(out).read_text())["run"]
    assert run["status"] == "failed" and "HTTP 404" in run["error"] and not rejects_path(out).exists()

    class Broken:
        tok = backend.tok

        def answer(self, prompts, records):
            raise RuntimeError("the device fell over")

    with pytest.raises(RuntimeError):
        regenerate(_cfg(source), tmp_path / "local.jsonl", backend=Broken(), progress=False)
    run = json.loads(report_path(tmp_path / "local.jsonl").read_text())["run"]
    assert (run["status"], run["error"]) == ("failed", "RuntimeError: the device fell over")


LEADING = [  # record 4 of the bundled corpus opens with an assistant turn: it answers no prompt
    {"id": "p", "messages": [{"role": "assistant", "content": "Welcome! Ask me anything."},
                             {"role": "user", "content": "CANNED hi"}, {"role": "assistant", "content": "old"},
                             {"role": "user", "content": "trailing"}]},
    {"id": "q", "messages": [{"role": "system", "content": "Be nice."}, {"role": "assistant", "content": "Hello."},
                             {"role": "user", "content": "unanswered"}]},
    {"id": "r", "conversations": [{"from": "human", "value": "CANNED ok"}, {"from": "gpt", "value": "fine"}]},
]


@pytest.fixture
def leading(tmp_path):
    path = tmp_path / "leading.jsonl"
    path.write_text("".join(json.dumps(c) + "\n" for c in LEADING))
    return path


def _messages(out):
    return {r["id"]: ([(m["role"], m["content"]) for m in r["messages"]], r["regen"])
            for r in map(json.loads, out.read_text().splitlines())}


def test_openai_keeps_a_leading_assistant_turn_and_never_sends_no_user_turn(leading, server, backend, tmp_path):
    report = _served(_openai(leading, server), tmp_path / "out.jsonl", backend)
    assert server.requests == 2 and all(any(m["role"] == "user" for m in seen) for seen in server.seen)
    got = _messages(tmp_path / "out.jsonl")
    assert got["p"][0] == [("assistant", "Welcome! Ask me anything."), ("user", "CANNED hi"),
                           ("assistant", "A canned answer.")]
    assert (got["p"][1]["finish"], got["p"][1]["leading_kept"]) == (["stop"], 1)
    assert got["p"][1]["source_tokens"] == len(backend.tok.encode_texts(["old"], [None])[0][0])  # the turn answered
    assert got["q"][0] == [("system", "Be nice."), ("assistant", "Hello.")] and got["q"][1]["finish"] == []
    assert got["r"][0][-1] == ("assistant", "A canned answer.") and got["r"][1]["leading_kept"] == 0
    t = report["totals"]
    assert (t["records"], t["assistant_turns"], t["leading_kept"], t["rejected"]) == (3, 2, 2, 0)


def test_the_bundled_corpus_record_4_is_written_not_sent_empty(server, backend, tmp_path):
    """Record 4 of the bundled corpus opens with an assistant turn (sent as `messages: []` before: a 400 on
    every rerun)."""
    cfg = _openai("sharegpt", server, limit=6, max_turns=1)
    server.canned = True  # (the tiny target on these long prompts would only cost time)
    report = _served(cfg, tmp_path / "out.jsonl", backend)
    source = next(c for c in load_conversations("sharegpt", 6) if c.record == 4)
    rec = next(r for r in map(json.loads, (tmp_path / "out.jsonl").read_text().splitlines()) if r["record"] == 4)
    assert rec["messages"][0] == {"role": "assistant", "content": source.turns[0][1]}
    assert [m["role"] for m in rec["messages"]] == ["assistant", "user", "assistant"]
    assert (report["totals"]["records"], report["totals"]["rejected"], server.requests) == (6, 0, 6)
    assert all(any(m["role"] == "user" for m in seen) for seen in server.seen)


def test_skip_leaves_out_records_with_a_leading_assistant_turn_counted(leading, server, backend, tmp_path):
    report = _served(_openai(leading, server, regen_leading_assistant="skip"), tmp_path / "out.jsonl", backend)
    assert list(_messages(tmp_path / "out.jsonl")) == ["r"] and server.requests == 1
    assert (report["run"]["skipped_leading_assistant"], report["totals"]["records"]) == (2, 1)


def test_local_keeps_a_leading_assistant_turn_and_answers_after_it(leading, backend, tmp_path):
    regenerate(_cfg(leading), tmp_path / "out.jsonl", backend=backend, progress=False)
    got = _messages(tmp_path / "out.jsonl")
    kept = (("assistant", "Welcome! Ask me anything."), ("user", "CANNED hi"))
    assert got["p"][0] == [*kept, ("assistant", backend.answer([kept], [0])[0].text)]
    assert got["q"][0] == [("system", "Be nice."), ("assistant", "Hello.")]
    assert [len(got[i][1]["finish"]) for i in "pqr"] == [1, 0, 1]


def test_local_a_prompt_over_the_targets_positions_is_rejected_the_rest_written(source, backend, reference,
                                                                                  tmp_path):
    """Positions for record a's first prompt but not its second: every record with a prompt that long is
    rejected (a mid-conversation), the others are written exactly as in the reference run."""
    ref = [json.loads(line) for line in reference[0].read_text().splitlines()]
    prompt_lengths = {r["record"]: [len(backend.prompt_ids(tuple((m["role"], m["content"]) for m in r["messages"][:i])))
                                    for i, m in enumerate(r["messages"]) if m["role"] == "assistant"] for r in ref}
    fits = prompt_lengths[0][1] - 1  # prompt tokens that fit
    small = LocalBackend(_cfg(source), target=backend.target, tokenizer=backend.tok)
    small.max_positions = fits + 6  # (+ max_new_tokens)
    out = tmp_path / "out.jsonl"
    report = regenerate(_cfg(source), out, backend=small, progress=False)
    rejected = {i for i, lengths in prompt_lengths.items() if max(lengths) > fits}
    assert 0 in rejected and len(rejected) < len(ref)
    assert set(read_rejects(rejects_path(out))) == rejected and report["totals"]["rejected"] == len(rejected)
    assert "record 0: prompt of" in read_rejects(rejects_path(out))[0]["error"]
    assert out.read_text().splitlines() == [line for line, r in zip(reference[0].read_text().splitlines(), ref)
                                            if r["record"] not in rejected]


def test_length_groups_sort_and_cap_padded_tokens():
    from dflash_lib.regenerate import length_groups

    assert length_groups([5, 1, 3, 1], 100) == [[1, 3, 2, 0]]
    assert length_groups([5, 1, 3, 1], 9) == [[1, 3, 2], [0]]  # 3 rows x 3 tokens = 9; 4 x 5 would be 20
    assert length_groups([5, 1, 3, 1], 6) == [[1, 3], [2], [0]]
    assert length_groups([50, 2], 10) == [[1], [0]]  # a prompt longer than the cap still gets its own group
    assert sorted(i for g in length_groups([7, 3, 9, 3, 1], 12) for i in g) == [0, 1, 2, 3, 4]


def test_a_padded_batch_answers_as_each_prompt_alone(source, reference, tmp_path):
    """Batched generation (left-padded, gen_batch 3) writes what one record per generate call writes (gen_batch 1,
    and gen_tokens 1 cutting a batch of 3 into one-prompt calls, shortest first): the padding is never attended and
    every answer lands at its own record. (The trainer's per-document attention, called without documents, attends
    under transformers' padding mask: without it a padded row answered differently.)"""
    out, _ = reference
    for name, kw in (("single", dict(gen_batch=1)), ("split", dict(gen_tokens=1))):
        cfg = _cfg(source, **kw)
        regenerate(cfg, tmp_path / f"{name}.jsonl", backend=LocalBackend(cfg), progress=False)
        assert (tmp_path / f"{name}.jsonl").read_bytes() == out.read_bytes(), name


def test_min_new_tokens_keeps_the_end_of_turn_out_of_the_first_tokens(source, backend):
    """With the end-of-turn id set to the token the target writes second, the answer stops there; with
    min_new_tokens it runs past it (Hugging Face's min_new_tokens masks the id)."""
    turns = (("user", "Hello"),)
    free = backend.model.generate(input_ids=__import__("torch").tensor([backend.prompt_ids(turns)]),
                                  max_new_tokens=6, do_sample=False, pad_token_id=backend.tok.pad_id)
    second = int(free[0, -5])

    class _Eos:
        def __init__(self, tok):
            self._tok = tok

        def __getattr__(self, name):
            return getattr(self._tok, name)

        eos_id = second

    for min_new, expect in ((0, "stop"), (6, "length")):
        cfg = _cfg(source, min_new_tokens=min_new)
        b = LocalBackend(cfg, target=backend.target, tokenizer=_Eos(backend.tok))
        answer = b.answer([turns], [0])[0]
        assert answer.finish_reason == expect
        # generated: one token and the end-of-turn id (counted, as an OpenAI server's usage counts it), or six
        assert answer.completion_tokens == (2 if expect == "stop" else 6)
