"""`dashboard.svg`: loss curves, expert placement, communication per step (exposed time, all-to-all, gradient
all-reduce) and, per MoE layer, each expert's share of the routed load over steps. Drawn by `moebal.train.svg`
(no plotting library: a run needs only the core dependencies, and the chart costs milliseconds)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from moebal.train.metrics import metric_lines
from moebal.train.svg import Figure, HeatMap, Lines

__all__ = ["HEATMAP_STEPS", "read_dashboard_records", "write_dashboard"]

HEATMAP_STEPS = 256
"""The most steps an expert-load heat map draws, evenly spaced over the run: one cell per step, expert and MoE
layer would make a 100k-step run's chart gigabytes."""
DASHBOARD_KEYS = ("step", "loss", "val_loss", "expert_counts", "rank_imbalance_before", "rank_imbalance_after",
                  "comm_window_s", "exposed_comm_s", "a2a_s", "allreduce_s", "placement_comm_s")
"""What the chart reads of a metrics record."""


def _every_other(records: list[dict[str, Any]], most: int) -> list[dict[str, Any]]:
    """Every k-th record (the first kept), k the smallest power of 2 that leaves at most `most`."""
    stride = 1
    while len(records) > most * stride:
        stride *= 2
    return records[::stride]


def read_dashboard_records(path: Path) -> list[dict[str, Any]]:
    """The chart's part of a metrics.jsonl, line by line: each record's `DASHBOARD_KEYS`, and per-layer expert
    counts on at most `HEATMAP_STEPS` evenly spaced records (every 2^j-th, j growing with the run), so that a long
    run's counts are never all in memory. A torn line is skipped."""
    out: list[dict[str, Any]] = []
    counted: list[dict[str, Any]] = []  # the records still holding counts: every `stride`-th counted record
    stride, seen = 1, 0
    for _, full in metric_lines(path):
        r = {k: full[k] for k in DASHBOARD_KEYS if k in full}
        if r.get("expert_counts"):
            if seen % stride == 0:
                counted.append(r)
            else:
                del r["expert_counts"]
            seen += 1
            if len(counted) > 2 * HEATMAP_STEPS:  # keep every other: the stride doubles
                for dropped in counted[1::2]:
                    del dropped["expert_counts"]
                counted, stride = counted[::2], 2 * stride
        out.append(r)
    return out


def _smooth(y: np.ndarray, span: int) -> np.ndarray:
    if len(y) < 2 or span <= 1:
        return y
    alpha = 2.0 / (span + 1)
    out = np.empty_like(y)
    acc = y[0]
    for i, v in enumerate(y):
        acc = alpha * v + (1 - alpha) * acc
        out[i] = acc
    return out


def write_dashboard(records: list[dict[str, Any]], path: Path, entropy: float | None = None,
                    title: str = "") -> Path:
    """Chart a run's metrics records as an SVG at `path` (written whole: a temporary file renamed)."""
    train = [r for r in records if "loss" in r]
    val = [r for r in records if r.get("val_loss") is not None]
    counts = _every_other([r for r in train if r.get("expert_counts")], HEATMAP_STEPS)
    n_layers = len(counts[-1]["expert_counts"]) if counts else 0
    placed = [r for r in train if r.get("rank_imbalance_before")]
    comm = [r for r in train if r.get("exposed_comm_s") is not None]
    cols = min(max(n_layers, 1), 4)
    fig = Figure(cols=max(cols, 2) if placed else cols)
    loss_span = max(fig.cols - 1, 1) if placed else fig.cols
    ax = fig.add(Lines(title or "loss", "step", "loss (nats/token)", span=loss_span))
    steps = [r["step"] for r in train]
    loss = np.array([r["loss"] for r in train], dtype=float)
    ax.add(steps, loss, "tab:blue", width=0.8)
    ax.add(steps, _smooth(loss, max(len(loss) // 50, 1)), "tab:blue", "train")
    if val:
        ax.add([r["step"] for r in val], [r["val_loss"] for r in val], "tab:orange", "validation", markers=True)
    if entropy:
        ax.hline(entropy, "grey", f"unigram entropy {entropy:.2f}")
    if placed:
        fig.add(_placement_panel(placed))
    if comm:
        fig.new_row()
        fig.add(_comm_panel(comm, fig.cols))
    fig.new_row()
    for layer in range(n_layers):
        share = np.array([r["expert_counts"][layer] for r in counts], dtype=float)
        share /= np.maximum(share.sum(axis=1, keepdims=True), 1.0)
        E = share.shape[1]
        fig.add(HeatMap(f"MoE layer {layer}: load / mean", [r["step"] for r in counts], (share * E).tolist(),
                        ylabel="expert"))
    return fig.write(path)


def _comm_panel(recs: list[dict[str, Any]], span: int) -> Lines:
    """Per step (mean over ranks): time the compute thread waited on communication, and the time each kind of
    collective was in flight (overlapped with compute or not), next to the step time."""
    steps = [r["step"] for r in recs]
    smooth = max(len(steps) // 50, 1)
    panel = Lines("communication (mean over ranks)", "step", "ms per step", span=span)
    series = (("comm_window_s", "whole step (with Trans and bookkeeping)", "grey"),
              ("exposed_comm_s", "exposed communication", "tab:red"),
              ("a2a_s", "all-to-all in flight", "tab:blue"),
              ("allreduce_s", "gradient all-reduce in flight", "tab:green"),
              ("placement_comm_s", "Trans/Agg in flight", "tab:purple"))
    for key, label, color in series:
        y = np.array([r.get(key, np.nan) for r in recs], dtype=float)
        if np.isfinite(y).any():
            panel.add(steps, 1e3 * _smooth(y, smooth), color, label, width=1.2 if key != "comm_window_s" else 0.8)
    return panel


def _placement_panel(placed: list[dict[str, Any]]) -> Lines:
    """Rank load max/mean (mean over MoE layers) before and after each step's expert placement."""
    steps = [r["step"] for r in placed]
    before = np.array([np.mean(r["rank_imbalance_before"]) for r in placed])
    after = np.array([np.mean(r["rank_imbalance_after"]) for r in placed])
    span = max(len(steps) // 50, 1)
    panel = Lines("expert placement", "step", "rank load max / mean")
    panel.add(steps, _smooth(before, span), "tab:red", "plain expert parallel")
    panel.add(steps, _smooth(after, span), "tab:green", "after placement")
    panel.hline(1.0, "grey")
    return panel
