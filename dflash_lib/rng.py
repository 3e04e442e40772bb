"""Capture and restore every random stream a run draws from, in a form a weights_only checkpoint can hold.

Covered: python `random`, numpy's global state, torch CPU, torch CUDA (every device, when available) and any
named generator the caller owns (the anchor `torch.Generator`, a sampler's `np.random.Generator`). Torch
states stay uint8 tensors; python and numpy states become JSON strings (exact for numpy's 128-bit integers),
so `torch.load(weights_only=True)` reads the result back without unpickling any object.
"""

from __future__ import annotations

import json
import random
from typing import Any, Union

import numpy as np
import torch

RNG_FORMAT = 1  # bump when the captured layout changes
NamedGenerator = Union[torch.Generator, np.random.Generator]


class RngStateError(ValueError):
    """A captured RNG state does not match the generators it is being restored into."""


def capture_rng(generators: dict[str, NamedGenerator] | None = None) -> dict[str, Any]:
    """Snapshot every global random stream plus the named `generators` (e.g. {"anchors": torch.Generator}).

    Returns a dict of tensors, strings, ints and lists only (safe for `torch.load(weights_only=True)`).
    """
    out: dict[str, Any] = {
        "format": RNG_FORMAT,
        "python": _python_to_json(random.getstate()),
        "numpy": _numpy_global_to_json(np.random.get_state()),
        "torch_cpu": torch.get_rng_state(),  # (5056,) uint8
        "torch_cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],  # [(816,) uint8] per GPU
        "generators": {},
    }
    for name, gen in (generators or {}).items():
        if isinstance(gen, torch.Generator):
            out["generators"][name] = {"kind": "torch", "device": str(gen.device), "state": gen.get_state()}
        elif isinstance(gen, np.random.Generator):
            out["generators"][name] = {"kind": "numpy", "state": json.dumps(gen.bit_generator.state)}
        else:
            raise RngStateError(f"generator {name!r} is a {type(gen).__name__}; expected torch.Generator or "
                                f"np.random.Generator")
    return out


def restore_rng(state: dict[str, Any], generators: dict[str, NamedGenerator] | None = None) -> None:
    """Put every stream captured by `capture_rng` back; the named `generators` must be the same set of names.

    Raises RngStateError (naming the stream) on a missing or extra generator name, a generator of another kind
    or device, a different number of CUDA devices, or a state of another format.
    """
    if not isinstance(state, dict) or state.get("format") != RNG_FORMAT:
        got = state.get("format") if isinstance(state, dict) else type(state).__name__
        raise RngStateError(f"RNG state format {got!r} is not the supported format {RNG_FORMAT}")
    generators = generators or {}
    saved = state["generators"]
    if set(saved) != set(generators):
        raise RngStateError(f"RNG state holds generators {sorted(saved)} but {sorted(generators)} were given")
    cuda_states = state["torch_cuda"]
    if cuda_states and (not torch.cuda.is_available() or torch.cuda.device_count() != len(cuda_states)):
        have = torch.cuda.device_count() if torch.cuda.is_available() else 0
        raise RngStateError(f"RNG state was captured with {len(cuda_states)} CUDA device(s); this process has {have}")
    for name, gen in generators.items():  # check everything before changing anything
        kind = ("torch" if isinstance(gen, torch.Generator)
                else "numpy" if isinstance(gen, np.random.Generator) else None)
        if kind != saved[name]["kind"]:
            raise RngStateError(f"generator {name!r} was captured as {saved[name]['kind']}, got {type(gen).__name__}")
        if kind == "torch" and str(gen.device) != saved[name]["device"]:
            raise RngStateError(f"generator {name!r} was captured on {saved[name]['device']}, got one on {gen.device}")

    random.setstate(_python_from_json(state["python"]))
    np.random.set_state(_numpy_global_from_json(state["numpy"]))
    torch.set_rng_state(state["torch_cpu"])
    if cuda_states:
        torch.cuda.set_rng_state_all(cuda_states)
    for name, gen in generators.items():
        if isinstance(gen, torch.Generator):
            gen.set_state(saved[name]["state"])
        else:
            gen.bit_generator.state = json.loads(saved[name]["state"])


def _python_to_json(st: tuple) -> str:
    version, internal, gauss_next = st  # internal: 624 uint32 words + position
    return json.dumps([version, list(internal), gauss_next])


def _python_from_json(text: str) -> tuple:
    version, internal, gauss_next = json.loads(text)
    return version, tuple(internal), gauss_next


def _numpy_global_to_json(st: tuple) -> str:
    name, keys, pos, has_gauss, cached = st  # keys: (624,) uint32
    return json.dumps([name, keys.tolist(), int(pos), int(has_gauss), float(cached)])


def _numpy_global_from_json(text: str) -> tuple:
    name, keys, pos, has_gauss, cached = json.loads(text)
    return name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached
