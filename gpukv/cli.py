"""The ``gpukv`` command line: ``gpukv replay [TRACE]``."""

from __future__ import annotations

import argparse
import json
import os
import sys

from gpukv import _runtime
from gpukv.plot import replay_svg
from gpukv.replay import Replay, ReplayOptions
from gpukv.traces import builtin_trace_path, load_trace

BUILTIN_REQUESTS = 300


def _replay_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "replay",
        help="run a serving loop over a trace and report hit rates, evictions, preemptions and manager time",
        description="Replay a trace through the block manager. With no TRACE, replays the built-in workload "
        f"(the first {BUILTIN_REQUESTS} requests of the Mooncake conversation trace).",
    )
    p.add_argument("trace", nargs="?", help="a Mooncake .jsonl or a step-trace .json (default: built-in workload)")
    p.add_argument("--format", choices=["auto", "mooncake", "step"], default="auto")
    p.add_argument("--backend", choices=["auto", "device", "reference"], default="auto",
                   help="device: the GPU-resident manager (Triton kernels; on a machine without CUDA they run under "
                   "Triton's interpreter, correct but slow); reference: the sequential spec; auto (default): device "
                   "when CUDA is available, else reference")
    p.add_argument("--compare", action=argparse.BooleanOptionalAction, default=None,
                   help="also replay on the reference and report whether the results agree "
                   "(default: on when the backend is device)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-blocks", type=int, default=65_536)
    p.add_argument("--max-model-len", type=int, default=131_072)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--uncached-first", action=argparse.BooleanOptionalAction, default=True,
                   help="free uncached blocks to the front of the free queue (default) or all to the back")
    p.add_argument("--admission", choices=["batch", "one"], default="batch",
                   help="admit a step's candidates in one batched step (default) or one step call each (vLLM's order)")
    p.add_argument("--max-requests", type=int, default=None)
    p.add_argument("--max-steps", type=int, default=None)
    p.add_argument("--prompt-only", action="store_true", help="each request finishes right after its prefill")
    p.add_argument("--arrival", choices=["back-to-back", "timestamp"], default="back-to-back",
                   help="Mooncake arrivals: all waiting from step 0 in order, or by timestamp")
    p.add_argument("--step-ms", type=float, default=100.0, help="with --arrival timestamp: milliseconds per step")
    p.add_argument("--json", metavar="OUT", help="write the full report (summary, per-request records, final state)")
    p.add_argument("--plot", metavar="OUT.svg", help="write an SVG: token hit rate and manager time over the steps")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    return p


def _positive(args, names) -> None:
    for name in names:
        v = getattr(args, name)
        if v is not None and v <= 0:
            raise SystemExit(f"gpukv replay: --{name.replace('_', '-')} must be positive, got {v}")


def _print_summary(report: dict) -> None:
    s = report["summary"]
    c = report["config"]
    rows = [
        ("backend", s["backend"]),
        ("trace", f"{c['trace_kind']}, {s['requests']} requests ({s['finished']} finished, {s['rejected']} rejected), {s['steps']} steps"),
        ("pool", f"{c['num_blocks']} blocks of {c['block_size']} tokens, max {c['max_num_seqs']} running, admission {c['admission']}"),
        ("token hit rate", f"{s['token_hit_rate']:.4f}  ({s['cached_tokens']:,} of {s['prompt_tokens']:,} prompt tokens)"),
        ("block hit rate", f"{s['block_hit_rate']:.4f}  ({s['hits']:,} hits of {s['queries']:,} blocks asked, {s['lookup_requests']} lookups)"),
        ("blocks in use", f"max {s['max_blocks_in_use']:,}, mean {s['mean_blocks_in_use']:,.0f}"),
        ("evictions", f"{s['evictions']:,}"),
        ("preemptions", f"{s['preemptions']:,}"),
        ("manager time/step", f"mean {s['manager_ms_per_step_mean']:.3f} ms, p50 {s['manager_ms_per_step_p50']:.3f} ms, p99 {s['manager_ms_per_step_p99']:.3f} ms"),
        ("wall time", f"{s['wall_s']:.1f} s"),
    ]
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{width}}  {v}")
    for m in report["messages"][:10]:
        print(f"note: {m}")
    if len(report["messages"]) > 10:
        print(f"note: ... and {len(report['messages']) - 10} more (see --json)")


def replay_main(args) -> int:
    _positive(args, ["block_size", "num_blocks", "max_model_len", "max_num_seqs", "max_requests", "max_steps", "step_ms"])
    path = args.trace
    max_requests = args.max_requests
    if path is None:
        path = builtin_trace_path()
        max_requests = max_requests or BUILTIN_REQUESTS
    try:
        trace = load_trace(path, args.format, max_requests=max_requests, arrival=args.arrival, step_ms=args.step_ms)
    except (OSError, ValueError) as e:
        raise SystemExit(f"gpukv replay: {e}")
    backend = args.backend
    if backend == "auto":
        backend = "device" if _runtime.CUDA_AVAILABLE else "reference"
        if backend == "reference":
            print("note: no CUDA device here, so the reference backend runs; --backend device runs the device "
                  "kernels under Triton's interpreter (same results, much slower)")

    def options(name: str) -> ReplayOptions:
        return ReplayOptions(
            block_size=args.block_size, num_blocks=args.num_blocks, max_model_len=args.max_model_len,
            max_num_seqs=args.max_num_seqs, admission=args.admission, uncached_first=args.uncached_first,
            prompt_only=args.prompt_only, backend=name, progress=not args.no_progress and sys.stderr.isatty(),
            max_steps=args.max_steps, hash_key=key,
        )

    # One key for both runs, so their digests (and so their tables) agree.
    key = os.urandom(16)
    report = Replay(trace, options(backend)).run()
    _print_summary(report)
    compare = args.compare if args.compare is not None else backend == "device"
    if compare and backend != "reference":
        print()
        print("the same replay on the reference:")
        ref = Replay(trace, options("reference")).run()
        _print_summary(ref)
        agree = {
            "requests": ref["requests"] == report["requests"],
            "final free queue": ref["final"]["free_queue"] == report["final"]["free_queue"],
            "summary counts": all(ref["summary"][k] == report["summary"][k] for k in _COUNTS),
        }
        print("device vs reference: " + ", ".join(f"{k} {'identical' if v else 'DIFFERENT'}" for k, v in agree.items()))
        report["reference"] = {"summary": ref["summary"], "agree": agree}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f)
        print(f"report written to {args.json}")
    if args.plot:
        with open(args.plot, "w") as f:
            f.write(replay_svg(report))
        print(f"plot written to {args.plot}")
    return 0


_COUNTS = ("prompt_tokens", "cached_tokens", "queries", "hits", "preemptions", "evictions", "admissions")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="gpukv", description="gpukv: a GPU-resident KV-cache block manager")
    sub = parser.add_subparsers(dest="command", required=True)
    _replay_parser(sub)
    args = parser.parse_args(argv)
    if args.command == "replay":
        return replay_main(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
