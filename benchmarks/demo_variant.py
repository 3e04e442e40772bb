"""The demo's recipe with one change, on the demo's data, decoded on the three prompt sets: is a demo change better?

    .venv/bin/python -P benchmarks/demo_variant.py --tag base
    .venv/bin/python -P benchmarks/demo_variant.py --tag l2 -p drafter_layers 2
    .venv/bin/python -P benchmarks/demo_variant.py --tag r480 --records 480     # more of the target's answers
    .venv/bin/python -P benchmarks/demo_variant.py --tag s1kl --first-steps 300  # a first stage on the corpus

Trains `--preset demo` (`dflash_lib.train.train`) on the demo's data (the real target's own answers, made through
vLLM or read from the cache as `make demo` does, `--records` of them; notebook 04's split) with the `-p`
overrides, into runs/demo_variant/<tag>/, then decodes the final drafter in process (greedy fp32: vLLM's served tau
equals it cycle for cycle) on the first `--prompts` held-out answers, HumanEval and MT-Bench (both turns),
`--max-new-tokens` each: `benchmarks/peers/run.py`'s `decode_prompt_sets`. One line: tau over every set with its
standard error over cycles, per set, and the training loop's seconds; appended to runs/demo_variant/results.jsonl.

`--first-steps N`: first N steps on the bundled corpus's own conversations (`--first-records` of them; every
assistant turn scored, no regeneration) with `--first-loss` (kl: the target's distribution at each position,
the labels costing nothing), then the demo's steps on the target's answers from that drafter (`-p init_from`;
the draft vocabulary chosen again from the answers).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE / "peers"))

from run import decode_prompt_sets  # noqa: E402

from dflash_lib.lab.demo import REAL_ANSWERS, engine_available, prepare_target, train_link  # noqa: E402
from dflash_lib.rundir import load_config  # noqa: E402
from dflash_lib.evaluate.served import tau_se  # noqa: E402
from dflash_lib.train.loop import train  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tag", required=True)
    ap.add_argument("--records", type=int, default=REAL_ANSWERS.records, help="conversations the target answers")
    ap.add_argument("-p", nargs=2, action="append", default=[], metavar=("KEY", "VALUE"))
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--out", default=str(REPO / "runs" / "demo_variant"))
    ap.add_argument("--first-steps", type=int, default=0, help="steps of a first stage on the bundled corpus")
    ap.add_argument("--first-records", type=int, default=4000, help="conversations of the corpus it reads")
    ap.add_argument("--first-loss", default="kl", choices=("ce", "kl", "ce+kl"))
    a = ap.parse_args()
    t0 = time.perf_counter()
    params, inputs = prepare_target("demo", dict(a.p), kind="real", engine=engine_available(),
                                    answer_settings=replace(REAL_ANSWERS, records=a.records))
    prep_s = time.perf_counter() - t0
    run = Path(a.out) / a.tag
    first_s = 0.0
    if a.first_steps:  # the corpus as it is: its own answers, the target's distribution as the labels
        first = {**params, "plan": "", "limit": a.first_records, "loss": a.first_loss, "steps": a.first_steps,
                 "eval_samples": 0, "ckpt_every": 0, "target_cache_gib": 0.0, "wandb_mode": "disabled", **dict(a.p)}
        first_s = train(load_config(first, "demo"), run / "first").loop_s
        a.p.append(("init_from", str(run / "first" / "drafter")))
    params = {**params, **train_link(inputs), "wandb_mode": "disabled", **dict(a.p)}
    summary = train(load_config(params, "demo"), run)
    _, sets = decode_prompt_sets(run, a.prompts, a.max_new_tokens)
    tau, se = tau_se([c for s in sets for c in s.cycle_log])
    line = {"tag": a.tag, "records": a.records, "overrides": dict(a.p), "prep_s": round(prep_s, 1),
            "loop_s": round(summary.loop_s, 1), "first_loop_s": round(first_s, 1), "tau": tau, "tau_se": se,
            "cycles": sum(len(c) for s in sets for c in s.cycle_log),
            "per_set": {s.name: tau_se(s.cycle_log)[0] for s in sets}}
    with open(Path(a.out) / "results.jsonl", "a") as f:
        f.write(json.dumps(line) + "\n")
    print(f"{a.tag}: tau {tau:.3f} +- {se:.3f} over {line['cycles']} cycles; "
          + ", ".join(f"{k} {v:.3f}" for k, v in line["per_set"].items()) + f"; loop {summary.loop_s:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
