"""The frozen target served by vLLM (`-p target_engine vllm`): the drafter's feature layers come from the engine,
which writes each document's hidden states to a file through our KV connector (`engine_plugins/`), instead of a
forward in the trainer; the embedding and LM head the drafter shares are read from the target folder's
safetensors. `ServedTarget` stands where `TargetModel` stands in the training pipeline. docs/scale.md, "The target
served by an engine".
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import hashlib
import itertools
import json
import os
import shlex
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Iterator, Sequence

import httpx
import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file

from dflash_lib.config import ConfigError, uses_bf16
from dflash_lib.data.batch import Batch
from dflash_lib.models.masks import RealTokens, real_tokens
from dflash_lib.models.target import chosen_layer_ids, local_hf_config, weight_files
from dflash_lib.serve.engine_plugins.model_identity import config_sha256, weights_fingerprint
from dflash_lib.serve.server import PLUGINS, SERVER_MODULE, EngineServer, EngineSpec, engine_dtype

FILE_WAIT_S = 60.0  # seconds a response's file may take to appear (the engine writes it in its next step)
RETRIES = 1  # a request whose file is missing or wrong is sent again this many times, then the step fails


def engine_layer_ids(layer_ids: Sequence[int]) -> list[int]:
    """vLLM's aux hidden-state ids for our feature layers: vLLM counts layer BOUNDARIES (id 0 = the embeddings, id
    i = the input of decoder layer i), so the output of our layer i is its id i + 1; the last layer's id holds the
    pre-norm output. Sorted and unique: the engine's file holds its layers in ascending id order."""
    return sorted({int(i) + 1 for i in layer_ids})


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
        self.timeout_s, self.pool = timeout_s, concurrent.futures.ThreadPoolExecutor(concurrency)
        self.http = httpx.Client(timeout=timeout_s, transport=transport)  # `transport`: tests stand in a server
        self._count = itertools.count()  # file names: prefix + a number; itertools.count is thread-safe in CPython
        self._model = ""
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
        self.pool.shutdown(wait=False)
        self.http.close()
        self.files.clean()

    def fetch(self, documents: Sequence[Sequence[int]]) -> list[torch.Tensor]:
        """(len_d, layers, hidden) hidden states of each document (token ids), in the engine's dtype."""
        return list(self.pool.map(self._one, documents))

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
        raise RuntimeError(f"the engine at {self.url} gave no usable hidden states for a document of {len(ids)} "
                           f"tokens after {1 + RETRIES} tries ({why}); nothing was trained on them")

    def _request(self, ids: list[int]) -> torch.Tensor:
        name = f"{self.files.prefix}{next(self._count)}-{uuid.uuid4().hex[:8]}"
        want = self.files.folder / f"{name}.safetensors"
        body = {"model": self.model, "prompt": ids, "max_tokens": 1, "temperature": 0.0,
                "kv_transfer_params": {"name": name}}
        reply = self.http.post(self.url + "/v1/completions", json=body)
        reply.raise_for_status()
        said = (reply.json().get("kv_transfer_params") or {}).get("hidden_states_path", "")
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


EMBED_KEYS = ("model.embed_tokens.weight", "model.language_model.embed_tokens.weight")  # a wrapper's text model
HEAD_KEYS = ("lm_head.weight", "model.language_model.lm_head.weight")


def shared_weights(folder: str | Path, hf: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's input embedding (V, H) and LM head (V, H) read from its safetensors alone, as transformers
    builds them from `hf` (its text config): the head is the embedding when `tie_word_embeddings`, else its own
    weights, which must be there. ConfigError naming the folder when either is missing or not (vocab_size,
    hidden_size) of config.json."""
    found: dict[str, torch.Tensor] = {}
    for name in weight_files(folder):
        with safe_open(str(Path(folder) / name), framework="pt") as f:
            for key in f.keys():
                if key in EMBED_KEYS or key in HEAD_KEYS:
                    found["embed" if key in EMBED_KEYS else "head"] = f.get_tensor(key)
    tied = bool(getattr(hf, "tie_word_embeddings", False))
    if "embed" not in found:
        raise ConfigError(f"target {str(folder)!r}: none of {', '.join(EMBED_KEYS)} in its safetensors")
    if not tied and "head" not in found:
        raise ConfigError(f"target {str(folder)!r}: its config.json does not tie the LM head to the embedding "
                          f"(tie_word_embeddings false) and its safetensors hold no {' or '.join(HEAD_KEYS)}")
    want = (int(hf.vocab_size), int(hf.hidden_size))
    for what in ("embed", "head"):
        if what in found and tuple(found[what].shape) != want:
            raise ConfigError(f"target {str(folder)!r}: its {'embedding' if what == 'embed' else 'LM head'} is "
                              f"{tuple(found[what].shape)}, config.json says (vocab_size, hidden_size) {want}")
    return found["embed"], found["embed"] if tied else found["head"]


class ServedTarget:
    """`TargetModel`'s part the trainer uses, served: `segments`, `context_features` (C, F*H) of a batch's real
    tokens (documents in row-major order), the shared `embed_tokens` / `lm_head` (frozen, on `device`), and its
    shapes. The engine runs the documents; nothing of the target's layers is held here."""

    gather = True
    backend = "engine"

    def __init__(self, folder: str | Path, layer_ids: Sequence[int], url: str, device: torch.device | str,
                 dtype: torch.dtype, concurrency: int = 8, timeout_s: float = 600.0, cache: Any = None,
                 files: EngineFiles | None = None) -> None:
        hf = local_hf_config(folder)
        self.model = SimpleNamespace(config=hf)  # what the drafter reads of a target model: its config
        self.num_layers, self.hidden_size = int(hf.num_hidden_layers), int(hf.hidden_size)
        self.layer_ids = [int(i) for i in layer_ids]
        bad = [i for i in self.layer_ids if not 0 <= i < self.num_layers]
        if bad or not self.layer_ids:
            raise ConfigError(f"target layer ids {self.layer_ids}: {bad or 'none given'} outside [0, {self.num_layers})")
        self.num_features, self.name_or_path = len(self.layer_ids), str(folder)
        self.layer_kinds = list(getattr(hf, "layer_types", None) or ["full_attention"] * self.num_layers)
        aux = engine_layer_ids(self.layer_ids)
        self.pick = torch.tensor([aux.index(i + 1) for i in self.layer_ids])  # file layer of each feature
        self.dtype, self._device = dtype, torch.device(device)
        embed, head = shared_weights(folder, hf)
        self.vocab_size = int(embed.shape[0])
        self.embed_tokens = torch.nn.Embedding.from_pretrained(embed.to(self._device, dtype), freeze=True)
        self.lm_head = torch.nn.Linear(self.hidden_size, head.shape[0], bias=False, device=self._device, dtype=dtype)
        self.lm_head.weight = torch.nn.Parameter(head.to(self._device, dtype), requires_grad=False)
        self.cache = cache  # a `hidden_cache.HiddenCache` read first; the engine (`url`, "" = none) for the rest
        if url and (files is None or list(files.aux_layer_ids) != aux):
            raise ValueError(f"an engine's features need its files' identity for aux layer ids {aux}, got {files}")
        self.client = HiddenStatesClient(url, files, self.hidden_size, concurrency, timeout_s) if url else None

    @property
    def device(self) -> torch.device:
        return self._device

    def segments(self, host_doc_ids: torch.Tensor) -> RealTokens:
        return real_tokens(host_doc_ids, True)

    @torch.no_grad()
    def context_features(self, batch: Batch, segments: RealTokens | None = None) -> torch.Tensor:
        """(C, F*H) features of the batch's real tokens (C = N, row-major, as `TargetModel.context_features`) in
        `dtype` on `device`, from the engine."""
        real = self.segments(batch.doc_ids) if segments is None else segments
        ids = batch.input_ids.reshape(-1).cpu()
        ids = ids if real.index is None else ids[real.index]
        docs = [ids[s:e] for s, e in real.segments]
        got = [None if self.cache is None else self.cache.get(d) for d in docs]  # (len, F*H) each, or None
        missing = [i for i, g in enumerate(got) if g is None]
        if missing and self.client is None:
            raise RuntimeError(f"{self.cache.path}: a document of {len(docs[missing[0]])} tokens is not in the cache "
                               "(captured from another token store?) and no engine serves the target")
        if missing:
            for i, st in zip(missing, self.client.fetch([docs[i].tolist() for i in missing])):  # (len, layers, H)
                got[i] = st[:, self.pick].reshape(st.shape[0], -1)
        feats = torch.cat(got) if got else torch.zeros(0, self.num_features * self.hidden_size)
        return feats.to(self._device, self.dtype, non_blocking=True)

    def context_features_and_final(self, *args, **kwargs):
        raise ConfigError("loss kl / ce+kl read the target's final-normed states, which a served target does not "
                          "hand over yet: train with loss 'ce' or target_engine 'local'")

    def close(self) -> None:
        if self.client is not None:
            self.client.close()


def served_dtype(config: Any, device: torch.device) -> str:
    """The dtype the engine runs `config`'s target in: bf16 when the run trains in bf16 or the CPU build runs this
    target in bf16 only (a linear-attention one), else float32."""
    bf16 = uses_bf16(config.train.precision, device) or engine_dtype(config.model.target,
                                                                     device.type == "cpu") == "bfloat16"
    return "bfloat16" if bf16 else "float32"


def engine_files(config: Any, run_dir: Path, device: torch.device, owner: str) -> EngineFiles:
    """What `config`'s run reads from the engine's files: the folder (`target_engine_dir` for a server started by
    hand, else run_dir/engine_hidden_states, where `target_engine_url` starts one), its feature layers in vLLM's
    numbering, the served dtype and the target's identity; `owner` names this client's files (`EngineFiles.of`)."""
    m = config.model
    hf = local_hf_config(m.target)
    ids = chosen_layer_ids(m.target_layer_ids, hf.num_hidden_layers, m.num_features)
    folder = Path(m.target_engine_dir) if m.target_engine_url else Path(run_dir) / "engine_hidden_states"
    if not folder.is_dir():
        raise ConfigError(f"target_engine_dir {str(folder)!r} is not a folder: give the folder the server's "
                          "connector writes to (its kv_connector_extra_config shared_storage_path)")
    return EngineFiles.of(folder, owner, m.target, engine_layer_ids(ids), served_dtype(config, device))


def probe_engine(config: Any, device: torch.device) -> None:
    """A one-token document sent to the server at `target_engine_url` (started by hand): its file's identity is
    checked (`EngineFiles.refuse_other`) before a run folder is made or a weight is read."""
    files = engine_files(config, Path("."), device, f"probe#{os.getpid()}#{uuid.uuid4().hex}")
    client = HiddenStatesClient(config.model.target_engine_url, files, int(local_hf_config(config.model.target)
                                                                                .hidden_size), 1)
    try:
        client.fetch([[0]])
    finally:
        client.close()


def engine_command(config: Any, folder: str | Path, device: torch.device) -> str:
    """The shell command that starts a server for `config`'s run by hand (`target_engine_url` +
    `target_engine_dir`): vLLM's OpenAI server (what `vllm serve` runs; `python` the engine's) on the target in
    `served_dtype`, its feature layers in vLLM's numbering and our connector writing into `folder`, made by the
    same code as a server started here. Add the server's own flags (--host, --port, parallelism, memory)."""
    m = config.model
    hf = local_hf_config(m.target)
    ids = chosen_layer_ids(m.target_layer_ids, hf.num_hidden_layers, m.num_features)
    spec = EngineSpec(target=m.target, dtype=served_dtype(config, device), max_model_len=config.data.max_len + 1,
                      hidden_states=tuple(engine_layer_ids(ids)), hidden_states_dir=str(Path(folder).resolve()))
    words = ["python", "-m", SERVER_MODULE, "--model", str(Path(m.target).resolve()), "--dtype", spec.dtype,
             "--max-model-len", str(spec.max_model_len), "--skip-tokenizer-init", "--speculative-config",
             json.dumps(spec.speculative_config()), "--kv-transfer-config", json.dumps(spec.kv_transfer_config())]
    return f"PYTHONPATH={shlex.quote(str(PLUGINS))} " + " ".join(shlex.quote(w) for w in words)


@contextlib.contextmanager
def target_engine_url(config: Any, run_dir: Path, device: torch.device) -> Iterator[str]:
    """The address of the engine serving `config`'s target with its feature layers: `target_engine_url` when
    given, else vLLM started here (`EngineServer`: free loopback port, health check, log run_dir/engine-target.log,
    its files in run_dir/engine_hidden_states/, always stopped), in `served_dtype`."""
    m = config.model
    if m.target_engine_url:
        yield m.target_engine_url
        return
    hf = local_hf_config(m.target)
    ids = chosen_layer_ids(m.target_layer_ids, hf.num_hidden_layers, m.num_features)
    out = Path(run_dir) / "engine_hidden_states"
    out.mkdir(parents=True, exist_ok=True)
    spec = EngineSpec(target=m.target, dtype=served_dtype(config, device), max_model_len=config.data.max_len + 1,
                      hidden_states=tuple(engine_layer_ids(ids)), hidden_states_dir=str(out.resolve()))
    with EngineServer(spec, Path(run_dir) / "engine-target.log", config.evaluate.engine_python or None,
                      config.evaluate.engine_start_timeout_s) as server:
        yield server.url
