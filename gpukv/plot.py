"""Figures of a replay and of a capacity sweep, with matplotlib (the optional
``plot`` extra). The output format follows the file's extension (``.png``,
``.svg``, ``.pdf``); without matplotlib, ``require()`` raises an
``ImportError`` whose message names the extra."""

from __future__ import annotations

from pathlib import Path
from typing import Any

EXTRA_HINT = "pip install 'gpukv[plot]' (matplotlib)"
FORMATS = (".png", ".svg", ".pdf")


def require() -> Any:
    """``matplotlib.pyplot`` on a file-only backend, or an ImportError naming the extra."""
    try:
        import matplotlib
    except ImportError:
        raise ImportError(f"plots need the 'plot' extra: {EXTRA_HINT}") from None
    matplotlib.use("Agg")  # files only: no display, none needed
    matplotlib.rcParams["svg.fonttype"] = "none"  # SVG text stays text (searchable, smaller)
    matplotlib.rcParams["svg.hashsalt"] = "gpukv"  # the SVG's element ids the same each time, not random
    import matplotlib.pyplot as plt

    return plt


def check_path(path: str | Path) -> str:
    """The format of ``path`` from its extension, or a ValueError saying which are known."""
    suffix = Path(path).suffix.lower()
    if suffix not in FORMATS:
        raise ValueError(f"{path}: the plot's format comes from its extension, one of "
                         f"{', '.join(FORMATS)}; got {suffix or 'none'}")
    return suffix[1:]


def replay_figure(report: dict, path: str | Path) -> None:
    """A replay report (``Replay.run()``'s dict) as three panels over the
    steps: vLLM's prefix cache hit rate so far beside its ceiling (a cache
    that never evicts), blocks in use against the pool, and the manager's
    time per step on a log scale (marked when Triton's interpreter ran it)."""
    plt = require()
    fmt = check_path(path)
    s = report["summary"]
    c = report.get("config", {})
    hit = report.get("prefix_cache_hit_rate_per_step", [])
    blocks = report.get("blocks_in_use", [])
    ms = report.get("step_ms", [])
    ceiling = s.get("prefix_cache_hit_rate_ceiling")
    fig, axes = plt.subplots(3, 1, figsize=(8, 8), sharex=True, constrained_layout=True)
    title = f"gpukv replay ({s['backend']}): prefix cache hit rate {s['prefix_cache_hit_rate']:.4f}"
    if ceiling is not None:
        title += f" of a possible {ceiling:.4f}"
    if s.get("preemptions"):
        title += f"\n{s['preemptions']:,} preemptions: pool oversubscribed {s.get('peak_demand_over_pool', 0):.1f}x"
    fig.suptitle(title)
    axes[0].plot(hit, color="tab:blue", label="prefix cache hit rate so far (vLLM's)")
    if ceiling is not None:
        axes[0].axhline(ceiling, color="black", linestyle=":",
                        label=f"ceiling, a cache that never evicts: {ceiling:.4f}")
    axes[0].set_ylabel("prefix cache hit rate")
    axes[0].set_ylim(bottom=0)
    axes[0].legend(loc="lower right", fontsize="small")
    axes[1].plot(blocks, color="tab:green", label="blocks in use")
    if c.get("num_blocks"):  # every block but the null block can be in use
        n = c["num_blocks"]
        axes[1].axhline(n - 1, color="black", linestyle=":",
                        label=f"the pool: {n:,} blocks, the null block included ({n - 1:,} for tokens)")
        axes[1].legend(loc="lower right", fontsize="small")
    axes[1].set_ylabel("blocks in use")
    axes[2].plot([max(x, 1e-4) for x in ms], color="tab:orange", linewidth=0.8)
    axes[2].set_yscale("log")
    axes[2].set_ylabel("manager time per step (ms)" + (",\nINTERPRETED (no CUDA)" if c.get("interpreted") else ""))
    axes[2].set_xlabel("step")
    for ax in axes:
        ax.grid(True, alpha=0.3)
    _save(fig, path, fmt)
    plt.close(fig)


def sweep_figure(result: dict, path: str | Path) -> None:
    """A capacity sweep (``gpukv.sweep.run_sweep``'s dict): hit rate against
    cache capacity, with the ceiling of a cache that never evicts; sizes that
    cannot hold ``max_model_len`` or rejected requests are marked. The
    capacity axis is logarithmic, its ticks the sizes swept, in the sweep's unit."""
    plt = require()
    fmt = check_path(path)
    points = result["points"]
    unit = result["capacity_unit"]
    xs = [p["capacity"] for p in points]
    fig, ax = plt.subplots(figsize=(7, 4.5), constrained_layout=True)
    ax.plot(xs, [p["prefix_cache_hit_rate"] for p in points], "o-", label="prefix cache hit rate (vLLM's)")
    ax.plot(xs, [p["first_admission_hit_rate"] for p in points], "s--", alpha=0.7,
            label="first admission of each request")
    flagged = [p for p in points if p["rejected"] or not p.get("holds_max_model_len", True)]
    if flagged:  # such a pool served fewer requests: not comparable with the others
        ax.plot([p["capacity"] for p in flagged], [p["prefix_cache_hit_rate"] for p in flagged], "x",
                color="red", markersize=12, markeredgewidth=2,
                label=f"not comparable: cannot hold max_model_len {result.get('max_model_len', 0):,} "
                "or rejected requests")
        for p in flagged:
            ax.annotate(f"{p['rejected']:,} rejected" if p["rejected"] else "< max_model_len",
                        (p["capacity"], p["prefix_cache_hit_rate"]), textcoords="offset points", xytext=(0, 10),
                        ha="center", color="red", fontsize="small")
    ceiling = result["ceiling"]
    ax.axhline(ceiling["prefix_cache_hit_rate"], color="black", linestyle=":",
               label=f"ceiling, a cache that never evicts: {ceiling['prefix_cache_hit_rate']:.3f}")
    ax.set_xscale("log")
    ax.set_xticks(xs, [_capacity_label(x, unit) for x in xs])
    ax.minorticks_off()
    ax.set_xlabel(f"KV-cache capacity ({unit})")
    ax.set_ylabel("hit rate (tokens)")
    ax.set_ylim(bottom=0)
    ax.set_title(f"{result['trace']}: {result['num_requests']} requests, {result['block_size']}-token blocks")
    ax.grid(True, which="major", alpha=0.3)
    ax.legend(loc="lower right", fontsize="small")
    _save(fig, path, fmt)
    plt.close(fig)


def _save(fig, path: str | Path, fmt: str) -> None:
    """Write the figure; an SVG or PDF without its date, so the same run
    draws the same file (``docs/sweep_builtin.svg`` is one)."""
    metadata = {"svg": {"Date": None}, "pdf": {"CreationDate": None}}.get(fmt)
    fig.savefig(path, format=fmt, metadata=metadata)


def _capacity_label(x: float, unit: str) -> str:
    """A tick in the user's unit: 8, 16, 32 GiB as written; tokens with k and M."""
    if unit != "tokens":
        return f"{x:g}"
    for scale, suffix in ((1e6, "M"), (1e3, "k")):
        if x >= scale:
            return f"{x / scale:.3g}{suffix}"
    return f"{x:g}"
