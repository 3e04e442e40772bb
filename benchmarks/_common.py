"""What the 2-rank benchmarks share: spawn local gloo ranks and collect what each one reports.

Imported by benchmarks/checkpoint_io.py and benchmarks/ddp_step.py, which put this folder on sys.path for that
import only (a sibling named like a stdlib module, benchmarks/tokenize.py, must not shadow it afterwards).
"""

from __future__ import annotations

import os
import queue
import socket
from typing import Any, Callable

import torch.multiprocessing as mp

from dflash_lib.train import distributed


def join_group(rank: int, world_size: int, port: int, timeout_s: float) -> None:
    """Join a local gloo group on 127.0.0.1:`port` as `rank` of `world_size` (what torchrun's environment says)."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    distributed.init_distributed(timeout_s=timeout_s, device="cpu")


def spawn_ranks(worker: Callable[..., None], args: tuple, world_size: int = 2,
                join_timeout_s: float = 60.0) -> dict[int, Any]:
    """Run `worker(rank, *args, port, out)` in `world_size` spawned processes; each puts (rank, result) on the
    queue `out`. Returns {rank: result}. A rank that dies is reported (SystemExit) instead of waited for."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=worker, args=(r, *args, port, out)) for r in range(world_size)]
    for p in procs:
        p.start()
    results = {}
    while len(results) < len(procs):
        try:
            rank, result = out.get(timeout=5)
            results[rank] = result
        except queue.Empty:
            dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
            if dead:
                raise SystemExit(f"a rank exited with {dead[0]}") from None
    for p in procs:
        p.join(timeout=join_timeout_s)
        if p.exitcode != 0:
            raise SystemExit(f"a rank exited with {p.exitcode}")
    return results
