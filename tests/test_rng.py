"""RNG capture/restore: every stream continues exactly, through a weights_only checkpoint file."""

from __future__ import annotations

import io
import random

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from dflash_lib.train.checkpoint import RngStateError, capture_rng, restore_rng


def _draw(gens: dict) -> list[float]:
    """A few values from every stream (python, numpy global, torch CPU, each named generator)."""
    out = [random.random(), random.gauss(0, 1), float(np.random.rand()), float(np.random.normal()),
           *torch.rand(3).tolist()]
    for name in sorted(gens):
        g = gens[name]
        out += torch.rand(2, generator=g).tolist() if isinstance(g, torch.Generator) else g.random(2).tolist()
    return out


def _through_weights_only_file(state: dict) -> dict:
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), before=st.integers(0, 50))
def test_restore_replays_every_stream(seed: int, before: int) -> None:
    random.seed(seed), np.random.seed(seed), torch.manual_seed(seed)
    gens = {"anchors": torch.Generator().manual_seed(seed + 1), "sampler": np.random.default_rng(seed + 2)}
    for _ in range(before):  # leave every stream mid-way (python's gauss cache, numpy's cached gaussian)
        _draw(gens)
    saved = _through_weights_only_file(capture_rng(gens))
    expected = _draw(gens)
    _draw(gens)  # move on, then rewind
    fresh = {"anchors": torch.Generator(), "sampler": np.random.default_rng()}
    restore_rng(saved, fresh)
    assert _draw(fresh) == expected


def test_capture_holds_only_weights_only_types() -> None:
    state = capture_rng({"a": torch.Generator(), "n": np.random.default_rng(3)})
    loaded = _through_weights_only_file(state)
    assert torch.equal(loaded["torch_cpu"], state["torch_cpu"])
    assert loaded["generators"]["n"]["state"] == state["generators"]["n"]["state"]  # 128-bit ints via JSON


@pytest.mark.parametrize("given_gens, match", [
    ({}, r"holds generators \['a'\] but \[\] were given"),
    ({"a": torch.Generator(), "b": torch.Generator()}, r"\['a'\] but \['a', 'b'\]"),
    ({"a": np.random.default_rng()}, "captured as torch, got Generator"),
])
def test_mismatched_generators_are_refused(given_gens: dict, match: str) -> None:
    state = capture_rng({"a": torch.Generator()})
    with pytest.raises(RngStateError, match=match):
        restore_rng(state, given_gens)


def test_failed_restore_changes_nothing() -> None:
    random.seed(5)
    state = capture_rng({"a": torch.Generator()})
    random.random(), torch.rand(1)
    now_py, now_torch = random.getstate(), torch.get_rng_state()
    with pytest.raises(RngStateError):
        restore_rng(state, {"a": np.random.default_rng()})  # wrong kind: found before anything is restored
    assert random.getstate() == now_py and torch.equal(torch.get_rng_state(), now_torch)


def test_bad_inputs_are_refused() -> None:
    with pytest.raises(RngStateError, match="expected torch.Generator or np.random.Generator"):
        capture_rng({"x": random.Random()})
    with pytest.raises(RngStateError, match="format"):
        restore_rng({"format": 99}, {})
    with pytest.raises(RngStateError, match="format"):
        restore_rng([1, 2], {})
    state = capture_rng()
    state["torch_cuda"] = [torch.zeros(16, dtype=torch.uint8)] * 64
    with pytest.raises(RngStateError, match="captured with 64 CUDA device"):
        restore_rng(state, {})
