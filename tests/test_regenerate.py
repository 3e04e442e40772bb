"""Regeneration: the local backend on a tiny target (deterministic, resumable, torn line redone) and the openai
backend against a chat-completions server this test starts on 127.0.0.1 (concurrency, 5xx retried, 4xx named)."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from dflash_lib.config import from_params
from dflash_lib.data import load_conversations
from dflash_lib.regenerate import LocalBackend, RegenerateError, regenerate, report_path, scan_output

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


class ChatServer:
    """A chat-completions server on 127.0.0.1: answers from the tiny target (or canned text for "CANNED"
    prompts, finish "stop"), a 500 on the first "FAIL500" request, a 400 for "BAD400"."""

    def __init__(self, backend):
        self.backend, self.lock = backend, threading.Lock()
        self.inflight = self.max_inflight = self.requests = 0
        self.failed_once = False
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
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def handle(self, req):
        with self.lock:
            self.requests += 1
            self.inflight += 1
            self.max_inflight = max(self.max_inflight, self.inflight)
        try:
            time.sleep(0.05)  # let concurrent requests overlap
            assert req["model"] == "tiny-qwen3" and req["chat_template_kwargs"] == {"enable_thinking": False}
            last = req["messages"][-1]["content"]
            if "BAD400" in last:
                return 400, {"error": {"message": "context too long"}}
            if "FAIL500" in last and not self.failed_once:
                self.failed_once = True
                return 500, {"error": {"message": "overloaded"}}
            if "CANNED" in last:
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


def test_openai_400_names_the_record_and_loses_nothing(source, server, tmp_path):
    bad = tmp_path / "bad.jsonl"
    rows = [dict(c) for c in CONVS[:3]]
    rows.insert(2, {"id": "x", "conversations": [{"from": "human", "value": "BAD400"}, {"from": "gpt", "value": "?"}]})
    bad.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "out.jsonl"
    cfg = _cfg(bad, backend="openai", base_url=server.url, concurrency=2, retry_backoff_s=0.01, model="tiny-qwen3")
    with pytest.raises(RegenerateError, match=r"record 2: HTTP 400 .*context too long"):
        regenerate(cfg, out, progress=False)
    assert [json.loads(line)["id"] for line in out.read_text().splitlines()] == ["a", "b"]  # written, in order


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
    every answer lands at its own record. (The trainer's per-document attention builds no padding mask: a padded
    row then answered differently.)"""
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
        assert answer.completion_tokens == (1 if expect == "stop" else 6)
