"""What feeds the training loop: sampler positions -> work items -> validated batches -> target features.

    epoch_batches (Work) -> make_collate (Collated: Batch or None, skipped samples)
    -> make_target_workers (Item: batch + target features) -> the trainer

Every item carries its sampler position (what a checkpoint records as consumed); samples that fail
`data.validation.validate_sample` are left out of their batch and counted, never crash a run: docs/architecture.md,
"The training pipeline", and docs/runs.md, "Runs that survive: resume, stop, torchrun".
"""

from __future__ import annotations

import contextlib
import hashlib
import threading
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Callable, Iterator, Sequence

import numpy as np
import torch

from dflash_lib.config import ConfigError
from dflash_lib.data.batch import Batch, collate_packed, collate_padded
from dflash_lib.data.validation import validate_sample
from dflash_lib.models.layout import DraftLayout
from dflash_lib.plan.buckets import bucket_of
from dflash_lib.target.feature_cache import FeatureCache, as_context, context_rows, real_slots, to_real
from dflash_lib.target.protocol import FeatureSource
from dflash_lib.train.pipeline import Stopped

if TYPE_CHECKING:
    from dflash_lib.target.sharded import ShardedTarget

Skips = tuple[tuple[str, int, int], ...]  # (reason, sample index, its tokens) of each sample left out of a batch

class NothingTrainedError(RuntimeError):
    """No sample fit for training in a whole epoch of batches, or in any batch of the run: nothing to learn from,
    so the run fails instead of writing a drafter that was never trained."""


@dataclass(frozen=True)
class Work:
    """One micro-batch of sample indices and its place in the sampler's sequence."""

    epoch: int  # sampler epoch
    step: int  # sampler step within the epoch (0-based): once consumed, a resume restarts at step + 1
    shard: int  # the data shard whose batch this is (0..D-1; -1: none, a rank with no shard of this step)
    last_shard: bool  # this rank's last item of its sampler step: the step is fully consumed with it
    indices: list[int]  # sample indices in the store ([] for shard -1)
    index: int = 0  # sampler steps drawn before this one since the run began (the noise schedule's clock)
    step_end: bool = True  # the last item of its OPTIMIZER step (the same sampler step on every rank)
    bound: int = -1  # the plan's `Bound` code of this batch (the budgets that closed it); -1 = not known


@dataclass
class Collated:
    """A collated work item: `batch` is None when every one of its samples failed validation."""

    work: Work
    batch: Batch | None
    skips: Skips  # samples left out
    layout: DraftLayout | None = None  # the drafter's host-side work for `batch` (anchors drawn), if prepared

    def pin_memory(self) -> "Collated":
        if self.batch is None:
            return self
        return replace(self, batch=self.batch.pin_memory(),
                       layout=None if self.layout is None else self.layout.pin_memory())


@dataclass
class Item:
    """One micro-batch leaving the pipeline (batch, device_batch and features are None for an all-invalid one)."""

    epoch: int  # sampler epoch it came from
    batch: Batch | None  # host copy (pinned on CUDA): anchors are sampled from it without a device sync
    device_batch: Batch | None  # the same batch on the training device
    features: torch.Tensor | None  # (C, num_features * H) the drafter's context features on the training device:
    # the batch's real tokens in row-major order (`TargetModel.context_features`), no padding slot
    step: int = 0  # sampler step within the epoch (see Work)
    shard: int = 0  # rank whose batch this is
    last_shard: bool = True  # completes its sampler step
    skips: Skips = ()  # samples of this micro-batch left out by validation
    layout: DraftLayout | None = None  # host layout of the drafter's work (anchors, scored positions)
    device_layout: DraftLayout | None = None  # the same on the training device
    ready: torch.cuda.Event | None = None  # recorded on the target worker's stream once every device tensor above
    # is written (CUDA); None where the worker ran on the consumer's stream (CPU)
    step_end: bool = True  # the last item of its optimizer step (see Work)
    bound: int = -1  # the budgets that closed its batch (see Work)
    target_hidden: torch.Tensor | None = None  # (u, H) the target's final-normed states at layout.target_rows, on
    # the training device (loss kl / ce+kl only: the layout then names the rows; None for loss ce)

    def device_tensors(self) -> list[torch.Tensor]:
        """Every tensor of device_batch, features and device_layout (the ones written on the worker's stream)."""
        out: list[torch.Tensor] = []
        if self.device_batch is not None:
            b = self.device_batch
            out += [b.input_ids, b.loss_mask, b.position_ids, b.doc_ids, b.cu_seqlens]
        if self.features is not None:
            out.append(self.features)
        if self.target_hidden is not None:
            out.append(self.target_hidden)
        if self.device_layout is not None:
            self.device_layout._map(lambda t: out.append(t) or t)
        return out

    def wait_ready(self) -> None:
        """Make the CURRENT stream wait (on the device, no host sync) until the worker's copies and target forward
        are done, and mark the item's device tensors as used by the current stream, so the caching allocator does
        not hand their memory back to the worker's stream before this stream is done with them. A no-op when
        `ready` is None (CPU). Call it once, on the consumer's thread, before the first use of the tensors."""
        if self.ready is None:
            return
        stream = torch.cuda.current_stream()
        stream.wait_event(self.ready)
        for t in self.device_tensors():
            t.record_stream(stream)
        self.ready = None  # waited: a second call is a no-op


def anchor_seed(seed: int, shard: int, epoch: int, step: int) -> int:
    """Seed of the anchor draw of one micro-batch: a pure function of its sampler position, so anchors can be
    drawn ahead in the feed stage and a resume draws exactly the anchors an uninterrupted run would."""
    digest = hashlib.sha256(f"anchors:{seed}:{shard}:{epoch}:{step}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def make_prepare(drafter: Any, seed: int, noise_of: Callable[[int], float]) -> Callable[[Batch, Work], DraftLayout]:
    """(host batch, work) -> the drafter's host layout: anchors drawn from `anchor_seed(seed, shard, epoch,
    step)` with noise `noise_of(work.index)`, laid out for the drafter's attention backend."""
    def prepare(batch: Batch, work: Work) -> DraftLayout:
        gen = torch.Generator().manual_seed(anchor_seed(seed, work.shard, work.epoch, work.step))
        return drafter.layout(batch, drafter.sample_anchors(batch, gen, noise_of(work.index)))
    return prepare


def make_collate(store: Any, packed: bool, pad_id: int, row_len: int, edges: Sequence[int] = (),
                 vocab_size: int | None = None, pad_to_edge: bool = False,
                 prepare: Callable[[Batch, Work], DraftLayout] | None = None,
                 pack_multiple: int = 0) -> Callable[[Work], Collated]:
    """Work -> Collated: the samples that pass `validate_sample` (not checked when `vocab_size` is None) padded
    one per row (to the longest, or with `pad_to_edge` to the bucket's upper edge: static shapes) or packed into
    one row of at most `row_len` tokens (their tokens rounded up to `pack_multiple`; 0 = exactly `row_len`:
    static shapes); the others are listed in `skips`. A padded batch's bucket id (from `edges`) is
    that of the longest sample the sampler put in it, valid or not, so a skip never relabels the batch.
    `prepare` (e.g. `make_prepare`) lays out the drafter's work on the host here, off the training thread."""
    if pad_to_edge and not len(edges):
        raise ConfigError("pad_to_edge needs bucket edges")

    def collate(work: Work) -> Collated:
        samples = [store[i] for i in work.indices]
        skips: list[tuple[str, int, int]] = []
        keep: list[int] = []
        for k, (i, (tokens, mask)) in enumerate(zip(work.indices, samples)):
            reason = None if vocab_size is None else validate_sample(tokens, mask, vocab_size)
            if reason is None:
                keep.append(k)
            else:
                skips.append((reason, int(i), len(tokens)))
        if not keep:
            return Collated(work, None, tuple(skips))
        good, idx = [samples[k] for k in keep], [work.indices[k] for k in keep]
        if packed:
            batch = collate_packed(good, pad_id, row_len, idx, multiple=pack_multiple)
        else:
            bucket = int(bucket_of(max(len(t) for t, _ in samples), edges)) if len(edges) else -1  # -1: no buckets
            pad_to = int(edges[bucket]) if pad_to_edge else 0
            batch = collate_padded(good, pad_id, idx, bucket, pad_to)
        return Collated(work, batch, tuple(skips), None if prepare is None else prepare(batch, work))

    return collate


def epoch_batches(sampler: Any, max_steps: int | None, start: tuple[int, int] = (0, 0), done: int = 0,
                  shards: Sequence[int] | None = None, lengths: Any = None, accum_tokens: int = 0,
                  data_shards: int = 1) -> Iterator[Work]:
    """Work items in training order from the sampler position `start` = (epoch, step within that epoch), over
    successive epochs, until `max_steps` sampler steps in all (`done` of them were consumed before `start`;
    None = endless).

    Data shards: a sampler with `epoch_plan` (every EpochBatchSampler) is planned for `data_shards` = D shards,
    the D batches of one sampler step forming the GLOBAL batch whatever the world size; step s yields
    plan.batch(s, d) for each shard d in `shards` (this rank's: d % world == rank), so W ranks split the same D
    batches (W < D: several per rank, accumulated; W > D: some ranks take none). A rank with no shard yields one
    empty Work (shard -1) per sampler step, so that every rank takes every step's collectives. Any other batch
    sampler (set_epoch + iteration; one process, D = 1) yields its own batches, skipping the first `step` of the
    start epoch.

    Optimizer steps: with `accum_tokens` > 0 one step spans whole sampler steps until the sampler's tokens of all
    D shards (`lengths` (N,) summed over the indices, samples failing validation included) reach
    accum_tokens * D; else one sampler step is one optimizer step. `step_end` marks the last item of each
    optimizer step, on every rank alike: the cut is a function of the plan, not of the world size.
    """
    epoch, first = start
    plan_of = getattr(sampler, "epoch_plan", None)
    shards = [int(getattr(sampler, "rank", 0))] if shards is None else [int(r) for r in shards]
    if plan_of is None and (len(shards) != 1 or data_shards != 1):
        raise ConfigError(f"taking {len(shards)} of {data_shards} data shards needs a sampler with an epoch plan; "
                          f"{type(sampler).__name__} has none")
    if accum_tokens > 0 and lengths is None:
        raise ConfigError("accum_tokens > 0 needs the samples' lengths to cut optimizer steps")
    n, tokens = done, 0
    while max_steps is None or n < max_steps:
        bound = None  # (S, D) Bound codes of the plan's batches, when it records them
        if plan_of is not None:
            plan = plan_of(epoch)
            steps: Iterator[tuple[int, list[list[int]]]] = (
                (s, [plan.batch(s, d) for d in range(data_shards)]) for s in range(first, plan.num_steps))
            bound = None if plan.bound is None else plan.bound[plan.steps]
        else:
            sampler.set_epoch(epoch)
            steps = ((s, [list(b)]) for s, b in enumerate(sampler) if s >= first)
        empty = True
        for s, per_shard in steps:
            empty = False
            if accum_tokens > 0:
                tokens += sum(int(np.asarray(lengths)[b].sum()) for b in per_shard if len(b))
                end = tokens >= accum_tokens * data_shards
                tokens = 0 if end else tokens
            else:
                end = True
            mine = [(d, per_shard[d] if plan_of is not None else per_shard[0]) for d in shards] or [(-1, [])]
            for k, (d, indices) in enumerate(mine):
                last = k == len(mine) - 1
                why = -1 if bound is None or d < 0 else int(bound[s, d])
                yield Work(epoch, s, d, last, indices, n, step_end=last and end, bound=why)
            n += 1
            if max_steps is not None and n >= max_steps:
                return
        if empty and first == 0:
            raise ValueError(f"sampler {type(sampler).__name__} yielded no batch in epoch {epoch}")
        epoch, first = epoch + 1, 0


def make_target_workers(targets: Sequence[FeatureSource], n_workers: int, main_device: torch.device,
                        threads: int = 0, streams: bool | None = None, passes_per_step: int = 0,
                        cache: FeatureCache | None = None) -> list[Callable[[Collated], Item]]:
    """`n_workers` callables Collated -> Item; worker w runs targets[w % len(targets)] (one replica per device;
    on CPU several threads share one) and hands its features to `main_device`.

    threads > 0: torch intra-op threads of the thread that calls a worker, for a target on CPU (torch's thread
    count is per calling thread, so the drafter's thread keeps its own once it has run a torch op: torch takes a
    thread's count from the latest set_num_threads when that thread first runs one); 0 leaves torch's default.

    streams (None = when the target is on CUDA): each worker enqueues its host-to-device copies and the target
    forward on a CUDA stream of its own (one on the target's device, and one on `main_device` for the hand-over
    when that differs), so on one GPU the target of the next micro-batch overlaps the drafter's step on the
    default stream. The worker records `Item.ready` after the last copy; the consumer calls `Item.wait_ready()`
    (a device-side wait) before it touches the item. No host sync is made: the segments of the target's varlen
    attention come from the HOST batch, and every copy is non_blocking from pinned memory.

    passes_per_step > 0: the target is a `target.sharded.ShardedTarget`, whose feature passes are collectives. The
    one worker (more are refused) runs exactly that many passes per sampler step, a filler where the rank has no
    batch (an item whose samples all failed validation, fewer shards than the most any rank takes), each after
    the ranks' handshake (`ShardedTarget.turn`), and leaves the handshake when its stage ends (`leave`).

    cache: a batch whose samples are all in it takes its features from it (no target forward); the target's
    features of every other batch are stored in it (with the final-normed states of every real token for loss kl).
    Refused with a sharded target (a rank skipping its forward would leave the others' collectives waiting)."""
    if passes_per_step > 0 and cache is not None:
        raise ConfigError("pipeline.target_cache_gib needs a target that is not sharded (target_parallel fsdp runs "
                          "its forward as collectives on every rank): set it to 0 or target_parallel replicate")
    if passes_per_step > 0 and n_workers != 1:
        raise ConfigError(f"a sharded target runs one target worker per rank (its passes are collectives, in one "
                          f"order on every rank), got pipeline.target_workers={n_workers}")
    local = threading.local()

    def worker(target: FeatureSource) -> Callable[[Collated], Item]:
        use_streams = target.device.type == "cuda" if streams is None else streams
        lanes: dict[str, Any] = {}  # this worker's streams, created on first use (in the thread that runs it)

        def lane(device: torch.device) -> Any:
            key = str(device)
            if key not in lanes:
                lanes[key] = torch.cuda.Stream(device=device)
            return lanes[key]

        def run(c: Collated) -> Item:
            if threads > 0 and target.device.type == "cpu" and getattr(local, "threads", 0) != threads:
                torch.set_num_threads(threads)  # this thread only
                local.threads = threads
            w = c.work
            if c.batch is None:
                return Item(w.epoch, None, None, None, w.step, w.shard, w.last_shard, c.skips, step_end=w.step_end,
                            bound=w.bound)
            with contextlib.ExitStack() as on:
                hand_over = None
                if use_streams:
                    on.enter_context(torch.cuda.stream(lane(target.device)))
                    hand_over = lane(main_device)
                    if main_device != target.device:
                        on.enter_context(torch.cuda.stream(hand_over))
                segments = target.segments(c.batch.doc_ids)  # from the host doc_ids: no device read
                rows = None if c.layout is None else c.layout.target_rows  # (u,): loss kl / ce+kl only
                hit = None if cache is None else cache.lookup(c.batch, rows is not None)
                if hit is not None:
                    feats, final = _from_cache(hit, c.batch, rows, segments.runs_padding, main_device)
                    dev_batch = c.batch.to(main_device, non_blocking=True)
                else:
                    dev_batch = c.batch.to(target.device, non_blocking=True)
                    feats, final = _target_forward(target, c.batch, dev_batch, rows, segments, cache)
                if hit is None and target.device != main_device:
                    dev_batch = c.batch.to(main_device, non_blocking=True)
                    feats = feats.to(main_device, non_blocking=True)
                    final = None if final is None else final.to(main_device, non_blocking=True)
                dev_layout = None if c.layout is None else c.layout.to(main_device, non_blocking=True)
                ready = None
                if hand_over is not None:
                    ready = torch.cuda.Event()
                    ready.record(hand_over)  # after the features and every copy above
            return Item(w.epoch, c.batch, dev_batch, feats, w.step, w.shard, w.last_shard, c.skips, c.layout,
                        dev_layout, ready, w.step_end, w.bound, final)
        return run if passes_per_step <= 0 else sharded(target, run)

    def sharded(target: "ShardedTarget", run: Callable[[Collated], Item]) -> Callable[[Collated], Item]:
        done = [0]  # passes of the current sampler step so far

        def turn() -> None:
            if not target.turn():
                raise Stopped("another rank's target feed stopped")

        def run_paired(c: Collated) -> Item:
            turn()
            if c.batch is None:
                target.filler()
            item = run(c)
            done[0] += 1
            if c.work.last_shard:  # the step's remaining passes: a rank with fewer shards than the most
                for _ in range(passes_per_step - done[0]):
                    turn()
                    target.filler()
                done[0] = 0
            return item

        run_paired.leave = target.leave  # type: ignore[attr-defined]  # called by the pipeline stage at its end
        return run_paired

    return [worker(targets[w % len(targets)]) for w in range(n_workers)]


def _target_forward(target: Any, batch: Batch, dev_batch: Batch, rows: torch.Tensor | None, segments: Any,
                    cache: FeatureCache | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The target's features of `batch` (C, F*H) and, with `rows` (u,) (loss kl), the final-normed states there
    (u, H); stored in `cache` (every real token's final states with them) when one is given."""
    final = every = None
    if rows is None:
        feats = target.context_features(dev_batch, segments)  # (C, F*H): never the padded slots
    elif cache is None:  # every layer, the final norm at the u rows: (C, F*H), (u, H)
        feats, final = target.context_features_and_final(dev_batch, rows, segments)
    else:  # the final norm at every real token, for the cache; the u rows taken from it
        pad = segments.runs_padding
        feats, every = target.context_features_and_final(dev_batch, context_rows(batch, pad), segments)
        final = every[to_real(rows, batch, pad).to(every.device)]
    if cache is not None:
        real = feats[real_slots(batch).to(feats.device)] if segments.runs_padding else feats
        cache.store(batch, real, every)
    return feats, final


def _from_cache(hit: tuple[torch.Tensor, torch.Tensor | None], batch: Batch, rows: torch.Tensor | None,
                runs_padding: bool, device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A cached batch's (C, F*H) context features and (u, H) final states at `rows`, on `device`."""
    real, every = hit
    pin = device.type == "cuda"
    feats = as_context(real.pin_memory() if pin else real, batch, runs_padding).to(device, non_blocking=True)
    if rows is None or every is None:
        return feats, None
    final = every[to_real(rows, batch, runs_padding)]
    return feats, (final.pin_memory() if pin else final).to(device, non_blocking=True)


def next_step_items(it: Iterator[Item], last_wait_s: Callable[[], float]) -> tuple[list[Item], float, bool]:
    """The micro-batches of one optimizer step: items up to the one marked `step_end` (see `epoch_batches`).
    Returns (items, seconds blocked on data, stream ended); `last_wait_s()` is the wait of the latest `next(it)`
    (the pipeline's `last_wait_s`)."""
    items: list[Item] = []
    wait = 0.0
    while True:
        try:
            item = next(it)
        except StopIteration:
            return items, wait, True
        wait += last_wait_s()
        items.append(item)
        if item.step_end:
            return items, wait, False
