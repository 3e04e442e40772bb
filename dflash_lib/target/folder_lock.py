"""One writer per folder: `folder_lock(folder, what)` holds an exclusive `fcntl.flock` on folder/<what>.lock while a
capture writes the folder; a second writer is refused in one line naming the lock file and its holder (the pid, host
and start the holder wrote into it). The kernel drops the lock when its holder dies, however it dies, so a file left
behind by a killed holder is stale by construction: the next writer locks it and writes its own name. flock reaches
other hosts on NFS (Linux emulates it with POSIX locks there); a file system without locks refuses in one line.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import socket
import time
from pathlib import Path
from typing import Iterator

from dflash_lib.config import ConfigError


def holder() -> dict[str, object]:
    """What a lock file says of its holder: this process's pid, host and start (UTC, ISO 8601)."""
    return {"pid": os.getpid(), "host": socket.gethostname(),
            "since": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


def _said(path: Path) -> str:
    """The holder a lock file names, in words ("" when it names none yet)."""
    try:
        who = json.loads(path.read_text())
        return f"pid {who['pid']} on {who['host']} since {who['since']}"
    except (OSError, ValueError, KeyError, TypeError):
        return ""


@contextlib.contextmanager
def folder_lock(folder: str | Path, what: str) -> Iterator[Path]:
    """Hold folder/<what>.lock (the folder exists) while the block runs; yields the lock file's path. ConfigError
    in one line naming the lock file when another process holds it. The file is removed on release, before the
    lock is dropped: a writer that opened it in between finds it unlinked and opens the new one."""
    path = Path(folder) / f"{what}.lock"
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            os.close(fd)
            if e.errno in (errno.EWOULDBLOCK, errno.EACCES):
                who = _said(path) or "a process that has not written its name yet"
                raise ConfigError(f"{path}: another {what} into {folder} holds this lock ({who}): wait for it, or "
                                  f"{what} into another folder") from None
            raise ConfigError(f"{path}: cannot lock ({e.strerror}): {what} into a folder on a file system with "
                              "locks") from None
        try:
            same = os.fstat(fd).st_ino == os.stat(path).st_ino
        except FileNotFoundError:  # released and removed by the holder we waited on: take the new file
            same = False
        if same:
            break
        os.close(fd)
    try:
        try:
            os.ftruncate(fd, 0)
            os.write(fd, json.dumps(holder()).encode())
        except OSError as e:  # a full disk
            raise ConfigError(f"{path}: cannot write this {what}'s name into its lock ({e.strerror})") from None
        yield path
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        os.close(fd)
