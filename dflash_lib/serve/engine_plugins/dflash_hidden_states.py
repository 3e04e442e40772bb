"""A KV connector vLLM loads (`kv_connector_module_path`; this folder on the engine's PYTHONPATH, never imported
by dflash_lib): with vLLM's `extract_hidden_states` speculative method it writes, for each finished request, the
prompt's hidden states of the configured layers to one safetensors file, `hidden_states` [tokens, layers, hidden]
(layers in ascending id order) and `token_ids` [tokens] int64, on CPU and CUDA alike (no streams, no pinned
memory). The file is OUTDIR/<kv_transfer_params.name>.safetensors (else the request id; a name the file system
refuses is refused in the response, `file_names`), written under a temporary name of its writing process (0600,
`file_names.temporary_name`) and renamed; the response's kv_transfer_params carry its path. A tensor-parallel
engine: its TP rank 0 alone writes (docs/scale.md, "The target served by an engine": a tensor-parallel engine). Its
safetensors metadata name what it holds (`identity`): the aux layer ids, the dtype, the model folder, its
config.json's sha256 and weights' fingerprint (`model_identity`, beside this file). Read by
`dflash_lib.serve.hidden_states`.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

import torch
from file_names import hidden_states_file, temporary_name  # beside this file, on the engine's PYTHONPATH
from model_identity import config_sha256, weights_fingerprint
from safetensors.torch import save_file
from vllm.distributed.kv_transfer.kv_connector.v1.base import (KVConnectorBase_V1, KVConnectorMetadata,
                                                              KVConnectorRole, SupportsHMA)
from vllm.distributed.parallel_state import get_tensor_model_parallel_rank


@dataclass
class _Write:
    path: str
    token_ids: list[int]
    block_ids: list[int]


@dataclass
class HiddenStatesMetadata(KVConnectorMetadata):
    writes: dict[str, _Write] = field(default_factory=dict)  # request id -> the file to write this step


def identity(vllm_config: Any) -> dict[str, str]:
    """What every file this engine writes holds (safetensors metadata, strings): `aux_layer_ids` (JSON list, as
    the speculative config gives them), `dtype` (the model's, e.g. "bfloat16"), `model` (the served folder),
    `config_sha256` and `weights_fingerprint` of that folder."""
    hf = vllm_config.speculative_config.draft_model_config.hf_config
    model = str(vllm_config.model_config.model)
    return {"aux_layer_ids": json.dumps([int(i) for i in getattr(hf, "eagle_aux_hidden_state_layer_ids", [])]),
            "dtype": str(vllm_config.model_config.dtype).removeprefix("torch."), "model": model,
            "config_sha256": config_sha256(model), "weights_fingerprint": weights_fingerprint(model)}


class DFlashHiddenStatesConnector(KVConnectorBase_V1, SupportsHMA):
    """Scheduler side: a finished request's blocks are kept and queued; worker side: its rows of the hidden-states
    cache ([blocks, layers, block_size, hidden]) are gathered and written in the next step, by TP rank 0 alone
    (`writer`); every worker reports the request done, so that vLLM frees its blocks once each has (by default it
    waits for every worker's report)."""

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self.out_dir = self._kv_transfer_config.get_from_extra_config("shared_storage_path", "")
        if not self.out_dir:
            raise ValueError("DFlashHiddenStatesConnector needs kv_connector_extra_config.shared_storage_path")
        self.group, self.block_size = 0, vllm_config.cache_config.block_size
        if kv_cache_config is not None:  # the hidden states' own cache group
            from vllm.v1.kv_cache_interface import HiddenStateCacheSpec

            groups = kv_cache_config.kv_cache_groups
            ours = [i for i, g in enumerate(groups) if isinstance(g.kv_cache_spec, HiddenStateCacheSpec)]
            self.group = ours[0] if ours else 0
            self.block_size = groups[self.group].kv_cache_spec.block_size
        self.queued: dict[str, _Write] = {}
        self.cache: torch.Tensor | None = None
        self.writer = False  # this worker writes the files: TP rank 0 (`register_kv_caches`: vLLM's groups exist)
        self.metadata = identity(vllm_config)


    # -- worker side
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        from vllm.config import get_layers_from_vllm_config
        from vllm.model_executor.models.extract_hidden_states import CacheOnlyAttentionLayer

        names = list(get_layers_from_vllm_config(self._vllm_config, CacheOnlyAttentionLayer, list(kv_caches)))
        if len(names) != 1:
            raise RuntimeError(f"expected one hidden-states cache layer, found {names}")
        self.cache = kv_caches[names[0]]
        # Every TP worker holds the whole of every hidden state: the layers' outputs are all-reduced (row-parallel
        # o_proj / down_proj) before the residual stream the aux states are read from, and the cache's heads
        # (the aux layers) are not split across workers. One worker writes; the others would write the same bytes.
        self.writer = get_tensor_model_parallel_rank() == 0

    def start_load_kv(self, *args: Any, **kwargs: Any) -> None:
        pass

    def wait_for_layer_load(self, layer_name: str) -> None:
        pass

    def save_kv_layer(self, *args: Any, **kwargs: Any) -> None:
        pass  # the hidden states are in their cache already

    def wait_for_save(self) -> None:
        pass

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        if not self.has_connector_metadata():
            return None, None
        done = set()
        for req_id, w in self._get_connector_metadata().writes.items():
            if self.writer:
                self.write(w)
            done.add(req_id)  # the others' reports too: the blocks are freed once every worker reported
        return done or None, None

    def write(self, w: _Write) -> None:
        """The request's rows of the cache [n, layers, H] and its token ids [n] to w.path, through a temporary
        name of this process (0600), renamed into place: a reader never sees half a file."""
        n = len(w.token_ids)
        slots = (torch.tensor(w.block_ids)[:, None] * self.block_size + torch.arange(self.block_size)).flatten()[:n]
        states = self.cache[slots // self.block_size, :, slots % self.block_size].to("cpu")  # [n, layers, H]
        tmp = temporary_name(w.path)
        save_file({"hidden_states": states.contiguous(), "token_ids": torch.tensor(w.token_ids)}, tmp,
                  metadata=self.metadata)
        os.chmod(tmp, 0o600)  # the user's data: the owner's alone (its folder is 0700)
        os.replace(tmp, w.path)

    # -- scheduler side
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        return 0, False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        pass

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        meta, self.queued = HiddenStatesMetadata(writes=self.queued), {}
        return meta

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        if request.prompt_token_ids is None or not block_ids:
            return False, None
        path, why = hidden_states_file(self.out_dir, str((request.kv_transfer_params or {}).get("name")
                                                          or request.request_id))
        if not path:  # refused here, in the response: the worker never tries to write it
            return False, {"hidden_states_error": why}
        computed = min(len(request.prompt_token_ids), request.num_computed_tokens)  # an aborted prefill: fewer
        self.queued[request.request_id] = _Write(path, list(request.prompt_token_ids[:computed]), list(block_ids))
        return True, {"hidden_states_path": path}  # True: the blocks stay until the worker has written them

    def request_finished_all_groups(self, request: Any, block_ids: tuple[list[int], ...]
                                    ) -> tuple[bool, dict[str, Any] | None]:
        if not 0 <= self.group < len(block_ids):
            return False, None
        return self.request_finished(request, block_ids[self.group])
