"""The frozen target sharded over the ranks with FSDP2 (`-p target_parallel fsdp`), for a target too large to sit
whole on every GPU beside the drafter.

What is sharded: each decoder layer is one `fully_shard` unit (its weights 1/W per rank), all-gathered in its
forward and resharded right after it (`reshard_after_forward=True`); each layer's forward prefetches the next
layer's all-gather EXPLICITLY (`set_modules_to_forward_prefetch`), so on CUDA the all-gather of layer i+1 runs
while layer i computes. `embed_tokens`, the final norm and `lm_head` stay replicated: the drafter shares the
embedding and the LM head and calls them on its own, outside any target forward. Their cost per rank is
(V x H) x 2 (untied) in the target's dtype, e.g. 2 x 151936 x 4096 x 2 bytes = 2.5 GB for Qwen3-235B-A22B beside
its 1/W share of ~470 GB of layers. The target is still LOADED whole on each rank first (the loader fills a full
model), so a target that does not fit one device alone cannot be loaded yet: the sharding frees the room that the
drafter, its optimizer and the activations need.

`TargetModel` calls its layers one by one, not through a root forward. FSDP2 hooks each unit's own `forward`, so
the layers all-gather and reshard when called directly; the root unit (`_FeatureForward`, whose subtree is the
decoder layers only, so it holds no parameter of its own) is entered around every feature pass, which is what
lets FSDP2 initialise the layers as one tree with one set of streams.

Collectives must pair across ranks. A forward's all-gathers carry the layers' weights, never the batch: every
feature pass all-gathers the same layers in the same order, whatever its tokens. So the ranks stay paired as long
as (1) every rank runs the same NUMBER of feature passes, and (2) a rank never interleaves two passes. (1): the
feed runs `ceil(D / W)` passes per sampler step on every rank (a filler, a 1-token document, for a shard the rank
does not have or a batch whose samples all failed validation: `feed.make_target_workers`), the zero-weight filler
item of a multi-rank run is built on every rank, and under a sharded target every rank runs the held-out
evaluation. (2): a lock around each pass (the feed thread's passes and the held-out evaluation's, in the trainer
thread).

Process groups: the passes run in the FEED thread while the drafter's DDP/FSDP reductions run in the trainer
thread. Two threads issuing collectives on one group can enqueue them in another order on each rank (a deadlock,
and NCCL requires one order per group), so the target gets a group of its own (`dist.new_group`, created by every
rank in the same order when the parts are built, before any other thread starts) and its DeviceMesh is made
from it. A second, gloo, group carries the feed's stop handshake: before each pass the ranks' feed threads agree
to go on (one float, max-reduced), and a feed thread that leaves (end of stream, the trainer closing the
pipeline, a failure) says so once, so the other ranks' feed threads stop at the same pass instead of waiting for
an all-gather that never comes. One feed thread per rank (`pipeline.target_workers` 1): two would issue passes
in an order of their own.
"""

from __future__ import annotations

import datetime as _dt
import threading
from typing import Any, Callable

import numpy as np
import torch
import torch.distributed as dist

from dflash_lib.config import ConfigError
from dflash_lib.data.batch import Batch, collate_padded
from dflash_lib.models.masks import RealTokens
from dflash_lib.models.target import TargetModel
from dflash_lib.train.pipeline import Stopped

TARGET_PARALLEL = ("replicate", "fsdp", "auto")  # `train.target_parallel`
AUTO_SHARE = 1 / 3  # auto shards a target whose weights exceed this share of one device's memory


def target_bytes(target: TargetModel) -> int:
    """Bytes of the target's parameters in their (training) dtype."""
    return sum(p.numel() * p.element_size() for p in target.parameters())


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


class _FeatureForward(torch.nn.Module):
    """The FSDP2 root around one feature pass: its subtree is the target's decoder layers (no parameter of its
    own), its forward runs `run()` (a closure over the pass; nothing goes through the root's input handling)."""

    def __init__(self, target: TargetModel) -> None:
        super().__init__()
        self.layers = target.base.layers  # the same modules: FSDP2 finds their units under this root

    def forward(self, run: Callable[[], torch.Tensor]) -> torch.Tensor:
        return run()


class ShardedTarget:
    """A `TargetModel` whose decoder layers are sharded over the ranks of a torchrun group (see the module
    docstring). It answers `device`, `segments` and `context_features` like the target (the feed, the filler
    item and the held-out evaluation call those); `target` is the plain model (embedding, LM head, config) that
    the drafter shares. Every call of `context_features` is a collective: every rank must make the same number.
    Build it on every rank at the same point (it creates two process groups)."""

    def __init__(self, target: TargetModel, timeout_s: float) -> None:
        from torch.distributed.device_mesh import DeviceMesh  # only a sharded target needs them
        from torch.distributed.fsdp import fully_shard

        if not dist.is_initialized():
            raise ConfigError("target_parallel fsdp needs a torchrun process group (more than one rank)")
        timeout = _dt.timedelta(seconds=timeout_s)
        self.group = dist.new_group(timeout=timeout)  # the layers' all-gathers, and nothing else
        self.control = dist.new_group(backend="gloo", timeout=timeout)  # the feed threads' stop handshake
        self.target, self.world_size = target, dist.get_world_size()
        mesh = DeviceMesh.from_group(self.group, target.device.type)
        layers = list(target.base.layers)
        for layer in layers:
            fully_shard(layer, mesh=mesh, reshard_after_forward=True)
        upto = max(target.layer_ids) + 1  # the feature pass's layers: the deeper ones never run in training
        for layer, following in zip(layers[:upto - 1], layers[1:upto]):
            layer.set_modules_to_forward_prefetch([following])
        self.root = fully_shard(_FeatureForward(target), mesh=mesh, reshard_after_forward=True)
        self.lock = threading.Lock()  # one pass at a time on this rank (feed thread, held-out evaluation)
        self.left = False  # this rank's feed has left the handshake (or seen a peer leave)
        self.filler_batch = collate_padded([(np.zeros(1, np.int64), np.ones(1, np.uint8))], 0)  # 1 token

    @property
    def device(self) -> torch.device:
        return self.target.device

    def segments(self, host_doc_ids: torch.Tensor) -> RealTokens:
        return self.target.segments(host_doc_ids)

    @torch.no_grad()
    def context_features(self, batch: Batch, segments: RealTokens | None = None) -> torch.Tensor:
        """`TargetModel.context_features` (C, F*H) with the layers all-gathered one at a time (a collective)."""
        with self.lock:
            return self.root(lambda: self.target.context_features(batch, segments))

    def filler(self) -> None:
        """One feature pass on a 1-token document, its features dropped: a rank's pass without a batch."""
        self.context_features(self.filler_batch)

    def turn(self) -> None:
        """Before a feed pass: every rank's feed agrees to go on (a gloo collective). Raises `Stopped` when
        another rank's feed has left, so this one stops at the same pass."""
        if self._handshake(stop=False):
            raise Stopped("another rank's target feed stopped")

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


def shard_target(target: TargetModel, setting: str, world_size: int, timeout_s: float) -> tuple[Any, str]:
    """(the target to run the feature passes on, the log line): `target` itself when replicated, else a
    `ShardedTarget` over it."""
    device = target.device
    device_bytes = torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else None
    choice, why = resolve_target_parallel(setting, target_bytes(target), device_bytes, world_size)
    if choice == "replicate":
        return target, f"target replicated on every rank ({why})"
    layers = target.num_layers
    return (ShardedTarget(target, timeout_s),
            f"target sharded over {world_size} ranks with FSDP2 ({why}): {layers} decoder layers, 1/{world_size} "
            f"of each per rank; embedding, norm and LM head replicated")
