"""Acceptance length tau by real speculative decoding on KV caches (`acceptance_length`): per cycle the drafter
drafts a block, the target verifies it in one forward, and the cycle keeps the accepted run plus the target's next
token: greedy (the output is the target's own greedy decoding, token for token) or, at temperature > 0, by
speculative sampling (`models.sampling`). `greedy_decode` is the plain baseline it is timed against.

The cycle, its positions and the two models' caches: docs/dflash.md, "Acceptance length tau"; tau, speedup and
sampling as `evaluate` reports them: docs/serving.md, "Measuring a drafter: speculative decoding on held-out prompts".
"""

from __future__ import annotations

import copy
import inspect
import time
from collections import Counter
from dataclasses import dataclass, field, replace
from typing import Any, Sequence

import torch
from transformers import DynamicCache

from dflash_lib.models.sampling import draw, sampling_probs, speculative_step
from dflash_lib.target.local import TargetModel, TargetStep


@dataclass
class AcceptanceResult:
    tau: float  # mean tokens per drafting cycle (accepted draft tokens + 1 bonus); 1 .. B
    histogram: dict[int, int]  # tokens per cycle -> number of cycles
    outputs: list[list[int]]  # the generated tokens of each prompt (max_new_tokens, or up to a stop id)
    cycles: int  # drafting cycles over all prompts
    per_position: list[float] = field(default_factory=list)  # [k-1]: fraction of cycles accepting draft slot k
    target_calls: int = 0  # target forwards: one prefill per prompt + one verification per cycle
    seconds: float = 0.0  # wall-clock time of the whole decoding (prefills included)
    # per prompt, per cycle: (context length when the cycle drafted = prompt + output so far, tokens the cycle
    # produced 1 .. B); what acceptance by context length, turn or benchmark is computed from
    cycle_log: list[list[tuple[int, int]]] = field(default_factory=list)
    temperature: float = 0.0  # sampling temperature of the target (and the drafter's proposals); 0 = greedy
    top_p: float = 1.0  # nucleus mass both distributions were cut to (temperature > 0)

    @property
    def output_tokens(self) -> int:
        return sum(len(o) for o in self.outputs)

    @property
    def target_calls_per_token(self) -> float:
        return self.target_calls / self.output_tokens if self.output_tokens else float("nan")

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.seconds if self.seconds > 0 else float("nan")


@dataclass
class DecodeResult:
    """Plain decoding with the target's KV cache, greedy or sampled (the speed baseline, `greedy_decode`)."""

    outputs: list[list[int]]  # generated tokens of each prompt
    seconds: float  # wall-clock time (prefills included)

    @property
    def tokens_per_s(self) -> float:
        n = sum(len(o) for o in self.outputs)
        return n / self.seconds if self.seconds > 0 else float("nan")


class TargetCache:
    """The target over its own Hugging Face KV cache, for one sequence: each `forward` runs only the tokens it
    is given, at the positions after those already cached; `crop` drops rejected positions. A cache that cannot
    drop positions (a linear-attention layer's recurrent state, a sliding layer past its window) is copied before
    each forward after the first, and `crop` restores that copy and runs the kept tokens again."""

    def __init__(self, target: TargetModel):
        self.target = target
        try:
            self.cache = DynamicCache(config=target.hf)
        except TypeError:  # older transformers: no config argument
            self.cache = DynamicCache()
        params = inspect.signature(target.base.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"  # renamed in transformers 5
        self.length = 0  # positions held
        self._before: tuple[Any, int, torch.Tensor] | None = None  # (cache copy, its length, the ids run since)

    def _croppable(self) -> bool:
        """Every layer of the cache drops positions exactly (plain keys and values; transformers 4's cache has
        no layer objects and holds only those)."""
        return all(type(layer).__name__ == "DynamicLayer" for layer in getattr(self.cache, "layers", ()))

    def _run(self, ids: torch.Tensor, past: int, features: bool) -> Any:
        dev, T = self.target.device, ids.shape[0]
        pos = torch.arange(past, past + T, device=dev)  # (T,)
        kwargs: dict[str, Any] = {self._cache_kw: self.cache}  # transformers builds each layer kind's mask
        return self.target.base(input_ids=ids.to(dev).reshape(1, T), position_ids=pos.reshape(1, T), use_cache=True,
                                output_hidden_states=features, **kwargs)

    def forward(self, ids: torch.Tensor, features: bool = True) -> TargetStep:
        """ids (T,) at positions length .. length+T-1 -> features (T, F*H) (None when not asked) and next-token
        logits (T, V); the cache then holds length+T positions."""
        t = self.target
        T, past = ids.shape[0], self.length
        self._before = None
        if past and not self._croppable():  # what `crop` restores
            self._before = (copy.deepcopy(self.cache), past, ids)
        out = self._run(ids, past, features)
        self.length = past + T
        feats = None
        if features:  # hidden_states[i + 1] = output of decoder layer i
            feats = torch.cat([out.hidden_states[i + 1][0] for i in t.layer_ids], dim=-1)  # (T, F*H)
        return TargetStep(feats, t.logits(out.last_hidden_state[0]))  # last_hidden_state is final-normed

    def crop(self, length: int) -> None:
        """Keep positions 0 .. length-1 (at least those held before the latest `forward`)."""
        if length >= self.length:
            return
        if self._before is None:
            self.cache.crop(length - self.length)  # negative: drop that many (transformers 4 and 5 alike)
        else:
            self.cache, past, ids = self._before
            if length < past:
                raise ValueError(f"crop to {length} positions: only the latest forward's (from {past}) can be dropped")
            if length > past:
                self._run(ids[:length - past], past, features=False)
        self._before = None
        self.length = length


class _CachedDrafting:
    def __init__(self, drafter: Any):
        self.drafter, self.cache = drafter, drafter.context_cache()

    def extend(self, features: torch.Tensor) -> None:
        self.drafter.extend_context(self.cache, features)

    def draft(self, anchor_token: int) -> list[int]:
        return self.drafter.draft_cached(self.cache, anchor_token)

    def logits(self, anchor_token: int) -> torch.Tensor | None:
        """(B-1, V) the drafter's logits at its draft slots; None for a drafter that gives only tokens (one that walks
        candidates, dflash2: its greedy walk is then proposed as a point mass, still exact speculative sampling)."""
        if not hasattr(self.drafter, "draft_logits_cached") or getattr(self.drafter, "walks_candidates", False):
            return None
        return self.drafter.draft_logits_cached(self.cache, _block_ids(self.drafter, anchor_token))[1:]


class _FeatureDrafting:
    """For a drafter with only `draft(features, anchor_pos, anchor_token)`: the accepted features, growing."""

    def __init__(self, drafter: Any):
        self.drafter, self.features = drafter, None

    def extend(self, features: torch.Tensor) -> None:
        self.features = features if self.features is None else torch.cat([self.features, features])

    def draft(self, anchor_token: int) -> list[int]:
        return self.drafter.draft(self.features, self.features.shape[0], anchor_token)

    def logits(self, anchor_token: int) -> torch.Tensor | None:
        """(B-1, V) the drafter's logits at its draft slots; None for a drafter that gives only tokens (one that walks
        candidates, dflash2: its greedy walk is then proposed as a point mass, still exact speculative sampling)."""
        if not hasattr(self.drafter, "draft_logits") or getattr(self.drafter, "walks_candidates", False):
            return None
        ids = _block_ids(self.drafter, anchor_token)
        return self.drafter.draft_logits(self.features, self.features.shape[0], ids)[1:]


def _block_ids(drafter: Any, anchor_token: int) -> torch.Tensor:
    """(B,) [anchor, MASK x (B-1)]: the block a DFlash drafter drafts from."""
    ids = torch.full((drafter.cfg.block_size,), drafter.cfg.mask_id, dtype=torch.long)
    ids[0] = anchor_token
    return ids


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _check(prompts: Sequence[Sequence[int]], max_new_tokens: int, temperature: float = 0.0, top_p: float = 1.0,
           generator: torch.Generator | None = None) -> torch.Generator | None:
    """Refuse bad arguments; the generator sampling draws from (None when greedy; a CPU one seeded 0 when none
    is given)."""
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    for i, prompt in enumerate(prompts):
        if not prompt:
            raise ValueError(f"prompt {i} is empty")
    if not temperature >= 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    if temperature == 0:
        return None
    if generator is None:
        return torch.Generator().manual_seed(0)
    if generator.device.type != "cpu":
        raise ValueError(f"the sampling generator must be a CPU torch.Generator (device-independent draws), got one "
                         f"on {generator.device}")
    return generator


def _masked(logits: torch.Tensor, first: int, min_new_tokens: int, stops: frozenset[int]) -> torch.Tensor:
    """logits (T, V), row i being output token number `first + i` (0-based), with the stop ids' logits -inf in the
    rows before `min_new_tokens` (as Hugging Face's `min_new_tokens`); a copy when any is masked."""
    early = min(max(min_new_tokens - first, 0), logits.shape[0])  # rows that may not stop yet
    if early and stops:
        logits = logits.clone()
        logits[:early, sorted(stops)] = float("-inf")
    return logits


def _greedy(logits: torch.Tensor, first: int, min_new_tokens: int, stops: frozenset[int]) -> list[int]:
    """The greedy tokens of logits (T, V), row i being output token number `first + i` (0-based); rows before
    `min_new_tokens` never pick a stop id (`_masked`)."""
    return _masked(logits, first, min_new_tokens, stops).argmax(dim=-1).tolist()


@dataclass(frozen=True)
class _Choice:
    """How output tokens are chosen: stop ids masked before `min_new_tokens`, then greedy (generator None) or
    sampled from `sampling_probs`. `first` below: the output token number (0-based) of a logits' row 0."""

    stops: frozenset[int]
    min_new_tokens: int
    temperature: float
    top_p: float
    generator: torch.Generator | None  # None: greedy
    forced: tuple[int, ...] = ()  # greedy: the output tokens the target is taken to choose (`acceptance_length`'s
    # `answers`), its own argmax beyond them

    def _pick(self, logits: torch.Tensor, first: int) -> list[int]:
        """The greedy tokens of logits (T, V), row i being output token `first + i`, those within `forced` forced."""
        picked = _greedy(logits, first, self.min_new_tokens, self.stops)
        return [self.forced[first + i] if first + i < len(self.forced) else t for i, t in enumerate(picked)]

    def probs(self, logits: torch.Tensor, first: int) -> torch.Tensor:
        """logits (T, V) -> the sampling distributions (T, V)."""
        masked = _masked(logits, first, self.min_new_tokens, self.stops)
        return sampling_probs(masked, self.temperature, self.top_p)

    def next_tokens(self, logits: torch.Tensor, first: int) -> list[int]:
        """One token per row of logits (T, V): the argmax or a draw."""
        if self.generator is None:
            return self._pick(logits, first)
        return draw(self.probs(logits, first), self.generator).tolist()

    def propose(self, drafting: Any, pending: int, first: int) -> tuple[list[int], torch.Tensor | None]:
        """The B-1 drafted tokens after `pending` (output token `first - 1`) and, when sampled, the distributions
        q (B-1, V) they were drawn from; q None: greedy, or a drafter of tokens only (a point mass at each)."""
        logits = drafting.logits(pending) if self.generator is not None else None
        if logits is None:
            return drafting.draft(pending), None
        q = self.probs(logits, first)
        return draw(q, self.generator).tolist(), q

    def verify(self, logits: torch.Tensor, draft: list[int], q: torch.Tensor | None, first: int) -> tuple[int, int]:
        """(n, token): draft slots accepted (0 .. B-1) by the target's logits (B, V) and the token after them,
        by exact match with the greedy tokens, or by the speculative-sampling rule (`speculative_step`)."""
        if self.generator is None:
            verified = self._pick(logits, first)  # (B,) the target's next tokens
            n = 0
            while n < len(draft) and draft[n] == verified[n]:
                n += 1
            return n, verified[n]
        p = self.probs(logits, first)  # (B, V)
        drafted = torch.tensor(draft, dtype=torch.long, device=p.device)  # (B-1,)
        if q is None:
            q = torch.nn.functional.one_hot(drafted, p.shape[-1]).to(p.dtype)
        return speculative_step(p, q.to(p.device), drafted, self.generator)


def _finished(out: list[int], max_new_tokens: int, stop_ids: frozenset[int]) -> bool:
    return len(out) >= max_new_tokens or bool(stop_ids.intersection(out))


def _cut(out: list[int], max_new_tokens: int, stop_ids: frozenset[int]) -> list[int]:
    out = out[:max_new_tokens]
    for i, tok in enumerate(out):
        if tok in stop_ids:
            return out[:i + 1]
    return out


@torch.no_grad()
def acceptance_length(target: TargetModel, drafter: Any, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                      stop_ids: Sequence[int] = (), min_new_tokens: int = 0, temperature: float = 0.0,
                      top_p: float = 1.0, generator: torch.Generator | None = None,
                      answers: Sequence[Sequence[int]] | None = None) -> AcceptanceResult:
    """Speculative-decode every prompt (batch 1) to `max_new_tokens` tokens, or through the first token in
    `stop_ids` (never among the first `min_new_tokens`, see `_masked`). The first token comes from the target's
    prefill (not a cycle); a last cycle that overshoots still counts its full accepted length, and the output is
    cut. Temperature 0: greedy, the target's greedy output exactly. Temperature > 0: speculative sampling with
    nucleus `top_p` (module docstring), every draw from the CPU `generator` (None: one seeded 0), the prompts in
    order; tau then counts the tokens a cycle produced the same way (accepted drafts + 1).
    `answers` (greedy only): one answer per prompt taken as the target's choice wherever it reaches (another
    engine's decoding, say), the target's own argmax beyond: the drafter's cycles along THOSE answers (the outputs
    are the answers, cut as any output), what a served tau is judged against when the two disagree at near ties."""
    gen = _check(prompts, max_new_tokens, temperature, top_p, generator)
    if answers is not None and (gen is not None or len(answers) != len(prompts)):
        raise ValueError(f"answers: greedy only (temperature 0, got {temperature}), one per prompt ({len(answers)} "
                         f"for {len(prompts)} prompts)")
    stops = frozenset(int(s) for s in stop_ids)
    choice = _Choice(stops, min_new_tokens, temperature, top_p, gen)
    hist: Counter[int] = Counter()
    accepted_at: Counter[int] = Counter()  # draft slot k -> cycles that accepted it
    outputs: list[list[int]] = []
    log: list[list[tuple[int, int]]] = []
    block = 0  # B, learned from the first draft (a drafter without cfg may draft any length)
    calls = 0
    _sync(target.device)
    start = time.perf_counter()
    for i, prompt in enumerate(prompts):
        if answers is not None:
            choice = replace(choice, forced=tuple(int(t) for t in answers[i]))
        tc = TargetCache(target)
        drafting = _CachedDrafting(drafter) if hasattr(drafter, "context_cache") else _FeatureDrafting(drafter)
        first = tc.forward(torch.tensor(list(prompt), dtype=torch.long))
        calls += 1
        drafting.extend(first.features)  # context 0 .. P-1
        out = choice.next_tokens(first.logits[-1:], 0)
        cycles_here: list[tuple[int, int]] = []
        while not _finished(out, max_new_tokens, stops):
            pending = out[-1]  # at position tc.length, not yet seen by the target
            draft, q = choice.propose(drafting, pending, len(out))  # (B-1,) at positions tc.length+1 ..
            block = len(draft) + 1
            base = tc.length
            check = tc.forward(torch.tensor([pending] + draft, dtype=torch.long))  # (B,) new tokens only
            calls += 1
            n, token = choice.verify(check.logits, draft, q, len(out))
            hist[n + 1] += 1
            cycles_here.append((len(prompt) + len(out), n + 1))
            accepted_at.update(range(1, n + 1))
            tc.crop(base + n + 1)  # keep the pending token and the n accepted drafts
            drafting.extend(check.features[:n + 1])
            out += draft[:n] + [token]
        outputs.append(_cut(out, max_new_tokens, stops))
        log.append(cycles_here)
    _sync(target.device)
    seconds = time.perf_counter() - start
    cycles = sum(hist.values())
    tau = sum(k * v for k, v in hist.items()) / cycles if cycles else float("nan")
    per_position = [accepted_at[k] / cycles if cycles else float("nan") for k in range(1, block)]
    return AcceptanceResult(tau=tau, histogram=dict(sorted(hist.items())), outputs=outputs, cycles=cycles,
                            per_position=per_position, target_calls=calls, seconds=seconds,
                            cycle_log=log, temperature=temperature, top_p=top_p)


@torch.no_grad()
def greedy_decode(target: TargetModel, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                  stop_ids: Sequence[int] = (), min_new_tokens: int = 0, temperature: float = 0.0,
                  top_p: float = 1.0, generator: torch.Generator | None = None) -> DecodeResult:
    """Plain decoding with the target's KV cache, one token per forward: the baseline speculative decoding is
    timed against (same `stop_ids` and `min_new_tokens`). Temperature 0: greedy, what speculative decoding must
    equal token for token; temperature > 0: plain sampling of `sampling_probs` (nucleus `top_p`) from the CPU
    `generator` (None: one seeded 0), the distribution speculative sampling's output follows."""
    gen = _check(prompts, max_new_tokens, temperature, top_p, generator)
    stops = frozenset(int(s) for s in stop_ids)
    choice = _Choice(stops, min_new_tokens, temperature, top_p, gen)
    outputs: list[list[int]] = []
    _sync(target.device)
    start = time.perf_counter()
    for prompt in prompts:
        tc = TargetCache(target)
        logits = tc.forward(torch.tensor(list(prompt), dtype=torch.long), features=False).logits
        out = choice.next_tokens(logits[-1:], 0)
        while not _finished(out, max_new_tokens, stops):
            out += choice.next_tokens(tc.forward(torch.tensor(out[-1:]), features=False).logits[-1:], len(out))
        outputs.append(out)
    _sync(target.device)
    return DecodeResult(outputs=outputs, seconds=time.perf_counter() - start)
