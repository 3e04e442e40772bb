"""The demo's target: a small Qwen3 causal LM TRAINED on the corpus, over a shrunk vocabulary, built once and cached.

`ensure_demo_target(cfg)` returns a folder that is both a Hugging Face Qwen3 folder (`-p target DIR`) and a mapped
tokenizer (`-p tokenizer DIR`, `data.tokenizers.MappedTokenizer`), under `<cache_dir>/<key>/` (`default_cache_dir`,
`key` a hash of every setting that decides it); `ensure_demo_answers` writes its answers. Vocabulary, training
and what it learns: docs/data.md, "The small trained target (tests, `--preset smoke`, `demo --target trained`)".
"""

from __future__ import annotations

import hashlib
import json
import math
import shutil
import sys
import tempfile
import time
import typing
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import torch
import torch.nn.functional as F
import transformers

from dflash_lib.config import MAPPED_VOCAB_FILE, Config, ConfigError, from_params
from dflash_lib.data.readers import load_conversations
from dflash_lib.data.split import split_store
from dflash_lib.data.store import StoreSettings, build_token_store_from_config, publish_folder
from dflash_lib.data.templates import get_template
from dflash_lib.data.tokenizers import MappedVocab, is_mapped_tokenizer, load_tokenizer, tokenizer_identity
from dflash_lib.models.target_config import tiny_qwen3_config
from dflash_lib.regenerate import leading_assistant_turns, regenerate, report_path
from dflash_lib.rundir import load_config
from dflash_lib.serve.adapter import EngineSpec
from dflash_lib.serve.server import EngineServer

DEMO_TARGET_FORMAT = 4  # bump when the build's semantics change (old folders then stop matching)
MAX_POSITIONS = 32768  # RoPE positions the target accepts: a regeneration prompt (a whole first user turn) may be long
TRAINING_FILE = "training.json"  # written last: its presence marks a complete folder


@dataclass(frozen=True)
class DemoTargetSettings:
    """How the demo target is trained (its shape is `cfg.model.hidden_size` x `cfg.model.target_layers`)."""

    vocab_size: int = 8192  # embedding rows: vocab_size - 2 kept base ids + UNK + MASK
    steps: int = 200  # optimizer steps (training.json records how long they took)
    tokens_per_step: int = 4096  # tokens per step: tokens_per_step // seq_len windows of seq_len tokens
    seq_len: int = 512  # tokens per training window (random windows of the concatenated training samples)
    lr: float = 3e-3  # peak learning rate (AdamW)
    warmup_steps: int = 20  # linear warmup steps, then cosine to min_lr_ratio * lr
    min_lr_ratio: float = 0.1  # cosine floor as a fraction of lr
    weight_decay: float = 0.1  # AdamW weight decay on matrices (not on norms)
    grad_clip: float = 1.0  # max global grad norm (0 = off)
    num_heads: int = 2  # attention heads (head_dim = hidden_size // num_heads: 32 at hidden 64, which vLLM's CPU
    # attention serves; it refuses head_dim < 32)
    num_kv_heads: int = 1  # key/value heads (grouped-query attention, as real Qwen3 models)
    seed: int = 0  # weight init and window sampling
    eval_samples: int = 32  # held-out samples the loss before/after is measured on (0 = none)
    log_every: int = 25  # progress line on stderr every N steps

    def __post_init__(self) -> None:
        if self.vocab_size < 8:
            raise ConfigError(f"demo target: vocab_size must be >= 8, got {self.vocab_size}")
        for name in ("steps", "tokens_per_step", "seq_len", "lr", "num_heads", "num_kv_heads", "log_every"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"demo target: {name} must be > 0, got {getattr(self, name)!r}")
        for name in ("warmup_steps", "weight_decay", "grad_clip", "eval_samples"):
            if getattr(self, name) < 0:
                raise ConfigError(f"demo target: {name} must be >= 0, got {getattr(self, name)!r}")
        if self.seq_len < 2 or self.tokens_per_step < self.seq_len:
            raise ConfigError(f"demo target: tokens_per_step ({self.tokens_per_step}) must hold at least one window "
                              f"of seq_len ({self.seq_len}) >= 2 tokens")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ConfigError(f"demo target: min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")

    @classmethod
    def from_pairs(cls, pairs: Sequence[Sequence[str]] | None) -> "DemoTargetSettings":
        """From command-line KEY VALUE strings; ConfigError naming an unknown key or a value of the wrong type."""
        hints = typing.get_type_hints(cls)
        values: dict[str, Any] = {}
        for key, text in pairs or []:
            if key not in hints:
                raise ConfigError(f"demo target: unknown setting {key!r}; known: {', '.join(hints)}")
            try:
                values[key] = hints[key](text) if hints[key] is not int else int(text, 10)
            except ValueError:
                raise ConfigError(f"demo target: {key} must be {hints[key].__name__}, got {text!r}") from None
        return cls(**values)


def demo_target_key(cfg: Config, settings: DemoTargetSettings) -> str:
    """Hash of everything that decides the folder's content (computed without building or reading the store)."""
    d = cfg.data
    if is_mapped_tokenizer(d.tokenizer):
        raise ConfigError(f"demo target: tokenizer {d.tokenizer!r} is already a mapped vocabulary; give its base "
                          "tokenizer (e.g. 'qwen')")
    store_key = StoreSettings(d.source, d.tokenizer, d.template, d.max_len, d.policy, d.limit, d.thinking).key()
    payload = dict(format=DEMO_TARGET_FORMAT, store=store_key, tokenizer=tokenizer_identity(d.tokenizer),
                   heldout_fraction=d.heldout_fraction, hidden_size=cfg.model.hidden_size,
                   layers=cfg.model.target_layers, settings=asdict(settings))
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:24]


def default_cache_dir(cfg: Config) -> Path:
    """`demo_targets/` next to the token-store cache (.cache/demo_targets by default)."""
    return Path(cfg.data.cache_dir).parent / "demo_targets"


def is_complete(folder: Path) -> bool:
    return all((folder / f).is_file() for f in (TRAINING_FILE, MAPPED_VOCAB_FILE, "config.json", "model.safetensors"))


def ensure_demo_target(cfg: Config, settings: DemoTargetSettings | None = None, cache_dir: str | Path | None = None,
                       progress: bool = True) -> Path:
    """The trained demo target folder for `cfg` (built, or the cached one with the same key). See the module doc."""
    settings = settings or DemoTargetSettings()
    key = demo_target_key(cfg, settings)
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir(cfg)
    final = root / key
    if is_complete(final):
        return final
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{key}.", dir=root))  # a leftover one (killed build) is never read

    def build(out: Path) -> None:
        build_demo_target(cfg, settings, out, key, progress)
        if final.exists() and not is_complete(final):
            shutil.rmtree(final)  # an incomplete folder under the final name (copied by hand): replace it

    publish_folder(tmp, final, build, is_complete)
    return final


def demo_target_params(folder: str | Path) -> dict[str, Any]:
    """The flat parameters that make a run use the demo target folder: target, tokenizer and its MASK id."""
    folder = Path(folder)
    return dict(target=str(folder), tokenizer=str(folder), mask_id=MappedVocab.read(folder).mask_id)


# -- the build -------------------------------------------------------------------------------------------------


def choose_vocab(counts: np.ndarray, vocab_size: int, must_keep: Sequence[int]) -> tuple[int, ...]:
    """The kept base ids: `must_keep` plus the most frequent others (ties: lower id first), vocab_size - 2 in
    all (fewer when fewer ids occur), ordered by count descending. counts: (base n_vocab,) int64."""
    n_keep = vocab_size - 2
    must = list(dict.fromkeys(int(i) for i in must_keep))
    if len(must) > n_keep:
        raise ConfigError(f"demo target: vocab_size {vocab_size} leaves {n_keep} ids, fewer than the {len(must)} "
                          "special tokens that must be kept")
    order = np.lexsort((np.arange(len(counts)), -counts))  # (V_base,) count descending, then id ascending
    seen = set(must)
    others = [int(i) for i in order[: n_keep + len(must)] if counts[i] > 0 and int(i) not in seen]
    kept = must + others[: n_keep - len(must)]
    return tuple(sorted(kept, key=lambda i: (-int(counts[i]), i)))


def training_stream(store: Any, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The samples `indices` of `store` back to back: ((T,) base ids uint32, (T,) loss mask uint8)."""
    if not len(indices):
        return np.zeros(0, np.uint32), np.zeros(0, np.uint8)
    return (np.concatenate([np.asarray(store[int(i)][0]) for i in indices]),
            np.concatenate([np.asarray(store[int(i)][1]) for i in indices]))


def lr_at(step: int, s: DemoTargetSettings) -> float:
    """Learning rate of 0-based `step`: linear warmup over warmup_steps, then cosine to min_lr_ratio * lr."""
    if step < s.warmup_steps:
        return s.lr * (step + 1) / s.warmup_steps
    progress = (step - s.warmup_steps) / max(1, s.steps - s.warmup_steps)
    return s.lr * (s.min_lr_ratio + (1 - s.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def build_model(cfg: Config, settings: DemoTargetSettings, vocab_size: int):
    """A freshly initialised Qwen3ForCausalLM (seeded; the caller's RNG untouched), tied embeddings."""
    hf_cfg = tiny_qwen3_config(hidden_size=cfg.model.hidden_size, num_layers=cfg.model.target_layers,
                               num_heads=settings.num_heads, num_kv_heads=settings.num_kv_heads, vocab_size=vocab_size,
                               max_position_embeddings=max(MAX_POSITIONS, cfg.data.max_len))
    hf_cfg.tie_word_embeddings = True
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(settings.seed)
        return transformers.Qwen3ForCausalLM(hf_cfg)


def next_token_loss(model: torch.nn.Module, ids: torch.Tensor, unk_id: int,
                    trained: torch.Tensor) -> tuple[torch.Tensor, int, int]:
    """ids (R, T) int64, trained (R, T) bool (the store's loss mask: assistant tokens) -> (mean next-token CE in
    nats over the positions whose label is trained and not `unk_id`, correct top-1 among them, their number).
    UNK is input, never a label: trained on, it is the single most frequent "token" of a small vocabulary (every
    rarer word maps to it) and a small model's argmax collapses onto it. Only assistant labels, as the drafter's:
    trained on every token, the small target's greedy answer to a generation prompt was the template's next header
    (`<|im_start|>assistant\n` in a loop), which no drafter trained on assistant tokens ever drafts."""
    logits = model(input_ids=ids).logits[:, :-1]  # (R, T-1, V)
    labels = ids[:, 1:].masked_fill((ids[:, 1:] == unk_id) | ~trained[:, 1:], -100)  # (R, T-1)
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100)
    scored = labels != -100
    return loss, int((logits.argmax(-1) == labels)[scored].sum()), int(scored.sum())


@torch.no_grad()
def document_loss(model: torch.nn.Module, docs: Sequence[tuple[np.ndarray, np.ndarray]],
                  unk_id: int) -> dict[str, float]:
    """Next-token CE (nats, token-weighted) and top-1 accuracy over whole documents (one forward each), on the
    labels `next_token_loss` trains. docs: (ids (T,), loss mask (T,)) per document."""
    model.eval()
    total = correct = n = 0.0
    for doc, mask in docs:
        if len(doc) < 2:
            continue
        loss, hits, scored = next_token_loss(model, torch.as_tensor(doc.astype(np.int64)).unsqueeze(0), unk_id,
                                             torch.as_tensor(np.asarray(mask, bool)).unsqueeze(0))
        if scored:
            total += loss.item() * scored
            correct += hits
            n += scored
    model.train()
    return dict(loss=total / n if n else math.nan, acc=correct / n if n else math.nan, tokens=int(n))


def train_lm(model: torch.nn.Module, stream: np.ndarray, trained: np.ndarray, s: DemoTargetSettings, unk_id: int,
             say: Callable[[str], None] = lambda _: None) -> list[dict[str, float]]:
    """`s.steps` AdamW steps on random windows of `stream` ((T,) new ids; `trained` (T,) its loss mask). Returns one row per step: step, loss
    (nats), lr, tokens, seconds and cpu_seconds (this process, all threads), all three cumulative."""
    if len(stream) < s.seq_len + 1:
        raise ConfigError(f"demo target: the training split holds {len(stream)} tokens, fewer than one window of "
                          f"seq_len {s.seq_len} + 1")
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([dict(params=decay, weight_decay=s.weight_decay), dict(params=rest, weight_decay=0.0)],
                            lr=s.lr, betas=(0.9, 0.95), eps=1e-8)
    rows_per_step = s.tokens_per_step // s.seq_len
    rng = np.random.default_rng(s.seed)
    offsets = np.arange(s.seq_len + 1)  # (L+1,): the window plus its last label
    stream = stream.astype(np.int64, copy=False)
    history, tokens, t0, c0 = [], 0, time.perf_counter(), time.process_time()
    model.train()
    for step in range(s.steps):
        lr = lr_at(step, s)
        for group in opt.param_groups:
            group["lr"] = lr
        starts = rng.integers(0, len(stream) - s.seq_len, size=rows_per_step)  # (R,)
        window = starts[:, None] + offsets  # (R, L+1)
        loss, _, _ = next_token_loss(model, torch.from_numpy(stream[window]), unk_id,
                                     torch.from_numpy(trained[window].astype(bool)))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if s.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), s.grad_clip)
        opt.step()
        tokens += rows_per_step * s.seq_len
        seconds = time.perf_counter() - t0
        history.append(dict(step=step + 1, loss=loss.item(), lr=lr, tokens=tokens, seconds=round(seconds, 3),
                            cpu_seconds=round(time.process_time() - c0, 3)))
        if (step + 1) % s.log_every == 0 or step + 1 == s.steps or step == 0:
            eta = seconds / (step + 1) * (s.steps - step - 1)
            say(f"demo target: step {step + 1}/{s.steps} | loss {history[-1]['loss']:.3f} | lr {lr:.1e} | "
                f"{tokens / seconds / 1e3:.1f} Ktok/s | ETA {eta:.0f} s")
    return history


def build_demo_target(cfg: Config, settings: DemoTargetSettings, out: Path, key: str = "",
                      progress: bool = True) -> dict[str, Any]:
    """Build the demo target into the (empty) folder `out`; returns the training.json record (written last)."""
    def say(msg: str) -> None:
        if progress:
            print(msg, file=sys.stderr, flush=True)

    t_start = time.perf_counter()
    d = cfg.data
    say(f"demo target: token store of {d.source!r} ({d.tokenizer}, {d.template}, max_len {d.max_len}, "
        f"limit {d.limit or 'all'})")
    store = build_token_store_from_config(d, progress=progress)
    split = split_store(store, d.heldout_fraction)
    base = load_tokenizer(d.tokenizer)
    template = get_template(d.template, base, d.thinking)
    specials = [base.special_id(t) for t in template.special_tokens] + [base.eos_id, base.pad_id]
    base_stream, trained = training_stream(store, split.train)  # (T,) base ids and loss mask, training split only
    counts = np.bincount(base_stream, minlength=base.n_vocab).astype(np.int64)  # (V_base,)
    vocab = MappedVocab(d.tokenizer, choose_vocab(counts, settings.vocab_size, specials), tokenizer_identity(d.tokenizer))
    vocab.write(out)
    mapped = load_tokenizer(str(out))  # the folder is a tokenizer from here on
    stream = mapped.map_ids(base_stream)  # (T,) new ids
    unk_train = float(np.mean(stream == vocab.unk_id)) if len(stream) else 0.0
    heldout_docs = [(mapped.map_ids(store[int(i)][0]), store[int(i)][1]) for i in split.heldout[: settings.eval_samples]]
    heldout_tokens = np.concatenate([d for d, _ in heldout_docs]) if heldout_docs else np.zeros(0, np.uint32)
    unk_heldout = float(np.mean(heldout_tokens == vocab.unk_id)) if len(heldout_tokens) else math.nan
    say(f"demo target: vocabulary {vocab.vocab_size} ids ({len(vocab.kept)} kept of {int((counts > 0).sum())} seen "
        f"in {len(stream):,} training tokens; UNK share {unk_train:.1%} of training, {unk_heldout:.1%} of held-out "
        f"tokens); MASK id {vocab.mask_id}")

    model = build_model(cfg, settings, vocab.vocab_size)
    n_params = sum(p.numel() for p in model.parameters())
    say(f"demo target: Qwen3 {cfg.model.hidden_size} hidden x {cfg.model.target_layers} layers, {n_params / 1e6:.2f} M "
        f"parameters; {settings.steps} steps of {settings.tokens_per_step} tokens")
    before = document_loss(model, heldout_docs, vocab.unk_id)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(settings.seed)
        history = train_lm(model, stream, trained, settings, vocab.unk_id, say)
    after = document_loss(model, heldout_docs, vocab.unk_id)
    model.save_pretrained(out, safe_serialization=True)
    first = history[0]["loss"]
    last = float(np.mean([h["loss"] for h in history[-min(10, len(history)):]]))
    record = dict(
        format=DEMO_TARGET_FORMAT, key=key, settings=asdict(settings),
        model=dict(hidden_size=cfg.model.hidden_size, layers=cfg.model.target_layers, parameters=n_params,
                   vocab_size=vocab.vocab_size, tie_word_embeddings=True),
        data=dict(source=d.source, base_tokenizer=d.tokenizer, template=d.template, max_len=d.max_len, limit=d.limit,
                  store=str(store.path), store_key=store.meta.get("key"), heldout_fraction=d.heldout_fraction,
                  train_samples=len(split.train), heldout_samples=len(split.heldout), train_tokens=int(len(stream))),
        vocab=dict(size=vocab.vocab_size, kept=len(vocab.kept), unk_id=vocab.unk_id, mask_id=vocab.mask_id,
                   base_ids_seen=int((counts > 0).sum()), unk_share_train=unk_train, unk_share_heldout=unk_heldout),
        steps=settings.steps, tokens=history[-1]["tokens"], train_seconds=history[-1]["seconds"],
        train_cpu_seconds=history[-1]["cpu_seconds"], threads=torch.get_num_threads(),
        seconds=round(time.perf_counter() - t_start, 1), ln_vocab=math.log(vocab.vocab_size),
        loss_first=first, loss_last=last,  # nats: first step, mean of the last 10 steps
        heldout_loss_before=before["loss"], heldout_loss_after=after["loss"], heldout_acc_after=after["acc"],
        heldout_eval_tokens=after["tokens"],
        history=[{k: (round(v, 5) if isinstance(v, float) else v) for k, v in h.items()} for h in history],
    )
    (out / TRAINING_FILE).write_text(json.dumps(record, indent=1))  # last: marks the folder complete
    say(f"demo target: loss {first:.2f} -> {last:.2f} (ln V = {math.log(vocab.vocab_size):.2f}); held-out "
        f"{before['loss']:.2f} -> {after['loss']:.2f}, top-1 {after['acc']:.1%}; {record['seconds']:.0f} s")
    return record


# -- the drafter's training data: the target's own answers ---------------------------------------------------------


@dataclass(frozen=True)
class DemoAnswerSettings:
    """The corpus the demo's drafter trains on: the target's own greedy answers (DFlash trains on what the target
    would say, docs/dflash.md; `regenerate`) to the first user turn of the first `records` conversations that open
    with a user turn (one opening with an assistant turn answers no prompt and is read past).

    The tiny trained target's answers are exactly `new_tokens` long: left free, it ends most after two or three
    tokens, which leaves no block to draft. A real model's end where it ends them (`free_end`), at most
    `new_tokens`."""

    records: int = 1024  # conversations answered again (their first assistant turn only)
    new_tokens: int = 64  # tokens per answer: exactly, or at most with free_end
    free_end: bool = False  # the answer ends at the target's end-of-turn token (else it is masked: exactly new_tokens)
    backend: str = "local"  # "local" (the target in-process, batched) | "vllm" (the engine's chat endpoint, a server
    # started for the target folder, faster than the local backend: docs/data.md; a Hugging Face tokenizer folder only)
    gen_batch: int = 64  # local: conversations per batched generate
    gen_tokens: int = 16384  # local: padded prompt tokens per generate call at most (prompts sorted by length)
    concurrency: int = 32  # vllm: conversations in flight (the server decodes as many at once)
    max_len: int = 0  # tokens per sample (prompt and answer) the drafter trains on; 0 = the data's max_len. vllm: a
    # prompt leaving no room for new_tokens is refused and listed in the rejects file (the store drops it anyway)
    heldout_fraction: float = 0.03  # the drafter run's held-out split of these answers (~30 prompts of 1024)

    def __post_init__(self) -> None:
        for name in ("records", "new_tokens", "gen_batch", "gen_tokens", "concurrency"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"demo answers: {name} must be > 0, got {getattr(self, name)!r}")
        if self.max_len < 0:
            raise ConfigError(f"demo answers: max_len must be >= 0, got {self.max_len}")
        if self.backend not in ("local", "vllm"):
            raise ConfigError(f"demo answers: backend must be 'local' or 'vllm', got {self.backend!r}")
        if not 0.0 < self.heldout_fraction < 1.0:
            raise ConfigError(f"demo answers: heldout_fraction must be in (0, 1), got {self.heldout_fraction}")

    @property
    def min_new_tokens(self) -> int:
        """The tokens before the end-of-turn token may end an answer (regenerate's and evaluate's)."""
        return 0 if self.free_end else self.new_tokens


def records_to_read(source: str, answered: int) -> int:
    """Records of `source` to read (a `limit`) so that `answered` of them open with a user turn (all there are
    when the source holds fewer)."""
    read = found = 0
    for conv in load_conversations(source):
        read = conv.record + 1
        found += not leading_assistant_turns(conv)
        if found == answered:
            break
    return read


def answers_config(cfg: Config, target_dir: str | Path, s: DemoAnswerSettings,
                   target_params: dict[str, Any] | None = None) -> Config:
    """`cfg` on the target (`target_params`: default the demo target's, `demo_target_params`) with `regenerate`'s
    settings for the demo answers (the openai backend's base_url is the server's, set when it starts)."""
    limit = records_to_read(cfg.data.source, s.records)
    params = target_params if target_params is not None else demo_target_params(target_dir)
    more = {"max_len": s.max_len} if s.max_len else {}
    return from_params(dict(params, **more, limit=limit, max_turns=1, max_new_tokens=s.new_tokens,
                            min_new_tokens=s.min_new_tokens, temperature=0.0, gen_batch=s.gen_batch,
                            gen_tokens=s.gen_tokens, concurrency=s.concurrency, regen_leading_assistant="skip",
                            backend="local" if s.backend == "local" else "openai"), cfg)


def ensure_demo_answers(cfg: Config, target_dir: str | Path, settings: DemoAnswerSettings | None = None,
                        progress: bool = True, target_params: dict[str, Any] | None = None) -> Path:
    """The JSONL of the target's answers (`regenerate`'s format, a source any run reads) under
    `target_dir/answers/`: written once, resumed when a build was stopped, reused when complete. Backend "vllm"
    starts the engine on `target_dir` (its log `answers/engine.log`)."""
    s = settings or DemoAnswerSettings()
    if s.backend == "vllm" and is_mapped_tokenizer(str(target_dir)):
        raise ConfigError(f"demo answers: backend 'vllm' serves the target's own Hugging Face tokenizer; {target_dir} "
                          "holds a mapped vocabulary (the tiny trained target): use backend 'local'")
    rcfg = answers_config(cfg, target_dir, s, target_params)
    payload = dict(source=rcfg.data.source, template=rcfg.data.template, thinking=rcfg.data.thinking,
                   max_len=rcfg.data.max_len if s.backend == "vllm" else None,
                   leading_assistant=rcfg.regenerate.regen_leading_assistant,
                   answers={k: v for k, v in asdict(s).items() if k != "heldout_fraction"})
    key = hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:16]
    out = Path(target_dir) / "answers" / f"answers-{key}.jsonl"
    report = report_path(out)
    if out.is_file() and report.is_file() and json.loads(report.read_text()).get("run", {}).get("status") == "complete":
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    if progress:
        size = f"at most {s.new_tokens}" if s.free_end else f"{s.new_tokens}"
        print(f"demo answers: the target answers the first user turn of {s.records} conversations of "
              f"{rcfg.data.source!r}, {size} tokens each, through {s.backend} -> {out}", file=sys.stderr, flush=True)
    if s.backend == "local":
        regenerate(rcfg, out, progress=progress)
        return out
    spec = EngineSpec(str(target_dir), max_model_len=rcfg.data.max_len, max_num_seqs=s.concurrency,
                      kv_cache_gib=2.0, token_ids=False)
    with EngineServer(spec, out.parent / "engine.log") as server:
        regenerate(from_params({"base_url": server.url + "/v1"}, rcfg), out, progress=progress)
    return out


def run_cli(preset_name: str, params: dict[str, str], pairs: Sequence[Sequence[str]] | None) -> Path:
    """`python -m dflash_lib demo-target`: the folder for the preset (+ -p data overrides, --set target settings)."""
    return ensure_demo_target(load_config(params, preset_name), DemoTargetSettings.from_pairs(pairs))


__all__ = ["DemoAnswerSettings", "DemoTargetSettings", "answers_config", "ensure_demo_answers", "TRAINING_FILE", "build_demo_target", "choose_vocab", "demo_target_key",
           "demo_target_params", "ensure_demo_target", "lr_at", "training_stream", "train_lm"]
