"""The figures the docs quote, the commands they come from, and the check that
they still match.

Every figure README.md and docs/chunked_prefill.md quote from a run (and the
text in docs/sweep_builtin.svg) is rendered here from the report of a
``gpukv`` command those docs name (``SOURCES``: each command as the docs
write it), and must appear in the docs exactly as rendered (white space
aside). ``tests/data/doc_figures.json`` keeps what each command reported
when it was last run: its summary (or a sweep's points), its stdout, and
how long it took.

    python tests/helpers/doc_figures.py run [ID ...]   # rerun the commands (all: about 10 minutes on two cores)
    python tests/helpers/doc_figures.py check          # every rendered figure is in the docs (a second)

``run`` records the new reports and then checks, printing each text the docs
should now carry; it writes ``docs/sweep_builtin.svg`` too (the sweep's
``--plot``). ``tests/docs/test_doc_figures.py`` runs ``check`` in CI and reruns
the cheap sources (the README's main job: seconds), comparing every figure
but the timings; the sweep and the whole-trace tables are rerun only by
``run``. Timings (wall times, the manager's time per step, how long a
command took) are quoted from the recorded run: a rerun does not repeat them.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import shlex
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RECORD = ROOT / "tests" / "data" / "doc_figures.json"
TRACE = "gpukv/data/mooncake_conversation_trace.jsonl.xz"  # the docs' path, from the repository's root
# What a rerun does not repeat: wall times and the manager's time per step.
TIMING_KEYS = {"wall_s", "process_wall_s", "manager_ms_per_step_mean", "manager_ms_per_step_p50",
               "manager_ms_per_step_p99", "elapsed_s", "cpu_s"}
TIMING_LINES = ("manager time/step", "time  ")


@dataclass(frozen=True)
class Source:
    """A command whose report the docs quote: as ``doc`` writes it (``$name``
    for a shell loop's variable, set by ``values``)."""

    id: str
    doc: str
    command: str
    values: dict[str, str] = field(default_factory=dict)
    cheap: bool = False  # CI reruns it (seconds)

    def argv(self) -> list[str]:
        """The command's arguments after ``gpukv``, without its ``--json`` (the runner adds its own)."""
        words = shlex.split(re.sub(r"\$(\w+)", lambda m: self.values[m[1]], self.command))
        assert words[0] == "gpukv", self.command
        out, skip = [], False
        for w in words[1:]:
            if skip:
                skip = False
            elif w == "--json":
                skip = True
            else:
                out.append(w)
        return out


def _prompt_only(budget: str, cap: str | None = None) -> Source:
    if cap is None:
        return Source(f"prompt-only-{budget}", "docs/chunked_prefill.md",
                      f"gpukv replay {TRACE} --backend reference --block-size 512 --num-blocks 250000 --prompt-only "
                      "--max-num-batched-tokens $b --no-progress --arrival back-to-back --max-num-seqs 256 "
                      "--json prompt_only_$b.json", {"b": budget})
    return Source(f"prompt-only-{budget}-cap{cap}", "docs/chunked_prefill.md",
                  f"gpukv replay {TRACE} --backend reference --block-size 512 --num-blocks 250000 --prompt-only "
                  "--max-num-batched-tokens 8192 --long-prefill-token-threshold $cap --no-progress --arrival "
                  "back-to-back --max-num-seqs 256 --json prompt_only_8192_cap$cap.json", {"cap": cap})


def _decode(budget: str, cap: str | None = None) -> Source:
    if cap is None:
        return Source(f"decode-{budget}", "docs/chunked_prefill.md",
                      f"gpukv replay {TRACE} --backend reference --block-size 512 --num-blocks 6000 --max-requests "
                      "2000 --max-num-batched-tokens $b --no-progress --arrival back-to-back --max-num-seqs 256 "
                      "--json decode_$b.json", {"b": budget})
    return Source(f"decode-{budget}-cap{cap}", "docs/chunked_prefill.md",
                  f"gpukv replay {TRACE} --backend reference --block-size 512 --num-blocks 6000 --max-requests 2000 "
                  f"--max-num-batched-tokens {budget} --long-prefill-token-threshold {cap} --no-progress --arrival "
                  f"back-to-back --max-num-seqs 256 --json decode_{budget}_cap{cap}.json")


BUDGETS = ("unlimited", "16384", "8192", "2048")
SOURCES = {s.id: s for s in [
    Source("replay-builtin", "README.md", "gpukv replay", cheap=True),
    Source("replay-rejecting", "README.md", "gpukv replay --num-blocks 100 --allow-rejected", cheap=True),
    Source("sweep-builtin", "README.md", "gpukv sweep --plot docs/sweep_builtin.svg"),
    Source("back-to-back-256", "docs/chunked_prefill.md", "gpukv replay --arrival back-to-back --max-num-seqs 256"),
    Source("back-to-back-256-unlimited", "docs/chunked_prefill.md",
           "gpukv replay --arrival back-to-back --max-num-seqs 256 --max-num-batched-tokens unlimited"),
    *[_prompt_only(b) for b in BUDGETS], _prompt_only("8192", "2048"), _prompt_only("8192", "256"),
    *[_decode(b) for b in BUDGETS], _decode("8192", "2048"),
]}


# ----------------------------------------------------------------- running

def run_source(source: Source) -> dict:
    """Run ``source``'s command from the repository's root; what it reported."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "report.json"
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        t0 = time.perf_counter()
        proc = subprocess.run([sys.executable, "-m", "gpukv", *source.argv(), "--json", str(out)], cwd=ROOT,
                              capture_output=True, text=True, check=False)
        elapsed = time.perf_counter() - t0
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        if proc.returncode != 0:
            raise RuntimeError(f"{source.id}: {source.command} exited {proc.returncode}: {proc.stderr[-2000:]}")
        report = json.loads(out.read_text())
    record = {"command": source.command, "values": source.values, "stdout": proc.stdout,
              "elapsed_s": round(elapsed, 1),
              "cpu_s": round(after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime, 1)}
    if "points" in report:  # a sweep
        keep = ("num_blocks", "capacity", "prefix_cache_hit_rate", "first_admission_hit_rate", "evictions",
                "preemptions", "recomputed_tokens", "computed_tokens", "rejected", "holds_max_model_len")
        record["points"] = [{k: p[k] for k in keep if k in p} for p in report["points"]]
        record["ceiling"] = {k: report["ceiling"][k] for k in keep if k in report["ceiling"]}
        record["num_requests"], record["block_size"] = report["num_requests"], report["block_size"]
    else:
        record["summary"] = report["summary"]
        record["config"] = report["config"]
        record["process_wall_s"] = report["process_wall_s"]
    return record


def load_record() -> dict:
    return json.loads(RECORD.read_text(encoding="utf-8"))


def without_timings(record: dict) -> dict:
    """A record as a rerun must repeat it: no timing, and no stdout line that shows one."""
    def strip(value):
        if isinstance(value, dict):
            return {k: strip(v) for k, v in value.items() if k not in TIMING_KEYS}
        if isinstance(value, list):
            return [strip(v) for v in value]
        return value

    out = strip(record)
    out["stdout"] = [line for line in record["stdout"].splitlines() if not line.startswith(TIMING_LINES)]
    return out


# ----------------------------------------------------------------- quoting

@dataclass(frozen=True)
class Quote:
    """Text that ``file`` (a docs file, or ``help:replay`` for that --help) must contain."""

    file: str
    text: str
    source: str


def _k(tokens: int) -> str:
    """A capacity as the README's prose writes it: 548k, 1.05M, 2.2M."""
    return f"{tokens / 1e6:.3g}M" if tokens >= 1e6 else f"{tokens / 1e3:.0f}k"


def _builtin_trace_figures() -> dict:
    """The built-in workload's own figures (read from the file: no command needed)."""
    from gpukv.tools.defaults import DEFAULT_BLOCK_SIZE, DEFAULT_NUM_BLOCKS
    from gpukv.tools.traces import builtin_trace_path

    recs = [json.loads(line) for line in builtin_trace_path().read_text().splitlines() if line.strip()]
    full = sum(r["input_length"] + r["output_length"] for r in recs) / len(recs)
    return {"requests": len(recs), "span_s": (max(r["timestamp"] for r in recs) - min(r["timestamp"] for r in recs))
            / 1000, "mean_prompt": sum(r["input_length"] for r in recs) / len(recs), "mean_full": full,
            "holds": (DEFAULT_NUM_BLOCKS - 1) * DEFAULT_BLOCK_SIZE / full}


def _readme_replay(rec: dict) -> list[str]:
    s, t = rec["summary"], _builtin_trace_figures()
    return [
        rec["stdout"].rstrip("\n"),
        f"`gpukv replay` on a 2-core machine without CUDA (about {rec['elapsed_s']:.0f} s):",
        f"The built-in workload is the first {t['span_s']:.0f} s ({t['requests']} requests, prompts of "
        f"{t['mean_prompt']:,.0f} tokens on average) of Mooncake's conversation trace",
        f"the pool holds about {t['holds']:.0f} of these requests at their full length",
        f"Here the slice allows only {s['prefix_cache_hit_rate_ceiling']:.3f}: its requests share a 512-token "
        f"system prompt ({s['prefix_cache_hit_rate']:.3f})",
    ]


def _readme_rejecting(rec: dict) -> list[str]:
    """The rate's line of a replay whose pool rejects most requests, as README quotes it."""
    s = rec["summary"]
    served = s["requests"] - s["rejected"]
    return [f"`prefix cache hit rate  {s['prefix_cache_hit_rate']:.4f}, NOT COMPARABLE: {s['rejected']:,} of "
            f"{s['requests']:,} requests were rejected, so it covers the {served:,} served, and the possible "
            f"{s['prefix_cache_hit_rate_ceiling']:.4f} all {s['prefix_cache_hit_rate_ceiling_requests']:,}` (the "
            f"{served:,} short requests, looked up {s['lookup_requests']:,} times while they waited for room)"]


def _help_replay(rec: dict) -> list[str]:
    del rec
    t = _builtin_trace_figures()
    return [f"the default pool holds about {t['holds']:.0f} of the built-in workload's requests at their full length"]


def _readme_sweep(rec: dict) -> list[str]:
    from gpukv.tools.defaults import DEFAULT_BLOCK_SIZE, DEFAULT_NUM_BLOCKS

    default = (DEFAULT_NUM_BLOCKS - 1) * DEFAULT_BLOCK_SIZE
    points = sorted(rec["points"], key=lambda p: p["capacity"])
    below = [p for p in points if p["capacity"] < default][::-1]  # nearest the default pool first
    above = [p for p in points if p["capacity"] > default]
    ceiling = rec["ceiling"]
    return [
        f"(`gpukv sweep --plot docs/sweep_builtin.svg`: {rec['elapsed_s']:.0f} s on two cores, {rec['cpu_s']:.0f} s of "
        "CPU, when last recorded",
        f"Below the default pool ({_k(default)} tokens) the running requests outgrow the pool and are preempted ("
        + ", ".join(f"{p['preemptions']:,} {'times ' if i == 0 else ''}at {_k(p['capacity'])} tokens"
                    for i, p in enumerate(below)) + ")",
        "Above the default pool more earlier turns stay cached: "
        + ", ".join(f"{p['prefix_cache_hit_rate']:.3f} at {_k(p['capacity'])} tokens" for p in above)
        + f", {ceiling['prefix_cache_hit_rate']:.3f} (the ceiling) once nothing is evicted",
    ]


def _svg_sweep(rec: dict) -> list[str]:
    return [f"ceiling, a cache that never evicts: {rec['ceiling']['prefix_cache_hit_rate']:.3f}",
            f"built-in workload: {rec['num_requests']} requests, {rec['block_size']}-token blocks"]


def _table_row(label: str, rec: dict) -> str:
    s = rec["summary"]
    return (f"| {label} | {s['every_admission_hit_rate']:.4f} | {s['first_admission_hit_rate']:.4f} | "
            f"{s['prompt_tokens']:,} | {s['mean_blocks_in_use']:,.0f} | {s['max_blocks_in_use']:,} | "
            f"{s['preemptions']:,} | {s['evictions']:,} | {s['steps']:,} | {s['wall_s']:.1f} s |")


def _label(source_id: str) -> str:
    """A table row's budget: ``unlimited``, ``16,384``, ``8,192, cap 2,048``."""
    m = re.search(r"-(unlimited|\d+)(?:-cap(\d+))?$", source_id)
    assert m is not None, source_id
    text = m[1] if m[1] == "unlimited" else f"{int(m[1]):,}"
    return text + (f", cap {int(m[2]):,}" if m[2] else "")


def _chunked_tables(records: dict) -> list[str]:
    rows = [_table_row(_label(i), records[i]) for i in records if i.startswith(("prompt-only-", "decode-"))]
    unlimited = records["prompt-only-unlimited"]["summary"]
    cap256 = records["prompt-only-8192-cap256"]["summary"]
    firsts = [records[f"decode-{b}"]["summary"]["first_admission_hit_rate"] for b in BUDGETS]
    firsts.append(records["decode-8192-cap2048"]["summary"]["first_admission_hit_rate"])
    return [
        *rows,
        f"{unlimited['requests']:,} requests, mean prompt {unlimited['prompt_tokens'] / unlimited['requests']:,.0f} "
        "tokens",
        f"The hit rate is the trace README's {unlimited['every_admission_hit_rate']:.4f} at every budget",
        f"(256 tokens, half a block: {8192 // 256} prefills at once, {cap256['every_admission_hit_rate']:.4f})",
        f"({unlimited['steps']} steps for the whole trace)",
        f"it barely moves ({min(firsts):.4f} to {max(firsts):.4f})",
        f"{records['decode-16384']['summary']['preemptions']:,} preemptions against the "
        f"{records['decode-unlimited']['summary']['preemptions']:,} of whole-prompt admission",
    ]


def _chunked_back_to_back(records: dict) -> list[str]:
    b, u = records["back-to-back-256"]["summary"], records["back-to-back-256-unlimited"]["summary"]
    return [f"{b['every_admission_hit_rate']:.4f} over every admission, {b['first_admission_hit_rate']:.4f} over first "
            f"admissions and {b['preemptions']:,} preemptions, against {u['every_admission_hit_rate']:.4f}, "
            f"{u['first_admission_hit_rate']:.4f} and {u['preemptions']:,} without a budget"]


# (file, the sources it reads, how the quotes are rendered from their records)
RENDERERS: list[tuple[str, tuple[str, ...], Callable[..., list[str]]]] = [
    ("README.md", ("replay-builtin",), lambda r: _readme_replay(r["replay-builtin"])),
    ("help:replay", ("replay-builtin",), lambda r: _help_replay(r["replay-builtin"])),
    ("README.md", ("replay-rejecting",), lambda r: _readme_rejecting(r["replay-rejecting"])),
    ("README.md", ("sweep-builtin",), lambda r: _readme_sweep(r["sweep-builtin"])),
    ("docs/sweep_builtin.svg", ("sweep-builtin",), lambda r: _svg_sweep(r["sweep-builtin"])),
    ("docs/chunked_prefill.md", tuple(i for i in SOURCES if i.startswith(("prompt-only-", "decode-"))),
     _chunked_tables),
    ("docs/chunked_prefill.md", ("back-to-back-256", "back-to-back-256-unlimited"), _chunked_back_to_back),
]


def quotes(records: dict) -> list[Quote]:
    out = []
    for file, ids, render in RENDERERS:
        for text in render(records):
            out.append(Quote(file, text, ",".join(ids)))
    return out


def normalized(text: str) -> str:
    """White space collapsed (the docs wrap their prose), shell continuations joined."""
    return " ".join(text.replace("\\\n", " ").split())


def file_text(name: str) -> str:
    """A docs file's text, or ``help:replay``: what ``gpukv replay --help`` prints."""
    if name.startswith("help:"):
        import contextlib
        import io

        from gpukv.tools.cli import main

        out = io.StringIO()
        columns = os.environ.get("COLUMNS")
        os.environ["COLUMNS"] = "10000"  # argparse wraps at the terminal's width, and textwrap at hyphens
        try:
            with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):
                main([name[5:], "--help"])
        finally:
            if columns is None:
                del os.environ["COLUMNS"]
            else:
                os.environ["COLUMNS"] = columns
        return out.getvalue()
    if name.endswith(".svg"):
        import xml.etree.ElementTree as ET

        return " ".join(ET.parse(ROOT / name).getroot().itertext())
    return (ROOT / name).read_text(encoding="utf-8")


def missing_quotes(records: dict) -> list[Quote]:
    """The rendered quotes the docs do not contain."""
    texts: dict[str, str] = {}
    missing = []
    for q in quotes(records):
        if q.file not in texts:
            texts[q.file] = normalized(file_text(q.file))
        if normalized(q.text) not in texts[q.file]:
            missing.append(q)
    return missing


def unnamed_commands() -> list[Source]:
    """Sources whose command their doc does not write (a loop's variable as ``$name``)."""
    docs: dict[str, str] = {}
    out = []
    for s in SOURCES.values():
        if s.doc not in docs:
            docs[s.doc] = normalized((ROOT / s.doc).read_text(encoding="utf-8"))
        if normalized(s.command) not in docs[s.doc]:
            out.append(s)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="what", required=True)
    run = sub.add_parser("run", help="rerun the commands and record their reports, then check")
    run.add_argument("ids", nargs="*", metavar="ID", help=f"the sources to rerun (default: all): {', '.join(SOURCES)}")
    sub.add_parser("check", help="check that the docs carry every figure as recorded")
    args = parser.parse_args(argv)
    unknown = [i for i in getattr(args, "ids", ()) if i not in SOURCES]
    if unknown:
        parser.error(f"no source {', '.join(unknown)}; there are {', '.join(SOURCES)}")
    if args.what == "run":
        records = load_record() if RECORD.exists() else {}
        for i in args.ids or list(SOURCES):
            print(f"running {i}: gpukv {shlex.join(SOURCES[i].argv())}", file=sys.stderr, flush=True)
            records[i] = run_source(SOURCES[i])
        RECORD.write_text(json.dumps(dict(sorted(records.items())), indent=1) + "\n", encoding="utf-8")
    records = load_record()
    problems = [f"{s.doc}: does not write the command of {s.id}: {s.command}" for s in unnamed_commands()]
    problems += [f"{q.file} should say (from {q.source}):\n{q.text}" for q in missing_quotes(records)]
    print("\n\n".join(problems) if problems else "every figure the docs quote is as recorded")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
