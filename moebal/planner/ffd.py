"""Lina's inference allocation (thesis section 4.5, "Two-phase scheduling"): pure, no torch.

Eq. 4.1 turns a layer's expected popularity into a number of devices per expert, n_e = N x (sum over tokens of
P(e)) / N_t; first-fit-decreasing packs the experts onto the N ranks so that popular experts get several ranks
(replicas, each taking a share of the expert's tokens) and unpopular ones share a rank (at most 4 per rank).

How moebal settles the thesis's gaps (docs/expert-parallel.md, "Lina's inference scheduling"):
- **Fractional n_e** (gap B5): an expert with n_e = w + f gets w whole ranks (items of size 1) and one item of
  size f; the items are packed by first-fit-decreasing into bins of capacity 1 (one rank = 1/N of the batch's
  assignments), at most `max_per_rank` experts per bin, never two pieces of one expert in one bin. An item
  that fits no open bin opens the next empty rank; when every rank is open it goes to the least-loaded rank
  that may take it (the thesis says nothing for this case; FFD's rounding can leave it with no room).
- **Experts without an estimate** (unlisted, n_e = 0): spread evenly over the ranks left empty, else put on the
  rank with the fewest experts, then the lowest load (the thesis says "a random device": a deterministic choice
  lets every rank compute the same plan without a broadcast). When E > max_per_rank x N the cap cannot hold
  and is raised to ceil(E / N). Split experts take a slot on each of their ranks, so the pieces can outnumber
  the slots even below that (8 experts on 2 ranks, one split in two: 9): the last pieces then go past the cap,
  to the least-loaded ranks that do not hold them (a preference, not a bound). A piece can go past it with
  slots to spare too: when no open rank has room for it, and the ranks under the cap hold its expert already,
  it goes to the least-loaded rank that does not (6 pieces of 5 experts on 2 ranks ended 1 and 5 experts; 3 of
  2,847 random cases of up to 4 ranks).
- **A holder's least share** (moebal's; the thesis assumes an expert's cost linear in its tokens): with
  `min_rows` (the dispatcher's MIN_ROWS, the size it pads a group to), n_e is capped at
  max(1, floor(load_e / min_rows)), so no replica takes fewer rows than a padded group costs anyway.
- **Token quotas** (gap B7): an expert's holders take its tokens in proportion to the sizes of their pieces;
  `split_rows` turns that into rows per (source rank, holder), each holder first taking its own rank's rows.

Shape legend: E experts, R ranks, S source ranks.
"""

from __future__ import annotations

import functools
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from moebal.planner.plan import default_owners

__all__ = ["MAX_PER_RANK", "ReplicaMap", "devices_from_load", "ffd_allocate", "split_rows"]

MAX_PER_RANK = 4  # the thesis's "maximum number of experts packed on one device"
_EPS = 1e-9


@dataclass(frozen=True)
class ReplicaMap:
    """Which ranks compute each expert of one layer and which share of its tokens each takes.

    holders[e]  ascending ranks that compute expert e (at least one)
    shares[e]   the share of e's tokens each holder takes (same order, sums to 1)"""

    num_ranks: int
    holders: tuple[tuple[int, ...], ...]
    shares: tuple[tuple[float, ...], ...]

    def __post_init__(self) -> None:
        for e, (h, s) in enumerate(zip(self.holders, self.shares)):
            if not h or len(h) != len(s) or list(h) != sorted(set(h)) or not 0 <= h[0] <= h[-1] < self.num_ranks:
                raise ValueError(f"expert {e}: holders {h} must be sorted, unique, non-empty ranks in "
                                 f"0..{self.num_ranks - 1}, one share each ({s})")
            if abs(sum(s) - 1.0) > 1e-6 or min(s) < 0:
                raise ValueError(f"expert {e}: shares {s} must be >= 0 and sum to 1")

    @classmethod
    def static(cls, num_experts: int, num_ranks: int) -> ReplicaMap:
        """Plain expert parallelism: each expert on its owner (contiguous blocks), no replica. One object per
        shape (a map is immutable), built once: inference asks for it at every static layer."""
        return _static_map(num_experts, num_ranks)

    @property
    def num_experts(self) -> int:
        return len(self.holders)

    def local_experts(self, rank: int) -> tuple[int, ...]:
        """Experts `rank` computes, ascending."""
        return tuple(e for e, h in enumerate(self.holders) if rank in h)

    def to_dict(self) -> dict[str, Any]:
        return {"num_ranks": self.num_ranks, "holders": [list(h) for h in self.holders],
                "shares": [[round(x, 6) for x in s] for s in self.shares]}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)


@functools.lru_cache(maxsize=64)
def _static_map(num_experts: int, num_ranks: int) -> ReplicaMap:
    owner = default_owners(num_experts, num_ranks)
    return ReplicaMap(num_ranks=num_ranks, holders=tuple((o,) for o in owner), shares=tuple((1.0,) for _ in owner))


def devices_from_load(load_E: Sequence[float], num_ranks: int, assignments: float,
                      min_rows: float = 0.0) -> list[float]:
    """Eq. 4.1: n_e = N x load_e / assignments (the batch's tokens x k: each rank's fair share is 1).

    `min_rows` > 0: no holder of an expert takes fewer than `min_rows` of its rows, so n_e is at most
    max(1, floor(load_e / min_rows)). The dispatcher pads a group of fewer rows to MIN_ROWS
    (moebal/distributed/lina_inference.py), so a smaller piece costs as much as `min_rows` rows: a replica of an
    expert with few rows adds a padded group and takes no work off its owner (a decode step, one token a
    sequence, is such a batch for every expert)."""
    if assignments <= 0:
        return [0.0] * len(load_E)
    n_E = [num_ranks * float(x) / assignments for x in load_E]
    if min_rows > 0:
        n_E = [min(n, float(max(1, math.floor(float(x) / min_rows)))) for n, x in zip(n_E, load_E)]
    return n_E


def ffd_allocate(n_E: Sequence[float], num_ranks: int, max_per_rank: int = MAX_PER_RANK) -> ReplicaMap:
    """First-fit-decreasing allocation of experts to ranks from n_e (ranks' worth of work per expert; 0 for an
    expert without an estimate). See the module docstring for the rules."""
    E, R = len(n_E), num_ranks
    if R < 1 or max_per_rank < 1:
        raise ValueError(f"ffd_allocate: num_ranks ({R}) and max_per_rank ({max_per_rank}) must be >= 1")
    if any(not math.isfinite(x) or x < 0 for x in n_E):
        raise ValueError(f"ffd_allocate: n_e must be finite and >= 0; got {list(n_E)}")
    cap = max(max_per_rank, -(-E // R))
    load = [0.0] * R
    pieces: list[dict[int, float]] = [{} for _ in range(R)]  # rank -> {expert: size}
    opened = 0
    for size, e in _items(n_E):
        b = next((b for b in range(opened) if load[b] + size <= 1.0 + _EPS and e not in pieces[b]
                  and len(pieces[b]) < cap), None)
        if b is None and opened < R:
            b, opened = opened, opened + 1
        if b is None:
            b = min(range(R), key=lambda r: (e in pieces[r] or len(pieces[r]) >= cap, load[r], r))
        pieces[b][e] = pieces[b].get(e, 0.0) + size
        load[b] += size
    _place_unlisted(n_E, pieces, load, opened, cap)
    return _as_map(pieces, E, R)


def _items(n_E: Sequence[float]) -> list[tuple[float, int]]:
    """(size, expert) pieces, largest first (ties: lower expert id): whole ranks, then the fractional rest."""
    items: list[tuple[float, int]] = []
    for e, n in enumerate(n_E):
        whole = int(math.floor(n + _EPS))
        items += [(1.0, e)] * whole
        if n - whole > _EPS:
            items.append((n - whole, e))
    return sorted(items, key=lambda it: (-it[0], it[1]))


def _place_unlisted(n_E: Sequence[float], pieces: list[dict[int, float]], load: list[float], opened: int,
                    cap: int) -> None:
    """Experts without an estimate: round-robin over the ranks FFD left empty, else the rank with the fewest
    experts, then the lowest load."""
    R = len(pieces)
    unlisted = [e for e, n in enumerate(n_E) if n <= _EPS]
    free = list(range(opened, R))
    for i, e in enumerate(unlisted):
        if free and i < len(free) * cap:
            b = free[i % len(free)]
        else:
            b = min(range(R), key=lambda r: (len(pieces[r]) >= cap, len(pieces[r]), load[r], r))
        pieces[b][e] = 0.0


def _as_map(pieces: list[dict[int, float]], E: int, R: int) -> ReplicaMap:
    holders: list[tuple[int, ...]] = []
    shares: list[tuple[float, ...]] = []
    for e in range(E):
        hs = tuple(r for r in range(R) if e in pieces[r])
        sizes = [pieces[r][e] for r in hs]
        total = sum(sizes)
        shares.append(tuple(s / total for s in sizes) if total > 0 else tuple(1.0 / len(hs) for _ in hs))
        holders.append(hs)
    return ReplicaMap(num_ranks=R, holders=tuple(holders), shares=tuple(shares))


def split_rows(counts_SE: np.ndarray, rmap: ReplicaMap) -> np.ndarray:
    """rows_SRE[s, r, e]: how many of source rank s's rows for expert e rank r computes.

    Expert e's C_e rows are cut into holder targets by its shares (largest remainder, ties to the lower rank);
    each holder first takes its own rank's rows up to its target, then the remaining rows fill the remaining
    targets in (source, holder) order. Every rank computes the same matrix from the same counts."""
    counts = np.asarray(counts_SE, dtype=np.int64)
    S, E = counts.shape
    out = np.zeros((S, rmap.num_ranks, E), dtype=np.int64)
    for e in range(E):
        hs = rmap.holders[e]
        if len(hs) == 1:  # one holder takes every source's rows
            out[:, hs[0], e] = counts[:, e]
            continue
        target = dict(zip(hs, _apportion(int(counts[:, e].sum()), rmap.shares[e])))
        left = counts[:, e].copy()
        for h in hs:
            if h < S:
                take = min(int(left[h]), target[h])
                out[h, h, e], left[h], target[h] = take, left[h] - take, target[h] - take
        for s in range(S):
            for h in hs:
                take = min(int(left[s]), target[h])
                if take:
                    out[s, h, e] += take
                    left[s] -= take
                    target[h] -= take
    return out


def _apportion(total: int, shares: Sequence[float]) -> list[int]:
    """Integers summing to `total` in proportion to `shares` (largest remainder, ties to the earlier entry)."""
    raw = [total * s for s in shares]
    base = [int(math.floor(x)) for x in raw]
    rest = total - sum(base)
    order = sorted(range(len(raw)), key=lambda i: (-(raw[i] - base[i]), i))
    for i in order[:rest]:
        base[i] += 1
    return base
