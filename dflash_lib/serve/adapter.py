"""What the house asks of a serving engine (`EngineAdapter`), and what it asks the engine to serve (`EngineSpec`).

Each engine is one module holding everything that is its alone (vLLM: `serve/vllm.py`: its command line and
speculative config, its metrics names, its dtype rules, its known faults, our connector's names); `server.py`
starts whichever `EngineSpec.engine` names, the client reads its metrics by the adapter's names. A second engine
is one such module, its entry in `server.ENGINES` and its doctor rules (docs/architecture.md, "How to add")."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Mapping


@dataclass(frozen=True)
class EngineSpec:
    """What the server serves and how, in the engine's own terms only through its adapter (`args`)."""

    target: str  # the target's local Hugging Face folder
    drafter: str | None = None  # an exported DFlash drafter folder; None: the target alone
    dtype: str = "float32"  # float32 | bfloat16 (the CPU build runs both)
    max_model_len: int = 2048  # tokens per sequence, prompt and answer
    max_num_seqs: int = 8  # sequences decoded at once
    kv_cache_gib: float = 1.0  # the KV cache's size (GiB)
    seed: int = 0  # the engine's sampling seed (requests may give their own)
    token_ids: bool = True  # prompts and answers as token ids, no tokenizer; False: the folder's tokenizer and chat
    # template serve text too (the chat endpoint `regenerate --backend openai` uses)
    extra: tuple[str, ...] = field(default_factory=tuple)  # more server flags, verbatim
    hidden_states: tuple[int, ...] = ()  # the engine's layer ids (`hidden_states.engine_layer_ids`) whose hidden
    # states each request writes to `hidden_states_dir` through our connector; no drafter
    hidden_states_dir: str = ""
    engine: str = "vllm"  # which engine serves it (`server.ENGINES`)


@dataclass(frozen=True)
class EngineAdapter:
    """One serving engine as the house uses it: how to start its OpenAI-compatible server and read its metrics."""

    name: str  # the engine's name in settings and logs
    module: str  # `python -m <module> <args>` starts its server (in the engine's own Python)
    args: Callable[[EngineSpec, int | None], list[str]]  # the server's flags for a spec on a loopback port; port
    # None: the flags a server started by hand needs for that spec (the user adds host, port, memory, parallelism)
    env: Callable[[EngineSpec], dict[str, str]]  # environment the server needs beyond ours (e.g. our plugins' path)
    dtype: Callable[[str | Path, bool], str]  # (target folder, on a CPU) -> the dtype it serves that target in
    known_fault: Callable[[str, float], str]  # (its version, temperature) -> "; known engine fault: ..." or ""
    spec_prefix: str  # prefix of its speculative-decoding counters in /metrics (Prometheus)
    load_metrics: Mapping[str, str]  # its /metrics names of the load figures -> "in_flight" | "finished" | "generated"
    api_key_env: str = "VLLM_API_KEY"  # the environment variable its server reads its API key from (a key sent
    # as `Authorization: Bearer`; vLLM guards /v1 with it, not /health nor /metrics)
