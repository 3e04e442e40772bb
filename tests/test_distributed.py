"""torch.distributed glue: single process, 2 gloo processes under torchrun, and a dead or silent peer."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist

from checkpoints import save_checkpoint
from dflash_lib.config import smoke
from dflash_lib.data.batch import collate_padded
from dflash_lib.train import distributed as D
from dflash_lib.rundir.checkpoints import CheckpointError
from dflash_lib.train.checkpoint import TrainingCheckpoints, capture_rng, restore_rng
from dflash_lib.train.feed import Item
from dflash_lib.train.state import BadStepGuard
from dflash_lib.train.step import filler_item, train_step
from loopback import free_port
from tiny_models import decode_drafter, decode_target

REPO = Path(__file__).resolve().parent.parent
TIMEOUT_S = 6.0  # collective timeout the worker processes are configured with

WORKER = textwrap.dedent("""
    import json, os, signal, sys, time, torch
    from dflash_lib.train import distributed as D
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


def _launch_pair(script: Path, mode: str) -> list[subprocess.Popen]:
    """Start 2 ranks by hand (as torchrun would, minus its agent that would kill the survivors itself)."""
    port = free_port()
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
    parallel = D.wrap_drafter(model, "fsdp")  # no process group: nothing to shard over
    assert (parallel.kind, parallel.loss_scale, parallel.drafter) == ("single", 1.0, model)
    assert set(parallel.full_weights()) == {"weight", "bias"}
    with pytest.raises(D.DistributedError, match=r"parallel must be one of \('ddp', 'fsdp'\), got 'zero'"):
        D.DrafterParallel(model, "zero", 2, torch.device("cpu"))


# -- the distributed invariants in one process: a 1-rank gloo group under DDP, a simulated idle peer ---------------


@pytest.fixture
def gloo_one(tmp_path, monkeypatch):
    """A 1-rank gloo process group (FileStore in tmp_path) that DDP can wrap; `distributed`'s own state stays that
    of a single process (its collectives are identities). Destroyed afterwards. One intra-op thread meanwhile:
    tiny matmuls on a busy 2-core machine run several times faster than on two."""
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    D.destroy()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        yield
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        D.destroy()
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def step_target():
    return decode_target()


def _docs(n: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """n documents of 12 .. 29 ids below the MASK id, the second half of each scored (the "answer")."""
    rng = np.random.default_rng(4)
    out = []
    for length in rng.integers(12, 30, n):
        mask = np.zeros(length, np.uint8)
        mask[length // 2:] = 1
        out.append((rng.integers(0, 255, length), mask))
    return out


def _items(target, drafter, docs, split: list[int]) -> list[Item]:
    """Ready micro-batches of docs[0:split[0]], docs[split[0]:split[1]], ...; anchors from ONE generator in
    document order, so any split draws the same anchors."""
    gen, out, lo = torch.Generator().manual_seed(3), [], 0
    for hi in split:
        batch = collate_padded(docs[lo:hi], pad_id=0, indices=list(range(lo, hi)))
        layout = drafter.layout(batch, drafter.sample_anchors(batch, gen))
        out.append(Item(0, batch, batch, target.features(batch), layout=layout, device_layout=layout))
        lo = hi
    return out


def _idle_peer_mean(reduced: list[int]):
    """A DDP communication hook standing in for the all-reduce (mean) of a 2-rank group whose other rank
    contributes an exactly-zero gradient (an idle rank running the filler): each bucket comes back halved. The
    index of every bucket reduced is appended to `reduced`."""

    def hook(state, bucket):
        reduced.append(bucket.index())
        fut = torch.futures.Future()
        fut.set_result(bucket.buffer() / 2)
        return fut

    return hook


def _sgd_update(target, kind: str, world_size: int, split: list[int], hook=None):
    """The parameter change of one train_step (SGD, lr 1, no clipping) of a fresh drafter over _docs(6) cut at
    `split`, on a DrafterParallel of `kind` for `world_size` ranks; and the step's StepResult."""
    drafter = decode_drafter(target, 4)
    params = [p for p in drafter.parameters() if p.requires_grad]
    before = [p.detach().clone() for p in params]
    parallel = D.DrafterParallel(drafter, kind, world_size, torch.device("cpu"))
    if hook is not None:
        parallel.module.register_comm_hook(None, hook)
    items = _items(target, drafter, _docs(6), split)
    res = train_step(parallel, items, params, torch.optim.SGD(params, lr=1.0), lr=1.0, grad_clip=0.0, autocast=False,
                     guard=BadStepGuard(3), step=1)
    return torch.cat([(p.detach() - b).flatten() for p, b in zip(params, before)]), res


def test_ddp_step_over_two_micro_batches_equals_one_process_holding_both(gloo_one, step_target):
    """DDP, 2 micro-batches (the first under no_sync): the update of one process holding the whole batch. On 2
    ranks whose peer is idle (zero gradient, `_idle_peer_mean`) the all-reduce halves the gradient and the loss x
    world-size scale restores it; each bucket is reduced once per step, after the last micro-batch."""
    want, one = _sgd_update(step_target, "single", 1, [6])
    assert want.abs().max() > 0
    got, res = _sgd_update(step_target, "ddp", 1, [4, 6])
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-7)
    assert res.weight_sum == pytest.approx(one.weight_sum) and res.loss == pytest.approx(one.loss, rel=1e-5)
    reduced: list[int] = []
    got, res = _sgd_update(step_target, "ddp", 2, [4, 6], hook=_idle_peer_mean(reduced))
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-7)
    assert res.grad_norm == pytest.approx(one.grad_norm, rel=1e-5)
    assert reduced and sorted(reduced) == sorted(set(reduced))  # every bucket once


def test_the_loss_scale_is_the_world_size_under_ddp_and_fsdp(gloo_one, step_target):
    """DDP and FSDP average gradients over ranks while the loss is normalised by the GLOBAL weight sum: each
    loss is multiplied back by the world size. One process scales nothing."""
    assert D.DrafterParallel(decode_drafter(step_target, 4), "single", 4, torch.device("cpu")).loss_scale == 1.0
    assert D.DrafterParallel(decode_drafter(step_target, 4), "ddp", 2, torch.device("cpu")).loss_scale == 2.0
    assert D.DrafterParallel(decode_drafter(step_target, 4), "fsdp", 3, torch.device("cpu")).loss_scale == 3.0


def test_the_idle_ranks_filler_has_exactly_zero_loss_and_gradient(gloo_one, step_target, monkeypatch):
    """A rank with nothing to score in a step its peer trains on runs the filler, so it joins the gradient
    reduction: its loss is exactly 0 and every trainable parameter gets an exactly-zero gradient (it moves
    nothing). Then through train_step on 2 ranks whose peer holds all the weight (`all_reduce_floats` adds the
    peer's weight sum): the filler runs, its gradient is reduced, the update is zero."""
    drafter = decode_drafter(step_target, 4)
    params = [p for p in drafter.parameters() if p.requires_grad]
    filler = filler_item(drafter, torch.device("cpu"))
    assert filler.layout.num_blocks > 0 and filler.layout.weight_sum == 0.0
    out = drafter.loss(filler.device_batch, filler.features, filler.device_layout, normalizer=7.0)
    assert out.loss.item() == 0.0
    out.loss.backward()
    assert all(p.grad is not None and not p.grad.any() for p in params)
    for p in params:
        p.grad = None

    reduced: list[int] = []
    parallel = D.DrafterParallel(drafter, "ddp", 2, torch.device("cpu"))
    parallel.module.register_comm_hook(None, _idle_peer_mean(reduced))
    calls = []

    def with_peer(values):  # the step's first reduction is its weight sum: the peer's 5.0 joins it
        calls.append(values)
        return [values[0] + 5.0, *values[1:]] if len(calls) == 1 else list(values)

    monkeypatch.setattr("dflash_lib.train.step.all_reduce_floats", with_peer)
    silent = [(tok, np.zeros_like(mask)) for tok, mask in _docs(2)]  # this rank: nothing scored
    (item,) = _items(step_target, drafter, silent, [2])
    before = [p.detach().clone() for p in params]
    res = train_step(parallel, [item], params, torch.optim.SGD(params, lr=1.0), lr=1.0, grad_clip=0.0,
                     autocast=False, guard=BadStepGuard(3), step=1, filler=filler)
    assert not res.skipped and res.weight_sum == 5.0 and res.grad_norm == 0.0 and reduced
    assert all(torch.equal(p, b) for p, b in zip(params, before))


def test_load_rng_gives_rank_1_of_a_one_rank_checkpoint_rank_0s_streams(tmp_path, monkeypatch):
    """A 1-rank run resumed on 2 ranks: rank 1 (no rank file of its own) restores rank (1 mod 1) = 0's streams."""
    drafter = torch.nn.Linear(2, 2)
    ckpts = TrainingCheckpoints(tmp_path, drafter, torch.optim.SGD(drafter.parameters(), lr=0.1), smoke().train, "h",
                                smoke().to_dict())
    outside = capture_rng()
    try:
        torch.manual_seed(11)
        random.seed(11)
        path = save_checkpoint(tmp_path, {"step": 1}, 1, config_hash="h", rank_state={"rng": capture_rng()})
        want = (torch.rand(3).tolist(), random.random())
        torch.manual_seed(99)
        random.seed(99)
        monkeypatch.setattr(D, "info", lambda: D.DistInfo(1, 2, 1, torch.device("cpu"), "gloo", 5.0))
        ckpts.load_rng(path, saved_world_size=1)
        assert (torch.rand(3).tolist(), random.random()) == want
        with pytest.raises(CheckpointError, match="no rank state for rank 1"):  # a 2-rank checkpoint has its own
            ckpts.load_rng(path, saved_world_size=2)
    finally:
        restore_rng(outside)
