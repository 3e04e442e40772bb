"""Shared test settings: wandb off, tokenizer threads quiet, runs written under a temp folder."""

import os

os.environ["WANDB_MODE"] = "disabled"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
