"""Checkpoints (DCP shards + objects + rank files + manifest): atomic saves, verified loads with fallback,
keep-last-N, config mismatch, another world size, full disk, kill -9."""

from __future__ import annotations

import errno
import json
import logging
import os
import random
import resource
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from checkpoints import load_latest, save_checkpoint
from dflash_lib.rundir import checkpoints as ckpt_format
from dflash_lib.rundir.checkpoints import CheckpointError, list_checkpoints, read_manifest
from dflash_lib.train import checkpoint as ckpt
from dflash_lib.train.checkpoint import CheckpointMismatchError, capture_rng, fresh_run_dir, restore_rng

REPO = Path(__file__).resolve().parent.parent
H = "cfg0123456789abc"  # a config hash for tests


def _train_state(model: torch.nn.Module, opt: torch.optim.Optimizer, sched: object, step: int,
                 anchors: torch.Generator) -> dict:
    return {"model": model.state_dict(), "optimizer": opt.state_dict(), "scheduler": sched.state_dict(),
            "rng": capture_rng(), "anchors": anchors.get_state(), "step": step, "epoch": 0,
            "sampler": {"epoch": 0, "position": step * 4, "order": torch.arange(8)}}


def _make(seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer, object]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.GELU(), torch.nn.Linear(8, 3))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 3))
    return model, opt, sched


def _step(model: torch.nn.Module, opt: torch.optim.Optimizer, sched: object, anchors: torch.Generator) -> float:
    x = torch.randn(5, 6)  # (B, D) from the global torch stream
    noise = torch.rand(5, 3, generator=anchors)  # (B, 3) from the named generator
    jitter = random.random() + float(np.random.rand())
    loss = ((model(x) - noise) ** 2).mean() * (1 + 0.01 * jitter)
    opt.zero_grad()
    loss.backward()
    opt.step()
    sched.step()
    return float(loss.detach())


def _write_steps(d: Path, steps: list[int], keep_last: int = 10, **kw) -> None:
    for s in steps:
        save_checkpoint(d, {"w": torch.full((4,), float(s)), "step": s}, s, config_hash=H, keep_last=keep_last, **kw)


def test_resume_reproduces_the_uninterrupted_losses(tmp_path: Path) -> None:
    """Train 6 steps straight vs. 3 steps, checkpoint, fresh objects, load, 3 more: identical losses."""
    random.seed(1), np.random.seed(1)
    model, opt, sched = _make()
    anchors = torch.Generator().manual_seed(7)
    straight = [_step(model, opt, sched, anchors) for _ in range(6)]

    random.seed(1), np.random.seed(1)
    model, opt, sched = _make()
    anchors = torch.Generator().manual_seed(7)
    first = [_step(model, opt, sched, anchors) for _ in range(3)]
    save_checkpoint(tmp_path, _train_state(model, opt, sched, 3, anchors), 3, config_hash=H)
    for _ in range(5):  # disturb every stream so the resume really depends on the restored state
        random.random(), np.random.rand(), torch.rand(1), torch.rand(1, generator=anchors)

    model, opt, sched = _make(seed=99)
    anchors = torch.Generator()
    state, path = load_latest(tmp_path, H)
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["optimizer"])
    sched.load_state_dict(state["scheduler"])
    restore_rng(state["rng"])
    anchors.set_state(state["anchors"])
    rest = [_step(model, opt, sched, anchors) for _ in range(3)]
    assert path.name == "ckpt-00000003" and state["step"] == 3
    assert torch.equal(state["sampler"]["order"], torch.arange(8))
    np.testing.assert_allclose(first + rest, straight, rtol=0, atol=1e-6)


def test_keep_last_n_deletes_only_older_ones(tmp_path: Path) -> None:
    _write_steps(tmp_path, [1, 2, 3, 4, 5], keep_last=2)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["ckpt-00000004", "ckpt-00000005"]
    assert sorted(os.listdir(tmp_path)) == ["ckpt-00000004", "ckpt-00000005"]  # no temp or trash left


def test_saving_the_same_step_again_replaces_it(tmp_path: Path) -> None:
    save_checkpoint(tmp_path, {"v": 1}, 7, config_hash=H)
    save_checkpoint(tmp_path, {"v": 2}, 7, config_hash=H)
    state, path = load_latest(tmp_path, H)
    assert state["v"] == 2 and sorted(os.listdir(tmp_path)) == ["ckpt-00000007"]


SHARD = f"{ckpt_format.DCP_DIR}/__0_0.distcp"  # the tensor bytes rank 0 wrote


def _flip_byte(p: Path) -> None:
    data = bytearray((p / SHARD).read_bytes())
    data[len(data) // 2] ^= 0xFF
    (p / SHARD).write_bytes(bytes(data))


CORRUPTIONS = {
    "flipped byte": (_flip_byte, "fails its checksum"),
    "truncated": (lambda p: os.truncate(p / SHARD, 100), "truncated"),
    "no manifest": (lambda p: (p / ckpt_format.MANIFEST_FILE).unlink(), "manifest.json is missing"),
    "garbage manifest": (lambda p: (p / ckpt_format.MANIFEST_FILE).write_bytes(b"\x00{not json"), "not valid JSON"),
    "manifest wrong type": (lambda p: (p / ckpt_format.MANIFEST_FILE).write_text(
        (p / ckpt_format.MANIFEST_FILE).read_text().replace('"step": 2', '"step": "2"')), "'step' must be int"),
    "shard missing": (lambda p: (p / SHARD).unlink(), "__0_0.distcp is missing"),
    "objects missing": (lambda p: (p / ckpt_format.OBJECTS_FILE).unlink(), "objects.pt is missing"),
}


@pytest.mark.parametrize("kind", list(CORRUPTIONS))
def test_corrupt_newest_is_refused_and_the_previous_used(tmp_path: Path, kind: str, caplog) -> None:
    _write_steps(tmp_path, [1, 2])
    corrupt, message = CORRUPTIONS[kind]
    corrupt(tmp_path / "ckpt-00000002")
    with caplog.at_level(logging.WARNING, logger="dflash_lib.train.checkpoint"):
        state, path = load_latest(tmp_path, H)
    assert path.name == "ckpt-00000001" and state["step"] == 1 and torch.equal(state["w"], torch.full((4,), 1.0))
    skipped = [r.getMessage() for r in caplog.records if "skipping checkpoint ckpt-00000002" in r.getMessage()]
    assert len(skipped) == 1 and message in skipped[0], caplog.text


@pytest.mark.parametrize("kind", ["truncated", "no manifest"])
def test_a_corrupt_checkpoint_does_not_count_towards_keep_last(tmp_path: Path, kind: str, caplog) -> None:
    """keep_last counts complete checkpoints only: with the corrupt step 3 among the newest, pruning after step
    4 keeps steps 2 and 4 (the two newest good ones) and deletes step 3 and step 1."""
    _write_steps(tmp_path, [1, 2, 3])
    CORRUPTIONS[kind][0](tmp_path / "ckpt-00000003")
    with caplog.at_level(logging.WARNING, logger="dflash_lib.train.checkpoint"):
        _write_steps(tmp_path, [4], keep_last=2)
    assert sorted(os.listdir(tmp_path)) == ["ckpt-00000002", "ckpt-00000004"]
    assert "deleting incomplete or corrupt checkpoint" in caplog.text and "ckpt-00000003" in caplog.text
    state, path = load_latest(tmp_path, H)
    assert path.name == "ckpt-00000004" and state["step"] == 4


def test_no_good_checkpoint_is_an_error_naming_each(tmp_path: Path) -> None:
    _write_steps(tmp_path, [1, 2])
    for p in list_checkpoints(tmp_path):
        _flip_byte(p)
    with pytest.raises(CheckpointError, match=r"no loadable checkpoint in .*ckpt-00000002.*ckpt-00000001.*--fresh"):
        load_latest(tmp_path, H)


def test_empty_or_missing_folder_means_a_fresh_start(tmp_path: Path) -> None:
    assert load_latest(tmp_path, H) is None
    assert load_latest(tmp_path / "absent", H) is None


def test_config_hash_mismatch_is_an_error(tmp_path: Path) -> None:
    _write_steps(tmp_path, [1])
    with pytest.raises(CheckpointMismatchError) as e:
        load_latest(tmp_path, "another")
    assert str(e.value) == (f"run folder {tmp_path} holds checkpoints of another config (hash {H} != another); "
                            f"use --fresh or another --run-dir")


def test_a_checkpoint_of_another_world_size_loads(tmp_path: Path) -> None:
    """DCP reshards and the trainer's data position is global: the world size is recorded, never refused."""
    _write_steps(tmp_path, [1])
    manifest = tmp_path / "ckpt-00000001" / ckpt_format.MANIFEST_FILE
    manifest.write_text(manifest.read_text().replace('"world_size": 1', '"world_size": 2'))
    assert read_manifest(tmp_path / "ckpt-00000001").world_size == 2
    state, _ = load_latest(tmp_path, H)
    assert state["step"] == 1 and torch.equal(state["w"], torch.full((4,), 1.0))


def test_manifest_records_what_was_saved(tmp_path: Path) -> None:
    path = save_checkpoint(tmp_path, {"x": torch.ones(3), "n": 2}, 12, config_hash=H,
                           meta={"epoch": 1.5, "config": {"lr": 0.1}}, rank_state={"rng": torch.arange(3)})
    m = read_manifest(path)
    assert (m.step, m.config_hash, m.world_size, m.format_version) == (12, H, 1, ckpt_format.FORMAT_VERSION)
    assert m.meta == {"epoch": 1.5, "config": {"lr": 0.1}}
    on_disk = sorted(str(p.relative_to(path)) for p in path.rglob("*") if p.is_file() and p.name != "manifest.json")
    assert sorted(m.files) == on_disk == ["dcp/.metadata", SHARD, "objects.pt", "rank-0.pt"]  # every file listed
    assert all(m.files[n].bytes == (path / n).stat().st_size for n in on_disk)
    assert torch.equal(ckpt_format.load_rank_state(path, 0)["rng"], torch.arange(3)) and ckpt_format.load_rank_state(path, 1) is None
    assert torch.load(path / "objects.pt", weights_only=True) == {"x": {"__dcp_tensor__": "x"}, "n": 2}


def test_disk_refusing_a_write_keeps_the_previous_checkpoint(tmp_path: Path) -> None:
    """A file-size limit (EFBIG, as a full disk gives ENOSPC) mid-save: clear error, no temp, previous loads."""
    save_checkpoint(tmp_path, {"w": torch.zeros(10), "step": 1}, 1, config_hash=H)
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    old_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # so the write fails with EFBIG instead of killing us
    resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, hard))
    try:
        with pytest.raises(CheckpointError) as e:
            save_checkpoint(tmp_path, {"w": torch.zeros(1 << 20), "step": 2}, 2, config_hash=H)  # 4 MiB of tensor
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, old_handler)
    msg = str(e.value)
    assert str(tmp_path) in msg and "EFBIG" in msg and "ckpt-00000001" in msg and "untouched" in msg
    assert isinstance(e.value.__cause__, OSError) and e.value.__cause__.errno == errno.EFBIG
    assert sorted(os.listdir(tmp_path)) == ["ckpt-00000001"]
    state, path = load_latest(tmp_path, H)
    assert state["step"] == 1


def test_full_disk_at_fsync_is_reported_and_cleaned(tmp_path: Path, monkeypatch) -> None:
    """Delayed-allocation filesystems report ENOSPC only at fsync: same guarantees."""
    save_checkpoint(tmp_path, {"step": 1}, 1, config_hash=H)
    real_fsync = os.fsync

    def full(fd: int) -> None:
        if not os.path.isdir(f"/proc/self/fd/{fd}"):
            raise OSError(errno.ENOSPC, "No space left on device")
        real_fsync(fd)

    monkeypatch.setattr(ckpt.os, "fsync", full)
    with pytest.raises(CheckpointError, match=r"No space left on device \[ENOSPC\]"):
        save_checkpoint(tmp_path, {"step": 2}, 2, config_hash=H)
    monkeypatch.undo()
    assert sorted(os.listdir(tmp_path)) == ["ckpt-00000001"]
    assert load_latest(tmp_path, H)[0]["step"] == 1


def test_fresh_run_dir_clears_only_checkpoints(tmp_path: Path) -> None:
    _write_steps(tmp_path, [1, 2])
    (tmp_path / ".tmp-ckpt-00000003-999999-0123abcd").mkdir()
    (tmp_path / "metrics.jsonl").write_text("{}\n")
    assert fresh_run_dir(tmp_path) == 3
    assert os.listdir(tmp_path) == ["metrics.jsonl"] and load_latest(tmp_path, H) is None
    assert fresh_run_dir(tmp_path / "absent") == 0


# ---------------------------------------------------------------------------------------------------------
# kill -9 at any moment, seen by a reader: only the public save/load API, whatever the files are called

# One interpreter (torch imported once) forks a writer per round that saves steps back to back until the test
# kills it; the server reports the writer's pid and reaps it, so the pid cannot be reused while the test holds it.
WRITER_SERVER = textwrap.dedent("""
    import os, sys, torch
    import torch.distributed.checkpoint  # imported once here, not in every forked writer
    from dflash_lib.train.checkpoint import start_save
    d, n = sys.argv[1], int(sys.argv[2])
    for line in sys.stdin:  # one line per round: the first step to save
        start = int(line)
        pid = os.fork()
        if pid == 0:
            for step in range(start, start + 1_000_000):
                w = torch.full((n + step % 7,), float(step))  # the size varies too: no two steps share a file
                start_save(d, {"w": w, "step": step}, step, config_hash="h", keep_last=2, meta={"step": step}).wait()
            os._exit(0)
        print(pid, flush=True)
        os.waitpid(pid, 0)
        print("reaped", flush=True)
""")
ATOMIC_N = 1 << 20  # floats per saved tensor: 4 MiB, a save of ~20 ms


def _consistent(state: dict, manifest: ckpt_format.Manifest) -> str | None:
    """Why a loaded checkpoint is not one whole save (None when it is)."""
    step = state.get("step")
    if not (step == manifest.step == manifest.meta.get("step")):
        return f"steps differ: state {step}, manifest {manifest.step}, meta {manifest.meta.get('step')}"
    if not torch.equal(state["w"], torch.full((ATOMIC_N + step % 7,), float(step))):
        return f"weights of step {step} are not the ones saved at step {step}"
    return None


def _watch(d: Path, stop, accepted: list, problems: list) -> None:
    """Poll the folder as a resuming run would: load the newest listed checkpoint. A refusal is allowed only for
    a checkpoint that is no longer there (pruned meanwhile); one refused while still in place is a partial save
    made visible, and one accepted must be a whole save."""
    while not stop.is_set():
        listed = list_checkpoints(d)
        if not listed:
            time.sleep(0.001)
            continue
        newest = listed[-1]
        try:
            state, manifest = ckpt_format.load_checkpoint(newest)
        except CheckpointError as e:
            if newest.is_dir():
                problems.append(f"{newest.name} is listed and in place but refused: {e}")
            continue
        if (why := _consistent(state, manifest)) is not None:
            problems.append(f"{newest.name} loaded but {why}")
        accepted.append(state["step"])


@pytest.mark.slow
def test_a_reader_never_sees_a_partial_checkpoint_while_writers_are_killed(tmp_path: Path) -> None:
    """A watcher thread loads the newest checkpoint over and over while writer processes saving back to back are
    killed (SIGKILL) at random moments; after each kill, at rest, every listed checkpoint loads and the newest is
    the one `load_latest` picks. Bounded: 6 kills or 6 s of rounds."""
    import threading

    d = tmp_path / "ckpts"
    script = tmp_path / "writer_server.py"
    script.write_text(WRITER_SERVER)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1"}  # the library under test, not whichever copy is installed
    server = subprocess.Popen([sys.executable, str(script), str(d), str(ATOMIC_N)], cwd=REPO, env=env, text=True,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    stop, accepted, problems = threading.Event(), [], []
    watcher = threading.Thread(target=_watch, args=(d, stop, accepted, problems), daemon=True)
    watcher.start()
    rng = random.Random(0)
    kills, left_over, newest_seen, writer = 0, 0, -1, None
    try:
        deadline = None
        while kills < 6 and (deadline is None or time.monotonic() < deadline):
            start = (kills + 1) * 100_000  # each round saves steps above every earlier one
            server.stdin.write(f"{start}\n")
            server.stdin.flush()
            line = server.stdout.readline()
            assert line.strip().isdigit(), server.stderr.read()
            writer = int(line)
            if deadline is None:  # the server is up (torch imported): the time bound starts now
                deadline = time.monotonic() + 6.0
            waited = time.monotonic() + 30
            while not (accepted and accepted[-1] >= start):  # the reader has seen this writer's first save
                assert time.monotonic() < waited and not problems, problems or "no save of this round seen in 30 s"
                time.sleep(0.001)
            time.sleep(rng.uniform(0.0, 0.3))  # then die at any moment of a later save
            os.kill(writer, signal.SIGKILL)
            assert server.stdout.readline().strip() == "reaped", server.stderr.read()
            writer, kills = None, kills + 1
            listed = list_checkpoints(d)
            assert listed, "the writer completed no save before it was killed"
            for path in listed:  # at rest: whatever is listed is a whole save
                state, manifest = ckpt_format.load_checkpoint(path)
                assert _consistent(state, manifest) is None, path
            state, path = load_latest(d, "h")
            assert path == listed[-1] and state["step"] >= max(newest_seen, start)
            newest_seen = state["step"]
            left_over += bool(set(os.listdir(d)) - {p.name for p in listed})  # this kill interrupted a save
    finally:
        stop.set()
        if writer is not None:
            os.kill(writer, signal.SIGKILL)
        server.stdin.close()
        server.wait(timeout=30)
        server.stdout.close(), server.stderr.close()
        watcher.join(timeout=30)
    assert problems == []
    assert kills >= 3 and left_over >= 1, (kills, left_over)  # the kills really hit saves in progress
    assert len(accepted) >= 20 and len(set(accepted)) >= 5, (len(accepted), len(set(accepted)))
    # the next save clears what the killed writers left behind, whatever it is called
    save_checkpoint(d, {"w": torch.zeros(1), "step": 0}, newest_seen + 1, config_hash="h", keep_last=2)
    assert sorted(os.listdir(d)) == [p.name for p in list_checkpoints(d)] and len(list_checkpoints(d)) == 2


def test_stale_temp_of_a_live_process_is_left_alone(tmp_path: Path) -> None:
    live = tmp_path / f".tmp-ckpt-00000009-{os.getppid()}-0123abcd"  # the parent process is alive
    dead = tmp_path / ".tmp-ckpt-00000009-4194304-0123abcd"  # above the default pid_max
    live.mkdir(), dead.mkdir()
    save_checkpoint(tmp_path, {"a": 1}, 1, config_hash=H)
    assert live.exists() and not dead.exists()
    assert json.loads((tmp_path / "ckpt-00000001" / ckpt_format.MANIFEST_FILE).read_text())["step"] == 1


class _Plant:
    """A pickle that leaves a file behind when unpickled: a `.metadata` swapped into a checkpoint."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def test_a_swapped_dcp_metadata_is_refused_before_it_is_unpickled(tmp_path: Path) -> None:
    """DCP reads dcp/.metadata with pickle: a file that is not the one the manifest records (its sha256) is
    refused, in one line, before torch reads it, by the trainer's sharded load (`load_into`, which the other ranks
    run without `find_latest`'s verification) as by export's `load_checkpoint`."""
    import pickle

    path = save_checkpoint(tmp_path / "ckpts", {"w": torch.full((4,), 1.0), "step": 1}, 1, config_hash=H)
    template = {"w": torch.zeros(4), "step": 0}
    assert torch.equal(ckpt.load_into(path, template)["w"], torch.full((4,), 1.0))  # the good one reads
    marker = tmp_path / "code-ran"
    (path / ckpt_format.DCP_DIR / ".metadata").write_bytes(pickle.dumps(_Plant(marker)))
    for load in (lambda: ckpt.load_into(path, {"w": torch.zeros(4), "step": 0}), lambda: ckpt_format.load_checkpoint(path)):
        with pytest.raises(CheckpointError, match=r"\.metadata") as e:
            load()
        assert "\n" not in str(e.value) and not marker.exists()
    doc = json.loads((path / ckpt_format.MANIFEST_FILE).read_text())
    del doc["files"][f"{ckpt_format.DCP_DIR}/.metadata"]
    (path / ckpt_format.MANIFEST_FILE).write_text(json.dumps(doc))
    with pytest.raises(CheckpointError, match=r"records no dcp/\.metadata"):
        ckpt.load_into(path, {"w": torch.zeros(4), "step": 0})
    assert not marker.exists()
