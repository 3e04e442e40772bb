"""Our KV connector's write path (`dflash_lib/serve/engine_plugins/dflash_hidden_states.py`) run in the engine's
Python without a GPU: a tensor-parallel engine's workers, each in a process of its own with vLLM's TP rank faked,
are handed the same finished request; TP rank 0 alone writes the file (through a temporary name of its own
process), every worker reports the request done. A planted fault, every worker writing (as before issue 55), is
seen by the same observation."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from dflash_lib.serve.engine_plugins.file_names import PART, TEMPORARY_EXTRA, hidden_states_file, temporary_name
from dflash_lib.serve.vllm import PLUGINS

# Run by the engine's Python, for each mode into the folder argv[1]/<mode>: "rank" (vLLM's TP rank, faked per
# worker) and "plant" (every worker told it is rank 0: every worker writes). A scheduler-side connector queues one
# finished request of 6 tokens in blocks [2, 0] of 4 slots; a worker of each TP rank 0 and 1 (forked: a process
# each, as vLLM's workers) registers a random hidden-states cache [3 blocks, 2 layers, 4 slots, 5 hidden], is bound
# the scheduler's metadata and runs get_finished. JSON on stdout, per mode: per rank, its pid, the requests it
# reported done and the temporary names it renamed into place; the file left and whether it holds the cache's rows
# of the request.
WORKERS = r'''
import json, os, sys
from types import SimpleNamespace
import torch
import vllm.config
from vllm.config import KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
import dflash_hidden_states as connector
from safetensors.torch import load_file

vllm.config.get_layers_from_vllm_config = lambda config, kind, names: {n: None for n in names}  # the cache layer
renamed = []  # this process's temporary names renamed into place
real_replace = os.replace
os.replace = lambda src, dst: (renamed.append(os.path.basename(src)), real_replace(src, dst))[1]


def observe(out, mode):
    os.makedirs(out)
    config = SimpleNamespace(
        kv_transfer_config=KVTransferConfig(kv_connector="DFlashHiddenStatesConnector", kv_role="kv_producer",
                                            kv_connector_extra_config={"shared_storage_path": out}),
        cache_config=SimpleNamespace(block_size=4), model_config=SimpleNamespace(model=out, dtype=torch.float32),
        speculative_config=SimpleNamespace(draft_model_config=SimpleNamespace(
            hf_config=SimpleNamespace(eagle_aux_hidden_state_layer_ids=[1, 3]))))
    scheduler = connector.DFlashHiddenStatesConnector(config, KVConnectorRole.SCHEDULER)
    request = SimpleNamespace(request_id="r1", prompt_token_ids=[7, 8, 9, 10, 11, 12], num_computed_tokens=6,
                              kv_transfer_params={"name": "doc"})
    keep, params = scheduler.request_finished(request, [2, 0])
    meta = scheduler.build_connector_meta(None)
    cache = torch.randn(3, 2, 4, 5, generator=torch.Generator().manual_seed(0))  # [blocks, layers, slots, hidden]
    ranks = {}
    for rank in (0, 1):
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # a worker
            os.close(read)
            connector.get_tensor_model_parallel_rank = lambda: 0 if mode == "plant" else rank
            worker = connector.DFlashHiddenStatesConnector(config, KVConnectorRole.WORKER)
            worker.register_kv_caches({"cache_only_layers.4": cache})
            worker.bind_connector_metadata(meta)
            done, _ = worker.get_finished(set())
            os.write(write, json.dumps({"pid": os.getpid(), "done": sorted(done or ()), "renamed": renamed}).encode())
            os._exit(0)
        os.close(write)
        with os.fdopen(read) as f:
            ranks[rank] = json.loads(f.read())
        assert os.waitpid(pid, 0)[1] == 0
    path = params["hidden_states_path"]
    got = load_file(path)
    slots = torch.tensor([8, 9, 10, 11, 0, 1])  # blocks [2, 0] x 4 slots, the first 6
    want = cache[slots // 4, :, slots % 4]
    return {"keep": keep, "file": os.path.basename(path), "left": sorted(os.listdir(out)), "ranks": ranks,
            "rows_equal": torch.equal(got["hidden_states"], want), "token_ids": got["token_ids"].tolist()}


print(json.dumps({mode: observe(os.path.join(sys.argv[1], mode), mode) for mode in ("rank", "plant")}))
'''


def _workers(python: Path, folder: Path) -> dict:
    done = subprocess.run([str(python), "-c", WORKERS, str(folder)], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(PLUGINS)})
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def _only_rank_0_wrote(seen: dict) -> bool:
    return bool(seen["ranks"]["0"]["renamed"]) and not seen["ranks"]["1"]["renamed"]


@pytest.mark.slow  # two of the engine's Python processes (~12 s): make test, not test-fast
def test_a_tensor_parallel_engines_rank_0_alone_writes_and_every_rank_reports_done(installed_engine_python,
                                                                                    tmp_path):
    both = _workers(installed_engine_python, tmp_path)
    seen, ranks = both["rank"], both["rank"]["ranks"]
    assert seen["keep"] and seen["left"] == ["doc.safetensors"] == [seen["file"]]  # no temporary file left
    assert seen["rows_equal"] and seen["token_ids"] == [7, 8, 9, 10, 11, 12]
    assert ranks["0"]["done"] == ranks["1"]["done"] == ["r1"]  # vLLM frees the blocks once every worker reported
    assert _only_rank_0_wrote(seen)
    (tmp,) = ranks["0"]["renamed"]
    assert tmp.startswith(f"doc.safetensors.{ranks['0']['pid']}-") and tmp.endswith(PART)

    planted = both["plant"]  # every worker writes: what the observation must catch
    assert not _only_rank_0_wrote(planted) and planted["rows_equal"]
    names = [planted["ranks"][r]["renamed"][0] for r in ("0", "1")]
    assert names[0] != names[1]  # two writers: neither writes into the other's temporary file


def test_temporary_names_differ_within_a_process_and_fit_the_name_limit():
    path, why = hidden_states_file("/out", "d" * 200)
    assert why == "" and len(Path(temporary_name(path)).name) <= 200 + len(".safetensors") + TEMPORARY_EXTRA
    assert temporary_name(path) != temporary_name(path)
    longest = 255 - len(".safetensors") - TEMPORARY_EXTRA
    assert hidden_states_file("/out", "d" * longest)[1] == ""
    assert "over 255 bytes" in hidden_states_file("/out", "d" * (longest + 1))[1]
