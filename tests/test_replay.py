"""The replay loop (the main job): scheduling policy, report, traces, CLI."""

import json

import pytest

from conftest import SHARED
from gpukv.cli import main
from gpukv.replay import Replay, ReplayOptions
from gpukv.traces import builtin_trace_path, load_trace, parse_step_trace

# block_size 2, 4 usable blocks. Worked by hand below.
PREEMPTION_TRACE = {
    "config": {"block_size": 2, "num_blocks": 5, "max_model_len": 100},
    "steps": [
        # a -> [1, 2], b -> [3, 4]: the pool is full.
        {"new": [{"id": "a", "token_ids": [1, 2, 3]}, {"id": "b", "token_ids": [4, 5, 6]}]},
        # Both fit in their blocks (4 tokens each); a's block 2 = [3, 7] and
        # b's block 4 = [6, 8] are full now and cached.
        {"decode": [{"id": "b", "token_ids": [8]}, {"id": "a", "token_ids": [7]}]},
        # a needs a third block: none free, so b (admitted last) is preempted:
        # freed tail first, 4 and 3 to the back. a pops 4 (evicting [6, 8]).
        # b keeps the token its update brought ([10]: sampled by the previous
        # step, as in vLLM), so it waits with [4, 5, 6, 8, 10]; b's later
        # decode entries are dropped (b is no longer running); nothing is admitted.
        {"decode": [{"id": "a", "token_ids": [9]}, {"id": "b", "token_ids": [10]}]},
        # a finishes: 4 (partial, uncached) to the front, 2 and 1 to the back:
        # [4, 3, 2, 1]. b is resumed with its 5 tokens: it hits block 3 ([4, 5];
        # [6, 8] was evicted), and pops 4 and 2 (evicting a's [3, 7]) for
        # [6, 8] and [10]. Left free: [1].
        {"finish": ["a"]},
    ],
}


def run_step_trace(doc, **kw):
    trace = parse_step_trace(doc)
    return Replay(trace, ReplayOptions(hash_key=bytes(16), **kw)).run()


@pytest.mark.parametrize("admission", ["batch", "one"])
def test_preemption_resumption_and_report(admission):
    report = run_step_trace(PREEMPTION_TRACE, admission=admission)
    a, b = report["requests"]["a"], report["requests"]["b"]
    assert (a["admitted_step"], a["num_cached_tokens"], a["block_ids"], a["preemptions"]) == (0, 0, [[1, 2]], 0)
    assert (b["admitted_step"], b["num_cached_tokens"], b["block_ids"], b["preemptions"]) == (0, 0, [[3, 4]], 1)
    assert a["status"] == "finished" and b["status"] == "running"
    assert report["final"]["free_queue"] == [1]
    s = report["summary"]
    assert (s["preemptions"], s["evictions"], s["admissions"]) == (1, 2, 3)
    assert (s["prompt_tokens"], s["cached_tokens"]) == (3 + 3 + 5, 2)
    assert (s["lookup_requests"], s["queries"], s["hits"]) == (3, 2 + 2 + 3, 1)
    assert report["blocks_in_use"] == [4, 4, 3, 3]  # after step 2: a holds 3, b none


@pytest.mark.parametrize("admission", ["batch", "one"])
def test_preempted_request_keeps_the_tokens_its_update_brought(admission):
    replay = Replay(parse_step_trace(PREEMPTION_TRACE), ReplayOptions(hash_key=bytes(16), admission=admission))
    replay.run()
    b = replay.live["b"]
    assert b.tokens.tolist() == [4, 5, 6, 8, 10]  # 10 came with the update of the step b was preempted in
    assert replay.manager.get_block_ids("b") == [[3, 4, 2]]  # hit 3 ([4, 5]); 4 = [6, 8], 2 = [10]
    assert replay.manager.num_free_blocks == 1


def test_preempted_request_with_several_new_tokens_keeps_them_all():
    # Same as PREEMPTION_TRACE, but b's update in the preempting step brings 3
    # tokens: b resumes with 7 tokens = 4 blocks, which fits once a finishes.
    doc = json.loads(json.dumps(PREEMPTION_TRACE))
    doc["steps"][2]["decode"][1]["token_ids"] = [10, 11, 12]
    replay = Replay(parse_step_trace(doc), ReplayOptions(hash_key=bytes(16)))
    report = replay.run()
    assert replay.live["b"].tokens.tolist() == [4, 5, 6, 8, 10, 11, 12]
    assert replay.manager.get_block_ids("b") == [[3, 4, 2, 1]]
    assert (report["summary"]["prompt_tokens"], report["summary"]["cached_tokens"]) == (3 + 3 + 7, 2)
    assert report["final"]["free_queue"] == []


def test_requests_that_can_never_run_are_rejected_and_the_replay_goes_on():
    doc = {
        "config": {"block_size": 2, "num_blocks": 4, "max_model_len": 6},
        "steps": [{"new": [
            {"id": "long", "token_ids": list(range(7))},  # > max_model_len
            {"id": "huge", "token_ids": list(range(10, 16)) + [1]},  # too long too
            {"id": "ok", "token_ids": [1, 2, 3]},
        ]}, {"finish": ["ok", "never-seen"]}],
    }
    report = run_step_trace(doc)
    assert report["requests"]["long"]["status"] == "rejected"
    assert "max_model_len" in report["requests"]["long"]["reason"]
    assert report["requests"]["ok"]["status"] == "finished"
    assert any("rejected" in m for m in report["messages"])


def test_max_num_seqs_limits_admission():
    doc = {"config": {"block_size": 2, "num_blocks": 50},
           "steps": [{"new": [{"id": str(i), "token_ids": [i, i + 1]} for i in range(5)]}, {}]}
    report = run_step_trace(doc, max_num_seqs=2)
    assert [report["requests"][str(i)]["admitted_step"] for i in range(5)] == [0, 0, None, None, None]


def test_step_trace_errors_are_clear():
    with pytest.raises(ValueError, match="missing field 'token_ids'"):
        parse_step_trace({"steps": [{"new": [{"id": "x"}]}]})
    with pytest.raises(ValueError, match="request id used twice"):
        parse_step_trace({"steps": [{"new": [{"id": "x", "token_ids": [1]}]}, {"new": [{"id": "x", "token_ids": [1]}]}]})
    with pytest.raises(ValueError, match="position 1"):
        parse_step_trace({"steps": [{"new": [{"id": "x", "token_ids": [1, -1]}]}]})
    with pytest.raises(ValueError, match="block_size must be positive"):
        parse_step_trace({"config": {"block_size": 0}, "steps": []})


def test_builtin_workload_is_the_first_300_mooncake_requests():
    trace = load_trace(builtin_trace_path())
    assert trace.kind == "mooncake" and len(trace.requests) == 300
    first = trace.requests[0]
    assert (first.input_length, first.output_length) == (6758, 500)
    tokens = first.prompt_tokens()
    assert len(tokens) == 6758 and tokens[0] == 0 and tokens[512] == 512 and tokens[1023] == 1023


def test_mooncake_decode_finishes_after_output_length_tokens():
    trace = load_trace(builtin_trace_path(), max_requests=2)
    for r in trace.requests:
        r.output_length = 3
    report = Replay(trace, ReplayOptions(block_size=64, num_blocks=2000, hash_key=bytes(16))).run()
    # step 0: prefill (samples token 1), steps 1-2 decode tokens 1-2, step 3 finish.
    assert [r["finished_step"] for r in report["requests"].values()] == [3, 3]
    # The second request shares hash id 0 (512 tokens = 8 blocks of 64) with the first.
    assert report["requests"]["r1"]["num_cached_tokens"] == 512


def test_cli_writes_the_report(tmp_path, capsys):
    out = tmp_path / "report.json"
    assert main(["replay", "--max-requests", "4", "--block-size", "64", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "token hit rate" in printed and "manager time/step" in printed
    report = json.loads(out.read_text())
    for key in ("prompt_tokens", "cached_tokens", "token_hit_rate", "queries", "hits", "preemptions", "evictions"):
        assert key in report["summary"]
    for rec in report["requests"].values():
        assert {"admitted_step", "num_prompt_tokens", "num_cached_tokens", "block_ids", "preemptions"} <= set(rec)
    assert isinstance(report["final"]["free_queue"], list)


def test_cli_writes_a_plot(tmp_path):
    import xml.etree.ElementTree as ET

    out = tmp_path / "replay.svg"
    assert main(["replay", "--max-requests", "3", "--block-size", "64", "--prompt-only", "--plot", str(out)]) == 0
    svg = ET.parse(out).getroot()
    lines = svg.findall("{http://www.w3.org/2000/svg}polyline")
    assert len(lines) == 2 and all(line.get("points") for line in lines)


def test_cli_rejects_bad_numbers(capsys):
    # More in tests/test_cli.py: one line on stderr, exit status 2.
    with pytest.raises(SystemExit) as info:
        main(["replay", "--block-size", "0"])
    assert info.value.code == 2 and "--block-size: must be positive" in capsys.readouterr().err
    with pytest.raises(SystemExit) as info:
        main(["replay", "/no/such/trace.jsonl"])
    assert info.value.code == 2 and "no such file" in capsys.readouterr().err


MOONCAKE = SHARED / "data" / "mooncake" / "conversation_trace.jsonl"


@pytest.mark.slow
@pytest.mark.skipif(not MOONCAKE.exists(), reason="the Mooncake trace lives in ../shared, which this checkout lacks")
def test_whole_mooncake_trace_hit_rate_with_512_token_blocks():
    # shared/data/mooncake/README.md: with 512-token blocks, full blocks only
    # and never the last token, the token hit ratio is 0.3734.
    trace = load_trace(MOONCAKE)
    opts = ReplayOptions(block_size=512, num_blocks=250_000, prompt_only=True, hash_key=bytes(16))
    report = Replay(trace, opts).run()
    s = report["summary"]
    assert s["requests"] == s["finished"] == 12031
    assert s["evictions"] == 0
    assert abs(s["token_hit_rate"] - 0.373) <= 0.002
    assert s["cached_tokens"] == 54_063_104
