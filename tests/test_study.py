"""Notebook 02's library glue (lengths in, plan out) and the notebook itself on a small synthetic corpus."""

import json

import numpy as np
import pandas as pd
import papermill as pm
import pytest

from dflash_lib.config import ConfigError, DataConfig
from dflash_lib.lab.study import METHODS, chosen_plan, load_lengths, load_plan, method_plans, method_table
from dflash_lib.plan.buckets import BucketPlan, plan_for_edges
from dflash_lib.rundir import REPO_ROOT
from html_check import external_references


@pytest.fixture(scope="module")
def lengths():
    rng = np.random.default_rng(0)
    return np.clip(rng.lognormal(6.0, 0.9, 3000).astype(np.int64), 8, 2048)


def test_method_table_compares_like_for_like(lengths):
    ks = [1, 2, 4]
    plans = method_plans(lengths, ks, max_len=2048, token_budget=8192)
    table = method_table(plans, ks)
    assert len(table) == len(ks) * len(METHODS)
    for _, row in table.iterrows():  # every figure is the batch-max evaluation of that row's edges
        again = plan_for_edges(lengths, row.edges, max_len=2048, objective="batch_max", token_budget=8192)
        assert row.efficiency == pytest.approx(again.efficiency)
        assert row.steps_per_epoch == again.steps_per_epoch
    at4 = table[table.k == 4].set_index("method")
    # the exact batch-max optimum is never beaten by any other edge set under its own objective
    assert at4.loc["dp_batch_max", "efficiency"] >= at4["efficiency"].max() - 1e-12
    assert at4.loc["seed", "gain_vs_seed_pts"] == 0.0
    assert at4.loc["dp_batch_max", "gain_vs_seed_pts"] == pytest.approx(
        100 * (at4.loc["dp_batch_max", "efficiency"] - at4.loc["seed", "efficiency"]))
    k1 = table[table.k == 1]
    assert k1["efficiency"].nunique() == 1  # one bucket: every method gives [max_len]


def test_load_lengths_from_a_run_folder(tmp_path, lengths):
    pd.DataFrame({"length": lengths, "raw_length": lengths}).to_parquet(tmp_path / "lengths.parquet")
    got = load_lengths(str(tmp_path), DataConfig())
    assert np.array_equal(got, lengths) and got.dtype == np.int64
    with pytest.raises(ConfigError, match="does not exist"):
        load_lengths(str(tmp_path / "nope"), DataConfig())
    pd.DataFrame({"length": np.array([], dtype=np.int64)}).to_parquet(tmp_path / "empty.parquet")
    with pytest.raises(ConfigError, match="holds no samples"):
        load_lengths(str(tmp_path / "empty.parquet"), DataConfig())


def test_plan_round_trip_through_a_folder(tmp_path, lengths):
    plan = chosen_plan(lengths, 3, max_len=2048, token_budget=8192, objective="edge", cost="linear", q=None,
                       multiple=1, policy="truncate", grid=64)
    (tmp_path / "plan.json").write_text(plan.to_json())
    assert load_plan(str(tmp_path)) == plan == BucketPlan.from_json(plan.to_json())
    with pytest.raises(ConfigError, match="plan"):
        load_plan(str(tmp_path / "missing.json"))


def test_a_plan_records_its_corpus_and_training_refuses_it_for_another(tmp_path, lengths):
    from dflash_lib.config import from_params
    from dflash_lib.data import build_token_store_from_config
    from dflash_lib.lab.study import plan_corpus
    from dflash_lib.train.build import bucket_edges, load_training_data

    nb01 = tmp_path / "nb01"  # a notebook-01 run folder: its summary.json names the store the lengths came from
    nb01.mkdir()
    (nb01 / "summary.json").write_text(json.dumps({"store_key": "k01", "samples": 3000,
                                                   "params": {"source": "a.jsonl"}}))
    corpus = plan_corpus(str(nb01), DataConfig())
    assert corpus == {"source": "a.jsonl", "store_key": "k01", "samples": 3000}
    assert plan_corpus(str(nb01 / "lengths.parquet"), DataConfig()) == corpus
    assert plan_corpus(str(tmp_path / "bare"), DataConfig()) is None  # lengths without a summary: not recorded
    plan = chosen_plan(lengths, 3, max_len=2048, token_budget=8192, objective="edge", cost="linear", q=None,
                       multiple=1, policy="truncate", grid=64, corpus=corpus)
    (tmp_path / "plan.json").write_text(plan.to_json())
    assert load_plan(str(tmp_path)).corpus == corpus
    config = from_params({"plan": str(tmp_path / "plan.json"), "max_len": 2048})
    assert bucket_edges(config, lengths, "k01") == list(plan.edges)
    with pytest.raises(ConfigError) as e:
        bucket_edges(config, lengths, "k02")
    assert str(e.value) == (f"plan '{tmp_path / 'plan.json'}' was made for another corpus: 'a.jsonl' (token store "
                            f"k01), this run reads 'sharegpt' (token store k02); plan this corpus with notebook 02, or "
                            f"take those edges anyway: -p plan '' -p edges '{json.dumps(list(plan.edges))}'")
    raw = json.loads(plan.to_json())
    raw.pop("corpus")  # a plan written before plans recorded their corpus: read, never checked
    (tmp_path / "plan.json").write_text(json.dumps(raw))
    assert load_plan(str(tmp_path)).corpus is None and bucket_edges(config, lengths, "k02") == list(plan.edges)

    # training checks the plan against the key of the store it reads (the smoke preset's corpus)
    data = from_params({"limit": 300, "max_len": 512}).data
    key = build_token_store_from_config(data, progress=False).meta["key"]
    for made_for, refused in ((key, False), ("0" * 24, True)):
        (tmp_path / "plan.json").write_text(json.dumps(raw | {"corpus": {"source": "sharegpt", "store_key": made_for},
                                                              "edges": [128, 512], "counts": [1, 1], "max_len": 512,
                                                              "batch_sizes": None}))
        run = from_params({"limit": 300, "max_len": 512, "plan": str(tmp_path / "plan.json")})
        if refused:
            with pytest.raises(ConfigError, match=f"token store {'0' * 24}\\), this run reads 'sharegpt' \\(token "
                                                  f"store {key}\\)"):
                load_training_data(run)
        else:
            assert load_training_data(run).edges == [128, 512]


@pytest.mark.slow
def test_notebook_02_writes_a_plan(tmp_path, lengths):
    src = tmp_path / "nb01"
    src.mkdir()
    pd.DataFrame({"length": lengths}).to_parquet(src / "lengths.parquet")
    corpus = {"source": "chats.jsonl", "store_key": "abc", "samples": len(lengths)}
    (src / "summary.json").write_text(json.dumps({"store_key": "abc", "samples": len(lengths),
                                                  "params": {"source": "chats.jsonl"}}))
    out = tmp_path / "run"
    out.mkdir()
    pm.execute_notebook(str(REPO_ROOT / "notebooks" / "02_bucket_optimization.ipynb"), str(out / "nb.ipynb"),
                        parameters=dict(lengths_from=str(src), max_len=2048, k=4, k_max=5, token_budget=8192,
                                        out_dir=str(out)),
                        kernel_name="python3", cwd=str(REPO_ROOT), progress_bar=False)
    plan = load_plan(str(out))
    assert plan.k == 4 and plan.edges[-1] == 2048 and plan.exact
    assert plan.corpus == corpus  # notebook 01's store, what training checks the plan against
    summary = json.loads((out / "summary.json").read_text())
    assert summary["predicted_efficiency"] == pytest.approx(plan.efficiency)
    names = {s["strategy"]: s for s in summary["strategies"]}
    assert set(names) == {"sorted", "random", "bucketed_optimal", "bucketed_seed", "bucketed_equal_length",
                          "length_grouped", "packed"}
    assert names["sorted"]["co_batch_recurrence"] == 1.0  # the reference run's frozen batches
    assert names["bucketed_optimal"]["dominated_by"] == "" and names["packed"]["dominated_by"] == ""
    assert names["packed"]["efficiency"] >= 0.98
    methods = pd.read_csv(out / "methods_by_k.csv")
    assert set(methods.k) == {1, 2, 3, 4, 5}
    for fig in ("lengths_edges", "efficiency_vs_k", "efficiency_vs_randomness"):
        html = (out / f"{fig}.html").read_text()
        assert not external_references(html) and len(html) > 1_000_000  # plotly.js inlined, nothing fetched


def test_fitted_cost_from_a_probe_folder(tmp_path):
    from dflash_lib.lab.study import fitted_cost

    (tmp_path / "cost_model.json").write_text(json.dumps({"q": 4096.0, "model": {}}))
    assert fitted_cost(str(tmp_path)) == ("quadratic", 4096.0)
    (tmp_path / "cost_model.json").write_text(json.dumps({"q": None}))
    with pytest.raises(ConfigError, match="no finite attention scale"):
        fitted_cost(str(tmp_path))
    with pytest.raises(ConfigError, match="does not exist"):
        fitted_cost(str(tmp_path / "nope"))
