"""Shared test settings and fixtures: wandb off, tokenizer threads quiet, the engine in one process, runs written
under a temp folder; one intra-op thread for tiny models; the serving engine's Python (or a skip) for the tests that
start it; the bundled Qwen tokenizer, loaded once."""

import os
from pathlib import Path

import pytest
import torch

os.environ["WANDB_MODE"] = "disabled"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# vLLM's engine core in the API server's process: the same engine, started ~7 s sooner here (~15 starts in `make
# test`); the engine-check test runs vLLM's default (a process each) and checks that none is left
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


@pytest.fixture(scope="module")
def one_thread():
    """Tiny matmuls on a busy 2-core machine: one intra-op thread is several times faster than two (restored at
    the end of the module that asked)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


REQUIRE_ENGINE = "DFLASH_REQUIRE_ENGINE"  # set by `make test` unless ENGINE=0: a missing engine fails, not skips


@pytest.fixture(scope="session")
def installed_engine_python() -> Path:
    """The serving engine's Python (`serve.engine_python`: .venv-engine or $DFLASH_ENGINE_PYTHON). Without one the
    test skips, or fails where `make test` requires the engine."""
    from dflash_lib.config import ConfigError
    from dflash_lib.serve import engine_python

    try:
        return engine_python()
    except ConfigError as e:
        if os.environ.get(REQUIRE_ENGINE) == "1":
            raise
        pytest.skip(f"no engine: {e}")


@pytest.fixture(scope="session")
def qwen_tokenizer():
    """The bundled Qwen BPE (`load_tokenizer("qwen")`), loaded once for every test that reads it."""
    from dflash_lib.data import load_tokenizer

    return load_tokenizer("qwen")
