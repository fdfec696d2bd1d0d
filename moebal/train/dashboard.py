"""`dashboard.png`: loss curves, expert placement, communication per step (exposed time, all-to-all, gradient
all-reduce) and, per MoE layer, each expert's share of the routed load over steps."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["write_dashboard"]


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
    """Plot a run's metrics records; matplotlib (Agg) is imported only here."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train = [r for r in records if "loss" in r]
    val = [r for r in records if r.get("val_loss") is not None]
    counts = [r for r in train if r.get("expert_counts")]
    n_layers = len(counts[-1]["expert_counts"]) if counts else 0
    placed = [r for r in train if r.get("rank_imbalance_before")]
    comm = [r for r in train if r.get("exposed_comm_s") is not None]
    cols = min(max(n_layers, 1), 4)
    rows = 1 + (n_layers + cols - 1) // cols if n_layers else 1
    rows += 1 if comm else 0
    fig = plt.figure(figsize=(4 * cols + 2, 3.2 * rows))
    grid = fig.add_gridspec(rows, cols)
    ax = fig.add_subplot(grid[0, :] if not placed or cols < 2 else grid[0, : cols - 1])
    if placed and cols >= 2:
        _placement_panel(fig.add_subplot(grid[0, cols - 1]), placed)
    steps = np.array([r["step"] for r in train])
    loss = np.array([r["loss"] for r in train], dtype=float)
    ax.plot(steps, loss, color="tab:blue", alpha=0.25, lw=0.8)
    ax.plot(steps, _smooth(loss, max(len(loss) // 50, 1)), color="tab:blue", label="train")
    if val:
        ax.plot([r["step"] for r in val], [r["val_loss"] for r in val], "o-", color="tab:orange", label="validation")
    if entropy:
        ax.axhline(entropy, color="grey", ls="--", lw=0.8, label=f"unigram entropy {entropy:.2f}")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token)")
    ax.set_title(title or "loss")
    ax.legend(loc="upper right")
    ax.grid(alpha=0.3)
    if comm:
        _comm_panel(fig.add_subplot(grid[1, :]), comm)
    first = 2 if comm else 1
    for layer in range(n_layers):
        a = fig.add_subplot(grid[first + layer // cols, layer % cols])
        share = np.array([r["expert_counts"][layer] for r in counts], dtype=float)
        share /= np.maximum(share.sum(axis=1, keepdims=True), 1.0)
        E = share.shape[1]
        im = a.imshow(share.T * E, aspect="auto", cmap="magma", interpolation="nearest", vmin=0.0,
                      extent=(counts[0]["step"] - 0.5, counts[-1]["step"] + 0.5, E - 0.5, -0.5))
        a.set_title(f"MoE layer {layer}: load / mean")
        a.set_xlabel("step")
        a.set_ylabel("expert")
        fig.colorbar(im, ax=a)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def _comm_panel(ax: Any, recs: list[dict[str, Any]]) -> None:
    """Per step (mean over ranks): time the compute thread waited on communication, and the time each kind of
    collective was in flight (overlapped with compute or not), next to the step time."""
    steps = [r["step"] for r in recs]
    span = max(len(steps) // 50, 1)
    series = (("comm_window_s", "whole step (with Trans and bookkeeping)", "grey"),
              ("exposed_comm_s", "exposed communication", "tab:red"),
              ("a2a_s", "all-to-all in flight", "tab:blue"),
              ("allreduce_s", "gradient all-reduce in flight", "tab:green"),
              ("placement_comm_s", "Trans/Agg in flight", "tab:purple"))
    for key, label, color in series:
        y = np.array([r.get(key, np.nan) for r in recs], dtype=float)
        if np.isfinite(y).any():
            ax.plot(steps, 1e3 * _smooth(y, span), color=color, label=label, lw=1.2 if key != "comm_window_s" else 0.8)
    ax.set_xlabel("step")
    ax.set_ylabel("ms per step")
    ax.set_title("communication (mean over ranks)")
    ax.legend(loc="upper right", fontsize=8, ncol=3)
    ax.grid(alpha=0.3)


def _placement_panel(ax: Any, placed: list[dict[str, Any]]) -> None:
    """Rank load max/mean (mean over MoE layers) before and after each step's expert placement."""
    steps = [r["step"] for r in placed]
    before = np.array([np.mean(r["rank_imbalance_before"]) for r in placed])
    after = np.array([np.mean(r["rank_imbalance_after"]) for r in placed])
    span = max(len(steps) // 50, 1)
    ax.plot(steps, _smooth(before, span), color="tab:red", label="plain expert parallel")
    ax.plot(steps, _smooth(after, span), color="tab:green", label="after placement")
    ax.axhline(1.0, color="grey", ls="--", lw=0.8)
    ax.set_xlabel("step")
    ax.set_ylabel("rank load max / mean")
    ax.set_title("expert placement")
    ax.legend(loc="upper right", fontsize=8)
    ax.grid(alpha=0.3)
