"""The frozen target sharded over the ranks with FSDP2 (`-p target_parallel fsdp`), for a target too large to sit
whole on every GPU beside the drafter.

`shard_layers`: each decoder layer a `fully_shard` unit, resharded after its forward, the next one prefetched;
embedding, final norm and LM head replicated. `load_sharded_target` builds it on the host and shards it layer by
layer (`plan_target` decides first); `ShardedTarget` runs as many feature passes on every rank, one at a time, on a
group of its own: docs/scale.md, "A target too large to sit whole beside the drafter: `-p target_parallel fsdp`".
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

import numpy as np
import torch
import torch.distributed as dist
import transformers

from dflash_lib.config import ConfigError, ModelConfig, reads_final_states
from dflash_lib.data.batch import Batch, collate_padded
from dflash_lib.models.masks import RealTokens
from dflash_lib.target.attention import IMPLEMENTATION, resolve_backend
from dflash_lib.target.local import TargetModel

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

TARGET_PARALLEL = ("replicate", "fsdp", "auto")  # `train.target_parallel`
AUTO_SHARE = 1 / 3  # auto shards a target whose weights exceed this share of one device's memory


@dataclass(frozen=True)
class TargetFootprint:
    """A target's parameters in the training dtype, read from its config alone (`target_footprint`)."""

    element_size: int  # bytes per element of the training dtype
    weights: int  # bytes of every parameter (tied ones once)
    replicated: int  # bytes of the parameters outside the decoder layers (embedding, final norm, LM head)
    layers: tuple[tuple[tuple[int, int], ...], ...]  # per decoder layer, per parameter: (dim-0 rows, elements/row)

    def shard_bytes(self, world_size: int) -> int:
        """Bytes of one rank's shards of every decoder layer: FSDP2 splits each parameter along dim 0 into W
        chunks and pads every rank's to the first chunk's ceil(rows / W) rows."""
        return self.element_size * sum(-(-rows // world_size) * per_row for layer in self.layers
                                       for rows, per_row in layer)

    def largest_layer(self) -> int:
        """Bytes of the largest decoder layer, whole."""
        return self.element_size * max((sum(rows * per_row for rows, per_row in layer) for layer in self.layers),
                                       default=0)

    def load_peak_bytes(self, world_size: int) -> int:
        """Bytes one device holds at most while `load_sharded_target` shards the target over `world_size` ranks:
        every layer's shard, the full layer being wrapped and the replicated parts (an upper bound: those are
        moved once every layer is sharded)."""
        return self.shard_bytes(world_size) + self.largest_layer() + self.replicated


def target_footprint(hf_cfg: transformers.PretrainedConfig, dtype: torch.dtype) -> TargetFootprint:
    """The footprint of `hf_cfg`'s causal LM in `dtype`, from the model built on the meta device (shapes only:
    no memory, no weight read). Buffers (the rotary tables: head_dim / 2 floats) are left out."""
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(hf_cfg)
    base = getattr(model, getattr(model, "base_model_prefix", "model"), None)
    if base is None or not hasattr(base, "layers"):
        raise ConfigError(f"target {type(model).__name__}: expected a decoder base model with `layers`")
    size = torch.empty((), dtype=dtype).element_size()
    in_layers = {id(p) for p in base.layers.parameters()}
    layers = tuple(tuple((p.shape[0] if p.dim() else 1, p[0].numel() if p.dim() else 1) for p in layer.parameters())
                   for layer in base.layers)
    params = list(model.parameters())  # tied weights once
    return TargetFootprint(size, size * sum(p.numel() for p in params),
                           size * sum(p.numel() for p in params if id(p) not in in_layers), layers)


def sharded_load_peak_bytes(hf_cfg: transformers.PretrainedConfig, world_size: int, dtype: torch.dtype) -> int:
    """`TargetFootprint.load_peak_bytes` of `hf_cfg`'s target in `dtype` over `world_size` ranks."""
    return target_footprint(hf_cfg, dtype).load_peak_bytes(world_size)


def resolve_target_parallel(setting: str, weights_bytes: int, device_bytes: int | None,
                            world_size: int) -> tuple[str, str]:
    """("replicate" | "fsdp", why) for `setting` ("replicate" | "fsdp" | "auto"). One process: replicate (there is
    nothing to shard over; an explicit fsdp is accepted and said so). auto: fsdp when the target's
    `weights_bytes` exceed AUTO_SHARE of `device_bytes` (one device's total memory; None = CPU: replicate)."""
    if setting not in TARGET_PARALLEL:
        raise ConfigError(f"target_parallel must be one of {list(TARGET_PARALLEL)}, got {setting!r}")
    gib = weights_bytes / 2**30
    if world_size == 1:
        return "replicate", f"one process: the target is whole here ({gib:.2f} GiB; target_parallel {setting})"
    if setting != "auto":
        return setting, f"target_parallel {setting} ({gib:.2f} GiB of weights)"
    if device_bytes is None:
        return "replicate", f"auto on CPU: replicated ({gib:.2f} GiB of weights)"
    shard = weights_bytes > AUTO_SHARE * device_bytes
    return ("fsdp" if shard else "replicate",
            f"auto: {gib:.2f} GiB of weights {'>' if shard else '<='} 1/3 of the device's "
            f"{device_bytes / 2**30:.1f} GiB")


@dataclass(frozen=True)
class TargetPlan:
    """How a run holds its target, decided from the config before a weight is read (`plan_target`)."""

    parallel: str  # "replicate" | "fsdp" (resolved, never "auto"); fsdp: built on the host, then sharded
    line: str  # the log line of a multi-rank run


def device_memory_bytes(device: torch.device) -> int | None:
    """Total memory of one CUDA device in bytes; None for the CPU (the auto rule then replicates)."""
    return torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else None


def plan_target(hf_cfg: transformers.PretrainedConfig, setting: str, world_size: int, dtype: torch.dtype,
                device_bytes: int | None) -> TargetPlan:
    """`resolve_target_parallel` for the target of `hf_cfg` trained in `dtype` (its bytes from `target_footprint`:
    no weight is loaded) and the log line (under fsdp with the device's peak while loading,
    `TargetFootprint.load_peak_bytes`). `device_bytes`: `device_memory_bytes` of the training device."""
    foot = target_footprint(hf_cfg, dtype)
    choice, why = resolve_target_parallel(setting, foot.weights, device_bytes, world_size)
    if choice == "replicate":
        return TargetPlan(choice, f"target replicated on every rank ({why})")
    peak = foot.load_peak_bytes(world_size) / 2**30
    return TargetPlan(choice,
                      f"target sharded over {world_size} ranks with FSDP2 ({why}): {len(foot.layers)} decoder "
                      f"layers, 1/{world_size} of each per rank; embedding, norm and LM head replicated (peak while "
                      f"loading ~{peak:.2f} GiB per device)")


class _FeatureForward(torch.nn.Module):
    """The FSDP2 root around one feature pass: its subtree is the target's decoder layers (no parameter of its
    own), its forward runs `run()` (a closure over the pass; nothing goes through the root's input handling)."""

    def __init__(self, target: TargetModel) -> None:
        super().__init__()
        self.layers = target.base.layers  # the same modules: FSDP2 finds their units under this root

    def forward(self, run: Callable[[], torch.Tensor]) -> torch.Tensor:
        return run()


def pass_depth(target: TargetModel, final: bool) -> int:
    """Decoder layers one feature pass runs: up to the deepest feature layer, or every layer when the pass also
    gives the final states (`final`: loss kl / ce+kl)."""
    return target.num_layers if final else max(target.layer_ids) + 1


def shard_layers(target: TargetModel, mesh: "DeviceMesh", final: bool = False) -> _FeatureForward:
    """FSDP2 over `target`'s decoder layers on `mesh` (the trainer's target group, or the dry run's fake one):
    `fully_shard` on each layer (moved to the mesh's device, 1/W kept, the full copy freed as it returns),
    resharded after its forward, layer i prefetching layer i + 1 while both are in the pass (`pass_depth`: a
    deeper layer never runs in training, and prefetched it would be gathered for nothing); then the root, a
    `_FeatureForward` over the layers only, so embedding, norm and LM head stay whole. Frozen weights: nothing is
    ever reduced. Returns the root: `root(lambda: target.context_features(...))` runs one pass."""
    from torch.distributed.fsdp import fully_shard  # only a sharded target needs it

    layers = list(target.base.layers)
    for layer in layers:
        fully_shard(layer, mesh=mesh, reshard_after_forward=True)
    upto = pass_depth(target, final)
    for layer, following in zip(layers[:upto - 1], layers[1:upto]):
        layer.set_modules_to_forward_prefetch([following])
    return fully_shard(_FeatureForward(target), mesh=mesh, reshard_after_forward=True)


class ShardedTarget:
    """A `TargetModel` whose decoder layers are sharded over the ranks of a torchrun group (see the module
    docstring). It answers `device`, `segments`, `context_features` and, built with `final` (loss kl / ce+kl),
    `context_features_and_final` like the target (the feed and the held-out evaluation call those; the
    zero-weight filler item runs no target); `target` is the plain model (embedding, LM head, config) that the
    drafter shares. Every pass is a collective: every rank must make the same number. Build it on every rank at
    the same point (it creates two process groups), with the same `final`. `device`: the training device (None = the target's); a target built
    on the host is moved there, its layers as they are sharded, the replicated parts after."""

    def __init__(self, target: TargetModel, timeout_s: float, device: torch.device | None = None,
                 final: bool = False) -> None:
        from torch.distributed.device_mesh import DeviceMesh  # only a sharded target needs it

        if not dist.is_initialized():
            raise ConfigError("target_parallel fsdp needs a torchrun process group (more than one rank)")
        timeout = _dt.timedelta(seconds=timeout_s)
        self.group = dist.new_group(timeout=timeout)  # the layers' all-gathers, and nothing else
        self.control = dist.new_group(backend="gloo", timeout=timeout)  # the feed threads' stop handshake
        self.target, self.world_size = target, dist.get_world_size()
        device = target.device if device is None else torch.device(device)
        mesh = DeviceMesh.from_group(self.group, device.type)
        self.final = final  # every pass runs every layer (`pass_depth`)
        self.root = shard_layers(target, mesh, final)
        move_outside_layers(target, device)  # after the layers: the device holds no full layer beside them
        self.lock = threading.Lock()  # one pass at a time on this rank (feed thread, held-out evaluation)
        self.left = False  # this rank's feed has left the handshake (or seen a peer leave)
        self.filler_batch = collate_padded([(np.zeros(1, np.int64), np.ones(1, np.uint8))], 0)  # 1 token

    @property
    def device(self) -> torch.device:
        return self.target.device

    @property
    def hf(self) -> transformers.PretrainedConfig:
        return self.target.hf

    @property
    def layer_ids(self) -> list[int]:
        return self.target.layer_ids

    @property
    def num_features(self) -> int:
        return self.target.num_features

    @property
    def num_layers(self) -> int:
        return self.target.num_layers

    @property
    def hidden_size(self) -> int:
        return self.target.hidden_size

    @property
    def vocab_size(self) -> int:
        return self.target.vocab_size

    @property
    def gather(self) -> bool:
        return self.target.gather

    @property
    def embed_tokens(self) -> torch.nn.Embedding:
        return self.target.embed_tokens  # replicated on every rank

    @property
    def lm_head(self) -> torch.nn.Linear:
        return self.target.lm_head  # replicated on every rank

    def segments(self, host_doc_ids: torch.Tensor) -> RealTokens:
        return self.target.segments(host_doc_ids)

    def close(self) -> None:
        """Nothing outside the process's memory: its process groups end with the run's (`distributed.destroy`)."""

    @torch.no_grad()
    def context_features(self, batch: Batch, segments: RealTokens | None = None) -> torch.Tensor:
        """`TargetModel.context_features` (C, F*H) with the layers all-gathered one at a time (a collective).
        Built with `final`: the pass of `context_features_and_final` at no row, so it gathers every layer as the
        other ranks' passes do."""
        if self.final:
            return self.context_features_and_final(batch, torch.empty(0, dtype=torch.long), segments)[0]
        with self.lock:
            return self.root(lambda: self.target.context_features(batch, segments))

    @torch.no_grad()
    def context_features_and_final(self, batch: Batch, rows: torch.Tensor,
                                   segments: RealTokens | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """`TargetModel.context_features_and_final`: ((C, F*H), (u, H)) at `rows` (u,), every layer all-gathered
        one at a time (a collective). ConfigError unless built with `final`: its passes would gather more layers
        than the other ranks' and the collectives would no longer pair."""
        if not self.final:
            raise ConfigError("this sharded target was built for loss ce (its passes gather the layers up to the "
                              "deepest feature layer only): build it with final=True for loss kl / ce+kl")
        with self.lock:
            return self.root(lambda: self.target.context_features_and_final(batch, rows, segments))

    def filler(self) -> None:
        """One feature pass on a 1-token document, its features dropped: a rank's pass without a batch."""
        self.context_features(self.filler_batch)

    def turn(self) -> bool:
        """Before a feed pass: every rank's feed agrees to go on (a gloo collective). False when another rank's
        feed has left: the caller stops at the same pass (the feed raises `pipeline.Stopped`)."""
        return not self._handshake(stop=False)

    def leave(self) -> None:
        """This rank's feed is done (end of stream, the pipeline closing, a failure): tell the other ranks' feeds
        once. Best effort: a dead peer's error is the one the trainer reports."""
        try:
            self._handshake(stop=True)
        except Exception:  # noqa: BLE001 - gloo words a dead peer in several types; it surfaces elsewhere
            pass

    def _handshake(self, stop: bool) -> bool:
        """True when a rank (this one included) says stop. After a stop it is never made again."""
        if self.left:
            return True
        flag = torch.tensor([float(stop)])  # (1,) on the host: the gloo group, no device sync
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.control)
        self.left = bool(flag.item() > 0)
        return self.left


def per_step_passes(data_shards: int, world_size: int) -> int:
    """Feature passes each rank runs per sampler step under a sharded target: the most shards a rank takes
    (`distributed.rank_shards`: rank 0's ceil(D / W)), one for a rank with none."""
    return max(1, -(-data_shards // world_size))


def move_outside_layers(target: TargetModel, device: torch.device) -> None:
    """Move every parameter and buffer of `target` outside its decoder layers (embedding, final norm, LM head,
    rotary tables) to `device`, in place in the modules: a weight tied under two names becomes one moved
    Parameter under both, and `target.device` (its embedding's) answers `device`."""
    inside = {id(m) for m in target.base.layers.modules()}
    moved: dict[int, torch.nn.Parameter] = {}  # id of a host Parameter -> its copy on the device
    for module in target.model.modules():
        if id(module) in inside:
            continue
        for name, p in list(module.named_parameters(recurse=False)):
            if id(p) not in moved:
                moved[id(p)] = torch.nn.Parameter(p.detach().to(device), requires_grad=p.requires_grad)
            setattr(module, name, moved[id(p)])  # the host copy is freed once no module holds it
        for name, buf in list(module.named_buffers(recurse=False)):
            setattr(module, name, buf.to(device))  # stays registered (persistent or not) as it was


def load_sharded_target(cfg: ModelConfig, device: torch.device, dtype: torch.dtype, timeout_s: float,
                        seed: int = 0, gather: bool = True, hf_cfg: Any = None) -> ShardedTarget:
    """The target of `cfg` built on the HOST in `dtype` (`TargetModel.from_model_config`; `seed` and `gather`
    and `hf_cfg` as there), then sharded onto the training `device` (`ShardedTarget`, with `final` when `cfg.loss` is not ce:
    kl / ce+kl read the final states): the device never holds it whole. The
    host model runs SDPA (flash-attn refuses a model on the CPU); the backend `cfg.attn_backend` resolves to on
    `device` is set once the weights are there."""
    backend = resolve_backend(cfg.attn_backend, device)  # refuses flash off CUDA, as a replicated target would
    host = TargetModel.from_model_config(dataclasses.replace(cfg, attn_backend="sdpa"), device="cpu", dtype=dtype,
                                         seed=seed, gather=gather, hf_cfg=hf_cfg)
    sharded = ShardedTarget(host, timeout_s, device, final=reads_final_states(cfg.loss))
    if backend != host.backend:
        host.model.set_attn_implementation(IMPLEMENTATION[backend])
        host.backend = backend
    return sharded
