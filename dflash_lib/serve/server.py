"""The engine's OpenAI-compatible server as a child process: started on a free loopback port with an API key of
its own (`connection`), health-checked (its /v1/models names our target), always stopped with its whole process
group; the one place an engine is started. What to run comes from the engine's adapter (`ENGINES`:
vLLM's is `serve/vllm.py`). The engine lives in its own venv (`make engine`: vLLM's CPU build) or is the user's own
on GPUs; this project never imports it. Read docs/serving.md, "The engine in the loop"."""

from __future__ import annotations

import os
import secrets
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

import httpx

from dflash_lib.config import ConfigError
from dflash_lib.rundir import REPO_ROOT
from dflash_lib.serve.adapter import EngineAdapter, EngineSpec
from dflash_lib.serve.connection import EngineError, forget, http_client, register
from dflash_lib.serve.vllm import VLLM

ENGINE_VENV = REPO_ROOT / ".venv-engine"  # `make engine`
ENGINE_PYTHON_ENV = "DFLASH_ENGINE_PYTHON"  # a Python whose vllm is the engine (the user's own on GPUs)
STOP_GRACE_S = 30.0  # seconds between SIGTERM and SIGKILL of the server's process group
ENGINES = {VLLM.name: VLLM}  # the engines a spec may name (`EngineSpec.engine`)


def engine_python(given: str | None = None) -> Path:
    """The Python that runs the engine: `given`, else $DFLASH_ENGINE_PYTHON, else `make engine`'s
    .venv-engine/bin/python. ConfigError naming what was looked for when it does not exist."""
    path = given or os.environ.get(ENGINE_PYTHON_ENV) or str(ENGINE_VENV / "bin" / "python")
    if not Path(path).is_file():
        raise ConfigError(f"no engine Python at {path}: run `make engine` (vLLM's CPU build in .venv-engine), or "
                          f"point -p engine_python / ${ENGINE_PYTHON_ENV} at a Python with vLLM installed, or give "
                          "-p engine_url of a running server")
    return Path(path)


def engine_adapter(name: str) -> EngineAdapter:
    """The adapter of the engine called `name`; ConfigError listing the known ones."""
    if name not in ENGINES:
        raise ConfigError(f"engine {name!r} is not one of {sorted(ENGINES)}")
    return ENGINES[name]


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (the kernel's choice)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# Runs first in the engine's Python (no preexec_fn: a fork of a process with threads may deadlock before exec):
# asks Linux for SIGTERM when the process that started it dies (PR_SET_PDEATHSIG, kept across exec), stops at once
# when that process has died already, then becomes the engine's server (exec: same pid, the group's leader).
PARENT_WATCH = ("import ctypes, os, signal, sys\n"
                "try:\n"
                "    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)\n"
                "except (OSError, AttributeError):\n"
                "    pass\n"
                "if os.getppid() != int(sys.argv[1]):\n"
                "    sys.exit(1)\n"
                "os.execv(sys.executable, [sys.executable, *sys.argv[2:]])\n")


def private_folder(path: str | Path) -> Path:
    """`path` made (parents too) and readable by its owner alone (0700): the engine writes the user's hidden
    states there."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    os.chmod(path, 0o700)
    return path


def group_alive(pgid: int) -> list[int]:
    """The pids of process group `pgid` that still run (zombies, dead but not yet reaped, left out; Linux /proc)."""
    alive = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()  # after "pid (comm)": state, ppid, pgrp, ...
        except (OSError, IndexError):
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            alive.append(int(stat.parent.name))
    return alive


class EngineServer:
    """`with EngineServer(spec, log) as server:` starts the spec's engine's server (`engine_python`, the module and
    flags of its adapter) on a free loopback port with an API key of its own (`api_key`: in its environment, never
    its argv), waits until /health answers and /v1/models names the spec's target (at most `start_timeout_s`), and
    stops it and every process of its group on leaving, on errors and on Ctrl-C (SIGTERM, SIGKILL after
    STOP_GRACE_S), whatever became of its leader; its output goes to `log` (0600). `url` is the server's address."""

    def __init__(self, spec: EngineSpec, log: str | Path, python: str | None = None,
                 start_timeout_s: float = 600.0) -> None:
        self.spec, self.log = spec, Path(log)
        self.engine = engine_adapter(spec.engine)
        self.python = engine_python(python)
        self.start_timeout_s = start_timeout_s
        self.port = 0
        self.api_key = ""
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> "EngineServer":
        self.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def start(self) -> None:
        self.port, self.api_key = free_port(), secrets.token_urlsafe(32)
        cmd = [str(self.python), "-m", self.engine.module, *self.engine.args(self.spec, self.port)]
        # the engine's venv only: our packages (another transformers) stay out, but what its adapter asks for
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | self.engine.env(self.spec)
        env[self.engine.api_key_env] = self.api_key
        if self.spec.hidden_states_dir:
            private_folder(self.spec.hidden_states_dir)
        self.log.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        with open(fd, "ab") as out:
            out.write(("$ " + " ".join(cmd) + "\n").encode())  # (the key is in the environment, not here)
            out.flush()
            launch = [str(self.python), "-c", PARENT_WATCH, str(os.getpid()), *cmd[1:]]
            self.proc = subprocess.Popen(launch, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         env=env, start_new_session=True)
        register(self.url, self.api_key, self.log)
        try:
            self._wait_healthy()
        except BaseException:
            self.stop()
            raise

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + self.start_timeout_s
        target = str(Path(self.spec.target).resolve())
        with http_client(self.url, 2.0) as http:
            while True:
                code = self.proc.poll()
                if code is not None:
                    raise EngineError(f"the engine exited with code {code} while starting; its log {self.log} ends: "
                                      f"{self.log_tail(8, ' | ')}")
                try:
                    if http.get(self.url + "/health").status_code == 200:
                        self._check_ours(http.get(self.url + "/v1/models"), target)
                        return
                except httpx.TransportError:
                    pass
                if time.monotonic() > deadline:
                    raise EngineError(f"the engine did not answer {self.url}/health within "
                                      f"{self.start_timeout_s:g} s; its log {self.log} ends: {self.log_tail(8, ' | ')}")
                time.sleep(0.5)

    def _check_ours(self, reply: httpx.Response, target: str) -> None:
        """EngineError unless /v1/models, asked with our key, names the spec's target: another process on the
        port (taken between `free_port` and the engine's bind) is not our engine."""
        try:
            names = [str(m.get(k)) for m in reply.json()["data"] for k in ("root", "id")] if reply.is_success else []
        except (ValueError, KeyError, TypeError, AttributeError):
            names = []
        if target not in names:
            raise EngineError(f"{self.url} answers /health but its /v1/models (HTTP {reply.status_code}) does not "
                              f"name our target {target}: another process holds the port; its log {self.log}")

    def stop(self) -> None:
        """Stop the server and every process of its group (idempotent): the engine core and workers too when the
        leader exited first (a crash, an OOM kill, an exit while starting)."""
        proc, self.proc = self.proc, None
        if self.port:
            forget(self.url)
        if proc is None:
            return
        pgid = proc.pid  # start_new_session: the leader's pid names the group
        for sig, wait in ((signal.SIGTERM, STOP_GRACE_S), (signal.SIGKILL, 10.0)):
            proc.poll()  # reaps a dead leader (a zombie is not counted alive)
            if not group_alive(pgid):
                return
            try:
                os.killpg(pgid, sig)
            except ProcessLookupError:
                return
            deadline = time.monotonic() + wait
            while time.monotonic() < deadline:
                proc.poll()
                if not group_alive(pgid):
                    return
                time.sleep(0.05)

    def log_tail(self, lines: int = 30, sep: str = "\n") -> str:
        try:
            return sep.join(line.strip() for line in self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"
