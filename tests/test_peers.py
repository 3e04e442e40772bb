"""The peers' comparison (dflash_lib/lab/peers.py, benchmarks/peers/): its rows from the engine's counters, the
peak memory read from GNU time, and docs/peers.md's table equal to the one results.json renders (never by hand)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dflash_lib.lab.peers import (SPREAD_BEGIN, SPREAD_END, TABLE_BEGIN, TABLE_END, PeerRow, SpreadLine, peak_rss_gib,
                                  loss_thirds, peers_table, served_fields, spread_table, with_table)
from dflash_lib.serve.client import ServedDecode, SpecCounters
from dflash_lib.evaluate.served import ServedReport, judge, pooled_speedup
from dflash_lib.serve.measure import ServedSet

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "peers" / "results.json"
SPREAD = REPO / "benchmarks" / "peers" / "spread.json"
DOCS = REPO / "docs" / "peers.md"


def _report() -> ServedReport:
    """Two sets served (2 and 4 drafting steps), each timed in 3 rounds with and without the drafter."""
    rows = []
    for name, counters in (("a", SpecCounters(2, 6, 3, (2, 1, 0))), ("b", SpecCounters(4, 12, 2, (1, 1, 0)))):
        ours = ServedSet(name, [[1, 2]], [[5, 6, 7]], [[(2, 3)]])
        engine = ServedDecode([[5, 6, 7]], counters, [counters], 0.5, (0.5, 0.6, 0.4))
        none = SpecCounters(0, 0, 0, ())
        plain = ServedDecode([[5, 6, 7]], none, [none], 1.0, (1.0, 1.1, 0.9))
        rows.append(judge(ours, engine, 4, True, False, plain))
    d = [ServedDecode([[5, 6, 7]], SpecCounters(2, 6, 3, (2, 1, 0)), [], 0.5, (0.5, 0.6, 0.4))]
    speedup, span = pooled_speedup(d, [ServedDecode([[5, 6, 7]], SpecCounters(0, 0, 0, ()), [], 1.0, (1.0, 1.1, 0.9))])
    return ServedReport("py", "0.32.0", "float32", True, 0.0, rows, [], "x.log", speedup, span)


def test_a_rows_served_tau_weights_each_set_by_the_engines_drafts():
    got = served_fields(_report())
    # set a: 2 steps, 3 accepted -> 2.5; set b: 4 steps, 2 accepted -> 1.5; together (2*2.5 + 4*1.5) / 6 = 1 + 5/6
    assert got["served_tau_per_set"] == {"a": 2.5, "b": 1.5}
    assert got["served_tau"] == pytest.approx(1 + 5 / 6, abs=1e-12)
    assert got["served_per_position"]["a"] == [1.0, 0.5, 0.0]
    assert got["served"] and got["prompts"] == 2 and got["outputs_equal"] == 2
    assert got["served_speedup"] == pytest.approx(2.0) and got["speedup_range"] == pytest.approx([1.1 / 0.6, 0.9 / 0.4])


def test_no_drafting_step_means_not_served():
    r = _report()
    for row in r.rows:
        row.served_drafts = 0
    got = served_fields(r)
    assert not got["served"] and got["served_tau"] is None


def test_peak_memory_is_read_from_gnu_time():
    text = "\tCommand being timed: \"x\"\n\tMaximum resident set size (kbytes): 2097152\n\tExit status: 0\n"
    assert peak_rss_gib(text) == 2.0
    assert peak_rss_gib("no report") is None


def test_the_table_shows_a_refused_trainer_with_its_reason_and_the_docs_block_is_replaced_alone():
    rows = [PeerRow("ours", "ran", "", "1.0", train_tokens=198363, tokens_per_s=1234.4, tokens_per_cpu_s=700.2, peak_rss_gib=1.5, served=True, served_tau=1.8,
                    served_tau_per_set={"a": 1.9}, served_speedup=1.4, speedup_range=[1.3, 1.5], outputs_equal=8,
                    prompts=8, zlab_tau=1.8),
            PeerRow("specforge", "refused", "needs CUDA | here", "0.2.0", zlab_reason="not served")]
    table = peers_table(rows, ["a"])
    lines = table.splitlines()
    assert lines[2].split(" | ")[3:8] == ["198,363", "1234", "700", "1.50", "1.800"] and "1.40x (1.30-1.50)" in lines[2]
    assert "refused: needs CUDA / here" in lines[3] and "— (not served)" in lines[3]
    doc = f"intro\n{TABLE_BEGIN}\nold\n{TABLE_END}\nafter\n"
    assert with_table(doc, table) == f"intro\n{TABLE_BEGIN}\n{table}\n{TABLE_END}\nafter\n"
    with pytest.raises(ValueError, match="markers"):
        with_table("no markers", table)


def test_docs_table_is_the_one_the_committed_results_render():
    results = json.loads(RESULTS.read_text())
    rows = [PeerRow.from_json(r) for r in results["rows"]]
    assert {r.trainer for r in rows} >= {"ours", "speculators", "specforge"}
    text = DOCS.read_text()
    block = text[text.index(TABLE_BEGIN) + len(TABLE_BEGIN):text.index(TABLE_END)].strip()
    assert block == peers_table(rows, results["sets"])


def test_the_spread_table_lists_every_retraining_and_each_trainers_mean_over_its_seeds():
    """Reference rows count as seed 0; ours' seeds and a peer's seed join their trainer's mean, a lever does not: a
    lever run with two seeds or more has a mean of its own, after the trainers'."""
    ref = [PeerRow("ours", "ran", "", "0.1", served_tau=1.10, served_tau_per_set={"a": 1.2}),
           PeerRow("speculators", "ran", "", "0.9", served_tau=1.20, served_tau_per_set={"a": 1.3}),
           PeerRow("specforge", "refused", "no", "0.2")]
    lines = [SpreadLine("seed", 1, {}, 100, 2.0, 1.14, 0.01, 900, {"a": 1.25}),
             SpreadLine("dpace", 0, {"position_weight": "dpace"}, 100, 2.0, 1.50, 0.01, 800, {"a": 1.6}),
             SpreadLine("speculators", 1, {}, 99, 3.0, 1.16, 0.02, 850, {"a": 1.31}),
             SpreadLine("l2", 0, {"drafter_layers": 2}, 100, 2.0, 1.30, 0.01, 800, {"a": 1.4}),
             SpreadLine("l2", 1, {"drafter_layers": 2}, 100, 2.0, 1.40, 0.01, 800, {"a": 1.5}),
             SpreadLine("order", 1, {"sampler_seed": "1"}, 100, 2.0, 1.20, 0.01, 800, {"a": 1.3}),
             SpreadLine("order", 2, {"sampler_seed": "2"}, 100, 2.0, 1.24, 0.01, 800, {"a": 1.3})]
    table = spread_table(lines, ref).splitlines()
    assert len(table) == 2 + 2 + 7 + 4  # head, rule, 2 reference rows that served, 7 lines, 4 means
    assert "| ours | sampler_seed = the seed | 2 | 1.240 | 0.010 | 800 | 1.300 |" in table
    assert "| ours | position_weight dpace | 0 | 1.500 | 0.010 | 800 | 1.600 |" in table
    assert "| speculators | the job's recipe | 1 | 1.160 | 0.020 | 850 | 1.310 |" in table
    assert table[-4].startswith("| **ours** | mean of 2 seeds (SD across seeds) | — | **1.120** | (0.028) |")
    # against ours' seeds (1.10, 1.14): the difference of the means over Welch's SE, sqrt(s1^2/n1 + s2^2/n2)
    assert table[-3].startswith("| **speculators** | mean of 2 seeds (SD across seeds); +0.060 on ours' seeds, 2.1 SE "
                                "| — | **1.180** | (0.028) |")  # SE sqrt(0.0008/2 + 0.0008/2) = 0.028
    assert table[-2].startswith("| **ours** | drafter_layers 2: mean of 2 seeds (SD across seeds); +0.230 on ours' "
                                "seeds, 4.3 SE | — | **1.350** | (0.071) |")  # SE sqrt(0.005/2 + 0.0008/2) = 0.054
    assert table[-1].startswith("| **ours** | sampler_seed = the seed: mean of 2 seeds (SD across seeds); +0.100 on "
                                "ours' seeds, 3.5 SE | — | **1.220** | (0.028) |")  # one lever over seeds


def test_docs_spread_table_is_the_one_the_committed_lines_render():
    lines = [SpreadLine.from_json(x) for x in json.loads(SPREAD.read_text())]
    rows = [PeerRow.from_json(r) for r in json.loads(RESULTS.read_text())["rows"]]
    assert {ln.tag for ln in lines} >= {"seed", "speculators", "specforge"}  # every trainer's seed spread
    text = DOCS.read_text()
    block = text[text.index(SPREAD_BEGIN) + len(SPREAD_BEGIN):text.index(SPREAD_END)].strip()
    assert block == spread_table(lines, rows)


def test_loss_thirds_averages_each_third_of_the_steps():
    assert loss_thirds([9.0, 6.0, 3.0]) == (9.0, 6.0, 3.0)
    assert loss_thirds([1, 2, 3, 4, 5, 6, 7]) == (1.5, 3.5, 6.0)  # cuts at 7 // 3 = 2 and 14 // 3 = 4: 2, 2, 3 steps
    with pytest.raises(ValueError, match="2 steps"):
        loss_thirds([1.0, 2.0])
