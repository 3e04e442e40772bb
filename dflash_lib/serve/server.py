"""The engine's OpenAI-compatible server as a child process: started on a free loopback port, health-checked,
always stopped; the one place an engine is started. What to run comes from the engine's adapter (`ENGINES`:
vLLM's is `serve/vllm.py`). The engine lives in its own venv (`make engine`: vLLM's CPU build) or is the user's own
on GPUs; this project never imports it. Read docs/serving.md, "The engine in the loop"."""

from __future__ import annotations

import ctypes
import os
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


def _die_with_parent() -> None:  # pragma: no cover - runs in the child between fork and exec
    """The server gets SIGTERM when the process that started it dies (Linux prctl PR_SET_PDEATHSIG), so a
    killed parent never leaves an engine running."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)
    except OSError:
        pass


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
    flags of its adapter) on a free loopback port,
    waits for /health (at most `start_timeout_s`), and stops it on leaving, on errors and on Ctrl-C (SIGTERM to
    its process group, SIGKILL after STOP_GRACE_S); its output goes to `log`. `url` is the server's address."""

    def __init__(self, spec: EngineSpec, log: str | Path, python: str | None = None,
                 start_timeout_s: float = 600.0) -> None:
        self.spec, self.log = spec, Path(log)
        self.engine = engine_adapter(spec.engine)
        self.python = engine_python(python)
        self.start_timeout_s = start_timeout_s
        self.port = 0
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
        self.port = free_port()
        cmd = [str(self.python), "-m", self.engine.module, *self.engine.args(self.spec, self.port)]
        # the engine's venv only: our packages (another transformers) stay out, but what its adapter asks for
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | self.engine.env(self.spec)
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log, "ab") as out:
            out.write(("$ " + " ".join(cmd) + "\n").encode())
            out.flush()
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         env=env, start_new_session=True, preexec_fn=_die_with_parent)
        try:
            self._wait_healthy()
        except BaseException:
            self.stop()
            raise

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + self.start_timeout_s
        while True:
            code = self.proc.poll()
            if code is not None:
                raise RuntimeError(f"the engine exited with code {code} while starting; its log {self.log} ends:\n"
                                   f"{self.log_tail()}")
            try:
                if httpx.get(self.url + "/health", timeout=2.0).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"the engine did not answer {self.url}/health within {self.start_timeout_s:g} s; "
                                   f"its log {self.log} ends:\n{self.log_tail()}")
            time.sleep(0.5)

    def stop(self) -> None:
        """Stop the server and every process it started (idempotent)."""
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        for sig, wait in ((signal.SIGTERM, STOP_GRACE_S), (signal.SIGKILL, 10.0)):
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                return
            try:
                proc.wait(timeout=wait)
                break
            except subprocess.TimeoutExpired:
                continue
        deadline = time.monotonic() + 10.0
        while group_alive(proc.pid) and time.monotonic() < deadline:  # the engine core and its workers
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                break
            time.sleep(0.1)

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

