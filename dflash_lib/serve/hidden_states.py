"""The frozen target served by vLLM (`-p target_engine vllm`): the drafter's feature layers come from the engine,
which writes each document's hidden states to a file through our KV connector (`engine_plugins/`), instead of a
forward in the trainer; the embedding and LM head the drafter shares are read from the target folder's
safetensors. `ServedTarget` stands where `TargetModel` stands in the training pipeline. docs/scale.md, "The target
served by an engine".
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import time
import uuid
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
from dflash_lib.serve.server import EngineServer, EngineSpec, engine_dtype

FILE_WAIT_S = 60.0  # seconds a response's file may take to appear (the engine writes it in its next step)
RETRIES = 1  # a request whose file is missing or wrong is sent again this many times, then the step fails


def engine_layer_ids(layer_ids: Sequence[int]) -> list[int]:
    """vLLM's aux hidden-state ids for our feature layers: vLLM counts layer BOUNDARIES (id 0 = the embeddings, id
    i = the input of decoder layer i), so the output of our layer i is its id i + 1; the last layer's id holds the
    pre-norm output. Sorted and unique: the engine's file holds its layers in ascending id order."""
    return sorted({int(i) + 1 for i in layer_ids})


class HiddenStatesClient:
    """Completions with max_tokens 1 (the prompt's prefill only) on a server run with `EngineSpec.hidden_states`;
    each document's file is read, checked (its token ids, its shape) and deleted."""

    def __init__(self, url: str, model: str, layers: int, hidden_size: int, concurrency: int = 8,
                 timeout_s: float = 600.0, transport: httpx.BaseTransport | None = None) -> None:
        self.url, self.model, self.layers, self.hidden_size = url.rstrip("/"), model, layers, hidden_size
        self.timeout_s, self.pool = timeout_s, concurrent.futures.ThreadPoolExecutor(concurrency)
        self.http = httpx.Client(timeout=timeout_s, transport=transport)  # `transport`: tests stand in a server

    def close(self) -> None:
        self.pool.shutdown(wait=False)
        self.http.close()

    def fetch(self, documents: Sequence[Sequence[int]]) -> list[torch.Tensor]:
        """(len_d, layers, hidden) hidden states of each document (token ids), in the engine's dtype."""
        return list(self.pool.map(self._one, documents))

    def _one(self, ids: Sequence[int]) -> torch.Tensor:
        ids = [int(t) for t in ids]
        why = ""
        for _ in range(1 + RETRIES):
            try:
                return self._request(ids)
            except (OSError, SafetensorError, ValueError, KeyError, httpx.HTTPError) as e:
                why = f"{type(e).__name__}: {e}"
        raise RuntimeError(f"the engine at {self.url} gave no usable hidden states for a document of {len(ids)} "
                           f"tokens after {1 + RETRIES} tries ({why}); nothing was trained on them")

    def _request(self, ids: list[int]) -> torch.Tensor:
        body = {"model": self.model, "prompt": ids, "max_tokens": 1, "temperature": 0.0,
                "kv_transfer_params": {"name": f"dflash-{uuid.uuid4().hex}"}}
        reply = self.http.post(self.url + "/v1/completions", json=body)
        reply.raise_for_status()
        path = Path((reply.json().get("kv_transfer_params") or {}).get("hidden_states_path", ""))
        if not path.name:
            raise ValueError("the response names no hidden_states_path: is the server run with our connector?")
        deadline = time.monotonic() + FILE_WAIT_S
        while not path.is_file():
            if time.monotonic() > deadline:
                raise OSError(f"{path} did not appear within {FILE_WAIT_S:g} s")
            time.sleep(0.005)
        try:
            got = load_file(str(path))
        finally:
            path.unlink(missing_ok=True)
        states, tokens = got["hidden_states"], got["token_ids"]
        if tokens.tolist() != ids:
            raise ValueError(f"{path.name}: its token ids are not the document's ({len(tokens)} vs {len(ids)} tokens)")
        if tuple(states.shape) != (len(ids), self.layers, self.hidden_size):
            raise ValueError(f"{path.name}: hidden_states {tuple(states.shape)}, expected "
                             f"{(len(ids), self.layers, self.hidden_size)}")
        return states


def _shared_weights(folder: str | Path) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's input embedding (V, H) and LM head (V, H; the embedding when tied) read from its safetensors
    alone (a vision-language wrapper's text model's)."""
    found: dict[str, torch.Tensor] = {}
    for name in weight_files(folder):
        with safe_open(str(Path(folder) / name), framework="pt") as f:
            for key in f.keys():
                if key in ("model.embed_tokens.weight", "model.language_model.embed_tokens.weight", "lm_head.weight"):
                    found["lm_head" if key == "lm_head.weight" else "embed"] = f.get_tensor(key)
    if "embed" not in found:
        raise ConfigError(f"target {str(folder)!r}: no model.embed_tokens.weight in its safetensors")
    return found["embed"], found.get("lm_head", found["embed"])


class ServedTarget:
    """`TargetModel`'s part the trainer uses, served: `segments`, `context_features` (C, F*H) of a batch's real
    tokens (documents in row-major order), the shared `embed_tokens` / `lm_head` (frozen, on `device`), and its
    shapes. The engine runs the documents; nothing of the target's layers is held here."""

    gather = True
    backend = "engine"

    def __init__(self, folder: str | Path, layer_ids: Sequence[int], url: str, device: torch.device | str,
                 dtype: torch.dtype, concurrency: int = 8, timeout_s: float = 600.0, cache: Any = None) -> None:
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
        embed, head = _shared_weights(folder)
        self.vocab_size = int(embed.shape[0])
        self.embed_tokens = torch.nn.Embedding.from_pretrained(embed.to(self._device, dtype), freeze=True)
        self.lm_head = torch.nn.Linear(self.hidden_size, head.shape[0], bias=False, device=self._device, dtype=dtype)
        self.lm_head.weight = torch.nn.Parameter(head.to(self._device, dtype), requires_grad=False)
        self.cache = cache  # a `hidden_cache.HiddenCache` read first; the engine (`url`, "" = none) for the rest
        self.client = HiddenStatesClient(url, str(Path(folder).resolve()), len(aux), self.hidden_size, concurrency,
                                         timeout_s) if url else None

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


@contextlib.contextmanager
def target_engine_url(config: Any, run_dir: Path, device: torch.device) -> Iterator[str]:
    """The address of the engine serving `config`'s target with its feature layers: `target_engine_url` when
    given, else vLLM started here (`EngineServer`: free loopback port, health check, log run_dir/engine-target.log,
    its files in run_dir/engine_hidden_states/, always stopped), in the trainer's precision (bf16 for a
    linear-attention target on CPU, the only one vLLM's CPU build runs)."""
    m = config.model
    if m.target_engine_url:
        yield m.target_engine_url
        return
    hf = local_hf_config(m.target)
    ids = chosen_layer_ids(m.target_layer_ids, hf.num_hidden_layers, m.num_features)
    bf16 = uses_bf16(config.train.precision, device) or engine_dtype(m.target, device.type == "cpu") == "bfloat16"
    out = Path(run_dir) / "engine_hidden_states"
    out.mkdir(parents=True, exist_ok=True)
    spec = EngineSpec(target=m.target, dtype="bfloat16" if bf16 else "float32", max_model_len=config.data.max_len + 1,
                      hidden_states=tuple(engine_layer_ids(ids)), hidden_states_dir=str(out.resolve()))
    with EngineServer(spec, Path(run_dir) / "engine-target.log", config.evaluate.engine_python or None,
                      config.evaluate.engine_start_timeout_s) as server:
        yield server.url
