"""A training run whose target is served by an engine the trainer starts (a stand-in engine: a few lines of
Python in its place, writing hidden states as our connector does) when that engine fails under it: an engine that
dies during the held-out evaluation ends the command in one line naming the engine's log, and SIGTERM while a step
waits on a hung engine saves the checkpoint of the last finished step and returns (issue 55, items 1 and 7)."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from pathlib import Path

import pytest

from dflash_lib.serve import server
from dflash_lib.serve.adapter import EngineAdapter
from dflash_lib.serve.vllm import PLUGINS

# A stand-in engine: `--port P --model M --aux IDS --out DIR`. /health; /v1/models naming M (with the bearer key of
# $VLLM_API_KEY); /v1/completions writes the prompt's "hidden states" [tokens, len(IDS), hidden] (float32, a
# function of token and layer) and token ids to DIR/<kv_transfer_params.name>.safetensors with our connector's
# identity (model_identity, on its PYTHONPATH) and names it. Its pid goes to $FAKE_OUT/pid; once $FAKE_OUT/hang
# exists it answers no more completions (each waits 600 s), after writing $FAKE_OUT/hung.
ENGINE = r'''
import http.server, json, os, sys, time
import numpy as np
from safetensors.numpy import save_file
from model_identity import config_sha256, weights_fingerprint
arg = lambda name: sys.argv[sys.argv.index(name) + 1]
port, model, aux, out = int(arg("--port")), arg("--model"), json.loads(arg("--aux")), arg("--out")
report, key = os.environ["FAKE_OUT"], os.environ["VLLM_API_KEY"]
hidden = json.load(open(os.path.join(model, "config.json")))["hidden_size"]
identity = {"aux_layer_ids": json.dumps(aux), "dtype": "float32", "model": model,
            "config_sha256": config_sha256(model), "weights_fingerprint": weights_fingerprint(model)}
open(os.path.join(report, "pid"), "w").write(str(os.getpid()))
class H(http.server.BaseHTTPRequestHandler):
    def answer(self, code, body=None):
        data = json.dumps(body).encode() if body is not None else b""
        self.send_response(code); self.send_header("Content-Length", str(len(data))); self.end_headers()
        self.wfile.write(data)
    def do_GET(self):
        if self.path == "/v1/models" and self.headers.get("Authorization") != f"Bearer {key}":
            return self.answer(401)
        self.answer(200, {"data": [{"id": model, "root": model}]} if self.path == "/v1/models" else None)
    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if os.path.exists(os.path.join(report, "hang")):
            open(os.path.join(report, "hung"), "w").write("")
            time.sleep(600)
        ids = np.asarray(body["prompt"], dtype=np.int64)
        states = np.sin(ids[:, None, None] * 0.01 + np.arange(len(aux))[None, :, None]
                        + np.arange(hidden)[None, None, :] * 0.1).astype(np.float32)
        path = os.path.join(out, body["kv_transfer_params"]["name"] + ".safetensors")
        save_file({"hidden_states": states, "token_ids": ids}, path + ".tmp", metadata=identity)
        os.replace(path + ".tmp", path)
        self.answer(200, {"choices": [{"text": ""}], "kv_transfer_params": {"hidden_states_path": path}})
    def log_message(self, *a): pass
http.server.ThreadingHTTPServer(("127.0.0.1", port), H).serve_forever()
'''

RUN = ["-p", "steps", "20", "-p", "target_layer_ids", "[1, 3]", "-p", "num_features", "2", "-p", "limit", "100",
       "-p", "heldout_fraction", "0.1", "-p", "target_engine", "vllm", "-p", "engine_python", sys.executable]


def _stand_in(tmp_path: Path, monkeypatch) -> Path:
    """The stand-in registered as the engine "vllm" the trainer starts; returns the folder it reports into."""
    (tmp_path / "stand_in_engine.py").write_text(ENGINE)
    report = tmp_path / "report"
    report.mkdir()
    fake = EngineAdapter(
        name="vllm", module="stand_in_engine",
        args=lambda spec, port: ["--port", str(port), "--model", str(Path(spec.target).resolve()), "--aux",
                                 str(list(spec.hidden_states)), "--out", spec.hidden_states_dir],
        env=lambda spec: {"PYTHONPATH": os.pathsep.join([str(tmp_path), str(PLUGINS)]), "FAKE_OUT": str(report)},
        dtype=lambda target, cpu: "float32", known_fault=lambda version, t: "", spec_prefix="fake:", load_metrics={})
    monkeypatch.setitem(server.ENGINES, "vllm", fake)
    return report


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> Path:
    from test_served_target import _tiny_target

    return _tiny_target(tmp_path_factory.mktemp("target"), "qwen3")


def _train(run_dir: Path, target: Path, *more: str) -> int:
    from dflash_lib.__main__ import main

    return main(["train", "--preset", "smoke", "--run-dir", str(run_dir), "-p", "target", str(target), *RUN, *more])


def test_an_engine_that_dies_during_the_held_out_pass_is_one_line_naming_its_log(tmp_path, monkeypatch, target,
                                                                                 capsys):
    """The engine is killed (its whole process group, SIGKILL) as the run's held-out evaluation starts: the
    command ends with exit 1 and one line naming the engine's log, no traceback."""
    import dflash_lib.train.heldout as heldout

    report = _stand_in(tmp_path, monkeypatch)
    real = heldout.evaluate

    def dies_first(*args, **kwargs):
        pid = int((report / "pid").read_text())
        os.killpg(pid, signal.SIGKILL)
        deadline = time.monotonic() + 20
        while server.group_alive(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        return real(*args, **kwargs)

    monkeypatch.setattr(heldout, "evaluate", dies_first)
    run_dir = tmp_path / "run"
    assert _train(run_dir, target, "-p", "cache_dir", str(tmp_path / "stores")) == 1  # tokenized here, as on a
    text = capsys.readouterr().err  # fresh clone: its progress bars go to stderr too
    err = [line for line in text.strip().splitlines() if "record/s" not in line]  # less the tokenizing bars
    assert len(err) == 1 and err[0].startswith("error: EngineError: the engine at http://127.0.0.1:"), err
    assert f"its log: {run_dir / 'engine-target.log'}" in err[0] and "Traceback" not in text


@pytest.mark.parametrize("drained_s", [0.0, 3.0])
def test_sigterm_while_a_step_waits_on_a_hung_engine_saves_the_last_step_and_returns(tmp_path, monkeypatch, target,
                                                                                   capsys, drained_s):
    """The engine hangs after the run's second step (every request from then on waits 600 s); SIGTERM as a
    request first waits on it (steps read ahead may still be trained on) or `drained_s` later (the loop waits on
    the engine for its next step): the trainer gives the requests in flight STOP_WAIT_S more (here 1 s), then
    saves the checkpoint of the last finished step and returns, in seconds rather than two 600 s timeouts."""
    import dflash_lib.serve.hidden_states as hs
    from dflash_lib.rundir.checkpoints import list_checkpoints
    from run_folder import metrics_rows

    monkeypatch.setattr(hs, "STOP_WAIT_S", 1.0)
    report = _stand_in(tmp_path, monkeypatch)
    run_dir = tmp_path / "run"
    sent: list[float] = []

    def terminate_when_hung() -> None:  # the engine hangs after 2 steps; SIGTERM once a request waits on it
        deadline = time.monotonic() + 120
        while not ((run_dir / "metrics.jsonl").is_file() and len(metrics_rows(run_dir)) >= 2):
            assert time.monotonic() < deadline
            time.sleep(0.05)
        (report / "hang").write_text("")
        while not (report / "hung").is_file() and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(drained_s)
        sent.append(time.monotonic())
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=terminate_when_hung, daemon=True).start()
    rc = _train(run_dir, target)
    waited = time.monotonic() - sent[0]
    out = capsys.readouterr()
    steps = [r["step"] for r in metrics_rows(run_dir) if "loss" in r]
    saved = [int(p.name.split("-")[1]) for p in list_checkpoints(run_dir / "checkpoints")]
    assert rc == 0, out.err[-2000:]
    assert steps and saved == [steps[-1]] and steps[-1] < 20  # the last finished step, before the run's end
    assert "stopped (SIGTERM)" in out.out and "has not answered" in out.out
    assert waited < 60  # a generous bound: STOP_WAIT_S is 1 s here, the engine's timeouts 2 x 600 s
