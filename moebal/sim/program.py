"""One training iteration of a decoder (dense or MoE) as an op graph for the engine.

Shape legend: L = layers, G = expert-parallel groups in a stage, R = ranks of one EP group, E = experts,
S = ranks of one stage (G * R = data-parallel size).

Layout (DeepSpeed-MoE / Megatron style): world = pp * dp; stage s owns ranks [s * dp, (s + 1) * dp); inside
a stage, EP group g is ranks s * dp + g * ep + [0, ep). Non-expert gradients are all-reduced over the stage's
dp ranks, expert gradients over the dp / ep ranks that hold the same experts. Consecutive ranks share a node,
so an EP group of 8 on an 8-GPU node exchanges tokens over NVLink.

Per micro-batch and MoE layer, forward (backward mirrors it with the backward GEMM shapes, dgrad + wgrad):
1. compute: norm + attention + router + permute (with the layer's own combine, counted here);
2. dispatch all-to-all (ep stream) of the byte matrix the placement implies;
3. compute: the experts this rank holds, on the rows it computes;
4. combine all-to-all (the transposed matrix).
A schedule may split 2-4 into rounds (FasterMoE's group-wise exchange, Lina's token chunks) so that expert
compute of round i overlaps the transfer of round i+1.

Placement traffic: Trans (chain broadcast of each replicated expert from its owner to its holders) and Agg
(chain reduce back) on an `aux` stream. Pro-Prophet's block-wise scheduler issues Trans of layer l+1 when
layer l starts (hidden under its compute) and Agg of layer l right after its backward, waiting only before the
optimizer step; without it (FasterMoE) both sit on the ep stream in the layer's critical path.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from moebal.errors import ConfigError
from moebal.planner.cost import Collective, CostModel, ModelShape, Topology
from moebal.planner.plan import ExpertPlacement
from moebal.planner.schedule import make_schedule
from moebal.sim.engine import Engine

__all__ = ["Layout", "SimSpec", "build_program", "pipeline_order", "uniform_stages"]

SCHEDULES = ("1f1b", "gpipe")
MOE_SCHEDULES = ("serial", "fastermoe", "lina")
RECOMPUTE = ("none", "moe", "attention", "full")


@dataclass(frozen=True)
class Layout:
    """pp stages x dp data-parallel ranks; expert-parallel groups of `ep` inside each stage's dp ranks."""

    ranks: int
    pp: int = 1
    ep: int = 1

    def __post_init__(self) -> None:
        if self.ranks < 1 or self.pp < 1 or self.ep < 1:
            raise ConfigError(f"ranks, pp and ep must be >= 1; got ranks={self.ranks}, pp={self.pp}, ep={self.ep}")
        if self.ranks % self.pp:
            raise ConfigError(f"{self.ranks} ranks cannot form {self.pp} pipeline stages: choose --ranks a "
                              f"multiple of parallel.pp")
        if self.dp % self.ep:
            raise ConfigError(f"expert-parallel size {self.ep} must divide the data-parallel size "
                              f"{self.dp} (= ranks / pp): change parallel.ep or --ranks")

    @property
    def dp(self) -> int:
        return self.ranks // self.pp

    @property
    def groups(self) -> int:
        """EP groups per stage."""
        return self.dp // self.ep

    def stage_ranks(self, s: int) -> np.ndarray:
        return np.arange(s * self.dp, (s + 1) * self.dp)

    def ep_groups(self, s: int) -> np.ndarray:
        """[G, R] global ranks of each EP group of stage s."""
        return self.stage_ranks(s).reshape(self.groups, self.ep)


@dataclass(frozen=True, kw_only=True)
class SimSpec:
    """Everything that shapes the op graph besides the model, the routing and the placements."""

    layout: Layout
    micro_batches: int = 1
    micro_batch_size: int = 1
    """Sequences per micro-batch per data-parallel rank."""
    seq_len: int = 2048
    schedule: str = "1f1b"
    moe_schedule: str = "serial"
    """serial (DeepSpeed-MoE), fastermoe (group-wise rounds of `round_group` ranks), lina (token chunks)."""
    round_group: int = 4
    a2a_chunks: int = 1
    trans_overlap: bool = False
    """Pro-Prophet block-wise scheduler: Trans/Agg off the critical path."""
    dp_overlap: bool = True
    """All-reduce gradient buckets during the backward pass (DDP); False: after it."""
    bucket_bytes: float = 25e6
    lina_priority: bool = False
    """Lina: an all-reduce chunk is issued only while no all-to-all is registered on the rank."""
    ar_chunk_bytes: float | None = None
    """Lina: all-reduce each gradient in chunks of this size instead of fused buckets."""
    grad_bytes: int = 4
    """Bytes per gradient element on the wire (fp32 main gradients); Agg's replica gradients travel in the compute
    dtype, as Trans's replicas."""
    tie_weight_bytes: int = 4
    """Bytes per element of a tied embedding's stepped weight on its way to the last stage's head copy (with
    stages): 2 where the sharded optimizer keeps bf16 compute copies (`parallel.param_dtype: bf16`), which is what
    travels (moebal/pipeline/tied.py); the head copy's gradient travels in fp32 (`grad_bytes` does not apply)."""
    stage_layers: tuple[int, ...] | None = None
    layer_scale: tuple[float, ...] | None = None
    """Multiplier on each layer's compute (dynamism schemes: pruning, MoD, early exit)."""
    optimizer: bool = True
    trans_algorithm: str = "chain"
    """Trans/Agg as a pipelined chain (NCCL broadcast/reduce) or a point-to-point fan-out ("fanout")."""
    a2a_padding: str = "none"
    """"capacity": every (source, expert) block padded to the largest one, as DeepSpeed-MoE's dropless mode
    does (capacity = max over ranks of per-expert counts, the all-to-all carries [E, C, D]); "none": exact."""
    count_exchange: bool = True
    """Exchange the R x E count matrix (a small all-to-all) before each forward dispatch, as dropless EP does."""
    recompute: str = "none"
    """`train.recompute`: none, moe, attention, full. The backward pass of a layer first re-runs the forward of
    what is recomputed: attention (`attention`, `full`); the router and the expert GEMMs, or the dense MLP
    (`moe`, `full`). Under expert parallelism only the rank-local expert GEMMs are rerun, never the
    all-to-alls (moebal/models/recompute.py), so the recomputation is compute on the backward ops only."""
    meta: dict[str, object] = field(default_factory=dict)
    stats_allreduce: bool = False
    """All-reduce each MoE layer's balancing statistics over its EP group, as moebal's expert parallelism does
    (`StatsReducer.sum_grad`: the global balancing loss, 2E + 1 fp32 values): blocking, after the combine in the
    forward, and its gradient before the layer's backward all-to-alls. Each is a synchronisation of the group's
    ranks plus one small all-reduce (its cost from the profile's all-reduce latency); False: a local loss."""
    moe_pass_overhead_s: float = 0.0
    """Host time on every rank of an EP group (ep > 1) at the start of each MoE layer pass, forward and backward,
    per micro-batch: the expert-parallel machinery the other terms leave out (dispatch bookkeeping, the issue
    path of its collectives). A measured constant: `scripts/validate_simulator.py` fits it on probe-shaped EP
    steps (docs/simulator.md); 0 elsewhere."""

    def check(self, shape: ModelShape) -> None:
        if self.schedule not in SCHEDULES:
            raise ConfigError(f"pipeline schedule must be one of {', '.join(SCHEDULES)}; got {self.schedule!r}")
        if self.moe_schedule not in MOE_SCHEDULES:
            raise ConfigError(f"moe schedule must be one of {', '.join(MOE_SCHEDULES)}; got {self.moe_schedule!r}")
        if self.recompute not in RECOMPUTE:
            raise ConfigError(f"recompute must be one of {', '.join(RECOMPUTE)}; got {self.recompute!r}")
        if self.micro_batches < 1 or self.micro_batch_size < 1 or self.seq_len < 1:
            raise ConfigError("micro_batches, micro_batch_size and seq_len must be >= 1")
        if shape.num_experts and shape.num_experts % self.layout.ep:
            raise ConfigError(f"{shape.num_experts} experts cannot be sharded over ep={self.layout.ep} ranks: "
                              f"choose an ep that divides the number of experts")
        stages = self.stage_layers or uniform_stages(shape.n_layers, self.layout.pp)
        if len(stages) != self.layout.pp or sum(stages) != shape.n_layers or min(stages) < 1:
            raise ConfigError(f"stage_layers {list(stages)} must have {self.layout.pp} entries >= 1 summing to "
                              f"{shape.n_layers} layers")
        if not self.moe_pass_overhead_s >= 0:
            raise ConfigError(f"moe_pass_overhead_s must be >= 0 seconds; got {self.moe_pass_overhead_s}")
        if self.a2a_padding not in ("none", "capacity"):
            raise ConfigError(f"a2a_padding must be 'none' or 'capacity'; got {self.a2a_padding!r}")
        if self.trans_algorithm not in ("chain", "fanout"):
            raise ConfigError(f"trans_algorithm must be 'chain' or 'fanout'; got {self.trans_algorithm!r}")
        if self.layer_scale is not None and len(self.layer_scale) != shape.n_layers:
            raise ConfigError(f"layer_scale needs one factor per layer ({shape.n_layers}); got {len(self.layer_scale)}")


def uniform_stages(n_layers: int, pp: int) -> tuple[int, ...]:
    """Megatron's static split: equal layer counts, the remainder on the first stages."""
    if pp > n_layers:
        raise ConfigError(f"{pp} pipeline stages need at least {pp} layers; the model has {n_layers}")
    base, extra = divmod(n_layers, pp)
    return tuple(base + (1 if s < extra else 0) for s in range(pp))


def pipeline_order(schedule: str, stage: int, stages: int, m: int) -> list[tuple[str, int]]:
    """The (F|B, micro-batch) order a stage runs: GPipe (all forwards, then all backwards) or 1F1B, as the
    pipeline engine runs them (`planner.schedule`)."""
    if schedule not in SCHEDULES:
        raise ConfigError(f"unknown simulated pipeline schedule {schedule!r}; choose one of {', '.join(SCHEDULES)}")
    return make_schedule(schedule, stages, stage, m)


# ---------------------------------------------------------------------------------------------------------
# per-layer data


@dataclass
class _MoELayerData:
    """Per EP group g: rounds of (dispatch bytes [R, R], expert forward seconds [R], expert backward seconds [R])
    for one micro-batch, FasterMoE's shadow compute (forward, backward), and each replicated expert's
    (owner, holders)."""

    rounds: list[list[tuple[np.ndarray, np.ndarray, np.ndarray]]]
    shadow_s: list[tuple[np.ndarray, np.ndarray]]
    replicated: list[list[tuple[int, tuple[int, ...]]]]


def _split_placement(counts_RE: np.ndarray, pl: ExpertPlacement) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(local_RE rows a rank computes from its own tokens, remote_RE rows that travel to the owner, own_RE owner
    mask) for one placement: a holder computes its own tokens, the owner everyone else's."""
    R, E = counts_RE.shape
    own_RE = np.zeros((R, E), dtype=bool)
    own_RE[np.asarray(pl.owner), np.arange(E)] = True
    held_RE = own_RE.copy()
    for e, reps in enumerate(pl.replicas):
        if reps:
            held_RE[list(reps), e] = True
    return counts_RE * held_RE, counts_RE * ~held_RE, own_RE


def _moe_data(cost: CostModel, shape: ModelShape, spec: SimSpec, counts_GRE: np.ndarray,
              placements: Sequence[ExpertPlacement]) -> _MoELayerData:
    """Per-micro-batch traffic and expert compute of one MoE layer on every EP group of a stage (the expert
    times of all groups and rounds in one vectorised cost-model call)."""
    cap = counts_GRE.max() / spec.micro_batches  # DeepSpeed's dropless capacity: max over ranks and experts
    parts, shadow_rows, repl = [], [], []
    for g, pl in enumerate(placements):
        c_RE = counts_GRE[g] / spec.micro_batches
        if spec.a2a_padding == "capacity":
            c_RE = np.full_like(c_RE, cap)
        local_RE, remote_RE, own_RE = _split_placement(c_RE, pl)
        if spec.moe_schedule == "fastermoe":
            # FasterMoE computes a rank's own tokens of shadowed experts separately, after the rounds.
            shadow_rows.append(local_RE * ~own_RE)
            local_RE = local_RE * own_RE
        else:
            shadow_rows.append(np.zeros_like(local_RE))
        parts.append(_split_rounds(cost, shape, spec, local_RE, remote_RE, own_RE))
        repl.append([(pl.owner[e], pl.holders(e)) for e in pl.replicated])
    rows = np.stack([r for p in parts for _, r in p] + shadow_rows)  # [groups * rounds + groups, R, E]
    fwd, bwd = np.asarray(cost.experts_s(shape, rows)), np.asarray(cost.experts_s(shape, rows, True))
    rounds, k = [], 0
    for p in parts:
        rounds.append([(b, fwd[k + i], bwd[k + i]) for i, (b, _) in enumerate(p)])
        k += len(p)
    shadows = [(fwd[k + g], bwd[k + g]) for g in range(len(placements))]
    return _MoELayerData(rounds=rounds, shadow_s=shadows, replicated=repl)


def _split_rounds(cost: CostModel, shape: ModelShape, spec: SimSpec, local_RE: np.ndarray, remote_RE: np.ndarray,
                  own_RE: np.ndarray) -> list[tuple[np.ndarray, np.ndarray]]:
    """[(dispatch bytes [R, R], expert rows [R, E])] per round."""
    R = local_RE.shape[0]
    tok_bytes = shape.dim * cost.act_bytes
    owner_E = np.argmax(own_RE, axis=0)
    send_RR = np.zeros((R, R))
    np.add.at(send_RR.T, owner_E, remote_RE.T)  # send_RR[:, owner[e]] += remote_RE[:, e]
    np.fill_diagonal(send_RR, 0.0)
    if spec.moe_schedule == "fastermoe" and spec.round_group < R:
        n = -(-R // spec.round_group)
        grp = np.arange(R) // spec.round_group
        out = []
        for s in range(n):
            mask_RR = ((grp[None, :] - grp[:, None]) % n) == s  # src group g sends to group g + s in round s
            rows_RE = (mask_RR.T.astype(np.float64) @ remote_RE) * own_RE + (local_RE if s == 0 else 0.0)
            out.append((send_RR * mask_RR * tok_bytes, rows_RE))
        return out
    k = spec.a2a_chunks if spec.moe_schedule == "lina" else 1
    rows_RE = (local_RE + (remote_RE.sum(axis=0)[None, :] * own_RE)) / k
    return [(send_RR * tok_bytes / k, rows_RE) for _ in range(k)]


def build_program(cost: CostModel, shape: ModelShape, spec: SimSpec, counts: np.ndarray | None,
                  placements: Sequence[Sequence[ExpertPlacement]] | None, topo: Topology) -> Engine:
    """The op graph of one iteration. counts[l] is [G, R, E] token-expert assignments per rank for the whole
    iteration (None for dense models); placements[l][g] the placement of layer l on EP group g."""
    return _Builder(cost, shape, spec, counts, placements, topo).build()


class _Builder:
    def __init__(self, cost: CostModel, shape: ModelShape, spec: SimSpec, counts: np.ndarray | None,
                 placements: Sequence[Sequence[ExpertPlacement]] | None, topo: Topology) -> None:
        spec.check(shape)
        self.cost, self.shape, self.spec, self.topo = cost, shape, spec, topo
        self.lay = spec.layout
        self.eng = Engine(topo)
        self.stages = spec.stage_layers or uniform_stages(shape.n_layers, self.lay.pp)
        self.first_layer = np.concatenate([[0], np.cumsum(self.stages)])
        self.tokens = spec.micro_batch_size * spec.seq_len
        self.counts, self.placements = counts, placements
        self.moe: dict[int, _MoELayerData] = {}
        self.scale = spec.layer_scale or (1.0,) * shape.n_layers
        self._names: dict[str, str] = {}
        self._ranks_cache: dict[tuple[int, int], list[int]] = {}
        self._coll_cache: dict[tuple[int, int, int, str], Collective] = {}
        # cross-stage wiring: (stage, kind, micro-batch) -> op ids per stage rank
        self.first_op: dict[tuple[int, str, int], list[int]] = {}
        self.last_op: dict[tuple[int, str, int], list[int]] = {}
        self.grad_ready: dict[int, list[int]] = {}
        self.trans_ops: dict[tuple[int, int], list[int]] = {}
        self.agg_ops: dict[int, list[int]] = {}  # global rank -> its Agg ops (the optimizer waits for them)
        self.tie_recv: dict[int, int] = {}  # first-stage rank -> its receive of the tied head's gradient
        self.opt_ops: dict[int, int] = {}  # global rank -> its optimizer op

    def nm(self, text: str) -> str:
        return self._names.setdefault(text, text)

    def build(self) -> Engine:
        for s in range(self.lay.pp):
            for l_ in range(self.first_layer[s], self.first_layer[s + 1]):
                if self.shape.is_moe(int(l_)):
                    self._prepare_moe(int(l_))
            self._emit_stage(s)
        self._wire_pipeline()
        tied = self.shape.tie_embeddings and self.lay.pp > 1
        if tied:
            self._tie_gradients()
        for s in range(self.lay.pp):
            self._emit_grad_sync(s)
        if tied and self.spec.optimizer:
            self._tie_weights()
        return self.eng

    def _prepare_moe(self, layer: int) -> None:
        lay = self.lay
        if self.counts is None:
            raise ConfigError(f"layer {layer} is an MoE layer but no routing counts were given")
        c = np.asarray(self.counts[layer], dtype=np.float64)
        if c.shape != (lay.groups, lay.ep, self.shape.num_experts):
            raise ConfigError(f"routing counts of layer {layer} have shape {c.shape}; expected "
                              f"({lay.groups} EP groups, {lay.ep} ranks, {self.shape.num_experts} experts)")
        pls = (self.placements[layer] if self.placements is not None
               else [ExpertPlacement.static(self.shape.num_experts, lay.ep)] * lay.groups)
        self.moe[layer] = _moe_data(self.cost, self.shape, self.spec, c, pls)

    # ---- compute times ----
    def _attn_s(self, layer: int, backward: bool = False) -> float:
        """Attention and everything of the layer that is not expert work (router, or the dense MLP); an MoE
        layer's forward also counts its own combine (the weighted sum after the combine all-to-all: the same
        total, placed before the exchanges), the backward leaves the combine to its own op."""
        sh, sp, cost = self.shape, self.spec, self.cost
        t = cost.attention_s(sh, sp.micro_batch_size, sp.seq_len, backward)
        if sh.is_moe(layer):
            t += cost.router_s(sh, self.tokens, backward)
            if not backward:
                t += cost.combine_s(sh, self.tokens)
        else:
            t += cost.dense_mlp_s(sh, self.tokens, backward)
        if backward:  # the recomputed forward runs at the start of the layer's backward
            if sp.recompute in ("attention", "full"):
                t += cost.attention_s(sh, sp.micro_batch_size, sp.seq_len, False)
            if sp.recompute in ("moe", "full"):
                t += (cost.router_s(sh, self.tokens, False) if sh.is_moe(layer)
                      else cost.dense_mlp_s(sh, self.tokens, False))
        return t * self.scale[layer]

    # ---- one stage ----
    def _emit_stage(self, s: int) -> None:
        ranks = self.lay.stage_ranks(s)
        m = self.spec.micro_batches
        for kind, j in pipeline_order(self.spec.schedule, s, self.lay.pp, m):
            if kind == "F":
                self._forward(s, ranks, j)
            else:
                self._backward(s, ranks, j, last=(j == m - 1))

    def _compute(self, ranks: np.ndarray, dur: float | np.ndarray, name: str, deps: list[list[int]] | None,
                 cat: str = "compute") -> list[int]:
        n = len(ranks)
        durs = [float(dur)] * n if np.ndim(dur) == 0 else np.asarray(dur, dtype=np.float64).tolist()
        return self.eng.compute_many(self._rank_list(ranks), "compute", durs, self.nm(name), cat, deps)

    def _rank_list(self, ranks: np.ndarray) -> list[int]:
        key = (int(ranks[0]), len(ranks))
        got = self._ranks_cache.get(key)
        if got is None:
            got = self._ranks_cache[key] = [int(r) for r in ranks]
        return got

    def _a2a(self, layer: int, g: int, ranks: np.ndarray, k: int, mat: np.ndarray, key: str) -> Collective:
        """The all-to-all of a (layer, group, round, direction): the same for every micro-batch, built once."""
        ck = (layer, g, k, key)
        coll = self._coll_cache.get(ck)
        if coll is None:
            coll = self._coll_cache[ck] = self.cost.all_to_all(self.topo, ranks, mat)
        return coll

    def _forward(self, s: int, ranks: np.ndarray, j: int) -> None:
        sh, cost = self.shape, self.cost
        lo, hi = int(self.first_layer[s]), int(self.first_layer[s + 1])
        prev: list[list[int]] | None = None
        first = None
        if s == 0:
            prev = [[o] for o in self._compute(ranks, cost.embed_s(sh, self.tokens), f"F{j} embed", None)]
            first = [p[0] for p in prev]
        # what the previous layer's block waited for: its end is that block's start, when Pro-Prophet's scheduler
        # issues this layer's Trans (None before the stage's first layer: at the iteration's start)
        block_start: list[list[int]] | None = None
        for layer in range(lo, hi):
            if sh.is_moe(layer) and j == 0:
                self._trans(s, layer, block_start if self.spec.trans_overlap else prev)
            block_start = prev
            ops = self._compute(ranks, self._attn_s(layer), f"F{j} L{layer} attn", prev)
            first = first or ops
            prev = [[o] for o in ops]
            if sh.is_moe(layer):
                prev = self._moe_pass(s, layer, j, prev, backward=False)
        if s == self.lay.pp - 1:
            prev = [[o] for o in self._compute(ranks, cost.head_s(sh, self.tokens), f"F{j} head", prev)]
        self.first_op[(s, "F", j)] = first or []
        self.last_op[(s, "F", j)] = [p[-1] for p in prev] if prev else []

    def _backward(self, s: int, ranks: np.ndarray, j: int, last: bool) -> None:
        sh, cost = self.shape, self.cost
        lo, hi = int(self.first_layer[s]), int(self.first_layer[s + 1])
        deps = [[o] for o in self.last_op[(s, "F", j)]]
        first = None
        if s == self.lay.pp - 1:
            ops = self._compute(ranks, cost.head_s(sh, self.tokens, True), f"B{j} head", deps)
            first, deps = ops, [[o] for o in ops]
        for layer in range(hi - 1, lo - 1, -1):
            if sh.is_moe(layer):
                comb = self._compute(ranks, cost.combine_s(sh, self.tokens, True) * self.scale[layer],
                                     f"B{j} L{layer} combine", deps)
                first = first or comb
                deps = self._moe_pass(s, layer, j, [[o] for o in comb], backward=True)
            ops = self._compute(ranks, self._attn_s(layer, True), f"B{j} L{layer} attn", deps)
            first = first or ops
            deps = [[o] for o in ops]
            if last:
                self.grad_ready[layer] = ops
                if sh.is_moe(layer):
                    self._agg(s, layer, deps)
        if s == 0:
            ops = self._compute(ranks, cost.embed_s(sh, self.tokens, True), f"B{j} embed", deps)
            deps = [[o] for o in ops]
        self.first_op[(s, "B", j)] = first or []
        self.last_op[(s, "B", j)] = [d[-1] for d in deps]

    # ---- MoE layer passes ----
    def _moe_pass(self, s: int, layer: int, j: int, deps: list[list[int]], backward: bool) -> list[list[int]]:
        """Dispatch, experts, combine in rounds for every EP group; returns per stage-rank deps after it."""
        data = self.moe[layer]
        groups = self.lay.ep_groups(s)
        out: list[list[int]] = [[] for _ in range(self.lay.dp)]
        tag = f"{'B' if backward else 'F'}{j} L{layer}"
        for g, ranks in enumerate(groups):
            base = g * self.lay.ep
            gdeps = deps[base:base + self.lay.ep]
            res = self._group_pass(layer, g, ranks, gdeps, tag, backward, data)
            out[base:base + self.lay.ep] = res
        return out

    def _group_pass(self, layer: int, g: int, ranks: np.ndarray, deps: list[list[int]], tag: str, backward: bool,
                    data: _MoELayerData) -> list[list[int]]:
        eng = self.eng
        rounds = data.rounds[g]
        prio = self.spec.lina_priority
        scale = self.scale[layer]
        if self.spec.moe_pass_overhead_s > 0 and len(ranks) > 1:
            deps = [[o] for o in self._compute(ranks, self.spec.moe_pass_overhead_s, f"{tag} ep host", deps)]
        if self.spec.stats_allreduce and backward:
            deps = self._stats_allreduce(layer, g, ranks, deps, f"{tag} stats", prio)
        if self.spec.count_exchange and not backward:
            R = len(ranks)
            coll = self._a2a(layer, g, ranks, -1, np.full((R, R), 8.0 * self.shape.num_experts), "counts")
            deps = [[o] for o in eng.collective(coll, "ep", self.nm(f"{tag} counts"), "a2a", deps=deps,
                                                priority=prio)]
        disp = []
        for k, (b_RR, _, _) in enumerate(rounds):
            mat = b_RR.T if backward else b_RR  # backward: output gradients travel like the combine
            coll = self._a2a(layer, g, ranks, k, mat, "T" if backward else "N")
            ops = eng.collective(coll, "ep", self.nm(f"{tag} a2a{k}"), "a2a", deps=deps if k == 0 else None,
                                 priority=prio)
            if backward and prio and k == 0:
                for d, o in zip(deps, ops):
                    eng.announce_priority(d[-1], o)  # Lina's look-ahead: the combine backward announces it
            disp.append(ops)
        fastermoe = self.spec.moe_schedule == "fastermoe"
        if fastermoe and data.replicated[g] and not backward:
            disp.append(self._broadcasts(layer, g, "ep", None))
        comb = []
        extra = [self.trans_ops.get((layer, int(r)), []) for r in ranks]
        again = self.spec.recompute in ("moe", "full")  # the expert GEMMs' forward rerun before their backward
        for k, (b_RR, fwd_R, bwd_R) in enumerate(rounds):
            exp = self._compute(ranks, ((bwd_R + fwd_R if again else bwd_R) if backward else fwd_R) * scale,
                                f"{tag} experts{k}",
                                [[disp[k][i], *extra[i]] for i in range(len(ranks))], "experts")
            coll = self._a2a(layer, g, ranks, k, b_RR if backward else b_RR.T, "N" if backward else "T")
            comb.append(eng.collective(coll, "ep", self.nm(f"{tag} a2a{k}'"), "a2a", deps=[[o] for o in exp],
                                       priority=prio))
        last = [[c[i] for c in comb] for i in range(len(ranks))]
        sh_f, sh_b = data.shadow_s[g]
        if fastermoe and sh_f.any():
            sh = self._compute(ranks, (sh_b if backward else sh_f) * scale, f"{tag} shadow",
                               [[disp[-1][i]] for i in range(len(ranks))])
            last = [lst + [o] for lst, o in zip(last, sh)]
            if backward:
                red = self._broadcasts(layer, g, "ep", [[o] for o in sh], reduce=True)
                last = [lst + [o] for lst, o in zip(last, red)]
        if self.spec.stats_allreduce and not backward:
            last = self._stats_allreduce(layer, g, ranks, last, f"{tag} stats", prio)
        return last

    def _stats_allreduce(self, layer: int, g: int, ranks: np.ndarray, deps: list[list[int]], name: str,
                         prio: bool) -> list[list[int]]:
        """The balancing statistics' all-reduce (2E + 1 fp32 values) over an EP group: every member waits."""
        ck = (layer, g, -2, "stats")
        coll = self._coll_cache.get(ck)
        if coll is None:
            nbytes = 4.0 * (2 * self.shape.num_experts + 1)
            coll = self._coll_cache[ck] = self.cost.all_reduce(self.topo, ranks.tolist(), nbytes)
        ops = self.eng.collective(coll, "ep", self.nm(name), "stats", deps=deps, priority=prio)
        return [[o] for o in ops]

    # ---- placement traffic ----
    def _broadcasts(self, layer: int, g: int, stream: str, deps: list[list[int]] | None,
                    reduce: bool = False) -> list[int]:
        """Trans (or Agg with reduce=True) of every replicated expert of layer `layer` in EP group g, issued
        together as one grouped operation (all chains progress at once and share the links); returns per group
        member its op id (-1 when it takes no part)."""
        eng, cost, topo = self.eng, self.cost, self.topo
        ranks = self.lay.ep_groups(self.layer_stage(layer))[g]
        # both in the compute dtype: the executor's replicas and their gradients travel in it (`wire_dtype`)
        nbytes = self.shape.expert_params * self.cost.act_bytes
        kind = "reduce" if reduce else "broadcast"
        groups = [(int(ranks[o]), [int(ranks[h]) for h in hs]) for o, hs in self.moe[layer].replicated[g]]
        last = {int(r): -1 for r in ranks}
        if not groups:
            return [-1] * len(ranks)
        coll = cost.broadcast_many(topo, groups, nbytes, kind, self.spec.trans_algorithm)
        pos = {int(r): i for i, r in enumerate(ranks)}
        mdeps = [deps[pos[r]] if deps else () for r in coll.ranks]
        ops = eng.collective(coll, stream, self.nm(f"L{layer} {'agg' if reduce else 'trans'}"),
                             "agg" if reduce else "trans", deps=mdeps)
        for r, o in zip(coll.ranks, ops):
            last[r] = o
        return [last[int(r)] for r in ranks]

    def layer_stage(self, layer: int) -> int:
        return int(np.searchsorted(self.first_layer, layer, side="right") - 1)

    def _trans(self, s: int, layer: int, prev: list[list[int]] | None) -> None:
        """Pro-Prophet's Trans, after `prev` (per rank of the stage): with its block-wise scheduler
        (`trans_overlap`) when the block before the layer starts, on the aux stream, hidden under that block's
        compute; without it when the block before has ended, on the ep stream, in the layer's critical path."""
        if self.spec.moe_schedule == "fastermoe":
            return  # FasterMoE broadcasts inside the layer (see _group_pass)
        data = self.moe[layer]
        for g in range(self.lay.groups):
            if not data.replicated[g]:
                continue
            base = g * self.lay.ep
            gdeps = prev[base:base + self.lay.ep] if prev else None
            ops = self._broadcasts(layer, g, "aux" if self.spec.trans_overlap else "ep", gdeps)
            for r, o in zip(self.lay.ep_groups(s)[g], ops):
                if o >= 0:
                    self.trans_ops[(layer, int(r))] = [o]

    def _agg(self, s: int, layer: int, deps: list[list[int]]) -> None:
        if self.spec.moe_schedule == "fastermoe":
            return  # reduced inside the layer's backward (see _group_pass)
        data = self.moe[layer]
        for g in range(self.lay.groups):
            if not data.replicated[g]:
                continue
            base = g * self.lay.ep
            ops = self._broadcasts(layer, g, "aux" if self.spec.trans_overlap else "ep",
                                   deps[base:base + self.lay.ep], reduce=True)
            for r, o in zip(self.lay.ep_groups(s)[g], ops):
                if o >= 0:
                    self.agg_ops.setdefault(int(r), []).append(o)

    # ---- pipeline wiring and gradient sync ----
    def _wire_pipeline(self) -> None:
        eng, cost, topo = self.eng, self.cost, self.topo
        act = self.tokens * self.shape.dim * self.cost.act_bytes
        for s in range(self.lay.pp - 1):
            src, dst = self.lay.stage_ranks(s), self.lay.stage_ranks(s + 1)
            fwd = [cost.p2p(topo, int(a), int(b), act) for a, b in zip(src, dst)]
            bwd = [cost.p2p(topo, int(b), int(a), act) for a, b in zip(src, dst)]
            for j in range(self.spec.micro_batches):
                for i in range(self.lay.dp):
                    send = eng.collective(fwd[i], ["pp_fwd_out", "pp_fwd_in"],
                                          self.nm(f"F{j} send"), "p2p", deps=[[self.last_op[(s, "F", j)][i]], []])
                    eng.add_dep(self.first_op[(s + 1, "F", j)][i], send[1])
                    back = eng.collective(bwd[i], ["pp_bwd_out", "pp_bwd_in"],
                                          self.nm(f"B{j} send"), "p2p", deps=[[self.last_op[(s + 1, "B", j)][i]], []])
                    eng.add_dep(self.first_op[(s, "B", j)][i], back[1])

    # tied embeddings across stages (moebal/pipeline/tied.py): each pipeline's last stage sends its head copy's
    # gradient (fp32) to its first stage, whose data-parallel sum of the embedding waits for it; after the first
    # stage's optimizer step the stepped weight (fp32, or bf16 compute copies: `tie_weight_bytes`) goes back, and
    # the last stage's step ends with its receipt
    def _tie_bytes(self, element: int = 4) -> float:
        return float(self.shape.vocab_size * self.shape.dim * element)

    def _tie_gradients(self) -> None:
        eng, cost, topo, lay = self.eng, self.cost, self.topo, self.lay
        for a, b in zip(lay.stage_ranks(0), lay.stage_ranks(lay.pp - 1)):
            # the stage's last backward op: GPipe and 1F1B end with B (the simulator has no zero bubble, no W)
            done = eng.last_op(int(b), "compute")
            ops = eng.collective(cost.p2p(topo, int(b), int(a), self._tie_bytes()), ["pp_bwd_out", "pp_bwd_in"],
                                 self.nm("tie grad send"), "p2p", deps=[[done], []])
            self.tie_recv[int(a)] = ops[1]

    def _tie_weights(self) -> None:
        eng, cost, topo, lay = self.eng, self.cost, self.topo, self.lay
        for a, b in zip(lay.stage_ranks(0), lay.stage_ranks(lay.pp - 1)):
            eng.collective(cost.p2p(topo, int(a), int(b), self._tie_bytes(self.spec.tie_weight_bytes)),
                           ["pp_fwd_out", "pp_fwd_in"],
                           self.nm("tie weight send"), "p2p", deps=[[self.opt_ops[int(a)]], []])

    def _grad_items(self, s: int) -> list[tuple[int, float, float]]:
        """(layer, non-expert grad bytes, expert grad bytes per rank) in the order grads become ready."""
        sh, gb = self.shape, self.spec.grad_bytes
        lo, hi = int(self.first_layer[s]), int(self.first_layer[s + 1])
        items: list[tuple[int, float, float]] = []
        head = sh.vocab_size * sh.dim if (s == self.lay.pp - 1 and not sh.tie_embeddings) else 0
        for layer in range(hi - 1, lo - 1, -1):
            dense = sh.attn_params + (sh.router_params if sh.is_moe(layer) else sh.dense_mlp_params)
            if layer == hi - 1:
                dense += head
            if layer == lo and s == 0:
                dense += sh.vocab_size * sh.dim
            experts = sh.expert_params * sh.num_experts // self.lay.ep if sh.is_moe(layer) else 0
            items.append((layer, dense * gb, experts * gb))
        return items

    def _emit_grad_sync(self, s: int) -> None:
        """Bucketed (or Lina-chunked) all-reduce of gradients, then the optimizer step."""
        lay, spec = self.lay, self.spec
        stage = lay.stage_ranks(s)
        edp = [stage[j::lay.ep] for j in range(lay.ep)]  # ranks holding the same experts
        dense_q: list[tuple[int, float]] = []
        exp_q: list[tuple[int, float]] = []
        for layer, dense_b, exp_b in self._grad_items(s):
            dense_q.append((layer, dense_b))
            if exp_b and lay.groups > 1:
                exp_q.append((layer, exp_b))
        self._reduce_queue(stage[None, :], dense_q, "dp")
        if exp_q:
            self._reduce_queue(np.stack(edp), exp_q, "edp")
        if spec.optimizer:
            self._optimizer(s)

    def _reduce_queue(self, groups: np.ndarray, queue: list[tuple[int, float]], stream: str) -> None:
        spec, eng, cost, topo = self.spec, self.eng, self.cost, self.topo
        chunk = spec.ar_chunk_bytes
        size, ready = 0.0, -1
        pieces: list[tuple[float, int]] = []  # (bytes, layer whose backward must finish first)
        for layer, b in queue:
            if chunk:
                n = int(np.ceil(b / chunk))
                pieces += [(min(chunk, b - i * chunk), layer) for i in range(n)]
                continue
            size += b
            ready = layer
            if size >= spec.bucket_bytes:
                pieces.append((size, ready))
                size = 0.0
        if size > 0:
            pieces.append((size, ready))
        last_bwd = {int(r): op for (st, kind, j), ops in self.last_op.items() if kind == "B"
                    for r, op in zip(self.lay.stage_ranks(st), ops)}
        pos = {int(r): i for s in range(self.lay.pp) for i, r in enumerate(self.lay.stage_ranks(s))}
        for k, (b, layer) in enumerate(pieces):
            for grp in groups:
                if spec.dp_overlap:
                    deps = [[self.grad_ready[layer][pos[int(r)]]] for r in grp]
                else:
                    deps = [[last_bwd[int(r)]] for r in grp]
                if layer == 0 and stream == "dp":  # the embedding's bucket: with the tied head's gradient added
                    deps = [d + ([self.tie_recv[int(r)]] if int(r) in self.tie_recv else []) for d, r in zip(deps, grp)]
                eng.collective(cost.all_reduce(topo, grp, b), stream, self.nm(f"{stream} allreduce{k}"), "allreduce",
                               deps=deps, gated=spec.lina_priority)

    def _optimizer(self, s: int) -> None:
        sh, lay = self.shape, self.lay
        params = sum(d / self.spec.grad_bytes + e / self.spec.grad_bytes for _, d, e in self._grad_items(s))
        lo, hi = int(self.first_layer[s]), int(self.first_layer[s + 1])
        # parameter tensors: 4 projections + 2 norms per layer, plus the router and 3 stacked expert matrices
        # (MoE) or 3 MLP matrices; the embedding on the first stage, final norm and head on the last
        tensors = sum(6 + ((2 if sh.router_hidden else 1) + 3 if sh.is_moe(i) else 3) for i in range(lo, hi))
        tensors += (1 if s == 0 else 0) + (2 if s == lay.pp - 1 else 0)
        eng = self.eng
        for r in lay.stage_ranks(s):
            deps = [eng.last_op(int(r), st) for st in ("dp", "edp", "aux", "ep", "compute")]
            deps += self.agg_ops.get(int(r), [])
            deps += [self.tie_recv[int(r)]] if int(r) in self.tie_recv else []
            self.opt_ops[int(r)] = eng.compute(int(r), "compute", self.cost.optimizer_s(params, tensors),
                                               self.nm("optimizer"), "optimizer", deps)
        del sh
