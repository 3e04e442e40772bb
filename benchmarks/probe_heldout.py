"""The throughput probe of notebook 03, printed: per strategy its real Ktok/s, how full its batches were in the
token and the block budget and which budget closed them, and the cost model's nested held-out error next to the
part of that error probe noise alone explains.

    .venv/bin/python benchmarks/probe_heldout.py                                 # the demo probe (make demo's)
    .venv/bin/python benchmarks/probe_heldout.py --preset smoke --steps 24 --rounds 2   # minutes, not a measure
    .venv/bin/python benchmarks/probe_heldout.py --plan-only     # seconds: the budget figures of the epoch plans
    .venv/bin/python benchmarks/probe_heldout.py --measure runs/<id>_03_throughput_probe_demo   # fit finished probes

The budget figures (token_fill, query_fill, bound_tokens, bound_blocks) of the probed steps come from the
trainer's metrics rows; `--plan-only` prints the same figures for each strategy's whole epoch-0 plan
(`plan.sampler.budget_use`), which needs no training and no idle machine. `--measure DIR` fits this checkout's
cost model to the metrics of probe runs already trained into DIR/<strategy>/ (notebook 03's folder): warm-up is
left out as the probe does (the first invocation's steps before its first steady one, else its first half, and
RESUME_WARMUP steps after each round's end; the probe itself starts at the steady window's first step).

Probe noise and model error are told apart twice:
- within one probe, `costmodel.held_out_noise`: the probe's steps are resampled (every strategy's) and each
  nested fold refitted with its terms, so `nested_noise_pct` (two standard deviations) is how far the held-out
  error moves from which steps happened to be measured. |error| within it is noise; the excess is model error.
- across probes (`--repeats N`, each a fresh probe into its own folder): the spread of each strategy's nested
  error over repeats also holds the machine's drift between strategies, which resampling cannot see (the
  probe's rounds spread that drift over every strategy instead of the one measured last).
Goal (issue 23): every nested error within 3%. Run on an idle machine; a shared one moves throughput by 4-9%.
"""

from __future__ import annotations

import sys
from pathlib import Path

# Run as a script, benchmarks/ is sys.path[0]: a sibling file named like a stdlib module (benchmarks/tokenize.py)
# would shadow it for torch's imports. This script needs nothing from its own folder.
sys.path = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

import argparse  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402

from dflash_lib.config import Config, from_params, preset  # noqa: E402
from dflash_lib.data import build_token_store_from_config  # noqa: E402
from dflash_lib.data.stats import store_drafter_queries  # noqa: E402
from dflash_lib.lab.probe import (PROBES, RESUME_WARMUP, budget_figures, calibrate, observations,  # noqa: E402
                                  predicted_efficiency, probe_table, run_probes, strategy_config)
from dflash_lib.plan.costmodel import held_out_noise, select_cost_model, throughput_rel_sd  # noqa: E402
from dflash_lib.plan.sampler import budget_use  # noqa: E402
from dflash_lib.rundir import new_run_dir  # noqa: E402
from dflash_lib.train.build import bucket_edges, build_sampler  # noqa: E402
from dflash_lib.rundir.reader import load_metrics  # noqa: E402

COLUMNS = ["ktok_s", "ratio_to_sorted", "ktok_s_noise_pct", "realized_efficiency", "token_fill", "query_fill",
           "bound_tokens", "bound_blocks", "cost_model_error_pct", "nested_error_pct", "nested_noise_pct",
           "nested_terms"]


def planned_use(base: Config) -> pd.DataFrame:
    """Per probe strategy, the budget figures of its epoch-0 plan on `base`'s corpus (the samplers the trainer
    builds: `build_sampler` with the store's drafter queries and the resolved block budget)."""
    store = build_token_store_from_config(base.data, progress=False)
    lengths = np.asarray(store.lengths)
    queries = store_drafter_queries(store, base.model.num_anchors, base.model.block_size)
    rows = {}
    for s in PROBES:
        cfg = strategy_config(base, s, 1)
        edges = bucket_edges(cfg, lengths, queries=queries) if cfg.sampler.strategy == "bucketed" else []
        sampler = build_sampler(cfg, lengths, 0, 1, edges, queries)
        use = budget_use(sampler)
        rows[s] = dict(batches=use.batches, docs_per_batch=len(lengths) / use.batches, token_fill=use.token_fill,
                       query_fill=use.query_fill, bound_tokens=use.bound_tokens, bound_blocks=use.bound_blocks,
                       token_efficiency=predicted_efficiency(cfg, sampler, lengths, edges),
                       block_budget=sampler.block_budget)
    return pd.DataFrame(rows).T


def measure_folder(folder: Path, steps: int, rounds: int, draws: int) -> tuple[pd.DataFrame, float]:
    """Ktok/s, budget figures and nested held-out error (with its noise) of the probe runs in folder/<strategy>/,
    fitted by this checkout's cost model; and the worst nested error."""
    ends = [round(steps * (r + 1) / rounds) for r in range(rounds)][:-1]
    obs, figures = {}, {}
    for s in PROBES:
        m = load_metrics(folder / s)
        resumed = np.zeros(len(m), dtype=bool)
        for end in ends:
            resumed |= m["step"].between(end + 1, end + RESUME_WARMUP).to_numpy()
        first = m[m["step"] <= (ends[0] if ends else steps)]  # the first invocation's steps
        steady = first.loc[first["steady"].astype(bool), "step"]
        start = int(steady.iloc[0]) if len(steady) else int(first["step"].iloc[len(first) // 2])
        obs[s] = observations(m[~resumed], start, run=s, padded_kernel=s == "static")
        figures[s] = budget_figures(m[~resumed & (m["step"] >= start)])
    choice = select_cost_model(obs)
    noise = held_out_noise(obs, choice.nested, draws)
    rows = {}
    for s, steps_s in obs.items():
        tok_s = sum(o.real_tokens for o in steps_s) / sum(o.seconds for o in steps_s)
        rows[s] = dict(steps=len(steps_s), ktok_s=tok_s / 1000, ktok_s_noise_pct=200 * throughput_rel_sd(steps_s),
                       **figures[s], nested_error_pct=100 * choice.nested[s].rel_error,
                       nested_noise_pct=200 * noise[s], nested_terms="+".join(choice.nested[s].terms))
    table = pd.DataFrame(rows).T
    table.insert(2, "ratio_to_sorted", table["ktok_s"] / table.loc["sorted", "ktok_s"])
    return table, choice.nested_max_abs_error


def report(table: pd.DataFrame, worst: float) -> None:
    """Print the table, each strategy's nested error against its noise, and the worst error."""
    print(table[[c for c in ["steps", *COLUMNS] if c in table.columns]].to_string(
        float_format=lambda v: f"{v:.3f}"))
    for name, row in table.iterrows():
        err, noise = row["nested_error_pct"], row["nested_noise_pct"]
        verdict = "within noise" if abs(err) <= noise else f"{abs(err) - noise:.1f} points beyond noise"
        print(f"  {name:9s} nested {err:+6.1f}% (noise +-{noise:.1f}%): {verdict}")
    print(f"worst nested held-out error {100 * worst:.1f}% (goal: within 3%)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="demo", help="config preset of the probe (demo: what make demo probes)")
    ap.add_argument("--steps", type=int, default=0, help="training steps per strategy (0 = the preset's probe_steps)")
    ap.add_argument("--rounds", type=int, default=0, help="chunks per probe, strategies taking turns (0 = preset's)")
    ap.add_argument("--repeats", type=int, default=1, help="fresh probes, for the spread of the errors across runs")
    ap.add_argument("--draws", type=int, default=200, help="bootstrap resamples of held_out_noise")
    ap.add_argument("--out", default="", help="folder of the probe runs, one per repeat (default: a new run folder)")
    ap.add_argument("--plan-only", action="store_true", help="only the budget figures of the strategies' plans")
    ap.add_argument("--measure", default="", help="fit the probe runs already trained into this folder")
    ap.add_argument("-p", nargs=2, action="append", default=[], metavar=("KEY", "VALUE"), help="config override")
    args = ap.parse_args()

    base = from_params(dict(args.p), preset(args.preset))
    steps = args.steps or base.train.probe_steps
    rounds = args.rounds or base.train.probe_rounds
    pd.set_option("display.width", 200)
    if args.measure:
        print(f"probe runs in {args.measure} ({steps} steps, {rounds} rounds), this checkout's cost model:")
        report(*measure_folder(Path(args.measure), steps, rounds, args.draws))
        return
    print(f"epoch-0 plans ({args.preset}, token_budget {base.sampler.token_budget}):")
    print(planned_use(base).to_string(float_format=lambda v: f"{v:.3f}"))
    if args.plan_only:
        return
    root = Path(args.out) if args.out else new_run_dir("bench_probe_heldout", args.preset)
    errors: dict[str, list[float]] = {}
    for rep in range(args.repeats):
        out = root / f"repeat{rep}"  # fresh: a folder holding a finished probe would resume, not train
        t0 = time.perf_counter()
        probes = run_probes(base, out, steps, rounds=rounds)
        choice = calibrate(probes)
        table = probe_table(probes, choice, noise_draws=args.draws)
        print(f"\nprobe {out} ({args.preset}, {steps} steps x {len(probes)} strategies, {rounds} rounds, "
              f"{time.perf_counter() - t0:.0f} s); terms {'+'.join(choice.model.terms)}")
        report(table, choice.nested_max_abs_error)
        for name, row in table.iterrows():
            errors.setdefault(str(name), []).append(row["nested_error_pct"])
    if len(next(iter(errors.values()))) > 1:
        print("\nacross repeats (drift included): nested error mean +- sd, %")
        for name, errs in errors.items():
            each = ", ".join(f"{e:+.1f}" for e in errs)
            print(f"  {name:9s} {np.mean(errs):+6.1f} +- {np.std(errs, ddof=1):.1f}  ({each})")


if __name__ == "__main__":
    main()
