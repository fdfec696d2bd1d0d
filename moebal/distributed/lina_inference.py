"""Lina's inference scheduling: per batch and per MoE layer, replicas for popular experts and packing of
unpopular ones, planned from the tokens' sample paths before the gate (phase 1) and re-planned after the gate
when the estimate was wrong (phase 2). Forward only (no autograd): `moebal eval --policy lina`.

Every rank holds every expert's weights (Lina's "each device saves the weights of all experts in host DRAM"), so
a new mapping moves no weights: a rank computes the rows it receives with the experts the mapping gives it. The
mapping is a `moebal.planner.ffd.ReplicaMap` (holders and token shares per expert); `split_rows` turns it and
the real counts into rows per (source, holder).

One MoE layer i on rank r (`LinaDispatcher.forward`):
  1. the gate has run (MoELayer.route); append each token's first choice to its path; count this rank's
     assignments per expert; estimate layer i+1's loads from the paths (`PathProfile.estimate`);
  2. one count exchange of [counts_E | estimate of layer i+1 | tokens] over the group <- host sync: splits
     (an all-gather, made as one all-to-all: every rank sends its row to every rank)
     (the piggy-back: Lina adds the estimate to the layer's first all-to-all for device 0 and sends the new
     mapping back on the second; here every rank receives every rank's counts and estimate in the one small
     exchange the layer needs anyway for its split sizes, and computes the same deterministic plan, so no
     mapping travels, as in moebal's expert planner: docs/expert-parallel.md, "Plan agreement");
  3. phase 2: the mapping for layer i is the one phase 1 planned during layer i-1 (layer 0's: from the profile's
     marginal, see below); when the top-2k experts of
     its estimate and of the real counts differ (as sets), re-plan from the real counts (FFD);
     phase 1 for layer i+1: FFD on the summed estimate (Eq. 4.1), kept for the next layer; an expert gets no
     more holders than it fills groups of `min_rows` rows (MIN_ROWS: a smaller group is padded to it, so a replica
     of a small expert would add work and take none off; `devices_from_load`); a layer whose assignments over
     every rank fill no such group (a decode step of a few sequences) runs the static blocks unplanned and
     unpadded, and from layer 1 on (the batch's tokens known from layer 0's exchange) its estimate is not
     computed (`_unsplittable`);
  4. rows sorted by (holder, expert), all-to-all with uneven splits; each rank runs the SwiGLU of each expert
     on the rows it received for it (experts one after another, as Lina does);
  5. all-to-all back, rows restored to the token order, combined with the gate weights.

Emulated devices (`dilate` > 1, CPU benchmarks only: moebal/distributed/dilate.py): every span of compute between
two points where a rank meets the others (each layer's start and end, the count exchange, both all-to-alls) lasts
`dilate` x its CPU time, as on devices that much slower than a core; with more ranks than cores this keeps the OS
from time-slicing the ranks' compute against each other. The host's planning is dilated with the rest (a GPU
system plans on its CPU at full speed): a cost that only Lina's and the oracle's planning pays.

Layer 0 has no path before it. Lina starts scheduling at its first full path (layer l); moebal estimates layers
1 .. l-1 from the shorter paths they have (moebal/planner/paths.py, gap B2's back-off) and layer 0 from its
marginal, the profile's popularity of layer 0 (the empty path): one distribution for every token of every batch,
scaled to the batch's tokens and mapped at layer 0 (the count exchange carries them; with `min_rows` 0 the
mapping does not depend on them, Eq. 4.1 being a ratio), and phase 2 checks it against the real counts as at any
layer. (A format-1 profile has no layer 0: that layer then runs static under
lina and phase1.)

Policies: "static" (plain expert parallelism: contiguous blocks of experts per rank, the same code path),
"lina" (phases 1 and 2), "phase1" (phase 1 only, the thesis's ablation), "oracle" (FFD on the real counts at
every layer, layer 0 included: what phase 2 would do every time).

Shape legend: T local tokens, K = top_k, E experts, R ranks, D model dim, A = T*K assignments, N rows sent,
M rows received.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

from moebal.distributed.dilate import DeviceClock
from moebal.planner.ffd import MAX_PER_RANK, ReplicaMap, devices_from_load, ffd_allocate, split_rows
from moebal.planner.paths import PathProfile, top_set

if TYPE_CHECKING:
    from moebal.models.moe import MoELayer
    from moebal.routing import Routing

__all__ = ["CPU_BLOCK_ROWS", "LAYER_PARTS", "MIN_ROWS", "POLICIES", "LayerRecord", "LinaInference", "check_profile",
           "expert_rows", "slowest_rank_parts", "slowest_rank_times"]

POLICIES = ("static", "lina", "phase1", "oracle")
# An expert's rows are computed in one GEMM whose size depends on the mapping (how many rows this rank takes).
# On CPU, a GEMM of a few rows takes another kernel than a large one and rounds differently (measured with
# torch 2.13: 1 and 7 rows differ in the last bits from the same rows inside a 1,100-row product; 37 and more
# agree), so a group under MIN_ROWS rows is padded with zero rows: a row's output then does not depend on
# where it is computed, and every policy gives the static run's logits bit for bit.
MIN_ROWS = 64
# On a CPU an expert's rows run in blocks of CPU_BLOCK_ROWS rows. A whole group's [rows, F] intermediates are
# fresh allocations above glibc's mmap threshold whose pages fault in on every call, which doubled the cost per
# row of a large group (measured with torch 2.13, one thread, D 64, F 1,024: about 12 us per row from 256 rows up,
# 5-7 us at 112 rows, 5.3-5.7 us at every size with the buffers allocated once or in blocks of 128), so the
# rank that held one large expert was the slowest whatever FFD's balance of rows. In blocks the cost per row is
# the same at every group size, which is what FFD's balance of rows assumes. (moebal leaves glibc's settings
# alone: docs/memory.md.) A group of n >= CPU_BLOCK_ROWS rows runs in n // CPU_BLOCK_ROWS near-equal parts, so
# no part is padded (a 60-row tail padded to MIN_ROWS was 4 % more rows on a 430-row group) and the bits do not
# change. On a GPU the group runs whole (one GEMM per projection).
CPU_BLOCK_ROWS = 128


@dataclass
class LayerRecord:
    """One MoE layer of one forward on this rank."""

    layer: int
    seconds: float  # from the dispatcher's entry to its exit (planning, both exchanges, experts)
    experts_s: float  # of which this rank's own expert compute (no waiting: the rest is exchanges and planning)
    plan_s: float  # of which the path estimate, the mappings (FFD) and the row split, between gate and all-to-all
    exchange_s: float  # of which inside the three collectives (the count exchange, both all-to-alls), waiting included
    replanned: bool  # phase 2 re-planned from the real counts
    rank_rows: list[int]  # rows each rank computed
    estimate_hit: bool | None  # top-2k sets of the estimate and the real counts equal (None: no estimate)
    replicas: int  # extra holders beyond one per expert in the layer's mapping


def slowest_rank_times(per_rank: list[list[list[dict[str, Any]]]]) -> list[float]:
    """Per forward, the MoE layers' time: each layer the slowest rank's, summed over the layers. `per_rank`: each
    rank's forwards, each a list of its layers' `LayerRecord`s as dicts (every rank runs the same forwards)."""
    return [parts["seconds"] for parts in slowest_rank_parts(per_rank)]


LAYER_PARTS = ("experts_s", "plan_s", "exchange_s")  # the parts of a `LayerRecord`'s seconds (disjoint spans)


def slowest_rank_parts(per_rank: list[list[list[dict[str, Any]]]]) -> list[dict[str, float]]:
    """Per forward, `slowest_rank_times`'s sum (`seconds`) and what it is made of: for each of LAYER_PARTS, the sum
    over the layers of that part of the layer's slowest rank (its `LayerRecord`; the exchanges include its waits,
    the rest of a layer is index work and the combine)."""
    out = []
    for f in range(len(per_rank[0])):
        slowest = [max((rank[f][j] for rank in per_rank), key=lambda rec: rec["seconds"])
                   for j in range(len(per_rank[0][f]))]
        out.append({k: sum(rec[k] for rec in slowest) for k in ("seconds", *LAYER_PARTS)})
    return out


@dataclass
class _ForwardState:
    """What a forward carries from one MoE layer to the next on this rank."""

    paths: list[np.ndarray] = field(default_factory=list)  # [T] first choices of each layer so far
    next_map: ReplicaMap | None = None
    next_est: np.ndarray | None = None  # summed estimate of the next layer over every rank
    tokens: float | None = None  # the batch's tokens over every rank, known from layer 0's count exchange on


def check_profile(model: Any, profile: PathProfile) -> None:
    """ValueError unless `profile` describes `model`'s MoE layers and experts (a command checks it before its
    ranks start, the scheduler again on each rank)."""
    layers = list(model.moe_layers())
    E = layers[0].num_experts if layers else 0
    if profile.num_layers != len(layers) or profile.num_experts != E:
        raise ValueError(f"the path profile describes {profile.num_layers} layers of {profile.num_experts} "
                         f"experts; the model has {len(layers)} MoE layers of {E}: build the profile from this "
                         f"model's routing (`moebal paths RUN_DIR`)")


class LinaInference:
    """Attach to a model (every rank holds the full model): each MoE layer's tokens go through a
    `LinaDispatcher` over `group`. Call `begin()` before each forward; `records` then holds its layers."""

    def __init__(self, model: Any, group: Any, policy: str = "lina", profile: PathProfile | None = None, *,
                 max_per_rank: int = MAX_PER_RANK, truncate: int | None = None, min_tokens: int = 1,
                 dilate: float = 1.0, min_rows: int = MIN_ROWS) -> None:
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {', '.join(POLICIES)}; got {policy!r}")
        if policy in ("lina", "phase1") and profile is None:
            raise ValueError(f"policy {policy!r} plans from a path profile: build one with `moebal paths` and pass "
                             f"it (or use policy 'static' or 'oracle')")
        self.layers: list[MoELayer] = list(model.moe_layers())
        if profile is not None:
            check_profile(model, profile)
        self.group, self.policy, self.profile = group, policy, profile
        self.profile_scale = 1.0 if profile is None else self.layers[0].top_k / profile.top_k
        """Served top_k / the profile's: a profile's distributions sum to the k it was recorded at, so a top-2
        training run's profile serving top-1 would plan from twice the assignments. The scale keeps Eq. 4.1's
        totals right; the shape stays the profiled k's (`moebal paths --top-k K` builds the served k's own)."""
        self.max_per_rank, self.truncate, self.min_tokens = max_per_rank, truncate, min_tokens
        self.min_rows = min_rows  # a holder's least share of an expert's rows (`devices_from_load`; 0: none)
        self.R, self.r = dist.get_world_size(group), dist.get_rank(group)
        if dilate > 1.0 and next(model.parameters()).device.type != "cpu":
            raise ValueError("dilate emulates slower devices on a CPU host; on a GPU the device is real (use 1)")
        self.clock = DeviceClock(dilate)
        self.records: list[LayerRecord] = []
        self.dispatchers = [LinaDispatcher(self, layer, i) for i, layer in enumerate(self.layers)]
        for layer, d in zip(self.layers, self.dispatchers):
            layer.set_dispatcher(d)
        self.first_est = self._first_layer_estimate()
        self.state = self._fresh_state()

    def _first_layer_estimate(self) -> np.ndarray | None:
        """Layer 0's phase-1 estimate (see the module docstring) for one token: the profiled popularity of layer 0,
        mapped at layer 0 once the batch's tokens are known (`_this_layer_map`). None without one (static,
        oracle, no profile, or a format-1 profile).

        The marginal is never truncated to its top k (`truncate`, the thesis's rule for a path's distribution):
        every token of layer 0 has the same one, so the truncation would put the whole layer on k experts (held
        out on the accuracy run of docs/expert-parallel.md: counts off by 1.33 of the mean, against 0.15-0.50
        whole)."""
        p = self.profile
        if self.policy not in ("lina", "phase1") or p is None or not self.layers or not p.estimates(0):
            return None
        return p.estimate(np.zeros((1, 0), dtype=np.int64), 0) * self.profile_scale

    def _fresh_state(self) -> _ForwardState:
        return _ForwardState(next_est=self.first_est)

    def begin(self) -> None:
        """Start a forward: forget the previous batch's paths, plans and records (layer 0's plan is kept)."""
        self.state, self.records = self._fresh_state(), []
        self.clock.mark()


class LinaDispatcher:
    """One MoE layer's token path under `LinaInference` (see the module docstring for the phases)."""

    def __init__(self, owner: LinaInference, layer: MoELayer, index: int) -> None:
        self.o, self.layer, self.index = owner, layer, index
        self.E, self.K = layer.num_experts, layer.top_k

    @torch.no_grad()
    def forward(self, x_TD: torch.Tensor, routing: Routing) -> torch.Tensor:
        o, E, R = self.o, self.E, self.o.R
        o.clock.settle()  # the work before the layer (attention, the gate) ends here on an emulated device
        t0 = time.perf_counter()
        T, K = routing.indices_TK.shape
        experts_A = routing.indices_TK.reshape(-1)
        active_A = routing.active_TK.reshape(-1) if routing.active_TK is not None else None
        # 1. paths, local counts, the estimate of the next layer
        o.state.paths.append(routing.indices_TK[:, 0].cpu().numpy().astype(np.int64))  # host sync on a GPU
        counts_E = torch.bincount(experts_A if active_A is None else experts_A[active_A], minlength=E)
        t_est = time.perf_counter()
        est_E = self._estimate_next()
        plan_s = time.perf_counter() - t_est
        # 2. the count exchange: counts, next layer's estimate, tokens to every rank (the layer's one host sync)
        # (on the rows' device: NCCL exchanges device tensors; gloo's are the CPU's)
        dev = x_TD.device
        mine = torch.cat([counts_E.double(), torch.as_tensor(est_E, dtype=torch.float64, device=dev),
                          torch.tensor([float(T)], dtype=torch.float64, device=dev)])
        every = mine.new_empty(R, mine.numel())
        o.clock.settle()
        t_gather = time.perf_counter()
        # an all-gather made as one all-to-all (every rank sends its row to every rank): one round of direct
        # exchanges, where gloo's all-gather is a ring of R - 1 dependent steps (docs/expert-parallel.md)
        dist.all_to_all_single(every, mine.repeat(R), group=o.group)
        all_RX = every.cpu().numpy()  # the host sync: split sizes and plans are host figures
        gather_s = time.perf_counter() - t_gather
        o.clock.mark()  # a wait is not the device's compute
        counts_RE = all_RX[:, :E].round().astype(np.int64)
        # 3. phase 2 for this layer, phase 1 for the next
        t_plan = time.perf_counter()
        tokens = o.state.tokens = float(all_RX[:, -1].sum())
        small = self._unsplittable(tokens, self.K)
        rmap, replanned, hit = self._this_layer_map(counts_RE, tokens, small)
        self._plan_next(all_RX[:, E:2 * E].sum(axis=0), tokens)
        rows_SRE = split_rows(counts_RE, rmap)
        plan_s += time.perf_counter() - t_plan
        # an unsplittable layer's groups are the same under every policy: no padding is needed for equal bits
        out_TD, experts_s, a2a_s = self._exchange(x_TD, routing, experts_A, active_A, rows_SRE, pad=not small)
        o.clock.settle()  # the combine
        o.records.append(LayerRecord(layer=self.index, seconds=time.perf_counter() - t0, experts_s=experts_s,
                                     plan_s=plan_s, exchange_s=gather_s + a2a_s, replanned=replanned,
                                     rank_rows=rows_SRE.sum(axis=(0, 2)).tolist(), estimate_hit=hit,
                                     replicas=sum(len(h) for h in rmap.holders) - E))
        return out_TD

    def _estimate_next(self) -> np.ndarray:
        o, nxt = self.o, self.index + 1
        if o.policy not in ("lina", "phase1") or o.profile is None or nxt >= len(o.layers):
            return np.zeros(self.E)
        if o.state.tokens is not None and self._unsplittable(o.state.tokens, o.layers[nxt].top_k):
            return np.zeros(self.E)  # the next layer runs static whatever the estimate (`_plan_next`)
        paths_TL = np.stack(o.state.paths, axis=1)
        return o.profile.estimate(paths_TL, nxt, truncate=o.truncate, min_tokens=o.min_tokens) * o.profile_scale

    def _this_layer_map(self, counts_RE: np.ndarray, tokens: float,
                        small: bool) -> tuple[ReplicaMap, bool, bool | None]:
        """(mapping for this layer, re-planned by phase 2, estimate's top-2k equal to the real one's); `tokens`:
        the batch's, over every rank; `small`: the layer is `_unsplittable`."""
        o, E, R = self.o, self.E, self.o.R
        actual_E = counts_RE.sum(axis=0)
        if o.policy == "static" or small:
            return ReplicaMap.static(E, R), False, None
        if o.policy == "oracle":
            return self.ffd(actual_E, float(actual_E.sum())), True, None
        planned, est = o.state.next_map, o.state.next_est
        if est is None:
            return ReplicaMap.static(E, R), False, None
        if planned is None:  # layer 0: its estimate is one token's, scaled to the batch (`min_rows` counts rows)
            planned = self.ffd(est * tokens, tokens * self.K)
        n = min(2 * self.K, E)
        hit = top_set(est, n) == top_set(actual_E, n)
        if hit or o.policy == "phase1":
            return planned, False, hit
        return self.ffd(actual_E, float(actual_E.sum())), True, hit

    def _plan_next(self, est_E: np.ndarray, tokens: float) -> None:
        o = self.o
        o.state.next_est, o.state.next_map = None, None
        if o.policy in ("lina", "phase1") and self.index + 1 < len(o.layers):
            nxt = o.layers[self.index + 1]
            if self._unsplittable(tokens, nxt.top_k):
                return  # no estimate: the next layer runs static (`_this_layer_map`)
            o.state.next_est = est_E
            o.state.next_map = self.ffd(est_E, tokens * nxt.top_k)

    def _unsplittable(self, tokens: float, top_k: int) -> bool:
        """A layer whose assignments over every rank (`tokens` x `top_k`) fill no group of `min_rows` rows: no
        expert can have a replica (`devices_from_load` gives it one holder), and padded to MIN_ROWS every group
        would cost the same on any rank whatever its rows, so a balance of rows buys nothing. The static blocks
        (E / R experts a rank) run without planning (no path estimate, no FFD), as under 'static'; every policy
        then computes the same groups on the same ranks, so they need no padding to give the same bits and run
        unpadded (`expert_rows(pad=False)`), a few times faster. A decode step of a few sequences is such a layer.
        Every rank and every policy decides alike: `tokens` is the count exchange's."""
        return self.o.min_rows > 0 and tokens * top_k < self.o.min_rows

    def ffd(self, load_E: np.ndarray, assignments: float) -> ReplicaMap:
        """The layer's mapping from expected (or real) loads: Eq. 4.1, then first-fit-decreasing."""
        n_E = devices_from_load(load_E.tolist(), self.o.R, assignments, min_rows=self.o.min_rows)
        return ffd_allocate(n_E, self.o.R, self.o.max_per_rank)

    # ---- 4-5: the token exchange ----
    def _exchange(self, x_TD: torch.Tensor, routing: Routing, experts_A: torch.Tensor, active_A: torch.Tensor | None,
                  rows_SRE: np.ndarray, pad: bool = True) -> tuple[torch.Tensor, float, float]:
        """(the layer's output, seconds of this rank's expert compute, seconds inside the two all-to-alls); `pad`:
        `expert_rows`'s."""
        E, R, r = self.E, self.o.R, self.o.r
        T, K = routing.indices_TK.shape
        dev = x_TD.device
        # rows of this rank, sorted by expert, cut into holder blocks (holder ascending within an expert)
        keys_A = experts_A if active_A is None else torch.where(active_A, experts_A, E)
        by_expert = torch.sort(keys_A, stable=True).indices[:int(rows_SRE[r].sum())]
        send_HE = torch.as_tensor(rows_SRE[r].T.reshape(-1))  # (expert, holder) order
        dest_N = torch.repeat_interleave(torch.arange(R).repeat(E), send_HE).to(dev)
        order = torch.sort(dest_N * E + experts_A[by_expert], stable=True).indices
        assign_N = by_expert[order]  # assignments in (holder, expert) order
        x_ND = x_TD.index_select(0, torch.div(assign_N, K, rounding_mode="floor"))
        recv_SE = rows_SRE[:, r, :]
        x_MD, dispatch_s = self._all_to_all(x_ND, rows_SRE[r].sum(axis=1), recv_SE.sum(axis=1))
        t0 = time.perf_counter()  # on a GPU this times the launches only (no sync is added for a figure)
        y_MD = self._experts(x_MD, recv_SE, pad)
        self.o.clock.settle()  # (emulated devices: the experts' time as the device's)
        experts_s = time.perf_counter() - t0
        y_ND, combine_s = self._all_to_all(y_MD, recv_SE.sum(axis=1), rows_SRE[r].sum(axis=1))
        y_AD = x_TD.new_zeros(T * K, x_TD.shape[1])
        y_AD[assign_N] = y_ND.to(y_AD.dtype)
        w_TK = routing.weights_TK.to(y_AD.dtype)
        if active_A is not None:
            w_TK = w_TK * active_A.view(T, K)
        # (T, K, D), not (T, K, -1): a rank may have no token (every one of its tokens left early) and still
        # take its part in both all-to-alls
        out_TD: torch.Tensor = (y_AD.view(T, K, x_TD.shape[1]) * w_TK.unsqueeze(-1)).sum(dim=1)
        return out_TD, experts_s, dispatch_s + combine_s

    def _all_to_all(self, x_ND: torch.Tensor, send_R: np.ndarray, recv_R: np.ndarray) -> tuple[torch.Tensor, float]:
        """(the rows received, seconds inside the collective, waiting included)."""
        out = x_ND.new_empty(int(recv_R.sum()), x_ND.shape[1])
        x_ND = x_ND.contiguous()
        self.o.clock.settle()
        t0 = time.perf_counter()
        dist.all_to_all_single(out, x_ND, [int(v) for v in recv_R], [int(v) for v in send_R], group=self.o.group)
        seconds = time.perf_counter() - t0
        self.o.clock.mark()
        return out, seconds

    def _experts(self, x_MD: torch.Tensor, recv_SE: np.ndarray, pad: bool) -> torch.Tensor:
        block = CPU_BLOCK_ROWS if x_MD.device.type == "cpu" else 0  # see CPU_BLOCK_ROWS
        return expert_rows(self.layer.experts, x_MD, recv_SE, block, pad)


def expert_rows(experts: Any, x_MD: torch.Tensor, recv_SE: np.ndarray, block: int = 0,
                pad: bool = True) -> torch.Tensor:
    """The received rows (blocks in (source, expert) order, `recv_SE` rows per block) through their experts' SwiGLU
    (`experts.w1`, `w3`: [E, F, D], `w2`: [E, D, F]), one expert at a time.

    The rows are gathered once into expert-major order (each expert's rows contiguous, sources in order) and the
    outputs scattered back once, so an expert's GEMMs read and write slices, whatever the number of sources.
    `block` > 0 (CPU_BLOCK_ROWS) runs a group of n >= `block` rows in n // `block` near-equal parts (each
    `block` to 2 x `block` - 1 rows: no short tail to pad); 0 runs it in one GEMM per projection. A group under
    MIN_ROWS rows is padded with zero rows to MIN_ROWS (see MIN_ROWS), so a row's output does not depend on its
    group or block. `pad` False computes such a group as it is, a few times faster (a 64-row GEMM for 1-16 rows),
    its bits then depending on its size: for a layer whose groups every policy computes alike (`_unsplittable`)."""
    if block and block < MIN_ROWS:
        raise ValueError(f"expert_rows: block ({block}) must be 0 (whole groups) or at least MIN_ROWS ({MIN_ROWS})")
    S, E = recv_SE.shape
    per_E = recv_SE.sum(axis=0)
    expert_M = np.repeat(np.tile(np.arange(E), S), recv_SE.reshape(-1))
    order_M = torch.as_tensor(np.argsort(expert_M, kind="stable")).to(x_MD.device)  # expert-major, sources kept
    x_sorted = x_MD.index_select(0, order_M)
    y_sorted = torch.empty_like(x_sorted)
    start = 0
    for e in range(E):
        n = int(per_E[e])
        if not n:
            continue
        w1, w3, w2 = (w[e].to(x_MD.dtype) for w in (experts.w1, experts.w3, experts.w2))
        parts = max(1, n // block) if block else 1
        cuts = [start + i * n // parts for i in range(parts + 1)]
        for lo, hi in zip(cuts[:-1], cuts[1:]):
            x = x_sorted[lo:hi]
            if pad and hi - lo < MIN_ROWS:  # see MIN_ROWS: the same GEMM kernel for every group size
                x = torch.cat([x, x.new_zeros(MIN_ROWS - (hi - lo), x.shape[1])])
            h = F.silu(x @ w1.T) * (x @ w3.T)
            y_sorted[lo:hi] = (h @ w2.T)[:hi - lo]
        start += n
    return torch.empty_like(y_sorted).index_copy_(0, order_M, y_sorted)
