"""A small SVG plotter for the run directory's charts (`dashboard.svg`, `pipeline.svg`): line panels, heat maps
and horizontal bars, written as text with the standard library.

The charts are written at the end of every run, so they must cost little and need nothing beyond the core
dependencies: matplotlib is not one of them (a run without it used to fail at its very end), and rendering a
PNG with it took 0.6-0.9 s of CPU per run. An SVG of a few hundred elements is written in milliseconds and opens
in any browser.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar
from xml.sax.saxutils import escape

from moebal.fileio import write_text_whole

__all__ = ["Bars", "Figure", "HeatMap", "Lines", "nice_ticks"]

PALETTE = {"tab:blue": "#1f77b4", "tab:orange": "#ff7f0e", "tab:green": "#2ca02c", "tab:red": "#d62728",
           "tab:purple": "#9467bd", "grey": "#808080"}
# magma at 0, 0.25, 0.5, 0.75, 1 (the heat maps' colour scale)
_MAGMA = ((0, 0, 4), (81, 18, 124), (183, 55, 121), (252, 137, 97), (252, 253, 191))
_PAD_L, _PAD_R, _PAD_T, _PAD_B = 58, 14, 24, 36


def nice_ticks(lo: float, hi: float, n: int = 5) -> list[float]:
    """About `n` round tick values inside [lo, hi] (1, 2, 2.5 or 5 times a power of ten apart)."""
    if not (math.isfinite(lo) and math.isfinite(hi)) or hi <= lo:
        return [lo] if math.isfinite(lo) else []
    raw = (hi - lo) / max(n - 1, 1)
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw)
    first = math.ceil(lo / step - 1e-9) * step
    return [first + i * step for i in range(int((hi - first) / step + 1e-9) + 1)]


def _fmt(v: float) -> str:
    return f"{v:.4g}"


def _colour(name: str) -> str:
    return PALETTE.get(name, name)


def _magma(x: float) -> str:
    x = min(max(x, 0.0), 1.0) * (len(_MAGMA) - 1)
    i = min(int(x), len(_MAGMA) - 2)
    f = x - i
    a, b = _MAGMA[i], _MAGMA[i + 1]
    return "#" + "".join(f"{round(a[k] + f * (b[k] - a[k])):02x}" for k in range(3))


@dataclass
class Lines:
    """A panel of line series: (x, y, colour, label, width, markers); NaN values break a line."""

    title: str
    xlabel: str = ""
    ylabel: str = ""
    series: list[tuple[Sequence[float], Sequence[float], str, str, float, bool]] = field(default_factory=list)
    hlines: list[tuple[float, str, str]] = field(default_factory=list)  # (y, colour, label)
    span: int = 1  # grid columns the panel takes

    def add(self, x: Iterable[float], y: Iterable[float], colour: str, label: str = "", width: float = 1.5,
            markers: bool = False) -> None:
        self.series.append((list(x), [float(v) for v in y], colour, label, width, markers))

    def hline(self, y: float, colour: str = "grey", label: str = "") -> None:
        self.hlines.append((float(y), colour, label))

    def draw(self, w: float, h: float) -> list[str]:
        pts = [(x, y) for xs, ys, *_ in self.series for x, y in zip(xs, ys) if math.isfinite(y)]
        if not pts:
            return _frame(w, self.title) + [_text(w / 2, h / 2, "no data", anchor="middle")]
        x0, x1 = min(p[0] for p in pts), max(p[0] for p in pts)
        ys = [p[1] for p in pts] + [y for y, _, _ in self.hlines]
        y0, y1 = min(ys), max(ys)
        if x1 <= x0:
            x0, x1 = x0 - 0.5, x1 + 0.5
        pad = 0.05 * (y1 - y0) if y1 > y0 else max(abs(y0) * 0.05, 0.5)
        y0, y1 = y0 - pad, y1 + pad
        ax = _Axes(w, h, x0, x1, y0, y1)
        out = _frame(w, self.title) + ax.grid(self.xlabel, self.ylabel)
        for y, colour, _ in self.hlines:
            out.append(f'<line x1="{ax.px(x0):.1f}" y1="{ax.py(y):.1f}" x2="{ax.px(x1):.1f}" y2="{ax.py(y):.1f}" '
                       f'stroke="{_colour(colour)}" stroke-width="1" stroke-dasharray="5,3"/>')
        for xs, ys_, colour, _, width, markers in self.series:
            for run in _runs(xs, ys_):
                d = " ".join(f"{ax.px(x):.1f},{ax.py(y):.1f}" for x, y in run)
                out.append(f'<polyline fill="none" stroke="{_colour(colour)}" stroke-width="{width}" points="{d}"/>')
                if markers:
                    out += [f'<circle cx="{ax.px(x):.1f}" cy="{ax.py(y):.1f}" r="2.5" fill="{_colour(colour)}"/>'
                            for x, y in run]
        legend = [(label, colour) for _, _, colour, label, _, _ in self.series if label]
        legend += [(label, colour) for _, colour, label in self.hlines if label]
        return out + _legend(w, legend)


@dataclass
class HeatMap:
    """A panel of cells: `values[i][j]` for step `steps[i]` and row j (e.g. expert j), coloured from 0 to `vmax`."""

    title: str
    steps: Sequence[float]
    values: Sequence[Sequence[float]]
    xlabel: str = "step"
    ylabel: str = ""
    vmax: float | None = None
    span: int = 1

    def draw(self, w: float, h: float) -> list[str]:
        if not self.values or not self.values[0]:
            return _frame(w, self.title) + [_text(w / 2, h / 2, "no data", anchor="middle")]
        n, rows = len(self.values), len(self.values[0])
        x0, x1 = float(self.steps[0]) - 0.5, float(self.steps[-1]) + 0.5
        ax = _Axes(w - 40, h, x0, x1, rows - 0.5, -0.5)
        vmax = self.vmax or max(max(r) for r in self.values) or 1.0
        out = _frame(w, self.title)
        cw = (ax.px(x1) - ax.px(x0)) / n
        ch = (ax.py(rows - 0.5) - ax.py(-0.5)) / rows
        for i, row in enumerate(self.values):
            for j, v in enumerate(row):
                out.append(f'<rect x="{ax.px(x0) + i * cw:.1f}" y="{ax.py(-0.5) + j * ch:.1f}" width="{cw + 0.3:.1f}" '
                           f'height="{ch + 0.3:.1f}" fill="{_magma(v / vmax)}"/>')
        out += ax.grid(self.xlabel, self.ylabel, yticks=list(range(rows)) if rows <= 16 else None, lines=False)
        # the colour scale, 0 to vmax
        sx, top, bottom = w - 30, _PAD_T, h - _PAD_B
        for k in range(20):
            out.append(f'<rect x="{sx}" y="{bottom - (k + 1) * (bottom - top) / 20:.1f}" width="10" '
                       f'height="{(bottom - top) / 20 + 0.3:.1f}" fill="{_magma((k + 0.5) / 20)}"/>')
        out += [_text(sx + 5, top - 4, _fmt(vmax), anchor="middle", size=9),
                _text(sx + 5, bottom + 11, "0", anchor="middle", size=9)]
        return out


@dataclass
class Bars:
    """A panel of horizontal bars in lanes: (lane, start, end, colour, text); a Gantt chart."""

    title: str
    lanes: Sequence[str]
    bars: Sequence[tuple[int, float, float, str, str]]
    xlabel: str = ""
    xmax: float | None = None
    span: int = 1

    def draw(self, w: float, h: float) -> list[str]:
        x1 = self.xmax or max((b[2] for b in self.bars), default=1.0)
        n = max(len(self.lanes), 1)
        ax = _Axes(w, h, 0.0, x1 if x1 > 0 else 1.0, n - 0.5, -0.5)
        out = _frame(w, self.title) + ax.grid(self.xlabel, "", yticks=[], lines=False)
        lane_h = (ax.py(n - 0.5) - ax.py(-0.5)) / n
        for j, name in enumerate(self.lanes):
            out.append(_text(_PAD_L - 4, ax.py(j) + 3, name, anchor="end", size=9))
        for lane, start, end, colour, label in self.bars:
            x, y = ax.px(start), ax.py(-0.5) + lane * lane_h + 0.1 * lane_h
            bw = max(ax.px(end) - x, 0.5)
            out.append(f'<rect x="{x:.1f}" y="{y:.1f}" width="{bw:.1f}" height="{0.8 * lane_h:.1f}" '
                       f'fill="{_colour(colour)}" stroke="white" stroke-width="0.4"/>')
            if label and bw > 14:
                out.append(_text(x + bw / 2, y + 0.4 * lane_h + 3, label, anchor="middle", size=8))
        return out


Panel = Lines | HeatMap | Bars
P = TypeVar("P", Lines, HeatMap, Bars)


class Figure:
    """Panels on a grid of `cols` columns, filled row by row (a panel may span several columns)."""

    def __init__(self, title: str = "", cols: int = 1, cell: tuple[float, float] = (420.0, 260.0)) -> None:
        self.title, self.cols, self.cell = title, max(cols, 1), cell
        self.rows: list[list[Panel]] = [[]]

    def add(self, panel: P) -> P:
        used = sum(p.span for p in self.rows[-1])
        if used + panel.span > self.cols:
            self.rows.append([])
        self.rows[-1].append(panel)
        return panel

    def new_row(self) -> None:
        if self.rows[-1]:
            self.rows.append([])

    def svg(self) -> str:
        cw, ch = self.cell
        rows = [r for r in self.rows if r]
        head = 28 if self.title else 0
        W, H = cw * self.cols, head + ch * len(rows)
        out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W:.0f}" height="{H:.0f}" '
               f'viewBox="0 0 {W:.0f} {H:.0f}" font-family="sans-serif">',
               f'<rect width="{W:.0f}" height="{H:.0f}" fill="white"/>']
        if self.title:
            out.append(_text(W / 2, 19, self.title, anchor="middle", size=14))
        for i, row in enumerate(rows):
            x = 0.0
            for panel in row:
                w = cw * panel.span
                out.append(f'<g transform="translate({x:.0f},{head + i * ch:.0f})">')
                out += panel.draw(w, ch)
                out.append("</g>")
                x += w
        out.append("</svg>")
        return "\n".join(out) + "\n"

    def write(self, path: str | Path) -> Path:
        """Write the SVG whole (a temporary file renamed over `path`)."""
        return write_text_whole(path, self.svg())


class _Axes:
    """Data to pixel coordinates inside a panel of w x h (y grows downwards on screen)."""

    def __init__(self, w: float, h: float, x0: float, x1: float, y0: float, y1: float) -> None:
        self.w, self.h, self.x0, self.x1, self.y0, self.y1 = w, h, x0, x1, y0, y1

    def px(self, x: float) -> float:
        return _PAD_L + (x - self.x0) / (self.x1 - self.x0) * (self.w - _PAD_L - _PAD_R)

    def py(self, y: float) -> float:
        return self.h - _PAD_B - (y - self.y0) / (self.y1 - self.y0) * (self.h - _PAD_T - _PAD_B)

    def grid(self, xlabel: str, ylabel: str, yticks: list[float] | None = None, lines: bool = True) -> list[str]:
        lo, hi = min(self.y0, self.y1), max(self.y0, self.y1)
        out = [f'<rect x="{_PAD_L}" y="{_PAD_T}" width="{self.w - _PAD_L - _PAD_R:.1f}" '
               f'height="{self.h - _PAD_T - _PAD_B:.1f}" fill="none" stroke="#444" stroke-width="0.8"/>']
        for x in nice_ticks(self.x0, self.x1):
            px = self.px(x)
            if lines:
                out.append(f'<line x1="{px:.1f}" y1="{_PAD_T}" x2="{px:.1f}" y2="{self.h - _PAD_B:.1f}" '
                           'stroke="#ddd" stroke-width="0.6"/>')
            out.append(_text(px, self.h - _PAD_B + 13, _fmt(x), anchor="middle", size=9))
        for y in nice_ticks(lo, hi) if yticks is None else yticks:
            py = self.py(y)
            if lines:
                out.append(f'<line x1="{_PAD_L}" y1="{py:.1f}" x2="{self.w - _PAD_R:.1f}" y2="{py:.1f}" '
                           'stroke="#ddd" stroke-width="0.6"/>')
            out.append(_text(_PAD_L - 4, py + 3, _fmt(y), anchor="end", size=9))
        if xlabel:
            out.append(_text((_PAD_L + self.w - _PAD_R) / 2, self.h - 6, xlabel, anchor="middle", size=10))
        if ylabel:
            cy = (_PAD_T + self.h - _PAD_B) / 2
            out.append(f'<text x="12" y="{cy:.1f}" font-size="10" text-anchor="middle" '
                       f'transform="rotate(-90 12 {cy:.1f})">{escape(ylabel)}</text>')
        return out


def _frame(w: float, title: str) -> list[str]:
    return [_text(w / 2, 15, title, anchor="middle", size=11)] if title else []


def _text(x: float, y: float, s: str, anchor: str = "start", size: int = 10) -> str:
    return f'<text x="{x:.1f}" y="{y:.1f}" font-size="{size}" text-anchor="{anchor}">{escape(s)}</text>'


def _legend(w: float, items: list[tuple[str, str]]) -> list[str]:
    out = []
    for k, (label, colour) in enumerate(items):
        y = _PAD_T + 10 + 13 * k
        x = w - _PAD_R - 8 - 6 * max(len(label) for label, _ in items) - 22
        out.append(f'<line x1="{x:.1f}" y1="{y - 3}" x2="{x + 16:.1f}" y2="{y - 3}" stroke="{_colour(colour)}" '
                   'stroke-width="2"/>')
        out.append(_text(x + 20, y, label, size=9))
    return out


def _runs(xs: Sequence[float], ys: Sequence[float]) -> list[list[tuple[float, float]]]:
    """The stretches of finite points (a NaN ends a stretch)."""
    runs: list[list[tuple[float, float]]] = [[]]
    for x, y in zip(xs, ys):
        if math.isfinite(y):
            runs[-1].append((float(x), y))
        elif runs[-1]:
            runs.append([])
    return [r for r in runs if r]
