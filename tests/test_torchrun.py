"""torchrun: 2 gloo ranks equal one process trained on the same global batches; resume with the same world
size, refuse another; a rank killed mid-run makes the other exit with an error, not hang."""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from dflash_lib.checkpoint import CheckpointMismatchError, list_checkpoints, read_manifest
from dflash_lib.config import from_params, preset
from dflash_lib.train import train

REPO = Path(__file__).resolve().parent.parent
PARAMS = {"steps": 6, "lr": 0.01, "warmup_steps": 1, "ckpt_every": 2, "dist_timeout_s": 30.0}
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled"}
TIMEOUT_S = 8.0  # dist_timeout_s of the killed-rank test


def cli_params(params: dict) -> list[str]:
    return [x for k, v in params.items() for x in ("-p", k, json.dumps(v))]


def torchrun(run_dir: Path, *extra: str, params: dict = PARAMS) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m",
           "dflash_lib", "train", "--preset", "smoke", "--run-dir", str(run_dir), *cli_params(params), *extra]
    return subprocess.run(cmd, cwd=REPO, env=ENV, capture_output=True, text=True, timeout=300)


def rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def column(table: list[dict], key: str) -> np.ndarray:
    return np.array([math.nan if r[key] is None else r[key] for r in table], dtype=float)


@pytest.mark.slow
def test_two_ranks_equal_one_process_on_the_same_global_batches_and_resume(tmp_path):
    ddp = tmp_path / "ddp"
    first = torchrun(ddp, "-p", "stop_at_step", "3")
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    assert [r["step"] for r in rows(ddp)] == [1, 2, 3]
    logged = [line for line in first.stdout.splitlines() if re.match(r"step \d+ \| loss", line)]
    assert len(logged) == 3  # rank 0 alone logs
    assert [p.name for p in list_checkpoints(ddp / "checkpoints")] == ["ckpt-00000002", "ckpt-00000003"]
    assert read_manifest(ddp / "checkpoints" / "ckpt-00000003").world_size == 2

    second = torchrun(ddp)  # same world size: resumes
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    assert "resuming from" in second.stdout
    summary = json.loads((ddp / "summary.json").read_text())
    assert (summary["world_size"], summary["resumed_from_step"], summary["steps"]) == (2, 3, 6)

    # One process, emulate_ranks=2: each step trains on both ranks' batches with both ranks' anchor generators.
    single = tmp_path / "single"
    one = train(from_params({**PARAMS, "emulate_ranks": 2}, preset("smoke")), single)
    assert one["world_size"] == 1 and one["emulated_ranks"] == 2
    got, want = rows(ddp), rows(single)
    assert [r["step"] for r in got] == [r["step"] for r in want] == [1, 2, 3, 4, 5, 6]
    for key in ("real_tokens", "padded_tokens", "skipped_tokens", "bucket"):
        assert [r[key] for r in got] == [r[key] for r in want], key
    assert [r["micro_batches"] for r in want] == [2] * 6 and [r["micro_batches"] for r in got] == [1] * 6
    for key in ("loss", "acc", "grad_norm"):
        np.testing.assert_allclose(column(got, key), column(want, key), rtol=0, atol=1e-5, err_msg=key)

    # A single process may not resume the 2-rank run.
    with pytest.raises(CheckpointMismatchError, match="written by 2 process.*world size 1; resume with "
                                                      "--nproc-per-node 2"):
        train(from_params(PARAMS, preset("smoke")), ddp)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def two_ranks_at_step_3(run_dir: Path, params: dict):
    """Two training ranks started by hand, as torchrun would start them; yields (rank0, rank1, rank 0's output
    lines, read live) once rank 0 has logged step 3. Every rank is killed on the way out if still running."""
    port = _free_port()
    cmd = [sys.executable, "-m", "dflash_lib", "train", "--preset", "smoke", "--run-dir", str(run_dir),
           *cli_params(params)]
    procs = []
    for rank in range(2):
        env = {**ENV, "RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": str(rank), "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(port)}
        procs.append(subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True))
    rank0, rank1 = procs
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(line.rstrip("\n") for line in rank0.stdout), daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 180
        while not any(line.startswith("step 3 |") for line in list(lines)) and time.monotonic() < deadline:
            assert rank0.poll() is None, "\n".join(lines[-20:])
            time.sleep(0.02)
        yield rank0, rank1, lines
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGKILL)
            p.wait(timeout=30)
        reader.join(timeout=10)


@pytest.mark.slow
def test_a_rank_killed_mid_run_makes_the_other_exit_with_an_error_within_the_timeout(tmp_path):
    """The two ranks are started by hand, as torchrun would (its agent would kill the survivor itself)."""
    params = {**PARAMS, "steps": 500, "dist_timeout_s": TIMEOUT_S}
    with two_ranks_at_step_3(tmp_path, params) as (rank0, rank1, lines):
        rank1.send_signal(signal.SIGKILL)
        killed_at = time.monotonic()
        rc = rank0.wait(timeout=TIMEOUT_S + 60)  # a hang would end here with TimeoutExpired
        waited_s = time.monotonic() - killed_at
    out = "\n".join(lines)
    assert rc == 1, out[-3000:]
    assert "error: DistributedError: rank 0/2:" in out and "a peer died or did not answer within 8.0 s" in out
    assert waited_s < TIMEOUT_S + 20  # the configured timeout plus process teardown, not a hang
    assert list_checkpoints(tmp_path / "checkpoints")  # the checkpoints written before the failure remain


@pytest.mark.slow
def test_sigterm_to_one_rank_stops_both_after_the_same_step_with_a_checkpoint_and_a_resume_continues(tmp_path):
    """A scheduler may signal one task first: the stop is agreed over all ranks at the step boundary, every rank
    exits 0, the checkpoint holds the last step logged, and torchrun resumes from it."""
    params = {**PARAMS, "steps": 400}
    with two_ranks_at_step_3(tmp_path, params) as (rank0, rank1, lines):
        rank1.send_signal(signal.SIGTERM)  # rank 0 gets nothing
        codes = [p.wait(timeout=120) for p in (rank0, rank1)]
    out = "\n".join(lines)
    assert codes == [0, 0], out[-3000:] + rank1.stdout.read()[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    stopped = summary["steps"]
    assert not summary["complete"] and 3 <= stopped < params["steps"]
    assert summary["stop_reason"] == "a stop signal on another rank"  # rank 0 writes: it was not signalled
    assert [r["step"] for r in rows(tmp_path)] == list(range(1, stopped + 1))
    assert list_checkpoints(tmp_path / "checkpoints")[-1].name == f"ckpt-{stopped:08d}"
    resumed = torchrun(tmp_path, "-p", "stop_at_step", str(stopped + 2), params=params)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert "resuming from" in resumed.stdout
    assert [r["step"] for r in rows(tmp_path)] == list(range(1, stopped + 3))
