"""Per-stage cost of one micro-batch as a function of its shape: (rows b, padded length s) -> time, memory.

Shape legend: P = pipeline stages, NB = micro-batch sizes of the grid, NS = sequence lengths of the grid.

DynaPipe's planner needs, for a micro-batch of b samples padded to s tokens, every stage's forward and
backward time and the activation bytes the stage keeps for the backward (§3 of the paper). Both come from
a table on a grid of powers of two, b = 1, 2, 4, ... and s = 16, 32, ..., read between grid points by
bilinear interpolation (the reference code's `RegularGridInterpolator`). The grid is ragged: a shape is
profiled only when b x s fits the token cap, so large b at long s is absent. A query is
  * exact at a grid point, bilinear between four present grid points;
  * for s below the smallest grid length: the smallest length's value (an upper bound; padding is rounded
    up to a multiple of 8 anyway);
  * **infeasible** (time and memory = +inf, `feasible` False) when b or s lies beyond the profiled range or
    any of the four corners is absent. The planner never puts such a micro-batch in a plan, and the CLI
    says which shape fell outside the table and how to widen it.
Linear interpolation in s overestimates a quadratic (attention) between grid points: conservative.

Lockstep ranks (`spread`, set by `spread_over`): when R ranks split every micro-batch's rows and must run the
same micro-batches together (expert shards of a stage exchanging tokens, or a stage's ranks summing routing
statistics), a micro-batch of b rows costs what its busiest rank's ceil(b / R) rows cost one rank, and one of
fewer than R rows is infeasible: no rank ever runs a micro-batch empty.

Two sources fill a table:
  * `analytic_table`: the hardware-profile CostModel (planner/cost.py) per layer, for dry runs of paper
    clusters (the GPT setting of the DynaPipe paper on A100s);
  * `moebal.pipeline.microbatch_profile.profile_table`: real forward+backward runs of each stage on this machine.
Tables serialise to JSON (`save`, `load`), so a profile is measured once and reused.

The module is pure numpy (no torch): planning workers import it without starting torch.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from moebal.errors import ConfigError
from moebal.fileio import read_json, write_text_whole

__all__ = ["MIN_GRID_LEN", "MicroBatchCost", "analytic_table", "default_grid", "load_cost", "stage_scale"]

MIN_GRID_LEN = 16
"""The cost grid's smallest padded length: a shorter micro-batch costs what one of this length does."""


def default_grid(max_len: int, max_tokens: int, min_len: int = MIN_GRID_LEN) -> tuple[np.ndarray, np.ndarray]:
    """Powers of two: s from min_len up to (and including) max_len, b from 1 while b x s <= max_tokens."""
    if max_len < 1 or max_tokens < max_len:
        raise ConfigError(f"cost grid: max_len ({max_len}) must be >= 1 and max_tokens ({max_tokens}) >= max_len")
    if max_tokens < min_len:  # not even one row of the smallest length fits: every shape would be infeasible
        raise ConfigError(f"cost grid: max_tokens ({max_tokens}) must be at least the grid's smallest length "
                          f"({min_len}), or no shape fits the table")
    s = [min_len]
    while s[-1] < max_len:
        s.append(min(2 * s[-1], max_len))
    b = [1]
    while 2 * b[-1] * min_len <= max_tokens:
        b.append(2 * b[-1])
    return np.asarray(b, dtype=np.int64), np.asarray(s, dtype=np.int64)


@dataclass(frozen=True)
class MicroBatchCost:
    """Per-stage forward/backward seconds and activation bytes on a (b, s) grid; NaN marks absent points."""

    b_grid: np.ndarray
    s_grid: np.ndarray
    fwd_PBS: np.ndarray
    bwd_PBS: np.ndarray
    act_PBS: np.ndarray
    """Bytes a stage keeps for the backward of one micro-batch (its stored activations)."""
    source: str = ""
    """Where the numbers come from (a profile name, 'measured on HOST', ...)."""
    meta: dict[str, Any] = field(default_factory=dict, compare=False)
    spread: int = 1
    """Lockstep ranks that split each micro-batch's rows (module docstring); the table's values are one rank's.
    Not serialised: the planner's `lockstep` argument sets it."""

    def __post_init__(self) -> None:
        if self.spread < 1:
            raise ConfigError(f"cost table: spread must be at least 1 rank; got {self.spread}")
        P, NB, NS = self.fwd_PBS.shape
        if self.bwd_PBS.shape != (P, NB, NS) or self.act_PBS.shape != (P, NB, NS):
            raise ConfigError("cost table: fwd, bwd and act must have the same [stages, b, s] shape")
        if len(self.b_grid) != NB or len(self.s_grid) != NS or NB < 1 or NS < 1:
            raise ConfigError(f"cost table: grid of {len(self.b_grid)} x {len(self.s_grid)} for values {NB} x {NS}")
        if np.any(np.diff(self.b_grid) <= 0) or np.any(np.diff(self.s_grid) <= 0) or self.b_grid[0] < 1:
            raise ConfigError("cost table: grid values must be positive and strictly increasing")

    @property
    def stages(self) -> int:
        return int(self.fwd_PBS.shape[0])

    @property
    def max_len(self) -> int:
        return int(self.s_grid[-1])

    @property
    def rows_grid(self) -> np.ndarray:
        """Micro-batch row counts at the grid points: b_grid rows on each of the `spread` lockstep ranks."""
        return self.b_grid * self.spread

    def spread_over(self, ranks: int) -> MicroBatchCost:
        """This table for micro-batches whose rows `ranks` lockstep ranks split (module docstring)."""
        return self if ranks == self.spread else replace(self, spread=int(ranks))

    def scaled(self, scale: Any) -> MicroBatchCost:
        """This table with stage p's forward and backward times times scale[p] (a dynamism scheme's prediction,
        `stage_scale`); the activation bytes as they are. None, or every factor 1: this table."""
        if scale is None:
            return self
        f = np.asarray(scale, dtype=np.float64)
        if f.shape != (self.stages,) or not np.all(np.isfinite(f)) or np.any(f <= 0):
            raise ConfigError(f"cost table: a stage scale needs {self.stages} positive factors; got {list(scale)}")
        if np.all(f == 1.0):
            return self
        return replace(self, fwd_PBS=self.fwd_PBS * f[:, None, None], bwd_PBS=self.bwd_PBS * f[:, None, None],
                       meta={**self.meta, "scheme_scale": f.tolist()})

    def max_rows(self, s: int) -> int:
        """The largest profiled micro-batch row count at length s (0 if none)."""
        ok = self.feasible(self.rows_grid, np.full(len(self.b_grid), s))
        return int(self.rows_grid[ok].max()) if ok.any() else 0

    # ---- queries (vectorised: b and s broadcast) ----
    def _interp(self, table: np.ndarray, b: Any, s: Any) -> np.ndarray:
        """[P, *shape] bilinear values; +inf outside the profiled range."""
        rows = np.asarray(b, dtype=np.float64)
        s = np.asarray(s, dtype=np.float64)
        # b and s keep their own shapes until they meet (a [G, 1] x [1, K] query does its per-axis work per axis)
        shape = np.broadcast_shapes(rows.shape, s.shape)
        b = np.ceil(rows / self.spread)  # the busiest lockstep rank's rows
        bg, sg = self.b_grid.astype(np.float64), self.s_grid.astype(np.float64)
        s_c = np.maximum(s, sg[0])  # shorter than the grid: the shortest length's value (an upper bound)
        out_of_range = (b < bg[0]) | (b > bg[-1]) | (s_c > sg[-1]) | (s < 1) | (rows < self.spread)
        ib = np.clip(np.searchsorted(bg, b, side="right") - 1, 0, max(len(bg) - 2, 0))
        is_ = np.clip(np.searchsorted(sg, s_c, side="right") - 1, 0, max(len(sg) - 2, 0))
        ib1 = np.minimum(ib + 1, len(bg) - 1)
        is1 = np.minimum(is_ + 1, len(sg) - 1)
        wb = np.where(ib1 > ib, (b - bg[ib]) / np.where(ib1 > ib, bg[ib1] - bg[ib], 1.0), 0.0)
        ws = np.where(is1 > is_, (s_c - sg[is_]) / np.where(is1 > is_, sg[is1] - sg[is_], 1.0), 0.0)
        wb, ws = np.clip(wb, 0.0, 1.0), np.clip(ws, 0.0, 1.0)
        total = np.zeros((table.shape[0],) + shape)
        flat = table.reshape(table.shape[0], -1)  # corners by flat index: np.take gathers faster than [:, cb, cs]
        absent, present = np.isnan(flat), np.nan_to_num(flat, nan=0.0)
        for cb, cs, w in ((ib, is_, (1 - wb) * (1 - ws)), (ib1, is_, wb * (1 - ws)),
                          (ib, is1, (1 - wb) * ws), (ib1, is1, wb * ws)):
            at = cb * len(sg) + cs
            used = w > 0
            bad = absent.take(at, axis=1) & used
            total = np.where(bad, np.inf, total + np.where(used, present.take(at, axis=1) * w, 0.0))
        return np.where(out_of_range, np.inf, total)

    def stage_times(self, b: Any, s: Any) -> tuple[np.ndarray, np.ndarray]:
        """(forward, backward) seconds per stage, each [P, *shape]; +inf where infeasible."""
        return self._interp(self.fwd_PBS, b, s), self._interp(self.bwd_PBS, b, s)

    def stage_memory(self, b: Any, s: Any) -> np.ndarray:
        """Stored activation bytes per stage, [P, *shape]; +inf where infeasible."""
        return self._interp(self.act_PBS, b, s)

    def time(self, b: Any, s: Any) -> np.ndarray:
        """t(M) of the DP: the bottleneck stage's forward + backward seconds (stages are balanced for the
        average micro-batch; the slowest one sets the pipeline's pace). +inf where infeasible."""
        f, bw = self.stage_times(b, s)
        bottleneck: np.ndarray = (f + bw).max(axis=0)
        return bottleneck

    def memory(self, b: Any, s: Any) -> np.ndarray:
        """The largest stage's stored activation bytes (the per-micro-batch memory the DP limits)."""
        largest: np.ndarray = self.stage_memory(b, s).max(axis=0)
        return largest

    def feasible(self, b: Any, s: Any) -> np.ndarray:
        ok: np.ndarray = np.isfinite(self.time(b, s))
        return ok

    def explain_infeasible(self, b: int, s: int) -> str:
        """Why (b, s) has no cost, and how to get one."""
        if s > self.max_len:
            return (f"length {s} is longer than the cost table's longest profiled length {self.max_len}: "
                    f"profile up to a longer length (or truncate samples)")
        if b < self.spread:
            return (f"{b} rows cannot give each of the {self.spread} ranks that run micro-batches in lockstep a "
                    f"row: use a larger batch (data.batch_size)")
        rows = self.max_rows(s)
        return (f"{b} rows of length {s} exceed the profiled range (at most {rows} rows at that length, "
                f"{int(self.rows_grid[-1])} at any): profile a larger token cap")

    # ---- serialisation ----
    def to_dict(self) -> dict[str, Any]:
        def arr(x: np.ndarray) -> list[Any]:
            return [[[None if np.isnan(v) else float(v) for v in row] for row in plane] for plane in x]

        return {"kind": "moebal.microbatch_cost", "source": self.source, "b_grid": self.b_grid.tolist(),
                "s_grid": self.s_grid.tolist(), "fwd_s": arr(self.fwd_PBS), "bwd_s": arr(self.bwd_PBS),
                "act_bytes": arr(self.act_PBS), "meta": self.meta}

    @classmethod
    def from_dict(cls, d: dict[str, Any], where: str = "cost table") -> MicroBatchCost:
        try:
            def arr(x: Any) -> np.ndarray:
                return np.asarray([[[np.nan if v is None else float(v) for v in row] for row in plane]
                                   for plane in x], dtype=np.float64)

            return cls(b_grid=np.asarray(d["b_grid"], dtype=np.int64), s_grid=np.asarray(d["s_grid"], dtype=np.int64),
                       fwd_PBS=arr(d["fwd_s"]), bwd_PBS=arr(d["bwd_s"]), act_PBS=arr(d["act_bytes"]),
                       source=str(d.get("source", "")), meta=dict(d.get("meta", {})))
        except (KeyError, TypeError, ValueError) as e:
            raise ConfigError(f"{where}: not a micro-batch cost table ({e.__class__.__name__}: {e}); "
                              f"write one with `moebal plan microbatches --profile FILE`") from None

    def save(self, path: str | Path) -> None:
        write_text_whole(path, json.dumps(self.to_dict()) + "\n")  # a reader never sees half a table


def load_cost(path: str | Path) -> MicroBatchCost:
    data = read_json(path, "cost table")
    if not isinstance(data, dict):
        raise ConfigError(f"cost table {path}: expected a JSON object")
    return MicroBatchCost.from_dict(data, where=f"cost table {path}")


def stage_scale(unit_costs: Any, factors: Any, sizes: Any, first_extra: float = 0.0, last_extra: float = 0.0,
                digits: int = 4) -> list[float] | None:
    """Each stage's predicted time under a dynamism scheme over its time without: the stage's units' costs without
    dynamism (`unit_costs`, the layer balancer's smoothed ones; equal where none were measured) times the scheme's
    latest factors (`Dynamism.unit_cost_factors`), with the embedding (`first_extra`, on the first stage) and the
    head and loss (`last_extra`, on the last) as they are. Rounded to `digits` decimals; None when every stage's is
    1 (nothing to scale).

    A stage's table is its cost without dynamism (profiled, or the hardware profile's); this factor scales its
    times as a whole, which is exact when every micro-batch shape changes the same way (pruning, sparse attention
    and freezing change what a layer computes per token; early exit and MoD the share of tokens that run it)."""
    c = np.asarray(unit_costs, dtype=np.float64)
    f = np.asarray(factors, dtype=np.float64)
    edges = np.concatenate([[0], np.cumsum(np.asarray(sizes, dtype=np.int64))])
    if c.shape != f.shape or edges[-1] != len(c):
        raise ConfigError(f"stage scale: {len(c)} unit costs, {len(f)} factors and stage sizes {list(sizes)} "
                          f"(summing to {int(edges[-1])}) must agree")
    out = []
    for p in range(len(edges) - 1):
        extra = (first_extra if p == 0 else 0.0) + (last_extra if p == len(edges) - 2 else 0.0)
        units = slice(int(edges[p]), int(edges[p + 1]))
        base = float(c[units].sum()) + extra
        ratio = (float((c[units] * f[units]).sum()) + extra) / base if base > 0 else 1.0
        out.append(max(round(ratio, digits), 10.0 ** -digits))
    return None if all(x == 1.0 for x in out) else out


# ---------------------------------------------------------------------------------------------------------
# from a hardware profile


def _layer_activation_bytes(shape: Any, b: np.ndarray, s: np.ndarray, act_bytes: int, moe: bool) -> np.ndarray:
    """Bytes autograd keeps for one decoder layer's backward (flash-style attention: no s x s scores).

    Counted per token: two norm inputs (fp32) and outputs, q, k, v, the attention output and its softmax
    statistics, the residual inputs, and the MLP's gate/up/down inputs and activations (SwiGLU: 3 x F);
    MoE layers keep top_k copies of the expert rows plus the routing tensors.
    """
    T = b * s
    q = shape.n_heads * shape.head_dim
    kv = shape.n_kv_heads * shape.head_dim
    per_tok: float = (2 * shape.dim * 4 + 2 * shape.dim * act_bytes + (2 * q + 2 * kv) * act_bytes
               + shape.n_heads * 4 + 2 * shape.dim * act_bytes)
    if moe:
        F = shape.expert_ffn_dim
        per_tok += shape.top_k * (shape.dim + 3 * F) * act_bytes + shape.num_experts * 4 * 2
    else:
        per_tok += (shape.dim + 3 * shape.ffn_dim) * act_bytes
    bytes_: np.ndarray = T * per_tok
    return bytes_


def analytic_table(shape: Any, profile: Any, sizes: list[int], b_grid: np.ndarray, s_grid: np.ndarray,
                   dtype: str = "bf16") -> MicroBatchCost:
    """A cost table from the hardware-profile CostModel: stage p runs layers of `sizes[p]` (the embedding on
    the first stage, final norm, LM head and loss on the last); MoE layers with balanced routing."""
    from moebal.planner.cost import CostModel

    cm = CostModel(profile, dtype)
    if sum(sizes) != shape.n_layers or min(sizes) < 1:
        raise ConfigError(f"stage sizes {sizes} must be >= 1 each and sum to the model's {shape.n_layers} layers")
    P, NB, NS = len(sizes), len(b_grid), len(s_grid)
    fwd = np.zeros((P, NB, NS))
    bwd = np.zeros((P, NB, NS))
    act = np.zeros((P, NB, NS))
    edges = np.concatenate([[0], np.cumsum(sizes)])
    for ib, b in enumerate(b_grid.tolist()):
        for is_, s in enumerate(s_grid.tolist()):
            T = b * s
            for p in range(P):
                for i in range(int(edges[p]), int(edges[p + 1])):
                    moe = shape.is_moe(i)
                    for back, out in ((False, fwd), (True, bwd)):
                        t = cm.attention_s(shape, b, s, back)
                        if moe:
                            rows = T * shape.top_k / shape.num_experts
                            t += cm.router_s(shape, T, back) + cm.combine_s(shape, T, back)
                            t += float(cm.experts_s(shape, np.full(shape.num_experts, rows), back))
                        else:
                            t += cm.dense_mlp_s(shape, T, back)
                        out[p, ib, is_] += t
                    act[p, ib, is_] += float(_layer_activation_bytes(shape, np.asarray(b), np.asarray(s),
                                                                     cm.act_bytes, moe))
                if p == 0:
                    fwd[p, ib, is_] += cm.embed_s(shape, T)
                    bwd[p, ib, is_] += cm.embed_s(shape, T, True)
                if p == P - 1:
                    fwd[p, ib, is_] += cm.head_s(shape, T)
                    bwd[p, ib, is_] += cm.head_s(shape, T, True)
                    act[p, ib, is_] += T * (shape.vocab_size * 4 + shape.dim * 4)
    name = profile if isinstance(profile, str) else getattr(profile, "name", "profile")
    return MicroBatchCost(b_grid=np.asarray(b_grid), s_grid=np.asarray(s_grid), fwd_PBS=fwd, bwd_PBS=bwd,
                          act_PBS=act, source=f"analytic:{name}:{dtype}", meta={"sizes": list(sizes)})
