"""Fault injection through the real command line: kill -9 (during training and during a checkpoint save),
SIGTERM, a failing pipeline stage, a full disk, read-only run and cache folders; in process: non-finite losses and
samples failing validation."""

from __future__ import annotations

import json
import math
import os
import resource
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from checkpoints import load_latest
from dflash_lib.config import from_params, preset
from dflash_lib.models import DFlashDrafter, DrafterConfig
from dflash_lib.target.local import TargetModel
from dflash_lib.plan.sampler import FixedBatchSampler
from dflash_lib.train.build import TrainingParts
from dflash_lib.rundir.checkpoints import list_checkpoints
from dflash_lib.train.loop import run_training
from dflash_lib.train.resume import resume_config_hash
from dflash_lib.train.state import NonFiniteLossError, StopRequest
from run_folder import metric_column, metrics_rows

REPO = Path(__file__).resolve().parent.parent
SLOW_SAVE = REPO / "tests" / "slow_save.py"  # the command line with every save held before its commit
PARAMS = ["-p", "steps", "12", "-p", "lr", "0.01", "-p", "warmup_steps", "1", "-p", "ckpt_every", "3"]
CONFIG = from_params({"steps": 12, "lr": 0.01, "warmup_steps": 1, "ckpt_every": 3}, preset("smoke"))
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled"}  # the same threads in every run: same sums


def cli(run_dir: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "dflash_lib", "train", "--preset", "smoke", "--run-dir", str(run_dir), *PARAMS,
            *extra]


def run_cli(run_dir: Path, *extra: str, env: dict | None = None, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(cli(run_dir, *extra), cwd=REPO, env=env or ENV, capture_output=True, text=True,
                          timeout=240, **kw)


def assert_same_run(run_dir: Path, reference: list[dict]) -> None:
    got = metrics_rows(run_dir)
    assert [r["step"] for r in got] == list(range(1, 13))
    assert [r["real_tokens"] for r in got] == [r["real_tokens"] for r in reference]
    np.testing.assert_allclose(metric_column(got, "loss"), metric_column(reference, "loss"), rtol=0, atol=1e-6)


class Watched:
    """A CLI training process (`cmd`, by default `cli(run_dir)`) whose merged stdout/stderr lines are collected
    by a reader thread."""

    def __init__(self, run_dir: Path, env: dict, cmd: list[str] | None = None) -> None:
        self.proc = subprocess.Popen(cmd or cli(run_dir), cwd=REPO, env=env, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True)
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))

    def wait_for(self, prefix: str, timeout_s: float = 180.0) -> str:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            hit = next((line for line in list(self.lines) if line.startswith(prefix)), None)
            if hit is not None:
                return hit
            if self.proc.poll() is not None and not self._reader.is_alive():
                break
            time.sleep(0.02)
        self.kill()
        raise AssertionError(f"no line starting with {prefix!r}; output:\n" + "\n".join(self.lines[-30:]))

    def finish(self, timeout_s: float = 60.0) -> int:
        rc = self.proc.wait(timeout=timeout_s)
        self._reader.join(timeout=10)
        return rc

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=30)


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> list[dict]:
    run_dir = tmp_path_factory.mktemp("reference")
    proc = run_cli(run_dir)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return metrics_rows(run_dir)


@pytest.mark.slow
def test_kill_9_during_training_then_resume(tmp_path, reference):
    w = Watched(tmp_path, ENV)
    w.wait_for("step 7 |")  # checkpoints of steps 3 and 6 are behind it
    w.kill()
    assert w.proc.returncode == -signal.SIGKILL
    state, path = load_latest(tmp_path / "checkpoints", resume_config_hash(CONFIG))
    assert state["step"] >= 6 and path.name == f"ckpt-{state['step']:08d}"
    proc = run_cli(tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"resuming from {path}" in proc.stdout
    assert_same_run(tmp_path, reference)


@pytest.mark.slow
def test_kill_9_in_the_middle_of_a_checkpoint_save_keeps_the_previous_one(tmp_path, reference):
    first = run_cli(tmp_path, "-p", "stop_at_step", "4")  # checkpoints 3 and 4
    assert first.returncode == 0, first.stderr[-3000:]
    # every save pauses after its shards, before its manifest
    w = Watched(tmp_path, ENV, [sys.executable, str(SLOW_SAVE), "60", *cli(tmp_path)[3:]])
    w.wait_for("slow save: pausing 60.0 s before committing the checkpoint of step 6")
    w.kill()
    ckpt_dir = tmp_path / "checkpoints"
    (partial,) = [p for p in ckpt_dir.iterdir() if p.name.startswith(".")]
    assert partial.name.startswith(".tmp-ckpt-00000006-")  # every shard written, the manifest not yet
    assert (partial / "dcp" / ".metadata").is_file() and (partial / "dcp" / "__0_0.distcp").is_file()
    assert (partial / "objects.pt").is_file() and not (partial / "manifest.json").exists()
    assert [p.name for p in list_checkpoints(ckpt_dir)] == ["ckpt-00000003", "ckpt-00000004"]
    state, path = load_latest(ckpt_dir, resume_config_hash(CONFIG))
    assert path.name == "ckpt-00000004" and state["step"] == 4  # the half-written step 6 is invisible
    proc = run_cli(tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert_same_run(tmp_path, reference)
    assert not [p for p in ckpt_dir.iterdir() if p.name.startswith(".")]  # the dead save's temp was cleaned up


@pytest.mark.slow
def test_sigterm_saves_a_checkpoint_exits_0_and_resumes(tmp_path, reference):
    w = Watched(tmp_path, ENV)
    w.wait_for("step 4 |")
    w.proc.send_signal(signal.SIGTERM)
    assert w.finish() == 0, "\n".join(w.lines[-20:])
    out = "\n".join(w.lines)
    assert "received SIGTERM: finishing the current step, then saving a checkpoint" in out
    stopped = next(line for line in w.lines if line.startswith("stopped (SIGTERM) after step"))
    step = int(stopped.split()[4])
    assert step >= 4 and f"checkpoint {tmp_path / 'checkpoints' / f'ckpt-{step:08d}'}" in stopped
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert (summary["complete"], summary["stop_reason"], summary["steps"]) == (False, "SIGTERM", step)
    state, _ = load_latest(tmp_path / "checkpoints", resume_config_hash(CONFIG))
    assert state["step"] == step
    proc = run_cli(tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads((tmp_path / "summary.json").read_text())["complete"]
    assert_same_run(tmp_path, reference)


STAGE_FAILURE = """
import sys
from dflash_lib.__main__ import main
from dflash_lib.target.local import TargetModel

original, calls = TargetModel.context_features, []

def failing(self, batch, *args, **kwargs):
    calls.append(1)
    if len(calls) == 3:
        raise RuntimeError("injected fault in the target forward")
    return original(self, batch, *args, **kwargs)

TargetModel.context_features = failing
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.slow
def test_a_failing_stage_exits_non_zero_naming_the_stage(tmp_path):
    cmd = [sys.executable, "-c", STAGE_FAILURE] + cli(tmp_path)[3:]
    proc = subprocess.run(cmd, cwd=REPO, env=ENV, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert ("error: PipelineError: stage 'target[0]' failed: RuntimeError: injected fault in the target forward"
            in proc.stderr)
    steps = [r["step"] for r in metrics_rows(tmp_path)]  # the failure aborts the queues: 2 batches at most before it
    assert steps in ([1], [1, 2])


def _limit_file_size(limit_bytes: int):
    def apply() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit then fails with EFBIG
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit_bytes, limit_bytes))
    return apply


@pytest.mark.slow
def test_a_full_disk_during_a_save_is_a_clear_error_and_the_previous_checkpoint_stays_valid(tmp_path, reference):
    first = run_cli(tmp_path, "-p", "stop_at_step", "3")
    assert first.returncode == 0, first.stderr[-3000:]
    ckpt_dir = tmp_path / "checkpoints"
    size = (ckpt_dir / "ckpt-00000003" / "dcp" / "__0_0.distcp").stat().st_size  # the weights and AdamW bytes
    proc = run_cli(tmp_path, preexec_fn=_limit_file_size(size // 2))  # metrics rows etc. stay far below it
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert (f"error: CheckpointError: could not write the checkpoint of step 6 to {ckpt_dir}: File too large "
            f"[EFBIG]") in proc.stderr
    assert "the previous checkpoints (ckpt-00000003) are untouched" in proc.stderr
    assert [p.name for p in ckpt_dir.iterdir()] == ["ckpt-00000003"]  # no temp left behind
    state, path = load_latest(ckpt_dir, resume_config_hash(CONFIG))
    assert path.name == "ckpt-00000003"
    again = run_cli(tmp_path)  # space again: resumes from step 3
    assert again.returncode == 0, again.stderr[-3000:]
    assert_same_run(tmp_path, reference)


# -- read-only run and cache folders: one line, exit 2, no run folder ----------------------------------------------


@pytest.fixture
def read_only(tmp_path, monkeypatch) -> Path:
    """A folder `ro` whose tree behaves as on a read-only mount (EROFS on every write, EEXIST on mkdir of what
    exists), faked at the os level: tests run as root, whom permission bits do not stop."""
    import builtins
    import errno
    import io

    root = tmp_path / "ro"
    root.mkdir()

    def inside(path) -> bool:
        return isinstance(path, (str, os.PathLike)) and os.path.abspath(os.fspath(path)).startswith(str(root))

    def refuse(path):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), os.fspath(path))

    def guard(real, writes):
        def call(path, *args, **kwargs):
            if inside(path) and writes(*args, **kwargs):
                refuse(path)
            return real(path, *args, **kwargs)
        return call

    def mkdir(path, *args, **kwargs):
        if inside(path):
            if os.path.lexists(path):
                raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), os.fspath(path))
            refuse(path)
        return real_mkdir(path, *args, **kwargs)

    def writing(mode="r", *args, **kwargs) -> bool:
        return any(c in mode for c in "wax+")

    real_mkdir = os.mkdir
    monkeypatch.setattr(os, "mkdir", mkdir)
    for module in (io, builtins):
        monkeypatch.setattr(module, "open", guard(io.open, writing))
    for name in ("replace", "rename", "unlink", "remove", "rmdir"):
        monkeypatch.setattr(os, name, guard(getattr(os, name), lambda *args, **kwargs: True))
    return root


def assert_one_line(err: str, *parts: str) -> None:
    assert err.startswith("error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    for part in parts:
        assert part in err, err


def test_a_read_only_run_folder_is_one_line_exit_2_and_leaves_nothing(read_only, capsys, monkeypatch):
    from dflash_lib.__main__ import main

    args = ["train", "--preset", "smoke", "-p", "steps", "1"]
    run_dir = read_only / "run"
    assert main([*args, "--run-dir", str(run_dir)]) == 2  # to be made on the read-only mount
    assert_one_line(capsys.readouterr().err, f"cannot write the run folder {run_dir}: Read-only file system")
    assert not run_dir.exists()
    assert main([*args, "--run-dir", str(read_only)]) == 2  # an existing read-only folder
    assert_one_line(capsys.readouterr().err, f"cannot write the run folder {read_only}: Read-only file system",
                    str(read_only / "config.json.tmp"))
    assert main([*args, "--run-dir", str(read_only), "--fresh"]) == 2
    assert_one_line(capsys.readouterr().err, f"cannot write the run folder {read_only}")
    assert list(read_only.iterdir()) == []
    monkeypatch.setattr("dflash_lib.rundir.RUNS_ROOT", read_only / "runs")  # the default: a new folder under runs/
    assert main(args) == 2
    assert_one_line(capsys.readouterr().err, f"cannot write the runs folder {read_only / 'runs'}: Read-only file "
                                             f"system")
    assert list(read_only.iterdir()) == []


def test_a_read_only_cache_folder_is_one_line_exit_2_and_makes_no_run_folder(read_only, tmp_path, capsys):
    from dflash_lib.__main__ import main

    cache = read_only / "cache"
    assert main(["train", "--preset", "smoke", "--run-dir", str(tmp_path / "run"), "-p", "cache_dir", str(cache)]) == 2
    assert_one_line(capsys.readouterr().err, f"cannot write the token store cache (-p cache_dir) {cache}: Read-only "
                                             f"file system")
    assert not (tmp_path / "run").exists() and list(read_only.iterdir()) == []


def _read_only_mount_works(folder: Path) -> bool:
    """Whether this machine lets us mount a read-only tmpfs on `folder` in a private mount namespace."""
    if shutil.which("unshare") is None:
        return False
    probe = subprocess.run(["unshare", "-rm", "sh", "-c", 'mount -t tmpfs -o ro tmpfs "$0"', str(folder)],
                           capture_output=True, timeout=30)
    return probe.returncode == 0


@pytest.mark.slow
def test_on_a_real_read_only_tmpfs_run_and_cache_folders_are_one_line_exit_2(tmp_path):
    """The same refusals on a real read-only mount (a tmpfs mounted ro in a private mount namespace)."""
    ro = tmp_path / "ro"
    ro.mkdir()
    if not _read_only_mount_works(ro):
        pytest.skip("cannot mount a read-only tmpfs here (no unshare, or user namespaces are not allowed)")
    script = (
        "import contextlib, io, json, sys\n"
        "from dflash_lib.__main__ import main\n"
        "ro, out = sys.argv[1], sys.argv[2]\n"
        "train = ['train', '--preset', 'smoke', '-p', 'steps', '1']\n"
        "results = []\n"
        "for extra in (['--run-dir', ro + '/run'], ['--run-dir', ro], ['--run-dir', out, '-p', 'cache_dir', ro + '/c']):\n"
        "    err = io.StringIO()\n"
        "    with contextlib.redirect_stderr(err):\n"
        "        rc = main(train + extra)\n"
        "    results.append([rc, err.getvalue()])\n"
        "print(json.dumps(results))\n")
    proc = subprocess.run(["unshare", "-rm", "sh", "-c", 'mount -t tmpfs -o ro tmpfs "$0" && exec "$@"', str(ro),
                           sys.executable, "-c", script, str(ro), str(tmp_path / "run")],
                          cwd=REPO, env=ENV, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (rc1, err1), (rc2, err2), (rc3, err3) = json.loads(proc.stdout.splitlines()[-1])
    assert (rc1, rc2, rc3) == (2, 2, 2)
    assert_one_line(err1, f"cannot write the run folder {ro / 'run'}: Read-only file system")
    assert_one_line(err2, f"cannot write the run folder {ro}: Read-only file system")
    assert_one_line(err3, f"cannot write the token store cache (-p cache_dir) {ro / 'c'}: Read-only file system")
    assert not (tmp_path / "run").exists()


# -- in process: stop requests, non-finite losses, bad samples ----------------------------------------------------


def test_stop_request_turns_the_first_signal_into_a_flag_and_the_second_into_an_abort():
    before = signal.getsignal(signal.SIGTERM)
    with StopRequest() as stop:
        assert stop.installed and not stop.requested
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop.requested and stop.reason == "SIGTERM"
        with pytest.raises(KeyboardInterrupt, match="second stop signal"):
            os.kill(os.getpid(), signal.SIGINT)
    assert signal.getsignal(signal.SIGTERM) is before
    inert = StopRequest()
    threading.Thread(target=inert.__enter__).start()  # not the main thread: installs nothing
    assert not inert.installed


def small_store(n: int = 24) -> list:
    rng = np.random.default_rng(0)
    store = []
    for length in rng.integers(12, 40, size=n):
        mask = np.zeros(length, np.uint8)
        mask[length // 3:] = 1
        store.append((rng.integers(0, 2000, size=length), mask))
    return store


def small_parts(config, store: list) -> TrainingParts:
    target = TargetModel.from_model_config(config.model, seed=0)
    torch.manual_seed(0)
    drafter = DFlashDrafter(DrafterConfig.from_model_config(config.model, target), target)
    lengths = np.array([len(t) for t, _ in store], dtype=np.int64)
    sampler = FixedBatchSampler([list(range(i, i + 4)) for i in range(0, len(store), 4)])
    return TrainingParts(store, lengths, sampler, [target], drafter, 0, False, 0, [])


def small_config(**params):
    base = dict(steps=6, log_every=1, prefetch=2, hs_queue=1, wandb_mode="disabled", ckpt_every=2)
    return from_params({**base, **params}, preset("smoke"))


def poison(drafter: DFlashDrafter, bad_calls: set[int]) -> None:
    """Make the drafter's loss NaN on the given (1-based) calls, as a numerical blow-up would."""
    original, calls = drafter.loss, [0]

    def loss(*args, **kwargs):
        calls[0] += 1
        out = original(*args, **kwargs)
        if calls[0] in bad_calls:
            out.loss = out.loss * math.nan
            out.ce_total = out.ce_total * math.nan
        return out

    drafter.loss = loss


def test_a_non_finite_loss_skips_the_step_and_is_counted(tmp_path, capsys):
    config = small_config()
    parts = small_parts(config, small_store())
    poison(parts.drafter, {3})  # one micro-batch per step: call 3 = step 3
    summary = run_training(config, parts, tmp_path)
    table = metrics_rows(tmp_path)
    assert summary.steps == 6 and summary.bad_steps == 1
    assert [r["skipped"] for r in table] == [False, False, True, False, False, False]
    assert table[2]["loss"] is None and table[2]["grad_norm"] is None and table[3]["bad_steps"] == 1
    assert "step 3: loss is not finite (nan): update skipped (1 in a row, 1 in all" in capsys.readouterr().out


def test_too_many_non_finite_losses_abort_with_the_last_good_checkpoint_intact(tmp_path):
    config = small_config(max_bad_steps=2)
    parts = small_parts(config, small_store())
    poison(parts.drafter, {5, 6})  # steps 5 and 6 blow up; checkpoints every 2 steps
    with pytest.raises(NonFiniteLossError, match="loss was nan for 2 steps in a row \\(up to step 6\\)") as e:
        run_training(config, parts, tmp_path)
    state, path = load_latest(tmp_path / "checkpoints", resume_config_hash(config))
    assert path.name == "ckpt-00000004"
    assert str(e.value).endswith(f"aborting (max_bad_steps=2); the newest checkpoint, {path}, is intact")
    assert state["trainer"]["guard"] == {"in_a_row": 0, "total": 0, "last_bad_step": -1}
    assert not (tmp_path / "summary.json").exists()


def test_an_abort_before_any_checkpoint_says_there_is_none(tmp_path):
    config = small_config(max_bad_steps=2, ckpt_every=0)
    parts = small_parts(config, small_store())
    poison(parts.drafter, {2, 3})
    with pytest.raises(NonFiniteLossError) as e:
        run_training(config, parts, tmp_path)
    assert str(e.value) == ("loss was nan for 2 steps in a row (up to step 3); aborting (max_bad_steps=2); no "
                            f"checkpoint was written yet (none in {tmp_path / 'checkpoints'}): a rerun starts from "
                            "step 0")
    assert not list((tmp_path / "checkpoints").glob("ckpt-*"))


def test_samples_failing_validation_are_skipped_and_counted(tmp_path, capsys):
    store = small_store()
    tok, mask = store[1]
    store[1] = (np.where(np.arange(len(tok)) == 5, 10 ** 7, tok), mask)  # a token id outside the vocabulary
    store[2] = (store[2][0], np.zeros_like(store[2][1]))  # no assistant token
    store[6] = (store[6][0], store[6][1][:-2])  # loss mask shorter than its tokens
    for i in range(8, 12):  # the whole third batch: nothing left to train on
        store[i] = (store[i][0][:0], store[i][1][:0])
    for i in range(12, 16):  # the fourth: valid samples, but one assistant token each, so no anchor to score
        mask = np.zeros_like(store[i][1])
        mask[3] = 1
        store[i] = (store[i][0], mask)
    config = small_config(steps=6, ckpt_every=0)
    summary = run_training(config, small_parts(config, store), tmp_path)
    # the third and fourth batches are read but trained on nothing: no step, so steps 5 and 6 are epoch 1's first
    # two batches (their bad samples skipped again)
    assert summary.steps == 6 and summary.empty_batches == 2 and summary.skipped_samples == {
        "token_out_of_vocab": 2, "no_assistant_token": 2, "mask_length_mismatch": 2, "empty": 4}
    assert summary.skipped_sample_examples["empty"] == ["8", "9", "10"]  # the first few record ids
    table = metrics_rows(tmp_path)
    assert [r["skipped_samples"] for r in table] == [2, 3, 7, 7, 9, 10]
    assert [r["epoch"] for r in table] == [0, 0, 0, 0, 1, 1]
    assert not any(r["skipped"] for r in table) and summary.bad_steps == 0
    said = capsys.readouterr().out
    assert ("epoch 0, sampler step 2: nothing to score (samples failing validation: empty (sample 8), empty "
            "(sample 9), empty (sample 10), empty (sample 11)); not a training step (no update, 2 steps so far)") in said
    assert ("epoch 0, sampler step 3: nothing to score (no anchor block with a position to score); not a training "
            "step (no update, 2 steps so far)") in said
    clean = [len(t) for i, (t, _) in enumerate(store[:8]) if i not in (1, 2, 6)]
    assert table[0]["real_tokens"] + table[1]["real_tokens"] == sum(clean)
    assert table[0]["skipped_tokens"] + table[1]["skipped_tokens"] == sum(len(store[i][0]) for i in (1, 2, 6))
