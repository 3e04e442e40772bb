"""The engine as a child process and who talks to it, with stand-in engines (a few lines of standard-library Python
started through `EngineServer` as vLLM is): its whole process group stopped whatever became of its leader, no
preexec_fn and a parent-death watch, its own API key (in its environment, never argv or log) sent by every
client, another process on its port refused, proxies ignored on loopback, a failed start in one line with its
log's last lines, private folders and files, and a stop that bounds the wait on a hung engine."""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from dflash_lib.config import ConfigError
from dflash_lib.serve import server
from dflash_lib.serve.adapter import EngineAdapter, EngineSpec
from dflash_lib.serve.connection import EngineError, api_key, is_loopback
from dflash_lib.serve.engine_plugins.file_names import hidden_states_file

# A stand-in engine: `--port P --model M`, FAKE_MODE from its environment: "serve" answers /health and, with the
# bearer key of $VLLM_API_KEY, /v1/models naming M (401 without it); "child" also starts a process of its group
# that outlives it (the engine core), its pid in FAKE_OUT/child; "crash" starts that process, logs 12 lines and
# exits 3 while starting; "nobind" never listens. Every mode writes its argv and key to FAKE_OUT/argv.json.
FAKE_ENGINE = r'''
import http.server, json, os, subprocess, sys, time
port, model = int(sys.argv[sys.argv.index("--port") + 1]), sys.argv[sys.argv.index("--model") + 1]
mode, out, key = os.environ["FAKE_MODE"], os.environ["FAKE_OUT"], os.environ.get("VLLM_API_KEY", "")
json.dump({"argv": sys.argv, "cmdline": open("/proc/self/cmdline").read(), "key": key}, open(out + "/argv.json", "w"))
if mode in ("child", "crash"):
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    open(out + "/child", "w").write(str(child.pid))
if mode == "crash":
    for i in range(12):
        print(f"engine line {i}", flush=True)
    sys.exit(3)
if mode == "nobind":
    time.sleep(600)
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        if self.path == "/v1/models" and self.headers.get("Authorization") != f"Bearer {key}":
            self.send_response(401); self.end_headers(); return
        body = json.dumps({"data": [{"id": model, "root": model}]}).encode() if self.path == "/v1/models" else b""
        self.send_response(200 if self.path in ("/health", "/v1/models") else 404); self.end_headers()
        self.wfile.write(body)
    def log_message(self, *a): pass
http.server.HTTPServer(("127.0.0.1", port), H).serve_forever()
'''


def _fake(tmp_path: Path, monkeypatch, mode: str) -> tuple[EngineSpec, Path]:
    """The stand-in registered as engine "fake" in `mode`; (its spec, the folder it reports into)."""
    (tmp_path / "fake_engine.py").write_text(FAKE_ENGINE)
    out = tmp_path / "out"
    out.mkdir(exist_ok=True)
    fake = EngineAdapter(name="fake", module="fake_engine",
                         args=lambda spec, port: ["--port", str(port), "--model", str(Path(spec.target).resolve())],
                         env=lambda spec: {"PYTHONPATH": str(tmp_path), "FAKE_MODE": mode, "FAKE_OUT": str(out)},
                         dtype=lambda target, cpu: "float32", known_fault=lambda version, t: "", spec_prefix="fake:",
                         load_metrics={})
    monkeypatch.setitem(server.ENGINES, "fake", fake)
    (tmp_path / "target").mkdir(exist_ok=True)
    return EngineSpec(str(tmp_path / "target"), engine="fake"), out


def _wait_for(path: Path, timeout_s: float = 20.0) -> str:
    deadline = time.monotonic() + timeout_s
    while not path.is_file() or not path.read_text():
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.05)
    return path.read_text()


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_a_stop_ends_the_engine_core_whose_api_server_died_first(tmp_path, monkeypatch):
    """The leader (vLLM's API server) crashed or was OOM-killed: stop() still ends its group's other processes
    (the engine core, the workers), which would keep running and holding memory."""
    spec, out = _fake(tmp_path, monkeypatch, "child")
    s = server.EngineServer(spec, tmp_path / "e.log", sys.executable, start_timeout_s=60)
    s.start()
    child, leader = int(_wait_for(out / "child")), s.proc
    try:
        os.kill(leader.pid, signal.SIGKILL)
        leader.wait(timeout=10)
        assert _alive(child)
        s.stop()
        assert not _alive(child) and server.group_alive(leader.pid) == []
    finally:
        if _alive(child):
            os.kill(child, signal.SIGKILL)


def test_an_engine_exiting_while_starting_is_one_line_with_its_log_and_leaves_no_process(tmp_path, monkeypatch):
    spec, out = _fake(tmp_path, monkeypatch, "crash")
    s = server.EngineServer(spec, tmp_path / "e.log", sys.executable, start_timeout_s=60)
    with pytest.raises(EngineError) as e:
        s.start()
    child = int(_wait_for(out / "child"))
    try:
        message = str(e.value)
        assert "\n" not in message and "exited with code 3 while starting" in message and str(tmp_path / "e.log") in message
        assert "engine line 11" in message and "engine line 4" in message and "engine line 3" not in message
        assert not _alive(child) and s.proc is None
    finally:
        if _alive(child):
            os.kill(child, signal.SIGKILL)


def test_the_engine_starts_without_preexec_fn_and_dies_with_the_process_that_started_it(tmp_path, monkeypatch):
    """No preexec_fn (it can deadlock between fork and exec while threads run); the parent-death watch runs in the
    engine's own Python instead: the process that started the engine is killed, the engine gets SIGTERM."""
    spec, out = _fake(tmp_path, monkeypatch, "serve")
    seen = []
    real = subprocess.Popen

    def popen(*a, **k):
        seen.append(k)
        return real(*a, **k)

    monkeypatch.setattr(server.subprocess, "Popen", popen)
    with server.EngineServer(spec, tmp_path / "e.log", sys.executable, start_timeout_s=60):
        pass
    assert seen and "preexec_fn" not in seen[0] and seen[0]["start_new_session"]
    starter = (f"import sys; sys.path[:0] = [{str(Path(__file__).parent)!r}]\n"
               "from test_serve_lifecycle import _fake\n"
               "from dflash_lib.serve import server\n"
               "import os, pathlib, pytest\n"
               "mp = pytest.MonkeyPatch()\n"
               f"spec, out = _fake(pathlib.Path({str(tmp_path)!r}), mp, 'serve')\n"
               f"s = server.EngineServer(spec, {str(tmp_path / 'e2.log')!r}, sys.executable, start_timeout_s=60)\n"
               "s.start(); print(s.proc.pid, flush=True); os._exit(0)\n")
    done = subprocess.run([sys.executable, "-c", starter], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert done.returncode == 0, done.stderr[-2000:]
    pid = int(done.stdout.split()[-1])
    deadline = time.monotonic() + 10
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    alive = _alive(pid)
    if alive:
        os.killpg(pid, signal.SIGKILL)
    assert not alive, "the engine outlived the process that started it"


def test_the_engines_key_is_in_its_environment_only_and_every_client_sends_it(tmp_path, monkeypatch):
    """A key of its own, never in argv (the log records it, `ps` shows it): /v1 refuses a request without it, and
    our clients (the health check, EngineClient) send it; forgotten once the engine stops."""
    from dflash_lib.serve.client import EngineClient

    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    spec, out = _fake(tmp_path, monkeypatch, "serve")
    with server.EngineServer(spec, tmp_path / "e.log", sys.executable, start_timeout_s=60) as s:
        seen = json.loads(_wait_for(out / "argv.json"))
        assert len(s.api_key) >= 32 and seen["key"] == s.api_key
        assert s.api_key not in seen["cmdline"] and s.api_key not in (tmp_path / "e.log").read_text()
        assert httpx.get(s.url + "/v1/models", trust_env=False).status_code == 401
        client = EngineClient(s.url)
        assert client.models()[0]["root"] == str((tmp_path / "target").resolve())
        client.close()
    assert api_key(s.url) == ""
    assert stat.S_IMODE((tmp_path / "e.log").stat().st_mode) == 0o600


def test_another_process_on_the_engines_port_is_refused(tmp_path, monkeypatch):
    """The port picked was taken by another server (a race): it answers /health, but /v1/models does not name our
    target, so it is not our engine."""
    import http.server

    class Other(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body = json.dumps({"data": [{"id": "/models/other", "root": "/models/other"}]}).encode()
            self.send_response(200)
            self.end_headers()
            self.wfile.write(body if self.path == "/v1/models" else b"")

        def log_message(self, *a):
            pass

    other = http.server.HTTPServer(("127.0.0.1", 0), Other)
    threading.Thread(target=other.serve_forever, daemon=True).start()
    spec, _ = _fake(tmp_path, monkeypatch, "nobind")
    monkeypatch.setattr(server, "free_port", lambda: other.server_address[1])
    try:
        s = server.EngineServer(spec, tmp_path / "e.log", sys.executable, start_timeout_s=30)
        with pytest.raises(EngineError, match="does not name our target .*another process holds the port") as e:
            s.start()
        assert "\n" not in str(e.value) and s.proc is None
    finally:
        other.shutdown()


def test_loopback_clients_ignore_the_environments_proxies(tmp_path, monkeypatch):
    """HTTP_PROXY / ALL_PROXY without NO_PROXY for loopback (common on clusters): every request to our local
    engine would go to the proxy (here: nothing listens there). The engine starts and answers all the same."""
    from dflash_lib.serve.client import EngineClient

    dead = "http://127.0.0.1:9"
    for name in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy"):
        monkeypatch.setenv(name, dead)
    for name in ("NO_PROXY", "no_proxy"):
        monkeypatch.delenv(name, raising=False)
    assert is_loopback("http://127.0.0.1:8000") and is_loopback("http://localhost:1") and is_loopback("http://[::1]:2")
    assert not is_loopback("http://engine:8000")
    spec, _ = _fake(tmp_path, monkeypatch, "serve")
    with server.EngineServer(spec, tmp_path / "e.log", sys.executable, start_timeout_s=20) as s:
        client = EngineClient(s.url)
        assert client.models()[0]["id"] == str((tmp_path / "target").resolve())
        client.close()


def test_request_names_the_file_system_refuses_are_refused_by_our_connector():
    ok, why = hidden_states_file("/out", "dflash-abc-1-ffff")
    assert (ok, why) == ("/out/dflash-abc-1-ffff.safetensors", "")
    assert hidden_states_file("/out", "../../etc/x")[0] == "/out/x.safetensors"  # inside its folder
    for name, says in (("a\0b", "NUL"), ("x" * 250, "over 255 bytes"), ("", "empty"), ("\ud800", "encoded")):
        path, why = hidden_states_file("/out", name)
        assert path == "" and says in why


def test_the_engines_folder_is_private(tmp_path, monkeypatch):
    spec, _ = _fake(tmp_path, monkeypatch, "serve")
    folder = tmp_path / "run" / "engine_hidden_states"
    from dataclasses import replace

    with server.EngineServer(replace(spec, hidden_states_dir=str(folder)), tmp_path / "e.log", sys.executable,
                             start_timeout_s=60):
        assert stat.S_IMODE(folder.stat().st_mode) == 0o700


def test_a_stop_bounds_the_wait_on_a_hung_engine(tmp_path, monkeypatch):
    """SIGTERM while a step's documents wait on a hung engine: the trainer's stop handler tells the client, which
    gives up STOP_WAIT_S later in one line (not after two 600 s timeouts)."""
    import dflash_lib.serve.hidden_states as hs
    from dflash_lib.train.state import StopRequest
    from test_served_target import _files

    release = threading.Event()

    def hung(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "m"}]})
        release.wait(60)
        return httpx.Response(500)

    monkeypatch.setattr(hs, "STOP_WAIT_S", 0.5)
    client = hs.HiddenStatesClient("http://engine", _files(tmp_path), 3, concurrency=2,
                                   transport=httpx.MockTransport(hung))
    result: list[BaseException | None] = []

    def fetch() -> None:
        try:
            client.fetch([[1, 2], [3], [4]])
            result.append(None)
        except BaseException as e:  # noqa: BLE001
            result.append(e)

    t = threading.Thread(target=fetch, daemon=True)
    t.start()
    try:
        with StopRequest() as stop:
            stop.on_request.append(client.stop_waiting)
            time.sleep(0.3)
            t0 = time.monotonic()
            os.kill(os.getpid(), signal.SIGTERM)
            t.join(10)
            waited = time.monotonic() - t0
        assert stop.reason == "SIGTERM" and result, "the fetch still waits on the hung engine"
        assert isinstance(result[0], EngineError) and "\n" not in str(result[0]) and waited < 5
        assert "a stop was asked and the engine at http://engine has not answered" in str(result[0])
    finally:
        release.set()
        client.close()


def test_an_engine_that_dies_mid_run_is_named_with_its_log(tmp_path, monkeypatch):
    """The engine started here stops answering: the document's error is one line naming its log, and so is what
    `evaluate` reports of its decoding (a failure, not an httpx traceback)."""
    import dflash_lib.serve.hidden_states as hs
    from dflash_lib.serve.connection import forget, register
    from dflash_lib.serve.measure import ServedPass, ServedSet, decode_passes
    from loopback import free_port
    from test_served_target import _files

    monkeypatch.setattr(hs, "FILE_WAIT_S", 0.1)
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens: the engine is gone
    register(url, "k", tmp_path / "engine.log")
    try:
        client = hs.HiddenStatesClient(url, _files(tmp_path), 3, concurrency=1)
        with pytest.raises(EngineError) as e:
            client.fetch([[1, 2, 3]])
        client.close()
        assert "\n" not in str(e.value) and f"its log: {tmp_path / 'engine.log'}" in str(e.value)
        run = decode_passes(str(tmp_path), str(tmp_path), [ServedPass([ServedSet("s", [[1, 2]], [], [])])], 4, 8,
                            url=url, plain=False)
        assert run.served == [] and "ConnectError" in run.failure and "its log:" in run.failure
    finally:
        forget(url)


def test_a_dead_or_foreign_engine_url_in_evaluate_is_one_line(tmp_path):
    import http.server

    from dflash_lib.config import from_params, preset
    from dflash_lib.evaluate import check_engine
    from loopback import free_port

    class Html(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.end_headers()
            self.wfile.write(b"<html>a login page</html>")

        def log_message(self, *a):
            pass

    html = http.server.HTTPServer(("127.0.0.1", 0), Html)
    threading.Thread(target=html.serve_forever, daemon=True).start()
    try:
        for url, says in ((f"http://127.0.0.1:{free_port()}", "ConnectError"),
                          (f"http://127.0.0.1:{html.server_address[1]}", "JSONDecodeError")):
            config = from_params({"target": str(tmp_path), "engine": "vllm", "engine_url": url}, preset("smoke"))
            with pytest.raises(ConfigError, match=f"engine_url {url}: no usable answer to /v1/models .*{says}") as e:
                check_engine(config)
            assert "\n" not in str(e.value)
    finally:
        html.shutdown()


def test_an_engine_error_ends_the_command_in_one_line(monkeypatch, capsys):
    """`train` and every other command: an engine's failure is one line and exit 1, never a traceback."""
    from dflash_lib.__main__ import main
    import dflash_lib.train.loop as loop

    def dies(*a, **k):
        raise EngineError("the engine at http://127.0.0.1:1 gave no usable hidden states; its log: /run/e.log")

    monkeypatch.setattr(loop, "train", dies)
    assert main(["train", "--preset", "smoke"]) == 1
    err = capsys.readouterr().err
    assert err == ("error: EngineError: the engine at http://127.0.0.1:1 gave no usable hidden states; its log: "
                   "/run/e.log\n")
