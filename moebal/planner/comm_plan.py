"""Communication plans: gradient chunk size, all-to-all chunks per MoE layer, and Lina's expert packing.

Pure functions of measured or profiled costs (no torch.distributed here). The executor is moebal.scheduler.

Shape legend: R = ranks in the expert-parallel group, E = experts.

- **Gradient chunk size** (Lina's all-reduce micro-op; the thesis tunes 30 MB by hand for 100 Gb/s
  InfiniBand). A chunk of S bytes costs alpha + S / beta. Lina never fuses gradients, so its micro-ops are
  never larger than one tensor: on its models (1M-parameter matrices in fp16) they are 1-2 MB, a few dozen per
  step, each going out as soon as the backward pass produces it. We cut a flat buffer, so we set the same
  granularity explicitly: 8 chunks per step's gradients (3 MB for the 25 MB of Lina's 16-expert
  Transformer-XL), and no chunk longer on the wire than half an all-to-all, since a chunk in flight is not
  pre-empted and an arriving all-to-all shares the link with it (Lina's bound: an all-to-all waits at most one
  micro-op); but never so small that the fixed cost is more than half a chunk's time (alpha * beta).
  Smaller chunks pay the latency and the scheduler's turnaround (one chunk in flight: the next is issued when
  the last completes on every rank) many times; larger ones cannot use the short gaps between all-to-alls
  and make an arriving all-to-all wait longer behind the chunk in flight. Without the step's gradient size
  the rule falls back to the smallest chunk whose fixed cost is 5 % of its time (on the `a100` profile's
  100 Gb/s InfiniBand 10 MB at 8 ranks and 12.3 MB at 16, where the ring's latency grows with the ranks; 91 MB
  inside one NVLink node; the thesis chose 30 MB).
- **All-to-all chunks** (Lina's all-to-all micro-ops; Tutel's `a2a_ffn_overlap_degree`, which its users pick by
  hand): the dispatch/experts/combine pipeline of `moebal.scheduler.exchange` replayed for c = 1..max_chunks
  with per-chunk latency, and the c with the smallest predicted forward + backward time. `overlap` says how
  much of a transfer really runs concurrently with compute (1 on a GPU, whose copy engines and NICs work
  while its SMs compute; measured on a CPU, whose cores do both): the prediction is
  overlap * pipelined + (1 - overlap) * serial.
- **Expert packing** (Lina, section 4.3.3): start with one expert per rank and double while the expert compute
  of one all-to-all chunk is shorter than the chunk's transfer; `pack_experts` applies the rule to
  time functions of the experts per rank (what the start-up measurement or the cost model gives).
  `lina_packing` is the rule a real run applies (`scheduler.expert_packing: lina`), with the guard the thesis
  leaves out: packing halves the expert-parallel group, so each expert then has twice the data-parallel
  copies and its gradient must be all-reduced among them (the thesis never says so). A doubling is taken only
  while the all-to-all time it saves per step (four exchanges per MoE layer: dispatch and combine, forward
  and backward) is at least the expert-gradient all-reduce time it adds; without that guard a link-bound job
  (the gradient sync already filling the step) packs itself into a slower one.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from moebal.errors import ConfigError

__all__ = ["CommCosts", "PackingCandidate", "a2a_chunks", "ar_chunk_bytes", "comm_costs_from_profile",
           "exchange_time", "lina_packing", "pack_experts"]


@dataclass(frozen=True, kw_only=True)
class CommCosts:
    """Coefficients of the communication model (seconds, bytes/s)."""

    ar_latency_s: float
    """Fixed cost of one gradient all-reduce (alpha)."""
    ar_bandwidth: float
    """Bytes/s of one all-reduce once its fixed cost is paid (beta)."""
    a2a_latency_s: float
    """Fixed cost of one all-to-all (a chunk pays it again)."""
    a2a_bandwidth: float
    """Bytes/s one rank receives in an all-to-all."""
    expert_tokens_per_s: float
    """Rows one rank pushes through its experts' forward per second."""
    backward_factor: float = 2.0
    """Expert backward / forward time."""
    overlap: float = 1.0
    """Share of a transfer that runs concurrently with compute (1: dedicated links and copy engines)."""

    def __post_init__(self) -> None:
        for name in ("ar_latency_s", "a2a_latency_s", "backward_factor"):
            v = getattr(self, name)
            if not (math.isfinite(v) and v >= 0):
                raise ConfigError(f"CommCosts.{name} = {v!r}: must be a finite number >= 0")
        for name in ("ar_bandwidth", "a2a_bandwidth", "expert_tokens_per_s"):
            v = getattr(self, name)
            if not (v > 0):
                raise ConfigError(f"CommCosts.{name} = {v!r}: must be a rate > 0")
        if not 0.0 <= self.overlap <= 1.0:
            raise ConfigError(f"CommCosts.overlap = {self.overlap!r}: must be a share in [0, 1]")

    def to_dict(self) -> dict[str, float]:
        return asdict(self)


def ar_chunk_bytes(costs: CommCosts, overhead: float = 0.05, total_bytes: float | None = None,
                   pieces: int = 8, a2a_s: float | None = None, lo: float = 64e3, hi: float = 256e6) -> float:
    """Gradient chunk size (see the module docstring). Without `total_bytes`: the smallest chunk whose fixed
    cost is `overhead` of its time. With it: `pieces` chunks per step's gradients, and no longer on the wire than
    half an all-to-all (`a2a_s`, when given), but never so small that the fixed cost is more than half a
    chunk's time."""
    if not 0.0 < overhead < 1.0:
        raise ConfigError(f"overhead must be in (0, 1); got {overhead}")
    ab = costs.ar_latency_s * costs.ar_bandwidth
    if not total_bytes:
        s = ab * (1.0 - overhead) / overhead
    else:
        s = total_bytes / max(1, pieces)
        if a2a_s:
            s = min(s, costs.ar_bandwidth * a2a_s / 2)
        s = max(ab, s)
    return float(min(hi, max(lo, s)))


def exchange_time(c: int, a2a_s: float, fec_s: float, latency_s: float, overlap: float) -> float:
    """Predicted time of one exchange (dispatch, experts, combine) in c chunks.

    Pipelined replay of the executor's issue order: every dispatch chunk at once (the link serves them in
    order), experts of chunk i after dispatch i and experts i-1, combine i queued on the link when experts i
    end; a2a_s is one full all-to-all, fec_s the experts on all rows. Serial: c * (2 a/c + f/c + 2 latency).
    """
    a, f = latency_s + a2a_s / c, fec_s / c
    link = 0.0
    disp_end = []
    for _ in range(c):
        link += a
        disp_end.append(link)
    comp = 0.0
    comb_ready = []
    for i in range(c):
        comp = max(comp, disp_end[i]) + f
        comb_ready.append(comp)
    for i in range(c):
        link = max(link, comb_ready[i]) + a
    serial = 2 * c * latency_s + 2 * a2a_s + fec_s
    return overlap * link + (1.0 - overlap) * serial


def a2a_chunks(costs: CommCosts, recv_bytes: float, compute_rows: float, max_chunks: int = 8,
               min_chunk_bytes: float = 16e3) -> tuple[int, float]:
    """Token chunks for one MoE layer's exchanges: (c, predicted forward + backward seconds).

    recv_bytes: bytes the busiest rank receives in one all-to-all; compute_rows: rows the busiest rank's
    experts compute. Chunks below min_chunk_bytes are not considered (all latency)."""
    a2a_s = recv_bytes / costs.a2a_bandwidth
    fec = compute_rows / costs.expert_tokens_per_s
    best = (1, math.inf)
    for c in range(1, max(1, max_chunks) + 1):
        if c > 1 and recv_bytes / c < min_chunk_bytes:
            break
        t = (exchange_time(c, a2a_s, fec, costs.a2a_latency_s, costs.overlap)
             + exchange_time(c, a2a_s, costs.backward_factor * fec, costs.a2a_latency_s, costs.overlap))
        if t < best[1] - 1e-12:  # ties keep fewer chunks
            best = (c, t)
    return best


def pack_experts(num_experts: int, world: int, t_ffn: Callable[[int], float], t_a2a: Callable[[int], float],
                 max_per_rank: int | None = None) -> int:
    """Lina's packing rule: experts per rank m = 1, 2, 4, ... while t_ffn(m) < t_a2a(m) and the next m still
    gives an expert-parallel group (world / m ranks) that divides the experts. Returns the experts per rank.

    t_ffn(m), t_a2a(m): expert compute and all-to-all time of one micro-op with m experts per rank (with a
    smaller group the all-to-all shrinks and may stay inside a node; at m = E it disappears). Lina starts at
    one expert per rank (#experts = #ranks); with fewer ranks than experts we start at E / world.
    """
    if num_experts % world and world % num_experts:
        raise ConfigError(f"{num_experts} experts and {world} ranks: one must divide the other to pack experts")
    m = max(1, num_experts // world)
    cap = max_per_rank or num_experts
    while 2 * m <= cap and num_experts % (2 * m) == 0 and world % (num_experts // (2 * m) or 1) == 0:
        if not t_ffn(m) < t_a2a(m):
            break
        m *= 2
    return m


@dataclass(frozen=True)
class PackingCandidate:
    """One expert-parallel layout of a packing decision (seconds, per MoE layer)."""

    ep: int
    """Expert-parallel ranks: experts per rank = E / ep."""
    t_ffn: float
    """Expert compute (forward) of one exchange's rows on a rank."""
    t_a2a: float
    """One exchange (all-to-all) of those rows on the wire; 0 when ep = 1."""
    t_expert_sync: float
    """All-reduce of a rank's expert gradients among their data-parallel copies, once per step; 0 when there is
    one copy."""


def lina_packing(cands: list[PackingCandidate], exchanges_per_step: int = 4) -> tuple[int, list[str]]:
    """Lina's doubling with moebal's gradient guard (module docstring): `cands` are the layouts in packing order
    (ep, ep / 2, ep / 4, ...). Returns the chosen expert-parallel size and one line per decision taken."""
    if not cands:
        raise ValueError("lina_packing needs at least the starting layout")
    i, why = 0, []
    while i + 1 < len(cands):
        c, n = cands[i], cands[i + 1]
        if not c.t_ffn < c.t_a2a:
            why.append(f"ep {c.ep}: kept, expert compute {1e3 * c.t_ffn:.3g} ms >= all-to-all {1e3 * c.t_a2a:.3g} ms "
                       f"(Lina's rule: the compute already covers the transfer)")
            break
        saved = exchanges_per_step * (c.t_a2a - n.t_a2a)
        added = n.t_expert_sync - c.t_expert_sync
        if added > saved:
            why.append(f"ep {c.ep}: kept, packing to ep {n.ep} would save {1e3 * saved:.3g} ms of all-to-all per "
                       f"layer and step but add {1e3 * added:.3g} ms of expert-gradient all-reduce")
            break
        why.append(f"ep {c.ep} -> {n.ep}: expert compute {1e3 * c.t_ffn:.3g} ms < all-to-all {1e3 * c.t_a2a:.3g} ms; "
                   f"saves {1e3 * saved:.3g} ms of all-to-all, adds {1e3 * added:.3g} ms of gradient all-reduce")
        i += 1
    if i + 1 == len(cands) and len(cands) > 1 and (not why or "->" in why[-1]):
        why.append(f"ep {cands[i].ep}: no smaller layout divides the experts and ranks")
    return cands[i].ep, why


def comm_costs_from_profile(cost: Any, layer: Any, ep_ranks: list[int], dense_ranks: list[int]) -> CommCosts:
    """CommCosts from a `CostModel` (a hardware profile) and the layer's `MoELayerCosts`: the all-reduce fit on
    1 MB and 64 MB over the dense group, an 8-byte all-to-all over the expert-parallel group, full overlap."""
    import numpy as np

    topo = cost.topology(max(max(ep_ranks), max(dense_ranks)) + 1)
    t1 = cost.time_of(cost.all_reduce(topo, dense_ranks, 1e6), topo)
    t2 = cost.time_of(cost.all_reduce(topo, dense_ranks, 64e6), topo)
    beta = 63e6 / max(t2 - t1, 1e-12)
    R = len(ep_ranks)
    tiny = cost.time_of(cost.all_to_all(topo, ep_ranks, np.full((R, R), 8.0)), topo) if R > 1 else 0.0
    return CommCosts(ar_latency_s=max(0.0, t1 - 1e6 / beta), ar_bandwidth=beta, a2a_latency_s=tiny,
                     a2a_bandwidth=layer.a2a_bw(8e6), expert_tokens_per_s=layer.expert_tokens_per_s,
                     backward_factor=layer.backward_factor, overlap=1.0)
