"""Per-stage timelines (Gantt charts) of one pipeline iteration, before and after rebalancing.

A timeline is a list of rows (stage, kind, micro-batch, start, end), kind 0 = forward, 1 = backward and 2 =
deferred weight gradients (the zero-bubble schedule's W), times in seconds from the iteration's first op
(`PipelineRunner` keeps one before the first adopted plan and one after the latest). `write_gantt` writes the run
directory's SVG; `draw_gantt` draws on a matplotlib axis for the benchmark scripts (matplotlib: the dev extra).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["draw_gantt", "timeline_stats", "write_gantt"]

Row = Sequence[float]


def timeline_stats(rows: Sequence[Row]) -> dict[str, Any]:
    """Makespan, per-stage busy time and the bubble ratio 1 - busy / (stages x makespan) of a timeline."""
    if not rows:
        return {"makespan_s": 0.0, "busy_s": [], "bubble_ratio": 0.0}
    stages = sorted({int(r[0]) for r in rows})
    makespan = max(r[4] for r in rows) - min(r[3] for r in rows)
    busy = [sum(r[4] - r[3] for r in rows if int(r[0]) == s) for s in stages]
    bubble = 1.0 - sum(busy) / max(len(stages) * makespan, 1e-12)
    return {"makespan_s": makespan, "busy_s": busy, "bubble_ratio": bubble}


def draw_gantt(ax: Any, rows: Sequence[Row], title: str = "", xmax: float | None = None) -> None:
    """One timeline on a matplotlib axis: a lane per stage, forwards light, backwards dark, weight gradients
    (W) orange, micro-batch numbers."""
    stages = sorted({int(r[0]) for r in rows})
    lane = {s: i for i, s in enumerate(stages)}
    for stage, kind, mb, start, end in rows:
        y = lane[int(stage)]
        color = _KIND_COLOUR[int(kind)]
        ax.barh(y, end - start, left=start, height=0.8, color=color, edgecolor="white", linewidth=0.4)
        if end - start > 0.02 * (xmax or max(r[4] for r in rows)):
            ax.text((start + end) / 2, y, str(int(mb)), ha="center", va="center", fontsize=6,
                    color="white" if kind == 1 else "black")
    st = timeline_stats(rows)
    ax.set_yticks(range(len(stages)), [f"stage {s}" for s in stages])
    ax.invert_yaxis()
    ax.set_xlabel("seconds")
    if xmax is not None:
        ax.set_xlim(0, xmax)
    ax.set_title(f"{title}  (iteration {st['makespan_s'] * 1e3:.0f} ms, bubble {st['bubble_ratio']:.0%})",
                 fontsize=9)


def write_gantt(before: Sequence[Row], after: Sequence[Row], path: str | Path, title: str = "") -> Path:
    """Two timelines on a shared time axis, as an SVG (`moebal.train.svg`: no plotting library needed)."""
    from moebal.train.svg import Bars, Figure

    panels = [(rows, name) for rows, name in ((before, "before rebalancing"), (after, "after")) if rows]
    xmax = max((r[4] for rows, _ in panels for r in rows), default=1.0)
    lanes = max((len({int(r[0]) for r in rows}) for rows, _ in panels), default=1)
    fig = Figure(cols=1, cell=(900.0, 70.0 + 26.0 * lanes))
    for rows, name in panels:
        stages = sorted({int(r[0]) for r in rows})
        lane = {s: i for i, s in enumerate(stages)}
        st = timeline_stats(rows)
        label = f"{title} {name}".strip()
        fig.add(Bars(f"{label}  (iteration {st['makespan_s'] * 1e3:.0f} ms, bubble {st['bubble_ratio']:.0%})",
                     [f"stage {s}" for s in stages],
                     [(lane[int(stage)], start, end, _KIND_COLOUR[int(kind)], str(int(mb)))
                      for stage, kind, mb, start, end in rows], xlabel="seconds", xmax=xmax))
    return fig.write(path)


_KIND_COLOUR = ("#9ecae1", "#3182bd", "#fd8d3c")  # forward, backward, deferred weight gradients (W)
