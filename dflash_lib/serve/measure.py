"""The engine's side of served acceptance: the prompts our decoding measured, sent to the engine as token ids, its
own counters read per prompt set, its answers and tokens/s, with the drafter and (a second start) without it
(`decode_passes`). Judging those figures against ours is evaluation's (`evaluate.served`). docs/serving.md, "The
engine in the loop"."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Sequence

import httpx

from dflash_lib.config import ConfigError
from dflash_lib.serve.adapter import EngineSpec
from dflash_lib.serve.client import EngineClient, ServedDecode
from dflash_lib.serve.connection import log_note
from dflash_lib.serve.engine_plugins.model_identity import config_sha256, weights_fingerprint
from dflash_lib.serve.server import EngineServer, engine_adapter


@dataclass
class ServedSet:
    """One prompt set as our decoding measured it (every turn of its questions)."""

    name: str  # the set and thinking mode, e.g. "heldout (thinking off)"
    prompts: list[list[int]]  # token ids, as decoded in process
    outputs: list[list[int]]  # our speculative decoding's answers
    cycle_log: list[list[tuple[int, int]]]  # per prompt, per cycle: (context, tokens produced 1 .. B)


def check_served_model(client: EngineClient, target_dir: str, longest: int) -> None:
    """A server given by URL must serve `target_dir` (one model whose root is that folder, or a folder with the
    same config.json and weights: `model_identity`) and take `longest` tokens a sequence; ConfigError naming both
    otherwise, before any prompt is sent."""
    models = client.models()
    roots = [str(m.get("root") or m.get("id")) for m in models]
    if len(roots) != 1:
        raise ConfigError(f"the engine at {client.url} serves {roots}: give a server of the one target {target_dir!r}")
    root, mine = Path(roots[0]), Path(target_dir)
    same = root.resolve() == mine.resolve() or (root.is_dir() and (config_sha256(root), weights_fingerprint(root))
                                                == (config_sha256(mine), weights_fingerprint(mine)))
    if not same:
        raise ConfigError(f"the engine at {client.url} serves {roots[0]!r}, not the target {target_dir!r} (nor a "
                          "folder of the same config.json and weights): start it on the target, or pass its folder "
                          "as the target")
    room = models[0].get("max_model_len")
    if isinstance(room, int) and room < longest:
        raise ConfigError(f"the engine at {client.url} takes {room} tokens a sequence; these prompts need {longest} "
                          "(the longest prompt + max_new_tokens + a block): restart it with --max-model-len "
                          f"{longest}")


def _decode_all(client: EngineClient, served: "ServedPass", max_new_tokens: int, stop_ids: Sequence[int],
                min_new_tokens: int, rounds: int = 1) -> list[ServedDecode]:
    """Each set decoded (the counters read around it); with `rounds` > 1, every set decoded that many times in
    all, round after round, each set's seconds the median of its rounds (the answers and counters: the first)."""
    sets = served.sets
    if sets and sets[0].prompts:  # first-request overheads out of the timings
        client.complete(sets[0].prompts[0], min(max_new_tokens, 8))

    def once(s: ServedSet) -> ServedDecode:
        return client.decode(s.prompts, max_new_tokens, served.temperature, served.top_p, served.seed, stop_ids,
                             min_new_tokens)

    first = [once(s) for s in sets]
    if rounds <= 1:
        return first
    times = [[d.seconds] for d in first]
    for _ in range(rounds - 1):  # round after round: a slow spell of the machine falls on every set alike
        for t, s in zip(times, sets):
            t.append(once(s).seconds)
    return [replace(d, seconds=statistics.median(t), round_seconds=tuple(t)) for d, t in zip(first, times)]


@dataclass
class ServedPass:
    """One decoding of prompt sets to serve with one engine start: greedy (temperature 0) or sampled."""

    sets: list[ServedSet]  # the prompt sets as our decoding measured them
    temperature: float = 0.0  # sampling temperature of both (0 = greedy)
    top_p: float = 1.0  # nucleus mass of both when sampling
    seed: int = 0  # the requests' sampling seed


@dataclass
class EngineRun:
    """What one `decode_passes` call measured: per pass, per set, the engine's decoding with the drafter and
    (when run) without it."""

    engine: str  # its name (`server.ENGINES`)
    where: str  # the engine's Python, or the URL of a running server
    version: str  # its /version ("?" when it failed before answering)
    log: str  # its log file ("" for a running server)
    failure: str = ""  # a request that failed, in one line ("" = none); then `served` is empty
    served: list[list[ServedDecode]] = field(default_factory=list)  # per pass, per set: with the drafter
    plain: list[list[ServedDecode | None]] = field(default_factory=list)  # per pass, per set: without it (None: not run)


def decode_passes(target_dir: str, drafter_dir: str, passes: Sequence[ServedPass], block_size: int,
                  max_new_tokens: int, stop_ids: Sequence[int] = (), min_new_tokens: int = 0, dtype: str = "float32",
                  python: str | None = None, url: str = "", log_dir: str | Path = ".", start_timeout_s: float = 600.0,
                  plain: bool = True, log_name: str = "engine", rounds: int = 1) -> EngineRun:
    """Serve `drafter_dir` on `target_dir` (one engine start) and decode every pass's prompts, one at a time;
    then (`plain`) the target alone on the same prompts for the engine's own speedup (a second start). `url`: a
    server already running (with this drafter), checked to serve the target and used as it is, no plain run.
    Logs: `log_dir`/`log_name`.log and `log_name`-plain.log. `rounds`: with the plain run, each set is timed
    that many times on each engine (the seconds: the median round's, every round kept). A request that fails
    is `EngineRun.failure`, not an exception."""
    everything = [p for s in passes for p in s.sets for p in p.prompts]
    longest = max((len(p) for p in everything), default=0) + max_new_tokens + block_size
    spec = EngineSpec(target_dir, drafter_dir, dtype=dtype, max_model_len=max(256, longest), max_num_seqs=1)
    log = Path(log_dir) / f"{log_name}.log"
    failure, version = "", "?"
    served: list[list[ServedDecode]] = []
    timed = max(1, rounds) if plain and not url else 1
    with (EngineServer(spec, log, python, start_timeout_s) if not url else _Running(url)) as server:
        client = EngineClient(server.url, engine=engine_adapter(spec.engine))
        try:
            if url:
                check_served_model(client, target_dir, longest)
            version = client.version()
            served = [_decode_all(client, s, max_new_tokens, stop_ids, min_new_tokens, timed) for s in passes]
        except (RuntimeError, httpx.HTTPError) as e:  # a refusal, or an engine gone (its log named)
            what = str(e) if isinstance(e, RuntimeError) else f"{type(e).__name__}: {e}"
            failure, served = " ".join(what.split())[:300] + log_note(server.url), []
        finally:
            client.close()
    where, log_file = (url, "") if url else (str(server.python), str(log))
    alone: list[list[ServedDecode | None]] = [[None] * len(s.sets) for s in passes]
    if plain and not url and not failure:
        target_alone = EngineSpec(target_dir, None, dtype=dtype, max_model_len=spec.max_model_len, max_num_seqs=1)
        with EngineServer(target_alone, Path(log_dir) / f"{log_name}-plain.log", python,
                          start_timeout_s) as server_alone:
            client = EngineClient(server_alone.url, engine=engine_adapter(spec.engine))
            try:
                alone = [list(_decode_all(client, s, max_new_tokens, stop_ids, min_new_tokens, timed))
                         for s in passes]
            finally:
                client.close()
    return EngineRun(spec.engine, where, version, log_file, failure, served, alone)


class _Running:
    """A server already running at `url`, used as `EngineServer` is (nothing started, nothing stopped)."""

    def __init__(self, url: str) -> None:
        self.url = url

    def __enter__(self) -> "_Running":
        return self

    def __exit__(self, *exc: object) -> None:
        return None


