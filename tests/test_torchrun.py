"""torchrun on gloo: DDP and FSDP2 equal one process holding the same global batches; resume across world sizes
(2 -> 1, 1 -> 2) continues the uninterrupted trajectory; two "nodes" through c10d rendezvous; kill -9 of the whole
job mid-save; a rank killed mid-run makes the other exit with an error, not hang; SIGTERM to one rank."""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import psutil
import pytest
import torch
from safetensors.torch import load_file

from dflash_lib.config import from_params, preset
from dflash_lib.train.build import build_parts
from dflash_lib.rundir.checkpoints import list_checkpoints, load_checkpoint, read_manifest
from dflash_lib.train.loop import run_training, train
from dflash_lib.train.resume import prepare_run_dir
from fp_tolerance import rounding_atol
from loopback import free_port
from run_folder import assert_same_trajectory, metrics_rows, one_flip

REPO = Path(__file__).resolve().parent.parent
SLOW_SAVE = REPO / "tests" / "slow_save.py"  # the command line with every save held before its commit
# 20 steps of 2+ sampler steps each (accum_tokens: a step ends once the global batch holds 2048 tokens per data
# shard), so every rank accumulates micro-batches under no_sync; lr high enough that any drift shows in the loss
# a draft vocabulary too: its buffers (ids, head rows) cross DDP, FSDP2, DCP and resume with the weights
RUN = {"steps": 20, "lr": 0.01, "warmup_steps": 1, "ckpt_every": 10, "accum_tokens": 2048, "log_every": 5,
       "dist_timeout_s": 30.0, "draft_vocab": 512}
PARAMS = {"steps": 6, "lr": 0.01, "warmup_steps": 1, "ckpt_every": 2, "dist_timeout_s": 30.0}  # the fault tests
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled"}
TIMEOUT_S = 8.0  # dist_timeout_s of the killed-rank test
FIGURES = ("loss", "acc", "grad_norm", "lr", "heldout_loss")  # what a metrics row logs of a step


def _weight_ratio() -> float:
    """The smoke preset's smallest scored-position weight over its largest (`one_flip`)."""
    from dflash_lib.models.anchors import decay_weights, default_gamma

    m = preset("smoke").model
    w = decay_weights(m.block_size, m.gamma or default_gamma(m.block_size))[1:]
    return float(w.min() / w.max())


WEIGHT_RATIO = _weight_ratio()


def cli_params(params: dict) -> list[str]:
    return [x for k, v in params.items() for x in ("-p", k, v if isinstance(v, str) else json.dumps(v))]


def torchrun_cmd(run_dir: Path, *extra: str, params: dict, launch: tuple = ("--standalone", "--nproc-per-node", "2"),
                 program: tuple = ("-m", "dflash_lib")) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", *launch, *program, "train", "--preset", "smoke",
            "--run-dir", str(run_dir), *cli_params(params), *extra]


def torchrun(run_dir: Path, *extra: str, params: dict = PARAMS) -> subprocess.CompletedProcess:
    proc = subprocess.run(torchrun_cmd(run_dir, *extra, params=params), cwd=REPO, env=ENV, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def rewind(src: Path, dst: Path, step: int) -> Path:
    """A copy of run folder `src` as a run stopped after `step` would have left it (checkpoints up to it)."""
    shutil.copytree(src, dst)
    for p in list_checkpoints(dst / "checkpoints"):
        if int(p.name.split("-")[1]) > step:
            shutil.rmtree(p)
    shutil.rmtree(dst / "drafter")
    (dst / "summary.json").unlink()
    return dst


def in_process(run_dir: Path, params: dict, data_shards: int) -> dict:
    """One process planned for `data_shards` shards: what a resume of a `data_shards`-rank run at world size 1
    does, from step 0 (the reference a W-rank run must equal)."""
    config = from_params(params, preset("smoke"))
    prepare_run_dir(config, run_dir)
    return run_training(config, build_parts(config, torch.device("cpu"), data_shards), run_dir)


def trajectory_atol(want: list[dict]) -> float:
    """What two runs of the same global batches may differ by in a logged figure (FIGURES): each is a sum over a
    step's tokens that the other run rounds in another order (gloo's sums of two ranks, another micro-batch
    grouping, kernels at another thread count), so rounding_atol of `want`'s largest figure over the most real
    tokens a step holds, in fp32. The weights they come from differ by ~1e-6 (`weight_atol`), which through
    gradients of norm < 1 moves a figure by far less."""
    figures = torch.tensor([abs(r[k]) for r in want for k in FIGURES if r.get(k) is not None])
    return rounding_atol(figures, terms=max(r["real_tokens"] for r in want), dtype=torch.float32)


def rounding_twin(run_dir: Path, params: dict, data_shards: int, seed: int) -> Path:
    """`in_process` once more with every micro-batch's gradient term moved by one ulp at random (x (1 + eps
    U(-1, 1)) per element, before it is accumulated): two summation orders round a term to neighbouring floats.
    How far the run carries that is its noise floor: AdamW divides each element by its own RMS sqrt(v), so where
    the terms of a gradient element cancel, one ulp of theirs moves the weight by far more than one ulp of it."""
    config = from_params(params, preset("smoke"))
    prepare_run_dir(config, run_dir)
    parts = build_parts(config, torch.device("cpu"), data_shards)
    gen, eps = torch.Generator().manual_seed(seed), torch.finfo(torch.float32).eps
    for p in parts.drafter.parameters():
        if p.requires_grad:
            p.register_hook(lambda g: g * (1 + eps * (2 * torch.rand(g.shape, generator=gen) - 1)))
    run_training(config, parts, run_dir)
    return run_dir


def weight_atol(want_dir: Path, twins: list[Path], params: dict) -> float:
    """The exported weights of two runs of the same global batches: k times the noise floor (the largest weight
    difference of the `twins` from `want_dir`; two of them, as one realisation can fall several times short of
    another). k = 2 sqrt(log2 token_budget): a real run's gradient term is a sum over up to token_budget tokens,
    which another kernel's blocked summation may round ~log2(token_budget) times differently (a random walk of
    sqrt(log2 T) ulps where the twins move it by one), and 2 standard deviations of that walk."""
    want = load_file(str(want_dir / "drafter" / "model.safetensors"))
    floor = max(float((load_file(str(t / "drafter" / "model.safetensors"))[n] - w).abs().max())
                for t in twins for n, w in want.items() if w.is_floating_point())
    assert floor > 0  # the twins really moved: a floor of 0 would ask for equal weights
    return 2 * math.sqrt(math.log2(from_params(params, preset("smoke")).sampler.token_budget)) * floor


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    """One process training the global batches of 2 data shards, 20 steps."""
    run_dir = tmp_path_factory.mktemp("one_process_two_shards")
    summary = in_process(run_dir, RUN, 2)
    assert (summary.world_size, summary.data_shards, summary.steps) == (1, 2, 20)
    return run_dir


@pytest.fixture(scope="module")
def reference_weight_atol(reference, tmp_path_factory) -> float:
    """`weight_atol` of the reference from two rounding twins of it (a few seconds each)."""
    twins = [rounding_twin(tmp_path_factory.mktemp(f"twin{seed}"), RUN, 2, seed) for seed in (0, 1)]
    return weight_atol(reference, twins, RUN)


@pytest.fixture(scope="module")
def one_process(tmp_path_factory) -> Path:
    """One process training the global batches of ONE data shard, 20 steps (the run every 1 -> 2 resume copies)."""
    run_dir = tmp_path_factory.mktemp("one_process_one_shard")
    summary = train(from_params(RUN, preset("smoke")), run_dir)
    assert (summary.world_size, summary.data_shards) == (1, 1)
    return run_dir


@pytest.fixture(scope="module")
def ddp(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    run_dir = tmp_path_factory.mktemp("ddp")
    return run_dir, torchrun(run_dir, params=RUN)


@pytest.mark.slow
def test_ddp_on_two_ranks_equals_one_process_and_resumes_on_one(ddp, reference, tmp_path):
    run_dir, proc = ddp
    got, want = metrics_rows(run_dir), metrics_rows(reference)
    assert_same_trajectory(got, want, atol=trajectory_atol(want), acc_flips=one_flip(want, WEIGHT_RATIO))
    assert [2 * r["micro_batches"] for r in got] == [r["micro_batches"] for r in want]  # each rank half of them
    assert sum(r["micro_batches"] >= 2 for r in got) >= 2  # accumulation on each rank: no_sync really ran
    assert len([line for line in proc.stdout.splitlines() if re.match(r"step \d+ \| loss", line)]) == 4  # rank 0
    summary = json.loads((run_dir / "summary.json").read_text())
    assert (summary["world_size"], summary["data_shards"], summary["parallel"]) == (2, 2, "ddp")
    ckpt = run_dir / "checkpoints" / "ckpt-00000020"
    assert read_manifest(ckpt).world_size == 2
    assert {"dcp/__0_0.distcp", "dcp/__1_0.distcp"} <= set(read_manifest(ckpt).files)  # both ranks wrote a part
    # 2 -> 1: one process resumes the 2-rank run's step-10 checkpoint and takes both data shards of each step
    resumed = rewind(run_dir, tmp_path / "two_to_one", 10)
    summary = train(from_params(RUN, preset("smoke")), resumed)
    assert (summary.world_size, summary.data_shards, summary.resumed_from_step) == (1, 2, 10)
    assert_same_trajectory(metrics_rows(resumed), want, atol=trajectory_atol(want), acc_flips=one_flip(want, WEIGHT_RATIO))


@pytest.mark.slow
def test_fsdp_on_two_ranks_equals_one_process_and_exports_plain_full_weights(reference, reference_weight_atol,
                                                                              tmp_path):
    run_dir = tmp_path / "fsdp"
    torchrun(run_dir, "-p", "parallel", "fsdp", params=RUN)
    want = metrics_rows(reference)
    assert_same_trajectory(metrics_rows(run_dir), want, atol=trajectory_atol(want), acc_flips=one_flip(want, WEIGHT_RATIO))
    assert json.loads((run_dir / "summary.json").read_text())["parallel"] == "fsdp"
    # the exported drafter: the same names and full tensors as one process wrote (no `module.`, no DTensor)
    got, want = (load_file(str(d / "drafter" / "model.safetensors")) for d in (run_dir, reference))
    assert sorted(got) == sorted(want)
    for name, w in want.items():
        assert type(got[name]) is torch.Tensor and got[name].shape == w.shape, name
        torch.testing.assert_close(got[name], w, rtol=0, atol=reference_weight_atol)
    # the FSDP checkpoint (each rank wrote its shard) reads back as plain full tensors in one process
    state, manifest = load_checkpoint(run_dir / "checkpoints" / "ckpt-00000020")
    assert manifest.world_size == 2 and {"dcp/__0_0.distcp", "dcp/__1_0.distcp"} <= set(manifest.files)
    one = load_checkpoint(reference / "checkpoints" / "ckpt-00000020")[0]
    assert sorted(state["drafter"]) == sorted(one["drafter"]) and not any("module." in k for k in state["drafter"])
    for name, w in one["drafter"].items():
        assert type(state["drafter"][name]) is torch.Tensor and state["drafter"][name].shape == w.shape, name


@pytest.mark.slow
def test_a_target_sharded_over_two_ranks_equals_one_process_and_stops_and_resumes_exactly(reference,
                                                                                          reference_weight_atol,
                                                                                          tmp_path):
    """target_parallel fsdp: the target's layers all-gathered in the feed threads on a group of their own; the
    same trajectory and final weights as one process, and a run stopped mid-stream (its feeds leave together)
    resumes onto it, the drafter now under FSDP2 too (two FSDP trees, one per thread, each on its own group)."""
    sharded = ("-p", "target_parallel", "fsdp")
    run_dir = tmp_path / "sharded"
    proc = torchrun(run_dir, *sharded, params=RUN)
    assert "target sharded over 2 ranks with FSDP2" in proc.stdout
    rows = metrics_rows(reference)
    assert_same_trajectory(metrics_rows(run_dir), rows, atol=trajectory_atol(rows), acc_flips=one_flip(rows, WEIGHT_RATIO))
    got, want = (load_file(str(d / "drafter" / "model.safetensors")) for d in (run_dir, reference))
    assert sorted(got) == sorted(want)
    for name, w in want.items():
        torch.testing.assert_close(got[name], w, rtol=0, atol=reference_weight_atol)
    resumed = tmp_path / "stopped"
    torchrun(resumed, *sharded, "-p", "stop_at_step", "7", params=RUN)
    assert [r["step"] for r in metrics_rows(resumed)] == list(range(1, 8))
    assert "resuming from" in torchrun(resumed, *sharded, "-p", "parallel", "fsdp", params=RUN).stdout
    assert_same_trajectory(metrics_rows(resumed), rows, atol=trajectory_atol(rows), acc_flips=one_flip(rows, WEIGHT_RATIO))


@pytest.mark.slow
def test_loss_ce_kl_with_a_target_sharded_over_two_ranks_equals_one_process(tmp_path):
    """loss ce+kl reads the target's final states at the scored rows: with the target sharded, every pass (the
    feed's, the feed's filler pass for a rank without a batch, the held-out evaluation's) runs every layer on both
    ranks (the zero-weight filler item runs none), and the
    trajectory, held-out figures and final weights are one process's on the same global batches."""
    params = {**RUN, "steps": 8, "ckpt_every": 4, "log_every": 4, "loss": "ce+kl", "kl_temperature": 1.5,
              "eval_every": 4}
    want_dir = tmp_path / "one"
    summary = in_process(want_dir, params, 2)
    assert (summary.world_size, summary.data_shards, summary.steps) == (1, 2, 8)
    run_dir = tmp_path / "sharded_kl"
    proc = torchrun(run_dir, "-p", "target_parallel", "fsdp", params=params)
    assert "target sharded over 2 ranks with FSDP2" in proc.stdout
    got, want = metrics_rows(run_dir), metrics_rows(want_dir)
    assert_same_trajectory(got, want, atol=trajectory_atol(want), acc_flips=one_flip(want, WEIGHT_RATIO))
    assert sum(r["micro_batches"] >= 2 for r in got) >= 1  # accumulation under no_sync on each rank
    held = [(r["step"], r["heldout_loss"]) for r in want if r.get("heldout_loss") is not None]
    assert held and [r["step"] for r in got if r.get("heldout_loss") is not None] == [s for s, _ in held]
    np.testing.assert_allclose([r["heldout_loss"] for r in got if r.get("heldout_loss") is not None],
                               [v for _, v in held], rtol=0, atol=trajectory_atol(want))
    got_w, want_w = (load_file(str(d / "drafter" / "model.safetensors")) for d in (run_dir, want_dir))
    assert sorted(got_w) == sorted(want_w)
    atol = weight_atol(want_dir, [rounding_twin(tmp_path / f"twin{seed}", params, 2, seed) for seed in (0, 1)],
                       params)
    for name, w in want_w.items():
        torch.testing.assert_close(got_w[name], w, rtol=0, atol=atol)


@pytest.mark.slow
@pytest.mark.parametrize("target_parallel", ["replicate", "fsdp"])
def test_a_one_process_run_resumed_on_two_ranks_continues_its_trajectory(one_process, tmp_path, target_parallel):
    """1 -> 2: the run's global batch is ONE data shard, so rank 1 takes none and joins every step's gradient
    reduction with a zero-weight filler (and, with a sharded target, every sampler step's all-gathers with a
    filler pass); the trajectory is the one-process run's."""
    one = one_process
    resumed = rewind(one, tmp_path / "one_to_two", 10)
    torchrun(resumed, "-p", "async_ckpt", "true", "-p", "target_parallel", target_parallel,
             params=RUN)  # and saved in the background, committed at the end
    summary = json.loads((resumed / "summary.json").read_text())
    assert (summary["world_size"], summary["data_shards"], summary["resumed_from_step"]) == (2, 1, 10)
    want = metrics_rows(one)
    assert_same_trajectory(metrics_rows(resumed), want, atol=trajectory_atol(want), acc_flips=one_flip(want, WEIGHT_RATIO))
    assert read_manifest(resumed / "checkpoints" / "ckpt-00000020").world_size == 2


@pytest.mark.slow
def test_two_nodes_through_c10d_rendezvous_equal_the_standalone_run(ddp, tmp_path):
    """`torchrun --nnodes 2 --nproc-per-node 1 --rdzv-backend c10d --rdzv-endpoint HOST:PORT`, both "nodes" on
    localhost: the same 2-rank run as --standalone (its first 4 steps)."""
    port = free_port()
    launch = ("--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint",
              f"127.0.0.1:{port}", "--rdzv-id", "dflash-test")
    cmd = torchrun_cmd(tmp_path, "-p", "stop_at_step", "4", params=RUN, launch=launch)
    nodes = [subprocess.Popen(cmd, cwd=REPO, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for _ in range(2)]
    try:
        outs = [n.communicate(timeout=300)[0] for n in nodes]
    finally:
        for n in nodes:
            if n.poll() is None:
                n.kill()
                n.wait(timeout=30)
    assert [n.returncode for n in nodes] == [0, 0], "\n".join(o[-2000:] for o in outs)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert (summary["world_size"], summary["steps"]) == (2, 4)
    want = metrics_rows(ddp[0])[:4]
    assert_same_trajectory(metrics_rows(tmp_path), want, atol=trajectory_atol(want), acc_flips=one_flip(want, WEIGHT_RATIO))


@pytest.mark.slow
def test_kill_9_of_the_whole_job_mid_save_then_resume_equals_the_uninterrupted_run(ddp, tmp_path):
    params = {**RUN, "ckpt_every": 5}  # resume-neutral: the same run as the ddp fixture
    torchrun(tmp_path, "-p", "stop_at_step", "5", params=params)  # checkpoint 5
    job = subprocess.Popen(torchrun_cmd(tmp_path, params=params, program=(str(SLOW_SAVE), "60")), cwd=REPO, env=ENV,
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(job.stdout), daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 240
        mark = "slow save: pausing 60.0 s before committing the checkpoint of step 10"
        while not any(mark in line for line in list(lines)):  # every rank wrote its part; no manifest yet
            assert job.poll() is None and time.monotonic() < deadline, "".join(lines[-30:])
            time.sleep(0.05)
    finally:  # torchrun's agent and both ranks at once (each rank runs in a session of its own), as a scheduler
        procs = [job, *psutil.Process(job.pid).children(recursive=True)]  # kills a job's cgroup
        for p in procs:
            p.send_signal(signal.SIGKILL)
        job.wait(timeout=30)
        psutil.wait_procs(procs[1:], timeout=30)
        reader.join(timeout=10)
    ckpt_dir = tmp_path / "checkpoints"
    (partial,) = [p for p in ckpt_dir.iterdir() if p.name.startswith(".")]
    assert partial.name.startswith(".tmp-ckpt-00000010-") and not (partial / "manifest.json").exists()
    assert {"__0_0.distcp", "__1_0.distcp", ".metadata"} <= {p.name for p in (partial / "dcp").iterdir()}
    assert [p.name for p in list_checkpoints(ckpt_dir)] == ["ckpt-00000005"]  # the half-written step 10 is invisible
    proc = torchrun(tmp_path, params=params)
    assert f"resuming from {ckpt_dir / 'ckpt-00000005'}" in proc.stdout
    want = metrics_rows(ddp[0])
    assert_same_trajectory(metrics_rows(tmp_path), want, atol=trajectory_atol(want), acc_flips=one_flip(want, WEIGHT_RATIO))
    assert not [p for p in ckpt_dir.iterdir() if p.name.startswith(".")]  # the dead save's temp was cleaned up


@contextlib.contextmanager
def two_ranks_at_step_3(run_dir: Path, params: dict):
    """Two training ranks started by hand, as torchrun would start them; yields (rank0, rank1, rank 0's output
    lines, read live) once rank 0 has logged step 3. Every rank is killed on the way out if still running."""
    port = free_port()
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
@pytest.mark.parametrize("target_parallel", ["replicate", "fsdp"])
def test_sigterm_to_one_rank_stops_both_after_the_same_step_with_a_checkpoint_and_a_resume_continues(
        tmp_path, target_parallel):
    """A scheduler may signal one task first: the stop is agreed over all ranks at the step boundary, every rank
    exits 0, the checkpoint holds the last step logged, and torchrun resumes from it. With a sharded target, the
    feeds reading ahead of the stop leave their handshake together: no rank waits for an all-gather."""
    params = {**PARAMS, "steps": 400, "target_parallel": target_parallel}
    with two_ranks_at_step_3(tmp_path, params) as (rank0, rank1, lines):
        rank1.send_signal(signal.SIGTERM)  # rank 0 gets nothing
        codes = [p.wait(timeout=120) for p in (rank0, rank1)]
    out = "\n".join(lines)
    assert codes == [0, 0], out[-3000:] + rank1.stdout.read()[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    stopped = summary["steps"]
    assert not summary["complete"] and 3 <= stopped < params["steps"]
    assert summary["stop_reason"] == "a stop signal on another rank"  # rank 0 writes: it was not signalled
    assert [r["step"] for r in metrics_rows(tmp_path)] == list(range(1, stopped + 1))
    assert list_checkpoints(tmp_path / "checkpoints")[-1].name == f"ckpt-{stopped:08d}"
    resumed = torchrun(tmp_path, "-p", "stop_at_step", str(stopped + 2), params=params)
    assert "resuming from" in resumed.stdout
    assert [r["step"] for r in metrics_rows(tmp_path)] == list(range(1, stopped + 3))


@pytest.mark.slow
def test_a_cached_target_without_an_engine_trains_on_two_ranks_as_in_one_process(tmp_path):
    """`-p hidden_cache` with no engine under torchrun: one process trains 6 steps from the cache (one data shard),
    two ranks resume it at step 3, rank 1 without a batch on any step: its zero-weight filler item needs no
    feature of the target (none of its tokens is in the cache). The trajectory is the one process's."""
    from test_hidden_cache import CACHED, capture_locally, tiny_target_folder

    params = {**CACHED, "target": str(tiny_target_folder(tmp_path))}
    capture_locally(from_params(params, preset("smoke")), tmp_path / "cache")
    params["hidden_cache"] = str(tmp_path / "cache")
    one = tmp_path / "one"
    train(from_params(params, preset("smoke")), one)
    resumed = rewind(one, tmp_path / "one_to_two", 3)
    torchrun(resumed, params=params)
    summary = json.loads((resumed / "summary.json").read_text())
    assert (summary["world_size"], summary["data_shards"], summary["resumed_from_step"]) == (2, 1, 3)
    want = metrics_rows(one)
    assert_same_trajectory(metrics_rows(resumed), want, atol=trajectory_atol(want), acc_flips=one_flip(want, WEIGHT_RATIO))
