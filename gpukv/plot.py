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
    steps: the token hit rate so far (every admission), blocks in use, and
    the manager's time per step on a log scale."""
    plt = require()
    fmt = check_path(path)
    s = report["summary"]
    hit = report.get("hit_rate_per_step", [])
    blocks = report.get("blocks_in_use", [])
    ms = report.get("step_ms", [])
    fig, axes = plt.subplots(3, 1, figsize=(8, 8), sharex=True, constrained_layout=True)
    fig.suptitle(f"gpukv replay ({s['backend']}): prefix cache hit rate {s['prefix_cache_hit_rate']:.4f}")
    axes[0].plot(hit, color="tab:blue")
    axes[0].set_ylabel("token hit rate so far")
    axes[1].plot(blocks, color="tab:green")
    axes[1].set_ylabel("blocks in use")
    axes[2].plot([max(x, 1e-4) for x in ms], color="tab:orange", linewidth=0.8)
    axes[2].set_yscale("log")
    axes[2].set_ylabel("manager time per step (ms)")
    axes[2].set_xlabel("step")
    for ax in axes:
        ax.grid(True, alpha=0.3)
    fig.savefig(path, format=fmt)
    plt.close(fig)


def sweep_figure(result: dict, path: str | Path) -> None:
    """A capacity sweep (``gpukv.sweep.run_sweep``'s dict): hit rate against
    cache capacity, with the ceiling of a pool that never evicts."""
    plt = require()
    fmt = check_path(path)
    points = result["points"]
    unit = result["capacity_unit"]
    xs = [p["capacity"] for p in points]
    fig, ax = plt.subplots(figsize=(7, 4.5), constrained_layout=True)
    ax.plot(xs, [p["prefix_cache_hit_rate"] for p in points], "o-", label="prefix cache hit rate (vLLM's)")
    ax.plot(xs, [p["first_admission_hit_rate"] for p in points], "s--", alpha=0.7,
            label="first admission of each request")
    rejecting = [p for p in points if p["rejected"]]
    if rejecting:  # such a pool served fewer requests: not comparable with the others
        ax.plot([p["capacity"] for p in rejecting], [p["prefix_cache_hit_rate"] for p in rejecting], "x",
                color="red", markersize=10, label="pool too small for some requests (rejected)")
    ceiling = result["ceiling"]
    ax.axhline(ceiling["prefix_cache_hit_rate"], color="black", linestyle=":",
               label=f"ceiling (no eviction): {ceiling['prefix_cache_hit_rate']:.3f}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel(f"KV-cache capacity ({unit})")
    ax.set_ylabel("hit rate (tokens)")
    ax.set_ylim(bottom=0)
    ax.set_title(f"{result['trace']}: {result['num_requests']} requests, {result['block_size']}-token blocks")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(loc="lower right")
    fig.savefig(path, format=fmt)
    plt.close(fig)
