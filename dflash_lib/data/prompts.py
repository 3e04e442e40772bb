"""The prompts `evaluate` decodes, from a prompt set name (`-p prompts_from`: heldout, humaneval, mt-bench,
FILE.jsonl) to token ids: the held-out samples of the token store cut before their answer (`heldout_prompts`),
the text sets' questions rendered with the tokenizer and template in each thinking mode (`prompt_sets`), and
each later turn of a multi-turn question asked after the target's own answer (`next_turn`).
The sets and how a later turn is asked: docs/evaluation.md.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from dflash_lib.config import Config, ConfigError
from dflash_lib.data.benchmarks import HELDOUT, BenchmarkPrompt, prompt_set, render_prompt
from dflash_lib.data.readers import DataError
from dflash_lib.data.split import sample_hash, split_store
from dflash_lib.data.store import build_token_store_from_config
from dflash_lib.data.templates import get_template
from dflash_lib.data.tokenizers import load_tokenizer
from dflash_lib.rundir.reader import HELDOUT_FILE


# -- the held-out prompts ----------------------------------------------------------------------------------------
def sample_prompt(tokens: np.ndarray, loss_mask: np.ndarray) -> np.ndarray | None:
    """(P,) the tokens before the first loss-masked one: the conversation up to and including the assistant
    generation prompt. None when the sample has no assistant token or starts with one (no prompt)."""
    mask = np.asarray(loss_mask, dtype=bool)
    if not mask.any():
        return None
    first = int(np.argmax(mask))
    return np.asarray(tokens[:first]) if first > 0 else None


@dataclass
class HeldOutPrompts:
    prompts: list[list[int]]  # token ids of each prompt (the conversation up to the assistant generation prompt)
    indices: list[int]  # store index of each prompt's sample
    heldout: int  # samples in the held-out split
    samples: int  # samples in the token store
    eos_id: int  # the tokenizer's end-of-turn id (stops an answer)
    source: str  # where the prompts came from, in words (the report's prompt_source)


def larger_fraction(fraction: float, n: int, samples: int) -> float | None:
    """The smallest of 0.01, 0.02, 0.05, 0.1, 0.2, 0.5 above `fraction` expected to hold out 2n of `samples`
    (the hash split holds out about fraction x samples; some prompts repeat), else the largest above it; None
    when `fraction` is already 0.5 or more."""
    above = [f for f in (0.01, 0.02, 0.05, 0.1, 0.2, 0.5) if f > fraction]
    return next((f for f in above if f * samples >= 2 * n), above[-1] if above else None)


def heldout_prompts(config: Config, n: int, run_dir: Path | None = None) -> HeldOutPrompts:
    """The first `n` held-out samples (hash order) of `config`'s token store with a prompt not taken before, each
    cut to `sample_prompt`. The split: `run_dir/heldout.json` when given and present (every used sample's hash checked
    against the store), else `split_store(store, heldout_fraction)`. ConfigError when the split is empty or
    holds fewer than `n` usable samples."""
    data = config.data
    try:
        store = build_token_store_from_config(data, progress=False)
    except DataError as e:
        raise ConfigError(str(e)) from None
    recorded = run_dir / HELDOUT_FILE if run_dir is not None else None
    if recorded is not None and recorded.is_file():
        doc = json.loads(recorded.read_text())
        fraction, order = float(doc["fraction"]), [int(i) for i in doc["indices"]]
        hashes = [int(h, 16) for h in doc["hashes"]]
        where = f"the held-out split of the run ({recorded}: heldout_fraction {fraction}, {len(order)} samples)"
    else:
        split = split_store(store, data.heldout_fraction)
        fraction, order, hashes = data.heldout_fraction, split.heldout.tolist(), split.hashes.tolist()
        where = (f"the held-out split of {data.source!r} (heldout_fraction {fraction}, hash rule of "
                 f"dflash_lib.data.split: {len(order)} of {len(store)} samples)")
    if not order:
        why = ("heldout_fraction is 0: nothing is held out" if fraction == 0 else
               f"heldout_fraction {fraction} of {len(store)} samples holds out none")
        larger = larger_fraction(fraction, n, len(store))
        fix = (f"train and evaluate with a larger -p heldout_fraction (e.g. {larger})" if larger is not None else
               f"{len(store)} samples are too few to hold {n} out: use a larger corpus (-p source, -p limit)")
        raise ConfigError(f"no held-out prompts: {why}; {fix} so that the prompts are samples the drafter never "
                          f"trained on")
    prompts, indices, seen = [], [], set()
    for i, h in zip(order, hashes):
        if len(prompts) == n:
            break
        if not 0 <= i < len(store):
            raise ConfigError(f"{recorded}: held-out index {i} is outside the token store ({len(store)} samples): "
                              f"the store built now ({data.source!r}, limit {data.limit}) is not the run's")
        tokens, mask = store[i]
        if sample_hash(tokens) != h:
            raise ConfigError(f"{recorded}: sample {i}'s tokens differ from the run's (hash {h:016x}): the token "
                              f"store built now (source, tokenizer, template, max_len, limit) is not the run's")
        prompt = sample_prompt(tokens, mask)
        if prompt is not None and tuple(prompt.tolist()) not in seen:
            seen.add(tuple(prompt.tolist()))
            prompts.append([int(t) for t in prompt])
            indices.append(int(i))
    if len(prompts) < n:
        raise ConfigError(f"prompts {n}: the held-out split holds only {len(prompts)} samples with a distinct prompt "
                          f"(heldout_fraction {fraction}, {len(order)} of {len(store)} samples held out); lower "
                          f"-p prompts or raise -p heldout_fraction")
    eos = store.meta.get("tokenizer", {}).get("eos_id")
    if eos is None:
        raise ConfigError(f"token store {store.path}: meta.json records no tokenizer eos_id")
    source = (f"the first {len(prompts)} samples of {where} with distinct prompts, each cut before its first "
              f"assistant token")
    return HeldOutPrompts(prompts, indices, len(order), len(store), int(eos), source)


# -- the prompt sets (`-p prompts_from`) ---------------------------------------------------------------------------
Render = Callable[[tuple[tuple[str, str], ...]], list[int]]  # a conversation -> the prompt's token ids


@dataclass
class PromptGroup:
    """The prompts of one prompt set in one thinking mode at one turn, as token ids ready to decode."""

    benchmark: str  # the prompt set ("heldout", "humaneval", "mt-bench", a FILE.jsonl)
    thinking: str  # the thinking mode they were rendered in (the held-out ones: the store's `thinking`)
    turn: int  # 1-based turn of the questions asked
    names: list[str]  # each prompt's id (a question id; a held-out sample's store index)
    prompts: list[list[int]]  # token ids of each prompt
    questions: list[BenchmarkPrompt] = field(default_factory=list)  # text sets: each prompt's question
    history: list[tuple[tuple[str, str], ...]] = field(default_factory=list)  # text sets: (role, text) so far
    render: Render | None = None  # text sets: how a conversation becomes a prompt (tokenizer + template)


@dataclass
class PromptSets:
    """Every prompt set's first turn; later turns are made from the target's own answers (`next_turn`)."""

    groups: list[PromptGroup]  # turn 1 of each set x thinking mode, in `prompts_from` order
    eos_id: int  # the tokenizer's end-of-turn id (stops an answer)
    source: str  # which prompts, in words (the report's prompt_source)
    indices: list[int]  # store index of each held-out prompt's sample ([] without `heldout`)
    decode_text: Callable[[Sequence[int]], str] | None = None  # token ids -> text (the answers of later turns)

    @property
    def prompts(self) -> list[list[int]]:
        """Every first-turn prompt, group order."""
        return [p for g in self.groups for p in g.prompts]


def thinking_modes(config: Config) -> list[str]:
    """The thinking modes the text prompt sets are rendered in: `enable_thinking`'s, else the data section's."""
    given = config.evaluate.enable_thinking
    return [m.strip() for m in given.split(",")] if given else [config.data.thinking]


def renderer(config: Config, tokenizer: Any, thinking: str) -> Render:
    """A conversation -> prompt ids with the configured template in `thinking` mode (`benchmarks.render_prompt`)."""
    try:
        template = get_template(config.data.template, tokenizer, thinking)
    except DataError as e:
        raise ConfigError(str(e)) from None

    def render(turns: tuple[tuple[str, str], ...]) -> list[int]:
        try:
            return render_prompt(tokenizer, template, turns)
        except DataError as e:
            raise ConfigError(f"template {config.data.template!r} cannot render a benchmark prompt: {e}") from None
    return render


def prompt_sets(config: Config, run_dir: Path | None = None) -> PromptSets:
    """The first `prompts` prompts of every set in `prompts_from`: the held-out samples (`heldout_prompts`) as the
    store rendered them, and each text set's first questions (file order) rendered, turn 1, in every thinking mode
    (`thinking_modes`). ConfigError for a set that cannot be read (naming what to install, or the bad line)."""
    n = config.evaluate.prompts
    groups: list[PromptGroup] = []
    sources: list[str] = []
    indices: list[int] = []
    eos: int | None = None
    tok = None
    for name in [x.strip() for x in config.evaluate.prompts_from.split(",")]:
        if name == HELDOUT:
            held = heldout_prompts(config, n, run_dir)
            groups.append(PromptGroup(HELDOUT, config.data.thinking, 1, [str(i) for i in held.indices],
                                      held.prompts))
            indices, eos = held.indices, held.eos_id
            sources.append(held.source)
            continue
        try:
            questions = prompt_set(name)[:n]
            tok = tok or load_tokenizer(config.data.tokenizer)
        except DataError as e:
            raise ConfigError(str(e)) from None
        for mode in thinking_modes(config):
            render = renderer(config, tok, mode)
            history = [(("user", q.turns[0]),) for q in questions]
            groups.append(PromptGroup(name, mode, 1, [q.prompt_id for q in questions], [render(h) for h in history],
                                      questions, history, render))
        turns = max(len(q.turns) for q in questions)
        sources.append(f"{name}: its first {len(questions)} questions (file order)"
                       + (f", up to {turns} turns each" if turns > 1 else ""))
    if tok is not None:
        if eos is not None and eos != tok.eos_id:
            raise ConfigError(f"the token store's end-of-turn id {eos} is not tokenizer {config.data.tokenizer!r}'s "
                              f"{tok.eos_id}: the held-out and the benchmark prompts would stop differently")
        eos = tok.eos_id
    assert eos is not None  # prompts_from names at least one set (EvalConfig)
    return PromptSets(groups, int(eos), "; ".join(sources), indices, tok.decode if tok is not None else None)


def next_turn(group: PromptGroup, outputs: Sequence[Sequence[int]], eos_id: int,
              decode_text: Callable[[Sequence[int]], str] | None) -> PromptGroup | None:
    """The next turn of `group`'s questions that have one, each asked after the target's own answer `outputs[i]`
    (its text, the end-of-turn token left out): the conversation [user 1, answer 1, ..., user t+1] rendered by the
    group's template. None when no question has another turn."""
    keep = [i for i, q in enumerate(group.questions) if len(q.turns) > group.turn]
    if not keep or group.render is None or decode_text is None:
        return None
    history = []
    for i in keep:
        answer = [t for t in outputs[i] if t != eos_id]
        history.append(group.history[i] + (("assistant", decode_text(answer)),
                                            ("user", group.questions[i].turns[group.turn])))
    return PromptGroup(group.benchmark, group.thinking, group.turn + 1, [group.names[i] for i in keep],
                       [group.render(h) for h in history], [group.questions[i] for i in keep], history, group.render)
