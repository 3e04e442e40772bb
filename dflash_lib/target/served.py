"""The frozen target served by vLLM (`-p target_engine vllm`): the drafter's feature layers come from the engine
(`serve.hidden_states`: each document's hidden states written to a file by our KV connector) instead of a forward
in the trainer; the embedding and LM head the drafter shares are read from the target folder's safetensors.
`ServedTarget` is a `FeatureSource` (`target.protocol`); `target_engine_url` starts or names its engine.
docs/scale.md, "The target served by an engine".
"""

from __future__ import annotations

import contextlib
import os
import shlex
import uuid
from pathlib import Path
from typing import Any, Iterator

import torch
import transformers
from safetensors import safe_open

from dflash_lib.config import ConfigError, reads_final_states, uses_bf16
from dflash_lib.data.batch import Batch
from dflash_lib.models.masks import RealTokens, real_tokens
from dflash_lib.models.target_config import weight_files
from dflash_lib.serve.hidden_states import EngineFiles, HiddenStatesClient
from dflash_lib.serve.adapter import EngineSpec
from dflash_lib.serve.server import EngineServer, engine_adapter, private_folder
from dflash_lib.target.facts import TargetFacts

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
    """The target served (a `FeatureSource`): `segments`, `context_features` (C, F*H) of a batch's real tokens
    (documents in row-major order) and, opened with `final` (loss kl / ce+kl), the final-normed states: the
    engine hands over the last layer's output too, passed here through the target's own final norm
    (`final_norm`); the shared `embed_tokens` / `lm_head` (frozen, on `device`), and its shapes. The engine runs
    the documents (a cache, `cached.CapturedFeatures`, is read first); nothing of the target's layers is held here."""

    gather = True
    backend = "engine"

    def __init__(self, facts: TargetFacts, url: str, device: torch.device | str, dtype: torch.dtype,
                 concurrency: int = 8, timeout_s: float = 600.0, cache: Any = None,
                 files: EngineFiles | None = None, final: bool = False) -> None:
        hf = facts.hf
        self.facts, self.final = facts, final
        self.hf = hf
        self.num_layers, self.hidden_size = facts.num_layers, facts.hidden_size
        self.layer_ids = list(facts.layer_ids)
        self.num_features, self.name_or_path = facts.num_features, facts.target
        self.layer_kinds = list(facts.layer_kinds)
        aux = facts.engine_layers(final)
        self.pick = facts.engine_pick(final)  # file layer of each feature
        self.last = facts.engine_last() if final else None  # file layer of the last layer's output
        self.dtype, self._device = dtype, torch.device(device)
        embed, head = shared_weights(facts.target, hf)
        self.vocab_size = int(embed.shape[0])
        self.embed_tokens = torch.nn.Embedding.from_pretrained(embed.to(self._device, dtype), freeze=True)
        self.lm_head = torch.nn.Linear(self.hidden_size, head.shape[0], bias=False, device=self._device, dtype=dtype)
        self.lm_head.weight = torch.nn.Parameter(head.to(self._device, dtype), requires_grad=False)
        self.norm = final_norm(facts, self._device, dtype) if final else None
        self.cache = cache  # a `cached.CapturedFeatures` read first; the engine (`url`, "" = none) for the rest
        if final and cache is not None and not cache.identity.final_states:
            raise ConfigError(f"{cache.path}: holds the feature layers only, not the last layer's states that loss "
                              "kl / ce+kl reads: capture again with that loss into another folder")
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
        `dtype` on `device`, from the cache or the engine."""
        return self._states(batch, segments, False)[0]

    @torch.no_grad()
    def context_features_and_final(self, batch: Batch, rows: torch.Tensor,
                                   segments: RealTokens | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """`TargetModel.context_features_and_final`: ((C, F*H), (u, H)), the final-normed states at the context
        entries `rows` (u,): the last layer's output through the target's final norm. ConfigError unless opened
        with `final` (its engine would not hand over the last layer)."""
        if not self.final:
            raise ConfigError("this served target was opened for loss ce (its engine hands over the feature layers "
                              "only): open it with final=True for loss kl / ce+kl")
        feats, last = self._states(batch, segments, True)
        return feats, self.norm(last[rows.to(self._device, non_blocking=True)])

    def _states(self, batch: Batch, segments: RealTokens | None,
                final: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The batch's real tokens' features (N, F*H) and, with `final`, the last layer's output before the final
        norm (N, H), in `dtype` on `device`: from the cache first, the engine for the documents it lacks."""
        real = self.segments(batch.doc_ids) if segments is None else segments
        ids = batch.input_ids.reshape(-1).cpu()
        ids = ids if real.index is None else ids[real.index]
        docs = [ids[s:e] for s, e in real.segments]
        got = [None if self.cache is None else self.cache.get(d) for d in docs]  # (len, F*H) each, or None
        last = [None if g is None or not final else self.cache.get_last(d) for g, d in zip(got, docs)]  # (len, H)
        missing = [i for i, g in enumerate(got) if g is None]
        if missing and self.client is None:
            raise RuntimeError(f"{self.cache.path}: a document of {len(docs[missing[0]])} tokens is not in the cache "
                               "(captured from another token store?) and no engine serves the target")
        if missing:
            for i, st in zip(missing, self.client.fetch([docs[i].tolist() for i in missing])):  # (len, layers, H)
                got[i] = st[:, self.pick].reshape(st.shape[0], -1)
                last[i] = st[:, self.last] if final else None
        H = self.hidden_size
        feats = (torch.cat(got) if got else torch.zeros(0, self.num_features * H)).to(self._device, self.dtype,
                                                                                      non_blocking=True)
        if not final:
            return feats, None
        return feats, (torch.cat(last) if last else torch.zeros(0, H)).to(self._device, self.dtype, non_blocking=True)

    def stop_waiting(self) -> None:
        """A stop was asked: a fetch waits at most `hidden_states.STOP_WAIT_S` more for the engine."""
        if self.client is not None:
            self.client.stop_waiting()

    def close(self) -> None:
        if self.client is not None:
            self.client.close()


NORM_PREFIXES = ("model.norm.", "model.language_model.norm.")  # the final norm's keys (a wrapper's text model)


def final_norm(facts: TargetFacts, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    """The target's final norm as its model builds it (the module of `facts.hf`'s causal LM, built on the meta
    device: no memory), its weights read from the folder's safetensors; frozen, in `dtype` on `device`.
    ConfigError naming the folder when they are not all there."""
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(facts.hf)
    norm = getattr(model, getattr(model, "base_model_prefix", "model")).norm
    found: dict[str, torch.Tensor] = {}
    for name in weight_files(facts.target):
        with safe_open(str(Path(facts.target) / name), framework="pt") as f:
            for key in f.keys():
                for prefix in NORM_PREFIXES:
                    if key.startswith(prefix):
                        found[key[len(prefix):]] = f.get_tensor(key)
    want = sorted(norm.state_dict())
    if sorted(found) != want:
        raise ConfigError(f"target {facts.target!r}: its final norm's {want} are not all in its safetensors (under "
                          f"{' or '.join(NORM_PREFIXES)}; found {sorted(found)})")
    norm.load_state_dict(found, assign=True)
    return norm.to(device, dtype).requires_grad_(False).eval()


def served_dtype(config: Any, device: torch.device) -> str:
    """The dtype the engine runs `config`'s target in (the serving engine's, or for a local target reading a cache,
    the engine `capture` ran: `EngineSpec`'s default): bf16 when the run trains in bf16 or the CPU build runs this
    target in bf16 only (a linear-attention one), else float32."""
    engine = EngineSpec.engine if config.model.target_engine == "local" else config.model.target_engine  # a cache's
    dtype = engine_adapter(engine).dtype(config.model.target, device.type == "cpu")
    bf16 = uses_bf16(config.train.precision, device) or dtype == "bfloat16"
    return "bfloat16" if bf16 else "float32"


def engine_files(config: Any, facts: TargetFacts, run_dir: Path, device: torch.device, owner: str) -> EngineFiles:
    """What `config`'s run reads from the engine's files: the folder (`target_engine_dir` for a server started by
    hand, else run_dir/engine_hidden_states, where `target_engine_url` starts one), its feature layers (and the
    last layer, for loss kl / ce+kl) in vLLM's numbering, the served dtype and the target's identity; `owner`
    names this client's files (`EngineFiles.of`)."""
    m = config.model
    folder = Path(m.target_engine_dir) if m.target_engine_url else Path(run_dir) / "engine_hidden_states"
    if not folder.is_dir():
        raise ConfigError(f"target_engine_dir {str(folder)!r} is not a folder: give the folder the server's "
                          "connector writes to (its kv_connector_extra_config shared_storage_path)")
    return EngineFiles.of(folder, owner, m.target, facts.engine_layers(reads_final_states(m.loss)),
                          served_dtype(config, device))


def probe_engine(config: Any, facts: TargetFacts, device: torch.device) -> None:
    """A one-token document sent to the server at `target_engine_url` (started by hand): its file's identity is
    checked (`EngineFiles.refuse_other`) before a run folder is made or a weight is read."""
    files = engine_files(config, facts, Path("."), device, f"probe#{os.getpid()}#{uuid.uuid4().hex}")
    client = HiddenStatesClient(config.model.target_engine_url, files, facts.hidden_size, 1)
    try:
        client.fetch([[0]])
    finally:
        client.close()


def engine_command(config: Any, facts: TargetFacts, folder: str | Path, device: torch.device) -> str:
    """The shell command that starts a server for `config`'s run by hand (`target_engine_url` +
    `target_engine_dir`): vLLM's OpenAI server (what `vllm serve` runs; `python` the engine's) on the target in
    `served_dtype`, its feature layers (and the last layer, for loss kl / ce+kl) in vLLM's numbering and our
    connector writing into `folder`, made by the same code as a server started here. Add the server's own flags
    (--host, --port, parallelism, memory); its API key goes in its environment ($VLLM_API_KEY, which the trainer
    sends too), never on this line."""
    m = config.model
    spec = EngineSpec(target=m.target, dtype=served_dtype(config, device), max_model_len=config.data.max_len + 1,
                      hidden_states=tuple(facts.engine_layers(reads_final_states(m.loss))),
                      hidden_states_dir=str(Path(folder).resolve()))
    engine = engine_adapter(spec.engine)
    env = [f"{k}={shlex.quote(v)}" for k, v in engine.env(spec).items()]
    return " ".join(env + [shlex.quote(w) for w in ["python", "-m", engine.module, *engine.args(spec, None)]])


@contextlib.contextmanager
def target_engine_url(config: Any, facts: TargetFacts, run_dir: Path, device: torch.device) -> Iterator[str]:
    """The address of the engine serving `config`'s target with its feature layers: `target_engine_url` when
    given, else vLLM started here (`EngineServer`: free loopback port, health check, log run_dir/engine-target.log,
    its files in run_dir/engine_hidden_states/, always stopped), in `served_dtype`."""
    m = config.model
    if m.target_engine_url:
        yield m.target_engine_url
        return
    out = private_folder(Path(run_dir) / "engine_hidden_states")  # 0700: the user's hidden states
    spec = EngineSpec(target=m.target, dtype=served_dtype(config, device), max_model_len=config.data.max_len + 1,
                      hidden_states=tuple(facts.engine_layers(reads_final_states(m.loss))),
                      hidden_states_dir=str(out.resolve()))
    with EngineServer(spec, Path(run_dir) / "engine-target.log", config.evaluate.engine_python or None,
                      config.evaluate.engine_start_timeout_s) as server:
        yield server.url
