"""What is vLLM's alone, behind `serve.adapter.EngineAdapter` (`VLLM`): its server's module and flags, the
speculative config that serves a DFlash drafter (or extracts hidden states through our connector), its metrics
names, its dtype rule for linear-attention targets on CPU, and its known faults. Nothing here imports vllm; the
layer numbering of its hidden states is `serve/hidden_states.py`'s and the drafter's config.json is
`models/export.py`'s (the serving format the engines read). docs/serving.md."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from dflash_lib.config import ConfigError
from dflash_lib.families import family_of, text_config
from dflash_lib.serve.adapter import EngineAdapter, EngineSpec

SERVER_MODULE = "vllm.entrypoints.openai.api_server"  # `vllm serve` without the CLI's package-name lookup
PLUGINS = Path(__file__).resolve().parent / "engine_plugins"  # modules the engine imports (its PYTHONPATH)
HIDDEN_STATES_CONNECTOR = "DFlashHiddenStatesConnector"  # engine_plugins/dflash_hidden_states.py
CONNECTOR_MODULE = "dflash_hidden_states"  # its module name on that path
SPEC_PREFIX = "vllm:spec_decode_"  # num_drafts, num_draft_tokens, num_accepted_tokens(_per_pos) counters
LOAD_METRICS = {"vllm:num_requests_running": "in_flight", "vllm:num_requests_waiting": "in_flight",
                "vllm:request_success_total": "finished", "vllm:generation_tokens_total": "generated"}
# Engine faults known to make served figures wrong, by version prefix, each with where it is reported: named on
# a FAIL line of the passes it concerns ("sampled": temperature > 0)
KNOWN_FAULTS = (("0.32.", "sampled", "vLLM 0.32's CPU build samples the target at T > 0 with per-token "
                 "temperatures read from uninitialised memory (vllm-project/vllm#55005, fix PR #55006): trust its "
                 "greedy rows only"),)


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


def linear_attention_target(target: str | Path) -> bool:
    """The target folder's config (a vision-language wrapper's text config) has linear-attention layers (Qwen3.5,
    Qwen3-Next: gated delta net between full attention), or is of a family vLLM serves by its hybrid model
    (`TargetFamily.linear_attention`). False for a folder without a readable config.json."""
    try:
        doc = json.loads((Path(target) / "config.json").read_text())
    except (OSError, ValueError):
        return False
    text = text_config(doc)
    if not isinstance(text, dict):
        return False
    return "linear_attention" in (text.get("layer_types") or ()) or family_of(text).linear_attention


def engine_dtype(target: str | Path, on_cpu: bool) -> str:
    """The dtype to serve `target` in, matching our decoding where the engine can: float32 on CPU (greedy then
    agrees exactly), bfloat16 on GPUs and for a linear-attention target on CPU (vLLM's CPU gated-delta-net kernel
    runs bf16 only: "CPU GDN attention requires BF16", vllm 0.32 `mamba/ops/cpu/gdn_attention.py`)."""
    return "float32" if on_cpu and not linear_attention_target(target) else "bfloat16"


def speculative_config(spec: EngineSpec) -> dict[str, Any] | None:
    """DFlash with K = B - 1 drafted tokens per step (None without a drafter), sampled drafts at T > 0 judged by
    the standard rule min(1, p/q), as our speculative sampling (vLLM's default "greedy" drafts its argmax and
    accepts it with probability p(argmax q): another rule, another acceptance). With `hidden_states`: vLLM's
    extract_hidden_states of those layers instead (no drafter)."""
    if spec.hidden_states:
        return {"method": "extract_hidden_states", "num_speculative_tokens": 1,
                "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": list(spec.hidden_states)}}}
    if spec.drafter is None:
        return None
    k = drafter_block_size(spec.drafter) - 1
    return {"method": "dflash", "model": str(Path(spec.drafter).resolve()), "num_speculative_tokens": k,
            "draft_sample_method": "probabilistic"}


def kv_transfer_config(spec: EngineSpec) -> dict[str, Any]:
    """Our connector (`engine_plugins/`, on the engine's PYTHONPATH) writing each request's hidden states of the
    `hidden_states` layers into `hidden_states_dir`."""
    return {"kv_connector": HIDDEN_STATES_CONNECTOR, "kv_connector_module_path": CONNECTOR_MODULE,
            "kv_role": "kv_producer", "kv_connector_extra_config": {"shared_storage_path": spec.hidden_states_dir}}


def server_args(spec: EngineSpec, port: int | None) -> list[str]:
    """The server's flags. With a port: loopback only, eager mode, the spec's sizes and seed, then `extra`.
    Always: the target, dtype and length, (`token_ids`) prompts and answers as token ids with no tokenizer (the
    engine sees exactly the ids we decode), the speculative and connector configs."""
    out = ["--model", str(Path(spec.target).resolve()), "--dtype", spec.dtype, "--max-model-len",
           str(spec.max_model_len)]
    if port is not None:
        out += ["--host", "127.0.0.1", "--port", str(port), "--max-num-seqs", str(spec.max_num_seqs), "--seed",
                str(spec.seed), "--kv-cache-memory-bytes", str(int(spec.kv_cache_gib * 2**30)), "--enforce-eager"]
    if spec.token_ids:
        out.append("--skip-tokenizer-init")
    speculative = speculative_config(spec)
    if speculative is not None:
        out += ["--speculative-config", json.dumps(speculative)]
        if port is not None and linear_attention_target(spec.target):  # prefix caching puts the recurrent state
            out.append("--no-enable-prefix-caching")  # in vLLM's "align" mode, whose copy kernel is Triton's: none
            # on CPU (a server started by hand, on a GPU, keeps its prefix caching)
    if spec.hidden_states:
        out += ["--kv-transfer-config", json.dumps(kv_transfer_config(spec))]
    return out + (list(spec.extra) if port is not None else [])


def server_env(spec: EngineSpec) -> dict[str, str]:
    """Our connector's folder on the engine's PYTHONPATH when it writes hidden states (nothing else of ours)."""
    return {"PYTHONPATH": str(PLUGINS)} if spec.hidden_states else {}


def known_fault(version: str, temperature: float) -> str:
    """"; known engine fault: ..." for an engine `version` with a `KNOWN_FAULTS` entry for this kind of pass."""
    kind = "sampled" if temperature > 0 else "greedy"
    return "".join(f"; known engine fault: {text}" for prefix, where, text in KNOWN_FAULTS
                   if version.startswith(prefix) and where == kind)


VLLM = EngineAdapter(name="vllm", module=SERVER_MODULE, args=server_args, env=server_env, dtype=engine_dtype,
                     known_fault=known_fault, spec_prefix=SPEC_PREFIX, load_metrics=LOAD_METRICS)
