"""Shared test settings: wandb off, tokenizer threads quiet, runs written under a temp folder."""

import os

import pytest
import torch

os.environ["WANDB_MODE"] = "disabled"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="module")
def one_thread():
    """Tiny matmuls on a busy 2-core machine: one intra-op thread is several times faster than two (restored at
    the end of the module that asked)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
