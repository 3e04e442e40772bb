"""torch.distributed glue: single process, 2 gloo processes under torchrun, and a dead or silent peer."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from dflash_lib import distributed as D

REPO = Path(__file__).resolve().parent.parent
TIMEOUT_S = 6.0  # collective timeout the worker processes are configured with

WORKER = textwrap.dedent("""
    import json, os, signal, sys, time, torch
    from dflash_lib import distributed as D
    mode, timeout = sys.argv[1], float(sys.argv[2])
    info = D.init_distributed(timeout_s=timeout, device="cpu")
    s = D.all_reduce_sum(float(info.rank + 1))
    x = torch.arange(4, dtype=torch.float32) * (info.rank + 1)  # (4,)
    t = D.all_reduce_sum(x)
    if mode == "ok":
        D.print0("printed once, by rank", info.rank)
        # one file per rank: two ranks printing at once may interleave their lines on torchrun's stdout
        with open(os.path.join(os.environ["RESULT_DIR"], f"rank{info.rank}.json"), "w") as f:
            json.dump({"rank": info.rank, "world": info.world_size, "local": info.local_rank,
                       "backend": info.backend, "sum": s, "tensor": t.tolist(), "input_kept": x.tolist(),
                       "main": D.is_main()}, f)
        D.barrier()
        D.destroy()
        sys.exit(0)
    if info.rank == 1:
        if mode == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(300)  # "silent": alive, but never joins the next collective
    t0 = time.monotonic()
    try:
        D.all_reduce_sum(1.0)
    except D.DistributedError as e:
        print(f"FAILED after {time.monotonic() - t0:.1f} s: {e}", flush=True)
        D.destroy()  # as a trainer's `finally` would: must not hang or abort after the failure
        sys.exit(3)
    print("no error", flush=True)
""")


@pytest.fixture
def single(monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    D.destroy()
    yield
    D.destroy()


def test_single_process_collectives_are_identities(single, capsys) -> None:
    info = D.init_distributed(timeout_s=5, device="cpu")
    assert (info.rank, info.world_size, info.backend, info.device) == (0, 1, None, torch.device("cpu"))
    assert D.init_distributed(timeout_s=99) is info  # idempotent
    x = torch.tensor([1.5, -2.0])
    y = D.all_reduce_sum(x)
    assert torch.equal(y, x) and y is not x
    assert D.all_reduce_sum(3) == 3.0 and isinstance(D.all_reduce_sum(3), float)
    D.barrier()
    D.print0("hello", 1)
    assert capsys.readouterr().out == "hello 1\n" and D.is_main()
    with pytest.raises(D.DistributedError, match="float or a tensor, got str"):
        D.all_reduce_sum("1")


@pytest.mark.parametrize("env, match", [
    ({"RANK": "0"}, r"incomplete: \['RANK'\] set but \['LOCAL_RANK', 'WORLD_SIZE'\] missing"),
    ({"RANK": "x", "WORLD_SIZE": "2", "LOCAL_RANK": "0"}, r"RANK='x' must be an integer"),
    ({"RANK": "2", "WORLD_SIZE": "2", "LOCAL_RANK": "0"}, r"inconsistent torchrun environment: RANK=2 WORLD_SIZE=2"),
    ({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0"}, r"MASTER_ADDR is not set"),
])
def test_bad_torchrun_environment_is_a_clear_error(single, monkeypatch, env: dict, match: str) -> None:
    for k, val in env.items():
        monkeypatch.setenv(k, val)
    with pytest.raises(D.DistributedError, match=match):
        D.init_distributed(timeout_s=5, device="cpu")


@pytest.mark.parametrize("kw, match", [(dict(timeout_s=0), "timeout_s must be"), (dict(timeout_s="5"), "timeout_s"),
                                       (dict(device="tpu"), "device must be")])
def test_bad_arguments_are_refused(single, kw: dict, match: str) -> None:
    with pytest.raises(D.DistributedError, match=match):
        D.init_distributed(**({"timeout_s": 5} | kw))


def _script(tmp_path: Path) -> Path:
    path = tmp_path / "worker.py"
    path.write_text(WORKER)
    return path


@pytest.mark.slow
def test_two_gloo_processes_under_torchrun_sum_correctly(tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(_script(tmp_path)), "ok", str(TIMEOUT_S)]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "RESULT_DIR": str(tmp_path)})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert [r["rank"] for r in results] == [0, 1] and [r["local"] for r in results] == [0, 1]
    for r in results:
        assert (r["world"], r["backend"], r["sum"]) == (2, "gloo", 3.0)
        assert r["tensor"] == [0.0, 3.0, 6.0, 9.0]  # (0,1,2,3) * (1 + 2)
        assert r["input_kept"] == [float(i * (r["rank"] + 1)) for i in range(4)]
    assert [r["main"] for r in results] == [True, False]
    assert proc.stdout.count("printed once, by rank") == 1 and "printed once, by rank 0" in proc.stdout


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch_pair(script: Path, mode: str) -> list[subprocess.Popen]:
    """Start 2 ranks by hand (as torchrun would, minus its agent that would kill the survivors itself)."""
    port = _free_port()
    procs = []
    for rank in range(2):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": str(rank),
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"}
        procs.append(subprocess.Popen([sys.executable, str(script), mode, str(TIMEOUT_S)], cwd=REPO, env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    return procs


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["kill", "silent"])
def test_a_dead_or_silent_peer_makes_the_other_fail_within_the_timeout(tmp_path: Path, mode: str) -> None:
    rank0, rank1 = _launch_pair(_script(tmp_path), mode)
    try:
        out, _ = rank0.communicate(timeout=120)  # generous bound for process start on busy cores
    finally:
        for p in (rank0, rank1):
            if p.poll() is None:
                p.send_signal(signal.SIGKILL)
            p.wait(timeout=30)
            p.stdout.close()
    assert rank0.returncode == 3, out
    line = next(x for x in out.splitlines() if x.startswith("FAILED after"))
    waited_s = float(line.split()[2])
    assert "rank 0/2: all_reduce failed (a peer died or did not answer within 6.0 s)" in line
    assert waited_s < 3 * TIMEOUT_S  # failed near the configured timeout, not after a hang
    if mode == "kill":
        assert rank1.returncode == -signal.SIGKILL
    else:
        assert waited_s >= 0.5 * TIMEOUT_S  # a silent peer is detected by the timeout itself


def test_checkpoint_timeout_covers_writing_and_reading_back_each_ranks_share() -> None:
    paper = 12.0 * 1.05e9  # bytes: the paper drafter's fp32 weights + two AdamW moments
    for world in (1, 8, 64):
        extra = D.checkpoint_timeout_s(paper, world, 60.0) - 60.0
        assert extra >= 2 * paper / world / D.CKPT_MIN_WRITE_BYTES_S  # write + read back at the slowest disk
    assert D.checkpoint_timeout_s(paper, 8, 60.0) == pytest.approx(123.0)  # the README's figure


def test_one_process_trains_on_the_plain_drafter_and_an_unknown_engine_is_refused(single) -> None:
    D.init_distributed(timeout_s=5, device="cpu")
    model = torch.nn.Linear(2, 2)
    engine = D.wrap_drafter(model, "fsdp")  # no process group: nothing to shard over
    assert (engine.kind, engine.loss_scale, engine.drafter) == ("single", 1.0, model)
    assert set(engine.full_weights()) == {"weight", "bias"}
    with pytest.raises(D.DistributedError, match=r"parallel must be one of \('ddp', 'fsdp'\), got 'zero'"):
        D.Engine(model, "zero", 2, torch.device("cpu"))
