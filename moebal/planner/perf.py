"""Performance models of one MoE layer under an expert placement: Pro-Prophet's (eq. 1-8) and FasterMoE's.

Shape legend: R = ranks in the expert-parallel group (the paper's D), E = logical experts.
`counts_RE[d, e]` = token-expert assignments that rank d routes to expert e in one iteration.

Pro-Prophet (arXiv 2411.10003, section III) charges a MoE layer
4 A2A + 1 FEC + 1 BEC + 1 Trans + 1 Agg:

    eq. 1  T_A2A   = max_d R_d * token_bytes / B_a2a          (R_d: tokens rank d receives from other ranks)
    eq. 2  T_FEC   = max_d H_d / t                            (H_d: tokens computed on rank d)
    eq. 3  T_BEC   = 2 * T_FEC
    eq. 4  T_Trans = s * (D - n) / D * param_bytes / B_trans
    eq. 5  T_Agg   = s * (D - n) / D * grad_bytes / B_agg
    eq. 6  T'      = 4 T_A2A + T_FEC + T_BEC + T_Trans + T_Agg
    eq. 8  T'      = 4 T_A2A + T_FEC + T_BEC + max(0, T_Trans - T_FEC - T_FNEC) + max(0, T_Agg - T_BEC - T_BNEC)

Generalisations (the paper has E = D, one expert per rank, and one n for every selected expert):
- H_d sums the tokens of every expert computed on d (experts on one rank run one after another, as eq. 2's
  "experts on one device are serial"); R_d sums the tokens d receives from other ranks for all of them.
- Each selected expert e may exclude its own number n_e of ranks. Eq. 4's s * (D - n) becomes the sum over
  selected experts of (D - n_e) = 1 + |replicas_e|, called `holders` here; with one n for all experts it is
  exactly the paper's s * (D - n).
- Eq. 1 prices every exchange from the busiest receiver's bytes at one bandwidth, measured on a uniform
  exchange. Where the NIC is shared by a node's GPUs, a uniform exchange loads it with all of them and a skewed
  one with the hot rank's traffic only, so eq. 1 overprices skew up to the GPUs per node (`a100`, 8 ranks,
  every token to one expert: 12.0 ms against 3.05 ms). Eq. 4 and 5 add one transfer time per replicated
  expert, while the experts' Trans (and Agg) are issued together and share the links (4 experts to all of 8
  `a100` ranks: 4.75 ms against 2.31 ms). Costs built from a hardware profile therefore carry the group's links
  (`GroupLinks`): an exchange takes its latency plus the busiest link's bytes / capacity, as the simulator's
  all-to-all, with the dispatch's and the combine's (reversed) traffic priced apart; Trans and Agg are the
  grouped point-to-point fan-out of moebal's executor (or a chain, `GroupLinks.trans_algorithm`), as the
  simulator's `broadcast_many`. Costs without links (the paper's constants, measured ones) keep eq. 1, 4, 5.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from typing import Any

import numpy as np

from moebal.errors import ConfigError
from moebal.planner.plan import ExpertPlacement

__all__ = [
    "A2ALoads", "Bandwidth", "GroupLinks", "ReplicaLoads", "TRANS_ALGORITHMS", "chain_order", "MoELayerCosts",
    "PAPER_COSTS", "LayerTime", "FasterMoECosts", "t_a2a", "t_fec", "t_bec", "t_trans", "t_agg", "layer_time",
    "a2a_loads", "linked_times", "replica_loads", "ep_loads", "held_mask", "replicas_from_held", "held_loads",
    "placement_loads", "evaluate", "evaluate_held", "fastermoe_expert_loads", "fastermoe_shadow",
]

Bandwidth = float | tuple[tuple[float, float], ...] | Callable[[float], float]
"""Bytes/s: a constant, a piecewise table ((up_to_bytes, bytes_per_s), ...) keyed on the bytes one rank
receives, or a callable bytes -> bytes/s (which can fold in a latency: b -> b / (lat + b / bw))."""

_GBIT = 1e9 / 8  # bytes/s in one Gbit/s


TRANS_ALGORITHMS = ("fanout", "chain")
"""How Trans sends an expert to its holders (and Agg returns their gradients): point-to-point from the owner
(moebal's executor, `ExpertParallel._trans`) or a chain through the holders (a broadcast/reduce, as the papers'
systems on NCCL)."""


def chain_order(node_of: np.ndarray, ids: np.ndarray, root_node: int) -> np.ndarray:
    """The order of a broadcast chain's members after its root: the root's node-mates first, then node by node
    (lowest node id first), ids ascending within a node, so the chain leaves each node once. `node_of[i]`: the
    node of member `ids[i]`."""
    return np.lexsort((ids, node_of, node_of != root_node))  # np.lexsort sorts by its last key first


@dataclass(frozen=True, eq=False)
class GroupLinks:
    """The links an expert-parallel group's transfers cross, to price its exchanges and its Trans/Agg as the
    simulator does (`CostModel.all_to_all`, `broadcast_many` and `time_of`: a collective alone on the links).

    Incidence lists: transfer src -> dst (indices 0..R-1 in the group; pair = src * R + dst) crosses link
    `link_P[k]` for every k with `pair_P[k]` = pair; `capacity_L` in bytes/s. A collective takes its latency
    plus the busiest link's bytes / (capacity x the collective's efficiency)."""

    num_ranks: int
    ranks: np.ndarray
    """The group's ranks (global ids, ascending as the group's indices)."""
    node_R: np.ndarray
    """The node of each of them."""
    pair_P: np.ndarray
    link_P: np.ndarray
    capacity_L: np.ndarray
    a2a_latency_s: float
    """One exchange's message latencies ((R - 1) of them)."""
    a2a_efficiency: float
    trans_algorithm: str
    """One of TRANS_ALGORITHMS."""
    trans_latency: np.ndarray
    """[R + 1, 2]: one message's latency in Trans when n ranks take part, within a node (0) or across (1)."""
    trans_efficiency: np.ndarray
    """[R + 1]: Trans's efficiency when n ranks take part."""
    agg_latency: np.ndarray
    agg_efficiency: np.ndarray
    by_dst: tuple[tuple[np.ndarray, np.ndarray, np.ndarray], ...] = field(init=False, repr=False)
    """Per rank i, the transfers to it: (source, position in `links`, links), for `A2ALoads.move`."""
    by_src: tuple[tuple[np.ndarray, np.ndarray, np.ndarray], ...] = field(init=False, repr=False)
    """Per rank i, the transfers from it: (destination, position in `links`, links)."""
    by_exchange: tuple[tuple[np.ndarray, np.ndarray, np.ndarray], ...] = field(init=False, repr=False)
    """Per rank i, `by_dst[i]` and `by_src[i]` in one, over the links of two exchanges ([2L]: the transfers to i
    on the first L, those from i on the second): one update for `A2ALoads.move`."""
    by_pair: tuple[np.ndarray, np.ndarray] = field(init=False, repr=False)
    """(ptr [R * R + 1], links): the links of each pair, for a chain's hops."""
    inv_capacity_L: np.ndarray = field(init=False, repr=False)

    def __post_init__(self) -> None:  # built once per group, not per plan
        if self.trans_algorithm not in TRANS_ALGORITHMS:
            raise ConfigError(f"trans algorithm {self.trans_algorithm!r}: one of {', '.join(TRANS_ALGORITHMS)}")
        R = self.num_ranks
        src_P, dst_P = self.pair_P // R, self.pair_P % R
        for name, key, other in (("by_dst", dst_P, src_P), ("by_src", src_P, dst_P)):
            order = np.argsort(key, kind="stable")
            ptr = np.searchsorted(key[order], np.arange(R + 1))
            per_rank = []
            for i in range(R):
                sel = order[ptr[i]:ptr[i + 1]]
                links, pos = np.unique(self.link_P[sel], return_inverse=True)
                per_rank.append((other[sel], pos.astype(np.int64), links))
            object.__setattr__(self, name, tuple(per_rank))
        L, merged = self.capacity_L.shape[0], []
        for (to_peer, to_pos, to_links), (from_peer, from_pos, from_links) in zip(self.by_dst, self.by_src):
            links, pos = np.unique(np.concatenate([to_links[to_pos], L + from_links[from_pos]]), return_inverse=True)
            merged.append((np.concatenate([to_peer, from_peer]), pos.astype(np.int64), links))
        object.__setattr__(self, "by_exchange", tuple(merged))
        object.__setattr__(self, "inv_capacity_L", 1.0 / self.capacity_L)
        order = np.argsort(self.pair_P, kind="stable")
        object.__setattr__(self, "by_pair", (np.searchsorted(self.pair_P[order], np.arange(R * R + 1)),
                                             self.link_P[order]))

    def seconds(self, bytes_RR: np.ndarray) -> float:
        """One exchange: bytes_RR[src, dst] bytes from src to dst."""
        load_L = np.bincount(self.link_P, weights=np.asarray(bytes_RR, np.float64).ravel()[self.pair_P],
                             minlength=self.capacity_L.shape[0])
        return self.a2a_latency_s + _busiest(load_L, self.capacity_L * self.a2a_efficiency)

    def hops(self, owner: int, to_R: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Trans's transfers (src, dst) sending the owner's expert to the ranks of mask `to_R`."""
        others = np.flatnonzero(to_R)
        if self.trans_algorithm == "fanout":
            return np.full(others.size, owner), others
        others = others[chain_order(self.node_R[others], self.ranks[others], int(self.node_R[owner]))]
        chain = np.concatenate([[owner], others])
        return chain[:-1], chain[1:]

    def links_of(self, src: np.ndarray, dst: np.ndarray) -> np.ndarray:
        """The links of transfers src[i] -> dst[i], concatenated."""
        ptr, links = self.by_pair
        pair = src * self.num_ranks + dst
        lo, n = ptr[pair], ptr[pair + 1] - ptr[pair]
        starts = np.repeat(lo - np.cumsum(n) + n, n)  # each pair's first link, minus the links before it
        return links[starts + np.arange(int(n.sum()))]


def _busiest(load_L: np.ndarray, capacity_L: np.ndarray) -> float:
    return float((load_L / capacity_L).max()) if capacity_L.size else 0.0


class A2ALoads:
    """The link loads of a layer's dispatch (tokens to their experts' owners) and combine (back), updated as a
    placement search moves tokens off an owner: `move(i, tokens_R)` drops tokens_R[r] of rank r's tokens bound
    for rank i from both exchanges in O(R) (the exchanges' incidences are kept by destination and by source)."""

    def __init__(self, links: GroupLinks, tokens_RR: np.ndarray, token_bytes: float) -> None:
        L = links.capacity_L.shape[0]
        self.links, self.token_bytes = links, float(token_bytes)
        self._inv_cap = np.tile(1.0 / (links.capacity_L * links.a2a_efficiency), 2)
        b_RR = np.asarray(tokens_RR, np.float64) * self.token_bytes
        self.load_2L = np.concatenate([np.bincount(links.link_P, weights=b_RR.ravel()[links.pair_P], minlength=L),
                                       np.bincount(links.link_P, weights=b_RR.T.ravel()[links.pair_P], minlength=L)])
        self.dispatch_L, self.combine_L = self.load_2L[:L], self.load_2L[L:]  # views

    def move(self, i: int, tokens_R: np.ndarray) -> None:
        """tokens_R[r] of rank r's tokens no longer go to rank i (they stay on r): dispatch r -> i and combine
        i -> r carry that much less."""
        peer, pos, links = self.links.by_exchange[i]
        b_R = np.asarray(tokens_R, np.float64) * self.token_bytes
        self.load_2L[links] -= np.bincount(pos, weights=b_R[peer], minlength=links.size)

    def seconds(self) -> float:
        """The layer's four exchanges: dispatch and combine in the forward, their reverses in the backward."""
        lat = self.links.a2a_latency_s
        if not self._inv_cap.size:
            return 4 * lat
        busiest = float((self.load_2L * self._inv_cap).reshape(2, -1).max(axis=1).sum())
        return 2.0 * (2 * lat + busiest)


class ReplicaLoads:
    """The link loads of a layer's Trans (each selected expert from its owner to its holders, issued together)
    and Agg (their gradients back), grown as a placement search selects experts (`add`, O(R) an expert)."""

    def __init__(self, links: GroupLinks, param_bytes: float, grad_bytes: float) -> None:
        L = links.capacity_L.shape[0]
        self.links, self.param_bytes, self.grad_bytes = links, float(param_bytes), float(grad_bytes)
        self.trans_L, self.agg_L = np.zeros(L), np.zeros(L)
        self.members = np.zeros(links.num_ranks, dtype=bool)  # the ranks taking part
        self.steps = 0  # the longest group's messages in a row (its holders other than the owner)

    def add(self, owner: int, to_R: np.ndarray) -> None:
        """Expert of `owner` replicated on the ranks of mask `to_R` (the owner not among them)."""
        k = self.links
        hops = int(np.count_nonzero(to_R))
        if hops == 0:
            return
        if k.trans_algorithm == "fanout":  # the owner's transfers to the holders, and theirs back: O(R)
            for load_L, nbytes, (peer, pos, links) in ((self.trans_L, self.param_bytes, k.by_src[owner]),
                                                       (self.agg_L, self.grad_bytes, k.by_dst[owner])):
                load_L[links] += nbytes * np.bincount(pos, weights=to_R[peer], minlength=links.size)
        else:
            src, dst = k.hops(owner, to_R)
            L = self.trans_L.shape[0]
            self.trans_L += self.param_bytes * np.bincount(k.links_of(src, dst), minlength=L)
            self.agg_L += self.grad_bytes * np.bincount(k.links_of(dst, src), minlength=L)
        self.members[owner] = True
        self.members |= to_R
        self.steps = max(self.steps, hops)

    def seconds(self) -> tuple[float, float]:
        """(Trans, Agg) seconds: the messages in a row times one's latency, plus the busiest link's bytes."""
        if self.steps == 0:
            return 0.0, 0.0
        k = self.links
        n = int(np.count_nonzero(self.members))
        nodes = k.node_R[self.members]
        spans = int(nodes.min() != nodes.max())
        busiest_s = (float((self.trans_L * k.inv_capacity_L).max()) / float(k.trans_efficiency[n]),
                     float((self.agg_L * k.inv_capacity_L).max()) / float(k.agg_efficiency[n]))
        return (self.steps * float(k.trans_latency[n, spans]) + busiest_s[0],
                self.steps * float(k.agg_latency[n, spans]) + busiest_s[1])


@dataclass(frozen=True, kw_only=True)
class MoELayerCosts:
    """Coefficients of the performance model for one MoE layer on one expert-parallel group.

    Units are bytes, seconds and token-expert assignments ("tokens"). Build it directly, with
    `from_shape` (model shape + hardware rates), or from a hardware profile in `moebal.planner.cost`.
    """

    token_bytes: float
    """Bytes of one token's hidden vector on the wire (d_model * bytes per element): the A2A payload."""
    expert_param_bytes: float
    """Bytes of one expert's parameters: what Trans sends to each replica holder (eq. 4)."""
    expert_grad_bytes: float
    """Bytes of one expert's gradients: what Agg reduces back to the owner (eq. 5)."""
    expert_tokens_per_s: float
    """t in eq. 2: tokens one rank pushes through expert forward compute per second."""
    a2a_bandwidth: Bandwidth
    """B-bar in eq. 1, bytes/s; a table or callable is keyed on the max bytes one rank receives."""
    trans_bandwidth: float
    """B-bar in eq. 4, bytes/s of the parameter broadcast."""
    agg_bandwidth: float
    """B-bar in eq. 5, bytes/s of the gradient reduce."""
    nonmoe_fwd_s: float = 0.0
    """T_FNEC of eq. 8: seconds of the non-MoE forward compute of the same block (hides Trans)."""
    nonmoe_bwd_s: float = 0.0
    """T_BNEC of eq. 8: seconds of the non-MoE backward compute of the same block (hides Agg)."""
    backward_factor: float = 2.0
    """Expert backward compute / forward compute (eq. 3 uses 2)."""
    overlap_share: float = 1.0
    """Share of the layer's step compute (FEC + FNEC, BEC + BNEC) that eq. 8 lets Trans and Agg hide under: 1
    when the step is one pass; 1 / M with M micro-batches, where Trans overlaps the block's compute in the
    first micro-batch's forward only and Agg the last one's backward (the gradients are complete only then),
    while the A2A and expert compute the plan saves add up over all M."""
    num_ranks: int | None = None
    """D, ranks in the expert-parallel group; None takes it from the count matrix, else it must match."""
    links: GroupLinks | None = None
    """The group's links (costs from a hardware profile): the exchanges, Trans and Agg priced per link instead
    of by eq. 1, 4 and 5."""

    def __post_init__(self) -> None:
        if not (isinstance(self.overlap_share, numbers.Real) and 0 < float(self.overlap_share) <= 1):
            raise ConfigError(f"MoELayerCosts.overlap_share = {self.overlap_share!r}: must be in (0, 1]")
        for name in ("token_bytes", "expert_param_bytes", "expert_grad_bytes", "nonmoe_fwd_s", "nonmoe_bwd_s",
                     "backward_factor"):
            v = getattr(self, name)
            if not (isinstance(v, numbers.Real) and math.isfinite(v) and float(v) >= 0):
                raise ConfigError(f"MoELayerCosts.{name} = {v!r}: must be a finite number >= 0")
        for name in ("expert_tokens_per_s", "trans_bandwidth", "agg_bandwidth"):
            v = getattr(self, name)
            if not (isinstance(v, numbers.Real) and math.isfinite(v) and float(v) > 0):
                raise ConfigError(f"MoELayerCosts.{name} = {v!r}: must be a rate > 0 (per second)")
        if self.num_ranks is not None and self.num_ranks < 1:
            raise ConfigError(f"MoELayerCosts.num_ranks = {self.num_ranks}: must be >= 1 or None")
        if self.links is not None and self.links.num_ranks != self.num_ranks:
            raise ConfigError(f"MoELayerCosts.links are of {self.links.num_ranks} ranks; num_ranks is "
                              f"{self.num_ranks}")
        object.__setattr__(self, "a2a_bandwidth", _normalise_bandwidth(self.a2a_bandwidth))

    def a2a_bw(self, nbytes: float) -> float:
        """A2A bandwidth in bytes/s when the most loaded rank receives `nbytes`."""
        bw = self.a2a_bandwidth
        if callable(bw):
            return float(bw(nbytes))
        if isinstance(bw, tuple):
            for up_to, rate in bw:
                if nbytes <= up_to:
                    return rate
            return bw[-1][1]  # beyond the table: its last (fastest) rate
        return float(bw)

    @classmethod
    def from_shape(cls, *, d_model: int, ffn_dim: int, flops_per_s: float, a2a_bandwidth: Bandwidth,
                   trans_bandwidth: float, agg_bandwidth: float | None = None, dtype_bytes: int = 4,
                   expert_matrices: int = 3, nonmoe_fwd_s: float = 0.0, nonmoe_bwd_s: float | None = None,
                   num_ranks: int | None = None) -> MoELayerCosts:
        """Costs of a bias-free MLP expert of `expert_matrices` d_model x ffn_dim matrices (3: SwiGLU, as
        moebal's experts; 2: the paper's two-layer MLP), 2 FLOPs per multiply-add, gradients as large as
        parameters, backward = 2 x forward (non-MoE backward defaults to 2 x its forward too)."""
        matrix_elems = d_model * ffn_dim * expert_matrices
        return cls(token_bytes=d_model * dtype_bytes, expert_param_bytes=matrix_elems * dtype_bytes,
                   expert_grad_bytes=matrix_elems * dtype_bytes,
                   expert_tokens_per_s=flops_per_s / (2.0 * matrix_elems), a2a_bandwidth=a2a_bandwidth,
                   trans_bandwidth=trans_bandwidth,
                   agg_bandwidth=trans_bandwidth if agg_bandwidth is None else agg_bandwidth,
                   nonmoe_fwd_s=nonmoe_fwd_s, nonmoe_bwd_s=2 * nonmoe_fwd_s if nonmoe_bwd_s is None else nonmoe_bwd_s,
                   num_ranks=num_ranks)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready fields (a piecewise table becomes a list of [up_to_bytes, bytes_per_s] pairs)."""
        if callable(self.a2a_bandwidth) or self.links is not None:
            raise ConfigError("MoELayerCosts from a hardware profile (a callable a2a_bandwidth, the group's links) "
                              "cannot be serialised: give the profile, or a table of bandwidths")
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        if isinstance(self.a2a_bandwidth, tuple):
            d["a2a_bandwidth"] = [[(up if math.isfinite(up) else None), bw] for up, bw in self.a2a_bandwidth]
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> MoELayerCosts:
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ConfigError(f"unknown MoELayerCosts field(s) {unknown}; valid fields: {sorted(names)}")
        try:
            return cls(**dict(d))
        except TypeError as e:
            raise ConfigError(f"MoELayerCosts: {e}") from None


def _normalise_bandwidth(bw: Any) -> Bandwidth:
    if callable(bw):
        fn: Callable[[float], float] = bw  # any callable is taken as bytes -> bytes/s, as documented
        return fn
    if isinstance(bw, numbers.Real) and not isinstance(bw, bool):
        if not (math.isfinite(bw) and float(bw) > 0):
            raise ConfigError(f"MoELayerCosts.a2a_bandwidth = {bw!r}: must be > 0 bytes/s")
        return float(bw)
    try:
        table = tuple((math.inf if up is None else float(up), float(rate)) for up, rate in bw)
    except (TypeError, ValueError):
        raise ConfigError(f"MoELayerCosts.a2a_bandwidth = {bw!r}: give bytes/s, a callable, or a table "
                          f"[[up_to_bytes, bytes_per_s], ...]") from None
    if not table or any(rate <= 0 for _, rate in table) or [u for u, _ in table] != sorted({u for u, _ in table}):
        raise ConfigError(f"MoELayerCosts.a2a_bandwidth table {bw!r}: needs >= 1 row, strictly increasing "
                          f"up_to_bytes and rates > 0")
    return table


# The authors' released constants (RTX 3090 + 100 Gb/s InfiniBand, fp32) for MoE-GPT-M (d_model 1024,
# expert hidden 2048, two-matrix MLP experts, 16 ranks x 1024 tokens). Their per-token compute constant counts
# 4 bytes inside a FLOP count, i.e. an effective quarter of the 35.7 TFLOP/s they quote: we keep the effective
# rate, since it is what their planner was tuned with. Non-MoE forward: (2 b s^2 h 2 + 4 b s h^2) * 4 / 35.7e12
# with b = 4 sequences per rank, s = 256, h = 1024.
PAPER_COSTS = MoELayerCosts.from_shape(
    d_model=1024, ffn_dim=2048, expert_matrices=2, dtype_bytes=4, flops_per_s=35.7e12 / 4,
    a2a_bandwidth=((128 * 1024, 6 * _GBIT), (256 * 1024, 16 * _GBIT), (1024 * 1024, 42 * _GBIT),
                   (math.inf, 100 * _GBIT)),
    trans_bandwidth=15 * _GBIT, agg_bandwidth=15 * _GBIT,
    nonmoe_fwd_s=(2 * 4 * 256**2 * 1024 * 2 + 4 * 4 * 256 * 1024**2) * 4 / 35.7e12)


# ---- eq. 1-8 --------------------------------------------------------------------------------------------------
def t_a2a(costs: MoELayerCosts, max_recv_tokens: float) -> float:
    """Eq. 1: one all-to-all (Tutel-style P2P), set by the rank that receives the most bytes."""
    nbytes = max_recv_tokens * costs.token_bytes
    return nbytes / costs.a2a_bw(nbytes) if nbytes > 0 else 0.0


def t_fec(costs: MoELayerCosts, max_compute_tokens: float) -> float:
    """Eq. 2: forward expert compute, set by the rank that computes the most tokens."""
    return max_compute_tokens / costs.expert_tokens_per_s


def t_bec(costs: MoELayerCosts, max_compute_tokens: float) -> float:
    """Eq. 3: backward expert compute = backward_factor (2) x forward."""
    return costs.backward_factor * t_fec(costs, max_compute_tokens)


def t_trans(costs: MoELayerCosts, holders: float, num_ranks: int) -> float:
    """Eq. 4 generalised: holders = sum over selected experts of (D - n_e); the paper's s * (D - n)."""
    return holders / num_ranks * costs.expert_param_bytes / costs.trans_bandwidth


def t_agg(costs: MoELayerCosts, holders: float, num_ranks: int) -> float:
    """Eq. 5 generalised as eq. 4."""
    return holders / num_ranks * costs.expert_grad_bytes / costs.agg_bandwidth


def layer_time(costs: MoELayerCosts, max_recv_tokens: float, max_compute_tokens: float, holders: float,
               num_ranks: int, overlap: bool = False, linked: tuple[float, float, float] | None = None) -> float:
    """Eq. 6 (overlap=False) or eq. 8 (Trans hidden under FEC + FNEC, Agg under BEC + BNEC); `linked`: (the
    four exchanges, Trans, Agg) in seconds priced per link (`A2ALoads`, `ReplicaLoads`) in place of eq. 1, 4
    and 5."""
    fec = t_fec(costs, max_compute_tokens)
    bec = costs.backward_factor * fec
    if linked is None:
        a2a4, trans, agg = 4.0 * t_a2a(costs, max_recv_tokens), t_trans(costs, holders, num_ranks), \
            t_agg(costs, holders, num_ranks)
    else:
        a2a4, trans, agg = linked
    if overlap:
        share = costs.overlap_share
        trans = max(0.0, trans - share * (fec + costs.nonmoe_fwd_s))
        agg = max(0.0, agg - share * (bec + costs.nonmoe_bwd_s))
    return a2a4 + fec + bec + trans + agg


# ---- loads under a placement -----------------------------------------------------------------------------
def ep_loads(counts_RE: np.ndarray, owner_E: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Plain expert parallelism: H_d = tokens of all experts owned by d, R_d = those from other ranks."""
    R, E = counts_RE.shape
    total_E = counts_RE.sum(axis=0, dtype=np.float64)
    local_E = counts_RE[owner_E, np.arange(E)].astype(np.float64)
    H_R = np.bincount(owner_E, weights=total_E, minlength=R)
    return H_R, H_R - np.bincount(owner_E, weights=local_E, minlength=R)


def held_mask(placement: ExpertPlacement) -> np.ndarray:
    """held_RE[d, e]: rank d holds expert e's parameters during the layer (owner or replica)."""
    held_RE = np.zeros((placement.num_ranks, placement.num_experts), dtype=bool)
    held_RE[np.asarray(placement.owner), np.arange(placement.num_experts)] = True
    for e, reps in enumerate(placement.replicas):
        if reps:
            held_RE[list(reps), e] = True
    return held_RE


def replicas_from_held(held_RE: np.ndarray, owner_E: np.ndarray) -> tuple[tuple[int, ...], ...]:
    """ExpertPlacement.replicas (sorted ranks per expert, owner left out) from a held_RE mask."""
    E = held_RE.shape[1]
    rep_ER = held_RE.T.copy()
    rep_ER[np.arange(E), owner_E] = False
    e_idx, r_idx = np.nonzero(rep_ER)  # row-major: ranks come out ascending per expert
    ranks = r_idx.tolist()
    out, pos = [], 0
    for k in np.bincount(e_idx, minlength=E).tolist():
        out.append(tuple(ranks[pos:pos + k]))
        pos += k
    return tuple(out)


def held_loads(counts_RE: np.ndarray, held_RE: np.ndarray, owner_E: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(H_R, recv_R) when held_RE says who holds what: a holder computes its own tokens, the owner the rest."""
    c_RE = counts_RE.astype(np.float64, copy=False)
    local_R = (c_RE * held_RE).sum(axis=1)  # tokens a rank computes for itself (never cross the wire)
    remote_E = (c_RE * ~held_RE).sum(axis=0)  # tokens that travel to the owner
    recv_R = np.bincount(owner_E, weights=remote_E, minlength=counts_RE.shape[0])
    return local_R + recv_R, recv_R


def placement_loads(counts_RE: np.ndarray, placement: ExpertPlacement) -> tuple[np.ndarray, np.ndarray]:
    """(H_R, recv_R) under a placement (H: tokens computed per rank, recv: tokens received from others)."""
    return held_loads(counts_RE, held_mask(placement), np.asarray(placement.owner))


def a2a_loads(counts_RE: np.ndarray, held_RE: np.ndarray, owner_E: np.ndarray, costs: MoELayerCosts) -> A2ALoads:
    """The link loads of the layer's exchanges when held_RE says who holds what (costs with `links`)."""
    assert costs.links is not None
    R, E = counts_RE.shape
    remote_RE = counts_RE.astype(np.float64, copy=False) * ~held_RE  # tokens that travel to the owner
    to_RE = np.arange(R)[:, None] * R + owner_E[None, :]  # tokens_RR[r, owner_E[e]] sums remote_RE[r, e]
    tokens_RR = np.bincount(to_RE.ravel(), weights=remote_RE.ravel(), minlength=R * R).reshape(R, R)
    return A2ALoads(costs.links, tokens_RR, costs.token_bytes)


def linked_times(costs: MoELayerCosts, a2a: A2ALoads, rep: ReplicaLoads | None, holders: int,
                 num_ranks: int) -> tuple[float, float, float]:
    """`layer_time`'s `linked`: the four exchanges from their link loads, and Trans/Agg from theirs (`rep`), or,
    where the layer is priced with overlap (eq. 8; `rep` None), by eq. 4 and 5.

    Why eq. 4/5 under overlap: eq. 8 hides Trans under the block's compute, while Trans in flight shares the
    links with the exchanges running at the same time; grouped per-link Trans, cheaper than eq. 4's sum, then
    counts on a hiding the links do not give, and the planner replicates more than pays (Mixtral-8x7B on 128
    `h100` ranks, pp 2 x ep 8, simulated: 9.39 s with grouped Trans against 8.67 s with eq. 4/5, which also
    ignores the sharing but prices Trans higher). Without overlap Trans runs alone, and per link is exact."""
    trans, agg = rep.seconds() if rep is not None else (t_trans(costs, holders, num_ranks),
                                                        t_agg(costs, holders, num_ranks))
    return a2a.seconds(), trans, agg


def replica_loads(held_RE: np.ndarray, owner_E: np.ndarray, costs: MoELayerCosts) -> ReplicaLoads:
    """The link loads of the layer's Trans and Agg when held_RE says who holds what (costs with `links`)."""
    assert costs.links is not None
    loads = ReplicaLoads(costs.links, costs.expert_param_bytes, costs.expert_grad_bytes)
    for e in np.flatnonzero(held_RE.sum(axis=0) > 1).tolist():
        to_R = held_RE[:, e].copy()
        to_R[owner_E[e]] = False
        loads.add(int(owner_E[e]), to_R)
    return loads


@dataclass(frozen=True)
class LayerTime:
    """Eq. 1-8 terms for one layer under one placement (seconds; tokens are token-expert assignments)."""

    a2a_s: float
    fec_s: float
    bec_s: float
    trans_s: float
    agg_s: float
    exposed_trans_s: float
    exposed_agg_s: float
    total_s: float
    max_recv_tokens: float
    max_compute_tokens: float
    holders: int

    def to_dict(self) -> dict[str, float]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


def evaluate(counts_RE: np.ndarray, placement: ExpertPlacement, costs: MoELayerCosts,
             overlap: bool = False) -> LayerTime:
    """Every term of eq. 6 / eq. 8 for `placement` on `counts_RE` (the reference the planners must match)."""
    return evaluate_held(counts_RE, held_mask(placement), np.asarray(placement.owner), costs, overlap)


def evaluate_held(counts_RE: np.ndarray, held_RE: np.ndarray, owner_E: np.ndarray, costs: MoELayerCosts,
                  overlap: bool = False) -> LayerTime:
    """`evaluate` on a held_RE mask (owner included) instead of an ExpertPlacement."""
    R = counts_RE.shape[0]
    H_R, recv_R = held_loads(counts_RE, held_RE, owner_E)
    per_E = held_RE.sum(axis=0)
    holders = int(per_E[per_E > 1].sum())  # sum over replicated experts of D - n_e (owner included)
    max_h, max_r = float(H_R.max()), float(recv_R.max())
    fec = t_fec(costs, max_h)
    if costs.links is None:
        a2a, trans, agg = t_a2a(costs, max_r), t_trans(costs, holders, R), t_agg(costs, holders, R)
    else:  # per link; a2a_s the four exchanges' mean
        rep = None if overlap else replica_loads(held_RE, owner_E, costs)
        a2a4, trans, agg = linked_times(costs, a2a_loads(counts_RE, held_RE, owner_E, costs), rep, holders, R)
        a2a = a2a4 / 4
    bec = costs.backward_factor * fec
    share = costs.overlap_share  # as `layer_time`, which the planners' searches minimise
    ex_trans = max(0.0, trans - share * (fec + costs.nonmoe_fwd_s)) if overlap else trans
    ex_agg = max(0.0, agg - share * (bec + costs.nonmoe_bwd_s)) if overlap else agg
    return LayerTime(a2a_s=a2a, fec_s=fec, bec_s=bec, trans_s=trans, agg_s=agg, exposed_trans_s=ex_trans,
                     exposed_agg_s=ex_agg, total_s=4 * a2a + fec + bec + ex_trans + ex_agg,
                     max_recv_tokens=max_r, max_compute_tokens=max_h, holders=holders)


# ---- FasterMoE's dynamic shadowing model -----------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class FasterMoECosts:
    """FasterMoE's (PPoPP'22) latency model: L = (3 t_comp + 4 t_feat) * B_max + shadowed * t_model."""

    t_comp: float
    """Seconds of one token's expert forward compute (FasterMoE: 4 alpha H^2 / TP)."""
    t_feat: float
    """Seconds to send one token's features once (FasterMoE: H * 4 bytes / BW)."""
    t_model: float
    """Seconds to broadcast one expert's parameters (FasterMoE: 2 alpha H^2 * 4 bytes / BW)."""

    @classmethod
    def from_layer_costs(cls, costs: MoELayerCosts, a2a_bytes: float) -> FasterMoECosts:
        """The same hardware as Pro-Prophet's model: features at the A2A rate seen at `a2a_bytes` received,
        parameters at the Trans rate (FasterMoE itself uses one network bandwidth for both)."""
        return cls(t_comp=1.0 / costs.expert_tokens_per_s, t_feat=costs.token_bytes / costs.a2a_bw(a2a_bytes),
                   t_model=costs.expert_param_bytes / costs.trans_bandwidth)

    @classmethod
    def from_shape(cls, *, d_model: int, alpha: float = 2.0, bw_net: float = 50 * _GBIT,
                   gemm_flops: float = 11.5e12, dtype_bytes: int = 4) -> FasterMoECosts:
        """FasterMoE's own constants (its environment defaults: 50 Gbit/s, 11.5 TFLOP/s, alpha 2, fp32)."""
        alpha_h2 = alpha * d_model**2
        return cls(t_comp=4 * alpha_h2 / gemm_flops, t_feat=d_model * dtype_bytes / bw_net,
                   t_model=2 * alpha_h2 * dtype_bytes / bw_net)

    def latency(self, max_expert_load: float, shadowed: int) -> float:
        return (3 * self.t_comp + 4 * self.t_feat) * max_expert_load + shadowed * self.t_model


def fastermoe_expert_loads(counts_RE: np.ndarray) -> np.ndarray:
    """Per-expert load B_e: tokens expert e receives from ALL sources, i.e. a sum over axis 0 (sources).

    FasterMoE's released policy sums the gathered (source x expert) matrix over axis 1, which yields one
    total per SOURCE rank (about batch * k each, so nearly equal), sorts those R values, and uses the sorted
    source indices as expert indices into the R*E shadow mask. It therefore ranks the wrong quantity and,
    with more than one expert per rank, can only ever mark experts 0..R-1. We sum over sources, which is
    what the paper's per-expert latency model means.
    """
    loads_E: np.ndarray = counts_RE.sum(axis=0, dtype=np.float64)
    return loads_E


def fastermoe_shadow(loads_E: np.ndarray, fc: FasterMoECosts) -> tuple[np.ndarray, float]:
    """FasterMoE's greedy: shadow the (i)-th heaviest expert while
    (3 t_comp + 4 t_feat) * (B_(i) - B_(i+1)) > t_model, i.e. while the drop in the bottleneck expert's
    compute and A2A time exceeds one more parameter broadcast. Returns (shadow_E mask, modelled latency).

    As in FasterMoE the last expert is never shadowed; ties in load are ordered by expert id (stable), so
    every rank reaches the same mask.
    """
    E = loads_E.shape[0]
    order_E = np.lexsort((np.arange(E), -loads_E))
    sorted_E = loads_E[order_E]
    shadow_E = np.zeros(E, dtype=bool)
    best = fc.latency(float(sorted_E[0]), 0) if E else 0.0
    for i in range(E - 1):
        new = fc.latency(float(sorted_E[i + 1]), i + 1)
        if not new < best:
            break
        best = new
        shadow_E[order_E[i]] = True
    return shadow_E, best
