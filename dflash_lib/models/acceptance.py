"""Acceptance length tau by a real greedy speculative-decoding loop (draft a block, verify, accept).

Per cycle, with the sequence so far s_0 .. s_{L-1} (s_{L-1} the last accepted token, not yet seen by the
target): the drafter drafts d_1 .. d_{B-1} from [s_{L-1}, MASK ...] at positions L-1 .. L+B-2 with the target
features of s_0 .. s_{L-2}; the target runs once over s + d and its greedy next tokens t_1 .. t_B at positions
L-1 .. L+B-2 verify the draft: the leading run of d_i == t_i is accepted, plus the bonus token t_{n+1}. So the
output is the target's own greedy decoding, token for token. The target recomputes the whole prefix every
cycle (no KV cache): exact and simple, meant for tiny models and short evaluations.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Sequence

import torch

from dflash_lib.models.drafter import DFlashDrafter
from dflash_lib.models.target import TargetModel


@dataclass
class AcceptanceResult:
    tau: float  # mean tokens per drafting cycle (accepted draft tokens + 1 bonus); 1 .. B
    histogram: dict[int, int]  # tokens per cycle -> number of cycles
    outputs: list[list[int]]  # the max_new_tokens generated tokens of each prompt
    cycles: int  # drafting cycles over all prompts


@torch.no_grad()
def acceptance_length(target: TargetModel, drafter: DFlashDrafter, prompts: Sequence[Sequence[int]],
                      max_new_tokens: int) -> AcceptanceResult:
    """Speculative-decode every prompt to `max_new_tokens` tokens. The first token comes from the target's
    prefill (not a cycle); a last cycle that overshoots still counts its full accepted length, and the output
    is cut to `max_new_tokens`."""
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    hist: Counter[int] = Counter()
    outputs: list[list[int]] = []
    for i, prompt in enumerate(prompts):
        if not prompt:
            raise ValueError(f"prompt {i} is empty")
        seq = torch.tensor(list(prompt), dtype=torch.long)  # (L,)
        first = target.step(seq, len(seq) - 1)
        feats = first.features  # (L, F*H): target features of seq (valid for any longer prefix too)
        seq = torch.cat([seq, first.logits[-1].argmax().reshape(1).cpu()])
        while len(seq) - len(prompt) < max_new_tokens:
            L = len(seq)
            draft = torch.tensor(drafter.draft(feats, L - 1, int(seq[-1])), dtype=torch.long)  # (B-1,)
            check = target.step(torch.cat([seq, draft]), L - 1)
            verified = check.logits.argmax(dim=-1).cpu()  # (B,) target's next token after each slot
            match = (draft == verified[:-1]).long()
            n = int(match.cumprod(0).sum())  # leading run of accepted draft tokens
            hist[n + 1] += 1
            seq = torch.cat([seq, draft[:n], verified[n:n + 1]])
            feats = check.features
        outputs.append(seq[len(prompt): len(prompt) + max_new_tokens].tolist())
    cycles = sum(hist.values())
    tau = sum(k * v for k, v in hist.items()) / cycles if cycles else float("nan")
    return AcceptanceResult(tau=tau, histogram=dict(sorted(hist.items())), outputs=outputs, cycles=cycles)
