"""torch.distributed glue: one process or a torchrun group, behind the same few calls, and torch's own engines.

`init_distributed` joins torchrun's group (gloo on CPU, NCCL on CUDA; a collective that times out raises
DistributedError instead of hanging); without torchrun every collective is a no-op, so the call sites
(`all_reduce_sum`, `any_rank`, `barrier`, `print0`, ...) stay the same. `wrap_drafter` puts the drafter on an
`DrafterParallel` (DDP or FSDP2; never the frozen target: `target.sharded`); `checkpoint_group` is a gloo group whose timeout
is sized for a save. Engines, timeouts, what is guaranteed: docs/scale.md, "Several GPUs and several nodes".
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import io
import os
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

_TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK")


class DistributedError(RuntimeError):
    """The process group could not start, or a collective failed (a peer died or did not answer in time)."""


@dataclass(frozen=True)
class DistInfo:
    rank: int  # global rank, 0 .. world_size-1
    world_size: int  # number of processes in the run
    local_rank: int  # rank on this machine (selects the GPU)
    device: torch.device  # where this rank computes
    backend: str | None  # "gloo" | "nccl", None for a single process
    timeout_s: float  # seconds a collective waits for its peers before failing

    @property
    def is_main(self) -> bool:
        return self.rank == 0


_info: DistInfo | None = None  # set by init_distributed, cleared by destroy


def _env_int(name: str) -> int:
    raw = os.environ.get(name)
    try:
        return int(raw)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise DistributedError(f"environment variable {name}={raw!r} must be an integer "
                               f"(set by torchrun: {', '.join(_TORCHRUN_VARS)})") from None


def _resolve_device(device: str, local_rank: int) -> torch.device:
    if device not in ("auto", "cpu", "cuda"):
        raise DistributedError(f"device must be 'auto', 'cpu' or 'cuda', got {device!r}")
    use_cuda = device == "cuda" or (device == "auto" and torch.cuda.is_available())
    if not use_cuda:
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise DistributedError("device='cuda' was asked for but CUDA is not available")
    if local_rank >= torch.cuda.device_count():
        raise DistributedError(f"LOCAL_RANK {local_rank} has no GPU: this machine has {torch.cuda.device_count()}")
    return torch.device("cuda", local_rank)


def init_distributed(timeout_s: float = 60.0, device: str = "auto") -> DistInfo:
    """Join the torchrun process group if there is one, else describe a single process.

    timeout_s: seconds any collective (and the initial rendezvous) waits before raising.
    device: "auto" (CUDA when available), "cpu" or "cuda"; CUDA uses NCCL and GPU `LOCAL_RANK`, CPU uses gloo.
    Calling it again returns the existing DistInfo.
    """
    global _info
    if _info is not None:
        return _info
    if not (isinstance(timeout_s, (int, float)) and not isinstance(timeout_s, bool) and timeout_s > 0):
        raise DistributedError(f"timeout_s must be a number of seconds > 0, got {timeout_s!r}")
    present = [v for v in _TORCHRUN_VARS if v in os.environ]
    if not present:
        _info = DistInfo(0, 1, 0, _resolve_device(device, 0), None, float(timeout_s))
        return _info
    if len(present) != len(_TORCHRUN_VARS):
        missing = sorted(set(_TORCHRUN_VARS) - set(present))
        raise DistributedError(f"torchrun environment is incomplete: {present} set but {missing} missing")
    rank, world_size, local_rank = (_env_int(v) for v in _TORCHRUN_VARS)
    if world_size < 1 or not 0 <= rank < world_size or local_rank < 0:
        raise DistributedError(f"inconsistent torchrun environment: RANK={rank} WORLD_SIZE={world_size} "
                               f"LOCAL_RANK={local_rank}")
    dev = _resolve_device(device, local_rank)
    if world_size == 1:
        _info = DistInfo(0, 1, local_rank, dev, None, float(timeout_s))
        return _info
    for var in ("MASTER_ADDR", "MASTER_PORT"):
        if var not in os.environ:
            raise DistributedError(f"environment variable {var} is not set (torchrun sets it)")
    backend = "nccl" if dev.type == "cuda" else "gloo"
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    try:
        dist.init_process_group(backend=backend, rank=rank, world_size=world_size,
                                timeout=_dt.timedelta(seconds=timeout_s),
                                device_id=dev if dev.type == "cuda" else None)
    except Exception as e:  # noqa: BLE001 - rendezvous failures come as several types; name the cause
        raise DistributedError(f"rank {rank}/{world_size}: could not join the {backend} process group at "
                               f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']} within {timeout_s} s: "
                               f"{type(e).__name__}: {e}") from e
    _info = DistInfo(rank, world_size, local_rank, dev, backend, float(timeout_s))
    return _info


def info() -> DistInfo:
    """The current DistInfo (a single CPU/auto process when init_distributed was not called)."""
    return _info if _info is not None else DistInfo(0, 1, 0, torch.device("cpu"), None, 0.0)


def initialized() -> bool:
    """True once init_distributed has run (and destroy has not)."""
    return _info is not None


def is_main() -> bool:
    """True on rank 0 (and in a single process): the rank that logs, writes wandb and saves checkpoints."""
    return info().rank == 0


def print0(*args: object, **kwargs: object) -> None:
    """print() on rank 0 only, flushed (so torchrun's interleaved logs stay in order)."""
    if is_main():
        print(*args, **{"flush": True, **kwargs})  # type: ignore[arg-type]


def _group_active() -> bool:
    return _info is not None and _info.backend is not None and dist.is_initialized()


def all_reduce_sum(x: float | torch.Tensor) -> float | torch.Tensor:
    """Sum `x` over all ranks. A float comes back as a float (summed in float64); a tensor comes back as a new
    tensor of the same shape, dtype and device (the input is not modified)."""
    if isinstance(x, bool) or not isinstance(x, (int, float, torch.Tensor)):
        raise DistributedError(f"all_reduce_sum takes a float or a tensor, got {type(x).__name__}")
    if not _group_active():
        return float(x) if not isinstance(x, torch.Tensor) else x.clone()
    assert _info is not None
    if isinstance(x, torch.Tensor):
        buf = x.detach().to(_info.device, copy=True)
    else:
        buf = torch.tensor([float(x)], dtype=torch.float64, device=_info.device)  # (1,)
    _collective("all_reduce", lambda: dist.all_reduce(buf, op=dist.ReduceOp.SUM))
    return buf.to(x.device) if isinstance(x, torch.Tensor) else float(buf.item())


def all_gather_bytes(data: bytes) -> list[bytes]:
    """Every rank's `data`, in rank order (`[data]` in a single process). Plain bytes, so the caller picks a
    serialisation it can read back safely (the trainer gathers per-rank state as torch.save bytes and reads
    them with weights_only=True). Two collectives: the lengths, then the payloads padded to the longest."""
    if not isinstance(data, (bytes, bytearray)):
        raise DistributedError(f"all_gather_bytes takes bytes, got {type(data).__name__}")
    if not _group_active():
        return [bytes(data)]
    assert _info is not None
    world, dev = _info.world_size, _info.device
    size = torch.tensor([len(data)], dtype=torch.int64, device=dev)  # (1,)
    sizes = [torch.zeros_like(size) for _ in range(world)]
    _collective("all_gather", lambda: dist.all_gather(sizes, size))
    lengths = [int(s.item()) for s in sizes]
    buf = torch.zeros(max(1, *lengths), dtype=torch.uint8)  # (longest,) gloo refuses empty tensors
    if data:
        buf[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    buf = buf.to(dev)
    out = [torch.empty_like(buf) for _ in range(world)]
    _collective("all_gather", lambda: dist.all_gather(out, buf))
    return [o[:n].cpu().numpy().tobytes() for o, n in zip(out, lengths)]


def barrier() -> None:
    """Wait until every rank gets here (no-op in a single process); DistributedError after the timeout."""
    if _group_active():
        _collective("barrier", dist.barrier)


def all_reduce_floats(values: Sequence[float]) -> list[float]:
    """Sum a list of floats over ranks in one collective (identity in a single process)."""
    if info().world_size == 1:
        return [float(v) for v in values]
    return all_reduce_sum(torch.tensor(list(values), dtype=torch.float64)).tolist()


def any_rank(flag: bool) -> bool:
    """True when `flag` is set on at least one rank (every rank gets the same answer)."""
    return all_reduce_floats([float(flag)])[0] > 0


def gather_states(state: dict[str, Any]) -> list[dict[str, Any]]:
    """Every rank's `state` (tensors, numbers, strings, lists, dicts), in rank order; [state] in one process.
    Sent as torch.save bytes and read back with weights_only=True (no object is ever unpickled)."""
    if info().world_size == 1:
        return [state]
    buf = io.BytesIO()
    torch.save(state, buf)
    return [torch.load(io.BytesIO(b), weights_only=True) for b in all_gather_bytes(buf.getvalue())]


def rank_shards(rank: int, world_size: int, data_shards: int) -> list[int]:
    """The data shards (0..D-1 of every sampler step) this rank trains on: d % world_size == rank. W == D: its
    own; W < D: several, accumulated in one step (a 2-rank run resumed by one process); W > D: one or none."""
    return list(range(rank, data_shards, world_size))


def _collective(name: str, call: Callable[[], object]) -> None:
    global _info
    assert _info is not None
    try:
        call()
    except Exception as e:  # noqa: BLE001 - gloo/NCCL report a dead or late peer with varying types
        failed, _info = _info, None
        _abort_group()
        raise DistributedError(f"rank {failed.rank}/{failed.world_size}: {name} failed (a peer died or did not "
                               f"answer within {failed.timeout_s} s): {type(e).__name__}: {e}") from e


_PEER_FAILURE = ("gloo", "nccl", "connection closed", "connection reset", "timed out", "timeout", "broken pipe",
                 "peer", "rendezvous", "store")  # how gloo/NCCL word a dead or late peer inside a backward


@contextlib.contextmanager
def collective_errors(name: str) -> Any:
    """Around work that runs collectives inside torch (DDP's bucketed all-reduce in the backward, FSDP's
    all-gather and reduce-scatter): a peer's failure becomes the same DistributedError as `_collective`'s (the
    group is aborted so the process exits with its own error); any other error passes through unchanged."""
    if not _group_active():
        yield
        return
    try:
        yield
    except Exception as e:  # noqa: BLE001 - filtered below
        text = str(e).lower()
        if not (isinstance(e, getattr(dist, "DistError", ())) or any(w in text for w in _PEER_FAILURE)):
            raise
        global _info
        failed, _info = _info, None
        _abort_group()
        assert failed is not None
        raise DistributedError(f"rank {failed.rank}/{failed.world_size}: {name} failed (a peer died or did not "
                               f"answer within {failed.timeout_s} s): {type(e).__name__}: "
                               f"{str(e).splitlines()[0] if str(e) else ''}") from e


def _abort_group() -> None:
    """Tear down a process group whose peers are gone. Without this, the group's destructor at interpreter exit
    can hit std::terminate (SIGABRT) instead of letting the process exit with its own error code."""
    abort = getattr(dist.distributed_c10d, "_abort_process_group", None)  # torch >= 2.6; private but stable
    try:
        if abort is not None and dist.is_initialized():
            abort()
    except Exception:  # noqa: BLE001 - best effort: the error being raised is the one that matters
        pass


def destroy() -> None:
    """Leave the process group (if any) and forget the DistInfo; safe to call twice."""
    global _info, _ckpt_group
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    _info, _ckpt_group = None, None


# -- data parallel engines ----------------------------------------------------------------------------------------
PARALLEL = ("ddp", "fsdp")  # `train.parallel`: torch's DistributedDataParallel, or FSDP2 (fully_shard)


class LossForward(torch.nn.Module):
    """The drafter's training loss as a module `forward`, so that DDP and FSDP2 see every call (their hooks live
    on `forward`). `drafter` is a submodule; the frozen target it references is not (it is replicated)."""

    def __init__(self, drafter: torch.nn.Module) -> None:
        super().__init__()
        self.drafter = drafter

    def forward(self, batch, features, layout, normalizer, target_hidden=None):  # noqa: ANN001 - DFlashDrafter.loss
        return self.drafter.loss(batch, features, layout, normalizer=normalizer, target_hidden=target_hidden)


class DrafterParallel:
    """How the drafter is trained across ranks. `kind`: "single" (one process: the drafter as it is), "ddp"
    (DistributedDataParallel over the drafter: bucketed gradient all-reduce overlapped with the backward) or
    "fsdp" (FSDP2: `fully_shard` per drafter layer, then the root; parameters, gradients and AdamW state are
    sharded over the ranks). `drafter` stays the plain module (its parameter names carry no wrapper prefix);
    under FSDP its parameters are DTensor shards.

    DDP and FSDP average gradients over ranks; the trainer's losses are already normalised by the GLOBAL weight
    sum, so `loss_scale` (= world size) multiplies each loss back before its backward: the reduced gradient is
    then the sum over ranks, exactly as one process holding every micro-batch computes it.
    """

    def __init__(self, drafter: torch.nn.Module, kind: str, world_size: int, device: torch.device) -> None:
        if kind not in ("single", *PARALLEL):
            raise DistributedError(f"parallel must be one of {PARALLEL}, got {kind!r}")
        self.drafter, self.kind, self.world_size = drafter, kind, world_size
        self.loss_scale = float(world_size) if kind != "single" else 1.0
        root = LossForward(drafter)
        if kind == "ddp":
            from torch.nn.parallel import DistributedDataParallel  # only DDP needs it

            with warnings.catch_warnings():  # torch 2.13 renames it; 2.11 has only this name, which both honour
                warnings.filterwarnings("ignore", message="`broadcast_buffers` is deprecated", category=FutureWarning)
                self.module = DistributedDataParallel(
                    root, device_ids=[device.index] if device.type == "cuda" else None,
                    broadcast_buffers=False,  # the drafter's only buffer (RoPE inv_freq) is a constant
                    gradient_as_bucket_view=True)  # grads live in the all-reduce buckets: no second copy
        elif kind == "fsdp":
            from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard  # only FSDP needs it

            mp = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
                  if device.type == "cuda" else MixedPrecisionPolicy())  # CPU: fp32 throughout (exact tests)
            for layer in drafter.layers:  # one unit per layer: its all-gather overlaps the previous layer
                fully_shard(layer, mp_policy=mp)
            self.module = fully_shard(root, mp_policy=mp)  # the root: fc, norms
        else:
            self.module = root

    def loss(self, batch, features, layout, normalizer, target_hidden=None):  # noqa: ANN001
        """DFlashDrafter.loss through the wrapper (its forward hooks run); `target_hidden` for loss kl / ce+kl."""
        return self.module(batch, features, layout, normalizer, target_hidden)

    def grad_sync(self, enabled: bool) -> Any:
        """Context of one micro-batch's backward: `enabled` False defers the gradient reduction (DDP `no_sync`,
        FSDP `set_requires_gradient_sync(False)`), so an accumulation step reduces once, on its last backward."""
        if self.kind == "ddp" and not enabled:
            return self.module.no_sync()
        if self.kind == "fsdp":
            self.module.set_requires_gradient_sync(enabled)
        return contextlib.nullcontext()

    @contextlib.contextmanager
    def full_root(self) -> Any:
        """FSDP: the root unit's parameters (fc, norms) unsharded while the drafter is called outside the
        engine's forward (the layers all-gather in their own forward hooks). A no-op for DDP and one process."""
        if self.kind != "fsdp":
            yield
            return
        self.module.unshard()
        try:
            yield
        finally:
            self.module.reshard()

    def full_weights(self) -> dict[str, torch.Tensor]:
        """The drafter's trainable weights as full, plain CPU tensors named as in the plain module (no `module.`
        prefix, no DTensor). A collective under FSDP (every rank calls it; rank 0 gets the tensors, the others
        an empty dict)."""
        if self.kind == "fsdp":
            # heavy to import; only checkpoint I/O needs it
            from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

            full = get_model_state_dict(self.drafter, options=StateDictOptions(full_state_dict=True,
                                                                                cpu_offload=True))
            trainable = {n for n, p in self.drafter.named_parameters() if p.requires_grad}
            return {n: t for n, t in full.items() if n in trainable}
        return {n: p.detach().cpu() for n, p in self.drafter.named_parameters() if p.requires_grad}


def wrap_drafter(drafter: torch.nn.Module, parallel: str = "ddp") -> DrafterParallel:
    """The DrafterParallel for this process: "single" without a process group, else `parallel` ("ddp" | "fsdp")."""
    d = info()
    kind = parallel if _group_active() else "single"
    if kind not in ("single", *PARALLEL):
        raise DistributedError(f"parallel must be one of {PARALLEL}, got {parallel!r}")
    return DrafterParallel(drafter, kind, d.world_size, d.device)


# -- the checkpoint group -------------------------------------------------------------------------------------------
_ckpt_group: Any = None
CKPT_MIN_WRITE_BYTES_S = 100e6  # the slowest storage we plan for (bytes/s per rank): a network disk under load


def checkpoint_timeout_s(state_bytes: float, world_size: int, base_s: float) -> float:
    """Seconds a checkpoint collective may wait: `base_s` (dist_timeout_s, the bound for a dead rank) plus
    twice the time one rank needs to write its share of a `state_bytes` state (DCP spreads replicated tensors
    over the ranks; FSDP shards are disjoint) and read it back for its checksum, at CKPT_MIN_WRITE_BYTES_S.
    The paper drafter (~1.0 B parameters: 12 GB of fp32 weights + AdamW) on 8 ranks: 60 + 2 * 2 * 1.5 GB /
    100 MB/s = 120 s; on 1 rank of a 2-rank run, 300 s."""
    per_rank = state_bytes / max(1, world_size)
    return float(base_s) + 2.0 * 2.0 * per_rank / CKPT_MIN_WRITE_BYTES_S


def checkpoint_group(timeout_s: float) -> Any:
    """A gloo process group for checkpoint collectives (DCP's planning and commit, async saves in a background
    thread), with its own timeout sized for the save (`checkpoint_timeout_s`); None without a process group.
    Created on first use: every rank must call it at the same point (the first save or load)."""
    global _ckpt_group
    if not _group_active():
        return None
    if _ckpt_group is None:
        _ckpt_group = dist.new_group(backend="gloo", timeout=_dt.timedelta(seconds=timeout_s))
    return _ckpt_group
