"""Run by the engine's Python (tests/test_causality.py): what the installed vLLM itself decides, called directly.

stdin: JSON {"folders": [a drafter folder, ...], "docs": [a config dict, ...], "masks": [[S, Q, causal, window], ...]}.
stdout (last line): JSON {"folders": [per layer causal, or an error string], "docs": [...], "masks": [(Q, S) 0/1]}.
- folders: the config vLLM builds from the folder (`get_config`, as for a served drafter), then its per-layer
  resolution `qwen3_dflash._dflash_layer_causal`;
- docs: the same resolution on a generic transformers config of the dict (no Qwen3 default for `layer_types`);
- masks: which of S cached keys each of the last Q queries attends in vLLM's CPU attention kernel, causal or not,
  with a sliding window (<= 0: none): the values are one-hot per key and the queries zero, so a query's output is
  the mean of the values it sees.
"""

import json
import sys

import torch
from transformers import PretrainedConfig
from vllm import _custom_ops as ops
from vllm.model_executor.models import qwen3_dflash
from vllm.transformers_utils.config import get_config
from vllm.v1.attention.backends.cpu_attn import _get_attn_isa


def per_layer(config) -> list[bool]:
    return [qwen3_dflash._dflash_layer_causal(config, i) for i in range(config.num_hidden_layers)]


def from_folder(folder: str):
    try:
        return per_layer(get_config(folder, trust_remote_code=False))
    except Exception as e:  # noqa: BLE001 - the engine's refusal is the answer
        return f"{type(e).__name__}: {e}"


def seen(S: int, Q: int, causal: bool, window: int, D: int = 32) -> list[list[int]]:
    block = 32
    isa = _get_attn_isa(torch.float32, block, D)
    blocks = -(-S // block) + 1
    cache = torch.zeros(blocks, 1, 2 * block, D)
    key_cache, value_cache = cache.chunk(2, dim=2)
    ops.cpu_attn_reshape_and_cache(torch.zeros(S, 1, D), torch.eye(S, D).unsqueeze(1), key_cache, value_cache,
                                   torch.arange(S), isa)
    out = torch.zeros(Q, 1, D)
    starts, lens = torch.tensor([0, Q], dtype=torch.int32), torch.tensor([S], dtype=torch.int32)
    meta = ops.cpu_attn_get_scheduler_metadata(1, 1, 1, D, lens, torch.float32, starts, causal, window, isa, False)
    ops.cpu_attention_with_kv_cache(torch.zeros(Q, 1, D), key_cache, value_cache, out, starts, lens, 1.0, causal,
                                    None, window, torch.arange(blocks, dtype=torch.int32).unsqueeze(0), 0.0, meta,
                                    None)
    return (out[:, 0, :S] > 0).int().tolist()


if __name__ == "__main__":
    job = json.loads(sys.stdin.read())
    print(json.dumps({"folders": [from_folder(f) for f in job["folders"]],
                      "docs": [per_layer(PretrainedConfig(**d)) for d in job["docs"]],
                      "masks": [seen(*m) for m in job["masks"]]}))
