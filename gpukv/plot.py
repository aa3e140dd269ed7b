"""A dependency-free SVG of a replay: token hit rate over the steps (so far,
cumulative) and the manager's time per step."""

from __future__ import annotations

from xml.sax.saxutils import escape

_W, _H, _PAD = 720, 220, 48


def _panel(values: list[float], top: int, title: str, unit: str) -> str:
    n = len(values)
    hi = max(values) if values and max(values) > 0 else 1.0
    x = lambda i: _PAD + (_W - 2 * _PAD) * (i / max(n - 1, 1))  # noqa: E731
    y = lambda v: top + _H - _PAD / 2 - (_H - _PAD) * (v / hi)  # noqa: E731
    # Long runs: one point per pixel column is all a 720-pixel plot can show.
    stride = max(1, n // (_W - 2 * _PAD))
    pts = " ".join(f"{x(i):.1f},{y(values[i]):.1f}" for i in range(0, n, stride))
    base = top + _H - _PAD / 2
    return (
        f'<text x="{_PAD}" y="{top + 16}" font-size="14">{escape(title)}</text>'
        f'<line x1="{_PAD}" y1="{base}" x2="{_W - _PAD}" y2="{base}" stroke="#888"/>'
        f'<line x1="{_PAD}" y1="{top + _PAD / 2}" x2="{_PAD}" y2="{base}" stroke="#888"/>'
        f'<text x="4" y="{top + _PAD / 2 + 4}" font-size="11">{hi:.3g}{escape(unit)}</text>'
        f'<text x="4" y="{base}" font-size="11">0</text>'
        f'<text x="{_W - _PAD}" y="{base + 16}" font-size="11" text-anchor="end">step {n - 1}</text>'
        f'<polyline fill="none" stroke="#1f77b4" stroke-width="1.5" points="{pts}"/>'
    )


def replay_svg(report: dict) -> str:
    """The SVG text for a replay report (``Replay.run()``'s dict)."""
    hit = report.get("hit_rate_per_step", [])
    ms = report.get("step_ms", [])
    s = report["summary"]
    title = f"gpukv replay ({s['backend']}): token hit rate {s['token_hit_rate']:.4f}"
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{_W}" height="{2 * _H + 30}" font-family="sans-serif">'
        f'<rect width="100%" height="100%" fill="white"/>'
        f'<text x="{_PAD}" y="20" font-size="15" font-weight="bold">{escape(title)}</text>'
        + _panel(hit, 30, "token hit rate so far", "")
        + _panel(ms, 30 + _H, "manager time per step", " ms")
        + "</svg>"
    )
