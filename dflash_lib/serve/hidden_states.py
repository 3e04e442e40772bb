"""The engine's hidden states of a document (`-p target_engine vllm`): the engine writes each document's hidden states
to a file through our KV connector (`engine_plugins/`); `HiddenStatesClient` asks for them and reads each file,
checked against this run's `EngineFiles` (layers in vLLM's numbering, `engine_layer_ids`; dtype; the target's
identity). The target served this way, as the trainer reads it: `dflash_lib/target/served.py`. docs/scale.md, "The
target served by an engine".
"""

from __future__ import annotations

import hashlib
import itertools
import json
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import httpx
import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file

from dflash_lib.config import ConfigError
from dflash_lib.models.drafters.dflash import vllm_aux_layer_ids
from dflash_lib.serve.connection import EngineError, http_client, log_note
from dflash_lib.serve.engine_plugins.model_identity import config_sha256, weights_fingerprint

FILE_WAIT_S = 60.0  # seconds a response's file may take to appear (the engine writes it in its next step)
RETRIES = 1  # a request whose file is missing or wrong is sent again this many times, then the step fails
STOP_WAIT_S = 30.0  # seconds a fetch still waits for the engine once a stop was asked (SIGTERM): a hung engine's
# 600 s timeout, retried, would outlast a scheduler's grace period


def engine_layer_ids(layer_ids: Sequence[int]) -> list[int]:
    """vLLM's aux hidden-state ids for our feature layers (`drafters.dflash.vllm_aux_layer_ids`: vLLM counts layer
    BOUNDARIES, so the output of our layer i is its id i + 1; the last layer's id holds the pre-norm output).
    Sorted and unique: the engine's file holds its layers in ascending id order."""
    return sorted(set(vllm_aux_layer_ids(list(layer_ids))))


def engine_pick(layer_ids: Sequence[int], held: Sequence[int] | None = None) -> torch.Tensor:
    """(len(layer_ids),) int64: the layer of the engine's file that holds each of `layer_ids`, the file holding
    the layers `held` (default `layer_ids`) in `engine_layer_ids` order."""
    aux = engine_layer_ids(layer_ids if held is None else held)
    return torch.tensor([aux.index(i) for i in vllm_aux_layer_ids(list(layer_ids))])


class EngineFileError(ConfigError):
    """A file of the engine holds what this run did not ask for (other layers, dtype or model): never retried."""


@dataclass(frozen=True)
class EngineFiles:
    """What this run reads from the engine's files and where: `folder` (the connector's shared_storage_path, as
    this machine sees it), the name prefix of this client's files, and the identity every file must carry (the
    connector's safetensors metadata, `engine_plugins/dflash_hidden_states.py`)."""

    folder: Path
    prefix: str  # "dflash-<owner>-": the names this client sends; late ones with it are this client's to delete
    aux_layer_ids: tuple[int, ...]  # vLLM's ids (`engine_layer_ids`), in the file's order
    dtype: str  # "float32" | "bfloat16": the dtype the engine runs the target in
    model: str  # the target folder (named in errors; the content is compared, not the path)
    config_sha256: str
    weights_fingerprint: str

    @classmethod
    def of(cls, folder: str | Path, owner: str, target: str | Path, aux_layer_ids: Sequence[int],
           dtype: str) -> "EngineFiles":
        """`owner`: a name for this client's files unique among the clients of one engine folder (a run folder
        and rank, a capture's output), hashed into the prefix."""
        tag = hashlib.sha256(owner.encode()).hexdigest()[:12]
        return cls(Path(folder).resolve(), f"dflash-{tag}-", tuple(int(i) for i in aux_layer_ids), dtype,
                   str(Path(target).resolve()), config_sha256(target), weights_fingerprint(target))

    def refuse_other(self, metadata: dict[str, str] | None, path: Path) -> None:
        """EngineFileError in one line naming the first of ids, dtype, config, weights in which the file's
        metadata differs from this run's (a file without our metadata: a server without our connector)."""
        md = metadata or {}
        if "aux_layer_ids" not in md:
            raise EngineFileError(f"{path}: holds no layer ids, dtype or model: not written by our connector "
                                  "(start the server as docs/scale.md shows)")
        try:
            ids = tuple(int(i) for i in json.loads(md["aux_layer_ids"]))
        except (ValueError, TypeError):
            ids = ()
        if ids != self.aux_layer_ids:
            raise EngineFileError(
                f"{path}: the engine writes aux layer ids {list(ids)}, this run reads {list(self.aux_layer_ids)} "
                f"(vLLM counts layer boundaries: our layer i is its id i + 1); restart the server with "
                f"eagle_aux_hidden_state_layer_ids {list(self.aux_layer_ids)}")
        if md.get("dtype") != self.dtype:
            raise EngineFileError(f"{path}: the engine runs the target in {md.get('dtype')}, this run reads "
                                  f"{self.dtype}: restart the server with --dtype {self.dtype}")
        for key, what in (("config_sha256", "config.json"), ("weights_fingerprint", "weights")):
            if md.get(key) != getattr(self, key):
                raise EngineFileError(
                    f"{path}: the engine serves {md.get('model')!r} whose {what} differ from this run's target "
                    f"{self.model!r} ({key} {str(md.get(key))[:12]}... vs {getattr(self, key)[:12]}...): serve "
                    "the same model")

    def late_files(self) -> list[Path]:
        """This client's whole files left in the folder: answers to requests it gave up on (a timeout, a retry, a
        killed run of the same owner). An unfinished .part is the engine's, renamed by it when written: left."""
        return sorted(self.folder.glob(self.prefix + "*.safetensors"))

    def clean(self) -> int:
        """Delete `late_files`; returns how many."""
        late = self.late_files()
        for path in late:
            path.unlink(missing_ok=True)
        return len(late)


class HiddenStatesClient:
    """Completions with max_tokens 1 (the prompt's prefill only) on a server run with `EngineSpec.hidden_states`;
    each document's file, named by this client (`files.prefix`) inside `files.folder`, is read, checked (its
    identity, token ids and shape) and only then deleted. Late files of this client are deleted when it starts
    and when it closes."""

    def __init__(self, url: str, files: EngineFiles, hidden_size: int, concurrency: int = 8,
                 timeout_s: float = 600.0, transport: httpx.BaseTransport | None = None) -> None:
        self.url, self.files, self.hidden_size = url.rstrip("/"), files, hidden_size
        self.layers = len(files.aux_layer_ids)
        self.timeout_s, self.concurrency = timeout_s, max(1, concurrency)
        self.http = http_client(self.url, timeout_s, transport)  # `transport`: tests stand in a server
        self._count = itertools.count()  # file names: prefix + a number; itertools.count is thread-safe in CPython
        self._model = ""
        self._give_up_at: float | None = None  # monotonic time past which a fetch stops waiting (`stop_waiting`)
        self.files.clean()

    @property
    def model(self) -> str:
        """The name the server serves its model by (the first of /v1/models): what it serves is judged by the
        identity in its files, not by this name."""
        if not self._model:
            reply = self.http.get(self.url + "/v1/models")
            reply.raise_for_status()
            self._model = str(reply.json()["data"][0]["id"])
        return self._model

    def close(self) -> None:
        self.http.close()
        self.files.clean()

    def stop_waiting(self) -> None:
        """A stop was asked (the trainer's SIGTERM handler calls this): fetches give the engine STOP_WAIT_S more,
        then raise EngineError instead of waiting out its timeouts."""
        if self._give_up_at is None:
            self._give_up_at = time.monotonic() + STOP_WAIT_S

    def fetch(self, documents: Sequence[Sequence[int]]) -> list[torch.Tensor]:
        """(len_d, layers, hidden) hidden states of each document (token ids), in the engine's dtype; `concurrency`
        requests at a time, on daemon threads (a request hung on the engine never holds up the process's exit)."""
        out: list[torch.Tensor | None] = [None] * len(documents)
        todo, errors, lock = iter(range(len(documents))), [], threading.Lock()

        def work() -> None:
            while not errors:
                with lock:
                    i = next(todo, None)
                if i is None:
                    return
                try:
                    out[i] = self._one(documents[i])
                except BaseException as e:  # noqa: BLE001 - handed to the caller's thread
                    errors.append(e)

        threads = [threading.Thread(target=work, daemon=True, name=f"engine-fetch-{k}")
                   for k in range(min(self.concurrency, len(documents)))]
        for t in threads:
            t.start()
        for t in threads:
            while t.is_alive() and not errors:
                t.join(0.1)
                if self._give_up_at is not None and time.monotonic() > self._give_up_at:
                    errors.append(EngineError(
                        f"a stop was asked and the engine at {self.url} has not answered for {STOP_WAIT_S:g} s more: "
                        f"its requests are given up, nothing was trained on them{log_note(self.url)}"))
                    raise errors[-1]  # (the threads take no other document)
        if errors:
            raise errors[0]
        return out  # type: ignore[return-value]

    def _one(self, ids: Sequence[int]) -> torch.Tensor:
        ids = [int(t) for t in ids]
        why = ""
        for _ in range(1 + RETRIES):
            try:
                return self._request(ids)
            except EngineFileError:
                raise
            except (OSError, SafetensorError, ValueError, KeyError, httpx.HTTPError) as e:
                why = f"{type(e).__name__}: {e}"
        raise EngineError(f"the engine at {self.url} gave no usable hidden states for a document of {len(ids)} "
                          f"tokens after {1 + RETRIES} tries ({' '.join(why.split())[:300]}); nothing was trained on "
                          f"them{log_note(self.url)}")

    def _request(self, ids: list[int]) -> torch.Tensor:
        name = f"{self.files.prefix}{next(self._count)}-{uuid.uuid4().hex[:8]}"
        want = self.files.folder / f"{name}.safetensors"
        body = {"model": self.model, "prompt": ids, "max_tokens": 1, "temperature": 0.0,
                "kv_transfer_params": {"name": name}}
        reply = self.http.post(self.url + "/v1/completions", json=body)
        reply.raise_for_status()
        params = reply.json().get("kv_transfer_params") or {}
        said = params.get("hidden_states_path", "")
        if params.get("hidden_states_error"):
            raise EngineFileError(f"the engine's connector refused {name!r}: {params['hidden_states_error']}")
        if not said:
            raise ValueError("the response names no hidden_states_path: is the server run with our connector?")
        if Path(said).name != want.name:
            raise ValueError(f"the engine names {said}, not the file {want.name} this client asked for")
        deadline = time.monotonic() + FILE_WAIT_S
        while not want.is_file():  # the folder as this machine sees it (the engine's path may be another mount's)
            if time.monotonic() > deadline:
                raise OSError(f"{want} did not appear within {FILE_WAIT_S:g} s (the engine wrote {said}: is "
                              f"{self.files.folder} its shared_storage_path?)")
            time.sleep(0.005)
        with safe_open(str(want), framework="pt") as f:
            self.files.refuse_other(f.metadata(), want)
        got = load_file(str(want))
        states, tokens = got["hidden_states"], got["token_ids"]
        if tokens.tolist() != ids:
            raise ValueError(f"{want.name}: its token ids are not the document's ({len(tokens)} vs {len(ids)} tokens)")
        if tuple(states.shape) != (len(ids), self.layers, self.hidden_size):
            raise ValueError(f"{want.name}: hidden_states {tuple(states.shape)}, expected "
                             f"{(len(ids), self.layers, self.hidden_size)}")
        if str(states.dtype).removeprefix("torch.") != self.files.dtype:
            raise EngineFileError(f"{want}: hidden_states in {states.dtype}, its metadata says {self.files.dtype}")
        want.unlink()  # a good read: this client's own file, and nothing else, is deleted
        return states
