"""The dry run: every bucket's worst batch and the packed row measured (`step`), judged against a device, projected
to step time and an ETA, and reported (a table and one JSON line).

    python -m dflash_lib dryrun --preset qwen3-8b [-p KEY VALUE]... [--device-gib 80] [--compare]
        [--world-size N [-p target_parallel replicate|fsdp|auto] [--link-gbs 450]]

docs/scale.md, "The paper scale, proven on a CPU: the dry run" and "Larger targets on several GPUs".
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np
import torch

from dflash_lib.config import Config, ConfigError, from_params
from dflash_lib.data import build_token_store_from_config
from dflash_lib.data.stats import store_drafter_queries
from dflash_lib.models.target_config import target_hf_config
from dflash_lib.plan.sampler import resolve_block_budget
from dflash_lib.rundir import JsonRecord, load_config, omitted
from dflash_lib.train.build import bucket_edges, build_sampler
from dflash_lib.dryrun.fake_ranks import LayerRuns, fake_process_group, local_bytes
from dflash_lib.target.sharded import resolve_target_parallel, target_footprint
from dflash_lib.dryrun.step import GIB, H200_BF16_TFLOPS, NVLINK4_GBS, PAPER_SAMPLES, Ranks, Reserve, StepFigures, StepSettings, build_step_models, for_cuda, measure_step
from dflash_lib.dryrun.worst import WorstBatch, host_batch, worst_batches

@dataclass
class BatchRecord(JsonRecord):
    """One worst-case batch in the dry run's report (`BatchResult.record`); sizes rounded for reading."""

    bucket: int  # bucket index; -1 = the packed row
    lower: int  # exclusive lower edge of the bucket (tokens); 0 for packed
    edge: int  # inclusive upper edge (tokens); max_len for packed
    docs: int  # documents in the batch
    target_tokens: int  # token slots the target runs, padding included
    real_tokens: int  # document tokens
    drafter_queries: int  # drafter query tokens: anchors x block_size
    peak_gib: float  # measured peak of the step (GiB), everything tracked
    required_gib: float  # the peak with fragmentation, kernel allowance and reserve (GiB, `Reserve.required_bytes`)
    fits: bool  # required_gib <= the device's memory
    tflops: float  # FLOPs of the step, activation recomputation included (TFLOP)
    tflops_split: dict[str, float]  # the same by part: target_forward, drafter_layers, drafter_attention, head_ce
    memory_gib: dict[str, float]  # GiB per category at the moment of the peak (parameters, gradients, optimizer, ...)
    kernel_allowance_gib: float  # what a CUDA kernel adds that the fake CPU step does not hold (GiB)
    step_s: float  # projected step time on the device at the stated MFU, collectives included (seconds)
    ktok_s: float  # real tokens per second at that step time, summed over the ranks (thousands)
    all_gather_gib: float = 0.0  # the sharded target's all-gathers of one step, full buffers (GiB per rank)
    grad_reduce_gib: float = 0.0  # the drafter's gradient all-reduce of one step (GiB per rank, fp32)
    comm_s: float = 0.0  # of step_s: the collectives at the stated link bandwidth (`Ranks.comm_seconds`)
    hidden_states_gib: float = 0.0  # a served target: the features the engine hands this rank per step (GiB)


@dataclass
class BatchResult:
    """One worst-case batch measured and judged against a device."""

    worst: WorstBatch
    figures: StepFigures
    required_bytes: float  # peak with the reserve (Reserve.required_bytes)
    fits: bool  # required_bytes <= the device's memory
    step_s: float  # projected step time on the device (seconds), comm_s included
    comm_s: float = 0.0  # of step_s: the collectives (seconds)
    world_size: int = 1  # ranks each running such a batch (ktok_s sums them)
    target_bytes: int = 0  # what this rank holds of the target's weights (bytes; its FSDP2 shards when sharded)
    balanced_experts: int = 0  # MoE experts modules priced by the balanced stand-in (StepModels.balanced_experts)
    # all-gathered bytes of the whole measurement whose layer never ran (`fake_ranks.LayerRuns`): a prefetch past
    # the pass's last layer, held unsharded for the run; the same on every batch's result, 0 for the trainer's chain
    idle_gather_bytes: int = 0

    def record(self) -> BatchRecord:
        """This batch in the report."""
        w, f = self.worst, self.figures
        return BatchRecord(bucket=w.bucket, lower=w.lower, edge=w.edge, docs=w.docs, target_tokens=w.target_tokens,
                    real_tokens=sum(w.lengths), drafter_queries=w.drafter_queries,
                    peak_gib=round(f.peak_bytes / GIB, 3), required_gib=round(self.required_bytes / GIB, 3),
                    fits=self.fits, tflops=round(f.flops_total / 1e12, 4),
                    tflops_split={k: round(v / 1e12, 4) for k, v in f.flops.items()},
                    memory_gib={k: round(v / GIB, 3) for k, v in f.memory.items()},
                    kernel_allowance_gib=round(f.kernel_allowance / GIB, 2), step_s=round(self.step_s, 3),
                    ktok_s=round(self.world_size * sum(w.lengths) / self.step_s / 1000.0, 1),
                    all_gather_gib=round(f.comm.get("all_gather", 0) / GIB, 3),
                    grad_reduce_gib=round(f.comm.get("all_reduce", 0) / GIB, 3), comm_s=round(self.comm_s, 3),
                    hidden_states_gib=round(f.comm.get("hidden_states", 0) / GIB, 3))


def measure_batches(config: Config, worst: Sequence[WorstBatch], settings: StepSettings, device_gib: float,
                    mfu: float = 0.4, peak_tflops: float = H200_BF16_TFLOPS, reserve: Reserve = Reserve(),
                    fake: bool = True, say: Callable[[str], None] = lambda line: None,
                    ranks: Ranks = Ranks()) -> list[BatchResult]:
    """Measure one step per batch of `worst` with models built once for `settings` (fake weights by default), as
    rank 0 of `ranks`: with an FSDP2-sharded target under a fake process group (`fake_ranks`), its peak, FLOPs
    and all-gathers are one rank's. The drafter is replicated and its gradients all-reduced in fp32 once per step
    (DistributedDataParallel, `train.parallel` ddp: its gradients are the all-reduce buckets, so its memory is
    the one-rank figure); that all-reduce's bytes are its trainable parameters' fp32 bytes."""
    with fake_process_group(ranks.world_size) if ranks.sharded else contextlib.nullcontext() as mesh:
        models = build_step_models(config, target_hf_config(config.model), settings, fake, config.train.seed, mesh)
        grads = 4 * sum(p.numel() for p in models.params) if ranks.world_size > 1 else 0  # fp32 gradient bytes
        held = local_bytes([p for m in models.held for p in m.parameters()])
        runs = LayerRuns(models.target.base.layers, ranks.world_size)
        out = []
        for w in worst:
            batch = host_batch(w, models.drafter.cfg.vocab_size, config.model.mask_id, seed=config.train.seed)
            with runs:
                fig = measure_step(models, batch, config.train.seed)
            if grads:
                fig.comm["all_reduce"] = fig.comm.get("all_reduce", 0) + grads
            if models.served:  # the features the engine hands over, in the target's dtype (not a collective)
                fig.comm["hidden_states"] = sum(w.lengths) * models.target.num_features * models.target.hidden_size \
                    * settings.target_dtype.itemsize
            need = reserve.required_bytes(fig.peak_bytes, fig.kernel_allowance)
            comm_s = ranks.comm_seconds(fig.comm)
            out.append(BatchResult(w, fig, need, need <= device_gib * GIB,
                                   fig.flops_total / (mfu * peak_tflops * 1e12) + comm_s, comm_s, ranks.world_size,
                                   held, models.balanced_experts))
            say(f"  {w.label}: {w.docs} docs, {w.drafter_queries} queries -> peak {fig.peak_bytes / GIB:.1f} GiB "
                f"({fig.seconds:.0f} s)")
        idle = sum(r.figures.gathered for r in out) - runs.bytes if ranks.sharded else 0
    return [dataclasses.replace(r, idle_gather_bytes=idle) for r in out]



def measure_plan(plan: Any, config: Config, device_gib: float = 80.0, attention: str | None = None,
                 reserve: Reserve = Reserve()) -> list[BatchRecord]:
    """Per-bucket measured peak of a BucketPlan (notebook 02's check): one fake step of each bucket's worst batch
    at `config`'s model shapes, as on CUDA (`for_cuda`; `attention` overrides the backend). Returns one record
    per bucket (docs, tokens, queries, peak_gib, required_gib, fits on `device_gib`, ...)."""
    config = _with(config, token_budget=int(plan.token_budget or config.sampler.token_budget))
    settings = for_cuda(config)
    if attention is not None:
        settings = dataclasses.replace(settings, attention=attention)
    block_budget = resolve_block_budget(config.sampler, config.buckets, config.model, config.data.max_len)
    worst = worst_batches(config, list(plan.edges), block_budget)[:-1]
    return [r.record() for r in measure_batches(config, worst, settings, device_gib, reserve=reserve)]


def _with(config: Config, **params: Any) -> Config:
    return from_params(params, config)


def _epoch_batches(config: Config, lengths: np.ndarray, queries: np.ndarray, edges: Sequence[int],
                   world_size: int = 1) -> tuple[list[int], int]:
    """(batches of each bucket in epoch 0 of the bucketed sampler, rows of the packed sampler) of rank 0 of
    `world_size` ranks: the steps of an epoch, every rank stepping together."""
    n = world_size
    bucketed = build_sampler(_with(config, strategy="bucketed"), lengths, 0, n, edges, queries).epoch_plan(0)
    packed = build_sampler(_with(config, strategy="packed"), lengths, 0, n, [], queries).epoch_plan(0)
    counts = np.bincount(bucketed.step_bucket, minlength=len(edges))
    return [int(c) for c in counts], packed.num_steps


@dataclass
class DryRunEta(JsonRecord):
    """The dry run's projection of a full training run on the report's world_size GPUs, every batch costed as its
    bucket's worst."""

    corpus_samples: int  # samples of the corpus the ETA is for
    corpus: str  # where that count came from: "given" (--corpus-samples) or the bundled corpus, in words
    epochs: float  # epochs of the full run (`full_run_epochs`)
    batches_per_epoch: dict[str, Any]  # "bucketed": batches of each bucket in one epoch; "packed": rows in one epoch
    seconds: dict[str, float]  # strategy (bucketed, packed) -> seconds of the full run
    days: dict[str, float]  # the same in days, rounded
    paper_samples: int  # the paper's training set (samples)
    paper_days: dict[str, float]  # strategy -> days of the full run over paper_samples


@dataclass
class DryRunAssumptions(JsonRecord):
    """What the dry run's projections assume (module docstring)."""

    gpu: str  # the device the step time is projected for
    peak_tflops: float  # its dense bf16 peak (TFLOP/s)
    mfu: float  # the model FLOPs utilisation assumed, a fraction of peak_tflops
    reserve_gib: float  # memory no tracker sees (GiB, `Reserve`)
    fragmentation: float  # caching-allocator overhead, a fraction of the measured peak
    device: str  # how the step was run, in words
    eta: str  # how the ETA is costed, in words
    link_gbs: float = NVLINK4_GBS  # per-GPU interconnect bandwidth the collectives are costed at (GB/s, one way)
    ranks: str = "one rank"  # how the ranks were emulated and what their collectives are, in words
    experts: str = "none"  # how a mixture-of-experts target's routing was priced, in words


@dataclass
class BackendComparison(JsonRecord):
    """The same dry run under another attention backend (`--compare`)."""

    fits: bool  # every batch fits the device
    buckets: list[BatchRecord]  # every bucket's worst batch
    packed: BatchRecord  # the packed row's
    eta: DryRunEta  # the full-run projection


@dataclass
class DryRunReport(JsonRecord):
    """The dry run of a configuration (`dry_run`): the JSON line of `python -m dflash_lib dryrun`."""

    device_gib: float  # memory of the device judged against (GiB)
    fits: bool  # every batch (buckets and packed) fits it
    attention: str  # drafter attention backend measured: dense | blocks | flex
    checkpointing: int  # drafter layers recomputed in the backward (the first ones; activation checkpointing)
    target: str  # the target: a preset's shapes, "tiny" or a model folder
    target_layers: int  # the target's decoder layers
    hidden_size: int  # the target's hidden size
    drafter_layers: int  # the drafter's layers
    block_size: int  # B: anchor + B-1 drafted positions
    num_anchors: int  # anchors drawn per document at most
    max_len: int  # longest document (tokens)
    token_budget: int  # token slots per batch, padding included
    block_budget: int  # drafter query tokens per batch at most (`sampler.resolve_block_budget`)
    edges: list[int]  # bucket upper edges of the corpus' plan (tokens)
    buckets: list[BatchRecord]  # every bucket's worst batch
    packed: BatchRecord  # the packed row's worst mix
    assumptions: DryRunAssumptions  # what the projections assume
    eta: DryRunEta  # the full-run projection
    seconds: float  # wall time of the dry run on this machine (seconds)
    world_size: int = 1  # ranks (GPUs) the step runs on, each its own worst batch
    target_parallel: str = "replicate"  # the target over them: replicate | fsdp (`Ranks`)
    target_gib: float = 0.0  # the target's bf16 weights, whole (GiB)
    target_gib_per_rank: float = 0.0  # what one rank holds of them (GiB): target_gib, or its FSDP2 shard
    # all-gathered for a layer that never ran (GiB per rank): a prefetch past the pass's last layer, gathered once
    # and held unsharded for the whole run (`BatchResult.idle_gather_bytes`); 0 for the trainer's prefetch chain
    idle_gather_gib: float = 0.0
    loss: str = "ce"  # the drafter loss measured: ce | kl | ce+kl (kl: every target layer, the target's logits too)
    compare: dict[str, BackendComparison] | None = omitted()  # backend -> the same run under it (`--compare` only)


def dry_run(config: Config, device_gib: float = 80.0, mfu: float = 0.4, corpus_samples: int = 0,
            attention: str | None = None, reserve: Reserve = Reserve(), peak_tflops: float = H200_BF16_TFLOPS,
            say: Callable[[str], None] = lambda line: None, world_size: int = 1,
            link_gbs: float = NVLINK4_GBS) -> DryRunReport:
    """The dry run of `config` (module docstring): the bucket plan of its corpus, every bucket's worst batch and
    the packed row measured in fake mode as on CUDA (`attention` overrides the backend), as rank 0 of
    `world_size` ranks with the target laid over them by `train.target_parallel` (`sharded.resolve_target_parallel`),
    projections. Returns the report (`format_report` prints it; the CLI's JSON line is its `to_json`)."""
    t0 = time.perf_counter()
    mc = config.model
    hf = target_hf_config(mc)
    weights = target_footprint(hf, torch.bfloat16).weights
    parallel, _ = resolve_target_parallel(config.train.target_parallel, weights, int(device_gib * GIB), world_size)
    ranks = Ranks(world_size, "served" if mc.target_engine == "vllm" else parallel, link_gbs)
    settings = for_cuda(config)
    if attention is not None:
        settings = dataclasses.replace(settings, attention=attention)
    store = build_token_store_from_config(config.data, progress=False)
    lengths = np.asarray(store.lengths)
    queries = store_drafter_queries(store, mc.num_anchors, mc.block_size)
    edges = bucket_edges(_with(config, strategy="bucketed"), lengths, store.meta.get("key"), queries)
    block_budget = resolve_block_budget(config.sampler, config.buckets, mc, config.data.max_len)
    say(f"corpus {config.data.source}: {len(lengths):,} samples, {int(lengths.sum()):,} tokens; edges {edges}; "
        f"token_budget {config.sampler.token_budget}, block_budget {block_budget}; attention {settings.attention}, "
        f"checkpointed layers {settings.checkpointing}/{mc.drafter_layers}; {ranks.world_size} rank(s), target "
        f"{ranks.target_parallel} ({weights / GIB:.1f} GiB bf16)")
    results = measure_batches(config, worst_batches(config, edges, block_budget), settings, device_gib, mfu,
                              peak_tflops, reserve, say=say, ranks=ranks)
    buckets, packed = results[:-1], results[-1]
    counts, rows = _epoch_batches(config, lengths, queries, edges, ranks.world_size)
    n = corpus_samples or len(lengths)
    epochs = config.train.full_run_epochs
    epoch_s = {"bucketed": sum(c * r.step_s for c, r in zip(counts, buckets)), "packed": rows * packed.step_s}
    eta = DryRunEta(
        corpus_samples=n, corpus="given" if corpus_samples else f"the bundled corpus ({len(lengths):,} samples)",
        epochs=epochs, batches_per_epoch={"bucketed": counts, "packed": rows},
        seconds={k: v * epochs * n / len(lengths) for k, v in epoch_s.items()},
        days={k: round(v * epochs * n / len(lengths) / 86400, 2) for k, v in epoch_s.items()},
        paper_samples=PAPER_SAMPLES,
        paper_days={k: round(v * epochs * PAPER_SAMPLES / len(lengths) / 86400, 2) for k, v in epoch_s.items()})
    return DryRunReport(
        device_gib=device_gib, fits=all(r.fits for r in results), attention=settings.attention,
        checkpointing=settings.checkpointing, target=mc.target, target_layers=int(hf.num_hidden_layers),
        hidden_size=int(hf.hidden_size), drafter_layers=mc.drafter_layers, block_size=mc.block_size,
        num_anchors=mc.num_anchors, max_len=config.data.max_len, token_budget=config.sampler.token_budget,
        block_budget=block_budget, edges=list(edges), loss=mc.loss,
        buckets=[r.record() for r in buckets], packed=packed.record(),
        assumptions=DryRunAssumptions(
            gpu="H200", peak_tflops=peak_tflops, mfu=mfu, reserve_gib=reserve.reserve_gib,
            fragmentation=reserve.fragmentation, device="fake CPU tensors standing in for CUDA, bf16 target, fp32 "
            "drafter under bf16 autocast, fused AdamW", eta=f"{ranks.world_size} GPU(s), rank 0's share of each "
            "epoch; every batch costed as its bucket's worst batch (an upper bound); FLOPs counted include "
            "activation recomputation; step time = compute at the MFU + collectives at link_gbs, not overlapped",
            link_gbs=ranks.link_gbs, ranks=_ranks_words(ranks), experts=_experts_words(hf, results[0].balanced_experts)),
        eta=eta, seconds=round(time.perf_counter() - t0, 1), world_size=ranks.world_size,
        target_parallel=ranks.target_parallel, target_gib=round(weights / GIB, 2),
        target_gib_per_rank=round(results[0].target_bytes / GIB, 2),
        idle_gather_gib=round(results[0].idle_gather_bytes / GIB, 3))


def _ranks_words(ranks: Ranks) -> str:
    if ranks.world_size == 1:
        return "one rank" + ("; the target served by an engine (target_engine vllm): this rank holds its embedding and "
                             "LM head and receives the features" if ranks.target_parallel == "served" else "")
    words = (f"rank 0 of {ranks.world_size}; the drafter replicated (DDP), its fp32 gradients all-reduced once "
             "per step")
    if ranks.sharded:
        words += ("; the target FSDP2-sharded per decoder layer under torch's fake process group (real "
                  "fully_shard: 1/N shards, the running and the prefetched layer gathered), embedding and LM head "
                  "whole on every rank; all-gathers counted from the collectives the step issued")
    if ranks.target_parallel == "served":
        words += ("; the target served by an engine on other GPUs (target_engine vllm): a rank holds its embedding "
                  "and LM head, runs no target layer, and receives the features (hidden_states_gib a step)")
    return words + "; ring collectives"


def _experts_words(hf: Any, balanced: int) -> str:
    experts = int(getattr(hf, "num_experts", 0) or 0)
    if not experts:
        return "none (dense target)"
    head = f"{experts} experts, {int(getattr(hf, 'num_experts_per_tok', 0))} per token: "
    if balanced:
        return head + (f"BALANCED routing assumed in {balanced} MoE layers (dryrun/balanced_experts.py: every expert "
                       "gets tokens x top_k / experts assignments, run one expert at a time as the eager loop)")
    return head + ("transformers' grouped_mm experts run as they are (all tokens x top_k assignments at once, "
                   "shapes independent of the routing); FLOPs are routing-independent")


def format_report(report: DryRunReport) -> str:
    """The human-readable table of a `dry_run` report."""
    r = report
    head = (f"dry run: target {r.target} ({r.target_layers} layers, hidden {r.hidden_size}), drafter "
            f"{r.drafter_layers} layers, block {r.block_size}, {r.num_anchors} anchors, max_len {r.max_len}, "
            f"loss {r.loss}"
            f"\n  attention {r.attention}, checkpointed layers {r.checkpointing}/{r.drafter_layers}, token_budget "
            f"{r.token_budget}, block_budget {r.block_budget}; device {r.device_gib:g} GiB"
            f"\n  {r.world_size} rank(s), target {r.target_parallel}: {r.target_gib_per_rank:.1f} of its "
            f"{r.target_gib:.1f} GiB bf16 weights per rank"
            + (f", {r.idle_gather_gib:.2f} GiB gathered for layers that never run (held)" if r.idle_gather_gib else "")
            + "; figures per rank, Ktok/s summed over the ranks")
    cols = ("batch", "edge", "docs", "tgt tok", "queries", "peak", "need", "fits", "TFLOP", "tgt/layers/attn/head",
            "AG/AR GiB", "comm s", "step s", "Ktok/s", "par/grad/opt/act/tmp GiB")
    rows = []
    for b in [*r.buckets, r.packed]:
        t, m = b.tflops_split, b.memory_gib
        rows.append((
            "packed" if b.bucket < 0 else f"bucket {b.bucket}", f"({b.lower}, {b.edge}]", b.docs,
            b.target_tokens, b.drafter_queries, f"{b.peak_gib:.1f}", f"{b.required_gib:.1f}",
            "yes" if b.fits else "NO", f"{b.tflops:.0f}",
            "/".join(f"{t[k]:.0f}" for k in ("target_forward", "drafter_layers", "drafter_attention", "head_ce")),
            f"{b.all_gather_gib:.1f}/{b.grad_reduce_gib:.1f}", f"{b.comm_s:.2f}", f"{b.step_s:.2f}", f"{b.ktok_s:.1f}",
            "/".join(f"{m.get(k, 0):.1f}" for k in ("parameters", "gradients", "optimizer", "activations",
                                                     "temporaries"))))
    widths = [max(len(str(x)) for x in col) for col in zip(cols, *rows)]
    lines = [head, "  ".join(str(c).rjust(w) for c, w in zip(cols, widths))]
    lines += ["  ".join(str(c).rjust(w) for c, w in zip(row, widths)) for row in rows]
    a, e = r.assumptions, r.eta
    lines.append(f"fits: {'yes' if r.fits else 'NO'} (need = peak x {1 + a.fragmentation:.2f} + kernel allowance "
                 f"+ {a.reserve_gib:g} GiB reserve <= {r.device_gib:g} GiB)")
    lines.append(f"projection: {a.gpu} at {a.mfu:.0%} MFU of {a.peak_tflops:g} TFLOP/s, links {a.link_gbs:g} GB/s "
                 f"per GPU; {a.eta}")
    lines.append(f"ranks: {a.ranks}; MoE: {a.experts}")
    served = max(b.hidden_states_gib for b in [*r.buckets, r.packed])
    if served:
        lines.append(f"served target: up to {served:.2f} GiB of features a step to each rank from the engine (their "
                     "transfer is not in the step time; the engine's GPUs run the target's forward)")
    lines.append(f"ETA of {e.epochs:g} epochs over {e.corpus_samples:,} samples ({e.corpus}): bucketed "
                 f"{e.days['bucketed']:.2f} days, packed {e.days['packed']:.2f} days; over the paper's "
                 f"{e.paper_samples:,}: bucketed {e.paper_days['bucketed']:.1f} days, packed "
                 f"{e.paper_days['packed']:.1f} days")
    return "\n".join(lines)


def run_cli(args: Any, params: dict[str, str]) -> int:
    """`python -m dflash_lib dryrun` (arguments and the -p KEY VALUE `params` parsed in `__main__`): the table, then
    ONE JSON line (the report); returns 0 when every batch fits the device, 1 otherwise (a bad parameter raises
    ConfigError: exit 2)."""
    if args.device_gib <= 0 or not 0 < args.mfu <= 1 or args.corpus_samples < 0 or args.world_size < 1 \
            or args.link_gbs <= 0:
        raise ConfigError("--device-gib must be > 0, --mfu in (0, 1], --corpus-samples >= 0, --world-size >= 1, "
                          "--link-gbs > 0")
    config = load_config(params, args.preset)
    ranks = dict(world_size=args.world_size, link_gbs=args.link_gbs)
    reserve = Reserve(**{k: v for k, v in dict(reserve_gib=args.reserve_gib, fragmentation=args.fragmentation).items()
                         if v is not None})
    say = lambda line: print(line, flush=True)  # noqa: E731
    report = dry_run(config, args.device_gib, args.mfu, args.corpus_samples, reserve=reserve, say=say, **ranks)
    print(format_report(report), flush=True)
    if args.compare:
        report.compare = {}
        for backend in ("dense", "blocks", "flex"):
            if backend == report.attention:
                continue
            say(f"-- attention {backend}")
            other = dry_run(config, args.device_gib, args.mfu, args.corpus_samples, backend, reserve, say=say,
                            **ranks)
            print(format_report(other), flush=True)
            report.compare[backend] = BackendComparison(other.fits, other.buckets, other.packed, other.eta)
    print(json.dumps(report.to_json()), flush=True)
    return 0 if report.fits else 1
