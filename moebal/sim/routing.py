"""Routing sources for the simulator: synthetic (Zipf popularity with locality drift) or a replayed log.

Shape legend: L = MoE layers (or all layers, see below), G = expert-parallel groups of a stage, R = ranks of one
EP group, E = experts. Counts are token-expert assignments per source rank for a whole iteration.

Routing log format (`routing.jsonl`, one JSON object per line, one line per training step):

    {"step": 12, "counts": [[[c, c, ...], ...], ...]}

`counts[l][r][e]` is the number of token-expert assignments that rank r routed to expert e in the l-th MoE
layer during that step (all micro-batches). Extra keys are ignored, so a run's `plans.jsonl` whose lines carry
a `counts` (or `routing`) field replays too; a step is the line that names it (`LoggedRouting`). Replaying into
a simulated job of another size keeps each layer's per-source expert shares: logged rows are cycled over the
simulated ranks and rescaled to the simulated tokens per rank; logged layers are cycled over the model's MoE
layers.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from moebal.errors import ConfigError, DataError
from moebal.fileio import complete_lines, read_text

__all__ = ["LoggedRouting", "SyntheticRouting", "mean_imbalance", "read_routing_log", "write_routing_log",
           "zipf_exponent_for"]


def zipf_exponent_for(num_experts: int = 16, top: int = 3, top_share: float = 0.5, bottom_share: float = 0.05) -> float:
    """Smallest Zipf exponent whose `top` heaviest of `num_experts` take more than `top_share` of the tokens
    and whose `top` lightest take less than `bottom_share` (Pro-Prophet's Fig. 3 description: 3 heaviest of 16
    hold > 50 %, 3 lightest < 5 %)."""

    def shares(s: float) -> tuple[float, float]:
        p = 1.0 / np.arange(1, num_experts + 1) ** s
        p /= p.sum()
        return float(p[:top].sum()), float(p[-top:].sum())

    lo, hi = 0.0, 8.0
    for _ in range(60):
        mid = (lo + hi) / 2
        t, b = shares(mid)
        if t > top_share and b < bottom_share:
            hi = mid
        else:
            lo = mid
    return hi


@dataclass(frozen=True, kw_only=True)
class SyntheticRouting:
    """Seeded Zipf routing: per layer, experts ranked by a random permutation get popularity ~ 1 / rank^s.

    Locality drift: popularity logits take a Gaussian random-walk step of `drift` per training step, so
    consecutive steps are similar (Pro-Prophet's locality) and the hot experts slowly move. `source_spread`
    perturbs each source rank's shares (log-normal, sigma = source_spread). Each of a rank's tokens picks
    top_k distinct experts; assignment counts are drawn multinomially and capped at one per token and expert.
    """

    num_layers: int
    num_experts: int
    top_k: int
    zipf_s: float = 1.0
    drift: float = 0.05
    source_spread: float = 0.0
    seed: int = 0
    layer_zipf_s: tuple[float, ...] | None = None
    """One exponent per layer (layers differ in skew); None: zipf_s for every layer."""

    def popularity(self, step: int) -> np.ndarray:
        """[L, E] expert shares of one step (deterministic in seed and step)."""
        L, E = self.num_layers, self.num_experts
        base = np.random.default_rng([self.seed, 0])
        perm = np.stack([base.permutation(E) for _ in range(L)])
        s_L = np.full(L, self.zipf_s) if self.layer_zipf_s is None else np.asarray(self.layer_zipf_s, float)
        if s_L.shape != (L,):
            raise ValueError(f"layer_zipf_s needs {L} exponents; got {s_L.shape[0]}")
        logits = -s_L[:, None] * np.log(perm + 1.0)
        if step > 0 and self.drift > 0:
            walk = np.random.default_rng([self.seed, 1]).normal(0.0, self.drift, size=(step, L, E)).sum(axis=0)
            logits = logits + walk
        p = np.exp(logits - logits.max(axis=1, keepdims=True))
        shares_LE: np.ndarray = p / p.sum(axis=1, keepdims=True)
        return shares_LE

    def counts(self, step: int, groups: int, ranks: int, tokens_per_rank: int) -> np.ndarray:
        """[L, G, R, E] assignment counts of one step."""
        L, E, k = self.num_layers, self.num_experts, min(self.top_k, self.num_experts)
        p_LE = self.popularity(step)
        rng = np.random.default_rng([self.seed, 2, step])
        p = np.broadcast_to(p_LE[:, None, None, :], (L, groups, ranks, E))
        if self.source_spread > 0:
            p = p * np.exp(rng.normal(0.0, self.source_spread, size=p.shape))
            p = p / p.sum(axis=-1, keepdims=True)
        c = rng.multinomial(tokens_per_rank * k, p.reshape(-1, E)).astype(np.float64).reshape(L, groups, ranks, E)
        return _cap(c, tokens_per_rank, np.ascontiguousarray(p))


def _cap(c: np.ndarray, cap: float, p: np.ndarray) -> np.ndarray:
    """No expert takes a token twice: move each row's excess over `cap` to the experts below it in proportion to
    their popularity `p` (a token's next choice, drawn without replacement, follows the popularity of the
    experts left), capping again until nothing is over (at most E rounds: each caps one more expert at least).
    Spreading the excess by the experts' room instead flattened the tail: past Zipf 1.5 at top-2 the skew fell
    as the exponent rose."""
    for _ in range(c.shape[-1]):
        excess = np.maximum(c - cap, 0.0).sum(axis=-1, keepdims=True)
        if not excess.any():
            break
        c = np.minimum(c, cap)
        w = p * (c < cap)
        c = c + excess * w / np.maximum(w.sum(axis=-1, keepdims=True), 1e-300)
    return c


# ---------------------------------------------------------------------------------------------------------
# logs


def write_routing_log(path: str | Path, steps: list[np.ndarray], first_step: int = 0) -> None:
    """Write one line per step; steps[i] is an [L, R, E] count array."""
    with open(path, "w", encoding="utf-8") as f:
        for i, c in enumerate(steps):
            f.write(json.dumps({"step": first_step + i, "counts": np.asarray(c).tolist()}) + "\n")


def read_routing_log(path: str | Path) -> list[np.ndarray]:
    """The [L, R, E] count arrays of a routing log (or of plans.jsonl lines that carry `counts`/`routing`)."""
    return [arr for _, arr in _read_routing(path)]


def _read_routing(path: str | Path) -> list[tuple[Any, np.ndarray]]:
    """(the line's `step` value or None, its counts) per line with counts."""
    p = Path(path)
    lines = complete_lines(read_text(p, "routing log", DataError))  # a live run's log: its whole lines
    out: list[tuple[Any, np.ndarray]] = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{p}:{n}: not a JSON object ({e.msg}); expected {{\"step\": N, \"counts\": "
                            f"[[[...]]]}}") from None
        counts = rec.get("counts", rec.get("routing")) if isinstance(rec, dict) else None
        if counts is None:
            continue
        arr = np.asarray(counts, dtype=np.float64) if _rectangular(counts) else None
        if arr is None or arr.ndim != 3 or (arr < 0).any() or not np.isfinite(arr).all():
            raise DataError(f"{p}:{n}: 'counts' must be a non-negative layers x ranks x experts array of numbers")
        if out and arr.shape != out[0][1].shape:
            raise DataError(f"{p}:{n}: counts shape {arr.shape} differs from the first line's {out[0][1].shape}")
        out.append((rec.get("step"), arr))
    if not out:
        raise DataError(f"routing log {p} has no line with a 'counts' field; see moebal/sim/routing.py for the format")
    return out


def _rectangular(x: object) -> bool:
    try:
        np.asarray(x, dtype=np.float64)
    except (TypeError, ValueError):
        return False
    return True


@dataclass(frozen=True)
class LoggedRouting:
    """Replays logged steps into a simulated layout (see the module docstring). With `step_ids` (every line
    named its distinct integer `step`, as a run's logs do) a step is the line that logged it, and the step before
    it is the line before (a run logs every `train.log_every` steps); without, a step is a line index, cycling."""

    steps: tuple[np.ndarray, ...]
    step_ids: tuple[int, ...] | None = None

    @classmethod
    def from_file(cls, path: str | Path) -> LoggedRouting:
        lines = _read_routing(path)
        ids = [s for s, _ in lines]
        named = all(isinstance(s, int) and not isinstance(s, bool) for s in ids) and len(set(ids)) == len(ids)
        return cls(tuple(arr for _, arr in lines), tuple(ids) if named else None)

    @property
    def num_experts(self) -> int:
        return int(self.steps[0].shape[2])

    def first_replayable(self) -> int:
        """The first step with a step before it to plan on (the default `moebal simulate --step`)."""
        return 1 if self.step_ids is None or len(self.step_ids) < 2 else self.step_ids[1]

    def previous(self, step: int) -> int:
        """The step placements plan on: the logged step before `step` (or `step - 1` without step ids)."""
        if self.step_ids is None:
            return step - 1
        i = self._index(step)
        if i == 0:
            raise ConfigError(f"step {step} is the routing log's first: placements plan on the step before it; "
                              f"choose a later one ({self._span()})")
        return self.step_ids[i - 1]

    def _index(self, step: int) -> int:
        if self.step_ids is None:
            return step % len(self.steps)
        if step not in self.step_ids:
            raise ConfigError(f"step {step} is not in the routing log ({self._span()})")
        return self.step_ids.index(step)

    def _span(self) -> str:
        ids = self.step_ids or ()
        shown = ", ".join(map(str, ids[:6])) + (f", ..., {ids[-1]}" if len(ids) > 6 else "")
        return f"its {len(ids)} logged steps: {shown}"

    def counts(self, step: int, num_layers: int, groups: int, ranks: int, tokens_per_rank: int,
               top_k: int) -> np.ndarray:
        c_LRE = self.steps[self._index(step)]
        Lg, Rg, _ = c_LRE.shape
        layers = c_LRE[np.arange(num_layers) % Lg]
        rows = layers[:, np.arange(groups * ranks) % Rg]  # [L, G*R, E], logged sources cycled
        total = rows.sum(axis=-1, keepdims=True)
        shares = np.divide(rows, total, out=np.full_like(rows, 1.0 / rows.shape[-1]), where=total > 0)
        out: np.ndarray = shares * tokens_per_rank * top_k
        return out.reshape(num_layers, groups, ranks, -1)


def mean_imbalance(counts: np.ndarray) -> float:
    """Mean over layers and groups of max/mean expert load (a one-number summary of skew)."""
    load = counts.sum(axis=-2)
    return float(np.mean(load.max(axis=-1) / np.maximum(load.mean(axis=-1), 1e-12)))



