"""Small server-side SVG charts (no JavaScript, no CDN). Every label is escaped. Values are
written in readable units by a formatter (durations(), count(), percent()), never as
`2.9e-05`; colours come from CSS classes (style.css), so that they follow the light or
dark colour scheme."""

from __future__ import annotations

import math
from collections.abc import Callable

from markupsafe import Markup, escape

#: How a chart writes a value: a number and its unit.
Format = Callable[[float], str]


def _trim(v: float) -> str:
    """Three significant digits at most, without a trailing ".0": 2.5, 25, 250, 1,250."""
    if abs(v) >= 1000:
        return f"{v:,.0f}"
    return f"{v:.3g}" if abs(v) >= 1 or v == 0 else f"{v:.2g}"


def seconds(s: float) -> str:
    """A duration in the unit that reads best: 29 µs, 4.2 ms, 2.5 s, 12 min, 3.1 h, 2.2 d."""
    a = abs(s)
    if a == 0:
        return "0 s"
    for unit, size in (("d", 86400.0), ("h", 3600.0), ("min", 60.0), ("s", 1.0), ("ms", 1e-3), ("µs", 1e-6)):
        if a >= size:
            return f"{_trim(s / size)} {unit}"
    return f"{_trim(s * 1e9)} ns"


def count(v: float) -> str:
    """A count: 7, 12.5k, 3.4M."""
    a = abs(v)
    if a >= 1e6:
        return f"{_trim(v / 1e6)}M"
    if a >= 1e4:
        return f"{_trim(v / 1e3)}k"
    return _trim(v)


def percent(v: float) -> str:
    """A percentage given as 0-100: 0.5%, 12%."""
    return f"{_trim(v)}%"


def per(unit: str, fmt: Format = count) -> Format:
    """A rate: `per("h")` writes 1,200 as "1,200/h"."""
    return lambda v: f"{fmt(v)}/{unit}"


def nice(top: float) -> float:
    """The smallest of 1, 2, 2.5, 5 times a power of ten at or above `top` (an axis' end)."""
    if top <= 0:
        return 1.0
    power = 10.0 ** int(f"{top:e}".split("e")[1])
    for m in (1, 2, 2.5, 5, 10):
        if top <= m * power * (1 + 1e-9):
            return m * power
    return 10 * power


def columns(points: list[tuple[str, float]], title: str, fmt: Format = count, axis: str = "",
            width: int = 720, height: int = 200) -> Markup:
    """Vertical bars, e.g. jobs per hour, with the value axis (`axis`: its label, e.g.
    "jobs/h") ruled at 0, half and top; every few labels shown so they never overlap."""
    top = nice(max((v for _, v in points), default=0))
    pad, base, head = 56, height - 24, 34
    step = (width - pad) / max(len(points), 1)
    every = max(1, int(len(points) / (width / 60)) + 1)
    parts = [f'<svg class="chart" viewBox="0 0 {width} {height}" role="img" aria-label="{escape(title)}">',
             f'<text x="0" y="12" class="t">{escape(title)}</text>']
    if axis:
        parts.append(f'<text x="0" y="26" class="a">{escape(axis)}</text>')
    for tick in (0.0, top / 2, top):
        y = base - (base - head) * tick / top
        rule = "axis" if tick == 0 else "grid"
        parts.append(f'<line x1="{pad}" y1="{y:.1f}" x2="{width}" y2="{y:.1f}" class="{rule}"/>'
                     f'<text x="{pad - 4}" y="{y + 3:.1f}" class="a" text-anchor="end">{escape(fmt(tick))}</text>')
    for i, (label, v) in enumerate(points):
        h = (base - head) * v / top
        x = pad + i * step
        parts.append(f'<rect x="{x + 1:.1f}" y="{base - h:.1f}" width="{max(step - 2, 1):.1f}" height="{h:.1f}" '
                     f'class="s0"><title>{escape(label)}: {escape(fmt(v))}</title></rect>')
        if i % every == 0:
            parts.append(f'<text x="{x:.1f}" y="{height - 8}" class="a">{escape(label)}</text>')
    parts.append("</svg>")
    return Markup("".join(parts))


def bars(rows: list[tuple[str, list[float | None]]], series: list[str], title: str, fmt: Format = count,
         width: int = 720, log: bool = False) -> Markup:
    """Horizontal bars, one group per row (e.g. a task) and one bar per series, each with
    its value written by `fmt` (e.g. seconds: "4.2 ms"); a missing value shows as "-".
    `log`: bar lengths on a log scale, for values that span powers of ten (runtimes from
    µs to minutes), from a tenth of the smallest positive value."""
    label_w, bar_h, gap = 200, 13, 10
    values = [v for _, vs in rows for v in vs if v is not None]
    top = max(values, default=0) or 1
    low = min((v for v in values if v > 0), default=1) / 10
    span = math.log10(top / low) if log and top > low else 1.0

    def length(v: float | None) -> float:
        if not v or v <= 0:
            return 0.0
        return (width - label_w - 80) * (math.log10(v / low) / span if log else v / top)

    group_h = bar_h * len(series) + gap
    height = 44 + group_h * len(rows)
    parts = [f'<svg class="chart" viewBox="0 0 {width} {height}" role="img" aria-label="{escape(title)}">',
             f'<text x="0" y="12" class="t">{escape(title)}</text>']
    for j, s in enumerate(series):
        parts.append(f'<rect x="{label_w + j * 90}" y="22" width="10" height="10" class="s{j % 3}"/>'
                     f'<text x="{label_w + 14 + j * 90}" y="31" class="a">{escape(s)}</text>')
    for i, (label, row_values) in enumerate(rows):
        y0 = 44 + i * group_h
        parts.append(f'<text x="0" y="{y0 + bar_h * len(series) / 2 + 4:.1f}" class="l">{escape(label[:32])}'
                     f'<title>{escape(label)}</title></text>')
        for j, v in enumerate(row_values):
            w = length(v)
            y = y0 + j * bar_h
            text = escape(fmt(v) if v is not None else "-")
            parts.append(f'<rect x="{label_w}" y="{y}" width="{w:.1f}" height="{bar_h - 2}" class="s{j % 3}">'
                         f'<title>{escape(label)} {escape(series[j])}: {text}</title></rect>'
                         f'<text x="{label_w + w + 4:.1f}" y="{y + bar_h - 3}" class="a">{text}</text>')
    parts.append("</svg>")
    return Markup("".join(parts))
