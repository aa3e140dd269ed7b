"""`gpukv replay` never crashes or lies: every malformed trace, option, output
path or environment variable is one line on stderr naming the file, the line
and the problem, with exit status 2 and no traceback; far-apart arrivals are
skipped, not stepped through."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time

import pytest

from conftest import ROOT
from gpukv.tools import cli
from gpukv.tools.cli import main
from gpukv.tools.replay import Replay, ReplayOptions
from gpukv.tools.traces import MAX_HASH_ID, load_trace

REC = {"timestamp": 0, "input_length": 600, "output_length": 2, "hash_ids": [1, 2]}


def line(**changes) -> str:
    rec = dict(REC, **changes)
    for k in [k for k, v in changes.items() if v is DROP]:
        del rec[k]
    return json.dumps(rec)


DROP = object()


def run_cli(argv, capsys) -> tuple[int, str, str]:
    """main(argv) in-process: (exit status, stdout, stderr)."""
    try:
        status = main(["replay", "--backend", "reference", "--no-progress", *argv])
    except SystemExit as e:
        status = e.code
    out, err = capsys.readouterr()
    return status, out, err


def assert_one_line_error(status, err, *needles):
    assert status == 2, err
    assert "Traceback" not in err
    lines = err.splitlines()
    assert len(lines) == 1, err
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    return lines[0]


def write(tmp_path, name, text) -> str:
    path = tmp_path / name
    if isinstance(text, bytes):
        path.write_bytes(text)
    else:
        path.write_text(text)
    return str(path)


# ---------------------------------------------------------------- Mooncake


BAD_MOONCAKE = {
    # name: (lines of the file, the line to blame, words the message must hold)
    "hash id 2**55 (used to alias id 0)": ([line(), line(hash_ids=[2**55, 1])], 2,
                                          ["hash_ids[0] is 36028797018963968", f"[0, {MAX_HASH_ID}]", "2**31"]),
    "hash id 10**30": ([line(hash_ids=[1, 10**30])], 1, ["hash_ids[1] is 1000000000000000000000000000000",
                                                        f"[0, {MAX_HASH_ID}]"]),
    "hash id 2**63 (outside int64)": ([line(hash_ids=[2**63])], 1, ["hash_ids[0]", "outside"]),
    "hash id one past the limit": ([line(hash_ids=[1, MAX_HASH_ID + 1])], 1, ["hash_ids[1] is 4194304"]),
    "negative hash id": ([line(), line(), line(hash_ids=[-1, 2])], 3, ["hash_ids[0] is -1"]),
    "nested hash_ids": ([line(hash_ids=[[1], 2])], 1, ["hash_ids[0] must be an integer, got an array"]),
    "float hash id": ([line(hash_ids=[1.5, 2])], 1, ["hash_ids[0] must be an integer, got a number 1.5"]),
    "bool hash id": ([line(hash_ids=[True, 2])], 1, ["hash_ids[0] must be an integer, got a boolean"]),
    "hash_ids not a list": ([line(hash_ids="12")], 1, ["'hash_ids' must be an array"]),
    "deeply nested JSON": ([line(), "[" * 100_000 + "]" * 100_000], 2, ["nested too deeply"]),
    "non-object line (array)": ([line(), "[1, 2]"], 2, ["expected a JSON object", "got an array"]),
    "non-object line (number)": (["42"], 1, ["expected a JSON object", "got an integer"]),
    "non-object line (null)": (["null"], 1, ["expected a JSON object", "got null"]),
    "missing field": ([line(hash_ids=DROP)], 1, ["missing field 'hash_ids'"]),
    "missing fields": (["{}"], 1, ["missing fields 'timestamp', 'input_length', 'output_length', 'hash_ids'"]),
    "timestamp a string": ([line(timestamp="0")], 1, ["'timestamp' must be a number", 'a string "0"']),
    "timestamp a bool": ([line(timestamp=True)], 1, ["'timestamp' must be a number"]),
    "timestamp NaN": (['{"timestamp": NaN, "input_length": 1, "output_length": 1, "hash_ids": [1]}'], 1,
                      ["'timestamp' must be finite"]),
    "timestamp Infinity": (['{"timestamp": Infinity, "input_length": 1, "output_length": 1, "hash_ids": [1]}'], 1,
                           ["'timestamp' must be finite"]),
    "negative timestamp": ([line(), line(timestamp=-5)], 2, ["'timestamp' must be >= 0", "-5"]),
    "input_length a float": ([line(input_length=600.0)], 1, ["'input_length' must be an integer"]),
    "input_length zero": ([line(input_length=0)], 1, ["'input_length' must be >= 1"]),
    "input_length too long for its ids": ([line(input_length=1025)], 1, ["input_length 1025 does not fit 2 hash_ids"]),
    "output_length null": ([line(output_length=None)], 1, ["'output_length' must be an integer, got null"]),
    "output_length negative": ([line(output_length=-1)], 1, ["'output_length' must be >= 0"]),
    "not JSON": ([line(), '{"timestamp": 0,'], 2, ["not JSON"]),
    "a line cut short": ([line(), '{"timestamp": 0, "input_length": 6'], 2, ["not JSON", "(column 35)"]),
    "an integer of 5000 digits": ([line(), '{"timestamp": ' + "9" * 5000 + "}"], 2, ["not JSON"]),
}


@pytest.mark.parametrize("case", list(BAD_MOONCAKE))
def test_malformed_mooncake_line_is_one_error_line(case, tmp_path, capsys):
    lines, lineno, needles = BAD_MOONCAKE[case]
    path = write(tmp_path, "trace.jsonl", "\n".join(lines) + "\n")
    status, out, err = run_cli([path, "--arrival", "timestamp"], capsys)
    assert_one_line_error(status, err, f"{path}:{lineno}: ", *needles)
    assert "prefix cache hit rate" not in out  # nothing ran


def test_invalid_utf8_names_the_line(tmp_path, capsys):
    path = write(tmp_path, "trace.jsonl", (line() + "\n").encode() + b'{"timestamp": "\xff"}\n')
    assert_one_line_error(*run_cli([path], capsys)[::2], f"{path}:2: ", "not UTF-8")


@pytest.mark.parametrize("text", ["", "\n\n  \n"])
def test_empty_trace_is_an_error(text, tmp_path, capsys):
    path = write(tmp_path, "trace.jsonl", text)
    assert_one_line_error(*run_cli([path], capsys)[::2], path, "empty trace")


def test_largest_hash_id_is_accepted_and_exact(tmp_path):
    path = write(tmp_path, "trace.jsonl", line(hash_ids=[MAX_HASH_ID, 0], input_length=513) + "\n")
    tokens = load_trace(path).requests[0].prompt_tokens()
    assert tokens[0] == MAX_HASH_ID * 512 and tokens[511] == 2**31 - 1 and tokens[512] == 0


# ------------------------------------------------------------- step traces


def doc_text(config='"block_size": 2,\n            "num_blocks": 10', **fields) -> str:
    """A two-step trace, one field of request b per line (``fields`` override
    or add to ``"id": "b", "token_ids": [1, 2, 3, 4]``)."""
    b = dict({"id": "b", "token_ids": [1, 2, 3, 4]}, **fields)
    members = ",\n            ".join(f"{json.dumps(k)}: {json.dumps(v)}" for k, v in b.items())
    return ('{"config": {' + config + '},\n'
            ' "steps": [\n'
            '  {"new": [{"id": "a", "token_ids": [1, 2, 3]}]},\n'
            '  {"new": [{' + members + '}]}]}\n')


def line_of(text: str, needle: str | tuple[str, int]) -> int:
    """The line of ``needle`` (or of its n-th later occurrence: ``(needle, n)``)."""
    needle, n = needle if isinstance(needle, tuple) else (needle, 0)
    at = text.index(needle)
    for _ in range(n):
        at = text.index(needle, at + 1)
    return text[:at].count("\n") + 1


TOKENS_B = ('"token_ids"', 1)  # request b's token_ids (a's come first)
MM = [{"offset": 0, "length": 2, "hash": "x"}, {"offset": 1, "length": 2, "hash": "y"}]

BAD_STEP = {
    # name: (document text, needle on the line to blame (None: line 1), words the message must hold)
    "num_blocks: 1": (doc_text('"block_size": 2,\n "num_blocks": 1'), '"num_blocks"',
                      ["num_blocks must be >= 2", "null block"]),
    "block_size: 0": (doc_text('\n"block_size": 0'), '"block_size"', ["block_size must be positive"]),
    "block_size a string": (doc_text('\n"block_size": "16"'), '"block_size"', ["'block_size' must be an integer"]),
    "num_blocks above int32": (doc_text(f'\n"num_blocks": {2**31}'), '"num_blocks"',
                               ["num_blocks must be at most 2147483647"]),
    "unknown config field": (doc_text('\n"num_block": 5'), '"num_block"', ['unknown field "num_block"']),
    "lora_id: -1": (doc_text(lora_id=-1), '"lora_id"', ["step 1 new request 'b'", "lora_id must be in [0, 2**64)"]),
    "lora_id: 2**64": (doc_text(lora_id=2**64), '"lora_id"',
                       ["lora_id must be in [0, 2**64), got 18446744073709551616"]),
    "lora_id a float": (doc_text(lora_id=1.0), '"lora_id"', ["'lora_id' must be an integer, got a number 1.0"]),
    "token -1": (doc_text(token_ids=[1, -1]), TOKENS_B, ["token id at position 1 is -1, outside [0, 2**32)"]),
    "token 2**32": (doc_text(token_ids=[2**32]), TOKENS_B, ["token id at position 0 is 4294967296"]),
    "nested tokens": (doc_text(token_ids=[1, [2]]), TOKENS_B, ["position 1 is an array"]),
    "float token": (doc_text(token_ids=[1, 2.0]), TOKENS_B, ["position 1 is a number 2.0"]),
    "bool token": (doc_text(token_ids=[True]), TOKENS_B, ["position 0 is a boolean true"]),
    "tokens not a list": (doc_text(token_ids="1 2"), TOKENS_B,
                          ["'token_ids' must be an array of integers, got a string"]),
    "no tokens": (doc_text(token_ids=[]), TOKENS_B, ["no tokens"]),
    "missing token_ids": ('{"steps": [\n {"new": [\n  {"id": "b"}]}]}', '{"id": "b"}', ["missing field 'token_ids'"]),
    "typo in a field name": (doc_text(token_id=[1]), '"token_id"', ['unknown field "token_id"']),
    "skip_prefix_cache not a bool": (doc_text(skip_prefix_cache=1), '"skip_prefix_cache"',
                                     ["'skip_prefix_cache' must be true or false, got an integer 1"]),
    "cache_salt a lone surrogate": (doc_text(cache_salt="\ud800"), '"cache_salt"', ["cache_salt is not valid Unicode"]),
    "cache_salt a number": (doc_text(cache_salt=5), '"cache_salt"', ["'cache_salt' must be a string"]),
    "mm item outside the prompt": (doc_text(mm=[{"offset": 2, "length": 3, "hash": "img"}]), '"mm"',
                                   ["mm[0]", "inside the prompt of 4 tokens"]),
    "mm items overlapping": (doc_text(mm=MM), '"mm"', ["mm[1]", "offsets 0 and 1 overlap"]),
    "mm hash a lone surrogate": (doc_text(mm=[{"offset": 0, "length": 1, "hash": "\udc00"}]), '"mm"',
                                 ["hash is not valid Unicode"]),
    "request id used twice": (doc_text(id="a"), ('"id": "a"', 1), ["step 1 new request 'a'", "request id used twice"]),
    "request id an object": (doc_text(id={"x": 1}), '"id": {',
                             ["field 'id' must be a string or an integer, got an object"]),
    "finish id a list": ('{"steps": [{"new": [{"id": "a", "token_ids": [1]}]},\n {"finish": [[1]]}]}', '"finish"',
                         ["step 1 finish", "a request id must be a string or an integer, got an array"]),
    "top level an array": ("[1, 2]", None, ["expected a JSON object", "got an array"]),
    "steps missing": ('{"config": {}}', None, ["missing field 'steps'"]),
    "a step not an object": ('{"steps": [\n  [1]\n]}', "[1]", ["step 0: expected an object, got an array"]),
    "decode twice in one step": ('{"steps": [{"new": [{"id": "a", "token_ids": [1]}]},\n'
                                 ' {"decode": [{"id": "a", "token_ids": [2]},\n'
                                 '             {"id": "a", "token_ids": [3]}]}]}', ('{"id": "a"', 2),
                                 ["step 1 decode 'a': decoded twice in one step"]),
    "not JSON": ('{"steps": [\n  {"new": []},\n  {"new": [}\n]}', '{"new": [}', ["not JSON"]),
    "deeply nested JSON": ('{"steps":\n' + "[" * 100_000 + "]" * 100_000 + "}", "[[[", ["nested too deeply"]),
}


@pytest.mark.parametrize("case", list(BAD_STEP))
def test_malformed_step_trace_is_one_error_line(case, tmp_path, capsys):
    text, needle, words = BAD_STEP[case]
    path = write(tmp_path, "steps.json", text)
    status, out, err = run_cli([path], capsys)
    where = f"{path}:{line_of(text, needle) if needle else 1}: "
    msg = assert_one_line_error(status, err, where, *words)
    assert "prefix cache hit rate" not in out, msg


@pytest.mark.parametrize("text", ['{"steps": []}', '{"steps": [{}, {"finish": ["x"]}]}', "", "  \n"])
def test_step_trace_without_requests_is_an_error(text, tmp_path, capsys):
    path = write(tmp_path, "steps.json", text)
    assert_one_line_error(*run_cli([path], capsys)[::2], path, "empty trace")


def test_step_trace_config_overriding_an_option_says_so(tmp_path, capsys):
    path = write(tmp_path, "steps.json", doc_text())
    status, out, err = run_cli([path, "--block-size", "4"], capsys)
    assert status == 0
    # A note goes to stderr, the results to stdout.
    assert err.splitlines() == ["note: the step trace's config sets block_size 2; --block-size 4 is not used"]
    assert "note:" not in out and "config sets" not in out
    assert "blocks of 2 tokens" in out


def test_one_of_a_kind_is_counted_in_the_singular(capsys):
    status, out, _ = run_cli(["--max-requests", "1", "--prompt-only", "--max-steps", "1"], capsys)
    assert status == 0
    assert ("mooncake, 1 request (0 finished, 0 rejected, 1 still running and 0 waiting when the replay stopped), "
            "1 step, arrivals by timestamp") in out
    assert "tokens looked up in 1 lookup, one each time" in out
    assert "(0 of 0 tokens, 0 lookups of preempted requests, counted apart as vLLM does)" in out


def test_a_step_trace_says_what_it_left_running(tmp_path, capsys):
    doc = {"steps": [{"new": [{"id": "a", "token_ids": [1, 2, 3]}, {"id": "b", "token_ids": [4, 5]}]},
                     {"finish": ["a"]}]}
    status, out, _ = run_cli([write(tmp_path, "steps.json", json.dumps(doc))], capsys)
    assert status == 0
    assert ("trace                  step, 2 requests (1 finished, 0 rejected, 1 still running and 0 waiting when the "
            "trace ended), 2 steps\n") in out


def test_max_steps_says_what_it_left_unfinished(capsys):
    status, out, _ = run_cli(["--max-requests", "3", "--arrival", "back-to-back", "--max-num-seqs", "2",
                              "--max-steps", "1", "--json", "-"], capsys)
    summary = json.loads(out.splitlines()[0])["summary"]
    assert (status, summary["finished"], summary["running_at_end"], summary["waiting_at_end"]) == (0, 0, 2, 1)


def test_the_pool_is_counted_one_way(capsys):
    status, out, _ = run_cli(["--max-requests", "1", "--prompt-only", "--num-blocks", "3000"], capsys)
    assert status == 0
    assert ("pool                   3,000 blocks of 16 tokens, block 0 the null block, so 2,999 hold 47,984 tokens; "
            "max 64 running, waiting requests admitted in one call a step (--admission batch)\n") in out
    assert "of 47,984 tokens)" in out  # pool pressure: the same tokens


# ----------------------------------------------------------------- options


HINT = "(see 'gpukv replay --help')"


@pytest.mark.parametrize("argv, message", [
    (["--block-size", "0"], "argument --block-size: must be an integer from 1 to 65536 (tokens per block), got 0"),
    (["--block-size", "x"], "argument --block-size: expected an integer from 1 to 65536 (tokens per block), got 'x'"),
    (["--num-blocks", "1"],
     "argument --num-blocks: must be an integer from 2 to 536870912 (blocks, the null block included), got 1"),
    (["--max-model-len", "-3"], "argument --max-model-len: must be an integer from 1 to 2147483647 (tokens), got -3"),
    (["--max-num-seqs", "0"], "argument --max-num-seqs: must be an integer from 1 to 1073741823 (requests), got 0"),
    (["--max-requests", "0"], "argument --max-requests: must be an integer from 1 to 2147483647 (requests), got 0"),
    (["--max-steps", "1.5"], "argument --max-steps: expected an integer from 1 to 2147483647 (steps), got '1.5'"),
    (["--max-steps", "9" * 5000], "argument --max-steps: expected an integer from 1 to 2147483647 (steps), got "
                                  f"'{'9' * 40}'... (5000 characters)"),
    (["--step-ms", "0"], "argument --step-ms: must be a number of milliseconds > 0 and finite, got 0"),
    (["--step-ms", "nan"], "argument --step-ms: must be a number of milliseconds > 0 and finite, got nan"),
    (["--step-ms", "inf"], "argument --step-ms: must be a number of milliseconds > 0 and finite, got inf"),
    (["--max-num-batched-tokens", "-1"], "argument --max-num-batched-tokens: must be an integer from 0 to 2147483647 "
                                         "(tokens; 0 or 'unlimited': no budget), got -1"),
    (["--max-num-batched-tokens", "lots"], "argument --max-num-batched-tokens: expected a number of tokens, or 0 or "
                                           "'unlimited' for no budget, got 'lots'"),
    (["--long-prefill-token-threshold", "-5"], "argument --long-prefill-token-threshold: must be an integer from 0 to "
                                               "2147483647 (tokens; 0: no cap), got -5"),
    (["--metrics-port", "65536"], "argument --metrics-port: must be an integer from 0 to 65535 (a TCP port; 0: any "
                                  "free one), got 65536"),
    (["--metrics-linger", "-1"], "argument --metrics-linger: must be a number of seconds >= 0 and <= 86400, got -1"),
    (["--metrics-linger", "1e9"], "argument --metrics-linger: must be a number of seconds >= 0 and <= 86400, got 1e9"),
    (["--metrics-linger", "5"], "--served-model-name, --metrics-vllm085 and --metrics-linger apply to the metrics: "
                                "add --metrics-port"),
])
def test_bad_option_is_one_error_line(argv, message, capsys):
    status, out, err = run_cli(argv, capsys)
    hint = f" {HINT}" if message.startswith("argument") else ""
    assert (status, out, err) == (2, "", f"gpukv replay: {message}{hint}\n")


def test_a_bad_choice_is_one_error_line(capsys):
    status, out, err = run_cli(["--admission", "all"], capsys)
    # argparse quotes the choices or not, by Python version.
    assert (status, out) == (2, "") and re.fullmatch(
        r"gpukv replay: argument --admission: invalid choice: 'all' \(choose from '?batch'?, '?one'?\) "
        + re.escape(HINT) + "\n", err), err


def test_a_missing_trace_says_what_trace_may_be(capsys):
    status, out, err = run_cli(["/no/such/trace.jsonl"], capsys)
    assert (status, out) == (2, "")
    assert err == ("gpukv replay: cannot read the trace: /no/such/trace.jsonl: no such file; TRACE is a Mooncake "
                   ".jsonl (or .jsonl.xz, .jsonl.gz) or a step-trace .json (docs/traces.md), and with no TRACE the "
                   "built-in workload runs\n")


def test_a_damaged_compressed_trace_is_one_error_line(tmp_path, capsys):
    import lzma

    packed = lzma.compress(("".join(line(timestamp=i) + "\n" for i in range(500))).encode())
    path = write(tmp_path, "t.jsonl.xz", packed[:200])
    status, out, err = run_cli([path], capsys)
    assert (status, out) == (2, "")
    assert re.fullmatch(re.escape(f"gpukv replay: {path}:") + r"\d+: cannot decompress it \(EOFError: .*\): a "
                        r"damaged or truncated compressed file\n", err), err


def test_a_corrupted_gzip_trace_is_one_error_line_not_an_internal_error(tmp_path, capsys):
    import gzip

    packed = bytearray(gzip.compress(("".join(line(timestamp=i) + "\n" for i in range(500))).encode()))
    for i in range(30, 60):  # the header intact, the deflate stream damaged: zlib's error, not gzip's
        packed[i] ^= 0xFF
    path = write(tmp_path, "t.jsonl.gz", bytes(packed))
    for command in (["replay", "--backend", "reference"], ["sweep", "--num-blocks", "64"]):
        with pytest.raises(SystemExit) as info:
            main([*command, "-q", path])
        out, err = capsys.readouterr()
        assert (info.value.code, out) == (2, "")
        assert re.fullmatch(re.escape(f"gpukv {command[0]}: {path}:1: cannot decompress it (zlib.error: Error -3 "
                                      "while decompressing data: ") + r"[^()]+\): a damaged or truncated compressed "
                            r"file\n", err), err


def test_an_unknown_option_is_one_error_line(capsys):
    status, out, err = run_cli(["--bogus"], capsys)
    assert (status, out, err) == (2, "", f"gpukv replay: unrecognized arguments: --bogus {HINT}\n")


def test_trace_that_is_a_directory(tmp_path, capsys):
    assert_one_line_error(*run_cli([str(tmp_path)], capsys)[::2], str(tmp_path), "is a directory")


def test_arrival_timestamp_on_a_step_trace_is_refused(tmp_path, capsys):
    path = write(tmp_path, "steps.json", doc_text())
    assert_one_line_error(*run_cli([path, "--arrival", "timestamp"], capsys)[::2], "step trace")


@pytest.mark.parametrize("option", ["--json", "--plot"])
def test_output_into_a_missing_directory_is_refused_before_the_replay(option, tmp_path, capsys, monkeypatch):
    ran = []
    monkeypatch.setattr(Replay, "run", lambda _self: ran.append(1))
    target = tmp_path / "no" / "such" / "out"
    status, out, err = run_cli(["--max-requests", "2", option, str(target)], capsys)
    assert_one_line_error(status, err, option, str(target), "does not exist")
    assert ran == [] and out == ""


@pytest.mark.parametrize("option", ["--json", "--plot"])
def test_output_that_is_a_directory_or_the_trace_is_refused(option, tmp_path, capsys):
    assert_one_line_error(*run_cli([option, str(tmp_path)], capsys)[::2], option, "is a directory")
    path = write(tmp_path, "trace.jsonl", line() + "\n")
    assert_one_line_error(*run_cli([path, option, path], capsys)[::2], "overwrite")
    assert (tmp_path / "trace.jsonl").read_text() == line() + "\n"


def test_json_and_plot_on_one_file_is_refused(tmp_path, capsys):
    out = str(tmp_path / "x")
    assert_one_line_error(*run_cli(["--json", out, "--plot", out], capsys)[::2], "same file")


# ------------------------------------------------------------ hash key env


@pytest.mark.parametrize("value, words", [
    ("xyz", ["GPUKV_HASH_KEY", "32 hex characters", "got 3"]),
    ("0" * 31, ["GPUKV_HASH_KEY", "32 hex characters"]),
    ("g" * 32, ["GPUKV_HASH_KEY", "hex digits"]),
    ("   ", ["GPUKV_HASH_KEY", "blank"]),
])
def test_malformed_hash_key_env_is_an_error(value, words, capsys, monkeypatch):
    monkeypatch.setenv("GPUKV_HASH_KEY", value)
    status, out, err = run_cli(["--max-requests", "1"], capsys)
    msg = assert_one_line_error(status, err, *words)
    assert value.strip() == "" or value not in msg  # the key is a secret: never echoed
    assert out == ""


def test_hash_key_env_is_used(capsys, monkeypatch):
    monkeypatch.setenv("GPUKV_HASH_KEY", "00" * 16)
    seen = []
    real = Replay.__init__

    def spy(self, trace, opts, manager=None):
        seen.append(opts.hash_key)
        real(self, trace, opts, manager)

    monkeypatch.setattr(Replay, "__init__", spy)
    status, _, _ = run_cli(["--max-requests", "1", "--prompt-only"], capsys)
    assert status == 0 and seen == [bytes(16)]


# ---------------------------------------------- interrupts, pipes, failures


def test_keyboard_interrupt_is_one_line_and_status_130(capsys, monkeypatch, tmp_path):
    def interrupted(_self):
        raise KeyboardInterrupt

    monkeypatch.setattr(Replay, "run", interrupted)
    out = tmp_path / "r.json"
    status, _, err = run_cli(["--max-requests", "1", "--json", str(out)], capsys)
    assert status == 130 and err.splitlines() == ["gpukv replay: interrupted; nothing was written"]
    assert not out.exists() and list(tmp_path.iterdir()) == []


def test_an_internal_error_is_one_line_and_status_1(capsys, monkeypatch):
    def boom(_self):
        raise RuntimeError("boom\nsecond line")

    monkeypatch.setattr(Replay, "run", boom)
    status, _, err = run_cli(["--max-requests", "1"], capsys)
    assert status == 1 and "Traceback" not in err and len(err.splitlines()) == 1
    assert "RuntimeError: boom second line" in err and "GPUKV_DEBUG=1" in err
    monkeypatch.setenv("GPUKV_DEBUG", "1")
    with pytest.raises(RuntimeError, match="boom"):
        main(["replay", "--backend", "reference", "--max-requests", "1"])


def _env():
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.pop("GPUKV_HASH_KEY", None)
    return env


def test_broken_pipe_exits_quietly():
    # stdout is a pipe whose reader is gone before anything is printed.
    r, w = os.pipe()
    os.close(r)
    proc = subprocess.run(
        [sys.executable, "-m", "gpukv", "replay", "--backend", "reference", "--max-requests", "1", "--prompt-only"],
        stdout=w, stderr=subprocess.PIPE, env=_env(), cwd=ROOT, timeout=300,
    )
    os.close(w)
    assert proc.returncode == 141, proc.stderr
    assert proc.stderr == b""


def test_end_to_end_malformed_trace_subprocess(tmp_path):
    path = write(tmp_path, "trace.jsonl", line() + "\n" + line(hash_ids=[10**30]) + "\n")
    proc = subprocess.run([sys.executable, "-m", "gpukv", "replay", path, "--backend", "reference"],
                          capture_output=True, text=True, env=_env(), cwd=ROOT, timeout=300)
    assert proc.returncode == 2
    assert proc.stderr.splitlines() == [
        f"gpukv replay: {path}:2: hash_ids[0] is 1000000000000000000000000000000, outside [0, 4194303]: block h "
        "holds tokens h*512+k, which must stay below 2**31 (generated tokens start there)"]
    assert proc.stdout == ""


# ---------------------------------------------------- far-apart arrivals


def _arrivals(tmp_path, name, gap_ms) -> str:
    # With 64-token blocks: r1 hits r0's 15 full prompt blocks (960 tokens; r0's
    # 16th block holds generated tokens), r2 hits id 1's 8 blocks (512), r3 (id 3
    # at position 0, a different chain from r1's id 3 at position 2) nothing.
    recs = [
        dict(timestamp=0, input_length=1000, output_length=3, hash_ids=[1, 2]),
        dict(timestamp=gap_ms, input_length=1100, output_length=2, hash_ids=[1, 2, 3]),
        dict(timestamp=gap_ms + 100, input_length=700, output_length=4, hash_ids=[1, 4]),
        dict(timestamp=2 * gap_ms, input_length=512, output_length=1, hash_ids=[3]),
    ]
    return write(tmp_path, name, "".join(json.dumps(r) + "\n" for r in recs))


def test_far_apart_timestamps_are_skipped_and_change_nothing(tmp_path):
    far = load_trace(_arrivals(tmp_path, "far.jsonl", 1e15), arrival="timestamp")
    near = load_trace(_arrivals(tmp_path, "near.jsonl", 1000), arrival="timestamp")
    opts = dict(block_size=64, num_blocks=200, hash_key=bytes(16))
    t = time.perf_counter()
    a = Replay(far, ReplayOptions(**opts)).run()
    assert time.perf_counter() - t < 10
    b = Replay(near, ReplayOptions(**opts)).run()
    sa, sb = a["summary"], b["summary"]
    for k in ("steps", "prompt_tokens", "cached_tokens", "every_admission_hit_rate", "queries", "hits",
              "block_hit_rate", "admissions", "evictions", "preemptions", "finished", "max_blocks_in_use",
              "mean_blocks_in_use"):
        assert sa[k] == sb[k], k
    assert (sa["cached_tokens"], sa["prompt_tokens"]) == (960 + 512, 1000 + 1100 + 700 + 512)
    # r0 runs steps 0-3; r1 and r2 the 6 steps from the gap on; r3 2 steps.
    assert sa["steps"] == 4 + 6 + 2 and sa["skipped_idle_steps"] > 10**13
    strip = lambda recs: {k: {f: v for f, v in r.items() if not f.endswith("_step")} for k, r in recs.items()}  # noqa: E731
    assert strip(a["requests"]) == strip(b["requests"])
    assert a["final"] == b["final"]
    assert a["requests"]["r1"]["admitted_step"] == 10**13


def test_far_apart_timestamps_through_the_cli(tmp_path):
    path = _arrivals(tmp_path, "far.jsonl", 1e15)
    t = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "gpukv", "replay", path, "--arrival", "timestamp",
                           "--backend", "reference", "--block-size", "64", "--num-blocks", "200"],
                          capture_output=True, text=True, env=_env(), cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert re.search(r"every admission +0.4444", proc.stdout) and "idle steps skipped" in proc.stdout
    assert time.perf_counter() - t < 120


def test_no_progress_line_state_is_left_after_an_error(capsys, monkeypatch):
    def boom(_self):
        raise MemoryError

    monkeypatch.setattr(Replay, "run", boom)
    status, _, err = run_cli(["--max-requests", "1"], capsys)
    assert_one_line_error(status, err, "ran out of memory")
    assert err.startswith("gpukv replay: "), err  # on a line of its own, no progress residue before it


def test_a_manager_refusal_during_the_replay_is_one_line(capsys, monkeypatch):
    errors = pytest.importorskip("gpukv.errors")

    def refused(_self):
        raise errors.InvalidInputError("lora_id must be < 2**64", argument="new[0].lora_id", fix="use a smaller id")

    monkeypatch.setattr(Replay, "run", refused)
    status, _, err = run_cli(["--max-requests", "1"], capsys)
    assert_one_line_error(status, err, "manager refused a request of the trace", "new[0].lora_id")


# ------------------------------------------------------- CLI conventions


def test_version_prints_the_version_and_exits_0(capsys):
    import importlib.metadata

    import gpukv

    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0
    out, err = capsys.readouterr()
    try:
        expected = importlib.metadata.version("gpukv")
    except importlib.metadata.PackageNotFoundError:
        expected = gpukv.__version__
    assert out.strip() == f"gpukv {expected}" and err == ""
    assert cli.version() == expected


def test_version_falls_back_to_the_module_attribute(monkeypatch):
    import importlib.metadata

    import gpukv

    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", missing)
    assert cli.version() == gpukv.__version__


def test_version_through_the_command_line():
    proc = subprocess.run([sys.executable, "-m", "gpukv", "--version"], capture_output=True, text=True,
                          env=_env(), cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("gpukv ") and proc.stdout.split()[1] == cli.version() and proc.stderr == ""


def test_help_shows_the_defaults(capsys):
    with pytest.raises(SystemExit) as info:
        main(["replay", "--help"])
    assert info.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    for shown in ("(default: auto)", "(default: 64: the default pool holds about 72", "(default: batch)",
                  "(default: timestamp;", "(default: 40.0)", "(default: 16;", "(default: 65536;", "(default: 131072;",
                  "(default: 8192, vLLM 0.8.5's default for its OpenAI server on GPUs with at least 70 GiB",
                  "0 or 'unlimited': no budget", "(default: 0, no cap, as in vLLM)"):
        assert shown in text, shown
    assert "(default: None)" not in text and "(default: False)" not in text


@pytest.mark.parametrize("argv, budget, given", [
    ([], 8192, 8192),
    (["--max-num-batched-tokens", "2048"], 2048, 2048),
    (["--max-num-batched-tokens", "0"], None, 0),
    (["--max-num-batched-tokens", "unlimited"], None, 0),
    (["--max-num-batched-tokens", " Unlimited "], None, 0),
    (["--max-num-batched-tokens", "none"], None, 0),
])
def test_token_budget_option(argv, budget, given, capsys):
    status, out, err = run_cli(["--max-requests", "2", "--prompt-only", "--json", "-", *argv], capsys)
    assert status == 0, err
    report = json.loads(out)
    assert report["config"]["max_num_batched_tokens"] == budget
    assert report["arguments"]["max_num_batched_tokens"] == given
    assert report["config"]["long_prefill_token_threshold"] == 0
    words = (f"token budget {budget:,} per step: a longer prompt is computed in pieces over several steps" if budget
             else "no token budget: each prompt computed whole in its admission step")
    assert re.search(rf"scheduling +{words}\n", err)
    assert re.search(r"  first admission +0\.0364  \(each request once, at its first admission\)", err)  # 512 of 14,080


def test_long_prefill_threshold_option(capsys):
    status, out, err = run_cli(["--max-requests", "2", "--prompt-only", "--json", "-",
                                "--long-prefill-token-threshold", "1000"], capsys)
    assert status == 0, err
    report = json.loads(out)
    assert report["config"]["long_prefill_token_threshold"] == 1000
    assert ("token budget 8,192 per step: a longer prompt is computed in pieces over several steps, at most 1,000 "
            "tokens of a prompt a step (--long-prefill-token-threshold)\n") in err
    # The first request's 6758 tokens take 7 steps of 1000 at most.
    assert report["requests"]["r0"]["prefill_done_step"] == 6


@pytest.mark.parametrize("argv, noted", [([], False), (["--max-num-batched-tokens", "64"], True),
                                         (["--long-prefill-token-threshold", "2"], True)])
def test_a_step_trace_runs_as_written_and_says_so_when_a_budget_is_given(argv, noted, tmp_path, capsys):
    path = write(tmp_path, "steps.json", doc_text())
    status, out, err = run_cli([path, *argv], capsys)
    assert status == 0, err
    assert ("a step trace runs as written" in err) == noted
    assert re.search(r"scheduling +a step trace runs as written \(no token budget, whole prompts\)", out)


REPORT_KEYS = {"gpukv_version", "arguments", "trace", "config", "summary", "requests", "final", "messages"}


def test_json_dash_writes_valid_json_to_stdout(capsys):
    status, out, err = run_cli(["--max-requests", "2", "--prompt-only", "--json", "-"], capsys)
    assert status == 0, err
    report = json.loads(out)  # stdout is the JSON report and nothing else
    assert set(report) >= REPORT_KEYS
    assert report["gpukv_version"] == cli.version()
    assert report["trace"] == "built-in"
    args = report["arguments"]
    assert args["json"] == "-" and args["max_requests"] == 2 and args["prompt_only"] is True
    assert args["backend"] == "reference" and args["command"] == "replay"
    config = report["config"]
    assert {"num_blocks": 65_536, "block_size": 16, "sliding_windows": [None], "backend": "reference"}.items() \
        <= config.items()
    # The human summary went to stderr, and nothing was written to a file named "-".
    assert "prefix cache hit rate" in err and "manager time/step" in err
    assert not os.path.exists("-")


def test_json_file_carries_version_arguments_trace_and_config(tmp_path, capsys):
    path = write(tmp_path, "steps.json", doc_text())
    out_json = tmp_path / "r.json"
    status, out, err = run_cli([path, "--json", str(out_json)], capsys)
    assert status == 0, err
    report = json.loads(out_json.read_text())
    assert set(report) >= REPORT_KEYS
    assert report["trace"] == path and report["arguments"]["trace"] == path
    assert report["arguments"]["json"] == str(out_json)
    assert report["config"]["block_size"] == 2 and report["config"]["backend"] == "reference"
    assert report["config"]["sliding_windows"] == [None] and report["config"]["num_blocks"] >= 2
    # Results on stdout; the "written to" note on stderr.
    assert "prefix cache hit rate" in out and "report written" not in out
    assert f"note: report written to {out_json}" in err


def test_json_dash_from_a_subprocess_is_parseable():
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "gpukv", "replay", "--backend", "reference", "--max-requests", "1",
                           "--prompt-only", "--json", "-"], capture_output=True, text=True, env=_env(), cwd=ROOT,
                          timeout=300)
    elapsed = time.perf_counter() - t0
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert set(report) >= REPORT_KEYS and report["trace"] == "built-in"
    assert "prefix cache hit rate" in proc.stderr
    # The whole process's time is the process's as its parent sees it (the
    # interpreter's start and the imports included; /proc counts in 10 ms
    # ticks), and holds the replay loop's.
    loop, total = report["summary"]["wall_s"], report["process_wall_s"]
    assert loop < total <= elapsed + 0.02 and total > 0.5 * elapsed, (loop, total, elapsed)
    time_line = next(x for x in proc.stderr.splitlines() if x.startswith("time "))
    assert time_line == (f"time                   replay loop {loop:.1f} s (its steps: the scheduler and the manager's "
                         f"calls); the whole process {total:.1f} s (also the imports, loading the trace, the manager's "
                         "setup, the ceiling's pass and the report)")


def test_no_cuda_note_goes_to_stderr(capsys, monkeypatch):
    from gpukv import _runtime

    monkeypatch.setattr(_runtime, "CUDA_AVAILABLE", False)
    try:
        status = main(["replay", "--no-progress", "--max-requests", "1", "--prompt-only"])
    except SystemExit as e:
        status = e.code
    out, err = capsys.readouterr()
    assert status == 0
    assert "note: no CUDA device here" in err and "note:" not in out
    assert "prefix cache hit rate" in out


def test_progress_uses_tqdm_and_prints_plain_lines_off_a_terminal(capsys, monkeypatch):
    import gpukv.tools.replay as replay_mod

    monkeypatch.setattr(replay_mod, "PLAIN_DELAY_S", 0.0)
    monkeypatch.setattr(replay_mod, "PLAIN_INTERVAL_S", 0.0)
    try:
        status = main(["replay", "--backend", "reference", "--max-requests", "3", "--prompt-only"])
    except SystemExit as e:
        status = e.code
    out, err = capsys.readouterr()
    assert status == 0
    lines = [line for line in err.splitlines() if line.startswith("replay (reference):")]
    assert lines, err
    assert "\r" not in err  # plain lines, readable in a CI log
    assert "3/3" in lines[-1] and "100%" in lines[-1]
    assert "replay (reference)" not in out  # progress never on stdout


def test_progress_is_quiet_for_a_short_replay_off_a_terminal(capsys):
    try:
        status = main(["replay", "--backend", "reference", "--max-requests", "1", "--prompt-only"])
    except SystemExit as e:
        status = e.code
    out, err = capsys.readouterr()
    assert status == 0 and err == ""


def test_progress_line_is_cleared_when_the_replay_fails(capsys, monkeypatch):
    import gpukv.tools.replay as replay_mod

    monkeypatch.setattr(replay_mod, "PLAIN_DELAY_S", 0.0)

    def boom(_self, *_args, **_kwargs):
        raise MemoryError

    monkeypatch.setattr(Replay, "_step", boom)
    try:
        status = main(["replay", "--backend", "reference", "--max-requests", "1"])
    except SystemExit as e:
        status = e.code
    out, err = capsys.readouterr()
    assert status == 2 and out == ""
    assert err.splitlines()[-1].startswith("gpukv replay: ") and "ran out of memory" in err


# ------------------------------------------------------------ without Triton

def test_the_device_backend_without_triton_is_one_error_line(capsys, monkeypatch):
    monkeypatch.setattr(cli, "_triton_installed", lambda: False)
    with pytest.raises(SystemExit) as info:
        main(["replay", "--backend", "device", "--max-requests", "2", "--no-progress"])
    status = info.value.code
    assert_one_line_error(status, capsys.readouterr().err, "the device backend needs Triton", "--backend reference")


_NO_TRITON = """
import importlib.abc, sys
class NoTriton(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == "triton" or name.startswith("triton."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
sys.meta_path.insert(0, NoTriton())
import gpukv, gpukv.reference.manager, gpukv.tools.replay
from gpukv.tools.cli import main
sys.exit(main(["replay", "--max-requests", "3", "--no-progress", "--json", "-"]))
"""


def test_the_reference_and_the_replay_run_where_triton_is_missing():
    # As on macOS or Windows, where Triton has no wheel (pyproject installs it on Linux only).
    out = subprocess.run([sys.executable, "-c", _NO_TRITON], capture_output=True, text=True, cwd=ROOT, timeout=300,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert report["config"]["backend"] == "reference"



# ------------------------------------------------------- what importing costs

_IMPORTS = """
import sys
import gpukv
print(gpukv.__version__, "torch" in sys.modules, "triton" in sys.modules)
from gpukv import GpukvError, MMItem, PrefixCacheStats
from gpukv.core import windows
assert windows.policies
print("torch" in sys.modules)
from gpukv import NewRequest, get_kv_cache_config
print(NewRequest.__module__, get_kv_cache_config.__module__, "gpukv._runtime" in sys.modules)
print(sorted(n for n in gpukv.__all__ if not hasattr(gpukv, n)), set(gpukv.__all__) <= set(dir(gpukv)))
print(gpukv.sizing.config.get_kv_cache_config is get_kv_cache_config)
"""


def test_importing_the_package_loads_neither_torch_nor_triton():
    proc = subprocess.run([sys.executable, "-c", _IMPORTS], capture_output=True, text=True, env=_env(), cwd=ROOT,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    import gpukv

    assert proc.stdout.splitlines() == [
        f"{gpukv.__version__} False False",  # import gpukv, and its version, cost neither
        "False",  # names (and gpukv.core.windows) from modules without torch
        "gpukv.core.requests gpukv.sizing.config True",  # the rest: gpukv._runtime first, before anything loads triton
        "[] True",  # every public name resolves and dir() lists it
        "True",  # as do the submodules `import gpukv` used to load
    ]


def test_the_lazy_names_are_all_and_the_type_checkers_see_them():
    import ast

    import gpukv

    tree = ast.parse((ROOT / "gpukv" / "__init__.py").read_text())
    seen = {}  # name -> module, from the `if TYPE_CHECKING:` block
    for node in tree.body:
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            for imp in node.body:
                assert isinstance(imp, ast.ImportFrom) and imp.module is not None
                seen.update({a.name: imp.module for a in imp.names})
    assert sorted(seen) == sorted(gpukv.__all__) == sorted(gpukv._MODULE_OF)
    assert seen == {name: f"gpukv.{module}" for name, module in gpukv._MODULE_OF.items()}
    assert len(set(gpukv.__all__)) == len(gpukv.__all__)


def test_dir_lists_the_public_names_and_not_the_packages_own_imports():
    import gpukv

    listed = {n for n in dir(gpukv) if not n.startswith("__")}
    assert not listed & {"Any", "TYPE_CHECKING", "annotations", "importlib"}
    assert not [n for n in listed if n.startswith("_")]
    # Every public name and submodule, and nothing else but submodules loaded since.
    submodules = {"core", "device", "errors", "events", "kernels", "reference", "sizing"}
    assert set(gpukv.__all__) | submodules <= listed
    others = listed - set(gpukv.__all__) - submodules
    assert others and all(type(getattr(gpukv, n)).__name__ == "module" for n in others), others  # tools, at least
    assert "__version__" in dir(gpukv)


def _imports_at_import_time(body: list) -> list[tuple[int, list[str]]]:
    """(line, modules) of each import a module runs when imported: its top
    level and the blocks there (try, if), not functions or TYPE_CHECKING."""
    import ast

    found = []
    for node in body:
        if isinstance(node, ast.Import):
            found.append((node.lineno, [a.name for a in node.names]))
        elif isinstance(node, ast.ImportFrom):
            found.append((node.lineno, [node.module or ""] + [f"{node.module}.{a.name}" for a in node.names]))
        elif isinstance(node, ast.If) and not (isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"):
            found += _imports_at_import_time(node.body) + _imports_at_import_time(node.orelse)
        elif isinstance(node, ast.Try):
            found += _imports_at_import_time(node.body + node.orelse + node.finalbody)
            for handler in node.handlers:
                found += _imports_at_import_time(handler.body)
    return sorted(found)


def test_every_module_that_imports_triton_imports_the_runtime_first():
    """What keeps Triton's interpreter on without CUDA now that `import gpukv`
    does not import gpukv._runtime: each module that imports triton (or vLLM,
    which imports it) imports gpukv._runtime before, itself or in its package's
    __init__ (which Python runs first)."""
    import ast

    def first(path, wanted) -> int | None:
        for lineno, names in _imports_at_import_time(ast.parse(path.read_text()).body):
            if any(wanted(n) for n in names):
                return lineno
        return None

    def is_runtime(name: str) -> bool:
        return name == "gpukv._runtime"

    def loads_triton(name: str) -> bool:
        return name.split(".")[0] in ("triton", "vllm")

    checked = 0
    package = ROOT / "gpukv"
    for path in sorted(package.rglob("*.py")):
        triton_at = first(path, loads_triton)
        if triton_at is None:
            continue
        checked += 1
        runtime_at = first(path, is_runtime)
        # The packages below gpukv/ that hold it (gpukv/vllm/ for gpukv/vllm/v0_8/scheduler.py), its own aside.
        inits = [d / "__init__.py" for d in path.parents if package in d.parents and d / "__init__.py" != path]
        before = (runtime_at is not None and runtime_at < triton_at) or any(
            first(init, is_runtime) is not None for init in inits)
        assert before, f"{path.relative_to(ROOT)}:{triton_at}: triton (or vLLM) before gpukv._runtime"
    assert checked >= 10  # the kernels and gpukv.vllm


_VERSION_AND_HELP = """
import contextlib, io, sys
from gpukv.tools.cli import main
for argv in (["--version"], ["replay", "--help"], ["sweep", "--help"]):
    with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):
        main(argv)
print("torch" in sys.modules, "triton" in sys.modules)
"""


def test_version_and_help_import_no_torch():
    proc = subprocess.run([sys.executable, "-c", _VERSION_AND_HELP], capture_output=True, text=True, env=_env(),
                          cwd=ROOT, timeout=300)
    assert (proc.returncode, proc.stdout, proc.stderr) == (0, "False False\n", "")


# ------------------------------------------------ what the summary says, and how much

def test_the_default_replay_arrives_by_timestamp_and_shows_its_ceiling(capsys):
    status, out, err = run_cli(["--max-requests", "3", "--prompt-only", "--json", "-"], capsys)
    assert status == 0, err
    report = json.loads(out)
    assert (report["arguments"]["arrival"], report["arguments"]["step_ms"]) == ("timestamp", 40.0)
    assert report["config"]["max_num_seqs"] == 64
    s = report["summary"]
    assert s["prefix_cache_hit_rate_ceiling"] == s["prefix_cache_hit_rate"] == 1024 / 21316  # nothing evicted
    assert "token_hit_rate" not in s  # one rate is the prefix cache hit rate; the others have other names
    assert len(report["prefix_cache_hit_rate_per_step"]) == s["steps"]
    assert re.search(r"prefix cache hit rate +0\.0480 of a possible 0\.0480  \(vLLM's: 1,024 of 21,316 tokens", err)
    assert "arrivals by timestamp, 40 ms a step" in err
    assert re.search(r"pool pressure +never oversubscribed: the running requests needed up to", err)
    assert re.search(r"recomputation +none: no request was preempted", err)


def test_a_step_trace_has_no_arrival_and_no_ceiling(tmp_path, capsys):
    status, out, err = run_cli([write(tmp_path, "steps.json", doc_text()), "--json", "-"], capsys)
    assert status == 0, err
    report = json.loads(out)
    assert report["arguments"]["arrival"] is None and report["summary"]["prefix_cache_hit_rate_ceiling"] is None
    assert re.search(r"prefix cache hit rate +[0-9.]+  \(vLLM's", err) and "of a possible" not in err


def test_an_oversubscribed_pool_says_so_and_what_preemptions_cost(capsys):
    trace = load_trace(cli.builtin_trace_path(), max_requests=16)
    for r in trace.requests:
        r.output_length = min(r.output_length, 16)
    report = Replay(trace, ReplayOptions(num_blocks=2500, hash_key=bytes(16))).run()
    report["arguments"] = {"arrival": "back-to-back", "step_ms": 40.0}
    cli._print_summary(report)
    out = capsys.readouterr().out
    s = report["summary"]
    assert re.search(rf"pool pressure +OVERSUBSCRIBED: the running requests needed up to "
                     rf"{s['peak_demand_over_pool']:.2f}x the pool .*, so {s['preemptions']:,} preemptions .*"
                     r"--arrival timestamp lets requests come as they came", out)
    share = s["recomputed_tokens"] / s["computed_tokens"]
    assert re.search(rf"recomputation +{s['recomputed_tokens']:,} of the {s['computed_tokens']:,} tokens computed "
                     rf"\({share:.0%}\) were computed again after {s['preemptions']:,} preemptions", out)


def _mixed(tmp_path) -> str:
    """Two requests of 600 tokens and, between them, one of 1000 that shares their first block."""
    return write(tmp_path, "mixed.jsonl", line() + "\n" + line(timestamp=10, input_length=1000) + "\n"
                 + line(timestamp=20, hash_ids=[1, 3]) + "\n")


REJECTED_LINE = ("gpukv replay: 1 of 3 requests were rejected (the notes and --json say why), so the prefix cache hit "
                 "rate covers only the requests served; a larger --num-blocks or --max-model-len serves them, and "
                 "--allow-rejected exits 0\n")


def test_a_replay_that_rejected_requests_says_its_rate_is_not_comparable_and_exits_3(tmp_path, capsys):
    # A pool of 50 blocks cannot hold the 1000-token request: the rate covers
    # the two served, the ceiling all three (the third would have hit).
    path, report = _mixed(tmp_path), tmp_path / "report.json"
    status, out, err = run_cli([path, "--prompt-only", "--num-blocks", "50", "--json", str(report), "-q"], capsys)
    assert status == cli.EXIT_REJECTED == 3
    assert err == REJECTED_LINE
    assert ("prefix cache hit rate  0.4267, NOT COMPARABLE: 1 of 3 requests were rejected, so it covers the 2 served, "
            "and the possible 0.5018 all 3  (vLLM's: 512 of 1,200 tokens looked up in 2 lookups,") in out
    assert " of a possible" not in out
    s = json.loads(report.read_text())["summary"]  # the report is out all the same
    assert (s["rejected"], s["prefix_cache_hit_rate_ceiling_requests"]) == (1, 3)
    status, out, err = run_cli([path, "--prompt-only", "--num-blocks", "50", "-q", "--allow-rejected"], capsys)
    assert (status, err) == (0, "") and "NOT COMPARABLE: 1 of 3 requests were rejected" in out


def test_requests_too_long_for_max_model_len_are_in_neither_rate(tmp_path, capsys):
    # The ceiling leaves out what max_model_len rejects: both cover the same two requests.
    status, out, err = run_cli([_mixed(tmp_path), "--prompt-only", "--max-model-len", "800", "-q"], capsys)
    assert (status, err) == (3, REJECTED_LINE)
    assert ("prefix cache hit rate  0.4267 of a possible 0.4267, both over the 2 requests served (1 of 3 requests "
            "were rejected)  (vLLM's:") in out


def test_a_rate_above_its_ceiling_says_why():
    s = {"prefix_cache_hit_rate": 0.2, "prefix_cache_hit_rate_ceiling": 0.1,
         "prefix_cache_hit_rate_ceiling_requests": 4, "requests": 4, "rejected": 0, "hits": 10,
         "queries": 50, "lookup_requests": 9}
    assert cli._headline(s).startswith("0.2000 of a possible 0.1000, above it as vLLM counts every try of a request "
                                       "waiting for room (9 lookups of 4 requests) and the possible rate each "
                                       "request once  (vLLM's: 10 of 50 tokens looked up in 9 lookups,")


def test_interpreted_kernel_times_are_labelled_as_such(tmp_path, capsys):
    from gpukv import _runtime

    if _runtime.CUDA_AVAILABLE or not cli._triton_installed():
        pytest.skip("needs Triton's interpreter: a machine without CUDA, with Triton")
    status, out, err = run_cli([write(tmp_path, "steps.json", doc_text()), "--backend", "device", "--no-compare",
                                "--json", "-"], capsys)
    assert status == 0, err
    assert json.loads(out)["config"]["interpreted"] is True
    assert re.search(r"manager time/step +mean .* \(INTERPRETED: Triton's interpreter on the CPU", err)
    assert re.search(r"backend +device \(Triton kernels under the interpreter", err)


def test_quiet_leaves_results_and_errors(tmp_path, capsys):
    status = main(["replay", "--max-requests", "2", "--prompt-only", "--backend", "auto", "-q"])
    out, err = capsys.readouterr()
    assert status == 0 and err == "" and "prefix cache hit rate" in out
    status = main(["sweep", "--max-requests", "3", "--prompt-only", "--num-blocks", "200", "--block-size", "64",
                   "--jobs", "1", "--quiet"])
    out, err = capsys.readouterr()
    assert status == 0 and err == "" and "(ceiling)" in out
    status, out, err = run_cli(["-q", str(tmp_path / "missing.jsonl")], capsys)
    assert_one_line_error(status, err, "no such file")
    with pytest.raises(SystemExit):
        main(["replay", "-q", "-v"])
    assert "not allowed with argument" in capsys.readouterr().err


def test_verbose_shows_every_note(tmp_path, capsys):
    path = write(tmp_path, "long.jsonl", "".join(line(input_length=1000, hash_ids=[1, 2]) + "\n" for _ in range(12)))
    status, out, err = run_cli([path, "--max-model-len", "500", "--allow-rejected"], capsys)
    assert status == 0 and err.count("rejected: prompt of 1000 tokens") == 10
    assert "note: ... and 2 more (--verbose shows them, --json keeps them)" in err
    status, out, err = run_cli([path, "--max-model-len", "500", "--verbose", "--allow-rejected"], capsys)
    assert status == 0 and err.count("rejected: prompt of 1000 tokens") == 12 and "more" not in err


@pytest.mark.parametrize("command", ["replay", "sweep"])
def test_an_unknown_option_names_the_command_it_was_given_to(command, capsys):
    with pytest.raises(SystemExit) as info:
        main([command, "--quietly"])
    assert info.value.code == 2
    assert capsys.readouterr().err == (f"gpukv {command}: unrecognized arguments: --quietly "
                                       f"(see 'gpukv {command} --help')\n")


MOONCAKE_LINES = line() + "\n" + line(hash_ids=[1, 3]) + "\n"
WRONG_FORMAT = {
    # name: (file name, text, options, words the one line must hold)
    "mooncake read as step": ("t.jsonl", MOONCAKE_LINES, ["--format", "step"],
                              ["not JSON", "looks like a mooncake trace, read as step: pass --format mooncake"]),
    "mooncake named .json": ("t.json", MOONCAKE_LINES, [],
                             ["looks like a mooncake trace, read as step (by its extension): pass --format mooncake"]),
    "step named .jsonl": ("t.jsonl", doc_text(), [],
                          ["looks like a step trace, read as mooncake (by its extension): pass --format step"]),
    "a JSON array of records": ("t.json", json.dumps([REC, REC]), [],
                                ["a JSON array of Mooncake records", "jq -c '.[]'", "> trace.jsonl"]),
    "neither": ("t.csv", "a,b\n1,2\n", [], ["not JSON", "gpukv reads two formats (docs/traces.md): mooncake"]),
}


@pytest.mark.parametrize("case", WRONG_FORMAT, ids=list(WRONG_FORMAT))
def test_a_trace_in_the_wrong_format_says_which_formats_there_are(case, tmp_path, capsys):
    name, text, options, words = WRONG_FORMAT[case]
    status, out, err = run_cli([write(tmp_path, name, text), *options], capsys)
    assert_one_line_error(status, err, *words)


def test_a_problem_in_the_right_format_gets_no_format_hint(tmp_path, capsys):
    status, out, err = run_cli([write(tmp_path, "t.jsonl", line() + "\n" + line(input_length=-1) + "\n")], capsys)
    assert "input_length" in assert_one_line_error(status, err) and "formats" not in err


# ------------------------------------------------------------ integer limits

# Every integer option of both commands and its range: a value
# outside it is a usage error, exit 2, whose one line names the option and the
# range. An option added without a range fails the first test below.
INT_LIMITS = {
    ("replay", "--block-size"): (1, 65536, "tokens per block"),
    ("replay", "--num-blocks"): (2, 2**29, "blocks, the null block included"),
    ("replay", "--max-model-len"): (1, 2**31 - 1, "tokens"),
    ("replay", "--max-num-seqs"): (1, 2**30 - 1, "requests"),
    ("replay", "--max-num-batched-tokens"): (0, 2**31 - 1, "tokens; 0 or 'unlimited': no budget"),
    ("replay", "--long-prefill-token-threshold"): (0, 2**31 - 1, "tokens; 0: no cap"),
    ("replay", "--max-requests"): (1, 2**31 - 1, "requests"),
    ("replay", "--max-steps"): (1, 2**31 - 1, "steps"),
    ("replay", "--metrics-port"): (0, 65535, "a TCP port; 0: any free one"),
    ("sweep", "--num-blocks"): (2, 2**29, "blocks, the null block included"),
    ("sweep", "--tokens"): (1, 2**31 - 1, "tokens"),
    ("sweep", "--layers"): (1, 4096, "layers"),
    ("sweep", "--kv-heads"): (1, 65536, "heads"),
    ("sweep", "--head-size"): (1, 65536, None),
    ("sweep", "--block-size"): (1, 65536, "tokens per block"),
    ("sweep", "--max-requests"): (1, 2**31 - 1, "requests"),
    ("sweep", "--max-num-batched-tokens"): (0, 2**31 - 1, "tokens; 0 or 'unlimited': no budget"),
    ("sweep", "--max-num-seqs"): (1, 2**30 - 1, "requests"),
    ("sweep", "--max-model-len"): (1, 2**31 - 1, "tokens"),
    ("sweep", "--jobs"): (1, 2**31 - 1, "processes; never more than the sizes"),
}
# The options that take a number that is not an integer (their own checks: test_bad_option_is_one_error_line).
FLOAT_OPTIONS = {("replay", "--step-ms"), ("replay", "--metrics-linger"), ("sweep", "--step-ms"), ("sweep", "--gib")}


def _typed_options() -> dict[tuple[str, str], object]:
    """(command, option) -> the parser of each value, for every option of both commands that has one."""
    import argparse

    parser = cli.build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return {(command, action.option_strings[-1]): getattr(action.type, "item", action.type)
            for command, p in sub.choices.items() for action in p._actions
            if action.type is not None and action.option_strings}


def test_every_integer_option_has_a_range():
    typed = _typed_options()
    assert typed.keys() == INT_LIMITS.keys() | FLOAT_OPTIONS
    for key, (low, high, _) in INT_LIMITS.items():
        assert typed[key].allowed == (low, high), key
    from gpukv.core.limits import MAX_NUM_BLOCKS as MANAGERS_LIMIT
    from gpukv.tools.defaults import MAX_NUM_BLOCKS
    from gpukv.tools.traces import MAX_SIZE

    assert MAX_NUM_BLOCKS == MANAGERS_LIMIT == 2**29 and MAX_SIZE == 2**31 - 1  # the managers' own limits


@pytest.mark.parametrize("command, option", sorted(INT_LIMITS), ids=lambda x: x)
def test_an_integer_option_takes_its_range_and_refuses_the_rest(command, option, capsys):
    low, high, what = INT_LIMITS[(command, option)]
    parse = _typed_options()[(command, option)]
    assert (parse(str(low)), parse(f" {high} ")) == (low, high)
    allowed = f"from {low} to {high}" + (f" ({what})" if what else "")
    for bad in (low - 1, high + 1, 2**63):
        with pytest.raises(SystemExit) as info:
            main([command, option, str(bad)])
        assert info.value.code == 2
        out, err = capsys.readouterr()
        assert (out, err) == ("", f"gpukv {command}: argument {option}: must be an integer {allowed}, got {bad} "
                                  f"(see 'gpukv {command} --help')\n")


def _two_requests(tmp_path) -> str:
    return write(tmp_path, "two.jsonl", line() + "\n" + line(timestamp=40, hash_ids=[1, 3]) + "\n")


@pytest.mark.parametrize("option", ["--block-size", "--max-model-len", "--max-num-seqs", "--max-num-batched-tokens",
                                    "--long-prefill-token-threshold", "--max-requests", "--max-steps"])
def test_the_largest_value_of_an_option_replays(option, tmp_path, capsys):
    # Each at its maximum runs to the end (the ranges are what the replay can
    # take, not just what parses); --num-blocks' largest is left to the
    # managers' memory check, which a machine with 320 GiB free would pass.
    status, out, err = run_cli([_two_requests(tmp_path), "--prompt-only", option, str(INT_LIMITS["replay", option][1])],
                               capsys)
    assert status == 0, err
    assert "trace                  mooncake, 2 requests (2 finished, 0 rejected)" in out


@pytest.mark.parametrize("argv, message", [
    (["--tokens", "10"], "--tokens 10: less than one block of 16 tokens; give at least 16 (a size holds whole blocks)"),
    (["--tokens", str(2**31 - 1), "--block-size", "1"],
     "--tokens: a pool of 2,147,483,648 blocks of 1 tokens; a pool has from 2 to 536870912 blocks, the null block "
     "included (at most 536870911 tokens of 1-token blocks)"),
    (["--gib", "1e7"], "--gib: a pool of 5,120,000,000 blocks of 16 tokens; a pool has from 2 to 536870912 blocks, "
                       "the null block included (at most 8589934576 tokens of 16-token blocks)"),
])
def test_a_sweep_size_no_pool_can_have_is_one_error_line(argv, message, capsys):
    with pytest.raises(SystemExit) as info:
        main(["sweep", "--max-requests", "1", "-q", *argv])
    assert info.value.code == 2
    assert capsys.readouterr() == ("", f"gpukv sweep: {message}\n")


@pytest.mark.parametrize("option", ["--num-blocks", "--tokens", "--gib"])
@pytest.mark.parametrize("text", ["4096,,8192", "4096,8192,", ",4096", "4096, ,8192", ",", " "])
def test_a_sweep_list_with_an_empty_item_is_one_error_line(option, text, capsys):
    with pytest.raises(SystemExit) as info:
        main(["sweep", "--max-requests", "1", "-q", option, text])
    assert info.value.code == 2
    assert capsys.readouterr() == ("", f"gpukv sweep: argument {option}: expected a comma-separated list of values "
                                       f"with nothing empty between the commas (such as 4096,8192), got {text!r} "
                                       "(see 'gpukv sweep --help')\n")


def test_a_step_trace_given_to_sweep_names_the_command_that_replays_it(tmp_path, capsys):
    path = write(tmp_path, "steps.json", doc_text())
    with pytest.raises(SystemExit) as info:
        main(["sweep", "-q", path])
    out, err = capsys.readouterr()
    assert (info.value.code, out) == (2, "")
    assert err.endswith(f"; this file looks like a step trace, and gpukv sweep replays Mooncake traces only: gpukv "
                        f"replay {path} replays a step trace, at one size\n"), err
    assert "--format" not in err  # sweep has no such option


def test_a_sweep_size_the_manager_refuses_is_one_error_line(capsys, monkeypatch):
    import pickle

    from gpukv.errors import CapacityError
    from gpukv.tools import replay, sweep

    def refuse(_opts):
        raise CapacityError("the reference pool needs about 320.00 GiB on the host", argument="num_blocks",
                            fix="lower num_blocks")

    monkeypatch.setattr(replay, "make_manager", refuse)
    with pytest.raises(SystemExit) as info:
        main(["sweep", "--max-requests", "1", "-q", "--num-blocks", str(2**29), "--jobs", "1"])
    assert info.value.code == 2
    assert capsys.readouterr() == ("", "gpukv sweep: the reference manager refused a pool of 536,870,912 blocks: "
                                       "num_blocks: the reference pool needs about 320.00 GiB on the host; lower "
                                       "num_blocks; ask for smaller sizes\n")
    # From a worker process it comes back whole (the managers' errors would lose their keyword arguments).
    refused = pickle.loads(pickle.dumps(sweep.SizeRefused("536,870,912 blocks: too big")))
    assert isinstance(refused, ValueError) and str(refused) == "536,870,912 blocks: too big"


def test_the_largest_sweep_values_run(capsys):
    assert main(["sweep", "--max-requests", "2", "--prompt-only", "-q", "--tokens", str(2**31 - 1), "--block-size",
                 "65536", "--jobs", str(2**31 - 1), "--max-num-seqs", str(2**30 - 1)]) == 0
    rows = [x.split()[:3] for x in capsys.readouterr().out.splitlines()[1:3]]
    # The ceiling (2 blocks of 65,536 tokens and the null block) above the larger size (32,767 blocks and the
    # null block): the table in order of size.
    assert rows == [["131,072", "(ceiling)", "3"], ["2,147,418,112", "32,768", "0.0000"]]


# ---------------------------------------------------------- metrics linger

def test_metrics_linger_keeps_the_endpoint_serving_after_the_report(capsys, monkeypatch):
    pytest.importorskip("prometheus_client")
    import urllib.request

    seen = {}

    def linger(seconds):  # instead of sleeping: what a scraper finds while the command lingers
        out, err = capsys.readouterr()
        port = re.search(r"http://127\.0\.0\.1:(\d+)/metrics", err)[1]
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
            seen.update(seconds=seconds, out=out, err=err, page=r.read().decode())

    monkeypatch.setattr(cli, "_sleep", linger)
    status = main(["replay", "--backend", "reference", "--no-progress", "--max-requests", "3", "--prompt-only",
                   "--metrics-port", "0", "--metrics-linger", "2.5", "--json", "-"])
    assert status == 0 and seen["seconds"] == 2.5
    summary = json.loads(seen["out"].splitlines()[0])["summary"]  # the report was out before the linger
    assert seen["err"].endswith("note: the replay is over; serving its final metrics 2.5 s longer (--metrics-linger; "
                                "Ctrl-C stops)\n")
    queries = re.search(r'^vllm:prefix_cache_queries_total\{[^}]*\} (\S+)$', seen["page"], re.M)
    assert float(queries[1]) == summary["queries"] > 0  # the final values


def test_ctrl_c_while_lingering_ends_it_with_status_0(capsys, monkeypatch):
    pytest.importorskip("prometheus_client")

    def interrupted(_seconds):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "_sleep", interrupted)
    assert main(["replay", "--backend", "reference", "--no-progress", "--max-requests", "1", "--prompt-only",
                 "--metrics-port", "0", "--metrics-linger", "30"]) == 0
    assert capsys.readouterr().err.endswith("note: stopped serving the metrics\n")


def test_no_linger_no_wait(capsys, monkeypatch):
    pytest.importorskip("prometheus_client")
    monkeypatch.setattr(cli, "_sleep", lambda _seconds: pytest.fail("lingered without --metrics-linger"))
    assert main(["replay", "--backend", "reference", "--no-progress", "--max-requests", "1", "--prompt-only",
                 "--metrics-port", "0"]) == 0
    assert "--metrics-linger" not in capsys.readouterr().err
