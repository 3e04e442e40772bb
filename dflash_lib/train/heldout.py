"""The held-out evaluations inside a training run: which ranks run them, when, and what the run keeps of them.

`HeldOutEvaluator`: rank 0 (every rank under FSDP) records the split in heldout.json and evaluates every
`eval_every` steps and after the last step, never on a stop. `build_eval_set` batches the first `eval_samples`
held-out samples once, anchors from a reserved seed (`EVAL_SHARD`), every block fed MASK, so every `evaluate`
scores the same blocks; beside them a block at every answer position where decoding may start a cycle, which
`evaluate` walks as `evaluate`'s greedy speculative decoding lays its cycles (`decoding_walk`): the tau it
reports is that of decoding along the stored answers, not the mean over random anchors.
The settings and figures: docs/runs.md, "Training outside notebooks".
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import torch

from dflash_lib.config import TrainConfig, uses_bf16
from dflash_lib.data.batch import Batch, collate_padded
from dflash_lib.data.validation import validate_sample
from dflash_lib.models.anchors import answer_span, decoding_anchors
from dflash_lib.models.layout import DraftLayout
from dflash_lib.models.loss import expected_acceptance, stats_size, weighted_loss
from dflash_lib.rundir import write_json
from dflash_lib.rundir.reader import HELDOUT_FILE
from dflash_lib.rundir.records import HeldoutFigures
from dflash_lib.train.build import TrainingParts
from dflash_lib.train.checkpoint import capture_rng, restore_rng
from dflash_lib.train.distributed import DrafterParallel
from dflash_lib.train.feed import anchor_seed

EVAL_SHARD = -1  # `feed.anchor_seed` shard of the evaluation's anchors: training shards are >= 0


class HeldOutEvaluator:
    """The held-out evaluations of one training run on `parts` (see the module docstring): `train` gives their
    cadence, sample count and anchor seed, `token_budget` (token slots per evaluation batch, the sampler's) their
    batches, `max_new_tokens` the answer tokens decoding's cycles are walked over (`evaluate`'s, the regenerate
    section's), `stop_at_eos` whether an answer ends at the store's end-of-turn id (`evaluate`'s). `latest`: the
    latest evaluation's figures, after optimizer step `latest_step`; None before the first."""

    def __init__(self, train: TrainConfig, token_budget: int, parts: TrainingParts, parallel: DrafterParallel,
                 main: bool, max_new_tokens: int, stop_at_eos: bool = True) -> None:
        self.train, self.token_budget, self.parts, self.parallel, self.main = train, token_budget, parts, parallel, main
        self.max_new_tokens, self.stop_at_eos = max_new_tokens, stop_at_eos
        self.eval_set: EvalSet | None = None  # held-out batches with fixed anchors (built by `prepare`)
        self.latest: HeldoutFigures | None = None
        self.latest_step: int | None = None

    def prepare(self, run_dir: Path) -> None:
        """Rank 0: record the split in run_dir/heldout.json; the evaluating ranks lay out the evaluation
        batches (the first `eval_samples` held-out samples, anchors drawn once)."""
        p, tc = self.parts, self.train
        if not (self.main or self.parallel.kind == "fsdp" or p.target_parallel == "fsdp") or p.heldout is None:
            return
        source = p.full_store if p.full_store is not None else p.store
        if self.main:
            write_json(run_dir / HELDOUT_FILE, p.heldout.record(len(source)))
        if tc.eval_samples > 0 and len(p.heldout.heldout):
            eos = getattr(source, "meta", {}).get("tokenizer", {}).get("eos_id") if self.stop_at_eos else None
            self.eval_set = build_eval_set(source, p.heldout.heldout, p.drafter, p.pad_id, self.token_budget,
                                           tc.seed, tc.eval_samples, self.max_new_tokens, eos)

    def due(self, step: int, final: bool) -> bool:
        """Evaluate after optimizer step `step` (1-based): every `eval_every` steps, and when `final` (the run's
        last step) on a rank that evaluates."""
        if self.eval_set is None or not self.eval_set.samples:
            return False
        every = self.train.eval_every
        return final or (every > 0 and step % every == 0)

    def run(self, step: int, say: Callable[[str], None]) -> HeldoutFigures:
        """The drafter on the evaluation batches now (`heldout.evaluate`, after optimizer step `step`; its `s`
        counts the full weights' gather too): kept in `latest` and said in one line."""
        t0 = time.perf_counter()
        with self.parallel.full_root():
            figures = evaluate(self.parts.drafter, self.parts.targets[0], self.eval_set,
                               uses_bf16(self.train.precision, self.parts.targets[0].device))
        figures = replace(figures, s=time.perf_counter() - t0)
        self.latest, self.latest_step = figures, step
        say(f"held-out at step {step} ({figures.samples} samples): loss {figures.loss:.3f} | acc {figures.acc:.3f} | "
            f"tau {figures.tau:.3f} ({figures.cycles} decoding cycles, first {self.max_new_tokens} answer tokens) | "
            f"tau_anchors {figures.tau_anchors:.3f} | eal {figures.eal:.3f}")
        return figures

    def after_loop(self, step: int, stopped: bool, say: Callable[[str], None]) -> None:
        """After the loop ended at step `step`: the evaluation after the run's last step when no step took it
        (the data ended on reads without a step; its figures reach the summary, not a metrics row). Never on a
        stop, nor before a step."""
        if step > 0 and not stopped and self.latest_step != step and self.due(step, final=True):
            self.run(step, say)


@dataclass
class EvalSet:
    """Fixed evaluation batches: host batches and their host layouts (anchors drawn once)."""

    batches: list[Batch]
    layouts: list[DraftLayout]  # random anchors: loss, acc, acc_per_pos, eal, tau_anchors
    walks: list[DraftLayout]  # every anchor a decoding cycle may start from (`decoding_anchors`): tau
    answers: list[list[int]]  # per batch, each document's answer length (tokens, `answer_span`), document order
    indices: list[int]  # store indices of the samples evaluated
    max_new_tokens: int  # answer tokens decoding's cycles are walked over

    @property
    def samples(self) -> int:
        return len(self.indices)


def build_eval_set(store: Any, indices: Sequence[int], drafter: Any, pad_id: int, token_budget: int,
                   seed: int, max_samples: int, max_new_tokens: int, stop_id: int | None = None) -> EvalSet:
    """The first `max_samples` of `indices` (store indices, hash order) that pass validation, in padded batches
    of at most `token_budget` token slots (rows x longest, at least one row), shortest first; anchors from
    `feed.anchor_seed(seed, EVAL_SHARD, 0, batch number)`, every block position after the anchor fed MASK; and
    the blocks of `decoding_anchors` for `max_new_tokens` answer tokens, each answer ending at its first
    `stop_id` (the end-of-turn id decoding stops at; None: at the loss mask's end)."""
    vocab = drafter.cfg.vocab_size
    chosen = [int(i) for i in indices if validate_sample(*store[int(i)], vocab) is None][:max_samples]
    by_length = sorted(chosen, key=lambda i: len(store[i][0]))  # stable: ties keep hash order
    groups: list[list[int]] = []
    for i in by_length:
        length = len(store[i][0])
        if groups and (len(groups[-1]) + 1) * length <= token_budget:
            groups[-1].append(i)
        else:
            groups.append([i])
    c = drafter.cfg
    batches, layouts, walks, answers = [], [], [], []
    for b, group in enumerate(groups):
        batch = collate_padded([store[i] for i in group], pad_id, group)
        gen = torch.Generator().manual_seed(anchor_seed(seed, EVAL_SHARD, 0, b))
        batches.append(batch)
        layouts.append(drafter.layout(batch, drafter.sample_anchors(batch, gen, 1.0)))
        walks.append(drafter.layout(batch, decoding_anchors(batch, max_new_tokens, c.block_size, c.gamma, c.mask_id,
                                                            c.position_weight, stop_id)))
        answers.append([decoded_answer_tokens(*store[i], stop_id) for i in group])
    return EvalSet(batches, layouts, walks, answers, chosen, max_new_tokens)


def decoded_answer_tokens(tokens: Any, loss_mask: Any, stop_id: int | None) -> int:
    """Tokens of a sample's answer as `evaluate` decodes it (`answer_span`, through its first `stop_id`): 0 when it
    has none or no prompt before it (`data.prompts.sample_prompt` passes such a sample over)."""
    span = answer_span(loss_mask, tokens, stop_id)
    return span[1] if span is not None and span[0] > 0 else 0


def decoding_walk(runs: Mapping[int, int], answer_tokens: int, max_new_tokens: int) -> list[int]:
    """Tokens of each cycle of greedy speculative decoding along one answer of `answer_tokens` tokens (its last
    one the end of turn) when the block anchored at answer index j accepts `runs[j]` drafts: as
    `evaluate.acceptance.acceptance_length` decodes, the prefill gives answer token 0, each cycle starts at the
    pending token j and ends on j + runs[j] + 1, and cycles run while fewer than min(max_new_tokens,
    answer_tokens) tokens are out (the last one may overshoot and counts in full)."""
    j, cycles = 0, []
    while j + 1 < min(max_new_tokens, answer_tokens):
        cycles.append(int(runs[j]) + 1)
        j += cycles[-1]
    return cycles


def evaluate(drafter: Any, target: Any, eval_set: EvalSet, autocast: bool) -> HeldoutFigures:
    """The drafter on `eval_set` without gradients, under the training autocast, in figures (`s`: seconds of this
    call): loss in nats and top-1 accuracy weighted as in training, acc_per_pos unweighted, tau_anchors the mean
    over the random anchors' blocks of each one's EXACT acceptance length, eal its marginal-product estimate;
    tau the acceptance length of greedy speculative decoding along the stored answers (`decoding_walk` over the
    walk blocks' own leading runs: tokens / cycles, as `evaluate` counts it). One device-to-host transfer at the
    end. Global RNG streams and the drafter's train/eval mode are left as they were, so an evaluation never
    changes the training trajectory."""
    t0, device = time.perf_counter(), target.device
    n_pos = drafter.cfg.block_size - 1
    rng, was_training = capture_rng(), drafter.training
    stats = torch.zeros(stats_size(n_pos + 1), dtype=torch.float64, device=device)
    runs: list[torch.Tensor] = []  # (n,) per walk layout: each block's leading run
    weight = 0.0
    drafter.eval()
    try:
        with torch.no_grad():
            for batch, layout, walk in zip(eval_set.batches, eval_set.layouts, eval_set.walks):
                final = None  # loss kl / ce+kl: the target's final states at the layout's target rows
                if layout.target_rows is None:
                    features = target.context_features(batch)  # (C, F*H); from the HOST batch: no device read
                else:
                    features, final = target.context_features_and_final(batch, layout.target_rows)
                dev_batch = batch.to(device)
                with torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=autocast):
                    if layout.weight_sum > 0:
                        out = drafter.loss(dev_batch, features, layout.to(device), target_hidden=final)
                        stats = stats + out.stats()
                        weight += layout.weight_sum
                    if walk.num_blocks:  # the paper's CE path: only the blocks' correct flags are read
                        dev_walk = walk.to(device)
                        hidden = drafter.forward_hidden(dev_batch, features, dev_walk)  # (n*B, H)
                        chunk = drafter.cfg.ce_chunk_blocks * drafter.cfg.block_size
                        runs.append(weighted_loss(hidden, drafter.head(), dev_walk, chunk, None,
                                                  t2d=drafter.target_to_draft()).block_runs_t)
    finally:
        drafter.train(was_training)
        restore_rng(rng)
    host_all = torch.cat([stats, *(r.double() for r in runs)]).tolist()
    host, block_runs = host_all[:stats.numel()], host_all[stats.numel():]
    cycles = walk_cycles(eval_set, block_runs)
    ce, correct = host[0], host[1]
    pos_correct, pos_count = host[2:2 + n_pos], host[2 + n_pos:2 + 2 * n_pos]
    tau_sum, blocks = host[2 + 2 * n_pos], host[3 + 2 * n_pos]
    acc_per_pos = [c / n if n else math.nan for c, n in zip(pos_correct, pos_count)]
    return HeldoutFigures(loss=ce / weight if weight > 0 else math.nan,
                          acc=correct / weight if weight > 0 else math.nan, acc_per_pos=acc_per_pos,
                          tau=sum(cycles) / len(cycles) if cycles else math.nan, eal=expected_acceptance(acc_per_pos),
                          blocks=int(blocks), samples=eval_set.samples, s=time.perf_counter() - t0,
                          tau_anchors=tau_sum / blocks if blocks > 0 else math.nan, cycles=len(cycles))


def walk_cycles(eval_set: EvalSet, block_runs: Sequence[float]) -> list[int]:
    """Tokens of every decoding cycle over `eval_set`'s documents (`decoding_walk`), from the walk layouts' block
    runs concatenated in layout order."""
    cycles: list[int] = []
    at = 0
    for walk, lengths in zip(eval_set.walks, eval_set.answers):
        n = walk.num_blocks
        doc, pos = walk.block_doc.tolist(), walk.anchor_pos.tolist()
        by_doc: dict[int, dict[int, int]] = {}
        for d, p, r in zip(doc, pos, block_runs[at:at + n]):
            by_doc.setdefault(d, {})[p] = int(r)
        at += n
        for d, length in enumerate(lengths):
            anchors = by_doc.get(d, {})
            first = min(anchors, default=0)  # the answer's first position: its block is the first cycle's
            cycles += decoding_walk({p - first: r for p, r in anchors.items()}, length, eval_set.max_new_tokens)
    return cycles
