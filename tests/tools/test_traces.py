"""Trace loading: what a valid trace becomes, and where an invalid one is blamed."""

import json
import re

import numpy as np
import pytest

from gpukv.tools.traces import (
    MAX_HASH_ID,
    TraceError,
    _loads_located,
    load_mooncake,
    load_step_trace,
    load_trace,
    mooncake_tokens,
    parse_step_trace,
)


def write_jsonl(tmp_path, recs, name="t.jsonl"):
    path = tmp_path / name
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in recs))
    return path


def rec(ts=0, n_in=600, n_out=2, ids=(1, 2)):
    return {"timestamp": ts, "input_length": n_in, "output_length": n_out, "hash_ids": list(ids)}


def test_trace_error_is_one_line_with_file_and_line():
    e = TraceError("x.jsonl", 7, "bad\nthing   here")
    assert str(e) == "x.jsonl:7: bad thing here" and (e.path, e.line, e.problem) == ("x.jsonl", 7, "bad thing here")
    assert str(TraceError("x.jsonl", None, "empty")) == "x.jsonl: empty"
    assert isinstance(e, ValueError)


def test_mooncake_arrivals_by_timestamp_and_blank_lines(tmp_path):
    path = write_jsonl(tmp_path, [rec(ts=250), "", rec(ts=0), "   ", rec(ts=99.5)])
    trace = load_mooncake(path, arrival="timestamp", step_ms=100)
    assert [(r.request_id, r.arrival_step) for r in trace.requests] == [("r1", 0), ("r2", 0), ("r0", 2)]
    assert [r.arrival_step for r in load_mooncake(path).requests] == [0, 0, 0]
    assert len(load_mooncake(path, max_requests=2).requests) == 2


def test_max_requests_stops_reading_before_a_bad_line(tmp_path):
    path = write_jsonl(tmp_path, [rec(), "not json"])
    assert len(load_trace(path, max_requests=1).requests) == 1
    with pytest.raises(TraceError, match=r"t\.jsonl:2: not JSON"):
        load_trace(path)


def test_hash_id_limit_is_where_tokens_reach_2_31(tmp_path):
    assert MAX_HASH_ID == 2**22 - 1
    tokens = mooncake_tokens(np.array([MAX_HASH_ID]), 512)
    assert tokens[-1] == 2**31 - 1 and tokens.dtype == np.int64
    with pytest.raises(ValueError, match="hash ids must be in"):
        mooncake_tokens(np.array([MAX_HASH_ID + 1]), 512)
    path = write_jsonl(tmp_path, [rec(ids=[MAX_HASH_ID, 2**55])])
    with pytest.raises(TraceError, match=r":1: hash_ids\[1\] is 36028797018963968, outside \[0, 4194303\]"):
        load_trace(path)


@pytest.mark.parametrize("bad, words", [
    ({"timestamp": -0.5}, "'timestamp' must be >= 0"),
    ({"timestamp": 10**400}, "'timestamp' is an integer of 401 digits, too large"),
    ({"input_length": True}, "'input_length' must be an integer, got a boolean true"),
    ({"input_length": 2**40}, "more than 2147483647 tokens"),
    ({"hash_ids": {"0": 1}}, "'hash_ids' must be an array of integers, got an object"),
])
def test_mooncake_field_errors(tmp_path, bad, words):
    path = write_jsonl(tmp_path, [rec(), dict(rec(), **bad)])
    with pytest.raises(TraceError) as info:
        load_trace(path)
    assert info.value.line == 2 and words in info.value.problem


def test_located_json_knows_every_member_line():
    text = '{"a": 1,\n "b": [1,\n  2,\n  {"c":\n   3}],\n "d": {}}'
    doc = _loads_located(text)
    assert doc == json.loads(text)
    assert doc.line == 1 and doc.lines == {"a": 1, "b": 2, "d": 6}
    assert doc["b"].line == 2 and doc["b"].lines == [2, 3, 4]
    assert doc["b"][2].lines == {"c": 5} and doc["d"].lines == {}


def test_step_trace_parsed_from_a_dict_names_no_line():
    with pytest.raises(TraceError) as info:
        parse_step_trace({"steps": [{"new": [{"id": "x", "token_ids": [1, -1]}]}]}, where="mine")
    assert str(info.value) == "mine: step 0 new request 'x': token id at position 1 is -1, outside [0, 2**32)"


def test_step_trace_from_a_file_names_the_offending_line(tmp_path):
    path = tmp_path / "s.json"
    path.write_text('{"steps": [\n {"new": [{"id": "a",\n           "token_ids": [1, 2],\n'
                    '           "lora_id": -1}]}]}')
    with pytest.raises(TraceError) as info:
        load_step_trace(path)
    assert info.value.line == 4 and "lora_id must be in [0, 2**64)" in info.value.problem


def test_step_trace_fields_become_requests():
    trace = parse_step_trace({
        "config": {"block_size": 4, "num_blocks": 9},
        "steps": [
            {"new": [{"id": 7, "token_ids": [1, 2, 3, 4, 5], "lora_id": 3, "cache_salt": "s",
                      "mm": [{"offset": 3, "length": 2, "hash": "b"}, {"offset": 0, "length": 2, "hash": 5}],
                      "skip_prefix_cache": True}]},
            {"decode": [{"id": 7, "token_ids": [9]}], "finish": [7]},
        ],
    })
    assert trace.config == {"block_size": 4, "num_blocks": 9} and trace.num_requests == 1
    r = trace.steps[0].new[0]
    assert (r.request_id, r.input_length, r.lora_id, r.cache_salt, r.skip_prefix_cache) == ("7", 5, 3, "s", True)
    assert [(m.offset, m.length, m.hash) for m in r.mm_items] == [(0, 2, "5"), (3, 2, "b")]
    assert trace.steps[1].decode["7"].tolist() == [9] and trace.steps[1].finish == ["7"]


# ---------------------------------------------------------- compressed traces

def test_the_shipped_trace_is_the_published_one():
    import hashlib

    from gpukv.tools.traces import builtin_trace_path, conversation_trace_path, open_trace

    with open_trace(conversation_trace_path()) as f:
        data = f.read()
    # The SHA-256 of conversation_trace.jsonl as kvcache-ai/Mooncake publishes it (FAST25-release/traces), the
    # file docs/chunked_prefill.md measured; the built-in workload is its first 300 lines.
    assert hashlib.sha256(data).hexdigest() == "b8cbb061a85206d729d91cdc2981f43c9e0d99209dce588d3af5f7934408b9df"
    lines = data.splitlines(keepends=True)
    assert len(lines) == 12_031
    assert b"".join(lines[:300]) == builtin_trace_path().read_bytes()
    trace = load_trace(conversation_trace_path(), max_requests=5)  # .jsonl.xz: a Mooncake trace by its name
    assert trace.kind == "mooncake" and [r.input_length for r in trace.requests[:2]] == [6758, 7322]


@pytest.mark.parametrize("suffix", [".xz", ".gz"])
def test_a_compressed_trace_reads_as_the_plain_one(tmp_path, suffix):
    import gzip
    import lzma

    text = "".join(json.dumps(r) + "\n" for r in (rec(), rec(ts=100, ids=(1, 3)), rec(ts=200, ids=(4, 5))))
    plain = tmp_path / "t.jsonl"
    plain.write_text(text)
    packed = tmp_path / f"t.jsonl{suffix}"
    packed.write_bytes((lzma.compress if suffix == ".xz" else gzip.compress)(text.encode()))
    a, b = load_trace(plain, arrival="timestamp", step_ms=100), load_trace(packed, arrival="timestamp", step_ms=100)
    assert b.kind == "mooncake"
    assert [(r.arrival_step, r.input_length, r.hash_ids.tolist()) for r in a.requests] == \
        [(r.arrival_step, r.input_length, r.hash_ids.tolist()) for r in b.requests] == \
        [(0, 600, [1, 2]), (1, 600, [1, 3]), (2, 600, [4, 5])]
    step = tmp_path / f"s.json{suffix}"  # a step trace, compressed: by the name under the ending
    doc = json.dumps({"steps": [{"new": [{"id": "a", "token_ids": [1, 2]}]}]}).encode()
    step.write_bytes((lzma.compress if suffix == ".xz" else gzip.compress)(doc))
    assert load_trace(step).kind == "step"


@pytest.mark.parametrize("suffix", [".xz", ".gz"])
def test_a_damaged_compressed_trace_is_one_line_naming_the_line(tmp_path, suffix):
    import gzip
    import lzma

    text = "".join(json.dumps(rec(ts=i)) + "\n" for i in range(2000)).encode()
    packed = (lzma.compress if suffix == ".xz" else gzip.compress)(text)
    path = tmp_path / f"t.jsonl{suffix}"
    path.write_bytes(packed[: len(packed) // 2])  # cut off midway
    with pytest.raises(TraceError) as e:
        load_trace(path)
    where, problem = str(e.value).split(": ", 1)
    assert where.startswith(f"{path}:") and 1 < int(where.rsplit(":", 1)[1]) < 2000
    assert problem.startswith("cannot decompress it (") and problem.endswith(
        "): a damaged or truncated compressed file")
    path.write_bytes(b"not compressed at all")
    with pytest.raises(TraceError, match="^" + re.escape(f"{path}:1: cannot decompress it (")):
        load_trace(path)


def _corrupted_gzip(text: bytes) -> bytes:
    """A gzip file whose header is intact and whose deflate stream is damaged:
    zlib, not gzip, is the one that finds out."""
    import gzip

    packed = bytearray(gzip.compress(text))
    for i in range(30, 60):
        packed[i] ^= 0xFF
    return bytes(packed)


@pytest.mark.parametrize("name", ["t.jsonl.gz", "s.json.gz"])
def test_a_corrupted_gzip_stream_is_a_trace_error_naming_the_file(tmp_path, name):
    text = "".join(json.dumps(rec(ts=i)) + "\n" for i in range(500)).encode()
    path = tmp_path / name
    path.write_bytes(_corrupted_gzip(text))
    with pytest.raises(TraceError) as e:
        load_trace(path)
    assert e.value.path == str(path)
    assert e.value.problem.startswith("cannot decompress it (zlib.error: Error -3 while decompressing data: ")
    assert e.value.problem.endswith("): a damaged or truncated compressed file")


@pytest.mark.parametrize("cut, column", [('{"timestamp": 0,', 17), ('{"timestamp": 0, "input_le', 18)])
@pytest.mark.parametrize("ending", ["\n", "\r\n", ""])
def test_a_line_cut_short_is_reported_where_it_stops(tmp_path, cut, column, ending):
    path = tmp_path / "t.jsonl"
    path.write_bytes((json.dumps(rec()) + "\n" + cut + ending).encode())
    with pytest.raises(TraceError) as e:
        load_trace(path)
    assert (e.value.line, e.value.problem.endswith(f"(column {column})")) == (2, True), str(e.value)
