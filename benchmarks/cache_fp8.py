"""The drafter's loss trained from a float8_e4m3fn cache against a bf16 cache, on the demo's target (issue 55).

    .venv/bin/python -P benchmarks/cache_fp8.py                         # 48 of the target's answers, 40 steps
    .venv/bin/python -P benchmarks/cache_fp8.py --records 96 --steps 80

The demo's recipe (`--preset demo` in bf16 on SmolLM2-135M-Instruct and its own answers, as `make demo` makes or
reads them: `lab.demo.prepare_target`) on its first `--records` answers. The target's features of that store are
computed once by the local target (fp32, on the CPU: it stands in for the engine, as in tests/test_hidden_cache.py)
and captured twice (`target.capture.capture`): into bfloat16 (what a bf16 run's cache holds) and into
float8_e4m3fn (`-p hidden_cache_dtype float8_e4m3fn`). Then the same drafter (same seed, same batches, same
anchors) trains `--steps` steps from each cache (`-p hidden_cache`). Printed: the bytes a token of each cache and
their ratio, the loss of step 1 (the same weights on the same batch: the features' difference alone), and over every
step the mean and largest |fp8 - bf16| loss difference, the mean relative to the bf16 loss, and the last 10 steps'
means; with `--control`, a second run from the bf16 cache (its largest difference from the first: the noise floor).
About 4 minutes on 2 shared CPU cores (the local target's forward of the store takes most); the figures:
docs/scale.md, "Cached: generate once, train many epochs".
"""

from __future__ import annotations

import sys
from pathlib import Path

# Run as a script, benchmarks/ is sys.path[0]: benchmarks/tokenize.py would shadow the stdlib module for torch.
sys.path = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

import argparse  # noqa: E402
import json  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402

from dflash_lib.data import build_token_store_from_config  # noqa: E402
from dflash_lib.data.batch import collate_padded  # noqa: E402
from dflash_lib.lab.demo import prepare_target, train_link  # noqa: E402
from dflash_lib.rundir import load_config  # noqa: E402
from dflash_lib.rundir.reader import METRICS_FILE  # noqa: E402
from dflash_lib.target.cached import CacheIdentity  # noqa: E402
from dflash_lib.target.capture import capture, plan_capture  # noqa: E402
from dflash_lib.target.facts import read_facts  # noqa: E402
from dflash_lib.target.local import TargetModel  # noqa: E402
from dflash_lib.train.loop import train  # noqa: E402

STORED = ("bfloat16", "float8_e4m3fn")


def local_states(config, documents: list[list[int]], chunk: int) -> dict[bytes, torch.Tensor]:
    """(len, F, H) fp32 feature-layer states of each document from the local target, `chunk` documents of near
    lengths a forward (per-document attention: each document's own), keyed by its token ids."""
    target = TargetModel.from_model_config(config.model)
    F, H = target.num_features, target.hidden_size
    by_length = sorted(documents, key=len)  # little padding in a chunk
    out = {}
    with torch.no_grad():
        for s in range(0, len(by_length), chunk):
            docs = by_length[s:s + chunk]
            batch = collate_padded([(np.asarray(d), np.ones(len(d), np.uint8)) for d in docs], 0)
            feats = target.context_features(batch).float()  # (N, F*H): real tokens, row-major
            for d, rows in zip(docs, torch.split(feats, [len(d) for d in docs])):
                out[bytes(np.asarray(d, np.uint32))] = rows.reshape(len(d), F, H).clone()
    return out


def losses(run: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (run / METRICS_FILE).read_text().splitlines()]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--records", type=int, default=48, help="the target's answers read (the store's samples)")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--chunk", type=int, default=8, help="documents per forward of the local target")
    ap.add_argument("--control", action="store_true", help="train from the bf16 cache a second time: the run's own "
                    "noise floor (0 on the CPU: its runs are deterministic)")
    ap.add_argument("--out", default="", help="keep the caches and runs here (default: a temporary folder)")
    a = ap.parse_args()
    t0 = time.perf_counter()
    params, inputs = prepare_target("demo", None, kind="real", engine=True)  # the answers `make demo` made
    flat = {**params, **train_link(inputs), "limit": a.records, "steps": a.steps, "eval_samples": 0,
            "eval_every": 0, "ckpt_every": 0, "target_cache_gib": 0.0, "wandb_mode": "disabled"}
    flat.pop("min_new_tokens", None)
    flat.pop("max_new_tokens", None)
    config = load_config(flat, "demo")
    facts = read_facts(config.model)
    store = build_token_store_from_config(config.data, progress=False)
    identity = CacheIdentity.of(config, facts.layer_ids, facts.hidden_size, store.meta["key"], torch.device("cpu"))
    assert identity.dtype == "bfloat16", identity.dtype  # the demo trains in bf16: its cache holds bf16
    assert list(facts.layer_ids) == sorted(facts.layer_ids)  # the stand-in's states in the engine's layer order
    documents = [np.asarray(store[i][0]).tolist() for i in range(len(store))]
    t1 = time.perf_counter()
    states = local_states(config, documents, a.chunk)
    t2 = time.perf_counter()
    with tempfile.TemporaryDirectory() as scratch:
        root = Path(a.out or scratch)
        per_token, runs = {}, {}
        for stored in STORED:
            cache = root / f"cache-{stored}"
            capture(store, identity, cache, lambda docs: [states[bytes(np.asarray(d, np.uint32))] for d in docs],
                    torch.arange(facts.num_features), vocab_size=facts.vocab_size, stored=stored, say=lambda _: None,
                    progress=False)
            per_token[stored] = plan_capture(store, identity, stored, facts.vocab_size, 256).bytes_per_token
        t3 = time.perf_counter()
        for name, stored in [(s, s) for s in STORED] + ([("control", "bfloat16")] if a.control else []):
            run = root / f"run-{name}"
            train(load_config({**flat, "hidden_cache": str(root / f"cache-{stored}")}, "demo"), run)
            runs[name] = losses(run)
        t4 = time.perf_counter()
    bf16, fp8 = np.asarray(runs["bfloat16"]), np.asarray(runs["float8_e4m3fn"])
    diff = np.abs(fp8 - bf16)
    report = {
        "target": str(Path(config.model.target).name), "samples": len(store),
        "tokens": int(np.asarray(store.lengths).sum()), "feature_layers": list(facts.layer_ids),
        "hidden": facts.hidden_size, "steps": len(bf16), "bytes_per_token": per_token,
        "fp8_over_bf16_bytes": round(per_token["float8_e4m3fn"] / per_token["bfloat16"], 4),
        "step1_loss": {"bfloat16": round(float(bf16[0]), 5), "float8_e4m3fn": round(float(fp8[0]), 5),
                       "diff": round(float(fp8[0] - bf16[0]), 5)},
        "mean_abs_diff": round(float(diff.mean()), 5), "max_abs_diff": round(float(diff.max()), 5),
        "mean_rel_diff": round(float((diff / bf16).mean()), 5),
        "last10_mean_loss": {"bfloat16": round(float(bf16[-10:].mean()), 5),
                             "float8_e4m3fn": round(float(fp8[-10:].mean()), 5)},
        **({"control_max_abs_diff": float(np.abs(np.asarray(runs["control"]) - bf16).max())} if a.control else {}),
        "seconds": {"store_and_target": round(t1 - t0, 1), "features": round(t2 - t1, 1),
                    "captures": round(t3 - t2, 1), "trainings": round(t4 - t3, 1)}}
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
