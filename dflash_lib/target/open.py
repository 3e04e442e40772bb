"""Which source of the target's features a run reads, picked from its settings and opened: `model.target_engine`
vllm (an engine runs the target), `model.hidden_cache` (its captured features, read first), else the local model,
replicated on each target device or sharded over the ranks (`train.target_parallel`, `sharded.plan_target`).

    check_target:  the refusals and the facts (read once), before a run folder is made -> TargetSource
    engine_url:    the served source's engine, started here or named by `target_engine_url`, and its files
    open_sources:  the FeatureSource(s) the feed runs (`target.protocol`)
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Iterator, Sequence

import torch

from dflash_lib.config import ConfigError, reads_final_states
from dflash_lib.serve.hidden_states import EngineFiles
from dflash_lib.target.cached import CapturedFeatures, open_cache
from dflash_lib.target.facts import TargetFacts, read_facts
from dflash_lib.target.local import TargetModel, check_trainable
from dflash_lib.target.protocol import FeatureSource
from dflash_lib.target.served import ServedTarget, engine_files, probe_engine, target_engine_url
from dflash_lib.target.sharded import load_sharded_target


@dataclass(frozen=True)
class TargetSource:
    """The source a run's settings pick, checked (`check_target`)."""

    facts: TargetFacts  # the target's facts, read once
    engine: bool  # target_engine vllm: an engine runs the target (for the documents the cache lacks)
    cache: CapturedFeatures | None = None  # hidden_cache: the captured features, opened and checked
    url: str = ""  # the engine's address, once started or named (`engine_url`)
    files: EngineFiles | None = None  # what this rank reads from the engine's files (`engine_url`)

    @property
    def served(self) -> bool:
        """True when the features come from outside the process (an engine, a cache): `ServedTarget`."""
        return self.engine or self.cache is not None


def check_target(config: Any, world_size: int, device: torch.device, store_key: str) -> TargetSource:
    """The source of `config`'s run, refused in one line before a run folder is made: a local target whose
    config.json or weights cannot train (`check_trainable`), a served or cached one that is not a local
    folder, an engine started per rank under torchrun, a served or cached one whose final logits are soft-capped
    for a loss reading them (kl, ce+kl), a server started by hand that serves another model or layers
    (`probe_engine`), a cache of another target, layer set, loss kind, dtype or token store `store_key`
    (`cached.open_cache`)."""
    m = config.model
    engine = m.target_engine == "vllm"
    facts = read_facts(m)  # config.json, read once: every source below takes these facts
    if not engine and not m.hidden_cache:
        check_trainable(m, facts.hf)  # a folder that is no causal LM, or has no weights, is refused here
    elif not Path(m.target).is_dir():
        raise ConfigError(f"target_engine vllm serves a LOCAL model folder, got target {m.target!r}")
    elif engine and world_size > 1 and not m.target_engine_url:
        raise ConfigError("target_engine vllm under torchrun: start one server for all ranks and pass its "
                          "address as -p target_engine_url")
    cap = getattr(facts.hf, "final_logit_softcapping", None)
    if (engine or m.hidden_cache) and reads_final_states(m.loss) and cap:
        raise ConfigError(f"target {m.target!r}: loss {m.loss!r} reads the target's distribution, whose final logits "
                          f"are soft-capped (final_logit_softcapping {cap}); train with loss 'ce'")
    if engine and m.target_engine_url:  # a server started by hand: what it serves, checked here
        probe_engine(config, facts, device)
    cache = open_cache(config, facts, store_key, device) if m.hidden_cache else None
    return TargetSource(facts, engine, cache)


@contextlib.contextmanager
def engine_url(config: Any, source: TargetSource, run_dir: Path, device: torch.device,
               rank: int) -> Iterator[TargetSource]:
    """`source` with its engine's address and the files this rank reads from it (a source no engine runs: as it
    is); an engine started here (`served.target_engine_url`) is stopped on leaving."""
    if not source.engine:
        yield source
        return
    with target_engine_url(config, source.facts, run_dir, device) as url:
        yield replace(source, url=url, files=engine_files(config, source.facts, run_dir, device,
                                                          f"{Path(run_dir).resolve()}#{rank}"))


def open_sources(config: Any, source: TargetSource, devices: Sequence[torch.device], dtype: torch.dtype,
                 parallel: str) -> list[FeatureSource]:
    """The sources the feed runs, in `dtype`: one `ServedTarget` on devices[0] for a served source (its engine's
    `url` and `files`, the cache first), one `ShardedTarget` for `parallel` fsdp, else a `TargetModel` replica
    per device (the same seed on every device: identical replicas). Static shapes (`sampler.static_shapes`) run
    every slot through a local target."""
    m, tc = config.model, config.train
    gather = not config.sampler.static_shapes
    if source.served:
        return [ServedTarget(source.facts, source.url, devices[0], dtype,
                             concurrency=max(1, config.pipeline.target_workers) * 4, cache=source.cache,
                             files=source.files, final=reads_final_states(m.loss))]
    if parallel == "fsdp":
        return [load_sharded_target(m, devices[0], dtype, tc.dist_timeout_s, tc.seed, gather, source.facts.hf)]
    return [TargetModel.from_model_config(m, device=d, dtype=dtype, seed=tc.seed, gather=gather, hf_cfg=source.facts.hf)
            for d in devices]
