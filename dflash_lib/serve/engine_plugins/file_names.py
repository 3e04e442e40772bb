"""The file a request's hidden states go to, decided by our connector (this folder is on the engine's PYTHONPATH)
and tested by dflash_lib (`dflash_lib.serve.engine_plugins.file_names`): standard library only. A name the file
system refuses (a NUL byte, more than 255 bytes with its suffixes) is refused here, as a reason in the response,
so that no request makes the engine raise while writing. `temporary_name`: the name a file is written under before
it is renamed into place, one of its own for every writing process."""

from __future__ import annotations

import os
import uuid

SUFFIX = ".safetensors"
PART = ".part"  # the temporary name's suffix, renamed when written
NAME_MAX = 255  # bytes of one path component (Linux, most file systems)
RANDOM_HEX = 16  # hex digits of a temporary name's random part (64 bits)
TEMPORARY_EXTRA = len(f".{2 ** 22}-") + RANDOM_HEX + len(PART)  # bytes at most that `temporary_name` adds to a
# file's name: a pid (Linux's pid_max is at most 2^22) and the random part


def temporary_name(path: str) -> str:
    """The name `path` is written under before it is renamed into place: beside it, with this process's pid and a
    random part, so that two writers of one file (two engines on one folder, or every worker of a tensor-parallel
    engine if more than one ever wrote) never write into the same temporary file."""
    return f"{path}.{os.getpid()}-{uuid.uuid4().hex[:RANDOM_HEX]}{PART}"


def hidden_states_file(out_dir: str, name: str) -> tuple[str, str]:
    """(path, "") of the file for request `name` (its last path component) in `out_dir`, or ("", why) when the
    file system would refuse that name."""
    base = os.path.basename(name)
    if not base or "\0" in base:
        return "", f"the file name {name!r} is empty or holds a NUL byte"
    try:
        size = len(os.fsencode(base + SUFFIX)) + TEMPORARY_EXTRA
    except UnicodeError:
        return "", f"the file name {name!r} cannot be encoded for the file system"
    if size > NAME_MAX:
        return "", (f"the file name of {len(base)} characters is over {NAME_MAX} bytes with its suffixes and "
                    "temporary name")
    return os.path.join(out_dir, base + SUFFIX), ""
