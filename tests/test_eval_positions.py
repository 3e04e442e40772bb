"""Evaluation refuses prompts whose decoding would run past the target's RoPE positions (max_position_embeddings):
the bound P + max_new_tokens + block_size exactly, the message names the set, turn, prompt and the -p that fits,
and the command refuses before it decodes anything."""

from __future__ import annotations

import pytest

from dflash_lib.config import ConfigError
from dflash_lib.data.prompts import PromptGroup
from dflash_lib.evaluate import check_positions, target_positions
from dflash_lib.models import tiny_qwen3_config
from dflash_lib.target.local import TargetModel
from tiny_models import save_tiny_run


def _group(lengths: list[int], turn: int = 1) -> PromptGroup:
    return PromptGroup("mt-bench", "off", turn, [f"q{i}" for i in range(len(lengths))],
                       [[1] * n for n in lengths])


def test_the_bound_is_prompt_plus_new_tokens_plus_a_block():
    check_positions(_group([10, 40]), 64, 16, 8)  # 40 + 16 + 8 = 64: exactly fits
    with pytest.raises(ConfigError) as e:
        check_positions(_group([10, 41, 30], turn=2), 64, 16, 8)  # 41 + 16 + 8 = 65
    assert str(e.value) == (
        "prompt set 'mt-bench' (turn 2, thinking off): 1 of 3 prompts need more than the target's 64 positions "
        "(max_position_embeddings): the longest, q1, has 41 tokens + max_new_tokens 16 + a block of 8 = 65; "
        "-p max_new_tokens 15 or fewer fits it, or leave that set out of -p prompts_from")
    with pytest.raises(ConfigError, match=r"2 of 2 prompts .* the longest, q0, has 70 tokens .* = 78; or leave"):
        check_positions(_group([70, 60]), 64, 0, 8)  # no max_new_tokens fits a prompt longer than the positions
    check_positions(_group([10_000]), None, 16, 8)  # a target naming no positions: nothing to check


def test_target_positions_reads_the_targets_config():
    target = TargetModel.from_hf_config(tiny_qwen3_config(hidden_size=32, num_layers=2, vocab_size=64,
                                                          max_position_embeddings=96), 1, seed=0)
    assert target_positions(target) == 96


def test_the_command_refuses_before_decoding(tmp_path, capsys):
    from dflash_lib.__main__ import main

    run, _ = save_tiny_run(tmp_path)  # the tiny target: 4096 positions, block size 4
    assert main(["evaluate", "--drafter", run, "--target", "tiny", "-p", "prompts", "1", "-p", "max_new_tokens",
                 "4093", "-p", "timing_warmup", "false"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("error: prompt set 'heldout' (turn 1, thinking ") and "target's 4096 positions" in err
