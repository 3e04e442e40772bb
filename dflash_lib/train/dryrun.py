"""Dry run: one full training step of the REAL configuration under `FakeTensorMode`, for the worst-case batch of
every bucket of the plan and of the packed strategy, measured for memory and FLOPs before a GPU is rented.

    python -m dflash_lib dryrun --preset qwen3-8b [-p KEY VALUE]... [--device-gib 80] [--compare]
        [--world-size N [-p target_parallel replicate|fsdp|auto] [--link-gbs 450]]

What runs: the target (the published shapes `models/shapes.py` names: Qwen3-8B, -32B, -30B-A3B, -235B-A22B; a
local model folder's config.json; or the tiny target) and the drafter are built with fake weights (shapes,
dtypes, no memory), and one
step runs exactly as the trainer runs it on CUDA: target features in bf16 up to the deepest feature layer (every
layer and the final norm at the scored rows under loss kl / ce+kl, sharded or not), the
drafter in fp32 master weights under bf16 autocast with the attention backend and activation checkpointing that
`auto` resolves to on CUDA, the fused LM head + CE, backward, gradient clipping and a fused AdamW step whose state
exists before the step (steady state). The anchors and the drafter layout are built on the host from real
tensors, as the feed stage builds them.

Measured: `torch.distributed._tools.mem_tracker.MemTracker` (peak bytes, split into parameters, gradients,
optimizer state, activations, temporaries and inputs at the moment of the peak) and
`torch.utils.flop_counter.FlopCounterMode` (target forward, drafter layers, drafter attention, LM head + CE).

Worst-case batch of a bucket (lower, edge]: the most documents of `edge` tokens the token budget admits (the
bucketed sampler's fill rule), each holding as many anchors as it can (min(num_anchors, edge - 1)) until the
block budget (`sampler.resolve_block_budget`) is spent; the documents past it hold none. Anchors sit at the END
of each document: every query sees the longest context it can. Packed: one row of token_budget tokens holding
the most full-anchor documents the block budget allows, each as long as max_len and the row allow, the rest of
the row filled with documents that hold no anchor.

Where a fake-mode figure differs from a real CUDA run, and how it is accounted for:
- Fake tensors cannot live on a CUDA device on a CPU-only torch (autograd aborts the process), so the step runs on
  the fake CPU device in the same dtypes, under CPU bf16 autocast (it casts matmuls, linear layers and SDPA to
  bf16 as CUDA autocast does). SDPA dispatches to the CPU flash kernel; its FLOPs are counted with the same
  formulas as CUDA's flash / memory-efficient kernels, and its outputs (out, logsumexp) have the sizes of the
  CUDA kernels'.
- FlexAttention has no CPU backward, not even under fake tensors. For `flex` the dry run stands in an op with
  FlexAttention's allocations (out, logsumexp, the backward's dq, dk, dv and row sums, the block mask's int32
  tile tables) and counts the FLOPs of the 128 x 128 tiles the block mask keeps (computed on the host from the
  layout, exactly as `create_block_mask` would mark them; a sliding drafter layer's: those its window keeps). A compiled `create_block_mask` on CUDA never builds
  the dense (Q, K) grid, so none is counted.
- The `dense` backend on CUDA runs the memory-efficient SDPA kernel, which pads a copy of the additive mask to a
  multiple of 16 keys: one (Q, K) bf16 mask per call is added as `kernel_allowance`.
- Not seen by any tracker: the CUDA context and cuBLAS/NCCL workspaces (about 0.5-1 GiB, plus NCCL buffers under
  DDP) and the caching allocator's fragmentation. A device fits a batch when
  peak x (1 + fragmentation) + kernel_allowance + reserve_gib <= device_gib (defaults 10 % and 1.5 GiB).
- Tracker artefacts: FlopCounterMode's module tracker holds gradients in its hooks (~10 GiB at the paper's shapes),
  so FLOPs are counted in a second pass, never in the one whose memory is measured; MemTracker's per-module peaks
  (unused) are skipped for speed and its gradient hooks go on trainable modules only (`StepMemTracker`).
- A mixture-of-experts target: transformers' grouped_mm experts run as they are (routing-independent shapes;
  their FLOPs by `balanced_experts.grouped_mm_flops`, which FlopCounterMode lacks); experts that route with
  data-dependent shapes get the BALANCED-routing stand-in of `train/balanced_experts.py`.
Step time is projected from the counted FLOPs (activation recomputation included) at a stated MFU of the H200's
dense bf16 peak (989 TFLOP/s); the ETA costs every batch of an epoch as its bucket's worst case (an upper bound).

Several ranks (`--world-size N`, `Ranks`): the step is rank 0's, every rank running its own worst batch. With
`target_parallel` fsdp the target is sharded by FSDP2's real `fully_shard` under torch's fake process group
(`train/fake_ranks.py`: per decoder layer, the next layer prefetched; embedding and LM head whole), so the peak
holds 1/N of the layers and the gathered buffers in flight, and the step's all-gathers are counted as issued.
The drafter is replicated under DDP (its memory is the one-rank figure; its fp32 gradients, all-reduced once per
step, are counted from its parameters). The collectives are costed as ring algorithms at `--link-gbs` per GPU
(default NVLink 4, 450 GB/s one way) and added to the compute time, not overlapped: an upper bound.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np
import torch
import transformers
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed._tools.mem_tracker import MemTracker
from torch.utils.flop_counter import FlopCounterMode

import dflash_lib.models.drafter as drafter_module
from dflash_lib.models import linear_attention
from dflash_lib.config import Config, ConfigError, from_params, reads_final_states
from dflash_lib.data import build_token_store_from_config
from dflash_lib.data.batch import Batch, collate_packed, collate_padded
from dflash_lib.data.stats import store_drafter_queries
from dflash_lib.models import DFlashDrafter, DrafterConfig, TargetModel
from dflash_lib.models.attention import resolve_attention, sdpa_flop_mapping
from dflash_lib.models.layout import attention_work, build_layout
from dflash_lib.models.target import target_hf_config
from dflash_lib.plan.buckets import SampleCost
from dflash_lib.plan.sampler import resolve_block_budget
from dflash_lib.plan.sampler.budget import TokenBudget
from dflash_lib.rundir import JsonRecord, load_config, omitted
from dflash_lib.train.balanced_experts import grouped_mm_flops, install_balanced_experts
from dflash_lib.train.build import bucket_edges, build_sampler, drafter_checkpointing
from dflash_lib.train.fake_ranks import CommTally, LayerRuns, fake_process_group, local_bytes
from dflash_lib.train.target_shard import resolve_target_parallel, shard_layers, target_footprint

GIB = 2 ** 30
H200_BF16_TFLOPS = 989.0  # dense bf16 peak of an H200 SXM (TFLOP/s)
NVLINK4_GBS = 450.0  # NVLink 4 per GPU, one direction (GB/s; H100/H200 SXM: 18 links, 900 GB/s both ways)
PAPER_SAMPLES = 800_000  # docs/dflash.md: the paper's training set, ~800K samples
FLEX_TILE = 128  # FlexAttention's block-mask tile (queries and keys)
aten = torch.ops.aten


# -- the device the run is for -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class StepSettings:
    """How the trainer runs one step on the emulated device (`for_cuda`)."""

    attention: str  # drafter attention backend: dense | blocks | flex
    checkpointing: int  # drafter layers recomputed in the backward (the first ones; activation checkpointing)
    target_dtype: torch.dtype = torch.bfloat16  # the frozen target's weights and features
    autocast: bool = True  # drafter under bf16 autocast over fp32 master weights


def for_cuda(config: Config) -> StepSettings:
    """What `build.build_parts` resolves on a CUDA device: `auto` attention and checkpointing, bf16 target."""
    mc = config.model
    return StepSettings(resolve_attention(mc.drafter_attention, "cuda"),
                        drafter_checkpointing(mc.drafter_checkpointing, torch.device("cuda"), mc.drafter_layers))


@dataclass(frozen=True)
class Reserve:
    """What no tracker sees on a real device (module docstring)."""

    reserve_gib: float = 1.5  # CUDA context, cuBLAS workspaces, NCCL buffers (GiB)
    fragmentation: float = 0.10  # caching-allocator overhead as a fraction of the measured peak

    def required_bytes(self, peak: float, kernel_allowance: float = 0.0) -> float:
        return peak * (1.0 + self.fragmentation) + kernel_allowance + self.reserve_gib * GIB


@dataclass(frozen=True)
class Ranks:
    """The ranks the step runs on (`--world-size`) and how the frozen target is laid over them."""

    world_size: int = 1  # data-parallel ranks (GPUs), each running its own worst batch
    target_parallel: str = "replicate"  # "replicate" (whole target on every rank) | "fsdp" (FSDP2 per layer) |
    # "served" (`target_engine vllm`: an engine elsewhere runs it; a rank holds its embedding and LM head only)
    link_gbs: float = NVLINK4_GBS  # per-GPU interconnect bandwidth, one direction (GB/s)

    def __post_init__(self) -> None:
        if self.world_size < 1 or self.link_gbs <= 0:
            raise ConfigError(f"world size must be >= 1 and link bandwidth > 0, got {self.world_size}, "
                              f"{self.link_gbs} GB/s")
        if self.target_parallel not in ("replicate", "fsdp", "served"):
            raise ConfigError(f"target_parallel must be replicate, fsdp or served here, got {self.target_parallel!r}")

    @property
    def sharded(self) -> bool:
        return self.target_parallel == "fsdp" and self.world_size > 1

    def comm_seconds(self, comm: dict[str, int]) -> float:
        """Seconds the step's collectives take over ring algorithms at link_gbs, none of it overlapped with
        compute (an upper bound: FSDP's prefetch and DDP's bucketed all-reduce hide much of it): an all-gather or
        a reduce-scatter moves (N-1)/N of its full buffer through each GPU's link, an all-reduce twice that."""
        n = self.world_size
        if n == 1:
            return 0.0
        moved = (n - 1) / n * (comm.get("all_gather", 0) + comm.get("reduce_scatter", 0)
                                + 2 * comm.get("all_reduce", 0))
        return moved / (self.link_gbs * 1e9)


# -- worst-case batches --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class WorstBatch:
    """The costliest micro-batch a bucket (or the packer) can produce: documents and the anchors of each."""

    label: str  # "bucket i" or "packed"
    bucket: int  # bucket index, -1 for packed
    lower: int  # exclusive lower edge (tokens)
    edge: int  # inclusive upper edge (tokens)
    lengths: tuple[int, ...]  # tokens of each document
    anchors: tuple[int, ...]  # anchors of each document (its valid anchor positions, all drawn)
    block_size: int  # B
    row_len: int = 0  # packed: tokens of the row; 0 = padded, one document per row

    @property
    def docs(self) -> int:
        return len(self.lengths)

    @property
    def target_tokens(self) -> int:
        """Token slots of the batch (padding included); the target runs only the real ones, sum(lengths)."""
        return self.row_len if self.row_len else self.docs * max(self.lengths)

    @property
    def drafter_queries(self) -> int:
        """Drafter query tokens, anchors x block_size."""
        return sum(self.anchors) * self.block_size


def _fill_anchors(n: int, per_doc: int, block_size: int, block_budget: int | None) -> list[int]:
    """Anchors of n documents that can hold `per_doc` each: the first ones full until the block budget (query
    tokens) is spent, one partial, the rest none."""
    left = math.inf if block_budget is None else block_budget // block_size  # anchors the budget allows
    out = []
    for _ in range(n):
        a = int(min(per_doc, left))
        out.append(a)
        left -= a
    return out


def worst_bucket_batch(bucket: int, lower: int, edge: int, config: Config, block_budget: int | None) -> WorstBatch:
    """The worst batch of bucket (lower, edge] (module docstring): rows from the token budget's fill rule."""
    sc, mc = config.sampler, config.model
    q = SampleCost(config.buckets.cost, config.buckets.q).q
    n = int(TokenBudget(sc.token_budget, q).sizing.capacity(edge))
    if n < 1:
        raise ConfigError(f"bucket {bucket} ({lower}, {edge}]: not one document of {edge} tokens fits token_budget "
                          f"{sc.token_budget}")
    anchors = _fill_anchors(n, min(mc.num_anchors, edge - 1), mc.block_size, block_budget)
    return WorstBatch(f"bucket {bucket}", bucket, lower, edge, (edge,) * n, tuple(anchors), mc.block_size)


def worst_packed_batch(config: Config, block_budget: int | None) -> WorstBatch:
    """One packed row of token_budget tokens with the worst mix (module docstring)."""
    T, L, mc = config.sampler.token_budget, config.data.max_len, config.model
    most = max(1, T // (mc.num_anchors + 1))  # documents the row holds at num_anchors anchors each
    anchors = [a for a in _fill_anchors(most, mc.num_anchors, mc.block_size, block_budget) if a > 0] or [0]
    length = min(L, T // len(anchors))  # as long as the row allows: later anchors, longer contexts
    lengths, anchors = [length] * len(anchors), [min(a, length - 1) for a in anchors]
    rest = T - sum(lengths)
    while rest >= 2:  # filler documents: one assistant token each, no anchor
        lengths.append(min(L, rest))
        anchors.append(0)
        rest -= lengths[-1]
    return WorstBatch("packed", -1, 0, L, tuple(lengths), tuple(anchors), mc.block_size, row_len=T)


def host_batch(worst: WorstBatch, vocab_size: int, mask_id: int, pad_id: int = 0, seed: int = 0) -> Batch:
    """Real host tensors of `worst`: random tokens; the loss mask set on the last anchors + 1 tokens of each
    document (exactly `anchors` valid anchor positions, at the end; one assistant token when it holds none)."""
    rng = np.random.default_rng(seed)
    high = min(vocab_size, mask_id) if mask_id > 0 else vocab_size
    samples = []
    for length, a in zip(worst.lengths, worst.anchors):
        tokens = rng.integers(0, high, length)
        mask = np.zeros(length, dtype=bool)
        mask[length - max(a + 1, 1):] = True
        samples.append((tokens, mask))
    if worst.row_len:
        return collate_packed(samples, pad_id, worst.row_len)
    return collate_padded(samples, pad_id, bucket=worst.bucket)


# -- the models, real or fake ---------------------------------------------------------------------------------------


@dataclass
class StepModels:
    """Target, drafter and optimizer of one measured configuration (fake when `mode` is set)."""

    target: Any  # TargetModel
    drafter: Any  # DFlashDrafter
    optimizer: torch.optim.Optimizer
    params: list[torch.nn.Parameter]  # the drafter's trainable parameters
    settings: StepSettings
    mode: FakeTensorMode | None  # None = real tensors
    features: Callable[..., torch.Tensor] | None = None  # the FSDP2-sharded feature pass; None = the target's own
    features_and_final: Callable[..., tuple[torch.Tensor, torch.Tensor]] | None = None  # its loss kl pass; None: own
    balanced_experts: int = 0  # MoE experts modules run by the balanced-routing stand-in (train/balanced_experts.py)
    served: bool = False  # `target_engine vllm`: the features arrive from the engine; the rank holds embedding and head

    @property
    def held(self) -> list[torch.nn.Module]:
        """What a rank holds of the target: all of it (its shards when sharded), or the served target's shared
        embedding and LM head."""
        return [self.target.embed_tokens, self.target.lm_head] if self.served else [self.target]

    @property
    def context(self) -> contextlib.AbstractContextManager:
        return self.mode if self.mode is not None else contextlib.nullcontext()


def _fake_drafter(drafter_cfg: Any, fake_target: Any, hf_cfg: Any, mode: FakeTensorMode, settings: StepSettings):
    """A DFlashDrafter with fake parameters on the fake target's device. Module.to() cannot move fake parameters
    (torch swaps them and refuses tensors the fake mode holds weak references to), and DFlashDrafter moves itself
    to its target's device: so it is built on the meta device against a meta twin of the target, then every
    parameter and buffer is replaced by a fake one of the same shape and dtype, and its target by the fake one."""
    with torch.device("meta"):
        twin = TargetModel(transformers.AutoModelForCausalLM.from_config(hf_cfg, dtype=settings.target_dtype),
                           fake_target.layer_ids)
        drafter = DFlashDrafter(drafter_cfg, twin, attention=settings.attention, checkpointing=settings.checkpointing)
    device = fake_target.device
    with mode:
        for module in drafter.modules():
            for name, p in list(module.named_parameters(recurse=False)):
                module.register_parameter(name, torch.nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device=device),
                                                                   requires_grad=p.requires_grad))
            for name, b in list(module.named_buffers(recurse=False)):
                persistent = name in module.state_dict()
                module.register_buffer(name, torch.empty(b.shape, dtype=b.dtype, device=device), persistent=persistent)
    object.__setattr__(drafter, "target", fake_target)  # DFlashDrafter keeps its target as a plain attribute
    return drafter


def build_step_models(config: Config, hf_cfg: Any, settings: StepSettings, fake: bool, seed: int = 0,
                      mesh: Any = None) -> StepModels:
    """The target (features only), a fresh drafter and a fused AdamW whose state already exists (steady state).
    Fake: a mixture-of-experts target's experts that fake tensors cannot run get the balanced-routing stand-in;
    `mesh` (a fake process group's, `fake_ranks.fake_process_group`) shards the target with FSDP2 over it."""
    mc, tc = config.model, config.train
    ids = mc.target_layer_ids or None
    mode = FakeTensorMode() if fake else None
    features, features_and_final, balanced = None, None, 0
    served = mc.target_engine == "vllm"
    if served and (not fake or mesh is not None):
        raise ConfigError("a served target (target_engine vllm) is measured in fake mode and never sharded")
    if fake:
        target = TargetModel.fake(hf_cfg, mc.num_features, ids, mode, "cpu", settings.target_dtype)
        balanced = install_balanced_experts(target.model)
        drafter = _fake_drafter(DrafterConfig.from_model_config(mc, target), target, hf_cfg, mode, settings)
        if mesh is not None:
            with mode:
                root = shard_layers(target, mesh, reads_final_states(mc.loss))  # as the trainer does (`target_shard`)

                def features(batch: Batch, segments: Any) -> torch.Tensor:  # one feature pass through the root
                    return root(lambda: target.context_features(batch, segments))

                def features_and_final(batch: Batch, rows: torch.Tensor, segments: Any):  # loss kl: every layer
                    return root(lambda: target.context_features_and_final(batch, rows, segments))
        if served:
            def features(batch: Batch, segments: Any) -> torch.Tensor:  # the engine's, copied onto the device
                return torch.empty(segments.num_real, target.num_features * target.hidden_size,
                                   dtype=settings.target_dtype, device=target.device)
    else:
        target = TargetModel.from_hf_config(hf_cfg, mc.num_features, ids, "cpu", settings.target_dtype, seed)
        torch.manual_seed(seed)
        drafter = DFlashDrafter(DrafterConfig.from_model_config(mc, target), target, attention=settings.attention,
                                checkpointing=settings.checkpointing)
    params = [p for p in drafter.parameters() if p.requires_grad]
    with mode if fake else contextlib.nullcontext():
        opt = torch.optim.AdamW(params, lr=tc.lr, weight_decay=tc.weight_decay, fused=True)
        for p in params:  # a zero-gradient step creates the state (exp_avg, exp_avg_sq, step) and changes nothing
            p.grad = torch.zeros_like(p)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return StepModels(target, drafter, opt, params, settings, mode, features, features_and_final, balanced, served)


# -- measurement ---------------------------------------------------------------------------------------------------


class StepMemTracker(MemTracker):
    """MemTracker that installs its gradient hooks only on modules whose parameters all train (it would register a
    hook on the frozen target's weights, which torch refuses), and keeps only the global peak per op: its
    per-module peaks, unused here, cost a pass over every module seen (~500 for an 8B target) after every op."""

    def _track_module_params_and_buffers(self, module: torch.nn.Module, install_grad_hooks: bool = True):
        trainable = all(p.requires_grad for p in module.parameters())
        return super()._track_module_params_and_buffers(module, install_grad_hooks and trainable)

    def _update_peak_stats(self, peak_state: Any) -> None:
        for dev, snap in self._curr_mem_snap.items():
            if self._peak_mem.get(dev, 0) < snap["Total"]:
                self._peak_mem[dev] = snap["Total"]
                self._peak_mem_snap[dev] = dict(snap)


class _Root(torch.nn.Module):
    """One module around the forward: MemTracker refuses a module called twice at the top level (the shared
    embedding, the rotary table), but not inside a parent."""

    def forward(self, fn: Callable[[], Any]) -> Any:
        return fn()


class _FlopTally:
    """FlopCounterMode with torch's formulas plus the CPU flash-attention kernels' (`sdpa_flop_mapping`: torch's table
    has only the CUDA ones), and a tally of the matmul FLOPs with a vocabulary-sized dimension (the LM head) for the split."""

    def __init__(self, vocab_size: int):
        self.vocab, self.head = vocab_size, 0

    def _matmul(self, dims: Sequence[int], flops: int) -> int:
        if self.vocab in dims:
            self.head += flops
        return flops

    def counter(self) -> FlopCounterMode:
        mm = lambda a, b, *_, out_shape=None, **__: self._matmul((*a, *b), 2 * a[0] * a[1] * b[1])  # noqa: E731
        addmm = lambda s, a, b, *_, out_shape=None, **__: self._matmul((*a, *b), 2 * a[0] * a[1] * b[1])  # noqa: E731
        bmm = lambda a, b, *_, out_shape=None, **__: self._matmul((*a, *b), 2 * a[0] * a[1] * a[2] * b[2])  # noqa: E731
        return FlopCounterMode(display=False, custom_mapping={aten.mm: mm, aten.addmm: addmm, aten.bmm: bmm,
                                                              aten._grouped_mm: grouped_mm_flops,  # MoE experts
                                                              **sdpa_flop_mapping()})


def _attention_flops(counter: FlopCounterMode) -> int:
    return sum(v for op, v in counter.get_flop_counts().get("Global", {}).items() if "attention" in str(op))


def flex_tiles(layout: Any, tile: int = FLEX_TILE, window: int = 0) -> int:
    """(query tile, key tile) pairs of 128 x 128 that FlexAttention's block mask keeps for this layout: a tile is
    computed when one of its queries may see one of its keys. Keys are [the C context entries ; the n*B block
    queries] (attention.flex_block_mask); `window` w > 0: a sliding layer's (query position p sees p - w < j <= p).
    Host numpy on the host layout."""
    B, n = layout.block_size, layout.num_blocks
    ctx_doc = layout.ctx_doc.numpy()
    C, Q = len(ctx_doc), n * B
    real = np.flatnonzero(ctx_doc >= 0)
    first = np.full(int(ctx_doc.max()) + 1 if real.size else 0, -1, dtype=np.int64)
    docs, at = np.unique(ctx_doc[real], return_index=True)
    first[docs] = real[at]  # context entry of each document's first token
    doc, anchor = layout.block_doc.numpy(), layout.anchor_pos.numpy()
    lo = first[doc]  # (n,) the visible context of block i: [lo, lo + anchor) ...
    hi = lo + anchor
    grid = np.zeros((-(-Q // tile), -(-(C + Q) // tile)), dtype=bool)  # (query tiles, key tiles)
    for i in range(n):
        for qt in range((i * B) // tile, (i * B + B - 1) // tile + 1):  # the block's queries in this query tile
            j0 = max(0, qt * tile - i * B)  # the first of them: it sees the most context
            start = lo[i] + (max(0, int(anchor[i]) + j0 - window + 1) if window else 0)
            if hi[i] > start:
                grid[qt, start // tile:(hi[i] - 1) // tile + 1] = True
    blocks = np.arange(n) * B  # ... and its own block: every pair of it (window: j - w < k <= j)
    for j in range(B):
        for k in range(max(0, j - window + 1), j + 1) if window else range(B):
            grid[(blocks + j) // tile, (C + blocks + k) // tile] = True
    return int(grid.sum())


class _FlexAllocations(torch.autograd.Function):
    """FlexAttention's allocations without its math (fake mode: it has no CPU backward). Forward: out (like q)
    and logsumexp (1, h, Q) fp32, both kept with q, k, v; backward: the row sums (1, h, Q) fp32, dq, dk, dv."""

    @staticmethod
    def forward(ctx, q, k, v, tally):
        out = torch.empty_like(q)
        lse = torch.empty(q.shape[:-1], dtype=torch.float32, device=q.device)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.tally = tally
        tally["forward"] += 1
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, out, lse = ctx.saved_tensors
        delta = torch.empty_like(lse)  # noqa: F841  (allocated by the kernel: sum(out * grad) per row)
        ctx.tally["backward"] += 1
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), None


@contextlib.contextmanager
def _flex_standin(tally: dict[int, dict[str, int]]):
    """Route the drafter's `flex` backend to `_FlexAllocations` (plus the block mask's tile tables) meanwhile."""
    real = drafter_module.make_attend

    def make_attend(layout, backend, window=0):
        if backend != "flex":
            return real(layout, backend, window)
        calls = tally.setdefault(window, {"forward": 0, "backward": 0})  # per window (0: full layers)
        Q, C = layout.num_queries, int(layout.ctx_doc.shape[0])
        qt, kt = -(-Q // FLEX_TILE), -(-(C + Q) // FLEX_TILE)
        dev = layout.block_doc.device
        tables = [torch.empty(1, 1, qt, kt, dtype=torch.int32, device=dev) for _ in range(4)]  # (kv, full) x (q, kv)

        def attend(q, kc, vc, kb, vb):
            tables  # noqa: B018  (the block mask lives as long as the attention that uses it)
            k, v = torch.cat([kc, kb], dim=2), torch.cat([vc, vb], dim=2)
            if torch.is_autocast_enabled(q.device.type):  # FlexAttention's autocast rule: q, k, v cast to its dtype
                dtype = torch.get_autocast_dtype(q.device.type)
                q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
            return _FlexAllocations.apply(q, k, v, calls)

        return attend

    drafter_module.make_attend = make_attend
    try:
        yield
    finally:
        drafter_module.make_attend = real


def _chunk_rule_allocations(tally: dict[str, int]) -> Callable:
    """flash-linear-attention's chunked delta rule over every document at once (what a hybrid target's linear
    layers run on CUDA) as its forward's allocations without its math: the grouped q, k repeated to the value heads,
    their l2-normed copies and inverse norms, the cumulative gates, the chunk matrix A (fp32, then inverted in the
    input dtype), w, u, the per-chunk states h (chunks, Hv, dk, dv), the new values and the output; its FLOPs
    (`chunk_rule_flops` per chunk and value head, a document's last chunk whole) added to `tally`."""

    def rule(query, key, value, g, beta, documents, cu_seqlens, fallback, **kwargs):
        (_, n, hv, dv), dk, dt, dev = value.shape, key.shape[-1], value.dtype, value.device
        chunks = sum(-(-(e - s) // linear_attention.CHUNK) for s, e in documents)
        empty = lambda *shape, dtype=dt: torch.empty(*shape, dtype=dtype, device=dev)  # noqa: E731
        repeated = [empty(1, n, hv, dk) for _ in range(2)] if hv != key.shape[2] else []  # noqa: F841
        normed = [empty(1, n, hv, dk) for _ in range(2)] + [empty(1, n, hv, dtype=torch.float32) for _ in range(2)]  # noqa: F841
        gates = empty(1, n, hv, dtype=torch.float32)  # noqa: F841
        a = empty(1, n, hv, linear_attention.CHUNK, dtype=torch.float32)
        inverse = empty(1, n, hv, linear_attention.CHUNK)  # noqa: F841
        del a
        w, u = empty(1, n, hv, dk), empty(1, n, hv, dv)  # noqa: F841
        states, new_values = empty(1, chunks, hv, dk, dv), empty(1, n, hv, dv)  # noqa: F841
        out = empty(1, n, hv, dv)  # written while all of the above are alive; they go when the kernel returns
        tally["flops"] += chunks * hv * linear_attention.chunk_rule_flops(dk, dv)
        return out

    return rule


@contextlib.contextmanager
def _linear_attention_standin(tally: dict[str, int]):
    """Run a hybrid target's linear-attention layers as CUDA runs them meanwhile: one padded convolution over the
    documents, and `_chunk_rule_allocations` for flash-linear-attention's kernel (it has no CPU or fake-tensor form)."""
    conv, rule = linear_attention.varlen_causal_conv, linear_attention.varlen_rule
    linear_attention.varlen_causal_conv = lambda x, w, b, act, documents, *_, **__: \
        linear_attention.padded_causal_conv(x, w, b, act, documents)
    linear_attention.varlen_rule = _chunk_rule_allocations(tally)
    try:
        yield
    finally:
        linear_attention.varlen_causal_conv, linear_attention.varlen_rule = conv, rule


@dataclass
class StepFigures:
    """One measured training step."""

    peak_bytes: int  # the step's peak, everything tracked
    memory: dict[str, int]  # bytes per category at the moment of the peak
    flops: dict[str, int]  # target_forward, drafter_layers, drafter_attention, head_ce
    kernel_allowance: int  # bytes a CUDA kernel adds that the fake CPU step does not hold (module docstring)
    attention_pairs: dict[str, float] = field(default_factory=dict)  # query-key pairs: allowed, computed (per head)
    seconds: float = 0.0  # wall time of the measured step on this machine
    comm: dict[str, int] = field(default_factory=dict)  # bytes of the step's collectives by kind (`CommTally`)
    gathered: int = 0  # all-gathered bytes of both measured passes (memory and FLOPs), the first one cold

    @property
    def flops_total(self) -> int:
        return sum(self.flops.values())


_CATEGORIES = {"Parameter": "parameters", "Buffer": "buffers", "Gradient": "gradients", "Optstate": "optimizer",
               "Activation": "activations", "Temp": "temporaries", "Other": "inputs"}


def _to_mode(obj: Any, mode: FakeTensorMode | None) -> Any:
    """Host tensors of a batch or layout (dataclasses, nested) as the step's device tensors (fake under `mode`)."""
    if mode is None:
        return obj
    if isinstance(obj, torch.Tensor):
        return mode.from_tensor(obj)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return dataclasses.replace(obj, **{f.name: _to_mode(getattr(obj, f.name), mode)
                                           for f in dataclasses.fields(obj) if f.init})
    return obj


def measure_step(models: StepModels, batch: Batch, seed: int = 0, count_flops: bool = True) -> StepFigures:
    """Run and measure one training step on host batch `batch` (anchors drawn with `seed`); `count_flops` False
    measures memory only (one pass; the figures' FLOPs are then zeros)."""
    s, target, drafter, opt = models.settings, models.target, models.drafter, models.optimizer
    anchors = drafter.sample_anchors(batch, torch.Generator().manual_seed(seed))
    layout = build_layout(batch, anchors, s.attention, target_rows=reads_final_states(drafter.cfg.loss))
    pairs = {}
    if s.attention in ("dense", "blocks"):
        pairs = {k: v for k, v in attention_work(layout, s.attention).items() if k != "ratio"}
    elif layout.num_blocks:
        pairs = dict(allowed=attention_work(layout, "dense")["allowed"],
                     computed=float(flex_tiles(layout) * FLEX_TILE * FLEX_TILE))
    allowance = 0
    if s.attention == "dense":  # the memory-efficient kernel's padded copy of the additive mask, one call at a time
        allowance = layout.num_queries * (-(-(layout.ctx_doc.numel() + layout.num_queries) // 16) * 16) * 2
    segments = target.segments(batch.doc_ids)  # host work of the target worker
    dev_batch, dev_layout = _to_mode(batch, models.mode), _to_mode(layout, models.mode)
    segments = _to_mode(segments, models.mode)  # its gather index, copied to the device as the worker copies it

    def step(phase: Callable[[str], contextlib.AbstractContextManager]) -> None:
        def forward():
            final = None  # loss kl / ce+kl: every target layer, (u, H) final-normed states at the target rows
            with phase("target"):
                if dev_layout.target_rows is None:
                    feats = (models.features or target.context_features)(dev_batch, segments)  # (C, F*H)
                else:
                    feats, final = (models.features_and_final or target.context_features_and_final)(
                        dev_batch, dev_layout.target_rows, segments)
            with phase("drafter"), torch.autocast("cpu", dtype=torch.bfloat16, enabled=s.autocast):
                return drafter.loss(dev_batch, feats, dev_layout, normalizer=layout.weight_sum,
                                    target_hidden=final), final

        out, held = _Root()(forward)  # `held`: the (u, H) states stay alive through the backward, as the
        with phase("backward"):  # trainer's Item keeps them
            out.loss.backward()
            torch.nn.utils.clip_grad_norm_(models.params, 1.0)
            opt.step()
        opt.zero_grad(set_to_none=True)

    # Memory and FLOPs in two passes: FlopCounterMode's module tracker buffers gradients in its hooks and would
    # add its own memory to the peak.
    tracker = StepMemTracker()
    tracker.track_external(*models.held, drafter, opt, *_tensors(dev_batch), *_tensors(dev_layout))
    flex: dict[int, dict[str, int]] = {}  # window -> the stand-in's calls
    first = CommTally()  # the all-gathers of the first pass: a model's first one starts with nothing gathered
    t0 = time.perf_counter()
    linear = {"flops": 0}  # the linear-attention stand-in's FLOPs (counted in the second pass)
    with models.context, tracker, first, _flex_standin(flex), _linear_attention_standin(linear), \
            warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Module is None")  # MemTracker: a module gone before its backward
        step(lambda name: contextlib.nullcontext())
    seconds = time.perf_counter() - t0
    (snap,) = tracker.get_tracker_snapshot("peak").values()
    memory = {_CATEGORIES[str(getattr(k, "value", k))]: int(v) for k, v in snap.items() if k != "Total"}
    if not count_flops:
        zero = dict.fromkeys(("target_forward", "drafter_layers", "drafter_attention", "head_ce"), 0)
        return StepFigures(int(snap["Total"]), memory, zero, allowance, pairs, seconds,
                           gathered=first.bytes.get("all_gather", 0))

    tally = _FlopTally(drafter.cfg.vocab_size)
    counters = {name: tally.counter() for name in ("target", "drafter", "backward")}
    flex: dict[int, dict[str, int]] = {}  # window -> the stand-in's calls
    comm = CommTally()
    linear["flops"] = 0
    with models.context, _flex_standin(flex), _linear_attention_standin(linear), comm:
        step(lambda name: counters[name])
    flex_flops = 0
    for window, calls in flex.items():  # per layer kind: the tiles its block mask keeps
        computed = pairs["computed"] if not window else float(flex_tiles(layout, window=window) * FLEX_TILE ** 2)
        per_forward = 4 * drafter.cfg.num_heads * drafter.cfg.head_dim * computed  # 2 matmuls per pair
        flex_flops += int(per_forward * calls["forward"] + 2.5 * per_forward * calls["backward"])  # backward: 5
    sdpa = _attention_flops(counters["drafter"]) + _attention_flops(counters["backward"])
    drafter_total = counters["drafter"].get_total_flops() + counters["backward"].get_total_flops()
    flops = dict(target_forward=counters["target"].get_total_flops() + linear["flops"], drafter_layers=drafter_total - sdpa - tally.head,
                 drafter_attention=sdpa + flex_flops, head_ce=tally.head)
    return StepFigures(int(snap["Total"]), memory, flops, allowance, pairs, seconds, dict(comm.bytes),
                       first.bytes.get("all_gather", 0) + comm.bytes.get("all_gather", 0))


def _tensors(obj: Any) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return [t for f in dataclasses.fields(obj) for t in _tensors(getattr(obj, f.name))]
    return []


# -- a plan: every bucket's worst batch, the packed row, projections --------------------------------------------------


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


def worst_batches(config: Config, edges: Sequence[int], block_budget: int | None) -> list[WorstBatch]:
    """Every bucket's worst batch for bucket upper edges `edges`, then the packed row's."""
    lowers = [0, *edges[:-1]]
    out = [worst_bucket_batch(i, lo, e, config, block_budget) for i, (lo, e) in enumerate(zip(lowers, edges))]
    return out + [worst_packed_batch(config, block_budget)]


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
    `world_size` ranks with the target laid over them by `train.target_parallel` (`target_shard.resolve_target_parallel`),
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
        return head + (f"BALANCED routing assumed in {balanced} MoE layers (train/balanced_experts.py: every expert "
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
