"""RNG capture/restore: every stream continues exactly, through a weights_only checkpoint file."""

from __future__ import annotations

import io
import random

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from dflash_lib.train.checkpoint import RngStateError, capture_rng, restore_rng


def _draw() -> list[float]:
    """A few values from every global stream (python, numpy, torch CPU)."""
    return [random.random(), random.gauss(0, 1), float(np.random.rand()), float(np.random.normal()),
            *torch.rand(3).tolist()]


def _through_weights_only_file(state: dict) -> dict:
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), before=st.integers(0, 50))
def test_restore_replays_every_stream(seed: int, before: int) -> None:
    random.seed(seed), np.random.seed(seed), torch.manual_seed(seed)
    for _ in range(before):  # leave every stream mid-way (python's gauss cache, numpy's cached gaussian)
        _draw()
    saved = _through_weights_only_file(capture_rng())
    expected = _draw()
    _draw()  # move on, then rewind
    restore_rng(saved)
    assert _draw() == expected


def test_capture_holds_only_weights_only_types() -> None:
    state = capture_rng()
    loaded = _through_weights_only_file(state)
    assert torch.equal(loaded["torch_cpu"], state["torch_cpu"])
    assert loaded["numpy"] == state["numpy"] and loaded["python"] == state["python"]


def _with_64_cuda_devices() -> dict:
    state = capture_rng()
    state["torch_cuda"] = [torch.zeros(16, dtype=torch.uint8)] * 64
    return state


def test_failed_restore_changes_nothing() -> None:
    random.seed(5)
    state = _with_64_cuda_devices()
    random.random(), torch.rand(1)
    now_py, now_torch = random.getstate(), torch.get_rng_state()
    with pytest.raises(RngStateError):
        restore_rng(state)  # found before anything is restored
    assert random.getstate() == now_py and torch.equal(torch.get_rng_state(), now_torch)


def test_bad_inputs_are_refused() -> None:
    with pytest.raises(RngStateError, match="format"):
        restore_rng({"format": 99})
    with pytest.raises(RngStateError, match="format"):
        restore_rng([1, 2])
    with pytest.raises(RngStateError, match="captured with 64 CUDA device"):
        restore_rng(_with_64_cuda_devices())
