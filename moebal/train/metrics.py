"""`metrics.jsonl` (one JSON object per logged step) and the per-step routing summary.

Routing statistics are taken from every MoE layer at one point per step (`LocalStep._routing_step`,
moebal/train/local.py), reduced across ranks there by a hook when the run is distributed, and turned into plain
numbers here.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from moebal.routing import RoutingStats
from moebal.routing.stats import read_all

__all__ = ["MetricsLog", "metric_lines", "read_metrics", "read_routing", "routing_record"]


def read_routing(stats: Iterable[RoutingStats]) -> list[dict[str, Any]]:
    """Per-layer routing statistics as plain numbers (the step's one host sync of them)."""
    return read_all(list(stats))


def routing_record(per_layer: list[dict[str, Any]]) -> dict[str, Any]:
    """The metrics fields for one step: per-layer lists, layer order as in the model."""
    if not per_layer:
        return {}
    return {
        "load_max": [s["max_load"] for s in per_layer],
        "load_mean": [round(s["mean_load"], 4) for s in per_layer],
        "load_imbalance": [round(s["imbalance"], 4) for s in per_layer],
        "dropped": [s["dropped"] for s in per_layer],
        # share of tokens that used more than one expert (adaptive gating varies it; fixed top-k>1 gives 1)
        # (the shares past the first, not 1 - the first: a layer that routed no token shares nothing)
        "multi_expert_share": [round(sum(s["used_k_share"][1:]), 4) for s in per_layer],
        "expert_counts": [s["counts"] for s in per_layer],
    }


class MetricsLog:
    """Appends one line per record and flushes it, so a crash loses at most the line being written."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._f = open(path, "a", encoding="utf-8")  # noqa: SIM115 - closed in close()

    def write(self, record: dict[str, Any]) -> None:
        self._f.write(json.dumps(record, separators=(",", ":")) + "\n")
        self._f.flush()

    def close(self) -> None:
        self._f.close()

    @staticmethod
    def truncate_after(path: Path, step: int) -> None:
        """Drop lines of steps after `step` (a resumed run re-logs them), rewriting the file atomically. Line by
        line: a long run's lines (per-layer expert counts, placements) are never all in memory at once."""
        if not path.is_file():
            return
        tmp = path.with_suffix(".jsonl.tmp")
        with open(tmp, "w", encoding="utf-8") as f:
            for line, record in metric_lines(path):
                if record.get("step", 0) <= step:
                    f.write(line if line.endswith("\n") else line + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)


def metric_lines(path: Path) -> Iterator[tuple[str, dict[str, Any]]]:
    """Each line of a .jsonl log with its record, one at a time (a long run's lines are never all in memory); a
    torn line (a crash mid-write) is skipped."""
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(record, dict):
                yield line, record


def read_metrics(path: Path, keys: Iterable[str] | None = None) -> list[dict[str, Any]]:
    """Records of a metrics.jsonl; a torn last line (a crash mid-write) is ignored. With `keys`, each record
    keeps only those of its keys (a reader's part of lines that can be large)."""
    wanted = None if keys is None else frozenset(keys)
    return [r if wanted is None else {k: v for k, v in r.items() if k in wanted} for _, r in metric_lines(path)]
