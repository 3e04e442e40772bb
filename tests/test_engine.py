"""The real engine in the loop: vLLM's CPU build (`make engine`, .venv-engine) serves a tiny Qwen3 target with a
DFlash drafter trained here, and what it serves equals what we decode in process: the greedy answers token for
token, and the engine's own acceptance counters (drafts, accepted per position) equal our cycles per prompt, in
fp32. Also the counters' parser, and the server's lifecycle (a refused start names its log; a stop leaves no
process). `make test` installs the engine and requires it (DFLASH_REQUIRE_ENGINE=1); `ENGINE=0` skips these."""

from __future__ import annotations

import subprocess
from pathlib import Path

import httpx
import pytest
import torch

from dflash_lib.config import ConfigError
from dflash_lib.evaluate.acceptance import acceptance_length
from dflash_lib.models.export import export_drafter
from dflash_lib.serve import EngineClient, EngineServer, EngineSpec, SpecCounters, engine_python, parse_spec_counters
from dflash_lib.serve.vllm import server_args
from dflash_lib.evaluate.engine_check import VOCAB as V, check_models
from dflash_lib.evaluate.served import (ServedReport, judge, served_acceptance, served_histogram, served_table,
                                        served_tau_se, tau_se, verdict_line)
from dflash_lib.serve.measure import ServedSet
from dflash_lib.serve.client import ServedDecode
from tiny_models import (overfit_on_greedy, random_prompts, save_random_model, save_tiny_qwen3,
                         tiny_chatml_tokenizer)

NEW = 24  # tokens decoded per prompt
TRAINED = random_prompts(16, seed=1, vocab=V)  # the prompts whose greedy answers the drafter is trained on

METRICS = """# HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.
# TYPE vllm:spec_decode_num_drafts_total counter
vllm:spec_decode_num_drafts_total{engine="0",model_name="m"} 40.0
vllm:spec_decode_num_drafts_total{engine="1",model_name="m"} 3.0
vllm:spec_decode_num_drafts_created{engine="0",model_name="m"} 1.7963830051378393e+09
vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="m"} 129.0
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="m"} 51.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="0"} 29.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="2"} 8.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="m",position="1"} 14.0
vllm:spec_decode_num_accepted_tokens_per_pos_created{engine="0",model_name="m",position="0"} 1.79e+09
vllm:num_requests_running{engine="0",model_name="m"} 0.0
"""


def test_the_counters_parser_sums_engines_orders_positions_and_subtracts():
    c = parse_spec_counters(METRICS)
    assert c == SpecCounters(43.0, 129.0, 51.0, (29.0, 14.0, 8.0))  # the _created samples are timestamps: ignored
    assert c.tau == pytest.approx(1 + 51 / 43) and c.acceptance == pytest.approx([29 / 43, 14 / 43, 8 / 43])
    d = c - SpecCounters(3.0, 9.0, 1.0, (1.0,))
    assert d == SpecCounters(40.0, 120.0, 50.0, (28.0, 14.0, 8.0))
    none = parse_spec_counters("vllm:num_requests_running 0.0\n")  # an engine without a drafter
    assert none == SpecCounters(0.0, 0.0, 0.0, ()) and none.tau != none.tau  # nan


def _decode(outputs, counters, seconds=1.0):
    return ServedDecode(outputs, counters, [counters], seconds)


def test_served_rows_judge_exactly_when_greedy_fp32_and_by_three_standard_errors_otherwise():
    """Our 40 cycles (tokens 1, 2, 4, 4 per two prompts, 10 times: tau 2.75, position acceptance 3/4, 2/4, 2/4)
    against the engine's counters: equal counts pass exactly; one accepted token fewer fails when exact, passes
    within 3 SE otherwise; a collapse to tau 1 fails and the line names the doctor's failing rules."""
    outputs = [[5, 6], [7]] * 10
    s = ServedSet("heldout (thinking off)", [[1], [2]] * 10, outputs, [[(1, 1), (2, 2)], [(1, 4), (5, 4)]] * 10)
    same = SpecCounters(40, 120, 70, (30, 20, 20))
    assert served_histogram(same) == {1: 10, 2: 10, 3: 0, 4: 20}
    row = judge(s, _decode(outputs, same), 4, exact=True, sampled=False, plain=_decode(outputs,
                                                                                      SpecCounters(0, 0, 0, ()), 2.0))
    assert row.ok and row.tau == row.served_tau == 2.75 and row.per_position == [0.75, 0.5, 0.5]
    assert row.served_per_position == [0.75, 0.5, 0.5] and row.outputs_equal == 20 and row.bound == 0.0
    assert row.served_speedup == pytest.approx(2.0) and (row.cycles, row.served_drafts) == (40, 40)
    assert verdict_line(row, True, [], "E", "T").startswith("PASS served heldout (thinking off): served tau 2.750")
    assert served_tau_se([row, row]) == pytest.approx(tau_se(s.cycle_log * 2))  # the same cycles, pooled
    one_less = SpecCounters(40, 120, 69, (30, 20, 19))
    assert not judge(s, _decode(outputs, one_less), 4, True, False, None).ok
    loose = judge(s, _decode(outputs, one_less), 4, exact=False, sampled=True, plain=None)
    sd = (sum((k - 2.75) ** 2 for k in (1, 2, 4, 4)) / 4) ** 0.5  # ours; the engine's (one token less) a bit more
    assert loose.ok and loose.outputs_equal is None and 3 * sd / 40 ** 0.5 * 2 ** 0.5 == pytest.approx(
        loose.bound, rel=0.02)
    collapsed = SpecCounters(400, 1200, 0, (0, 0, 0))
    bad = judge(s, _decode(outputs, collapsed), 4, exact=False, sampled=True, plain=None)
    assert not bad.ok and bad.served_tau == 1.0
    line = verdict_line(bad, False, ["engine_layer_ids", "mask_token_id"], "EXPORT", "TARGET")
    assert line.startswith("FAIL served heldout") and "the doctor fails engine_layer_ids, mask_token_id" in line
    assert line.endswith("-> python -m dflash_lib doctor EXPORT --target TARGET")
    assert "the doctor passes every rule" in verdict_line(bad, False, [], "E", "T")
    wrong_answer = judge(s, _decode([[5, 6], [8]] + outputs[2:], same), 4, True, False, None)
    assert not wrong_answer.ok and wrong_answer.outputs_equal == 19
    table = served_table(ServedReport("py", "0.32.0", "float32", True, 0.0, [row, bad], [], "")).splitlines()
    assert table[0] == "engine vLLM 0.32.0 (float32, temperature 0)"
    assert table[2].split() == ["heldout", "(thinking", "off)", "2.750", "2.750", "30.0", "15.0", "2.00x",
                                "2.00-2.00x", "0.75/0.75", "0.50/0.50", "0.50/0.50"]
    assert table[3].split()[3:10] == ["2.750", "1.000", "30.0", "-", "-", "-", "0.75/0.00"]


def test_a_row_with_no_draft_fails_whatever_the_rule():
    """An engine that made no drafts (a server without the drafter, say) gives served tau nan: FAIL, exact or
    not, the line saying so; a set with no cycle of ours neither passes."""
    outputs = [[5, 6], [7]]
    s = ServedSet("heldout", [[1], [2]], outputs, [[(1, 2)], [(1, 1)]])
    for exact, sampled in ((True, False), (False, False), (False, True)):
        row = judge(s, _decode(outputs, SpecCounters(0, 0, 0, ())), 4, exact, sampled, None)
        assert not row.ok and row.served_drafts == 0
        assert "the engine made no drafts" in verdict_line(row, exact, [], "E", "T")
    empty = judge(ServedSet("none", [[1]], [[5]], [[]]), _decode([[5]], SpecCounters(2, 6, 3, (2, 1, 0))), 4, False,
                  True, None)
    assert not empty.ok and "our decoding made no drafting cycle" in verdict_line(empty, False, [], "E", "T")


def test_a_bf16_row_is_judged_against_ours_along_the_engines_answers():
    """Greedy, not exact (bf16): when the engine's answers part from ours, served tau is judged against our cycles
    along ITS answers (`along`): lower than ours on our answers, within the bound of ours along its answers, it
    passes; below that, it fails; `along` is ignored when exact."""
    outputs = [[5, 6], [7]] * 10
    s = ServedSet("heldout", [[1], [2]] * 10, outputs, [[(1, 1), (2, 2)], [(1, 4), (5, 4)]] * 10)  # tau 2.75
    served = SpecCounters(40, 120, 40, (30, 10, 0))  # tau 2.0: {1: 10, 2: 20, 3: 10}
    along = [[(1, 1), (2, 2)], [(1, 2), (3, 3)]] * 10  # ours along its answers: {1: 10, 2: 20, 3: 10}, tau 2.0
    assert not judge(s, _decode(outputs, served), 4, exact=False, sampled=False, plain=None).ok
    row = judge(s, _decode(outputs, served), 4, exact=False, sampled=False, plain=None, along=along)
    assert row.ok and row.tau == 2.75 and row.tau_along == 2.0 and row.served_tau == 2.0 and row.cycles_along == 40
    assert "vs ours along its answers 2.000" in verdict_line(row, False, [], "E", "T")
    worse = [[(1, 4), (5, 4)]] * 20  # ours along its answers 4.0: served 2.0 is far below
    assert not judge(s, _decode(outputs, served), 4, False, False, None, along=worse).ok
    exact = judge(s, _decode(outputs, served), 4, exact=True, sampled=False, plain=None, along=along)
    assert exact.tau_along is None and not exact.ok


def _metrics(drafts=0, running=0, finished=0, generated=0):
    return (f'vllm:spec_decode_num_drafts_total{{engine="0"}} {drafts}\n'
            f'vllm:num_requests_running{{engine="0"}} {running}\nvllm:num_requests_waiting{{engine="0"}} 0\n'
            f'vllm:request_success_total{{finished_reason="length"}} {finished}\n'
            f'vllm:request_success_total{{finished_reason="stop"}} 0\n'
            f'vllm:generation_tokens_total{{engine="0"}} {generated}\n')


class _Shared:
    """A stand-in server used by us and, when `other` says so, by another client: its /metrics count our request
    (3 tokens, 1 draft) and, during request number `other`, another client's (`how`: finished alongside, or still
    running)."""

    def __init__(self, other: int = -1, how: str = "finished"):
        self.state = dict(drafts=0, running=0, finished=0, generated=0)
        self.other, self.how, self.requests = other, how, 0

    def __call__(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == "/metrics":
            return httpx.Response(200, text=_metrics(**self.state))
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "m"}]})
        st = self.state
        st.update(drafts=st["drafts"] + 1, finished=st["finished"] + 1, generated=st["generated"] + 3)
        if self.requests == self.other:
            st.update(generated=st["generated"] + 5, drafts=st["drafts"] + 2)
            st.update(finished=st["finished"] + 1) if self.how == "finished" else st.update(running=1)
        self.requests += 1
        return httpx.Response(200, json={"choices": [{"token_ids": [1, 2, 3]}]})


@pytest.mark.parametrize("other, how", [(-1, ""), (1, "finished"), (0, "running")])
def test_counters_mixed_with_another_clients_requests_are_refused(other, how):
    """The counters of a decoding are deltas around each request: one request finished, exactly its tokens
    generated, none in flight before or after, else `BusyEngineError` names what else ran."""
    from dflash_lib.serve.client import BusyEngineError, parse_load

    assert parse_load(_metrics(running=2, finished=7, generated=40)).in_flight == 2
    client = EngineClient("http://engine", transport=httpx.MockTransport(_Shared(other, how)))
    if other < 0:
        got = client.decode([[1], [2], [3]], 3)
        assert got.counters.drafts == 3 and [c.drafts for c in got.per_prompt] == [1, 1, 1]
        return
    with pytest.raises(BusyEngineError, match="served other requests while one of ours was measured") as e:
        client.decode([[1], [2], [3]], 3)
    assert ("2 finished, 8 tokens generated for our 3" if how == "finished" else "0 / 1 in flight") in str(e.value)


def test_a_running_server_of_another_target_is_refused_before_anything_is_sent(tmp_path):
    """`-p engine_url`: the server must serve the target folder (its /v1/models root, or a folder of the same
    config.json and weights) and take the longest sequence; refused in one line naming both otherwise."""
    import shutil

    from dflash_lib.serve.measure import check_served_model

    save_tiny_qwen3(tmp_path / "t", vocab_size=V)
    shutil.copytree(tmp_path / "t", tmp_path / "copy")
    save_tiny_qwen3(tmp_path / "other", seed=1, vocab_size=V)

    def client(root, room=256, n=1):
        entry = {"id": str(root), "root": str(root), "max_model_len": room}
        return EngineClient("http://e", transport=httpx.MockTransport(
            lambda r: httpx.Response(200, json={"data": [entry] * n})))

    check_served_model(client(tmp_path / "t"), str(tmp_path / "t"), 200)
    check_served_model(client(tmp_path / "copy"), str(tmp_path / "t"), 200)  # the same bytes elsewhere
    for root, room, n, says in ((tmp_path / "other", 256, 1, "serves .*other', not the target"),
                                ("/nowhere/t", 256, 1, "serves '/nowhere/t', not the target"),
                                (tmp_path / "t", 256, 2, "give a server of the one target"),
                                (tmp_path / "t", 100, 1, "takes 100 tokens a sequence; these prompts need 200")):
        with pytest.raises(ConfigError, match=says) as e:
            check_served_model(client(root, room, n), str(tmp_path / "t"), 200)
        assert "\n" not in str(e.value)


class _Clock:
    """A fake engine client whose decodings take the seconds given, in order."""

    def __init__(self, seconds):
        self.seconds, self.calls = list(seconds), 0

    def complete(self, *a, **k):
        return [0]

    def decode(self, prompts, *a, **k):
        self.calls += 1
        return ServedDecode([[1] * 10 for _ in prompts], SpecCounters(self.calls, 0, 0, ()), [], self.seconds.pop(0))


def test_timed_rounds_take_each_sets_median_and_the_pooled_speedup_its_range():
    """Two sets, 3 rounds on each engine: every set is decoded once (answers and counters kept), then timed again
    round after round; its seconds are the median of its rounds; the pooled speedup is total tokens over total
    median seconds with vs without, its range the per-round pooled speedups."""
    from dflash_lib.evaluate.served import pooled_speedup
    from dflash_lib.serve.measure import ServedPass, _decode_all

    sets = [ServedSet("a", [[1], [2]], [], []), ServedSet("b", [[3]], [], [])]
    fast = _Clock([1.0, 0.5, 1.2, 0.8, 1.1, 0.5])  # a, b, then round 2: a, b, round 3: a, b
    slow = _Clock([2.0, 1.0, 2.0, 1.0, 2.2, 1.0])
    with_d = _decode_all(fast, ServedPass(sets), 10, (), 0, rounds=3)
    without = _decode_all(slow, ServedPass(sets), 10, (), 0, rounds=3)
    assert [d.round_seconds for d in with_d] == [(1.0, 1.2, 1.1), (0.5, 0.8, 0.5)]
    assert [d.seconds for d in with_d] == [1.1, 0.5] and [d.counters.drafts for d in with_d] == [1, 2]
    assert fast.calls == 6
    speedup, span = pooled_speedup(with_d, without)
    assert speedup == pytest.approx((30 / 1.6) / (30 / 3.0))  # medians: a 1.1 + b 0.5 vs a 2.0 + b 1.0
    assert span == pytest.approx([3.0 / 2.0, 3.2 / 1.6])  # rounds: 3.0/1.5, 3.0/2.0, 3.2/1.6
    s = ServedSet("a", [[1], [2]], [[1] * 10] * 2, [[(1, 1)] * 10] * 2)
    row = judge(s, with_d[0], 4, False, False, without[0])
    assert row.served_round_s == [1.0, 1.2, 1.1] and row.plain_round_s == [2.0, 2.0, 2.2]
    assert row.speedup_range == pytest.approx([2.0 / 1.2, 2.0 / 1.0])
    assert row.served_speedup == pytest.approx(2.0 / 1.1) and row.served_tokens == row.plain_tokens == 20
    one = _decode_all(_Clock([1.0, 2.0]), ServedPass(sets), 10, (), 0, rounds=1)
    assert [d.round_seconds for d in one] == [(), ()] and [d.seconds for d in one] == [1.0, 2.0]


def test_evaluate_refuses_the_engine_without_a_target_folder_before_loading(tmp_path):
    from dflash_lib.__main__ import main

    target, drafter = check_models()
    export_drafter(drafter, tmp_path / "d", torch.float32)
    with pytest.raises(ConfigError, match="engine vllm: the engine serves a local target folder"):
        main(["--debug", "evaluate", "--drafter", str(tmp_path / "d"), "--target", "tiny", "-p", "engine", "vllm",
              "-p", "hidden_size", "128", "-p", "target_layers", "4", "-p", "num_features", "2"])


def test_a_missing_engine_python_names_what_to_do(tmp_path, monkeypatch):
    monkeypatch.delenv("DFLASH_ENGINE_PYTHON", raising=False)
    with pytest.raises(ConfigError, match="make engine"):
        engine_python(str(tmp_path / "nothing" / "python"))
    monkeypatch.setenv("DFLASH_ENGINE_PYTHON", str(tmp_path / "nope"))
    with pytest.raises(ConfigError, match=str(tmp_path / "nope")):
        engine_python()


def test_the_server_flags_serve_the_drafter_with_block_size_minus_one_drafts(tmp_path):
    target, drafter = check_models()
    export_drafter(drafter, tmp_path / "d", torch.float32)
    args = server_args(EngineSpec(str(tmp_path / "t"), str(tmp_path / "d"), kv_cache_gib=0.5), 8000)
    spec = args[args.index("--speculative-config") + 1]
    assert '"method": "dflash"' in spec and '"num_speculative_tokens": 3' in spec  # blocks of 4
    assert '"draft_sample_method": "probabilistic"' in spec  # at T > 0 the standard rule, as ours
    assert args[args.index("--host") + 1] == "127.0.0.1" and "--skip-tokenizer-init" in args
    assert "--speculative-config" not in server_args(EngineSpec(str(tmp_path / "t")), 8000)


_SHAPE = dict(vocab_size=V, hidden_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
              head_dim=32, intermediate_size=256)  # heads of 32: the CPU build's attention serves none narrower


def _family_folder(path: Path, family: str = "qwen3_next") -> Path:
    """A tiny target of `family`, random (seeded) and saved. qwen3_next: 3 gated-delta-net layers then a full one,
    linear key and value heads of 64 (the CPU build's kernel refuses 32), 4 experts all routed to every token (in
    bf16 a top-k router's near ties flip experts, and the answers part at once; vLLM needs the MoE). gemma4: sliding (window 8) and
    full layers alternating, per-layer embeddings, the last layer reusing another's keys and values, soft-capped
    logits."""
    import transformers

    if family == "qwen3_next":
        cfg = transformers.Qwen3NextConfig(
            **_SHAPE, layer_types=["linear_attention"] * 3 + ["full_attention"], linear_num_key_heads=2,
            linear_num_value_heads=2, linear_key_head_dim=64, linear_value_head_dim=64, num_experts=4,
            num_experts_per_tok=4, moe_intermediate_size=64, shared_expert_intermediate_size=64)
    else:
        cfg = transformers.Gemma4TextConfig(
            **_SHAPE, sliding_window=8, layer_types=["sliding_attention", "full_attention"] * 2,
            hidden_size_per_layer_input=16, vocab_size_per_layer_input=V, num_kv_shared_layers=1, global_head_dim=64,
            final_logit_softcapping=30.0)
    save_random_model(path, cfg, spread=(0.3, 0.5))  # layers far from identity: the answers depend on every layer
    return path


def test_a_linear_attention_target_is_served_in_bf16_without_prefix_caching(tmp_path):
    from dflash_lib.serve.vllm import engine_dtype, linear_attention_target

    target, drafter = check_models()
    export_drafter(drafter, tmp_path / "d", torch.float32)
    target.model.save_pretrained(tmp_path / "qwen3")
    hybrid = _family_folder(tmp_path / "next")
    assert linear_attention_target(hybrid) and not linear_attention_target(tmp_path / "qwen3")
    assert not linear_attention_target(tmp_path / "nothing")
    assert (engine_dtype(hybrid, True), engine_dtype(tmp_path / "qwen3", True)) == ("bfloat16", "float32")
    assert engine_dtype(tmp_path / "qwen3", on_cpu=False) == "bfloat16"
    assert "--no-enable-prefix-caching" in server_args(EngineSpec(str(hybrid), str(tmp_path / "d")), 8000)
    assert "--no-enable-prefix-caching" not in server_args(EngineSpec(str(hybrid)), 8000)  # the target alone caches
    assert "--no-enable-prefix-caching" not in server_args(EngineSpec(str(tmp_path / "qwen3"), str(tmp_path / "d")),
                                                            8000)


# -- with the real engine ----------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def served(installed_engine_python, tmp_path_factory):
    """(target, drafter, client, server): the engine check's models (`evaluate.engine_check`), the target saved as a
    Hugging Face folder with a tokenizer, the drafter trained 30 steps on the target's greedy answers to TRAINED (tau
    ~2.7 of 4 on them: every draft position sometimes accepted, sometimes not) and exported in fp32, both served by the
    engine in fp32."""
    python = installed_engine_python
    root = tmp_path_factory.mktemp("engine")
    target, drafter = check_models()
    target.model.save_pretrained(root / "target")
    tiny_chatml_tokenizer().save_pretrained(root / "target")  # ~300 ids below V: `evaluate` renders prompts with it
    overfit_on_greedy(target, drafter, TRAINED, NEW, steps=30)
    export_drafter(drafter, root / "drafter", torch.float32)
    spec = EngineSpec(str(root / "target"), str(root / "drafter"), max_model_len=256, max_num_seqs=4,
                      kv_cache_gib=0.5)
    with EngineServer(spec, root / "engine.log", python=str(python)) as server:
        client = EngineClient(server.url)
        yield target, drafter, client, server
        client.close()


@pytest.mark.engine
def test_served_greedy_answers_and_acceptance_equal_ours_per_prompt(served):
    """Greedy, fp32: the engine's answers are the target's own greedy answers, and per prompt its counters hold
    exactly our drafting cycles and the cycles accepting each draft position (so tau and per-position acceptance
    are equal, not just close)."""
    target, drafter, client, _ = served
    prompts = TRAINED[:4] + random_prompts(2, seed=7, vocab=V)  # learnt answers, and new ones
    ours = acceptance_length(target, drafter, prompts, NEW)
    got = client.decode(prompts, NEW)
    assert got.outputs == ours.outputs == [target.greedy(p, NEW) for p in prompts]
    for cycles, c in zip(ours.cycle_log, got.per_prompt):
        accepted = [sum(1 for _, n in cycles if n > k) for k in range(1, 4)]  # cycles that accepted slot k
        assert (c.drafts, c.draft_tokens, list(c.per_position)) == (len(cycles), 3 * len(cycles), accepted)
    assert got.counters.tau == pytest.approx(ours.tau, abs=1e-12)
    assert got.counters.acceptance == pytest.approx(ours.per_position, abs=1e-12)
    assert 1.3 < ours.tau < 3.7 and all(0 < a < 1 for a in ours.per_position)  # neither none nor all accepted


def trained_and_served_as_ours(drafter, server, folder: Path):
    """Train `drafter` 30 steps on the greedy answers to TRAINED, export it in fp32 to `folder` and serve it on 4 of
    those prompts: the engine's answers and cycles must be ours exactly (greedy fp32). Returns our decoding."""
    target = drafter.target
    overfit_on_greedy(target, drafter, TRAINED, NEW, steps=30)
    export_drafter(drafter, folder, torch.float32)
    prompts = TRAINED[:4]
    ours = acceptance_length(target, drafter, prompts, NEW)
    report = served_acceptance(server.spec.target, str(folder), [ServedSet("trained", prompts, ours.outputs,
                               ours.cycle_log)], 4, NEW, python=str(server.python), log_dir=folder.parent, plain=False)
    (row,) = report.rows
    assert row.ok and row.outputs_equal == 4 and row.served_tau == pytest.approx(ours.tau, abs=1e-12), report.lines
    assert 1.3 < ours.tau < 3.7  # it drafts: some positions accepted, not all
    return ours


@pytest.mark.engine
@pytest.mark.slow  # its own engine start (~30 s)
def test_a_non_causal_sliding_drafter_is_served_as_we_decode_it(served, tmp_path):
    """z-lab's DFlash2 layout in small: two `sliding_attention` layers that are not causal (`-p drafter_causal
    non_causal`, exported as dflash_config.causal false) with a window of 3, which vLLM's non-causal window takes
    both ways: inside the block of 4 too. Trained here and exported in fp32, vLLM serves it with our answers and
    exactly our cycles (greedy fp32); the same weights run causal, vLLM's default for the kind, draft otherwise
    (two layers: with one, the block keys a causal query misses are MASK rows of one value, and no draft moved)."""
    from dflash_lib.models import DFlashDrafter, DrafterConfig

    target, _, _, server = served
    cfg = DrafterConfig(**{**check_models()[1].cfg.to_dict(), "num_layers": 2,
                           "layer_types": ["sliding_attention"] * 2, "sliding_window": 3, "causal": False})
    torch.manual_seed(0)
    drafter = DFlashDrafter(cfg, target)
    ours = trained_and_served_as_ours(drafter, server, tmp_path / "non_causal")
    causal = DFlashDrafter(DrafterConfig(**{**cfg.to_dict(), "causal": None}), target)
    causal.load_state_dict(drafter.state_dict())
    assert causal.cfg.layer_causal == [True] * 2 and drafter.cfg.layer_causal == [False] * 2
    assert acceptance_length(target, causal, TRAINED[:4], NEW).cycle_log != ours.cycle_log


@pytest.mark.engine
@pytest.mark.slow  # its own engine start (~30 s)
def test_a_sliding_window_draft_vocabulary_drafter_is_served_as_we_decode_it(served, tmp_path):
    """One drafter with both export features the engine must read beside the plain layout (one engine start, not
    two): a head of the target's rows of the answers' most frequent tokens, fewer than the answers use (so some
    labels are outside it: draft_vocab_size, d2t, lm_head), and a `sliding_attention` layer with a window of 6
    (shorter than the answers: it bites). Trained here and exported in fp32, vLLM serves it with our answers and
    exactly our cycles (greedy fp32), so its causal-in-block windowed attention and its draft vocabulary are ours;
    the same weights as a full-attention layer draft otherwise."""
    import numpy as np

    from dflash_lib.models import DFlashDrafter, DrafterConfig
    from dflash_lib.models.draft_vocab import coverage, top_tokens

    target, _, _, server = served
    counts = np.bincount(np.concatenate([target.greedy(p, NEW) for p in TRAINED]), minlength=V)
    n = int((counts > 0).sum()) * 3 // 4
    cfg = DrafterConfig(**{**check_models()[1].cfg.to_dict(), "draft_vocab_size": n,
                           "layer_types": ["sliding_attention"], "sliding_window": 6})
    torch.manual_seed(0)
    drafter = DFlashDrafter(cfg, target)
    ids = top_tokens(counts, n)
    drafter.set_draft_vocab(ids)
    assert 0.5 < coverage(counts, ids) < 1.0
    ours = trained_and_served_as_ours(drafter, server, tmp_path / "sliding-vocab")
    full = DFlashDrafter(DrafterConfig(**{**cfg.to_dict(), "layer_types": [], "sliding_window": 0}), target)
    full.set_draft_vocab(ids)
    full.load_state_dict(drafter.state_dict())
    assert acceptance_length(target, full, TRAINED[:4], NEW).cycle_log != ours.cycle_log


def _served_family(family: str, dtype: str, python, tmp_path: Path, edit=None):
    """A drafter trained here on the greedy answers of a tiny `family` target (in bf16: the engine's own, from a
    start without the drafter, as a drafter is trained on what the served target answers), exported in fp32 (with
    `edit` planted in the export, see `_planted`) and served by vLLM's CPU build in `dtype` on all 16 TRAINED
    prompts (the more cycles, the tighter the bound). Returns our own decoding, ours along the engine's answers
    (`acceptance_length(answers=...)`), the engine's decoding, and (bf16) the engine's answers without the
    drafter."""
    from dflash_lib.config import ModelConfig
    from dflash_lib.models import DFlashDrafter, DrafterConfig
    from dflash_lib.target.local import TargetModel
    from dflash_lib.serve.vllm import engine_dtype

    folder = _family_folder(tmp_path / "target", family)
    assert engine_dtype(folder, on_cpu=True) == dtype
    mc = ModelConfig(target=str(folder), num_features=2, target_layer_ids=[0, 2], drafter_layers=1,
                     block_size=4, mask_id=V - 1, num_anchors=64)
    target = TargetModel.from_model_config(mc, device="cpu")
    torch.manual_seed(0)
    drafter = DFlashDrafter(DrafterConfig.from_model_config(mc, target), target)
    plain = None
    if dtype != "float32":
        spec = EngineSpec(str(folder), None, dtype=dtype, max_model_len=256, max_num_seqs=1, kv_cache_gib=0.25)
        with EngineServer(spec, tmp_path / "engine-plain.log", python=str(python)) as server:
            client = EngineClient(server.url)
            plain = client.decode(TRAINED, NEW).outputs
            client.close()
    overfit_on_greedy(target, drafter, TRAINED, NEW, steps=30, answers=plain)
    export_drafter(drafter, tmp_path / "drafter", torch.float32)
    if edit is not None:
        _planted(tmp_path / "drafter", edit)
    prompts = TRAINED
    ours = acceptance_length(target, drafter, prompts, NEW)
    assert ours.outputs == [target.greedy(p, NEW) for p in prompts]  # our decoding over the family's cache
    spec = EngineSpec(str(folder), str(tmp_path / "drafter"), dtype=dtype, max_model_len=256, max_num_seqs=1,
                      kv_cache_gib=0.25)
    with EngineServer(spec, tmp_path / "engine.log", python=str(python)) as server:
        client = EngineClient(server.url)
        got = client.decode(prompts, NEW)
        client.close()
    along = acceptance_length(target, drafter, prompts, NEW, answers=got.outputs)
    assert 1.3 < along.tau < 4.0  # it drafts, along the answers it was trained for
    return ours, along, got, plain


def _judged(family: str, dtype: str, ours, along, got):
    """The gap alarm's row: exact in fp32 (our answers and cycles), else served tau against ours along the
    engine's own answers (`judge(along=...)`), within GAP_SIGMAS standard errors."""
    exact = dtype == "float32"
    row = judge(ServedSet(family, TRAINED, ours.outputs, ours.cycle_log), got, 4, exact=exact, sampled=False,
                plain=None, along=None if exact else along.cycle_log)
    return row, verdict_line(row, exact, [], "export", family)


@pytest.mark.engine
@pytest.mark.slow  # its own engine start (~40 s)
@pytest.mark.parametrize("family, dtype", [("qwen3_next", "bfloat16"), ("gemma4", "float32")])
def test_the_targets_drafters_are_wanted_for_are_served_at_our_tau(family, dtype, installed_engine_python,
                                                                   tmp_path):
    """A drafter trained here on the target's greedy answers, served by vLLM's CPU build. gemma-4 (sliding windows,
    per-layer embeddings, shared keys and values, soft-capped logits) in fp32: our answers and exactly our cycles.
    Qwen3-Next in bf16 (the build's gated-delta-net kernel has no fp32): how far the engine's bf16 answers follow
    our fp32 ones depends on the CPU's bf16 kernels (near ties part them), so served tau is judged against ours
    along the engine's OWN answers (the drafter's cycles on the same tokens), within the gap alarm's 3 standard
    errors: a rule no CPU's rounding moves, which a wrong export still fails (the planted faults below)."""
    ours, along, got, plain = _served_family(family, dtype, installed_engine_python, tmp_path)
    if dtype == "float32":
        assert got.outputs == ours.outputs and along.cycle_log == ours.cycle_log
    assert along.outputs == got.outputs
    row, line = _judged(family, dtype, ours, along, got)
    assert row.ok and row.served_tau > 1.3 and row.served_drafts > 0, line
    assert row.tau_along == (None if dtype == "float32" else pytest.approx(along.tau)), line
    same = sum(a == b for a, b in zip(got.outputs, ours.outputs))
    alike = "" if plain is None else f", {sum(a == b for a, b in zip(got.outputs, plain))} its own without the drafter"
    print(line, f"({same}/{len(ours.outputs)} served answers equal our fp32 ones{alike})")


@pytest.mark.engine
@pytest.mark.slow
@pytest.mark.long  # an engine start each (~40 s): `make test-long`
@pytest.mark.parametrize("edit", ["fc halves swapped", "aux ids without +1"])
def test_a_wrong_bf16_export_fails_the_rule_along_the_engines_answers(edit, installed_engine_python, tmp_path):
    """The bf16 rule above is not blind: the same Qwen3-Next drafter with its fc halves swapped, or its feature
    layers read one boundary early (vLLM's aux ids without the +1: the embeddings for layer 0), is served below
    ours along the engine's answers by more than the bound. (Both layer ids shifted by one, [1, 3] for [0, 2], is
    not reliably seen on this random target: served 1.57 vs ours 1.82, bound 0.34; adjacent layers' features
    differ little there.)"""
    ours, along, got, _ = _served_family("qwen3_next", "bfloat16", installed_engine_python, tmp_path, edit)
    row, line = _judged("qwen3_next", "bfloat16", ours, along, got)
    assert not row.ok and row.served_tau < row.tau_along - row.bound, line
    print(line)


@pytest.mark.engine
def test_stop_ids_end_the_served_answer_as_ours(served):
    """A stop id ends the answer, included, never before min_new_tokens: the same ids as our decoding."""
    target, drafter, client, _ = served
    prompts = TRAINED[4:12]
    plain = [target.greedy(p, NEW) for p in prompts]
    stop = max(set(t for o in plain for t in o[2:]), key=lambda t: sum(o[2:].count(t) for o in plain))
    ours = acceptance_length(target, drafter, prompts, NEW, stop_ids=[stop], min_new_tokens=2)
    got = client.decode(prompts, NEW, stop_ids=[stop], min_tokens=2)
    assert got.outputs == ours.outputs
    assert sum(o[-1] == stop for o in ours.outputs) >= 2 and any(len(o) < NEW for o in ours.outputs)


@pytest.mark.engine
def test_a_refused_start_names_the_log_and_leaves_no_process(installed_engine_python, tmp_path):
    python = installed_engine_python
    (tmp_path / "target").mkdir()
    (tmp_path / "target" / "config.json").write_text('{"model_type": "qwen3", "architectures": ["Nope"]}')
    server = EngineServer(EngineSpec(str(tmp_path / "target")), tmp_path / "engine.log", python=str(python))
    with pytest.raises(RuntimeError, match="engine.log") as e:
        server.start()
    assert "exited with code" in str(e.value) and server.proc is None
    assert (tmp_path / "engine.log").read_text().startswith("$ ")


@pytest.mark.engine
@pytest.mark.slow  # its own engine start (~30 s)
def test_the_engine_check_command_says_ok_and_leaves_no_engine_process(installed_engine_python, tmp_path, capsys,
                                                                       monkeypatch):
    """What `make engine` runs after installing: one greedy answer equal to the target's, drafted. Then the
    server is stopped: no process its log names (the API server, the engine core, its worker) is left, and
    nothing answers on its port."""
    import re

    import httpx

    from dflash_lib.__main__ import main
    from dflash_lib.serve.server import group_alive

    python = installed_engine_python
    monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING", raising=False)  # vLLM's default, as users run it
    assert main(["engine-check", "--python", str(python), "--log", str(tmp_path / "engine.log")]) == 0
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert line.startswith("engine ok: vLLM 0.") and "16 greedy tokens equal to the target's" in line
    assert float(line.split("tau ")[1]) >= 1.0 and int(line.split(", ")[-2].split()[0]) > 0  # drafts made
    log = (tmp_path / "engine.log").read_text()
    pids = {int(p) for p in re.findall(r"\((?:APIServer|EngineCore|Worker|VllmWorker-\d+) pid=(\d+)\)", log)}
    assert len(pids) >= 3  # the API server, the engine core and its worker
    ps = subprocess.run(["ps", "-eo", "pid=,stat="], capture_output=True, text=True, check=True).stdout
    alive = {int(f[0]) for f in (line.split() for line in ps.splitlines()) if not f[1].startswith("Z")}
    assert pids & alive == set() and all(group_alive(p) == [] for p in pids)
    port = int(re.search(r"--port (\d+)", log).group(1))
    with pytest.raises(httpx.TransportError):
        httpx.get(f"http://127.0.0.1:{port}/health", timeout=2.0)


@pytest.mark.engine
def test_evaluate_with_the_engine_serves_the_same_prompts_beside_ours(served, tmp_path, capsys):
    """`evaluate -p engine vllm -p engine_url URL` on a JSONL prompt set rendered by the target folder's tokenizer:
    the JSON line's `served` row equals our figures exactly (greedy fp32) and says PASS."""
    import json

    from dflash_lib.__main__ import main
    from dflash_lib.evaluate import DecodeReport

    _, _, _, server = served
    target_dir, drafter_dir = server.spec.target, server.spec.drafter
    questions = tmp_path / "q.jsonl"
    questions.write_text("".join(json.dumps({"id": f"q{i}", "messages": [{"role": "user", "content": q}]}) + "\n"
                                 for i, q in enumerate(["Hi there", "What is 2+2?", "Tell me a story"])))
    code = main(["evaluate", "--drafter", drafter_dir, "--target", target_dir, "-p", "engine", "vllm", "-p",
                 "engine_url", server.url, "-p", "prompts_from", str(questions), "-p", "tokenizer", target_dir, "-p",
                 "template", "chatml", "-p", "prompts", "3", "-p", "max_new_tokens", "16", "-p", "num_features", "2",
                 "-p", "target_layer_ids", "[0, 2]"])
    out, err = capsys.readouterr()
    assert code == 0
    report = json.loads(out.strip().splitlines()[-1])
    assert DecodeReport.from_json(report).to_json() == report  # the nested served record reads back
    served_report = report["served"]
    (row,) = served_report["rows"]
    assert served_report["exact"] and served_report["engine"] == server.url and served_report["version"] != "?"
    assert (row["prompts"], row["cycles"], row["served_drafts"]) == (3, report["cycles"], report["cycles"])
    assert row["tau"] == row["served_tau"] == report["tau"] and row["per_position"] == report["per_position"]
    assert row["outputs_equal"] == 3 and row["ok"] and row["plain_tokens_per_s"] is None
    assert served_report["lines"][0].startswith(f"PASS served {questions} (thinking off): served tau")
    assert "served by" in err and served_report["lines"][0] in err


@pytest.mark.engine
@pytest.mark.slow  # its own engine start (~25 s)
def test_evaluate_exits_1_on_a_failed_verdict_and_refuses_another_targets_server(served, tmp_path, capsys):
    """`evaluate -p engine_url URL` of a server that serves the target WITHOUT the drafter: the engine makes no
    drafts, its row FAILs (nothing measured passes nothing), and evaluate exits 1; a --target other than the
    server's is refused (exit 2) before any weight is read."""
    import json

    from dflash_lib.__main__ import main

    _, _, _, server = served
    target_dir, drafter_dir = server.spec.target, server.spec.drafter
    questions = tmp_path / "q.jsonl"
    questions.write_text("".join(json.dumps({"id": f"q{i}", "messages": [{"role": "user", "content": q}]}) + "\n"
                                 for i, q in enumerate(["Hi there", "What is 2+2?", "Tell me a story"])))
    spec = EngineSpec(target_dir, None, max_model_len=256, max_num_seqs=1, kv_cache_gib=0.25)
    with EngineServer(spec, tmp_path / "plain.log", python=str(server.python)) as plain:
        common = ["-p", "engine", "vllm", "-p", "engine_url", plain.url, "-p", "prompts_from", str(questions), "-p",
                  "tokenizer", target_dir, "-p", "template", "chatml", "-p", "prompts", "3", "-p", "max_new_tokens",
                  "16", "-p", "num_features", "2", "-p", "target_layer_ids", "[0, 2]"]
        code = main(["evaluate", "--drafter", drafter_dir, "--target", target_dir, *common])
        err = capsys.readouterr().err
        assert code == 1 and "the engine made no drafts" in err and "error: 1 served verdict(s) FAIL" in err
        save_tiny_qwen3(tmp_path / "another", seed=3, vocab_size=V, hidden_size=128, num_heads=4, num_kv_heads=2)
        code = main(["evaluate", "--drafter", drafter_dir, "--target", str(tmp_path / "another"), *common])
        err = capsys.readouterr().err
    assert code == 2 and f"serves {str(Path(target_dir).resolve())!r}, not the target" in err and "prompts:" not in err


def _shift_layers(doc, weights):
    doc["dflash_config"]["target_layer_ids"] = [1, 3]  # both fields shifted by one: every engine agrees, wrongly
    doc["eagle_aux_hidden_state_layer_ids"] = [2, 4]


def _aux_without_the_plus_one(doc, weights):
    doc["eagle_aux_hidden_state_layer_ids"] = list(doc["dflash_config"]["target_layer_ids"])


def _mask(mask):
    def edit(doc, weights):
        doc["dflash_config"]["mask_token_id"] = mask
    return edit


def _block_size_8(doc, weights):
    doc["block_size"] = doc["dflash_config"]["block_size"] = 8


def _swap_fc_halves(doc, weights):
    fc = weights["fc.weight"]
    h = fc.shape[0]
    weights["fc.weight"] = torch.cat([fc[:, h:], fc[:, :h]], dim=1).contiguous()  # the two fused layers exchanged


FAULTS = {"fc halves swapped": _swap_fc_halves, "layers shifted": _shift_layers,
          "aux ids without +1": _aux_without_the_plus_one}


def _planted(folder: Path, edit) -> None:
    """The exported drafter in `folder` with `edit(config doc, weights)` (or the FAULTS entry it names) applied."""
    import json

    from safetensors.torch import load_file, save_file

    edit = FAULTS.get(edit, edit)
    doc = json.loads((folder / "config.json").read_text())
    weights = load_file(str(folder / "model.safetensors"))
    edit(doc, weights)
    (folder / "config.json").write_text(json.dumps(doc))
    save_file(weights, str(folder / "model.safetensors"))


@pytest.mark.engine
@pytest.mark.slow  # an engine start per fault (~27 s each)
@pytest.mark.parametrize("edit, says, rule", [
    (_shift_layers, "a train/serve gap", "trained_as"),  # served: acceptance lower (2.41 vs 2.67, LOG.md)
    (_aux_without_the_plus_one, "a train/serve gap", "engine_layer_ids"),  # served: vLLM reads the wrong layers
    (_mask(V), "the engine failed a request", "mask_token_id"),  # past the embedding: the first request fails
    # `make test-long` (an engine start each, past make test's budget; figures in LOG.md, 2026-12-04):
    pytest.param(_block_size_8, "a train/serve gap", "trained_as",  # 7 drafts a step: positions differ from ours
                 marks=pytest.mark.long),
    pytest.param(_swap_fc_halves, "a train/serve gap", "trained_as",  # the same shapes: loads, acceptance lower
                 marks=pytest.mark.long),
], ids=["layers shifted", "aux ids without +1", "mask past the vocabulary", "block size 8", "fc halves swapped"])
# (MASK 0, an ordinary row, was served too (2026-12-04): acceptance lower, named by trained_as like the layers
# shifted; the doctor's mask rule is checked at its boundaries in tests/test_doctor.py without the engine)
def test_a_planted_export_fault_is_what_the_real_engine_shows_and_the_doctor_names(served, tmp_path, edit, says,
                                                                                   rule):
    """What the REAL engine does with each fault planted in the export (none is refused at load: it serves
    with other acceptance, or fails the first request), and the FAIL line naming the doctor rule that catches it
    before serving."""
    import shutil

    from dflash_lib.doctor import diagnose

    target, drafter, _, server = served
    folder = tmp_path / "faulty"
    shutil.copytree(server.spec.drafter, folder)
    _planted(folder, edit)
    prompts = TRAINED[:4]
    ours = acceptance_length(target, drafter, prompts, NEW)
    sets = [ServedSet("trained", prompts, ours.outputs, ours.cycle_log)]
    report = served_acceptance(server.spec.target, str(folder), sets, 4, NEW, python=str(server.python),
                               log_dir=tmp_path, plain=False,
                               doctor=lambda: diagnose(folder, server.spec.target, {"doctor_samples": 1}).failed())
    line = report.lines[-1]
    assert line.startswith("FAIL served") and says in line and "the doctor fails " in line and rule in line
    if report.rows:  # served: lossless all the same (the target verifies every draft), other acceptance
        (row,) = report.rows
        assert row.outputs_equal == 4 and row.served_tau != row.tau and not row.ok
        assert row.plain_tokens_per_s is None  # plain=False: the engine was started once
    else:
        assert "500" in line


@pytest.mark.engine
@pytest.mark.slow  # an engine start with the real target's tokenizer (~35 s), its conversion once per machine
def test_regenerate_through_the_real_server_equals_local_greedy(installed_engine_python, tmp_path):
    """`regenerate --backend openai` against vLLM's chat endpoint serving the demo's REAL target
    (SmolLM2-135M-Instruct, its own tokenizer and chat template, as text) writes the same answers as `--backend
    local` greedy on the same folder rendered by the same template (`-p template hf`), token for token; a second
    turn is asked after the first answer."""
    import json

    from dflash_lib.config import from_params
    from dflash_lib.lab.real_target import ensure_real_target, real_target_params
    from dflash_lib.regenerate import regenerate

    python = installed_engine_python
    folder = ensure_real_target()  # .cache/real_targets, as the demo's
    source = tmp_path / "src.jsonl"
    source.write_text("".join(json.dumps({"id": str(i), "messages": m}) + "\n" for i, m in enumerate([
        [{"role": "user", "content": "What is the capital of France?"}, {"role": "assistant", "content": "x"}],
        [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "x"},
         {"role": "user", "content": "And another one?"}, {"role": "assistant", "content": "x"}],
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Write a haiku about rain."},
         {"role": "assistant", "content": "x"}]])))
    common = dict(real_target_params(folder), source=str(source), max_new_tokens=16, num_features=1)
    local = regenerate(from_params(dict(common, backend="local")), tmp_path / "local.jsonl", progress=False)
    spec = EngineSpec(str(folder), max_model_len=512, max_num_seqs=2, kv_cache_gib=0.25, token_ids=False)
    with EngineServer(spec, tmp_path / "engine.log", python=str(python)) as server:
        served_report = regenerate(from_params(dict(common, backend="openai", base_url=server.url + "/v1")),
                                   tmp_path / "served.jsonl", progress=False)
    assert local["totals"]["records"] == served_report["totals"]["records"] == 3
    mine = [json.loads(line) for line in (tmp_path / "local.jsonl").read_text().splitlines()]
    theirs = [json.loads(line) for line in (tmp_path / "served.jsonl").read_text().splitlines()]
    for a, b in zip(mine, theirs):  # the same number of tokens per answer, ended the same way, the same text
        assert (a["regen"]["finish"], a["regen"]["completion_tokens"]) == (b["regen"]["finish"],
                                                                          b["regen"]["completion_tokens"])
        assert a["messages"] == b["messages"]
    answers = [m["content"] for r in mine for m in r["messages"] if m["role"] == "assistant"]
    assert len(answers) == 4 and "Paris" in answers[0]  # a real instruct model's answers, not a toy's


def test_a_fail_line_names_a_known_engine_fault_of_its_version_and_kind():
    from dflash_lib.serve.vllm import known_fault

    assert "vllm-project/vllm#55005" in known_fault("0.32.0", 1.0)
    assert known_fault("0.32.0", 0.0) == "" and known_fault("0.33.0", 1.0) == ""


# -- a training run's drafters served: the best one named by served tau ------------------------------------------
def test_the_best_drafter_is_named_by_served_tau_when_every_drafter_was_served():
    from dflash_lib.evaluate import DrafterMeasurement, best_drafter

    def row(step, tau, served=None):
        return DrafterMeasurement(step, f"d{step}", tau, {}, [], 1, None, 1.0, served_tau=served)

    assert best_drafter([row(0, 1.0), row(2, 2.5), row(4, 2.5)])[:2] == (row(4, 2.5), "tau")  # ties: later step
    # served: the one the engine accepts most, whatever our tau says
    best, by, tau = best_drafter([row(0, 1.0, 1.0), row(2, 2.9, 1.2), row(4, 2.5, 2.4)])
    assert (best.step, by, tau) == (4, "served tau", 2.4)
    assert best_drafter([row(0, 1.0, 2.0), row(2, 2.9, 2.0)])[0].step == 2  # served ties: our tau
    assert best_drafter([row(0, 1.0, 2.0), row(2, 2.9)])[1] == "tau"  # not every drafter served: ours


def test_a_runs_evaluation_refuses_a_running_server_before_loading(tmp_path):
    from dflash_lib.evaluate import evaluate_run

    with pytest.raises(ConfigError, match="engine_url: a running server serves one drafter"):
        evaluate_run(tmp_path / "nowhere", None, {"engine": "vllm", "engine_url": "http://127.0.0.1:1"})


@pytest.fixture(scope="module")
def folder_run(installed_engine_python, tmp_path_factory):
    """A real 2-step training run against a target FOLDER the engine serves (Qwen3, hidden 64, 2 layers, head_dim
    32, Qwen3's vocabulary; the smoke preset's token store)."""
    from dflash_lib.config import from_params
    from dflash_lib.train.loop import train

    root = tmp_path_factory.mktemp("run")
    save_tiny_qwen3(root / "target", hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=2)
    config = from_params(dict(limit=300, max_len=512, target=str(root / "target"), hidden_size=64, target_layers=2,
                              num_features=1, num_anchors=8, block_size=4, token_budget=2048, k=4, steps=2,
                              ckpt_every=2, eval_every=0, log_every=1, prefetch=2, wandb_mode="disabled"))
    train(config, root / "train")
    return root


@pytest.mark.engine
@pytest.mark.slow  # three engine starts (~90 s): the untrained drafter, the final one, the target alone
def test_evaluate_run_serves_every_drafter_and_names_the_best_by_served_tau(folder_run, tmp_path):
    """`evaluate_run -p engine vllm`: every drafter of the run (untrained, final) served on the same held-out
    prompts; greedy fp32 served tau equals ours exactly per drafter; the final drafter also served sampled at
    `sampled_temperature` and against the target alone (the engine's speedup); logs in the out folder; the best
    drafter named by served tau; the notebook's summary carries it."""
    import json

    from dflash_lib.evaluate import RunEvaluation, evaluate_run, run_summary

    said: list[str] = []
    report = evaluate_run(folder_run, None, {"engine": "vllm", "prompts": 3, "max_new_tokens": 12,
                                             "timing_warmup": False}, out_dir=tmp_path, say=said.append)
    assert [r.step for r in report.by_step] == [0, 2]
    for r in report.by_step:
        (row,) = r.served.rows
        assert r.served.exact and row.ok and row.outputs_equal == 3 and row.served_drafts == row.cycles == r.cycles
        assert r.served_tau == row.served_tau == pytest.approx(r.tau, abs=1e-9)
        assert row.per_position == pytest.approx(row.served_per_position)
    untrained, final = report.by_step
    assert untrained.served.rows[0].plain_tokens_per_s is None  # the target alone: once, with the final drafter
    plain = final.served.rows[0]
    assert plain.plain_tokens_per_s > 0 and plain.served_speedup == pytest.approx(plain.served_tokens_per_s /
                                                                                  plain.plain_tokens_per_s)
    assert report.final.served == final.served
    hot = report.sampled.served
    assert hot.temperature == 1.0 and not hot.exact and hot.rows[0].outputs_equal is None
    assert hot.rows[0].served_drafts > 0 and hot.rows[0].plain_tokens_per_s > 0
    logs = sorted(p.name for p in (tmp_path / "engine").iterdir())
    assert logs == ["engine-step-0.log", "engine-step-2-plain.log", "engine-step-2.log"]
    best = max(report.by_step, key=lambda r: (r.served_tau, r.tau, r.step))
    assert (report.best_by, report.best_step, report.best_tau) == ("served tau", best.step, best.served_tau)
    assert f"best drafter by served tau: step {best.step}" in "\n".join(said)
    doc = json.loads(json.dumps(report.to_json()))
    assert RunEvaluation.from_json(doc) == report
    summary = run_summary(report)
    assert summary["served_tau_by_step"] == {"0": untrained.served_tau, "2": final.served_tau}
    assert summary["best_by"] == "served tau" and summary["served"]["rows"][0]["ok"]


def test_a_second_engine_is_one_adapter_and_its_registry_entry(tmp_path, monkeypatch):
    """`EngineServer` starts whatever `EngineSpec.engine` names: its adapter's module, flags and environment (a
    stand-in engine here: a module answering /health and naming the target in /v1/models, found through the
    environment its adapter asks for); an unknown engine is refused in one line."""
    import sys

    import httpx

    from dflash_lib.config import ConfigError
    from dflash_lib.serve import server
    from dflash_lib.serve.adapter import EngineAdapter

    (tmp_path / "fake_engine.py").write_text(
        "import http.server, json, sys\n"
        "class H(http.server.BaseHTTPRequestHandler):\n"
        "    def do_GET(self):\n"
        "        self.send_response(200 if self.path in ('/health', '/v1/models') else 404); self.end_headers()\n"
        f"        models = {{'data': [{{'id': {str(tmp_path.resolve())!r}}}]}}\n"
        "        self.wfile.write(json.dumps(models).encode() if self.path == '/v1/models' else b'')\n"
        "    def log_message(self, *a): pass\n"
        "http.server.HTTPServer(('127.0.0.1', int(sys.argv[sys.argv.index('--port') + 1])), H).serve_forever()\n")
    fake = EngineAdapter(name="fake", module="fake_engine", args=lambda spec, port: ["--port", str(port)],
                         env=lambda spec: {"PYTHONPATH": str(tmp_path)}, dtype=lambda target, cpu: "float32",
                         known_fault=lambda version, t: "", spec_prefix="fake:", load_metrics={})
    monkeypatch.setitem(server.ENGINES, "fake", fake)
    with server.EngineServer(EngineSpec(str(tmp_path), engine="fake"), tmp_path / "e.log", sys.executable,
                             start_timeout_s=60) as s:
        assert s.engine is fake and httpx.get(s.url + "/health").status_code == 200
    assert (tmp_path / "e.log").read_text().splitlines()[0] == f"$ {sys.executable} -m fake_engine --port {s.port}"
    with pytest.raises(ConfigError, match=r"^engine 'sglang' is not one of \['fake', 'vllm'\]$"):
        server.EngineServer(EngineSpec(str(tmp_path), engine="sglang"), tmp_path / "e.log", sys.executable)
