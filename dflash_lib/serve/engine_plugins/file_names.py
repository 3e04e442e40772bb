"""The file a request's hidden states go to, decided by our connector (this folder is on the engine's PYTHONPATH)
and tested by dflash_lib (`dflash_lib.serve.engine_plugins.file_names`): standard library only. A name the file
system refuses (a NUL byte, more than 255 bytes with its suffix) is refused here, as a reason in the response, so
that no request makes the engine raise while writing."""

from __future__ import annotations

import os

SUFFIX = ".safetensors"
PART = ".part"  # the temporary name's suffix, renamed when written
NAME_MAX = 255  # bytes of one path component (Linux, most file systems)


def hidden_states_file(out_dir: str, name: str) -> tuple[str, str]:
    """(path, "") of the file for request `name` (its last path component) in `out_dir`, or ("", why) when the
    file system would refuse that name."""
    base = os.path.basename(name)
    if not base or "\0" in base:
        return "", f"the file name {name!r} is empty or holds a NUL byte"
    try:
        size = len(os.fsencode(base + SUFFIX + PART))
    except UnicodeError:
        return "", f"the file name {name!r} cannot be encoded for the file system"
    if size > NAME_MAX:
        return "", f"the file name of {len(base)} characters is over {NAME_MAX} bytes with its suffixes"
    return os.path.join(out_dir, base + SUFFIX), ""
