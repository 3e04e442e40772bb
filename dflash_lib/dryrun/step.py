"""One training step of the real configuration under `FakeTensorMode`, measured: the models built with fake
weights as the trainer builds them on CUDA (`build_step_models`), the step's peak memory by category
(`StepMemTracker`) and its FLOPs by part (`FlopCounterMode` plus the stand-ins for what has no fake or CPU form:
FlexAttention, flash-linear-attention). docs/scale.md, "The paper scale, proven on a CPU: the dry run".
"""

from __future__ import annotations

import contextlib
import dataclasses
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
from dflash_lib.config import Config, ConfigError, reads_final_states
from dflash_lib.data.batch import Batch
from dflash_lib.models.drafters import DrafterKind, drafter_kind
from dflash_lib.models.attention import resolve_attention, sdpa_flop_mapping
from dflash_lib.models.layout import attention_work, build_layout
from dflash_lib.dryrun.balanced_experts import grouped_mm_flops, install_balanced_experts
from dflash_lib.train.build import drafter_checkpointing
from dflash_lib.train.step import build_optimizer
from dflash_lib.dryrun.fake_ranks import CommTally
from dflash_lib.target.local import TargetModel
from dflash_lib.target.sharded import shard_layers

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


@dataclass
class StepModels:
    """Target, drafter and optimizer of one measured configuration (fake when `mode` is set)."""

    target: Any  # TargetModel
    drafter: Any  # the drafter kind's module
    optimizer: tuple[torch.optim.Optimizer, ...]  # `train.step.build_optimizer`'s
    params: list[torch.nn.Parameter]  # the drafter's trainable parameters
    settings: StepSettings
    mode: FakeTensorMode | None  # None = real tensors
    features: Callable[..., torch.Tensor] | None = None  # the FSDP2-sharded feature pass; None = the target's own
    features_and_final: Callable[..., tuple[torch.Tensor, torch.Tensor]] | None = None  # its loss kl pass; None: own
    balanced_experts: int = 0  # MoE experts modules run by the balanced-routing stand-in (dryrun/balanced_experts.py)
    served: bool = False  # `target_engine vllm`: the features arrive from the engine; the rank holds embedding and head

    @property
    def held(self) -> list[torch.nn.Module]:
        """What a rank holds of the target: all of it (its shards when sharded), or the served target's shared
        embedding and LM head."""
        return [self.target.embed_tokens, self.target.lm_head] if self.served else [self.target]

    @property
    def context(self) -> contextlib.AbstractContextManager:
        return self.mode if self.mode is not None else contextlib.nullcontext()


def _fake_drafter(kind: DrafterKind, drafter_cfg: Any, fake_target: Any, hf_cfg: Any, mode: FakeTensorMode,
                  settings: StepSettings):
    """A drafter of `kind` with fake parameters on the fake target's device. Module.to() cannot move fake
    parameters (torch swaps them and refuses tensors the fake mode holds weak references to), and the drafter
    builds itself on its target's device: so it is built on the meta device against a meta twin of the target,
    then every parameter and buffer is replaced by a fake one of the same shape and dtype, and its target by the
    fake one."""
    with torch.device("meta"):
        twin = TargetModel(transformers.AutoModelForCausalLM.from_config(hf_cfg, dtype=settings.target_dtype),
                           fake_target.layer_ids)
        drafter = kind.module_class(drafter_cfg, twin, attention=settings.attention,
                                    checkpointing=settings.checkpointing)
    device = fake_target.device
    with mode:
        for module in drafter.modules():
            for name, p in list(module.named_parameters(recurse=False)):
                module.register_parameter(name, torch.nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device=device),
                                                                   requires_grad=p.requires_grad))
            for name, b in list(module.named_buffers(recurse=False)):
                persistent = name not in module._non_persistent_buffers_set  # (state_dict() would read meta tensors)
                module.register_buffer(name, torch.empty(b.shape, dtype=b.dtype, device=device), persistent=persistent)
    object.__setattr__(drafter, "target", fake_target)  # the drafter keeps its target as a plain attribute
    return drafter


def build_step_models(config: Config, hf_cfg: Any, settings: StepSettings, fake: bool, seed: int = 0,
                      mesh: Any = None) -> StepModels:
    """The target (features only), a fresh drafter and a fused AdamW whose state already exists (steady state).
    Fake: a mixture-of-experts target's experts that fake tensors cannot run get the balanced-routing stand-in;
    `mesh` (a fake process group's, `fake_ranks.fake_process_group`) shards the target with FSDP2 over it."""
    mc, tc = config.model, config.train
    kind = drafter_kind(mc.drafter_kind)
    ids = mc.target_layer_ids or None
    mode = FakeTensorMode() if fake else None
    features, features_and_final, balanced = None, None, 0
    served = mc.target_engine == "vllm"
    if served and (not fake or mesh is not None):
        raise ConfigError("a served target (target_engine vllm) is measured in fake mode and never sharded")
    if fake:
        target = TargetModel.fake(hf_cfg, mc.num_features, ids, mode, "cpu", settings.target_dtype)
        balanced = install_balanced_experts(target.model)
        drafter = _fake_drafter(kind, kind.config_class.from_model_config(mc, target), target, hf_cfg, mode, settings)
        if mesh is not None:
            with mode:
                root = shard_layers(target, mesh, reads_final_states(mc.loss))  # as the trainer does (`target.sharded`)

                def features(batch: Batch, segments: Any) -> torch.Tensor:  # one feature pass through the root
                    return root(lambda: target.context_features(batch, segments))

                def features_and_final(batch: Batch, rows: torch.Tensor, segments: Any):  # loss kl: every layer
                    return root(lambda: target.context_features_and_final(batch, rows, segments))
        if served:
            def features(batch: Batch, segments: Any) -> torch.Tensor:  # the engine's, copied onto the device
                return torch.empty(segments.num_real, target.num_features * target.hidden_size,
                                   dtype=settings.target_dtype, device=target.device)

            def features_and_final(batch: Batch, rows: torch.Tensor, segments: Any):  # loss kl: the engine's last
                final = torch.empty(rows.shape[0], target.hidden_size,  # layer too, normed here: (u, H)
                                    dtype=settings.target_dtype, device=target.device)
                return features(batch, segments), final
    else:
        target = TargetModel.from_hf_config(hf_cfg, mc.num_features, ids, "cpu", settings.target_dtype, seed)
        torch.manual_seed(seed)
        drafter = kind.build(mc, target, attention=settings.attention, checkpointing=settings.checkpointing)
    params = [p for p in drafter.parameters() if p.requires_grad]
    with mode if fake else contextlib.nullcontext():
        opt = build_optimizer(params, tc, torch.device("cuda"))  # the trainer's, fused as on a GPU
        for p in params:  # a zero-gradient step creates the state (AdamW's moments, Muon's momentum) and changes nothing
            p.grad = torch.zeros_like(p)
        for o in opt:
            o.step()
            o.zero_grad(set_to_none=True)
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


def flex_tiles(layout: Any, tile: int = FLEX_TILE, window: int = 0, causal: bool = False) -> int:
    """(query tile, key tile) pairs of 128 x 128 that FlexAttention's block mask keeps for this layout: a tile is
    computed when one of its queries may see one of its keys. Keys are [the C context entries ; the n*B block
    queries] (attention.flex_block_mask); `window` w > 0: a sliding layer's (query position p sees p - w < j, and
    j < p + w unless causal); `causal`: j <= p. Host numpy on the host layout."""
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
    blocks = np.arange(n) * B  # ... and its own block: the pairs (j, k) that `attention.position_mask` keeps
    for j in range(B):
        lo = max(0, j - window + 1) if window else 0
        hi = j + 1 if causal else min(B, j + window) if window else B
        for k in range(lo, hi):
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
def _flex_standin(tally: dict[tuple[int, bool], dict[str, int]]):
    """Route the drafter's `flex` backend to `_FlexAllocations` (plus the block mask's tile tables) meanwhile."""
    real = drafter_module.make_attend

    def make_attend(layout, backend, window=0, causal=False):
        if backend != "flex":
            return real(layout, backend, window, causal)
        calls = tally.setdefault((window, causal), {"forward": 0, "backward": 0})  # per layer kind
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
            for o in opt:
                o.step()
        for o in opt:
            o.zero_grad(set_to_none=True)

    # Memory and FLOPs in two passes: FlopCounterMode's module tracker buffers gradients in its hooks and would
    # add its own memory to the peak.
    tracker = StepMemTracker()
    tracker.track_external(*models.held, drafter, opt, *_tensors(dev_batch), *_tensors(dev_layout))
    flex: dict[tuple[int, bool], dict[str, int]] = {}  # (window, causal) -> the stand-in's calls
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

    tally = _FlopTally(drafter.cfg.draft_vocab_size or drafter.cfg.vocab_size)  # the head: V or N rows
    counters = {name: tally.counter() for name in ("target", "drafter", "backward")}
    flex: dict[tuple[int, bool], dict[str, int]] = {}  # (window, causal) -> the stand-in's calls
    comm = CommTally()
    linear["flops"] = 0
    with models.context, _flex_standin(flex), _linear_attention_standin(linear), comm:
        step(lambda name: counters[name])
    flex_flops = 0
    for (window, causal), calls in flex.items():  # per layer kind: the tiles its block mask keeps
        computed = (float(flex_tiles(layout, window=window, causal=causal) * FLEX_TILE ** 2) if window or causal
                    else pairs["computed"])
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


