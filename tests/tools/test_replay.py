"""The replay loop (the main job): scheduling policy, report, traces, CLI."""

import json
import os

import pytest

from conftest import SHARED
from gpukv.core.requests import NewRequest
from gpukv.tools.cli import main
from gpukv.tools.replay import Replay, ReplayOptions, no_eviction_hit_rate
from gpukv.tools.traces import builtin_trace_path, conversation_trace_path, load_trace, parse_step_trace

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
    # vLLM's counting: a and b's first lookups in tokens; b's re-admission apart.
    assert (s["lookup_requests"], s["queries"], s["hits"], s["query_blocks"], s["hit_blocks"]) == (2, 6, 0, 4, 0)
    assert (s["preempted_lookup_requests"], s["preempted_queries"], s["preempted_hits"]) == (1, 5, 2)
    assert report["blocks_in_use"] == [4, 4, 3, 3]  # after step 2: a holds 3, b none


@pytest.mark.parametrize("admission", ["batch", "one"])
def test_preempted_request_keeps_the_tokens_its_update_brought(admission):
    replay = Replay(parse_step_trace(PREEMPTION_TRACE), ReplayOptions(hash_key=bytes(16), admission=admission))
    replay.run()
    b = replay.live["b"]
    assert b.tokens.tolist() == [4, 5, 6, 8, 10]  # 10 came with the update of the step b was preempted in
    assert replay.manager.get_block_ids("b") == [[3, 4, 2]]  # hit 3 ([4, 5]); 4 = [6, 8], 2 = [10]
    assert replay.manager.read_num_free_blocks() == 1


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
        parse_step_trace({"steps": [{"new": [{"id": "x", "token_ids": [1]}]},
                                    {"new": [{"id": "x", "token_ids": [1]}]}]})
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
    report = Replay(trace, ReplayOptions(block_size=64, num_blocks=2000, hash_key=bytes(16),
                                         max_num_batched_tokens=None)).run()
    # step 0: prefill (samples token 1), steps 1-2 decode tokens 1-2, step 3 finish.
    assert [r["finished_step"] for r in report["requests"].values()] == [3, 3]
    # The second request shares hash id 0 (512 tokens = 8 blocks of 64) with the first.
    assert report["requests"]["r1"]["num_cached_tokens"] == 512


def test_mooncake_decode_under_the_default_budget():
    trace = load_trace(builtin_trace_path(), max_requests=2)
    for r in trace.requests:
        r.output_length = 3
    report = Replay(trace, ReplayOptions(block_size=64, num_blocks=2000, hash_key=bytes(16))).run()
    assert report["config"]["max_num_batched_tokens"] == 8192
    # The default budget of 8192: step 0 computes r0's 6758 tokens and the first
    # 8192 - 6758 = 1434 of r1's 7322 (its hit of 512, on r0's first blocks
    # scheduled in the same step, counts towards them); step 1 computes r1's
    # other 5888 and samples its first token, so r1 finishes a step after r0.
    recs = report["requests"]
    assert [r["prefill_done_step"] for r in recs.values()] == [0, 1]
    assert [r["finished_step"] for r in recs.values()] == [3, 4]
    assert recs["r1"]["admitted_step"] == 0 and recs["r1"]["num_cached_tokens"] == 512


def test_cli_writes_the_report(tmp_path, capsys):
    out = tmp_path / "report.json"
    assert main(["replay", "--max-requests", "4", "--block-size", "64", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "prefix cache hit rate" in printed and "manager time/step" in printed
    report = json.loads(out.read_text())
    for key in ("prompt_tokens", "cached_tokens", "every_admission_hit_rate", "queries", "hits", "preemptions",
                "evictions", "prefix_cache_hit_rate", "prefix_cache_hit_rate_ceiling"):
        assert key in report["summary"]
    for rec in report["requests"].values():
        assert {"admitted_step", "num_prompt_tokens", "num_cached_tokens", "block_ids", "preemptions"} <= set(rec)
    assert isinstance(report["final"]["free_queue"], list)


def test_cli_rejects_bad_numbers(capsys):
    # More in tests/tools/test_cli.py: one line on stderr, exit status 2.
    with pytest.raises(SystemExit) as info:
        main(["replay", "--block-size", "0"])
    assert info.value.code == 2 and "--block-size: must be an integer from 1 to 65536" in capsys.readouterr().err
    with pytest.raises(SystemExit) as info:
        main(["replay", "/no/such/trace.jsonl"])
    assert info.value.code == 2 and "no such file" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.skipif(not (SHARED / "data" / "mooncake").exists() and os.environ.get("GPUKV_SLOW_TESTS") != "1",
                    reason="a minute on the whole Mooncake trace: runs beside ../shared/data/mooncake (whose "
                    "README's figure it checks) or with GPUKV_SLOW_TESTS=1")
def test_whole_mooncake_trace_hit_rate_with_512_token_blocks():
    # shared/data/mooncake/README.md: with 512-token blocks, full blocks only
    # and never the last token, the token hit ratio is 0.3734. The default token
    # budget (8192) changes no hit: with no chunk cap a request is admitted only
    # once every earlier one is scheduled whole (docs/chunked_prefill.md).
    trace = load_trace(conversation_trace_path())  # the package's copy: the same bytes (tests/tools/test_traces.py)
    opts = ReplayOptions(block_size=512, num_blocks=250_000, prompt_only=True, hash_key=bytes(16), max_num_seqs=256)
    report = Replay(trace, opts).run()
    s = report["summary"]
    assert s["requests"] == s["finished"] == 12031
    assert s["evictions"] == 0
    assert abs(s["every_admission_hit_rate"] - 0.373) <= 0.002
    assert s["cached_tokens"] == 54_063_104


# ----------------------------------------------------------------- chunked prefill


def mooncake_trace(tmp_path, recs, **kw):
    """A Mooncake trace of ``(input_length, output_length, hash_ids)`` lines,
    all arriving at step 0; the requests are r0, r1, ..."""
    path = tmp_path / "trace.jsonl"
    lines = [{"timestamp": 0, "input_length": n, "output_length": out, "hash_ids": ids} for n, out, ids in recs]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return load_trace(path, **kw)


class ChunkLog(Replay):
    """A replay that records, per step, what it asks of the manager: running
    updates as ``(id, new tokens, chunk)`` and admissions as ``(id, hit,
    new tokens)``, whether one batched ``step()`` or ``allocate_slots``
    admitted them."""

    def __init__(self, trace, opts):
        super().__init__(trace, opts)
        self.log: list[list[tuple]] = []
        step, allocate_slots = self.manager.step, self.manager.allocate_slots

        def logged_step(finished=(), running=(), new=(), **kw):
            self.log[-1] += [(u.request_id, len(u.new_token_ids), u.num_tokens_to_compute) for u in running]
            result = step(finished, running, new, **kw)
            self.log[-1] += [(r.request_id, hit, k) for r, hit, k in
                             zip(new, result.num_computed_tokens, result.num_new_tokens, strict=False)]
            return result

        def logged_allocate_slots(request, *args, computed=None, num_tokens=None, **kw):
            blocks = allocate_slots(request, *args, computed=computed, num_tokens=num_tokens, **kw)
            if blocks is not None:
                self.log[-1].append((request.request_id, computed.num_tokens, num_tokens))
            return blocks

        self.manager.step, self.manager.allocate_slots = logged_step, logged_allocate_slots

    def _step(self, *args):
        self.log.append([])
        super()._step(*args)


# Blocks of 256 tokens; Mooncake hash id 1 is the first 512 tokens of r0, r1 and r2.
THREE = [(1000, 2, [1, 2]), (1200, 1, [1, 3, 4]), (600, 1, [1, 5])]


def chunk_replay(tmp_path, recs, **kw):
    opts = dict(block_size=256, num_blocks=100, hash_key=bytes(16))
    replay = ChunkLog(mooncake_trace(tmp_path, recs), ReplayOptions(**(opts | kw)))
    return replay, replay.run()


def fields(report, *names):
    return {rid: tuple(r[n] for n in names) for rid, r in report["requests"].items()}


@pytest.mark.parametrize("admission", ["batch", "one"])
def test_vllm_waiting_loop_worked_by_hand(tmp_path, admission):
    """Both admission modes are vLLM's waiting loop: each request is looked
    up first, then only the tokens beyond its hit are scheduled and charged;
    "batch" in one ``step()``, "one" by ``get_computed_blocks`` and
    ``allocate_slots`` per request."""
    replay, report = chunk_replay(tmp_path, THREE, max_num_batched_tokens=1024, admission=admission)
    assert replay.log == [
        # r0: 1000 new; r1: hit 512 (the blocks r0 caches as it is admitted),
        # 24 new, which spends the budget: r2 waits.
        [("r0", 0, 1000), ("r1", 512, 24)],
        # r0 decodes (1), r1 computes its other 664 and samples; r2: hit 512,
        # its 88 new fit in the 359 left, so it is done in its admission step.
        [("r0", 1, None), ("r1", 0, 664), ("r2", 512, 88)],
        [],  # all three finish
    ]
    assert fields(report, "admitted_step", "num_cached_tokens", "prefill_done_step", "finished_step") == {
        "r0": (0, 0, 0, 2), "r1": (0, 512, 1, 2), "r2": (1, 512, 1, 2)}
    s = report["summary"]
    assert (s["prompt_tokens"], s["cached_tokens"], s["steps"], s["preemptions"]) == (2800, 1024, 3, 0)
    assert s["every_admission_hit_rate"] == s["first_admission_hit_rate"] == 1024 / 2800
    # r0 holds 4 blocks, r1 its 2-block hit and 1 more (536 tokens); then r1
    # has 5 (3 of its own) and r2 3 (1 of its own); then none.
    assert report["blocks_in_use"] == [5, 8, 0]
    assert report["config"]["max_num_batched_tokens"] == 1024


@pytest.mark.parametrize("admission", ["batch", "one"])
def test_a_hit_past_the_first_chunk_is_not_preempted(tmp_path, admission):
    """The smallest case of a hit past the first chunk: under a 512-token
    budget, B's hit covers its first chunk. Charged the whole chunk, hit included, it was admitted holding
    only its hit blocks and preempted 49 times; under vLLM's rule it computes
    512 tokens past its 1024-token hit and nothing is preempted (vLLM 0.8.5:
    0 preemptions)."""
    recs = [(1024, 100, [1, 2]), (1536, 1, [1, 2, 3])]
    replay, report = chunk_replay(tmp_path, recs, block_size=16, num_blocks=97, max_num_batched_tokens=512,
                                  admission=admission)
    assert report["summary"]["preemptions"] == 0
    admissions = [entry for step in replay.log for entry in step if entry[0] == "r1" and entry[1] > 0]
    assert admissions == [("r1", 1024, 512)]


def test_long_prefill_threshold_caps_each_chunk(tmp_path):
    replay, report = chunk_replay(tmp_path, THREE, max_num_batched_tokens=1024, long_prefill_token_threshold=300)
    assert replay.log == [
        # At most 300 past the hit each. r0's 300 cache its first block, so
        # r1 hits it and computes 300 more (to 556), which caches the second
        # block of hash id 1; r2 hits both and has only 88 left (424 left).
        [("r0", 0, 300), ("r1", 256, 300), ("r2", 512, 88)],
        [("r0", 0, 300), ("r1", 0, 300)],  # r2 finishes
        [("r0", 0, 300), ("r1", 0, 300)],
        [("r0", 0, 100), ("r1", 0, 44)],  # both done
        [("r0", 1, None)],  # r1 finishes, r0 decodes its second token
        [],  # r0 finishes
    ]
    assert fields(report, "num_cached_tokens", "prefill_done_step", "finished_step") == {
        "r0": (0, 3, 5), "r1": (256, 3, 4), "r2": (512, 0, 1)}
    assert report["config"]["long_prefill_token_threshold"] == 300


def test_threshold_without_a_budget(tmp_path):
    replay, report = chunk_replay(tmp_path, THREE[:1], max_num_batched_tokens=None, long_prefill_token_threshold=400)
    assert replay.log == [[("r0", 0, 400)], [("r0", 0, 400)], [("r0", 0, 200)], [("r0", 1, None)], []]


@pytest.mark.parametrize("admission", ["batch", "one"])
def test_preempted_prefill_resumes_from_zero_with_its_own_hit(tmp_path, admission):
    # 6 usable blocks of 256. r0 (4 blocks) and r1 (5 blocks) cannot run together.
    recs = [(1000, 3, [1, 2]), (1200, 1, [3, 4, 5])]
    replay, report = chunk_replay(tmp_path, recs, num_blocks=7, max_num_batched_tokens=1280, admission=admission)
    assert replay.log == [
        # r0 whole (4 blocks), r1's first 280 tokens (2 blocks, the first full and cached): the pool is full.
        [("r0", 0, 1000), ("r1", 0, 280)],
        # r1's next 920 need 3 more blocks: none free, so r1 (admitted last)
        # is preempted; nothing is admitted in a step that preempts.
        [("r0", 1, None), ("r1", 0, 920)],
        [("r0", 1, None)],  # r1 does not fit yet (past its hit it needs 4 more blocks, 2 are free)
        # r0 finishes; r1 is admitted again, hits the block its first chunk
        # cached and computes the 944 tokens after it.
        [("r1", 256, 944)],
        [],  # r1 finishes
    ]
    assert fields(report, "admitted_step", "num_cached_tokens", "prefill_done_step", "finished_step", "preemptions") \
        == {"r0": (0, 0, 0, 3, 0), "r1": (0, 0, 3, 4, 1)}
    s = report["summary"]
    assert (s["preemptions"], s["admissions"]) == (1, 3)
    assert (s["prompt_tokens"], s["cached_tokens"]) == (1000 + 1200 + 1200, 256)  # the re-admission's own hit
    assert s["first_admission_hit_rate"] == 0.0


def test_a_step_trace_runs_unbudgeted():
    replay = Replay(parse_step_trace(PREEMPTION_TRACE),
                    ReplayOptions(hash_key=bytes(16), max_num_batched_tokens=1, long_prefill_token_threshold=1))
    report = replay.run()
    assert (report["config"]["max_num_batched_tokens"], report["config"]["long_prefill_token_threshold"]) == (None, 0)
    assert report["requests"]["a"]["prefill_done_step"] == 0 and report["blocks_in_use"] == [4, 4, 3, 3]


@pytest.mark.parametrize("bad", [dict(max_num_batched_tokens=0), dict(long_prefill_token_threshold=-1)])
def test_bad_budget_options_are_refused(bad):
    with pytest.raises(ValueError, match=next(iter(bad))):
        Replay(load_trace(builtin_trace_path(), max_requests=1), ReplayOptions(**bad))


class Checked(Replay):
    """Checks after every step that the replay's view of each request agrees
    with the manager's, and that no running request was left unscheduled."""

    def _running_updates(self, step, decode, finished, budget):
        updates = super()._running_updates(step, decode, finished, budget)
        # A decode costs 1 and a prefill's chunk never grows, so the demand
        # ahead of a request scheduled last step never grows either.
        assert {u.request_id for u in updates} == {item.rid for item in self.running}
        return updates

    def _record_step(self):
        super()._record_step()
        for live in self.running:
            assert self.manager.num_computed_tokens(live.rid) == live.num_computed
            assert live.unsent_sampled == (0 if live.prefilling else 1)
        assert all(live.num_computed == 0 and live.unsent_sampled == 0 for live in self.waiting)


@pytest.mark.parametrize("budget,threshold,admission", [(2048, 0, "batch"), (512, 0, "one"), (4096, 700, "batch")])
def test_budgeted_builtin_workload_keeps_its_books(budget, threshold, admission):
    trace = load_trace(builtin_trace_path(), max_requests=16)
    report = Checked(trace, ReplayOptions(num_blocks=2500, hash_key=bytes(16), max_num_batched_tokens=budget,
                                          long_prefill_token_threshold=threshold, admission=admission)).run()
    s = report["summary"]
    assert s["finished"] + s["rejected"] == 16 and s["preemptions"] > 0
    assert max(report["blocks_in_use"]) <= 2499


# What the replay produced before it scheduled chunks (captured from the code
# of that time): with no budget and no cap it must produce exactly this.
# ``digest`` is the first 16 hex digits of the SHA-256 of the JSON (sorted
# keys) of the per-request block ids, the final free queue and blocks in use.
SUMMARY_KEYS = ("requests", "finished", "rejected", "steps", "prompt_tokens", "cached_tokens",
                "every_admission_hit_rate", "queries", "hits", "lookup_requests", "admissions", "preemptions",
                "evictions", "max_blocks_in_use", "mean_blocks_in_use")
BEFORE_CHUNKING = {
    "builtin40": dict(
        summary=(40, 40, 0, 930, 506280, 19968, 0.039440625740696844, 31665, 1248, 40, 40, 0, 0, 30417,
                 13080.770967741935),
        admitted_step=[0] * 40, num_cached_tokens=[0] + [512] * 39,
        finished_step=[500, 490, 794, 316, 3, 173, 453, 458, 402, 610, 71, 402, 548, 354, 14, 145, 355, 466, 929, 349,
                       370, 475, 420, 848, 80, 265, 26, 745, 11, 584, 615, 344, 309, 1, 238, 449, 31, 240, 555, 524],
        preemptions=[0] * 40, digests=("e0ecaa8b764ac759", "73540bdbc1adeb2e", "97afab682d54752d")),
    "builtin40_4000_blocks": dict(
        summary=(40, 39, 1, 3255, 422792, 22944, 0.054267819637079225, 3447544, 93370, 2769, 40, 1, 21881, 3999,
                 3089.7182795698923),
        admitted_step=[0, 0, 0, 0, 0, 0, 0, 453, 453, 500, 855, None, 855, 911, 911, 911, 911, 925, 1056, 1110, 1403,
                       1459, 1459, 1773, 1773, 1985, 1985, 1985, 2250, 2250, 2250, 2250, 2250, 2250, 2594, 2621, 2621,
                       2621, 2652, 2730],
        num_cached_tokens=[0] + [512] * 10 + [None] + [512] * 28,
        finished_step=[500, 490, 794, 316, 3, 173, 453, 911, 855, 1110, 926, 0, 1403, 1265, 925, 1056, 1266, 1391,
                       1985, 1459, 1773, 1934, 1879, 2621, 1853, 2250, 2011, 2730, 2261, 2834, 2865, 2594, 2559, 2251,
                       2832, 3070, 2652, 2861, 3232, 3254],
        preemptions=[0] * 38 + [1, 0], digests=("196529171d4350ae", "a01be4d081cde95a", "1c3ab2aa4482cbe4")),
    "preemption_trace": dict(
        summary=(2, 1, 0, 4, 11, 2, 0.18181818181818182, 7, 1, 3, 3, 1, 2, 4, 3.5),
        admitted_step=[0, 0], num_cached_tokens=[0, 0], finished_step=[3, None], preemptions=[0, 1],
        digests=("dee4368a269e90de", "080a9ed428559ef6", "91ea77414eb49ab9")),
}


def _digest(obj) -> str:
    import hashlib

    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:16]


def _before_chunking_case(name: str):
    if name == "preemption_trace":
        return parse_step_trace(PREEMPTION_TRACE), {}
    return load_trace(builtin_trace_path(), max_requests=40), {"num_blocks": 4000} if "4000" in name else {}


@pytest.mark.parametrize("name,admission", [("builtin40", "batch"), ("builtin40_4000_blocks", "batch"),
                                            ("builtin40_4000_blocks", "one"), ("preemption_trace", "batch"),
                                            ("preemption_trace", "one")])
def test_no_budget_is_exactly_the_unchunked_replay(name, admission):
    trace, kw = _before_chunking_case(name)
    # The config of the capture, explicit: 256 running at most was the default then.
    report = Replay(trace, ReplayOptions(hash_key=bytes(16), admission=admission, max_num_batched_tokens=None,
                                         long_prefill_token_threshold=0, max_num_seqs=256, **kw)).run()
    want = BEFORE_CHUNKING[name]
    s, recs = report["summary"], list(report["requests"].values())
    # The stats' units changed since (queries and hits are tokens now, and
    # re-admissions after a preemption count apart), so the lookup counts are
    # compared as attempts of either kind; blocks hit and asked only where
    # nothing was preempted (then they are the same blocks as before).
    got = {k: s[k] for k in SUMMARY_KEYS}
    got["lookup_requests"] = s["lookup_requests"] + s["preempted_lookup_requests"]
    got["queries"], got["hits"] = s["query_blocks"], s["hit_blocks"]
    expected = dict(zip(SUMMARY_KEYS, want["summary"], strict=True))
    if s["preemptions"]:
        for k in ("queries", "hits"):
            del got[k], expected[k]
    assert got == expected
    assert [r["admitted_step"] for r in recs] == want["admitted_step"]
    assert [r["num_cached_tokens"] for r in recs] == want["num_cached_tokens"]
    assert [r["finished_step"] for r in recs] == want["finished_step"]
    assert [r["preemptions"] for r in recs] == want["preemptions"]
    got = (_digest([r["block_ids"] for r in recs]), _digest(report["final"]["free_queue"]),
           _digest(report["blocks_in_use"]))
    assert got == want["digests"]
    # Unchunked, a prefill completes in its admission step.
    assert all(r["prefill_done_step"] == r["admitted_step"] for r in recs)


# ------------------------------------------- the ceiling, the pool's pressure, recomputation


def test_the_ceiling_by_hand(tmp_path):
    # 16-token blocks. r0 caches its 62 full blocks (992 tokens). r1 shares
    # r0's whole prompt: it hits those 62 (its own limit, (1100 - 1) // 16 = 68,
    # is further). r2 shares block 1 only: 512 tokens, 32 blocks. r3 (70,000
    # tokens) is longer than max_model_len and is left out, as the replay rejects it.
    recs = [(1000, 2, [1, 2]), (1100, 2, [1, 2, 3]), (700, 2, [1, 4]), (70_000, 2, list(range(5, 142)))]
    trace = mooncake_trace(tmp_path, recs)
    assert no_eviction_hit_rate(trace, 16, max_model_len=65_536) == (992 + 512) / (1000 + 1100 + 700)
    # A request whose prompt is all cached hits at most (n - 1) // 16 blocks: r1 = r0 here.
    trace = mooncake_trace(tmp_path, [(1024, 2, [1, 2]), (1024, 2, [1, 2])])
    assert no_eviction_hit_rate(trace, 16) == 1008 / 2048
    assert no_eviction_hit_rate(parse_step_trace(PREEMPTION_TRACE), 2) is None  # Mooncake traces only


@pytest.mark.parametrize("arrival,block_size,prompt_only", [("back-to-back", 16, True), ("timestamp", 48, False)])
def test_the_ceiling_is_the_replay_in_a_pool_that_never_evicts(arrival, block_size, prompt_only):
    # The first 160 requests: past the 100th, later turns of conversations
    # hit more than the system prompt's first 512 tokens.
    trace = load_trace(builtin_trace_path(), max_requests=160, arrival=arrival, step_ms=40)
    for r in trace.requests:
        r.output_length = min(r.output_length, 4)
    roomy = sum(-(-(r.input_length + r.output_length) // block_size) for r in trace.requests) + 1
    opts = ReplayOptions(block_size=block_size, num_blocks=roomy, hash_key=bytes(16), prompt_only=prompt_only)
    s = Replay(trace, opts).run()["summary"]
    assert s["evictions"] == s["preemptions"] == 0 and s["lookup_requests"] == 160
    assert s["hits"] > 512 * 159  # more than every request's hit on the shared first block
    assert s["prefix_cache_hit_rate_ceiling"] == s["prefix_cache_hit_rate"] == s["first_admission_hit_rate"]


def test_recomputation_after_a_preemption_by_hand():
    # PREEMPTION_TRACE: a and b compute 3 tokens each, then 1 each, then a 1
    # more while b is preempted with 4 computed; b comes back with 5 tokens,
    # hits [4, 5] and computes 3: positions 2 and 3 again, 4 for the first time.
    s = run_step_trace(PREEMPTION_TRACE)["summary"]
    assert (s["computed_tokens"], s["recomputed_tokens"], s["most_preemptions_of_a_request"]) == (12, 2, 1)
    # Running requests hold up to 8 tokens in 2-token blocks, the whole pool
    # of 4 blocks, when a asks for a fifth: the step that preempts b.
    assert (s["peak_demand_tokens"], s["pool_tokens"], s["peak_demand_over_pool"]) == (8, 8, 1.0)


def test_a_pool_that_preempts_was_oversubscribed_and_a_roomy_one_recomputes_nothing():
    trace = load_trace(builtin_trace_path(), max_requests=16)
    for r in trace.requests:
        r.output_length = min(r.output_length, 16)
    tight = Replay(trace, ReplayOptions(num_blocks=2500, hash_key=bytes(16))).run()["summary"]
    assert tight["preemptions"] > 0 and tight["peak_demand_over_pool"] > 1
    assert 0 < tight["recomputed_tokens"] < tight["computed_tokens"]
    roomy = Replay(trace, ReplayOptions(hash_key=bytes(16))).run()["summary"]
    assert roomy["preemptions"] == roomy["recomputed_tokens"] == 0 and roomy["peak_demand_over_pool"] < 1
    # Every prompt and output token computed once, less the cache hits.
    work = sum(r.input_length + r.output_length - 1 for r in trace.requests) - roomy["cached_tokens"]
    assert roomy["computed_tokens"] == work


def test_the_default_config_is_a_deployment_not_a_stampede():
    from gpukv.tools import replay

    opts = ReplayOptions()
    assert (opts.num_blocks, opts.block_size, opts.max_num_seqs) == (65_536, 16, 64)
    assert (replay.DEFAULT_ARRIVAL, replay.DEFAULT_STEP_MS) == ("timestamp", 40.0)
    # 64 running requests of the built-in workload's mean full length fit the pool.
    trace = load_trace(builtin_trace_path())
    mean = sum(r.input_length + r.output_length for r in trace.requests) / trace.num_requests
    assert 64 * mean < (opts.num_blocks - 1) * opts.block_size


def test_the_report_does_not_import_the_replay():
    """The report takes a ReplayOutcome (plain values), so gpukv.tools.replay
    imports gpukv.tools.report and not the other way round, not even for
    type checkers."""
    import ast
    from pathlib import Path

    tree = ast.parse((Path(__file__).resolve().parents[2] / "gpukv" / "tools" / "report.py").read_text())
    imported = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    imported |= {a.name for node in ast.walk(tree) if isinstance(node, ast.Import) for a in node.names}
    assert "gpukv.tools.replay" not in imported


def test_the_device_manager_sizes_admissions_by_the_replays_token_budget():
    """The replay hands its step's token budget to the device manager, which
    sizes a long prompt's admission entries by it (``plan_admission``)."""
    from gpukv.tools.replay import make_manager

    m = make_manager(ReplayOptions(backend="device", num_blocks=64, block_size=16, max_model_len=4096,
                                   max_num_batched_tokens=512))
    m.step(new=[NewRequest("a", list(range(2000)), num_tokens_to_compute=512)])
    assert [b for b in m._admission.buffers] == [(8, 128, 2048, 32, 32)]  # (512 tokens: 32 blocks, not 125)
    m.check_invariants()
