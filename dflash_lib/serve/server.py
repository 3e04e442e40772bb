"""vLLM's OpenAI-compatible server as a child process: started on a free loopback port, health-checked, always
stopped. The engine lives in its own venv (`make engine`: vLLM's CPU build) or is the user's own vLLM on GPUs;
this project never imports vllm. Read docs/serving.md, "The engine in the loop"."""

from __future__ import annotations

import ctypes
import json
import os
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from dflash_lib.config import ConfigError, text_config_doc
from dflash_lib.rundir import REPO_ROOT

ENGINE_VENV = REPO_ROOT / ".venv-engine"  # `make engine`
ENGINE_PYTHON_ENV = "DFLASH_ENGINE_PYTHON"  # a Python whose vllm is the engine (the user's own on GPUs)
SERVER_MODULE = "vllm.entrypoints.openai.api_server"  # `vllm serve` without the CLI's package-name lookup
STOP_GRACE_S = 30.0  # seconds between SIGTERM and SIGKILL of the server's process group
PLUGINS = Path(__file__).resolve().parent / "engine_plugins"  # modules the engine imports (its PYTHONPATH)
HIDDEN_STATES_CONNECTOR = "DFlashHiddenStatesConnector"  # engine_plugins/dflash_hidden_states.py


def engine_python(given: str | None = None) -> Path:
    """The Python that runs the engine: `given`, else $DFLASH_ENGINE_PYTHON, else `make engine`'s
    .venv-engine/bin/python. ConfigError naming what was looked for when it does not exist."""
    path = given or os.environ.get(ENGINE_PYTHON_ENV) or str(ENGINE_VENV / "bin" / "python")
    if not Path(path).is_file():
        raise ConfigError(f"no engine Python at {path}: run `make engine` (vLLM's CPU build in .venv-engine), or "
                          f"point -p engine_python / ${ENGINE_PYTHON_ENV} at a Python with vLLM installed, or give "
                          "-p engine_url of a running server")
    return Path(path)


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (the kernel's choice)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def drafter_block_size(export_dir: str | Path) -> int:
    """B of an exported drafter (its config.json's block_size, else dflash_config's): it drafts B - 1 tokens."""
    path = Path(export_dir) / "config.json"
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"{path}: not a readable exported drafter config ({e})") from None
    block = doc.get("block_size") or (doc.get("dflash_config") or {}).get("block_size")
    if not isinstance(block, int) or block < 2:
        raise ConfigError(f"{path}: block_size {block!r} is not an integer >= 2")
    return block


LINEAR_ATTENTION_TYPES = ("qwen3_next", "qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text")  # gated delta net


def linear_attention_target(target: str | Path) -> bool:
    """The target folder's config (a vision-language wrapper's text config) has linear-attention layers (Qwen3.5,
    Qwen3-Next: gated delta net between full attention). False for a folder without a readable config.json."""
    try:
        doc = json.loads((Path(target) / "config.json").read_text())
    except (OSError, ValueError):
        return False
    text = text_config_doc(doc)
    if not isinstance(text, dict):
        return False
    return "linear_attention" in (text.get("layer_types") or ()) or text.get("model_type") in LINEAR_ATTENTION_TYPES


def engine_dtype(target: str | Path, on_cpu: bool) -> str:
    """The dtype to serve `target` in, matching our decoding where the engine can: float32 on CPU (greedy then
    agrees exactly), bfloat16 on GPUs and for a linear-attention target on CPU (vLLM's CPU gated-delta-net kernel
    runs bf16 only: "CPU GDN attention requires BF16", vllm 0.32 `mamba/ops/cpu/gdn_attention.py`)."""
    return "float32" if on_cpu and not linear_attention_target(target) else "bfloat16"


@dataclass(frozen=True)
class EngineSpec:
    """What the server serves and how (vLLM's own flags, written out by `args`)."""

    target: str  # the target's local Hugging Face folder
    drafter: str | None = None  # an exported DFlash drafter folder; None: the target alone
    dtype: str = "float32"  # float32 | bfloat16 (the CPU build runs both)
    max_model_len: int = 2048  # tokens per sequence, prompt and answer
    max_num_seqs: int = 8  # sequences decoded at once
    kv_cache_gib: float = 1.0  # the KV cache's size (GiB; --kv-cache-memory-bytes, the CPU build's too)
    seed: int = 0  # the engine's sampling seed (requests may give their own)
    token_ids: bool = True  # prompts and answers as token ids, no tokenizer; False: the folder's tokenizer and chat
    # template serve text too (the chat endpoint `regenerate --backend openai` uses)
    extra: tuple[str, ...] = field(default_factory=tuple)  # more server flags, verbatim
    hidden_states: tuple[int, ...] = ()  # vLLM's aux layer ids (`hidden_states.engine_layer_ids`) whose hidden
    # states each request writes to `hidden_states_dir` (vLLM's extract_hidden_states + our connector); no drafter
    hidden_states_dir: str = ""

    def speculative_config(self) -> dict[str, Any] | None:
        """DFlash with K = B - 1 drafted tokens per step (None without a drafter), sampled drafts at T > 0 judged
        by the standard rule min(1, p/q), as our speculative sampling (vLLM's default "greedy" drafts its argmax
        and accepts it with probability p(argmax q): another rule, another acceptance)."""
        if self.hidden_states:
            return {"method": "extract_hidden_states", "num_speculative_tokens": 1,
                    "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": list(self.hidden_states)}}}
        if self.drafter is None:
            return None
        k = drafter_block_size(self.drafter) - 1
        return {"method": "dflash", "model": str(Path(self.drafter).resolve()), "num_speculative_tokens": k,
                "draft_sample_method": "probabilistic"}

    def args(self, port: int) -> list[str]:
        """The server's flags: eager mode, loopback only, and (`token_ids`) prompts and answers as token ids with
        no tokenizer: the engine sees exactly the ids we decode."""
        out = ["--model", str(Path(self.target).resolve()), "--host", "127.0.0.1", "--port", str(port),
               "--dtype", self.dtype, "--max-model-len", str(self.max_model_len), "--max-num-seqs",
               str(self.max_num_seqs), "--seed", str(self.seed), "--kv-cache-memory-bytes",
               str(int(self.kv_cache_gib * 2**30)), "--enforce-eager"]
        if self.token_ids:
            out.append("--skip-tokenizer-init")
        spec = self.speculative_config()
        if spec is not None:
            out += ["--speculative-config", json.dumps(spec)]
            if linear_attention_target(self.target):  # prefix caching puts the recurrent state in vLLM's "align"
                out.append("--no-enable-prefix-caching")  # mode, whose copy kernel is Triton's: none on CPU
        if self.hidden_states:
            out += ["--kv-transfer-config", json.dumps(self.kv_transfer_config())]
        return out + list(self.extra)

    def kv_transfer_config(self) -> dict[str, Any]:
        """Our connector (`engine_plugins/`, on the engine's PYTHONPATH) writing each request's hidden states of
        the `hidden_states` layers into `hidden_states_dir`."""
        return {"kv_connector": HIDDEN_STATES_CONNECTOR, "kv_connector_module_path": "dflash_hidden_states",
                "kv_role": "kv_producer", "kv_connector_extra_config": {"shared_storage_path": self.hidden_states_dir}}


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
    """`with EngineServer(spec, log) as server:` starts vLLM's server (`engine_python`) on a free loopback port,
    waits for /health (at most `start_timeout_s`), and stops it on leaving, on errors and on Ctrl-C (SIGTERM to
    its process group, SIGKILL after STOP_GRACE_S); its output goes to `log`. `url` is the server's address."""

    def __init__(self, spec: EngineSpec, log: str | Path, python: str | None = None,
                 start_timeout_s: float = 600.0) -> None:
        self.spec, self.log = spec, Path(log)
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
        cmd = [str(self.python), "-m", SERVER_MODULE, *self.spec.args(self.port)]
        # the engine's venv only: our packages (another transformers) stay out
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        if self.spec.hidden_states:  # our connector, and nothing else of ours
            env["PYTHONPATH"] = str(PLUGINS)
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

