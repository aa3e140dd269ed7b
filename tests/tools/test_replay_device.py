"""`gpukv replay --backend device` writes what `--backend reference` writes:
the same per-request records and final free queue, on the shipped workload
and on random step traces."""

import json
import random

import pytest

from gpukv.tools.cli import main
from gpukv.tools.replay import Replay, ReplayOptions
from gpukv.tools.traces import builtin_trace_path, load_trace, parse_step_trace

KEY = bytes(16)


def random_step_trace(seed: int, steps: int = 10) -> dict:
    rng = random.Random(seed)
    docs = [[rng.randrange(30) for _ in range(12)] for _ in range(3)]
    live, out, n = [], [], 0
    for _ in range(steps):
        step = {"finish": [], "decode": [], "new": []}
        for rid in list(live):
            if rng.random() < 0.2:
                step["finish"].append(rid)
                live.remove(rid)
            elif rng.random() < 0.8:
                step["decode"].append({"id": rid, "token_ids": [rng.randrange(30) for _ in range(rng.randint(1, 2))]})
        for _ in range(rng.randint(0, 3)):
            base = rng.choice(docs)[: rng.randint(1, 12)]
            new = {"id": f"q{n}", "token_ids": base + [rng.randrange(30) for _ in range(rng.randint(0, 5))]}
            if rng.random() < 0.15:
                new["cache_salt"] = "s"
            step["new"].append(new)
            live.append(f"q{n}")
            n += 1
        out.append(step)
    return {"config": {"block_size": 2, "num_blocks": rng.randint(8, 20), "max_model_len": 64}, "steps": out}


def both(trace, **kw):
    reports = []
    for backend in ("reference", "device"):
        reports.append(Replay(trace, ReplayOptions(backend=backend, hash_key=KEY, **kw)).run())
    return reports


@pytest.mark.parametrize("seed", range(3))
def test_random_step_traces_agree(seed):
    ref, dev = both(parse_step_trace(random_step_trace(seed)))
    assert dev["requests"] == ref["requests"]
    assert dev["final"] == ref["final"]
    for k in ("prompt_tokens", "cached_tokens", "queries", "hits", "preemptions", "evictions"):
        assert dev["summary"][k] == ref["summary"][k], k


def test_shipped_workload_agrees():
    trace = load_trace(builtin_trace_path(), max_requests=24)
    ref, dev = both(trace, block_size=256, num_blocks=700, prompt_only=True, max_num_seqs=8, max_model_len=65536)
    assert dev["requests"] == ref["requests"]
    assert dev["final"] == ref["final"]
    assert ref["summary"]["cached_tokens"] > 0 and ref["summary"]["evictions"] > 0


def test_budgeted_mooncake_replay_agrees():
    # Chunked prefills under a token budget, with preemptions (a pool of 49
    # blocks of 256 for prompts of ~28 blocks: admission needs only the first
    # chunk's blocks, so prefills outgrow the pool). Short outputs keep it quick.
    trace = load_trace(builtin_trace_path(), max_requests=5)
    for r in trace.requests:
        r.output_length = min(r.output_length, 4)
    ref, dev = both(trace, block_size=256, num_blocks=50, max_num_seqs=4, max_model_len=65536,
                    max_num_batched_tokens=4096)
    assert dev["requests"] == ref["requests"]
    assert dev["final"] == ref["final"]
    for k in ("prompt_tokens", "cached_tokens", "queries", "hits", "preemptions", "evictions", "steps"):
        assert dev["summary"][k] == ref["summary"][k], k
    assert ref["summary"]["preemptions"] > 0 and ref["config"]["max_num_batched_tokens"] == 4096
    assert any(r["prefill_done_step"] > r["admitted_step"] for r in ref["requests"].values())


def test_cli_compare_reports_agreement(tmp_path, capsys):
    path = tmp_path / "trace.json"
    path.write_text(json.dumps(random_step_trace(7, steps=5)))
    out = tmp_path / "r.json"
    assert main(["replay", str(path), "--backend", "device", "--json", str(out)]) == 0
    assert "device vs reference: requests identical, final free queue identical" in capsys.readouterr().out
    assert all(json.loads(out.read_text())["reference"]["agree"].values())
