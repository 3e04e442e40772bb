"""The dry run on N ranks without N devices: torch's FAKE process group, the frozen target sharded by FSDP2 as
the trainer shards it on N GPUs, and the bytes every collective moves.

`fake_process_group(N)` makes this process rank 0 of an N-rank group whose collectives return at once, so
`target.sharded.shard_layers` under `FakeTensorMode` leaves it holding what a rank holds on N GPUs; `CommTally`
counts each collective's bytes, `LayerRuns` the gathered bytes of the layers that ran. What it measures:
docs/scale.md, "Larger targets on several GPUs: `dryrun --world-size`".
"""

from __future__ import annotations

import contextlib
import functools
from collections import defaultdict
from typing import Any, Iterator, Sequence

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from dflash_lib.config import ConfigError

@contextlib.contextmanager
def fake_process_group(world_size: int) -> Iterator[Any]:
    """This process as rank 0 of a fake `world_size`-rank group (module docstring) while the block runs; yields
    the 1-D CPU device mesh FSDP2 shards over (built outside any fake mode: a mesh reads its ranks' values).
    ConfigError when another process group is already initialised in this process."""
    try:
        from torch.testing._internal.distributed.fake_pg import FakeStore  # private: torch's fake group
    except ImportError as e:
        raise ConfigError(f"--world-size needs torch's fake process group (torch.testing._internal.distributed."
                          f"fake_pg), which this torch {torch.__version__} does not ship: {e}") from None
    from torch.distributed.device_mesh import init_device_mesh

    if dist.is_initialized():
        raise ConfigError("the multi-rank dry run needs this process to hold no other process group")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        yield init_device_mesh("cpu", (world_size,))
    finally:
        dist.destroy_process_group()


def local_bytes(params: Sequence[torch.Tensor]) -> int:
    """Bytes this rank holds of `params`: a DTensor's local shard (FSDP2 pads it to the same rows on every rank),
    a plain tensor whole."""
    total = 0
    for p in params:
        local = p.to_local() if hasattr(p, "to_local") else p
        total += local.numel() * local.element_size()
    return total


class CommTally(TorchDispatchMode):
    """Bytes each kind of collective moves while active (module docstring): `bytes` maps all_gather,
    reduce_scatter and all_reduce to the summed size of their full buffers; `calls` counts the collectives.
    Counts the c10d ops eager FSDP2 and DDP issue (`_allgather_base_`, `_reduce_scatter_base_`, `allreduce_`)."""

    FULL_BUFFER = {"_allgather_base_": ("all_gather", 0), "_reduce_scatter_base_": ("reduce_scatter", 1),
                   "allreduce_": ("all_reduce", 0)}  # c10d op -> (kind, argument holding the full buffer)

    def __init__(self) -> None:
        super().__init__()
        self.bytes: dict[str, int] = defaultdict(int)
        self.calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001 - torch's dispatch protocol
        op = str(func).split(".")
        if len(op) >= 2 and op[0] == "c10d" and op[1] in self.FULL_BUFFER:
            kind, at = self.FULL_BUFFER[op[1]]
            full = args[at][0] if isinstance(args[at], (list, tuple)) else args[at]  # allreduce_ takes a list
            self.bytes[kind] += full.numel() * full.element_size()
            self.calls += 1
        return func(*args, **(kwargs or {}))


class LayerRuns(contextlib.AbstractContextManager):
    """While active, `bytes` sums the gathered size of each sharded decoder layer of `layers` at every forward it
    runs (its local shards x `world_size`: FSDP2 pads every rank's shard to the same rows, so this is the
    all-gather buffer). All-gathers issued (`CommTally`) minus these bytes = gathered for a layer that never ran:
    a prefetch past the pass's last layer, whose buffer FSDP2 then holds unsharded for the whole run."""

    def __init__(self, layers: Sequence[torch.nn.Module], world_size: int) -> None:
        self.layers = list(layers)
        self.sizes = [world_size * local_bytes(list(layer.parameters())) for layer in self.layers]
        self.bytes = 0
        self._hooks: list[Any] = []

    def _ran(self, size: int, *_: Any) -> None:
        self.bytes += size

    def __enter__(self) -> "LayerRuns":
        self._hooks = [layer.register_forward_pre_hook(functools.partial(self._ran, size))
                       for layer, size in zip(self.layers, self.sizes)]
        return self

    def __exit__(self, *exc: Any) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
