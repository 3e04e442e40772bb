"""The study chain's glue: what one notebook reads from the run folder of the one before it, and the tables
the notebooks show. Notebook 01 writes `lengths.parquet`; notebook 02 writes `plan.json`; notebooks 03 and 04
read the plan.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import pandas as pd

from dflash_lib.config import ConfigError, DataConfig
from dflash_lib.data import build_token_store_from_config
from dflash_lib.plan.buckets import (BucketPlan, efficiency_vs_k, equal_length_boundaries, optimal_boundaries,
                                     plan_for_edges, seed_boundaries)

METHODS = ("seed", "equal_length", "dp_edge", "dp_batch_max")  # the edge sets notebook 02 compares


def load_lengths(lengths_from: str, data: DataConfig) -> np.ndarray:
    """(N,) int64 sample lengths in tokens, after the max_len policy.

    `lengths_from`: a run folder of notebook 01 (or its lengths.parquet); "" builds (or reuses) the token store
    described by `data`.
    """
    if not lengths_from:
        return np.asarray(build_token_store_from_config(data).lengths, dtype=np.int64)
    path = Path(lengths_from)
    if path.is_dir():
        path = path / "lengths.parquet"
    if not path.is_file():
        raise ConfigError(f"lengths_from: {path} does not exist (expected a notebook-01 run folder)")
    frame = pd.read_parquet(path, columns=["length"])
    if frame.empty:
        raise ConfigError(f"lengths_from: {path} holds no samples")
    return frame["length"].to_numpy(dtype=np.int64)


def plan_corpus(lengths_from: str, data: DataConfig) -> dict[str, Any] | None:
    """What a plan made from `load_lengths(lengths_from, data)` is for (plan.json's `corpus`): {"source",
    "store_key", "samples"} of the token store the lengths came from, read from the notebook-01 run folder's
    summary.json (None without one: the plan is then never checked), else of the store `data` builds."""
    if not lengths_from:
        store = build_token_store_from_config(data)  # (the cached store load_lengths built)
        return {"source": data.source, "store_key": store.meta["key"], "samples": len(store)}
    folder = Path(lengths_from)
    summary_file = (folder if folder.is_dir() else folder.parent) / "summary.json"
    if not summary_file.is_file():
        return None
    summary = json.loads(summary_file.read_text())
    return {"source": summary.get("params", {}).get("source"), "store_key": summary.get("store_key"),
            "samples": summary.get("samples")}


def load_plan(plan: str) -> BucketPlan:
    """A BucketPlan from a plan.json path or a notebook-02 run folder holding one."""
    path = Path(plan)
    if path.is_dir():
        path = path / "plan.json"
    if not path.is_file():
        raise ConfigError(f"plan: {path} does not exist (expected plan.json or a notebook-02 run folder)")
    return BucketPlan.from_json(path.read_text())


def fitted_cost(cost_from: str) -> tuple[str, float]:
    """("quadratic", q) from the step-time model notebook 03 fitted (q = b / c: the row length, in tokens, at
    which attention costs as much as the per-token work). A cost_model.json path or a notebook-03 run folder."""
    path = Path(cost_from)
    if path.is_dir():
        path = path / "cost_model.json"
    if not path.is_file():
        raise ConfigError(f"cost_from: {path} does not exist (expected a notebook-03 run folder)")
    q = json.loads(path.read_text()).get("q")
    if q is None or not q > 0:
        raise ConfigError(f"cost_from: {path} has no finite attention scale q (the fit found no attention cost); "
                          f"use cost='linear'")
    return "quadratic", float(q)


def method_plans(lengths: np.ndarray, k_values: Sequence[int], *, max_len: int, token_budget: int,
                 cost: str = "linear", q: float | None = None, multiple: int = 1, policy: str = "truncate",
                 grid: int = 64) -> dict[str, list[BucketPlan]]:
    """For each method in METHODS, its plan at every k in `k_values`, all RE-EVALUATED under the batch-max
    objective with the same token budget (what the fill-rule sampler pays), so the columns compare like for
    like. seed = geometric start + coordinate descent on the edge objective (the reference run's method as it ran);
    equal_length = lhotse's equal-total-length edges; dp_edge / dp_batch_max = the exact optimum of each objective.
    """
    kw = dict(max_len=max_len, cost=cost, q=q, token_budget=token_budget, multiple=multiple, policy=policy)
    k_top = max(k_values)
    dp = {"dp_edge": efficiency_vs_k(lengths, k_top, objective="edge", **kw),
          "dp_batch_max": efficiency_vs_k(lengths, k_top, objective="batch_max", grid=grid, **kw)}
    out: dict[str, list[BucketPlan]] = {m: [] for m in METHODS}
    for k in k_values:
        found = {
            "seed": seed_boundaries(lengths, k, objective="edge", **kw),
            "equal_length": equal_length_boundaries(lengths, k, **kw),
            **{name: plans[min(k, len(plans)) - 1] for name, plans in dp.items()},
        }
        for name, plan in found.items():
            out[name].append(plan_for_edges(lengths, plan.edges, objective="batch_max", method=_method(name), **kw))
    return out


def _method(name: str) -> str:
    return {"seed": "seed", "equal_length": "equal_length"}.get(name, "optimal")


def method_table(plans: dict[str, list[BucketPlan]], k_values: Sequence[int]) -> pd.DataFrame:
    """One row per (requested k, method): edges, buckets actually used (equal-length edges can merge), predicted
    padding efficiency, capacity utilisation, steps per epoch, and the efficiency gain of each method over the
    reference run's ("seed") at the same k (percentage points)."""
    rows = []
    for name, plan_list in plans.items():
        for k, p in zip(k_values, plan_list, strict=True):
            rows.append(dict(k=k, method=name, buckets=p.k, efficiency=p.efficiency,
                             capacity_utilisation=p.capacity_utilisation, steps_per_epoch=p.steps_per_epoch,
                             edges=list(p.edges)))
    table = pd.DataFrame(rows)
    seed = table[table.method == "seed"].set_index("k")["efficiency"]
    table["gain_vs_seed_pts"] = 100 * (table["efficiency"] - table["k"].map(seed))
    return table.sort_values(["k", "method"]).reset_index(drop=True)


def chosen_plan(lengths: np.ndarray, k: int, *, max_len: int, token_budget: int, objective: str, cost: str,
                q: float | None, multiple: int, policy: str, grid: int,
                corpus: dict[str, Any] | None = None) -> BucketPlan:
    """The exact optimal plan the rest of the study uses (the parameters of notebook 02), recording `corpus`
    (`plan_corpus`: what training checks it against)."""
    plan = optimal_boundaries(lengths, k, max_len=max_len, objective=objective, cost=cost, q=q,
                              token_budget=token_budget, multiple=multiple, policy=policy, grid=grid)
    return dataclasses.replace(plan, corpus=corpus)
