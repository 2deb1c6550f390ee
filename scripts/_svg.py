"""Line charts as SVG text, for the benchmark scripts: no plotting package needed, and the files diff as text.

`chart` draws panels side by side, each with series of (x, y) points on a log2 x axis, axis titles, a legend, and
point labels placed so that none overlaps another (a label that finds no free place within a few line heights is
left out; the CSV beside the plot has every value).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from html import escape

COLORS = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e")
MARKERS = ("circle", "square", "diamond", "triangle")
FONT = 12
CHAR = 0.58 * FONT
"""Approximate width of one character of a sans-serif font at FONT px: enough to keep labels apart."""


@dataclass
class Series:
    name: str
    points: list[tuple[float, float]]
    labels: list[str] = field(default_factory=list)
    """One per point (or none): drawn beside it where there is room."""
    line: bool = True
    """Joined by a line (a sweep), or markers alone (single published or measured figures)."""


@dataclass
class Panel:
    title: str
    x_title: str
    y_title: str
    series: list[Series]
    y_from_zero: bool = True


W, H = 460, 340
LEFT, RIGHT, TOP, BOTTOM = 78, 16, 34, 112


def _nice_ticks(lo: float, hi: float, n: int = 5) -> list[float]:
    span = hi - lo or abs(hi) or 1.0
    step = 10 ** math.floor(math.log10(span / n))
    for m in (1, 2, 2.5, 5, 10):
        if span / (m * step) <= n:
            step *= m
            break
    start = math.floor(lo / step) * step
    return [start + i * step for i in range(math.ceil((hi - start) / step - 1e-9) + 1)]  # the last at or above hi


def _fmt(v: float) -> str:
    if v == 0:
        return "0"
    if abs(v) >= 10_000:
        return f"{v:,.0f}"
    return f"{v:.4g}"


def _marker(kind: str, x: float, y: float, color: str) -> str:
    if kind == "circle":
        return f'<circle cx="{x:.1f}" cy="{y:.1f}" r="4" fill="{color}"/>'
    if kind == "square":
        return f'<rect x="{x - 4:.1f}" y="{y - 4:.1f}" width="8" height="8" fill="{color}"/>'
    if kind == "diamond":
        return f'<path d="M{x:.1f},{y - 5.5:.1f} l5.5,5.5 l-5.5,5.5 l-5.5,-5.5 z" fill="{color}"/>'
    return f'<path d="M{x:.1f},{y - 5.5:.1f} l5.5,9.5 l-11,0 z" fill="{color}"/>'


def _panel(p: Panel, ox: float) -> list[str]:
    xs = [x for s in p.series for x, _ in s.points]
    ys = [y for s in p.series for _, y in s.points]
    lx0, lx1 = math.log2(min(xs)), math.log2(max(xs))
    if lx0 == lx1:
        lx0, lx1 = lx0 - 1, lx1 + 1
    y0, y1 = (0.0 if p.y_from_zero else min(ys)), max(ys)
    ticks = _nice_ticks(y0, y1 if y1 > y0 else y0 + 1.0)
    y0, y1 = ticks[0], ticks[-1]
    pw, ph = W - LEFT - RIGHT, H - TOP - BOTTOM
    pad = 0.06 * (lx1 - lx0)

    def px(x: float) -> float:
        return ox + LEFT + (math.log2(x) - lx0 + pad) / (lx1 - lx0 + 2 * pad) * pw

    def py(y: float) -> float:
        return TOP + ph - (y - y0) / (y1 - y0 or 1.0) * ph

    out = [
        f'<text x="{ox + LEFT + pw / 2:.1f}" y="20" text-anchor="middle" font-weight="bold">{escape(p.title)}</text>'
    ]
    out.append(f'<rect x="{ox + LEFT}" y="{TOP}" width="{pw}" height="{ph}" fill="none" stroke="#444"/>')
    for t in ticks:
        y = py(t)
        out.append(f'<line x1="{ox + LEFT}" x2="{ox + LEFT + pw}" y1="{y:.1f}" y2="{y:.1f}" stroke="#ddd"/>')
        out.append(f'<text x="{ox + LEFT - 5}" y="{y + 4:.1f}" text-anchor="end">{_fmt(t)}</text>')
    for x in sorted(set(xs)):
        out.append(f'<text x="{px(x):.1f}" y="{TOP + ph + 16}" text-anchor="middle">{_fmt(x)}</text>')
    out.append(
        f'<text x="{ox + LEFT + pw / 2:.1f}" y="{TOP + ph + 34}" text-anchor="middle">{escape(p.x_title)}</text>'
    )
    cy = TOP + ph / 2
    out.append(
        f'<text x="{ox + 16}" y="{cy:.1f}" text-anchor="middle" transform="rotate(-90 {ox + 16} {cy:.1f})">'
        f"{escape(p.y_title)}</text>"
    )
    taken: list[tuple[float, float, float, float]] = []  # boxes of markers and placed labels
    for s in p.series:
        taken += [(px(x) - 6, py(y) - 6, px(x) + 6, py(y) + 6) for x, y in s.points]
    for i, s in enumerate(p.series):
        color, marker = COLORS[i % len(COLORS)], MARKERS[i % len(MARKERS)]
        pts = sorted(s.points)
        if s.line and len(pts) > 1:
            path = " ".join(f"{px(x):.1f},{py(y):.1f}" for x, y in pts)
            out.append(f'<polyline points="{path}" fill="none" stroke="{color}" stroke-width="1.5"/>')
        out += [_marker(marker, px(x), py(y), color) for x, y in s.points]
        for (x, y), label in zip(s.points, s.labels):
            if not label:
                continue
            box = _place(label, px(x), py(y), taken, (ox + LEFT, TOP, ox + LEFT + pw, TOP + ph))
            if box is not None:
                taken.append(box)
                out.append(f'<text x="{box[0]:.1f}" y="{box[3] - 3:.1f}" font-size="{FONT - 1}" fill="{color}">'
                           f"{escape(label)}</text>")  # fmt: skip
    ly = TOP + ph + 52
    for i, s in enumerate(p.series):  # the legend, one row per series under the axis title
        color, marker = COLORS[i % len(COLORS)], MARKERS[i % len(MARKERS)]
        y = ly + 17 * i
        if s.line:
            out.append(f'<line x1="{ox + LEFT}" x2="{ox + LEFT + 22}" y1="{y}" y2="{y}" stroke="{color}"/>')
        out.append(_marker(marker, ox + LEFT + 11, y, color))
        out.append(f'<text x="{ox + LEFT + 30}" y="{y + 4}">{escape(s.name)}</text>')
    return out


def _place(
    label: str, x: float, y: float, taken: list[tuple[float, float, float, float]], frame: tuple[float, ...]
) -> tuple[float, float, float, float] | None:
    """A box for `label` near (x, y) that overlaps no box in `taken` and stays inside `frame`, or None."""
    w, h = CHAR * len(label) * (FONT - 1) / FONT, FONT + 2
    for dy in (-h / 2 - 8, h / 2 + 8, -h / 2 - 8 - h, h / 2 + 8 + h, -h / 2 - 8 - 2 * h, h / 2 + 8 + 2 * h):
        for dx in (6, -w - 6, -w / 2):
            box = (x + dx, y + dy - h / 2, x + dx + w, y + dy + h / 2)
            inside = frame[0] <= box[0] and box[2] <= frame[2] and frame[1] <= box[1] and box[3] <= frame[3]
            if inside and not any(_overlap(box, t) for t in taken):
                return box
    return None


def _overlap(a: tuple[float, ...], b: tuple[float, ...]) -> bool:
    return a[0] < b[2] and b[0] < a[2] and a[1] < b[3] and b[1] < a[3]


def chart(panels: list[Panel], caption: str) -> str:
    """An SVG document of `panels` side by side, `caption` (the command that made it) at the bottom."""
    rows = max(len(p.series) for p in panels)
    height = H - BOTTOM + 52 + 17 * rows + 12
    width = W * len(panels)
    body = [line for i, p in enumerate(panels) for line in _panel(p, i * W)]
    body.append(f'<text x="8" y="{height - 8}" font-size="{FONT - 2}" fill="#555">{escape(caption)}</text>')
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" viewBox="0 0 {width} {height}" '
        f'font-family="DejaVu Sans, Arial, sans-serif" font-size="{FONT}">\n<rect width="100%" height="100%" fill="white"/>\n'
        + "\n".join(body)
        + "\n</svg>\n"
    )
