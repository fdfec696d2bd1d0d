"""Fit on one part of a paper's results, score on the rest: the bookkeeping every reproduction script shares.

A reproduction is judged on rows it never saw while fitting. `fit_choice` receives only the fitting rows and
refuses any other; `evaluate` splits the rows by table, fits, and scores the held-out rows against a per-column
constant baseline (each column's median over the fitting rows). A reproduction counts as reproduced only where
its held-out mean absolute relative error beats that baseline's: a simulator that only gets the size of a
table's numbers, not the differences between its rows, does not beat it.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np


@dataclasses.dataclass(frozen=True)
class PaperRow:
    """One number copied from a paper."""

    table: str
    """Which table or figure it comes from (the unit of the fit/hold-out split)."""
    column: str
    """Which quantity (e.g. the system whose speed-up it is); constant baselines are per column."""
    label: str
    """The row within the table (e.g. "k=1 S")."""
    paper: float
    """The paper's value."""

    @property
    def id(self) -> str:
        return f"{self.table}/{self.column}/{self.label}"


def ranks(x: Sequence[float]) -> np.ndarray:
    """Ranks 1..n, ties sharing their mean rank (as Spearman's coefficient needs)."""
    a = np.asarray(x, dtype=float)
    order = np.argsort(a, kind="stable")
    r = np.empty(len(a))
    r[order] = np.arange(1, len(a) + 1)
    for v in np.unique(a):
        tied = a == v
        r[tied] = r[tied].mean()
    return r


def spearman(x: Sequence[float], y: Sequence[float]) -> float:
    """Spearman rank correlation (Pearson on ranks); nan where either side is constant."""
    rx, ry = ranks(x), ranks(y)
    if len(rx) < 2 or rx.std() == 0 or ry.std() == 0:
        return float("nan")
    return float(np.corrcoef(rx, ry)[0, 1])


def score(rows: Sequence[PaperRow], pred: Mapping[str, float]) -> dict[str, Any]:
    """Errors of `pred` (row id -> value) on `rows`: mean and median absolute relative error, rows within 25 %
    and the rank correlation with the paper."""
    paper = [r.paper for r in rows]
    sim = [pred[r.id] for r in rows]
    err = [abs(s - p) / p for s, p in zip(sim, paper)]
    return {"rows": len(rows), "mean_abs_rel_error": statistics.fmean(err), "median_abs_rel_error":
            statistics.median(err), "within_25pct": sum(e <= 0.25 for e in err), "spearman": spearman(sim, paper)}


def split(rows: Sequence[PaperRow], fit_tables: Sequence[str]) -> tuple[list[PaperRow], list[PaperRow]]:
    """(fitting rows, held-out rows)."""
    return [r for r in rows if r.table in fit_tables], [r for r in rows if r.table not in fit_tables]


def fit_choice(rows: Sequence[PaperRow], candidates: Mapping[str, Mapping[str, float]],
               fit_tables: Sequence[str]) -> dict[str, Any]:
    """The candidate model (name -> row id -> simulated value) with the least mean absolute relative error on
    `rows`, which must all come from `fit_tables`: a held-out row here raises, so no choice sees them."""
    stray = [r.id for r in rows if r.table not in fit_tables]
    if stray:
        raise ValueError(f"fit_choice got held-out rows {stray[:3]}; pass only rows of tables {list(fit_tables)}")
    errors = {name: score(rows, pred)["mean_abs_rel_error"] for name, pred in candidates.items()}
    return {"choice": min(errors, key=errors.__getitem__), "fit_error_per_candidate": errors,
            "fit_tables": list(fit_tables), "fit_rows": [r.id for r in rows]}


def column_medians(rows: Sequence[PaperRow]) -> dict[str, float]:
    """Each column's median paper value over `rows` (the constant baseline's only parameters)."""
    cols = sorted({r.column for r in rows})
    return {c: statistics.median(r.paper for r in rows if r.column == c) for c in cols}


def leave_one_out_medians(rows: Sequence[PaperRow]) -> dict[str, float]:
    """Each row predicted by the median of the other rows of its column: a constant baseline for a reproduction
    with no fitting rows, which never sees the row it predicts."""
    return {r.id: statistics.median(o.paper for o in rows if o.column == r.column and o is not r) for r in rows}


def judge(held: Sequence[PaperRow], pred: Mapping[str, float], baselines: Mapping[str, Mapping[str, float]]
          ) -> dict[str, Any]:
    """Held-out scores of `pred` and of each constant baseline; reproduced only where `pred` beats them all."""
    out: dict[str, Any] = {"held_out": score(held, pred),
                           "baselines": {k: score(held, b) for k, b in baselines.items()}}
    out["reproduced"] = bool(all(out["held_out"]["mean_abs_rel_error"] < b["mean_abs_rel_error"]
                                 for b in out["baselines"].values()))
    return out


def evaluate(rows: Sequence[PaperRow], candidates: Mapping[str, Mapping[str, float]],
             fit_tables: Sequence[str]) -> dict[str, Any]:
    """Fit on `fit_tables`' rows, then score the chosen candidate in sample and on every other row, beside the
    fitting rows' column medians predicting the held-out rows."""
    fit_rows, held = split(rows, fit_tables)
    fitted = fit_choice(fit_rows, candidates, fit_tables)
    pred = candidates[fitted["choice"]]
    medians = column_medians(fit_rows)
    const = {r.id: medians[r.column] for r in held}
    return {"fit": fitted, "in_sample": score(fit_rows, pred), "constant_baseline_medians": medians,
            **judge(held, pred, {"column_medians_of_fit_rows": const})}
