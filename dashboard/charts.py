"""Small server-side SVG charts (no JavaScript, no CDN). Every label is escaped."""

from __future__ import annotations

from markupsafe import Markup, escape

COLOURS = ("#2f5bd3", "#e0a100", "#c62f3a")


def _fmt(v: float) -> str:
    return f"{v:.3g}" if v < 1000 else f"{v:,.0f}"


def columns(points: list[tuple[str, float]], title: str, unit: str = "", width: int = 720,
            height: int = 180) -> Markup:
    """Vertical bars, e.g. jobs per hour; every few labels shown so they never overlap."""
    top = max((v for _, v in points), default=0) or 1
    pad, base = 40, height - 24
    step = (width - pad) / max(len(points), 1)
    every = max(1, int(len(points) / (width / 60)))
    parts = [f'<svg class="chart" viewBox="0 0 {width} {height}" role="img" aria-label="{escape(title)}">',
             f'<text x="{pad}" y="12" class="t">{escape(title)}</text>',
             f'<text x="0" y="30" class="a">{_fmt(top)}{escape(unit)}</text>',
             f'<line x1="{pad}" y1="{base}" x2="{width}" y2="{base}" class="axis"/>']
    for i, (label, v) in enumerate(points):
        h = (base - 20) * v / top
        x = pad + i * step
        parts.append(f'<rect x="{x + 1:.1f}" y="{base - h:.1f}" width="{max(step - 2, 1):.1f}" height="{h:.1f}" '
                     f'fill="{COLOURS[0]}"><title>{escape(label)}: {_fmt(v)}{escape(unit)}</title></rect>')
        if i % every == 0:
            parts.append(f'<text x="{x:.1f}" y="{height - 8}" class="a">{escape(label)}</text>')
    parts.append("</svg>")
    return Markup("".join(parts))


def bars(rows: list[tuple[str, list[float]]], series: list[str], title: str, unit: str = "",
         width: int = 720) -> Markup:
    """Horizontal bars, one group per row (e.g. a task) and one bar per series."""
    label_w, bar_h, gap = 200, 12, 10
    top = max((v for _, vs in rows for v in vs if v is not None), default=0) or 1
    group_h = bar_h * len(series) + gap
    height = 40 + group_h * len(rows)
    parts = [f'<svg class="chart" viewBox="0 0 {width} {height}" role="img" aria-label="{escape(title)}">',
             f'<text x="0" y="12" class="t">{escape(title)}</text>']
    for j, s in enumerate(series):
        parts.append(f'<rect x="{label_w + j * 90}" y="20" width="10" height="10" fill="{COLOURS[j % 3]}"/>'
                     f'<text x="{label_w + 14 + j * 90}" y="29" class="a">{escape(s)}</text>')
    for i, (label, values) in enumerate(rows):
        y0 = 40 + i * group_h
        parts.append(f'<text x="0" y="{y0 + bar_h * len(series) / 2 + 4:.1f}" class="l">{escape(label[:32])}</text>')
        for j, v in enumerate(values):
            w = (width - label_w - 70) * (v or 0) / top
            y = y0 + j * bar_h
            text = f"{_fmt(v or 0)}{escape(unit)}"
            parts.append(f'<rect x="{label_w}" y="{y}" width="{w:.1f}" height="{bar_h - 2}" fill="{COLOURS[j % 3]}">'
                         f'<title>{escape(label)} {escape(series[j])}: {text}</title></rect>'
                         f'<text x="{label_w + w + 4:.1f}" y="{y + bar_h - 3}" class="a">{text}</text>')
    parts.append("</svg>")
    return Markup("".join(parts))
