"""`python -m dflash_lib engine-check`: the engine serves a DFlash drafter here. A random 4-layer Qwen3 target
(4 heads of 32: the CPU build's smallest head size) and a random drafter are written to a temporary folder, the
engine serves them, and one greedy answer must equal the target's own (`TargetModel.greedy`) with the drafter
drafting. What `make engine` runs after installing."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import torch

from dflash_lib.models import tiny_qwen3_config
from dflash_lib.models.drafters import drafter_kind
from dflash_lib.models.export import export_drafter
from dflash_lib.serve.adapter import EngineSpec
from dflash_lib.serve.client import EngineClient
from dflash_lib.serve.server import EngineServer
from dflash_lib.target.local import TargetModel

VOCAB, LAYERS, HIDDEN, HEAD_DIM = 512, 4, 128, 32


def check_models(kind: str = "dflash") -> tuple[TargetModel, Any]:
    """The check's target (seeded, random) and a random drafter of `kind` (a drafter_kind value) reading its
    layers 0 and 2, blocks of 4."""
    hf = tiny_qwen3_config(hidden_size=HIDDEN, num_layers=LAYERS, num_heads=HIDDEN // HEAD_DIM, num_kv_heads=2,
                           vocab_size=VOCAB)
    target = TargetModel.from_hf_config(hf, 2, layer_ids=[0, 2], seed=0)
    declared = drafter_kind(kind)
    cfg = declared.config_class(hidden_size=HIDDEN, num_layers=1, num_heads=HIDDEN // HEAD_DIM, num_kv_heads=2,
                                head_dim=HEAD_DIM, intermediate_size=2 * HIDDEN, vocab_size=VOCAB,
                                target_layer_ids=[0, 2], target_num_layers=LAYERS, block_size=4, mask_id=VOCAB - 1,
                                num_anchors=64)
    torch.manual_seed(0)
    return target, declared.module_class(cfg, target)


def engine_check(python: str | None = None, new_tokens: int = 16, log: str | Path | None = None,
                 kind: str = "dflash") -> str:
    """Serve the check's models (a drafter of `kind`) and decode one prompt; returns the verdict line.
    RuntimeError (with the engine's log) when the engine does not start or its answer differs from the target's
    greedy one."""
    target, drafter = check_models(kind)
    prompt = list(range(1, 9))
    want = target.greedy(prompt, new_tokens)
    with tempfile.TemporaryDirectory(prefix="dflash-engine-check-") as tmp:
        root = Path(tmp)
        target.model.save_pretrained(root / "target")
        export_drafter(drafter, root / "drafter", torch.float32)
        spec = EngineSpec(str(root / "target"), str(root / "drafter"), max_model_len=128, max_num_seqs=1,
                          kv_cache_gib=0.25)
        with EngineServer(spec, log or root / "engine.log", python=python) as server:
            client = EngineClient(server.url, engine=server.engine)
            try:
                version = client.version()
                got = client.decode([prompt], new_tokens)
            finally:
                client.close()
    if got.outputs[0] != want:
        raise RuntimeError(f"engine check: the served greedy answer {got.outputs[0]} differs from the target's "
                           f"{want}")
    if not got.counters.drafts:
        raise RuntimeError("engine check: the engine decoded without drafting (no spec_decode counter moved)")
    return (f"engine ok: vLLM {version} ({server.python}) served a DFlash drafter: {new_tokens} greedy tokens equal "
            f"to the target's, {got.counters.drafts:.0f} drafts, tau {got.counters.tau:.2f}")
