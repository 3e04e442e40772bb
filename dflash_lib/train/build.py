"""What a training run is made of, built from a Config: its data, sampler, target replica(s) and drafter.

    load_training_data: token store -> held-out split -> lengths, drafter query tokens, bucket edges, pad id
    build_parts:        + the sampler (the global plan of D data shards), the frozen target(s), a fresh drafter
                        -> TrainingParts, everything the loop in `dflash_lib.train.loop` consumes

`load_training_data` opens and checks the corpus before anything is written into a run folder: `train()` calls
it first, so a missing source or an empty store leaves no half-made run behind.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch

from dflash_lib.config import Config, ConfigError, checkpointed_layers, target_tokenizer, uses_bf16
from dflash_lib.data import build_token_store_from_config
from dflash_lib.data.split import HeldOutSplit, SubsetStore, split_store
from dflash_lib.data.stats import store_drafter_queries
from dflash_lib.models import DFlashDrafter
from dflash_lib.models.draft_vocab import coverage, scored_token_counts, top_tokens
from dflash_lib.models.attention import resolve_attention
from dflash_lib.models.drafters import drafter_kind
from dflash_lib.models.export import init_from
from dflash_lib.models.target_config import target_hf_config
from dflash_lib.plan import sampler as samplers
from dflash_lib.plan.buckets import BucketPlan, SampleCost, bucket_of, optimal_boundaries
from dflash_lib.plan.sampler.budget import TokenBudget
from dflash_lib.target.facts import read_facts
from dflash_lib.target.open import TargetSource, open_sources
from dflash_lib.target.protocol import FeatureSource
from dflash_lib.target.sharded import device_memory_bytes, plan_target
from dflash_lib.train import distributed


@dataclass
class TrainingParts:
    """Everything the loop consumes: built from a Config by `build_parts`, or by a test from small stand-ins."""

    store: Any  # store[i] -> (tokens (L,), loss_mask (L,)) numpy arrays
    lengths: np.ndarray  # (N,) tokens per sample of the store
    sampler: Any  # batch sampler with set_epoch(e) and len() = steps per epoch (this rank); epoch_plan if any
    targets: list[FeatureSource]  # one replica per target device (targets[0] on the training device), or the one
    # `ShardedTarget` or `ServedTarget`: what the feature passes run on (`target.open.open_sources`)
    drafter: DFlashDrafter  # on the training device, sharing the target's embedding and LM head (replicated)
    pad_id: int  # token id written into padding slots (never scored)
    packed: bool  # collate by packing documents into rows of at most `row_len` tokens instead of padding
    row_len: int  # longest packed row in tokens (the token budget; rows are shorter unless static shapes)
    edges: list[int]  # bucket upper edges in tokens, for the bucket id of padded batches ([] = no buckets)
    heldout: HeldOutSplit | None = None  # the held-out split (store, lengths and sampler are its train part)
    full_store: Any = None  # the store the split's indices refer to (None: `store` itself)
    data_shards: int = 1  # D: batches per sampler step (the sampler's plan width), shared by the ranks
    target_parallel: str = "replicate"  # how the target is held: "replicate" | "fsdp" (resolved, never "auto")


@dataclass
class TrainingData:
    """The corpus side of a run (`load_training_data`), opened and checked before the run folder is touched."""

    store: Any  # the training view: store[i] -> (tokens (L,), loss_mask (L,)); held-out samples left out
    lengths: np.ndarray  # (N,) tokens per sample of `store`
    queries: np.ndarray  # (N,) drafter query tokens per sample of `store` (anchors x block size at most)
    edges: list[int]  # bucket upper edges in tokens for the bucketed sampler ([] = another strategy)
    pad_id: int  # token id written into padding slots (the tokenizer's, from the store's meta.json)
    split: HeldOutSplit  # the held-out split; its indices refer to `full_store`
    full_store: Any  # the whole token store


def load_training_data(config: Config) -> TrainingData:
    """Build (or read from its cache) the token store of `config.data`, hold out `heldout_fraction` of it and
    compute what the sampler needs; prints which tokenizer the run uses. Raises DataError / ConfigError on a
    missing source, an empty store, ids or a MASK id the target cannot embed (`check_vocabulary`), a split that
    leaves nothing to train on, a missing bucket plan or a store without a pad id."""
    store = build_token_store_from_config(config.data, progress=distributed.info().rank == 0)
    lengths = np.asarray(store.lengths)
    if len(lengths) == 0:
        raise ConfigError(f"the token store {store.path} holds no sample (source {config.data.source!r})")
    distributed.print0(check_vocabulary(config, store.meta.get("tokenizer", {})))
    full_store, split = store, split_store(store, config.data.heldout_fraction)
    if len(split.train) == 0:
        raise ConfigError(f"heldout_fraction {config.data.heldout_fraction} holds out every one of the "
                          f"{len(lengths)} samples")
    if len(split.heldout):  # the sampler and its bucket plan see the training part only
        store, lengths = SubsetStore(full_store, split.train), lengths[split.train]
    queries = store_drafter_queries(full_store, config.model.num_anchors,
                                    config.model.block_size)[split.train]  # (N,) query tokens
    edges = (bucket_edges(config, lengths, full_store.meta.get("key"), queries)
             if config.sampler.strategy == "bucketed" else [])
    pad_id = store.meta.get("tokenizer", {}).get("pad_id")
    if pad_id is None:
        raise ConfigError(f"token store {store.path}: meta.json records no tokenizer pad_id")
    return TrainingData(store, lengths, queries, edges, int(pad_id), split, full_store)


def check_vocabulary(config: Config, tokenizer: dict[str, Any]) -> str:
    """Refuse (ConfigError) a run whose ids the target cannot embed: a tokenizer emitting ids 0 .. n_vocab-1
    (`tokenizer`: the token store's facts, special tokens included) beyond the target's vocab_size (every sample
    would be skipped as token_out_of_vocab), or a mask_id outside [0, vocab_size). Reads the target's config
    only, no weight. Returns the log line naming the tokenizer used and why."""
    data, model = config.data, config.model
    vocab = int(target_hf_config(model).vocab_size)  # embedding rows of the target
    n_vocab = tokenizer.get("n_vocab")
    if n_vocab is None:
        raise ConfigError(f"token store of {data.source!r}: meta.json records no tokenizer n_vocab (rebuild it)")
    own = target_tokenizer(model.target)
    if n_vocab > vocab:
        fix = ("the folder's tokenizer and model do not match" if own == data.tokenizer
               else "pass the target's own tokenizer with -p tokenizer DIR")
        raise ConfigError(f"tokenizer {data.tokenizer!r} emits ids up to {n_vocab - 1} ({n_vocab} ids) but target "
                          f"{model.target!r} has vocab_size {vocab}: {fix}")
    if not 0 <= model.mask_id < vocab:
        free = f", e.g. {vocab - 1}: a row the tokenizer (ids < {n_vocab}) never emits" if n_vocab < vocab else ""
        raise ConfigError(f"mask_id {model.mask_id} is outside target {model.target!r}'s vocabulary [0, {vocab}): "
                          f"pass -p mask_id N with N < {vocab}{free}")
    if model.draft_vocab >= vocab:  # every row: no draft vocabulary (the doctor and evaluate would refuse it)
        raise ConfigError(f"draft_vocab {model.draft_vocab} is not below target {model.target!r}'s vocab_size "
                          f"{vocab}: pass -p draft_vocab N with N < {vocab} (0: the whole head)")
    why = ("the target folder's own" if own == data.tokenizer
           else f"-p tokenizer; the target folder ships its own, {own!r}" if own is not None else "")
    return (f"tokenizer {data.tokenizer!r}{f' ({why})' if why else ''}: {n_vocab} ids, target {model.target!r}: "
            f"vocab_size {vocab}, mask_id {model.mask_id}")


def bucket_edges(config: Config, lengths: np.ndarray, store_key: str | None = None,
                 queries: np.ndarray | None = None) -> list[int]:
    """Bucket upper edges (tokens) for the bucketed sampler: `plan` (a plan.json) if set, else `edges`, else
    the optimal edges for these lengths (`plan.buckets.optimal_boundaries` with the buckets section's settings;
    given the samples' drafter `queries` (N,), priced under the resolved block budget too, as the sampler fills).
    `store_key`: the key of the token store the lengths come from; a plan made for a store of another key is
    refused (ConfigError naming both corpora and how to use its edges anyway)."""
    sc, bc = config.sampler, config.buckets
    if sc.plan:
        path = Path(sc.plan)
        if not path.is_file():
            raise ConfigError(f"plan {str(path)!r}: no such file (a plan.json written by notebook 02)")
        plan = BucketPlan.from_json(path.read_text())
        made_for = (plan.corpus or {}).get("store_key")
        if store_key is not None and made_for is not None and made_for != store_key:
            raise ConfigError(f"plan {str(path)!r} was made for another corpus: {plan.corpus.get('source')!r} (token "
                              f"store {made_for}), this run reads {config.data.source!r} (token store {store_key}); "
                              f"plan this corpus with notebook 02, or take those edges anyway: -p plan '' -p edges "
                              f"'{json.dumps(list(plan.edges))}'")
        return list(plan.edges)
    if sc.edges:
        return list(sc.edges)
    q = SampleCost(bc.cost, bc.q).q
    blocks = (None if queries is None
              else samplers.resolve_block_budget(sc, bc, config.model, config.data.max_len))
    plan = optimal_boundaries(lengths, bc.k, max_len=config.data.max_len, objective=bc.objective, cost=bc.cost,
                              q=q, token_budget=sc.token_budget, multiple=bc.multiple, policy=config.data.policy,
                              queries=queries, block_budget=blocks)
    return list(plan.edges)


def static_batch_sizes(edges: Sequence[int], token_budget: int, q: float | None = None,
                       block_budget: int | None = None, lengths: np.ndarray | None = None,
                       queries: np.ndarray | None = None) -> list[int]:
    """Rows per batch of each bucket when every row is padded to its bucket's upper edge (`budget.fixed_batch_sizes`):
    the most rows whose cost (edge tokens, + edge^2 / q with a quadratic cost) fits the token budget and, given
    block_budget with the samples' `lengths` (N,) and drafter `queries` (N,), whose bucket's costliest samples
    fit the block budget."""
    budget = samplers.BatchBudget(TokenBudget(token_budget, q),
                                  None if block_budget is None else samplers.BlockBudget(block_budget))
    costliest = None
    if block_budget is not None and queries is not None:
        bucket = bucket_of(lengths, edges)  # (N,)
        costliest = [np.sort(queries[bucket == k])[::-1] for k in range(len(edges))]
    return samplers.fixed_batch_sizes(budget, edges, costliest)


def build_sampler(config: Config, lengths: np.ndarray, rank: int, world_size: int,
                  edges: Sequence[int], queries: np.ndarray | None = None) -> Any:
    """The batch sampler named by `sampler.strategy`, sharded for (rank, world_size). Given `queries` (N,),
    drafter query tokens per sample (`data.stats.store_drafter_queries`), every batch also stays within
    `sampler.resolve_block_budget` query tokens; None bounds target tokens only."""
    sc = config.sampler
    q = SampleCost(config.buckets.cost, config.buckets.q).q
    common = dict(seed=sc.sampler_seed, rank=rank, world_size=world_size)
    if queries is not None:
        budget = samplers.resolve_block_budget(sc, config.buckets, config.model, config.data.max_len)
        common |= dict(queries=queries, block_budget=budget)
    if sc.strategy == "sorted":
        return samplers.SortedStaticSampler(lengths, sc.token_budget, q=q, **common)
    if sc.strategy == "random":
        return samplers.RandomShuffleSampler(lengths, sc.token_budget, q=q, **common)
    if sc.strategy == "bucketed":
        sizes = None
        if sc.static_shapes:
            sizes = static_batch_sizes(edges, sc.token_budget, q, common.get("block_budget"), lengths, queries)
        return samplers.BucketedShuffleSampler(lengths, list(edges), sc.token_budget, q=q, batch_sizes=sizes,
                                               **common)
    return samplers.PackedSampler(lengths, sc.token_budget, window=sc.pack_window, **common)


def choose_draft_vocab(drafter: DFlashDrafter, store: Any) -> str:
    """Give `drafter` the draft vocabulary of its `store` (the training split): the draft_vocab_size tokens most
    often scored there (`draft_vocab.top_tokens`). Returns the log line with their coverage of the labels."""
    counts = scored_token_counts(store, drafter.cfg.vocab_size)
    ids = top_tokens(counts, drafter.cfg.draft_vocab_size)
    drafter.set_draft_vocab(ids.to(drafter.draft_ids.device))
    return (f"draft vocabulary: {len(ids)} of the target's {drafter.cfg.vocab_size} tokens, "
            f"{coverage(counts, ids):.2%} of the training split's {int(counts.sum())} scored labels")


def drafter_checkpointing(setting: str, device: torch.device, drafter_layers: int) -> int:
    """`drafter_checkpointing` resolved for `device` to the number of drafter layers recomputed in the backward
    (`config.checkpointed_layers`: "auto" = all on CUDA, none on CPU)."""
    return checkpointed_layers(setting, drafter_layers, torch.device(device).type)


def build_parts(config: Config, device: torch.device, data_shards: int = 0,
                data: TrainingData | None = None, source: TargetSource | None = None) -> TrainingParts:
    """Token store, sampler, target source(s) and a fresh drafter for `config` on `device`. The sampler is
    planned for `data_shards` = D shards (0 = the world size; a resume passes the checkpoint's D): every
    sampler step is D batches whatever the number of ranks that share them. `data`: the corpus already opened
    by `load_training_data` (None = open it here). `source`: the checked source (`target.open.check_target`, its
    engine's address and files from `target.open.engine_url`; None = the local target of `config`); the sources
    the feed runs come from `target.open.open_sources`. `train.target_parallel` fsdp (or auto resolving to it,
    decided from the target's config before a weight is read: `target.sharded.plan_target`) builds the target on
    the host and shards its decoder layers onto the device before the drafter is built on it."""
    if resolve_attention(config.model.drafter_attention, device) == "flex" and torch.device(device).type != "cuda":
        raise ConfigError(f"drafter_attention 'flex' trains only on CUDA (FlexAttention has no backward on "
                          f"{torch.device(device).type}); use 'blocks' (exact, any device) or 'auto'")
    dist = distributed.info()
    data = data if data is not None else load_training_data(config)
    source = source if source is not None else TargetSource(read_facts(config.model), engine=False)
    shards = data_shards if data_shards > 0 else dist.world_size
    # the global plan: rank r reads its shards
    sampler = build_sampler(config, data.lengths, 0, shards, data.edges, data.queries)
    dtype = torch.bfloat16 if uses_bf16(config.train.precision, device) else torch.float32  # frozen: no fp32 master
    if device.type == "cuda" and dist.world_size == 1 and torch.cuda.device_count() > 1:
        devices = [torch.device("cuda", i) for i in range(min(config.pipeline.target_workers,
                                                              torch.cuda.device_count()))]
    else:
        devices = [device]
    plan = plan_target(source.facts.hf, "replicate" if source.served else config.train.target_parallel,
                       dist.world_size, dtype, device_memory_bytes(device))
    replicas = devices if plan.parallel == "replicate" and not source.served else [device]
    targets = open_sources(config, source, replicas, dtype, plan.parallel)
    sharded = plan.parallel == "fsdp"
    shared = targets[0].target if sharded else targets[0]  # the model whose embedding and LM head the drafter shares
    torch.manual_seed(config.train.seed)
    drafter = drafter_kind(config.model.drafter_kind).build(
        config.model, shared, attention=config.model.drafter_attention,
        checkpointing=drafter_checkpointing(config.model.drafter_checkpointing, device, config.model.drafter_layers))
    if config.model.init_from:  # fine-tune a saved or exported drafter instead of the random init
        init_from(drafter, config.model.init_from)
    if config.model.draft_vocab:
        distributed.print0(choose_draft_vocab(drafter, data.store))
    if dist.world_size > 1:
        distributed.print0(plan.line)
    if sharded and config.pipeline.target_workers != 1:
        if config.train.target_parallel == "fsdp":
            raise ConfigError(f"target_parallel fsdp runs one target worker per rank (its forwards are collectives, "
                              f"in one order on every rank): pass -p target_workers 1, not "
                              f"{config.pipeline.target_workers}")
        distributed.print0(f"target_workers {config.pipeline.target_workers} -> 1: a sharded target's forwards are "
                           f"collectives, run by one worker per rank")
    return TrainingParts(data.store, data.lengths, sampler, targets, drafter, data.pad_id,
                         config.sampler.strategy == "packed", config.sampler.token_budget, data.edges, data.split,
                         data.full_store, shards, "fsdp" if sharded else "replicate")
