"""Figures of a replay and of a capacity sweep, with matplotlib (the optional
``plot`` extra). The output format follows the file's extension (``.png``,
``.svg``, ``.pdf``); without matplotlib, ``require_matplotlib()`` raises an
``ImportError`` whose message names the extra."""

from __future__ import annotations

from pathlib import Path
from typing import Any

EXTRA_HINT = "pip install matplotlib (or pip install -e '.[plot]' in a gpukv clone)"
FORMATS = (".png", ".svg", ".pdf")


def require_matplotlib() -> Any:
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
    time per step on a log scale (marked when Triton's interpreter ran it).
    Legends sit above their panels, off the curves."""
    plt = require_matplotlib()
    fmt = check_path(path)
    s = report["summary"]
    c = report.get("config", {})
    fig, axes = plt.subplots(3, 1, figsize=(8, 8.5), sharex=True, constrained_layout=True)
    fig.suptitle(_replay_title(s), fontsize="medium")
    _hit_rate_panel(axes[0], s, report.get("prefix_cache_hit_rate_per_step", []))
    _blocks_panel(axes[1], report.get("blocks_in_use", []), c.get("num_blocks"))
    ms = report.get("step_ms", [])
    axes[2].plot([max(x, 1e-4) for x in ms], color="tab:orange", linewidth=0.8)
    axes[2].set_yscale("log")
    axes[2].set_ylabel("manager time per step (ms)" + (",\nINTERPRETED (no CUDA)" if c.get("interpreted") else ""))
    axes[2].set_xlabel("step")
    for ax in axes:
        ax.grid(True, alpha=0.3)
    _save(fig, path, fmt)
    plt.close(fig)


def _comparable(s: dict) -> bool:
    """Whether the rate and its ceiling cover the same requests (the ceiling
    leaves out only what max_model_len rejects)."""
    served = s["requests"] - s.get("rejected", 0)
    return s.get("prefix_cache_hit_rate_ceiling_requests", s["requests"]) == served


def _replay_title(s: dict) -> str:
    """The headline, as the summary words it; a line each for rejections and preemptions."""
    ceiling = s.get("prefix_cache_hit_rate_ceiling")
    title = f"gpukv replay ({s['backend']}): prefix cache hit rate {s['prefix_cache_hit_rate']:.4f}"
    if ceiling is not None and _comparable(s):
        title += f" of a possible {ceiling:.4f}"
    if s.get("rejected"):
        served = s["requests"] - s["rejected"]
        title += f"\n{s['rejected']:,} of {s['requests']:,} requests rejected: the rate covers the {served:,} served"
        if ceiling is not None and not _comparable(s):
            title += (f",\nNOT COMPARABLE with the possible {ceiling:.4f}, which covers "
                      f"{s.get('prefix_cache_hit_rate_ceiling_requests', s['requests']):,}")
    if s.get("preemptions"):
        title += f"\n{s['preemptions']:,} preemptions: pool oversubscribed {s.get('peak_demand_over_pool', 0):.1f}x"
    return title


def _legend_above(ax) -> None:
    """The panel's legend above it, on one row when it fits the width."""
    labels = ax.get_legend_handles_labels()[1]
    ax.legend(loc="lower left", bbox_to_anchor=(0, 1.0), ncol=2 if sum(map(len, labels)) < 90 else 1,
              fontsize="small", frameon=False, borderaxespad=0.2)


def _hit_rate_panel(ax, s: dict, hit: list) -> None:
    ceiling = s.get("prefix_cache_hit_rate_ceiling")
    ax.plot(hit, color="tab:blue", label="prefix cache hit rate so far (vLLM's)")
    if ceiling is not None:
        label = f"ceiling, a cache that never evicts: {ceiling:.4f}"
        if not _comparable(s):
            label += f" (over all {s.get('prefix_cache_hit_rate_ceiling_requests', s['requests']):,} requests)"
        ax.axhline(ceiling, color="black", linestyle=":", label=label)
    ax.set_ylabel("prefix cache hit rate")
    ax.set_ylim(bottom=0)
    _legend_above(ax)


def _blocks_panel(ax, blocks: list, num_blocks: int | None) -> None:
    """Blocks in use against the pool; a pool far larger than the most ever in
    use is named, not drawn, so that the curve keeps the panel's height."""
    ax.plot(blocks, color="tab:green", label="blocks in use")
    most = max(blocks, default=0)
    if num_blocks:  # every block but the null block can be in use
        pool = f"the pool: {num_blocks:,} blocks, the null block included ({num_blocks - 1:,} for tokens)"
        if most * 2 >= num_blocks - 1:
            ax.axhline(num_blocks - 1, color="black", linestyle=":", label=pool)
        else:
            ax.plot([], [], " ", label=f"the pool, {num_blocks:,} blocks, is off this scale: at most "
                    f"{most / (num_blocks - 1):.1%} in use")
    ax.set_ylim(bottom=0)
    ax.yaxis.set_major_formatter(_thousands())
    ax.set_ylabel("blocks in use")
    _legend_above(ax)


def _thousands():
    from matplotlib.ticker import FuncFormatter

    return FuncFormatter(lambda x, _pos: f"{x:,.0f}")


def sweep_figure(result: dict, path: str | Path) -> None:
    """A capacity sweep (``gpukv.tools.sweep.run_sweep``'s dict): hit rate against
    cache capacity, with the ceiling of a cache that never evicts; sizes that
    cannot hold ``max_model_len`` or rejected requests are marked. The
    capacity axis is logarithmic, its ticks the sizes swept, in the sweep's unit."""
    plt = require_matplotlib()
    fmt = check_path(path)
    points = result["points"]
    unit = result["capacity_unit"]
    xs = [p["capacity"] for p in points]
    fig, ax = plt.subplots(figsize=(8, 6), constrained_layout=True)
    ax.plot(xs, [p["prefix_cache_hit_rate"] for p in points], "o-", label="prefix cache hit rate (vLLM's)")
    ax.plot(xs, [p["first_admission_hit_rate"] for p in points], "s--", alpha=0.7,
            label="first admission of each request")
    flagged = [p for p in points if p["rejected"] or not p.get("holds_max_model_len", True)]
    if flagged:  # such a pool served fewer requests: not comparable with the others
        ax.plot([p["capacity"] for p in flagged], [p["prefix_cache_hit_rate"] for p in flagged], "x",
                color="red", markersize=12, markeredgewidth=2,
                label=f"not comparable: < max_model_len {result.get('max_model_len', 0):,}, or rejected requests")
        for p in flagged:
            ax.annotate(f"{p['rejected']:,} rejected" if p["rejected"] else "< max_model_len",
                        (p["capacity"], p["prefix_cache_hit_rate"]), textcoords="offset points", xytext=(0, 10),
                        ha="center", color="red", fontsize="small")
    _mark_preemptions(ax, points)
    ceiling = result["ceiling"]
    ax.axhline(ceiling["prefix_cache_hit_rate"], color="black", linestyle=":",
               label=f"ceiling, a cache that never evicts: {ceiling['prefix_cache_hit_rate']:.3f}")
    ticks = sorted({*xs, ceiling["capacity"]})
    ax.plot([ceiling["capacity"]], [ceiling["prefix_cache_hit_rate"]], "*", color="black", markersize=12,
            label=f"a cache that never evicts holds {_capacity_label(ceiling['capacity'], unit)} {unit}")
    ax.set_xscale("log")
    ax.set_xticks(ticks, [_capacity_label(x, unit) for x in ticks])
    ax.minorticks_off()
    ax.set_xlabel(f"KV-cache capacity ({unit})")
    ax.set_ylabel("hit rate (tokens)")
    ax.set_ylim(bottom=0)
    ax.set_title(f"{result['trace']}: {result['num_requests']} requests, {result['block_size']}-token blocks")
    ax.grid(True, which="major", alpha=0.3)
    fig.legend(loc="outside lower center", ncol=2, fontsize="small", frameon=False)  # below, off the points
    _save(fig, path, fmt)
    plt.close(fig)


def _mark_preemptions(ax, points: list[dict]) -> None:
    """Each size where requests were preempted, and how many times, under its point."""
    preempted = [p for p in points if p.get("preemptions")]
    if not preempted:
        return
    ax.plot([p["capacity"] for p in preempted], [p["prefix_cache_hit_rate"] for p in preempted], "o", color="none",
            markeredgecolor="tab:purple", markersize=11, markeredgewidth=1.5,
            label="preempted at that size: the pool oversubscribed")
    for p in preempted:
        ax.annotate(f"{p['preemptions']:,} preempted", (p["capacity"], p["prefix_cache_hit_rate"]),
                    textcoords="offset points", xytext=(0, -18), ha="center", color="tab:purple", fontsize="small",
                    bbox={"boxstyle": "round,pad=0.1", "facecolor": "white", "edgecolor": "none", "alpha": 0.8})


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
