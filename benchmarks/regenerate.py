"""Regeneration throughput, local backend, tiny target: records/s and generated tokens/s at batch 1 vs batched
`generate`, as a ratio, in one run (issue 14).

    .venv/bin/python benchmarks/regenerate.py [--records 200] [--batch 16] [--max-new-tokens 32]

The first `--records` conversations of the bundled corpus, first assistant turn each (max_turns), greedy.
A tiny random target never emits eos, so every answer is max_new_tokens long: both runs generate the same
token count and the ratio is the batching gain alone.
"""

from __future__ import annotations

from pathlib import Path
import sys

sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]  # noqa: E402
# (benchmarks/tokenize.py would shadow the standard library's tokenize, which transformers needs)

import argparse  # noqa: E402
import json  # noqa: E402
import tempfile  # noqa: E402

from dflash_lib.config import from_params
from dflash_lib.regenerate import LocalBackend, regenerate


def run(records: int, batch: int, max_new_tokens: int, max_turns: int) -> dict:
    base = dict(limit=records, template="qwen3", max_new_tokens=max_new_tokens, max_turns=max_turns,
                hidden_size=64, target_layers=4)
    backend = LocalBackend(from_params(base))
    backend.target.model.config.max_position_embeddings = 1 << 20  # long ShareGPT prompts: RoPE extrapolates
    backend.max_positions = 1 << 20
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        for b in (1, batch):
            rep = regenerate(from_params(dict(base, gen_batch=b)), Path(tmp) / f"b{b}.jsonl", backend=backend,
                             progress=False)
            r = rep["run"]
            out[f"batch_{b}"] = dict(records=r["written_now"], generated_tokens=r["generated_tokens_now"],
                                     seconds=r["seconds"], records_per_s=round(r["records_per_s"], 2),
                                     tokens_per_s=round(r["tokens_per_s"], 1))
    one, many = out["batch_1"], out[f"batch_{batch}"]
    out["ratio_records_per_s"] = round(many["records_per_s"] / one["records_per_s"], 2)
    out["ratio_tokens_per_s"] = round(many["tokens_per_s"] / one["tokens_per_s"], 2)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--records", type=int, default=200)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--max-turns", type=int, default=1)
    a = ap.parse_args()
    print(json.dumps(run(a.records, a.batch, a.max_new_tokens, a.max_turns), indent=1))


if __name__ == "__main__":
    main()
