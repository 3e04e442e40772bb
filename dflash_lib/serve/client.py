"""Talking to a running engine: completions with token-id prompts and answers, and the engine's own
speculative-decoding counters read from its Prometheus /metrics (`SpecCounters`), whose deltas over a set of
requests give the SERVED acceptance: tau = 1 + accepted / drafts, and the share of drafts accepting position k.
A delta holds our request alone or is refused (`Load`: another client's requests would be mixed in)."""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
from typing import Mapping, Sequence

import httpx

from dflash_lib.config import ConfigError
from dflash_lib.serve.adapter import EngineAdapter
from dflash_lib.serve.connection import http_client
from dflash_lib.serve.vllm import VLLM

_LINE = re.compile(r'^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(?P<labels>[^}]*)\})?\s+(?P<value>\S+)')
_POSITION = re.compile(r'position="(\d+)"')


@dataclass(frozen=True)
class SpecCounters:
    """The engine's speculative-decoding counters (summed over its engines), or a difference of two readings."""

    drafts: float  # verification steps that carried drafted tokens
    draft_tokens: float  # drafted tokens proposed
    accepted: float  # drafted tokens accepted
    per_position: tuple[float, ...]  # [k]: drafts that accepted draft position k + 1 (0-based k)

    def __sub__(self, other: "SpecCounters") -> "SpecCounters":
        n = max(len(self.per_position), len(other.per_position))
        mine = self.per_position + (0.0,) * (n - len(self.per_position))
        theirs = other.per_position + (0.0,) * (n - len(other.per_position))
        return SpecCounters(self.drafts - other.drafts, self.draft_tokens - other.draft_tokens,
                            self.accepted - other.accepted, tuple(a - b for a, b in zip(mine, theirs)))

    @property
    def tau(self) -> float:
        """Tokens per drafting step: accepted drafts + the token the verification adds (nan with no draft)."""
        return 1.0 + self.accepted / self.drafts if self.drafts else float("nan")

    @property
    def acceptance(self) -> list[float]:
        """[k]: the share of drafting steps that accepted draft position k + 1."""
        return [a / self.drafts if self.drafts else float("nan") for a in self.per_position]


def parse_spec_counters(text: str, prefix: str = VLLM.spec_prefix) -> SpecCounters:
    """`SpecCounters` from Prometheus exposition text (an engine's /metrics): the `_total` samples of
    `prefix` + num_drafts, num_draft_tokens, num_accepted_tokens and num_accepted_tokens_per_pos (one per position
    label), summed over the other labels (engine index, model name). All zero when the engine serves no drafter."""
    sums = {"num_drafts": 0.0, "num_draft_tokens": 0.0, "num_accepted_tokens": 0.0}
    per_pos: dict[int, float] = {}
    for line in text.splitlines():
        m = _LINE.match(line)
        if m is None or not m["name"].startswith(prefix) or not m["name"].endswith("_total"):
            continue
        key = m["name"][len(prefix):-len("_total")]
        value = float(m["value"])
        if key == "num_accepted_tokens_per_pos":
            pos = _POSITION.search(m["labels"] or "")
            if pos is not None:
                per_pos[int(pos[1])] = per_pos.get(int(pos[1]), 0.0) + value
        elif key in sums:
            sums[key] += value
    positions = tuple(per_pos.get(k, 0.0) for k in range(max(per_pos) + 1)) if per_pos else ()
    return SpecCounters(sums["num_drafts"], sums["num_draft_tokens"], sums["num_accepted_tokens"], positions)


class BusyEngineError(ConfigError):
    """The engine served other clients' requests while ours were measured: its counters are not ours alone (a
    server to give one's own, not a fault of the drafter)."""


@dataclass(frozen=True)
class Load:
    """What the engine is doing and has done, from /metrics: requests in flight (running + waiting), requests
    finished and tokens generated since it started (summed over its engines and labels)."""

    in_flight: float
    finished: float
    generated: float


def parse_load(text: str, names: Mapping[str, str] = VLLM.load_metrics) -> Load:
    """`Load` from Prometheus exposition text (an engine's /metrics; `names`: its metric -> Load field)."""
    sums = {"in_flight": 0.0, "finished": 0.0, "generated": 0.0}
    for line in text.splitlines():
        m = _LINE.match(line)
        if m is not None and m["name"] in names:
            sums[names[m["name"]]] += float(m["value"])
    return Load(**sums)


def alone(before: Load, after: Load, tokens: int, url: str) -> None:
    """BusyEngineError unless, between `before` and `after` one request of ours, the engine ran nothing else: none
    in flight at either reading, one request finished and exactly its `tokens` generated."""
    if (before.in_flight, after.in_flight, after.finished - before.finished, after.generated - before.generated) \
            != (0, 0, 1, tokens):
        raise BusyEngineError(
            f"the engine at {url} served other requests while one of ours was measured ({before.in_flight:g} / "
            f"{after.in_flight:g} in flight before / after, {after.finished - before.finished:g} finished, "
            f"{after.generated - before.generated:g} tokens generated for our {tokens}): its counters would mix "
            "theirs into ours; measure on a server no one else uses")


@dataclass(frozen=True)
class ServedDecode:
    """Prompts decoded one at a time by the engine (`EngineClient.decode`)."""

    outputs: list[list[int]]  # the generated token ids of each prompt
    counters: SpecCounters  # the engine's counters over the whole decoding
    per_prompt: list[SpecCounters]  # the same, per prompt
    seconds: float  # wall time of the requests (the median of `round_seconds` when the set was timed again)
    round_seconds: tuple[float, ...] = ()  # wall time of each timed decoding of the same prompts (() = this one only)

    @property
    def tokens(self) -> int:
        return sum(len(o) for o in self.outputs)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else float("nan")


class EngineClient:
    """An OpenAI-compatible engine at `url` (`engine`: its adapter, whose metrics names are read), prompts and
    answers as token ids; its API key sent, proxies bypassed on loopback (`connection.http_client`)."""

    def __init__(self, url: str, timeout_s: float = 600.0, transport: httpx.BaseTransport | None = None,
                 engine: EngineAdapter = VLLM) -> None:
        self.url = url.rstrip("/")
        self.engine = engine
        self.http = http_client(self.url, timeout_s, transport, engine.api_key_env)  # `transport`: a stand-in
        self._model: str | None = None

    def close(self) -> None:
        self.http.close()

    def _get(self, path: str) -> httpx.Response:
        r = self.http.get(self.url + path)
        r.raise_for_status()
        return r

    @property
    def model(self) -> str:
        """The served model's name (the first of /v1/models)."""
        if self._model is None:
            self._model = self._get("/v1/models").json()["data"][0]["id"]
        return self._model

    def models(self) -> list[dict]:
        """The entries of /v1/models (vLLM's: id, root = the folder it loaded, max_model_len)."""
        return list(self._get("/v1/models").json()["data"])

    def version(self) -> str:
        """The engine's version (its /version), "?" when it does not say."""
        try:
            return str(self._get("/version").json().get("version", "?"))
        except (httpx.HTTPError, ValueError):
            return "?"

    def counters(self) -> SpecCounters:
        return parse_spec_counters(self._get("/metrics").text, self.engine.spec_prefix)

    def _reading(self) -> tuple[SpecCounters, Load]:
        text = self._get("/metrics").text
        return parse_spec_counters(text, self.engine.spec_prefix), parse_load(text, self.engine.load_metrics)

    def complete(self, prompt: Sequence[int], max_tokens: int, temperature: float = 0.0, top_p: float = 1.0,
                 seed: int | None = None, stop_ids: Sequence[int] = (), min_tokens: int = 0) -> list[int]:
        """The engine's answer to the token ids `prompt`: at most `max_tokens` ids, ending at the first of
        `stop_ids` (included, never before `min_tokens`); the model's own end-of-sequence id does not stop it
        unless listed, as in our decoding. Greedy at temperature 0."""
        body = {"model": self.model, "prompt": [int(t) for t in prompt], "max_tokens": int(max_tokens),
                "temperature": float(temperature), "top_p": float(top_p), "ignore_eos": True,
                "stop_token_ids": [int(s) for s in stop_ids], "min_tokens": int(min_tokens),
                "return_token_ids": True}
        if seed is not None:
            body["seed"] = int(seed)
        r = self.http.post(self.url + "/v1/completions", json=body)
        if r.status_code != 200:
            raise RuntimeError(f"the engine refused a completion ({r.status_code}): {r.text[:500]}")
        ids = r.json()["choices"][0].get("token_ids")
        if ids is None:
            raise RuntimeError("the engine's completion carries no token_ids (an engine without return_token_ids)")
        return [int(t) for t in ids]

    def decode(self, prompts: Sequence[Sequence[int]], max_tokens: int, temperature: float = 0.0,
               top_p: float = 1.0, seed: int = 0, stop_ids: Sequence[int] = (),
               min_tokens: int = 0) -> ServedDecode:
        """Every prompt answered in turn (batch 1, as `evaluate.acceptance` decodes), the counters read
        around each request, which must be the engine's only one then (`alone`); prompt i samples with seed
        `seed + i`."""
        outputs, per_prompt = [], []
        before, load = self._reading()
        start = before
        seconds = 0.0  # the requests alone, not the counter readings
        for i, prompt in enumerate(prompts):
            t = time.perf_counter()
            outputs.append(self.complete(prompt, max_tokens, temperature, top_p, seed + i if temperature > 0 else
                                         None, stop_ids, min_tokens))
            seconds += time.perf_counter() - t
            after, load_after = self._reading()
            alone(load, load_after, len(outputs[-1]), self.url)
            per_prompt.append(after - before)
            before, load = after, load_after
        return ServedDecode(outputs, before - start, per_prompt, seconds)
