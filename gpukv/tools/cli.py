"""The ``gpukv`` command line: ``gpukv replay [TRACE]``.

Exit status: 0 done; 2 a bad trace, option, environment variable or output
path (one line on stderr, ``gpukv replay: FILE:LINE: problem`` for a trace,
checked before the replay starts wherever it can be); 3 the replay ran and its
report is out, but it rejected requests, so its hit rate covers fewer requests
than its ceiling (``--allow-rejected`` makes that 0); 1 an internal error (one
line; ``GPUKV_DEBUG=1`` shows the traceback); 130 interrupted (Ctrl-C); 141 the
reader of stdout went away (``gpukv replay | head``).

Results (the summary, ``--json -``) go to stdout; notes, progress and errors to
stderr. With ``--json -`` the JSON report alone is on stdout and the human
summary moves to stderr.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib.metadata
import importlib.util
import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

# Nothing here imports torch: parsing the options, --version and --help stay
# quick, and --metrics-port serves before torch loads. The replay
# (gpukv.tools.replay, gpukv._runtime: torch) is imported where it runs.
from gpukv.core import hashing
from gpukv.errors import GpukvError
from gpukv.tools import plot
from gpukv.tools.defaults import (
    DEFAULT_ARRIVAL,
    DEFAULT_BLOCK_SIZE,
    DEFAULT_MAX_NUM_BATCHED_TOKENS,
    DEFAULT_MAX_NUM_SEQS,
    DEFAULT_NUM_BLOCKS,
    DEFAULT_STEP_MS,
    MAX_BLOCK_SIZE,
    MAX_LINGER_S,
    MAX_NUM_BLOCKS,
    PLAIN_INTERVAL_S,
)
from gpukv.tools.traces import (
    DECOMPRESS_ERRORS,
    MAX_SIZE,
    Trace,
    TraceError,
    builtin_trace_path,
    load_trace,
    open_trace,
    trace_suffix,
)

if TYPE_CHECKING:
    from gpukv.tools.replay import ReplayOptions

BUILTIN_REQUESTS = 300
PROG = "gpukv"

# Defaults of the sizes a step trace's config may set instead.
DEFAULT_SIZES = {"block_size": DEFAULT_BLOCK_SIZE, "num_blocks": DEFAULT_NUM_BLOCKS, "max_model_len": 131_072}

# How much goes to stderr besides results and errors: -1 --quiet (nothing),
# 0 notes, warnings and progress, 1 --verbose (every note). Set by main().
_verbosity = 0
# When main() began: the process's age where /proc cannot tell it.
_main_started = time.perf_counter()

EXIT_USAGE = 2
EXIT_INTERNAL = 1
EXIT_REJECTED = 3  # the report is out, but its rate covers fewer requests than the trace
EXIT_INTERRUPTED = 130
EXIT_BROKEN_PIPE = 141  # 128 + SIGPIPE, what a shell reports for `cat` in the same spot


class CliError(Exception):
    """A problem with what the user handed in: one line, exit status 2."""

    def __init__(self, message: str, status: int = EXIT_USAGE, prog: str | None = None) -> None:
        super().__init__(" ".join(str(message).split()))
        self.status, self.prog = status, prog


def version() -> str:
    """The installed distribution's version, else ``gpukv.__version__``."""
    try:
        return importlib.metadata.version("gpukv")
    except importlib.metadata.PackageNotFoundError:
        import gpukv

        return str(getattr(gpukv, "__version__", "unknown"))


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows each option's default, except where there is none to show (None,
    a plain flag) or the help already says it."""

    def _get_help_string(self, action):
        text = action.help or ""
        if action.default is None or action.default is False or "default" in text:
            return text
        return super()._get_help_string(action)


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (no usage block) and exit 2."""

    def error(self, message: str):  # noqa: D102
        raise CliError(f"{message} (see '{self.prog} --help')", prog=self.prog)


def _short(text: str, limit: int = 40, quote: bool = True) -> str:
    """``text`` as the user typed it, cut for an error message (quoted, unless it is a number)."""
    shown = repr if quote else str
    return shown(text) if len(text) <= limit else shown(text[:limit]) + f"... ({len(text)} characters)"


def _int_option(minimum: int, maximum: int, what: str = ""):
    """An option's parser: an integer in ``[minimum, maximum]``, else a
    message that names the range (and, in ``what``, what it counts); argparse
    prefixes the option's name, and the parser exits 2."""
    allowed = f"from {minimum} to {maximum}{f' ({what})' if what else ''}"

    def parse(text: str) -> int:
        try:
            value = int(text.strip(), 10)
        except ValueError:  # not an integer, or one of thousands of digits
            raise argparse.ArgumentTypeError(f"expected an integer {allowed}, got {_short(text)}") from None
        if not minimum <= value <= maximum:
            raise argparse.ArgumentTypeError(f"must be an integer {allowed}, got {_short(text.strip(), quote=False)}")
        return value

    parse.allowed = (minimum, maximum)  # type: ignore[attr-defined]  # read by the tests: every int option has a range
    return parse


def _float_option(unit: str, minimum: float = 0.0, maximum: float = math.inf, zero: bool = False):
    """An option's parser for a finite number of ``unit`` above ``minimum``
    (or equal to it, with ``zero``) and at most ``maximum``."""
    low = f">= {minimum:g}" if zero else f"> {minimum:g}"
    allowed = f"{low} and finite" if maximum == math.inf else f"{low} and <= {maximum:g}"

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number of {unit}, got {_short(text)}") from None
        above = value >= minimum if zero else value > minimum
        if not (above and value <= maximum and math.isfinite(value)):
            raise argparse.ArgumentTypeError(f"must be a number of {unit} {allowed}, got "
                                             f"{_short(text.strip(), quote=False)}")
        return value

    return parse


_ms_option = _float_option("milliseconds")
_gib_option = _float_option("GiB")
_linger_option = _float_option("seconds", maximum=MAX_LINGER_S, zero=True)

# The integer options' ranges, shared by both commands (MAX_SIZE: int32 on the device).
_block_size_option = _int_option(1, MAX_BLOCK_SIZE, "tokens per block")
_num_blocks_option = _int_option(2, MAX_NUM_BLOCKS, "blocks, the null block included")
_model_len_option = _int_option(1, MAX_SIZE, "tokens")
_requests_option = _int_option(1, MAX_SIZE, "requests")
# The device manager keeps two request rows per running request (int32 row ids).
_num_seqs_option = _int_option(1, MAX_SIZE // 2, "requests")


# Words --max-num-batched-tokens takes for "no budget" (as does 0).
UNLIMITED_WORDS = ("unlimited", "none", "off")


def _budget_option(text: str) -> int:
    """A token budget: a positive int, or 0 / ``unlimited`` (also ``none``,
    ``off``) for no budget, returned as 0."""
    word = text.strip().lower()
    if word in UNLIMITED_WORDS:
        return 0
    try:
        value = int(word, 10)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of tokens, or 0 or 'unlimited' for no budget, "
                                         f"got {text!r}") from None
    if not 0 <= value <= MAX_SIZE:
        raise argparse.ArgumentTypeError(f"must be an integer from 0 to {MAX_SIZE} (tokens; 0 or 'unlimited': no "
                                         f"budget), got {_short(text.strip(), quote=False)}")
    return value


_budget_option.allowed = (0, MAX_SIZE)  # type: ignore[attr-defined]


def _list_option(parse_one):
    """A comma-separated list of values, each parsed by ``parse_one``."""
    def parse(text: str) -> list:
        items = text.split(",")
        if not text.strip() or any(not t.strip() for t in items):
            # '4,,8' or '4,8,' is a slip of the keyboard: refuse it rather than guess.
            raise argparse.ArgumentTypeError(f"expected a comma-separated list of values with nothing empty "
                                             f"between the commas (such as 4096,8192), got {_short(text)}")
        return [parse_one(t) for t in items]

    parse.item = parse_one  # type: ignore[attr-defined]  # the tests read each item's range through it
    return parse


def _sweep_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "sweep", formatter_class=_HelpFormatter,
        help="replay one trace at several cache sizes and report the hit rate against capacity",
        description="Replay a Mooncake trace (default: the built-in workload) at several KV-cache sizes, in "
        "parallel processes on the reference manager, and report each size's prefix cache hit rate beside the "
        "ceiling (a cache that never evicts, from one pass over the trace). Sizes in blocks, tokens, or GiB for a "
        "model (--layers, --kv-heads, --head-size, --dtype); with none, four sizes halving down from the ceiling. "
        "A size that cannot hold --max-model-len or rejects requests is flagged: its hit rate is not comparable.",
    )
    p.add_argument("trace", nargs="?", help="a Mooncake .jsonl (default: built-in workload)")
    sizes = p.add_mutually_exclusive_group()
    sizes.add_argument("--num-blocks", type=_list_option(_num_blocks_option), metavar="N,N,...",
                       help="pool sizes in blocks, the null block included (N blocks hold N - 1 blocks of tokens)")
    sizes.add_argument("--tokens", type=_list_option(_model_len_option), metavar="T,T,...",
                       help="pool sizes in tokens, whole blocks (T tokens: T // block size blocks and the null block)")
    sizes.add_argument("--gib", type=_list_option(_gib_option), metavar="G,G,...",
                       help="pool sizes in GiB of KV cache for the model given by --layers etc.")
    # Far past any model's (the largest have about 128 layers): --gib's sizing
    # describes every layer, so a billion of them would run for minutes.
    p.add_argument("--layers", type=_int_option(1, 4096, "layers"), default=32, help="model layers (with --gib)")
    p.add_argument("--kv-heads", type=_int_option(1, 65536, "heads"), default=8,
                   help="KV heads per layer (with --gib)")
    p.add_argument("--head-size", type=_int_option(1, 65536), default=128, help="head size (with --gib)")
    p.add_argument("--dtype", choices=["float16", "bfloat16", "float32", "float8_e4m3fn"], default="bfloat16",
                   help="KV-cache dtype (with --gib)")
    p.add_argument("--block-size", type=_block_size_option, default=DEFAULT_BLOCK_SIZE, help="tokens per block")
    p.add_argument("--max-requests", type=_requests_option, default=None,
                   help=f"replay only the first N requests (default: all; {BUILTIN_REQUESTS} for the built-in "
                   "workload)")
    p.add_argument("--max-num-batched-tokens", type=_budget_option, default=DEFAULT_MAX_NUM_BATCHED_TOKENS,
                   metavar="N", help="the token budget per step (0 or 'unlimited': none)")
    p.add_argument("--max-num-seqs", type=_num_seqs_option, default=DEFAULT_MAX_NUM_SEQS,
                   help="most requests running at once")
    p.add_argument("--max-model-len", type=_model_len_option, default=DEFAULT_SIZES["max_model_len"],
                   help="longest request in tokens; a size that cannot hold one is flagged")
    p.add_argument("--prompt-only", action="store_true", help="each request finishes right after its prefill")
    _add_arrival_options(p)
    p.add_argument("--jobs", type=_int_option(1, MAX_SIZE, "processes; never more than the sizes"),
                   default=os.cpu_count() or 1,
                   help="replays run at once, one process each")
    p.add_argument("--json", metavar="OUT", help="write the points as JSON")
    p.add_argument("--plot", metavar="OUT.png",
                   help="draw hit rate against capacity (.png, .svg or .pdf; needs the 'plot' extra)")
    _add_verbosity_options(p, "a bar per size")
    return p


def sweep_main(args) -> int:
    from gpukv.tools import sweep
    from gpukv.tools.replay import ReplayOptions

    path, label = args.trace, args.trace
    max_requests = args.max_requests
    if path is None:
        path, label = str(builtin_trace_path()), "built-in workload"
        max_requests = max_requests or BUILTIN_REQUESTS
    outputs = {opt: _check_output(v, opt, args.trace) for opt, v in (("--json", args.json), ("--plot", args.plot))
               if v is not None}
    if "--plot" in outputs:
        _check_plot(args.plot)
    args.arrival = args.arrival or DEFAULT_ARRIVAL
    trace = _load_trace_or_fail(path, "mooncake", max_requests, args.arrival, args.step_ms, command="sweep")
    bs = args.block_size
    model = sweep.ModelShape(args.layers, args.kv_heads, args.head_size, args.dtype)
    blocks, unit, capacities = _sweep_sizes(args, trace, model)
    opts = ReplayOptions(block_size=bs, max_num_seqs=args.max_num_seqs, prompt_only=args.prompt_only,
                         max_model_len=args.max_model_len, max_num_batched_tokens=args.max_num_batched_tokens or None,
                         hash_key=_hash_key())
    shown = ([sweep.capacity_text(c, unit) for c in capacities] if capacities
             else [sweep.capacity_text(sweep.pool_tokens(n, bs), unit) for n in blocks])
    jobs = min(args.jobs, len(blocks))
    _note(f"{_plural(len(blocks), 'replay')} of {_plural(trace.num_requests, 'request')} ({_arrival_text(args)}), "
          f"{jobs} at a time; the ceiling from one pass over the trace")
    for n, text in zip(blocks, shown, strict=True):
        if not sweep.holds_max_model_len(n, bs, args.max_model_len):
            _warn(f"{text} ({n:,} blocks) cannot hold one request of --max-model-len {args.max_model_len:,} tokens "
                  "(vLLM would refuse to start): longer requests are rejected, and its hit rate is not comparable")

    def finished(i: int, point: dict) -> None:
        if _verbosity > 0:
            _note(f"{shown[i]}: prefix cache hit rate {point['prefix_cache_hit_rate']:.4f}, "
                  f"{_plural(point['preemptions'], 'preemption')}, {point['wall_s']:.1f} s")

    try:
        result = sweep.run_sweep(trace, blocks, opts, jobs=jobs, capacity_unit=unit, capacities=capacities,
                                 trace_label=label, capacity_of=model.gib_of if args.gib is not None else None,
                                 progress=_verbosity >= 0, labels=shown, on_point=finished)
    except sweep.SizeRefused as e:
        raise CliError(f"the reference manager refused a pool of {e}; ask for smaller sizes") from None
    _deliver_sweep(args, result, outputs)
    return 0


def _sweep_sizes(args, trace: Trace, model) -> tuple[list[int], str, list[float] | None]:
    """The pools a sweep replays, in blocks (the null block included), their
    unit and, for GiB, the sizes as given; a size no pool can have is a CliError."""
    from gpukv.tools import sweep

    bs = args.block_size
    unit, capacities = "tokens", None
    if args.num_blocks is not None:
        blocks = list(args.num_blocks)
    elif args.tokens is not None:
        for t in args.tokens:
            if t < bs:
                raise CliError(f"--tokens {t}: less than one block of {bs} tokens; give at least {bs} "
                               f"(a size holds whole blocks)")
        blocks = [t // bs + 1 for t in args.tokens]
    elif args.gib is not None:
        try:
            blocks = [model.blocks_for(g, bs) for g in args.gib]
        except ValueError as e:
            raise CliError(f"--gib: {e}") from None
        unit, capacities = "GiB", list(args.gib)
    else:
        blocks = sweep.default_sizes(trace, bs, max_model_len=args.max_model_len)
    option = next((o for o in ("--num-blocks", "--tokens", "--gib") if getattr(args, o[2:].replace("-", "_"))),
                  "the trace's default sizes")
    for n in blocks:
        if not 2 <= n <= MAX_NUM_BLOCKS:
            most = sweep.pool_tokens(MAX_NUM_BLOCKS, bs)
            raise CliError(f"{option}: a pool of {n:,} blocks of {bs} tokens; a pool has from 2 to {MAX_NUM_BLOCKS} "
                           f"blocks, the null block included (at most {most} tokens of {bs}-token blocks)")
    return blocks, unit, capacities


def _deliver_sweep(args, result: dict, outputs: dict[str, Path]) -> None:
    """A sweep's warnings, files and table."""
    for line in result["warnings"]:
        if "rejected" in line:
            _warn(line)
    result = {"gpukv_version": version(), "arguments": dict(vars(args)), **result}
    if "--json" in outputs:
        _write_atomically(outputs["--json"], json.dumps(result, default=str), "--json")
        _note(f"points written to {args.json}")
    if "--plot" in outputs:
        plot.sweep_figure(result, outputs["--plot"])
        _note(f"plot written to {args.plot}")
    _print_sweep(result)


def _arrival_text(args) -> str:
    if args.arrival == "timestamp":
        return f"arrivals by timestamp, {args.step_ms:g} ms a step"
    return "arrivals back to back"


def _print_sweep(result: dict) -> None:
    unit = result["capacity_unit"]
    print(f"{'capacity (' + unit + ')':>18}  {'blocks':>9}  {'hit rate':>8}  {'first adm.':>10}  {'evictions':>10}  "
          f"{'preempted':>9}  {'recomputed':>10}  {'rejected':>8}")
    # In order of size, the ceiling where it falls (a size may be larger than it).
    rows = sorted([*result["points"], {**result["ceiling"], "label": "ceiling"}],
                  key=lambda p: (p["num_blocks"], "label" in p))
    flagged = False
    for p in rows:
        cap = f"{p['capacity']:,.4g}" if unit == "GiB" else f"{p['capacity']:,}"
        if "label" in p:
            cap += " (ceiling)"
        mark = ""
        if (p["rejected"] and "label" not in p) or not p.get("holds_max_model_len", True):
            mark, flagged = "  !", True
        work = p.get("computed_tokens")
        recomputed = f"{p['recomputed_tokens'] / work:.0%}" if work else "-"
        print(f"{cap:>18}  {p['num_blocks']:>9,}  {p['prefix_cache_hit_rate']:>8.4f}  "
              f"{p['first_admission_hit_rate']:>10.4f}  {p['evictions']:>10,}  {p['preemptions']:>9,}  "
              f"{recomputed:>10}  {p['rejected']:>8,}{mark}")
    print("hit rate: vLLM's prefix cache hit rate (tokens hit over tokens looked up, a preempted request's "
          "returns apart); first adm.: each request's first admission; recomputed: share of the tokens computed "
          "that a preempted request had computed before; ceiling: a cache that never evicts (one pass over the trace); "
          "blocks: the pool, the null block included, so it holds blocks - 1 blocks of tokens")
    if flagged:
        print(f"!: cannot hold max_model_len {result['max_model_len']:,} or rejected requests: served fewer requests, "
              "not comparable with the other sizes")


def _replay_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "replay", formatter_class=_HelpFormatter,
        help="run a serving loop over a trace and report hit rates, evictions, preemptions and manager time",
        description="Replay a trace through the block manager. With no TRACE, replays the built-in workload "
        f"(the first {BUILTIN_REQUESTS} requests of the Mooncake conversation trace). Exit status: 0 done, "
        "2 a bad trace, option or output path (one line on stderr), 3 done but requests were rejected (the hit "
        "rate then covers fewer requests than its ceiling; --allow-rejected: 0), 1 an internal error, "
        "130 interrupted. "
        "Results go to stdout; notes and progress to stderr.",
    )
    p.add_argument("trace", nargs="?", help="a Mooncake .jsonl or a step-trace .json (default: built-in workload)")
    _add_backend_options(p)
    _add_pool_options(p)
    _add_scheduling_options(p)
    _add_workload_options(p)
    _add_output_options(p)
    return p


def _add_backend_options(p: argparse.ArgumentParser) -> None:
    """The trace's format and the manager that replays it."""
    p.add_argument("--format", choices=["auto", "mooncake", "step"], default="auto",
                   help="the trace's format; auto: by its content")
    p.add_argument("--backend", choices=["auto", "device", "reference"], default="auto",
                   help="device: the GPU-resident manager (Triton kernels; on a machine without CUDA they run under "
                   "Triton's interpreter, correct but slow); reference: the sequential spec; auto: device "
                   "when CUDA is available, else reference")
    p.add_argument("--compare", action=argparse.BooleanOptionalAction, default=None,
                   help="also replay on the reference and report whether the results agree "
                   "(default: on when the backend is device)")


def _add_pool_options(p: argparse.ArgumentParser) -> None:
    """The pool's sizes; a step trace's config may set them instead."""
    p.add_argument("--block-size", type=_block_size_option, default=None,
                   help=f"tokens per block (default: {DEFAULT_SIZES['block_size']}; a step trace's config wins)")
    p.add_argument("--num-blocks", type=_num_blocks_option, default=None,
                   help=f"blocks in the pool, the null block included (default: {DEFAULT_SIZES['num_blocks']}; a step "
                   "trace's config wins)")
    p.add_argument("--max-model-len", type=_model_len_option, default=None,
                   help=f"longest request in tokens (default: {DEFAULT_SIZES['max_model_len']}; a step trace's "
                   "config wins)")
    p.add_argument("--max-num-seqs", type=_num_seqs_option, default=DEFAULT_MAX_NUM_SEQS,
                   help=f"most requests running at once (default: {DEFAULT_MAX_NUM_SEQS}: the default pool holds about "
                   "72 of the built-in workload's requests at their full length; vLLM's 1024 suits short chats)")


def _add_scheduling_options(p: argparse.ArgumentParser) -> None:
    """How steps are filled and blocks freed."""
    p.add_argument("--max-num-batched-tokens", type=_budget_option, default=None, metavar="N",
                   help="token budget per step, as vLLM's max_num_batched_tokens: running requests first (a decode "
                   "costs 1, a prefill continues with a chunk), then new requests' first chunks while it lasts; "
                   "0 or 'unlimited': no budget, each prompt computed whole in its admission step (default: "
                   f"{DEFAULT_MAX_NUM_BATCHED_TOKENS}, vLLM 0.8.5's default for its OpenAI server on GPUs with "
                   "at least 70 GiB such as the H100/H200 gpukv targets; it uses 2048 on smaller ones). Mooncake "
                   "traces only: a step trace runs as written")
    p.add_argument("--long-prefill-token-threshold", type=_int_option(0, MAX_SIZE, "tokens; 0: no cap"), default=0,
                   metavar="N",
                   help="most prompt tokens one request computes in a step (default: 0, no cap, as in vLLM). "
                   "Mooncake traces only")
    p.add_argument("--uncached-first", action=argparse.BooleanOptionalAction, default=True,
                   help="free uncached blocks to the front of the free queue, or (--no-uncached-first) all to the back")
    p.add_argument("--admission", choices=["batch", "one"], default="batch",
                   help="vLLM's waiting loop (look each request up, then schedule tokens beyond its hit, charged "
                   "only those) either way: batch, for a step's candidates in one batched step() call; one, one "
                   "get_computed_blocks and allocate_slots per request, as vLLM calls its manager")


def _add_workload_options(p: argparse.ArgumentParser) -> None:
    """How much of the trace runs, and when its requests arrive."""
    p.add_argument("--max-requests", type=_requests_option, default=None,
                   help=f"replay only the first N requests (default: all; {BUILTIN_REQUESTS} for the built-in "
                   "workload)")
    p.add_argument("--max-steps", type=_int_option(1, MAX_SIZE, "steps"), default=None,
                   help="stop after this many steps have run (idle steps skipped under --arrival timestamp do not "
                   "count)")
    p.add_argument("--prompt-only", action="store_true", help="each request finishes right after its prefill")
    p.add_argument("--allow-rejected", action="store_true",
                   help="exit 0 even when the replay rejected requests it can never run (too long for "
                   "--max-model-len, or for the pool); without it such a replay exits 3, as its hit rate then covers "
                   "fewer requests than its ceiling")
    _add_arrival_options(p)


def _add_arrival_options(p: argparse.ArgumentParser) -> None:
    """When a Mooncake trace's requests arrive."""
    p.add_argument("--arrival", choices=["timestamp", "back-to-back"], default=None,
                   help=f"Mooncake arrivals: by the trace's timestamps, as a deployment sees them (steps in which "
                   "nothing runs or waits are skipped), or back-to-back: all waiting from step 0, in order, which "
                   f"oversubscribes any pool smaller than the trace (default: {DEFAULT_ARRIVAL}; a step trace has "
                   "its own steps)")
    p.add_argument("--step-ms", type=_ms_option, default=DEFAULT_STEP_MS,
                   help="with --arrival timestamp: the milliseconds a step stands for (an engine step with a few "
                   "dozen running requests)")


def _add_verbosity_options(p: argparse.ArgumentParser, progress: str) -> None:
    """How much goes to stderr besides the results and errors."""
    group = p.add_mutually_exclusive_group()
    group.add_argument("-q", "--quiet", action="store_true",
                       help=f"results and errors only: no notes, warnings or progress ({progress}) on stderr")
    group.add_argument("-v", "--verbose", action="store_true",
                       help="every note (the report's notes are otherwise cut at ten)")


def _add_output_options(p: argparse.ArgumentParser) -> None:
    """Where the report, the plot, the metrics and the progress go."""
    p.add_argument("--json", metavar="OUT",
                   help="write the full report (summary, per-request records, final state, version, arguments, "
                   "trace and config); '-' writes it to stdout and moves the human summary to stderr")
    p.add_argument("--plot", metavar="OUT.png",
                   help="draw vLLM's prefix cache hit rate so far beside its ceiling, blocks in use against the pool "
                   "and the manager's time per step, over the steps (.png, .svg or .pdf by the extension; needs the "
                   "'plot' extra)")
    p.add_argument("--metrics-port", type=_int_option(0, 65535, "a TCP port; 0: any free one"), default=None,
                   metavar="PORT",
                   help="serve Prometheus metrics at http://127.0.0.1:PORT/metrics from before the trace loads until "
                   "the replay ends, and --metrics-linger seconds longer (vLLM's names and labels, tested with vLLM "
                   "0.33.0; 0 picks a free port; needs the 'metrics' extra)")
    p.add_argument("--metrics-linger", type=_linger_option, default=0, metavar="SECONDS",
                   help="with --metrics-port: keep serving the final metrics this many seconds after the replay ends "
                   f"(at most {MAX_LINGER_S:g}; Ctrl-C stops early), so a scraper that visits every 15 s still sees "
                   "a short replay's totals; 0: the endpoint closes when the replay ends")
    p.add_argument("--served-model-name", default="gpukv", metavar="NAME",
                   help="the metrics' model_name label (vLLM's flag of that name sets it there)")
    p.add_argument("--metrics-vllm085", action="store_true",
                   help="also vLLM 0.8.5's names where they differ: vllm:gpu_prefix_cache_queries / _hits "
                   "(in blocks, as 0.8.5 counted) and vllm:gpu_cache_usage_perc")
    p.add_argument("--no-progress", action="store_true",
                   help="no progress on stderr (a live bar on a terminal, a plain line every "
                   f"{PLAIN_INTERVAL_S:g} s elsewhere)")
    _add_verbosity_options(p, "--no-progress")


def _rate(hits: int, queries: int) -> str:
    return f"{hits / queries:.4f}" if queries else "   n/a"


def _note(message: str) -> None:
    if _verbosity >= 0:
        print(f"note: {message}", file=sys.stderr)


def _warn(message: str) -> None:
    if _verbosity >= 0:
        print(f"warning: {message}", file=sys.stderr)


def _print_summary(report: dict, file=None) -> None:
    file = file if file is not None else sys.stdout
    s = report["summary"]
    c = report["config"]
    steps = _plural(s["steps"], "step")
    if s.get("skipped_idle_steps"):
        steps += f" (and {_plural(s['skipped_idle_steps'], 'idle step')} skipped)"
    arrival = report.get("arguments", {}).get("arrival")
    if c["trace_kind"] == "mooncake" and arrival is not None:
        steps += ", " + _arrival_text(argparse.Namespace(**report["arguments"]))
    rows = [
        ("backend", _backend_text(c)),
        ("trace", f"{c['trace_kind']}, {_plural(s['requests'], 'request')} ({_outcomes(s, c)}), {steps}"),
        ("pool", f"{_plural(c['num_blocks'], 'block')} of {c['block_size']} tokens, block 0 the null block, so "
                 f"{c['num_blocks'] - 1:,} hold {s['pool_tokens']:,} tokens; max {c['max_num_seqs']} running, "
                 f"{_ADMISSION[c['admission']]}"),
        ("scheduling", _scheduling(c)),
        ("prefix cache hit rate", _headline(s)),
        ("  first admission", f"{s['first_admission_hit_rate']:.4f}  (each request once, at its first admission)"),
        ("  after preemption", f"{_rate(s['preempted_hits'], s['preempted_queries'])}  ({s['preempted_hits']:,} of "
                               f"{s['preempted_queries']:,} tokens, "
                               f"{_plural(s['preempted_lookup_requests'], 'lookup')} of preempted requests, "
                               "counted apart as vLLM does)"),
        ("  every admission", f"{s['every_admission_hit_rate']:.4f}  ({s['cached_tokens']:,} of "
                              f"{s['prompt_tokens']:,} prompt tokens, a preempted request's returns included)"),
        ("block hit rate", f"{s['block_hit_rate']:.4f}  ({s['hit_blocks']:,} of {s['query_blocks']:,} blocks looked "
                           "up in the same lookups, a prompt's partial last block included, which never hits)"),
        ("pool pressure", _pressure(s, arrival if c["trace_kind"] == "mooncake" else None)),
        ("recomputation", _recomputation(s)),
        ("blocks in use", f"max {s['max_blocks_in_use']:,}, mean {s['mean_blocks_in_use']:,.0f}"),
        ("evictions", _evictions(s)),
        ("preemptions", f"{s['preemptions']:,}"),
        ("manager time/step", _manager_time(s, c)),
        ("time", _times(s, report.get("process_wall_s"))),
    ]
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{width}}  {v}", file=file)
    messages = report["messages"]
    shown = messages if _verbosity > 0 else messages[:10]
    for m in shown:
        _note(m)
    if len(messages) > len(shown):
        _note(f"... and {len(messages) - len(shown)} more (--verbose shows them, --json keeps them)")


def _plural(n: int, word: str) -> str:
    """``1 request``, ``2 requests``, ``1,024 blocks``."""
    return f"{n:,} {word}{'' if n == 1 else 's'}"


def _outcomes(s: dict, c: dict) -> str:
    """What became of a replay's requests: finished, rejected, and those it
    left running or waiting (a step trace that ends first, or --max-steps)."""
    text = f"{s['finished']:,} finished, {s['rejected']:,} rejected"
    running, waiting = s.get("running_at_end", 0), s.get("waiting_at_end", 0)
    if running or waiting:
        end = "when the trace ended" if c["trace_kind"] == "step" else "when the replay stopped"
        text += f", {running:,} still running and {waiting:,} waiting {end}"
    return text


def _times(s: dict, process_s: float | None) -> str:
    """The replay loop's wall time, and the whole process's beside it."""
    text = f"replay loop {s['wall_s']:.1f} s (its steps: the scheduler and the manager's calls)"
    if process_s is not None:
        text += (f"; the whole process {process_s:.1f} s (also the imports, loading the trace, the manager's setup, "
                 "the ceiling's pass and the report)")
    return text


def _process_seconds() -> float:
    """How long this process has run, as ``time`` counts it (the
    interpreter's start and the imports included): from /proc where there
    is one, else since ``main()`` began."""
    try:
        with open("/proc/self/stat") as f:
            after_name = f.read().rsplit(")", 1)[1].split()
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        start = int(after_name[19]) / os.sysconf("SC_CLK_TCK")  # field 22, starttime, in clock ticks since boot
        return max(0.0, uptime - start)
    except (OSError, ValueError, IndexError, AttributeError):
        return time.perf_counter() - _main_started


def _headline(s: dict) -> str:
    """vLLM's prefix cache hit rate, beside what the trace allows; where the
    two do not cover the same requests (the replay rejected some the ceiling
    counts), it says so instead of setting one beside the other."""
    rate = f"{s['prefix_cache_hit_rate']:.4f}"
    ceiling = s.get("prefix_cache_hit_rate_ceiling")
    if s["rejected"]:
        rate += _rejected_text(s, ceiling)
    elif ceiling is not None:
        rate += f" of a possible {ceiling:.4f}"
    if ceiling is not None and s["prefix_cache_hit_rate"] > ceiling and _same_requests(s):
        rate += (f", above it as vLLM counts every try of a request waiting for room "
                 f"({_plural(s['lookup_requests'], 'lookup')} of {_plural(_served(s), 'request')}) and the "
                 "possible rate each request once")
    text = (f"{rate}  (vLLM's: {s['hits']:,} of {s['queries']:,} tokens looked up in "
            f"{_plural(s['lookup_requests'], 'lookup')}, one each time a waiting request was tried; a preempted "
            "request's return is counted apart, below")
    if ceiling is not None:
        text += "; possible: the same trace in a cache that never evicts"
    return text + ")"


def _served(s: dict) -> int:
    return s["requests"] - s["rejected"]


def _same_requests(s: dict) -> bool:
    """Whether the rate and its ceiling cover the same requests: the ceiling
    leaves out those longer than max_model_len, which the replay rejects too."""
    return s.get("prefix_cache_hit_rate_ceiling_requests", s["requests"]) == _served(s)


def _rejected_text(s: dict, ceiling: float | None) -> str:
    """What a replay that rejected requests can say of its rate."""
    rejected = f"{s['rejected']:,} of {_plural(s['requests'], 'request')} were rejected"
    if ceiling is None:
        return f", over the {_served(s):,} served alone ({rejected})"
    if _same_requests(s):  # the rejected ones are in neither
        return f" of a possible {ceiling:.4f}, both over the {_served(s):,} requests served ({rejected})"
    counted = s.get("prefix_cache_hit_rate_ceiling_requests", s["requests"])
    covered = f"all {counted:,}" if counted == s["requests"] else f"the {counted:,} within max_model_len"
    return (f", NOT COMPARABLE: {rejected}, so it covers the {_served(s):,} served, and the possible "
            f"{ceiling:.4f} {covered}")


def _pressure(s: dict, arrival: str | None) -> str:
    """Whether the running requests ever needed more than the pool holds."""
    ratio = s["peak_demand_over_pool"]
    need = (f"the running requests needed up to {ratio:.2f}x the pool at their full length "
            f"({s['peak_demand_tokens']:,} of {s['pool_tokens']:,} tokens)")
    if not s["preemptions"]:
        if ratio > 1:  # shared blocks, or requests finishing before the others grew
            return f"OVERSUBSCRIBED, though nothing was preempted: {need}"
        return f"never oversubscribed: {need}"
    fix = "fewer --max-num-seqs or more --num-blocks avoid it"
    if arrival == "back-to-back":
        fix += "; --arrival timestamp lets requests come as they came"
    return f"OVERSUBSCRIBED: {need}, so {_plural(s['preemptions'], 'preemption')} ({fix})"


def _evictions(s: dict) -> str:
    """How many cached blocks were reclaimed, and what that says (and does
    not say) about the hits lost: only a reclaimed block asked for again
    would have hit, and most are never asked for again."""
    text = f"{s['evictions']:,}"
    ceiling = s.get("prefix_cache_hit_rate_ceiling")
    if s["evictions"] and ceiling is not None and _same_requests(s):
        text += ("  (cached blocks reclaimed for new ones; not lost hits: only one asked for again would have hit, "
                 f"and a pool that never evicts reaches just the possible {ceiling:.4f}; gpukv sweep measures the "
                 "sizes between)")
    elif s["evictions"]:
        text += "  (cached blocks reclaimed for new ones)"
    return text


def _recomputation(s: dict) -> str:
    """How much of the work preemptions cost."""
    if not s["preemptions"]:
        return f"none: no request was preempted ({s['computed_tokens']:,} tokens computed)"
    share = s["recomputed_tokens"] / s["computed_tokens"] if s["computed_tokens"] else 0.0
    return (f"{s['recomputed_tokens']:,} of the {s['computed_tokens']:,} tokens computed ({share:.0%}) were "
            f"computed again after {_plural(s['preemptions'], 'preemption')} (one request preempted "
            f"{_plural(s['most_preemptions_of_a_request'], 'time')})")


def _backend_text(c: dict) -> str:
    if c["backend"] == "reference":
        return "reference (the sequential spec, in Python)"
    if c.get("interpreted"):
        return "device (Triton kernels under the interpreter: no CUDA here)"
    return "device (Triton kernels on the GPU)"


def _manager_time(s: dict, c: dict) -> str:
    text = (f"mean {s['manager_ms_per_step_mean']:.3f} ms, p50 {s['manager_ms_per_step_p50']:.3f} ms, "
            f"p99 {s['manager_ms_per_step_p99']:.3f} ms")
    if c.get("interpreted"):
        return text + " (INTERPRETED: Triton's interpreter on the CPU, not the kernels' speed on a GPU)"
    if c["backend"] == "reference":
        return text + " (the reference in Python: not the device manager's speed)"
    return text


# How the waiting requests were admitted, by --admission, in words.
_ADMISSION = {"batch": "waiting requests admitted in one call a step (--admission batch)",
              "one": "waiting requests admitted one call each, as vLLM calls its manager (--admission one)"}


def _scheduling(config: dict) -> str:
    """The token budget and chunk cap a replay ran with, in words."""
    if config["trace_kind"] == "step":
        return "a step trace runs as written (no token budget, whole prompts)"
    budget = config["max_num_batched_tokens"]
    cap = config["long_prefill_token_threshold"]
    if budget is None:
        text = "no token budget: each prompt computed whole in its admission step"
    else:
        text = f"token budget {budget:,} per step: a longer prompt is computed in pieces over several steps"
    if cap:
        text += f", at most {cap:,} tokens of a prompt a step (--long-prefill-token-threshold)"
    return text


def _check_output(path: str, option: str, trace: str | None) -> Path:
    """Refuse, before anything runs, an output path that cannot be written."""
    if not path:
        raise CliError(f"{option}: empty path")
    out = Path(path)
    if out.is_dir():
        raise CliError(f"{option} {path}: is a directory; give a file name")
    parent = out.parent
    if not parent.exists():
        raise CliError(f"{option} {path}: directory {str(parent)!r} does not exist")
    if not parent.is_dir():
        raise CliError(f"{option} {path}: {str(parent)!r} is not a directory")
    if out.exists() and not os.access(out, os.W_OK):
        raise CliError(f"{option} {path}: file is not writable")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise CliError(f"{option} {path}: cannot create files in {str(parent)!r} (permission denied)")
    if trace is not None and out.exists() and out.resolve() == Path(trace).resolve():
        raise CliError(f"{option} {path}: that is the trace; writing the report would overwrite it")
    return out


def _write_atomically(out: Path, text: str, option: str) -> None:
    """Write ``text`` to ``out`` via a temporary file in the same directory, so
    an interrupted or failed write never leaves a truncated report."""
    tmp = None
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent)
        with os.fdopen(fd, "w") as f:
            f.write(text)
        # mkstemp makes the file private; give it the mode a plain open() would.
        if out.exists():
            mode = out.stat().st_mode & 0o777
        else:
            umask = os.umask(0)
            os.umask(umask)
            mode = 0o666 & ~umask
        os.chmod(tmp, mode)
        os.replace(tmp, out)
        tmp = None
    except OSError as e:
        raise CliError(f"{option} {out}: could not write: {e.strerror or e}") from None
    finally:
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp)


def _hash_key() -> bytes:
    """The key from ``GPUKV_HASH_KEY`` / ``PYTHONHASHSEED`` (as the managers
    resolve it), refusing malformed values instead of falling back."""
    raw = os.environ.get(hashing.HASH_KEY_ENV)
    if raw is not None and raw != "" and not raw.strip():
        raise CliError(f"{hashing.HASH_KEY_ENV} is set but blank: set it to 32 hex characters (16 bytes), "
                       "or unset it for a random key")
    try:
        return hashing.resolve_hash_key()
    except (ValueError, TypeError) as e:
        raise CliError(f"{e}") from None


def _os_problem(e: OSError) -> str:
    if e.filename is not None and e.strerror:
        return f"{e.filename}: {e.strerror}"
    return str(e)


def _resolve_budget(args, trace_kind: str) -> int | None:
    """The token budget ReplayOptions takes (None: no budget), from
    ``--max-num-batched-tokens`` (not given: the default; 0: none). Sets the
    parsed argument to what applies, so the report's ``arguments`` say it; a
    step trace, which runs as written, says so when either option was given."""
    given = args.max_num_batched_tokens
    if trace_kind == "step" and (given is not None or args.long_prefill_token_threshold):
        _note("a step trace runs as written: --max-num-batched-tokens and --long-prefill-token-threshold "
              "apply to Mooncake traces")
    if given is None:
        given = args.max_num_batched_tokens = DEFAULT_MAX_NUM_BATCHED_TOKENS
    return given or None


def replay_main(args) -> int:
    path = args.trace
    max_requests = args.max_requests
    if path is None:
        path = builtin_trace_path()
        max_requests = max_requests or BUILTIN_REQUESTS
    # Everything the user handed in is checked before the replay starts.
    outputs, json_to_stdout = _replay_outputs(args)
    if args.arrival == "timestamp" and args.format == "step":
        raise CliError("--arrival timestamp applies to Mooncake traces, not step traces")
    key = _hash_key()  # one key for both runs, so their digests (and tables) agree
    if args.metrics_port is None and (args.metrics_vllm085 or args.served_model_name != "gpukv"
                                      or args.metrics_linger):
        raise CliError("--served-model-name, --metrics-vllm085 and --metrics-linger apply to the metrics: "
                       "add --metrics-port")
    # The endpoint answers from the first second, a scraper's first try
    # included: it starts before the trace loads and torch is imported.
    metrics = (_serve_metrics(args.metrics_port, model_name=args.served_model_name, vllm085=args.metrics_vllm085)
               if args.metrics_port is not None else None)
    trace = _load_replay_trace(args, path, max_requests)
    # What applied, for the report's arguments: a step trace has no arrivals to choose.
    args.arrival = (args.arrival or DEFAULT_ARRIVAL) if trace.kind == "mooncake" else None
    sizes = _replay_sizes(args, trace)
    budget = _resolve_budget(args, trace.kind)
    backend = _choose_backend(args.backend)
    job = _ReplayJob(args, trace, sizes, budget, key, backend, metrics)

    report = job.run(backend)
    compare = args.compare if args.compare is not None else backend == "device"
    ref = None
    if compare and backend != "reference":
        ref = job.run("reference")
        report["reference"] = _agreement(report, ref)
    # What this report is of, so that it can be reproduced.
    report = {
        "gpukv_version": version(),
        "arguments": dict(vars(args)),
        "trace": args.trace if args.trace is not None else "built-in",
        **report,
        # The whole process so far, beside the summary's replay loop (wall_s).
        "process_wall_s": _process_seconds(),
    }
    _deliver_report(args, report, ref, outputs, json_to_stdout)
    if metrics is not None and args.metrics_linger:
        _linger(args.metrics_linger)
    return _rejected_status(report["summary"], args.allow_rejected)


def _rejected_status(s: dict, allowed: bool) -> int:
    """0, or EXIT_REJECTED with a line on stderr when the replay rejected
    requests and ``--allow-rejected`` was not given: the report is out, but
    its rate is not the trace's."""
    if not s["rejected"] or allowed:
        return 0
    _fail(f"{PROG} replay", f"{s['rejected']:,} of {_plural(s['requests'], 'request')} were rejected (the notes and "
          "--json say why), so the prefix cache hit rate covers only the requests served; a larger --num-blocks or "
          "--max-model-len serves them, and --allow-rejected exits 0")
    return EXIT_REJECTED


def _linger(seconds: float) -> None:
    """Keep the metrics endpoint (a daemon thread) serving the final values
    ``seconds`` longer, so a scraper's next visit still finds them; the
    report is out already, so Ctrl-C just ends it early."""
    _note(f"the replay is over; serving its final metrics {seconds:g} s longer (--metrics-linger; Ctrl-C stops)")
    try:
        _sleep(seconds)
    except KeyboardInterrupt:
        _note("stopped serving the metrics")


_sleep = time.sleep  # what _linger waits with (a test replaces it)


def _replay_outputs(args) -> tuple[dict[str, Path], bool]:
    """The checked output files by option, and whether the JSON report goes to stdout."""
    outputs = {}
    json_to_stdout = args.json == "-"
    for option, value in (("--json", args.json), ("--plot", args.plot)):
        if value is not None and not (option == "--json" and json_to_stdout):
            outputs[option] = _check_output(value, option, args.trace)
    if len(outputs) == 2 and outputs["--json"].resolve() == outputs["--plot"].resolve():
        raise CliError(f"--json and --plot name the same file {args.json!r}")
    if "--plot" in outputs:
        _check_plot(args.plot)
    return outputs, json_to_stdout


def _load_replay_trace(args, path, max_requests: int | None) -> Trace:
    """The trace to replay, any problem with it a CliError."""
    trace = _load_trace_or_fail(path, args.format, max_requests, args.arrival or DEFAULT_ARRIVAL, args.step_ms)
    if trace.kind == "step" and args.arrival == "timestamp":
        raise CliError(f"{path}: --arrival timestamp applies to Mooncake traces, and this is a step trace")
    return trace


def _load_trace_or_fail(path, fmt: str, max_requests: int | None, arrival: str, step_ms: float,
                        command: str = "replay") -> Trace:
    """``load_trace``, any problem a CliError; one that comes from reading the
    file in the wrong format says which formats there are and which this looks
    like (``command``: the one that reads it, whose options the hint names)."""
    try:
        return load_trace(path, fmt, max_requests=max_requests, arrival=arrival, step_ms=step_ms)
    except TraceError as e:
        raise CliError(f"{e}{_format_hint(path, fmt, command)}") from None
    except FileNotFoundError as e:
        raise CliError(f"cannot read the trace: {_os_problem(e)}; TRACE is a Mooncake .jsonl (or .jsonl.xz, "
                       ".jsonl.gz) or a step-trace .json (docs/traces.md), and with no TRACE the built-in workload "
                       "runs") from None
    except OSError as e:
        raise CliError(f"cannot read the trace: {_os_problem(e)}") from None
    except (ValueError, TypeError) as e:
        raise CliError(f"{path}: {e}") from None


FORMATS_HELP = ("gpukv reads two formats (docs/traces.md): mooncake, JSON Lines, one request a line (what a .jsonl "
                "file is taken for), and step, one JSON document with 'config' and 'steps' (any other extension)")


def _format_hint(path, fmt: str, command: str = "replay") -> str:
    """After a trace error: '; it looks like ...' when the file is recognisably
    another format (or a convertible one), else nothing."""
    looks = _sniff_format(path)
    if looks is None:
        return ""
    resolved = fmt if fmt != "auto" else ("mooncake" if trace_suffix(path) == ".jsonl" else "step")
    if looks == resolved:
        return ""  # the right format, with a problem of its own: the message says which
    if command == "sweep" and looks == "step":  # sweep has no --format: it reads Mooncake traces alone
        return (f"; this file looks like a step trace, and gpukv sweep replays Mooncake traces only: "
                f"gpukv replay {path} replays a step trace, at one size")
    if looks in ("mooncake", "step"):
        return (f"; this file looks like a {looks} trace, read as {resolved}"
                f"{' (by its extension)' if fmt == 'auto' else ''}: pass --format {looks}. {FORMATS_HELP}")
    if looks == "mooncake array":
        return (f"; this file is a JSON array of Mooncake records: make it JSON Lines, one record a line "
                f"(jq -c '.[]' {path} > trace.jsonl), and replay that. {FORMATS_HELP}")
    return f"; {FORMATS_HELP}"


def _sniff_format(path) -> str | None:
    """What the start of ``path`` looks like: 'mooncake' (an object with
    Mooncake's fields on the first line), 'step' (a JSON document with
    'steps'), 'mooncake array', 'other' (text that is neither), or None
    (unreadable)."""
    try:
        with open_trace(path) as f:
            head = f.read(1 << 20).decode("utf-8", errors="replace")
    except (OSError, *DECOMPRESS_ERRORS):
        return None
    first = next((line.strip() for line in head.splitlines() if line.strip()), "")
    with contextlib.suppress(ValueError, RecursionError):
        rec = json.loads(first)
        if isinstance(rec, dict) and {"input_length", "hash_ids"} <= set(rec):
            return "mooncake"
    with contextlib.suppress(ValueError, RecursionError):
        doc = json.loads(head)
        if isinstance(doc, dict) and "steps" in doc:
            return "step"
        if isinstance(doc, list) and doc and isinstance(doc[0], dict) and "hash_ids" in doc[0]:
            return "mooncake array"
    if '"steps"' in head[:4096] and first.startswith("{"):
        return "step"  # a step trace too long to sniff whole, or one with a problem of its own
    return "other"


def _replay_sizes(args, trace: Trace) -> dict:
    """block_size, num_blocks and max_model_len: a step trace's config, else
    the option, else the default; an option the config overrides gets a note."""
    sizes = {}
    for name, default in DEFAULT_SIZES.items():
        given = getattr(args, name)
        if trace.kind == "step" and name in trace.config:
            sizes[name] = trace.config[name]
            if given is not None and given != trace.config[name]:
                _note(f"the step trace's config sets {name} {trace.config[name]}; "
                      f"--{name.replace('_', '-')} {given} is not used")
        else:
            sizes[name] = given if given is not None else default
    return sizes


def _choose_backend(backend: str) -> str:
    """The backend that runs: ``auto`` resolved, and the device one only where Triton is."""
    from gpukv import _runtime  # torch (and Triton's interpreter switch, before triton loads)

    if backend == "auto":
        backend = "device" if _runtime.CUDA_AVAILABLE else "reference"
        if backend == "reference":
            _note("no CUDA device here, so the reference backend runs; --backend device runs the device "
                  "kernels under Triton's interpreter (same results, much slower)")
    if backend == "device" and not _triton_installed():
        raise CliError("the device backend needs Triton, which is not installed here (it has wheels for Linux "
                       "only: pip install triton); --backend reference runs without it")
    return backend


@dataclasses.dataclass
class _ReplayJob:
    """What replay_main resolved from the arguments, enough to replay the trace
    on either backend (the main one, and the reference to compare with)."""

    args: argparse.Namespace
    trace: Trace
    sizes: dict
    budget: int | None
    key: bytes
    backend: str  # the main run's; the metrics follow that run only
    metrics: Any

    def options(self, name: str) -> ReplayOptions:
        """A fresh ReplayOptions for a run on ``name`` (Replay adjusts the one it gets)."""
        from gpukv.tools.replay import ReplayOptions

        args = self.args
        return ReplayOptions(
            max_num_seqs=args.max_num_seqs, admission=args.admission, uncached_first=args.uncached_first,
            prompt_only=args.prompt_only, backend=name, progress=not (args.no_progress or args.quiet),
            max_steps=args.max_steps,
            hash_key=self.key, max_num_batched_tokens=self.budget,
            long_prefill_token_threshold=args.long_prefill_token_threshold,
            metrics=self.metrics if name == self.backend else None, **self.sizes,
        )

    def run(self, name: str) -> dict:
        """The report of a replay on ``name``; what the manager refuses becomes a CliError."""
        from gpukv.tools.replay import Replay

        opts = self.options(name)
        what = f"{self.args.trace}: " if self.args.trace is not None else ""
        try:
            replay = Replay(self.trace, opts)
        except MemoryError:
            raise CliError(f"not enough memory for a {name} manager of {self.sizes['num_blocks']:,} blocks of "
                           f"{self.sizes['block_size']} tokens; lower --num-blocks") from None
        except (ValueError, TypeError) as e:  # sizes the manager refuses (gpukv.errors included)
            raise CliError(f"the {name} manager refused the configuration: {e}") from None
        try:
            return replay.run()  # its progress bar clears its line if the run fails
        except MemoryError:
            raise CliError(f"{what}ran out of memory during the replay (try a smaller trace or pool)") from None
        except GpukvError as e:
            if isinstance(e, (ValueError, TypeError, KeyError)):
                raise CliError(f"{what}the {name} manager refused a request of the trace: {e}") from None
            raise


def _agreement(report: dict, ref: dict) -> dict:
    """The reference run's summary and whether it agrees with the main run's report."""
    agree = {
        "requests": ref["requests"] == report["requests"],
        "final free queue": ref["final"]["free_queue"] == report["final"]["free_queue"],
        "summary counts": all(ref["summary"][k] == report["summary"][k] for k in _COUNTS),
    }
    return {"summary": ref["summary"], "agree": agree}


def _deliver_report(args, report: dict, ref: dict | None, outputs: dict[str, Path], json_to_stdout: bool) -> None:
    """Write the report's files, then print it (and the reference run's, if any)."""
    # Files first: a reader of stdout that goes away must not cost the report.
    if "--json" in outputs:
        _write_atomically(outputs["--json"], json.dumps(report, default=str), "--json")
    if "--plot" in outputs:
        plot.replay_figure(report, outputs["--plot"])
    if json_to_stdout:
        sys.stdout.write(json.dumps(report, default=str) + "\n")
        sys.stdout.flush()
    human = sys.stderr if json_to_stdout else sys.stdout
    _print_summary(report, human)
    if ref is not None:
        print(file=human)
        print("the same replay on the reference:", file=human)
        _print_summary(ref, human)
        agree = report["reference"]["agree"]
        print("device vs reference: " + ", ".join(f"{k} {'identical' if v else 'DIFFERENT'}" for k, v in agree.items()),
              file=human)
    if "--json" in outputs:
        _note(f"report written to {args.json}")
    if "--plot" in outputs:
        _note(f"plot written to {args.plot}")
    sys.stdout.flush()  # a closed pipe shows here, inside main's handler


_COUNTS = ("prompt_tokens", "cached_tokens", "queries", "hits", "query_blocks", "hit_blocks", "lookup_requests",
           "preempted_lookup_requests", "preempted_queries", "preempted_hits", "preemptions", "evictions",
           "admissions")


def _fail(prefix: str, message: str) -> None:
    # The replay's tqdm bar clears its line when a run fails, so the message
    # starts a line of its own. A stderr that cannot be written is let go.
    try:
        sys.stderr.write(f"{prefix}: {message}\n")
        sys.stderr.flush()
    except (OSError, ValueError):
        pass


def _silence_stdout() -> None:
    """After EPIPE on stdout, point it at /dev/null so the interpreter's
    final flush does not fail again (Python's documented recipe)."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except Exception:  # OSError, or io.UnsupportedOperation for a captured stdout
        pass


def _serve_metrics(port: int, *, model_name: str = "gpukv", vllm085: bool = False):
    """Prometheus metrics served from a daemon thread while the replay runs."""
    from gpukv.tools import prometheus

    try:
        metrics = prometheus.ServingMetrics(model_name=model_name, vllm085=vllm085)
    except ImportError as e:
        raise CliError(str(e)) from None
    try:
        bound = metrics.serve(port)
    except OSError as e:
        raise CliError(f"--metrics-port {port}: cannot listen there ({e.strerror or e})") from None
    _note(f"Prometheus metrics at http://127.0.0.1:{bound}/metrics")
    return metrics


def _check_plot(path: str) -> None:
    """A plot's format and matplotlib, checked before anything runs."""
    try:
        plot.check_path(path)
        plot.require_matplotlib()
    except (ValueError, ImportError) as e:
        raise CliError(f"--plot {e}") from None


def _triton_installed() -> bool:
    try:
        return importlib.util.find_spec("triton") is not None
    except ImportError:
        return False


def build_parser() -> argparse.ArgumentParser:
    """The command line: ``gpukv replay`` and ``gpukv sweep``."""
    parser = _Parser(prog=PROG, description="gpukv: a GPU-resident KV-cache block manager",
                     formatter_class=_HelpFormatter)
    parser.add_argument("--version", action="version", version=f"%(prog)s {version()}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    _replay_parser(sub)
    _sweep_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the command; on an error, print one line on stderr and exit
    (``SystemExit``) with the status the module docstring lists."""
    parser = build_parser()
    prefix = PROG
    global _verbosity, _main_started
    _verbosity = 0
    _main_started = time.perf_counter()
    try:
        args, extra = parser.parse_known_args(argv)
        prefix = f"{PROG} {args.command}"
        if extra:  # argparse would blame the top-level command
            raise CliError(f"unrecognized arguments: {' '.join(extra)} (see '{prefix} --help')", prog=prefix)
        _verbosity = -1 if args.quiet else 1 if args.verbose else 0
        if args.command == "replay":
            return replay_main(args)
        if args.command == "sweep":
            return sweep_main(args)
        raise CliError(f"unknown command {args.command!r}")
    except CliError as e:
        _fail(e.prog or prefix, str(e))
        raise SystemExit(e.status) from None
    except KeyboardInterrupt:
        _fail(prefix, "interrupted; nothing was written")
        raise SystemExit(EXIT_INTERRUPTED) from None
    except BrokenPipeError:
        _silence_stdout()
        raise SystemExit(EXIT_BROKEN_PIPE) from None
    except Exception as e:  # a bug: still one line, the traceback on request
        if os.environ.get("GPUKV_DEBUG"):
            raise
        text = " ".join(str(e).split())
        _fail(prefix, f"internal error ({type(e).__name__}: {text[:300]}); this is a bug in gpukv, "
                      "rerun with GPUKV_DEBUG=1 for the traceback")
        raise SystemExit(EXIT_INTERNAL) from None


if __name__ == "__main__":
    sys.exit(main())
