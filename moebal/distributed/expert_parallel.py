"""Expert parallelism: an MoE layer's experts sharded over the "ep" group, placements applied per step.

Shape legend: T local tokens, K = top_k, E logical experts, R ranks in the EP group, D model dim,
N rows this rank sends, M rows it receives, L experts present on this rank (owned + replicated here).

One layer's forward on rank r (`ExpertParallelDispatcher.forward`):
  1. route locally (the layer's gate, unchanged), then sort this rank's active assignments by
     (compute rank, expert): the compute rank of (r, e) is r itself when r owns e or holds a replica of e
     (Pro-Prophet: a replica computes its own rank's tokens), else e's owner;
  2. exchange the [R, E] count matrix with one small all-to-all              <- host sync: split sizes
     (with plan-ahead, E more columns: this rank's estimate of layer i+1, moebal/distributed/plan_ahead.py,
     after which layer i+1's placement is planned and its Trans issued);
  3. all-to-all the token rows (uneven splits, inside autograd);
  4. regroup the received rows from (source, expert) order to (expert, source) order and run the grouped
     SwiGLU over the L local experts (owned parameters and Trans'd replica buffers);
  5. undo the regrouping, all-to-all the outputs back (the reverse splits), combine with the gate weights.
Backward runs the same exchanges in reverse (autograd), replica gradients accumulate in their buffers.

Around the step (`ExpertParallel`):
  - Trans (before forward): the owner of every replicated expert sends its parameters to the replica holders
    (point-to-point; fan-out cost grows with the receivers, unlike Pro-Prophet's eq. 4, which the cost model
    accounts for);
  - Agg (after backward, before the optimizer step): replica gradients travel back to the owner and are added
    in ascending rank order, so every placement computes the same sum in a fixed order;
  - gradient sync: non-expert gradients averaged over every rank of the stage ("dp_ep"); expert gradients
    (already summed over the EP group by the all-to-all backward) summed over their data-parallel copies
    ("dp") and divided by the same rank count, so both equal the single-process mean-loss gradient.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any, Protocol

import torch
import torch.distributed as dist
from torch import nn

from moebal.distributed.groups import ParallelDims
from moebal.kernels.dispatch import DispatchPlan, combine
from moebal.planner.plan import ExpertPlacement, default_owners
from moebal.scheduler.core import CommScheduler, Handle
from moebal.scheduler.exchange import ExchangePlan, expert_exchange
from moebal.scheduler.grads import GradGroup, GradSync
from moebal.sync import count_ids, to_host, upload

if TYPE_CHECKING:
    from moebal.distributed.plan_ahead import PlanAhead
    from moebal.models.moe import MoELayer
    from moebal.routing import Routing

# (placement, experts computed here, grad mode): what a step's stacked weights were built for
_StackKey = tuple[ExpertPlacement, tuple[int, ...], bool]
_Weights = tuple[torch.Tensor, torch.Tensor, torch.Tensor]
# an owner's Agg receives for one replicated expert: (dispatcher, expert, [(holder, flat gradient)])
_Inbox = tuple["ExpertParallelDispatcher", int, list[tuple[int, torch.Tensor]]]

__all__ = ["ExpertParallel", "ExpertParallelDispatcher", "is_expert_param"]

_EXPERT_ATTR = "_moebal_expert_param"


def is_expert_param(p: torch.Tensor) -> bool:
    """True for parameters sharded by expert parallelism (their gradients sync over "dp" only)."""
    return bool(getattr(p, _EXPERT_ATTR, False))


def _sorted_keys(keys_A: torch.Tensor, num_keys: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(order_A, counts_K): assignments sorted by an integer key in [0, num_keys) (key == num_keys marks an
    inactive assignment, sorted last) and the rows per key; no host sync."""
    order_A = torch.sort(keys_A, stable=True).indices
    return order_A, count_ids(keys_A, num_keys + 1)[:num_keys]


class ExpertWeights(Protocol):
    """Where a layer's owned expert weights live when they are sharded at rest (`parallel.shard: full`,
    moebal/distributed/fsdp.py `ExpertsAtRest`): gathered before a read, freed after."""

    trans_reads: bool
    """Whether Trans may read them (a placement policy that replicates): Trans gathers them first."""

    @property
    def gathered(self) -> bool: ...

    def gather(self) -> None: ...

    def release(self) -> None: ...

    def after_forward(self, out: torch.Tensor) -> torch.Tensor:
        """The layer's forward is done: free them (unless its backward comes next), and return `out` made to
        gather them again when the backward pass reaches it."""
        ...


class ExpertModel(Protocol):
    """What expert parallelism needs of a model: a whole model (`MoebalForCausalLM`) or a pipeline stage."""

    def moe_layers(self) -> Iterable[MoELayer]: ...

    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]: ...


class ExpertParallelDispatcher:
    """The token path of one MoE layer under expert parallelism (replaces the local dispatch/compute/combine)."""

    def __init__(self, layer: MoELayer, dims: ParallelDims, sched: CommScheduler | None = None,
                 index: int = 0, group: Any = None, compute_dtype: torch.dtype | None = None) -> None:
        """`group`: the communicator of the token exchange (default: the "ep" group; `ExpertParallel` passes
        its high-priority channel); `compute_dtype`: the dtype the experts compute in (bf16 under autocast),
        in which replicas travel and are held (None: the parameters' dtype)."""
        self.layer, self.index = layer, index
        self.sched = sched or CommScheduler("off", rank=dims.rank, device=dims.device)
        self.compute_dtype = compute_dtype
        self._stacked: tuple[_StackKey, _Weights] | None = None  # (key, weights) for this step
        self.a2a_chunks = 1  # Lina's all-to-all micro-ops per exchange (set per step by the scheduling hook)
        self.trans: Handle | None = None  # this layer's Trans in flight
        # called when the layer's token exchange begins (block overlap: next Trans)
        self.on_start: Callable[[], None] | None = None
        # called with {replicated expert: flat gradient} when its backward is done
        self.on_grads: Callable[[dict[int, torch.Tensor]], None] | None = None
        self.group = group if group is not None else dims.group("ep")
        self.R, self.r = dims.size("ep"), dims.index("ep")
        self.ep_ranks = dims.ranks_of("ep")
        self.E = layer.num_experts
        self.owner = default_owners(self.E, self.R)
        self.owned = [e for e in range(self.E) if self.owner[e] == self.r]
        self.placement = ExpertPlacement.static(self.E, self.R)
        self.replicas: dict[int, torch.Tensor] = {}  # expert -> flat [w1 | w3 | w2] buffer (a leaf with grad)
        self.ahead: PlanAhead | None = None  # plans the next layer from this layer's gate (planner.plan_ahead)
        self.weights: ExpertWeights | None = None  # owned weights sharded at rest (None: held whole)
        self._shard(layer)

    # ---- sharding and replicas ----
    def _shard(self, layer: MoELayer) -> None:
        lo, hi = self.owned[0], self.owned[-1] + 1
        for name in ("w1", "w3", "w2"):
            full = getattr(layer.experts, name)
            if full.shape[0] == len(self.owned) < self.E:  # built as this rank's shard (moebal.models.from_hf)
                p = full if isinstance(full, nn.Parameter) else nn.Parameter(full.detach())
            else:
                p = nn.Parameter(full.detach()[lo:hi].clone())
            setattr(p, _EXPERT_ATTR, True)
            setattr(layer.experts, name, p)
        layer.experts.expert_ids = tuple(self.owned)  # rows are experts lo..hi-1 (checkpoints key them so)

    def _local_index(self, e: int) -> int:
        return e - self.owned[0]

    @property
    def wire_dtype(self) -> torch.dtype:
        """The dtype of replicas and their gradients (Trans and Agg payloads)."""
        return self.compute_dtype or self.layer.experts.w1.dtype

    def expert_flat(self, e: int) -> torch.Tensor:
        """An owned expert's parameters as one flat tensor [w1 | w3 | w2] in the wire dtype (what Trans sends)."""
        i, ex = self._local_index(e), self.layer.experts
        if self.weights is not None and not self.weights.gathered:
            raise RuntimeError(f"Trans of expert {e} of MoE layer {self.index}: its weights are sharded at rest and "
                               f"were not gathered (a replicating placement under planner.policy static?)")
        return torch.cat([ex.w1[i].reshape(-1), ex.w3[i].reshape(-1), ex.w2[i].reshape(-1)]).detach().to(
            self.wire_dtype)

    def _expert_views(self, flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        ex = self.layer.experts
        F_, D = ex.w1.shape[1], ex.w1.shape[2]
        n = F_ * D
        return flat[:n].view(F_, D), flat[n:2 * n].view(F_, D), flat[2 * n:].view(D, F_)

    def _local_weights(self, local: list[int]) -> _Weights:
        """Stacked [L, ...] weights of the experts computed here, in ascending expert id.

        Plain expert parallelism uses the parameters (no copy). With replicas the owned slices and the
        replica buffers are stacked once per step, in the compute dtype (the cast the kernel would make
        anyway), and reused by every micro-batch's forward until the next placement (`reset_step`): the
        stack's autograd nodes save no tensors, so each backward pass can run through them."""
        ex = self.layer.experts
        if local == self.owned:
            return ex.w1, ex.w3, ex.w2  # plain expert parallelism: no copy
        key = (self.placement, tuple(local), torch.is_grad_enabled())
        if self._stacked is not None and self._stacked[0] == key:
            return self._stacked[1]
        dtype = self.wire_dtype
        parts: list[tuple[torch.Tensor, ...]] = []
        for e in local:
            if e in self.replicas:
                parts.append(self._expert_views(self.replicas[e]))
            else:
                i = self._local_index(e)
                parts.append((ex.w1[i].to(dtype), ex.w3[i].to(dtype), ex.w2[i].to(dtype)))
        w1, w3, w2 = (torch.stack([p[j] for p in parts]) for j in range(3))
        self._stacked = (key, (w1, w3, w2))
        return w1, w3, w2

    def reset_step(self) -> None:
        """Forget this step's stacked weights (new placement, or the parameters changed)."""
        self._stacked = None

    def _destinations(self, device: torch.device) -> torch.Tensor:
        """Compute rank of this rank's tokens for each expert under the current placement (cached per plan)."""
        key = (self.placement, device)
        if getattr(self, "_dest_key", None) != key:
            self._dest_E = upload([self.placement.compute_rank(self.r, e) for e in range(self.E)], device,
                                  torch.int64)
            self._dest_key = key
        return self._dest_E

    # ---- the token path ----
    def forward(self, x_TD: torch.Tensor, routing: Routing) -> torch.Tensor:
        T, K = routing.indices_TK.shape
        E, R, dev = self.E, self.R, x_TD.device
        if self.weights is not None:  # sharded at rest: whole for this forward (a no-op when Trans gathered them)
            self.weights.gather()
        if self.on_start is not None:
            self.on_start()
        if torch.is_autocast_enabled(dev.type):  # rows travel in the compute dtype: half the bytes of fp32
            x_TD = x_TD.to(torch.get_autocast_dtype(dev.type))
        # 1. sort assignments by (compute rank, expert)
        dest_E = self._destinations(dev)
        experts_A = routing.indices_TK.reshape(-1)
        keys_A = dest_E[experts_A] * E + experts_A
        if routing.active_TK is not None:
            keys_A = torch.where(routing.active_TK.reshape(-1), keys_A, R * E)
        order_A, counts_RE = _sorted_keys(keys_A, R * E)
        send_RE = counts_RE.view(R, E)
        # plan-ahead (moebal/distributed/plan_ahead.py): this rank's estimate of the next layer rides along
        ahead = self.ahead
        est_E = ahead.on_gate(self.index, routing.indices_TK) if ahead is not None else None
        send_RX = send_RE if est_E is None else torch.cat([send_RE, est_E.expand(R, E)], dim=1)
        # 2. counts: recv_RX[s, e] = rows rank s sends here for expert e (then rank s's estimate, if any)
        recv_RX = torch.empty_like(send_RX)
        self.sched.all_to_all(recv_RX, send_RX, None, None, self.group, name=f"L{self.index} counts",
                              layer=self.index, kind="counts").wait()
        # The layer's one host sync: the split sizes of the uneven all-to-all (both directions in one read).
        send_wide, recv_wide = to_host(torch.stack([send_RX, recv_RX]), "all-to-all counts")
        send_counts, recv_counts = [row[:E] for row in send_wide], [row[:E] for row in recv_wide]
        if est_E is not None and ahead is not None:  # plan the next layer, issue its Trans (async)
            ahead.on_counts(self.index, [row[E:] for row in recv_wide])
        order_N = order_A[:sum(map(sum, send_counts))]
        plan = DispatchPlan(order_N=order_N, token_N=torch.div(order_N, K, rounding_mode="floor"),
                            counts_E=counts_RE, num_tokens=T, top_k=K)
        # 3-5. dispatch, experts on the L local experts (owned and Trans'd replicas), combine: in c token chunks
        local = list(self.placement.local_experts(self.r))
        xplan = ExchangePlan(send_counts=send_counts, recv_counts=recv_counts, local=local,
                             chunks=self.a2a_chunks, device=dev, layer=self.index,
                             recompute=self.layer.recomputes_experts())
        on_grads = self.on_grads
        if on_grads is not None and self.placement.replicated:  # owners post their receives here too
            xplan.on_weight_grads = lambda dW: on_grads(self._replica_grads(local, dW))
        x_ND = x_TD.index_select(0, plan.token_N)
        self.wait_trans()
        y_ND = expert_exchange(x_ND, self._local_weights(local), xplan, self.layer.experts, self.sched, self.group)
        out_TD = combine(y_ND, plan, routing.weights_TK)
        if self.weights is not None:  # freed until the backward pass reaches this output (it gathers them again)
            out_TD = self.weights.after_forward(out_TD)
        if out_TD.requires_grad:
            # Lina's look-ahead: when the backward reaches this combine, a backward all-to-all is imminent
            out_TD.register_hook(self._announce)
        return out_TD

    def _replica_grads(self, local: list[int], dW: list[torch.Tensor | None]) -> dict[int, torch.Tensor]:
        """Flat [w1 | w3 | w2] gradient of every replica among the experts computed here."""
        grads = [g for g in dW if g is not None]
        out = {}
        for j, e in enumerate(local):
            if e in self.replicas and len(grads) == len(dW):
                out[e] = torch.cat([g[j].reshape(-1) for g in grads])
        return out

    def _announce(self, grad: torch.Tensor) -> None:
        self.sched.expect_critical()

    def wait_trans(self) -> None:
        """Block until this layer's replica parameters have arrived (Trans issued earlier, maybe overlapped)."""
        h, self.trans = getattr(self, "trans", None), None
        if h is not None:
            h.wait()


class ExpertParallel:
    """Expert parallelism for a whole model: sharding, per-step placements, Trans, Agg and gradient sync.

    Every collective goes through `sched` (a `CommScheduler`; mode "off" issues the gradient sync after the
    backward pass, "ddp" and "lina" overlap it with the backward, see moebal/scheduler). With `overlap`
    (Pro-Prophet's block-wise scheduling), Trans of layer l+1 is issued when layer l's MoE block starts and
    waited for just before layer l+1 exchanges tokens, and Agg of layer l is issued as soon as layer l's expert
    backward has produced the replica gradients and waited for only before the optimizer step.
    """

    def __init__(self, model: ExpertModel, dims: ParallelDims, sched: CommScheduler | None = None, *,
                 chunk_bytes: float = 0.0, overlap: bool = False, compute_dtype: torch.dtype | None = None,
                 sync_gradients: bool = True) -> None:
        """`compute_dtype`: what the experts compute in (bf16 under autocast; None: the parameters' dtype):
        replicas travel and live in it. `sync_gradients` false: no gradient buffers and no sync (a sharded
        optimizer, moebal/distributed/sharded.py, reduce-scatters the gradients after Agg). The token
        exchanges of every layer share one high-priority channel over the "ep" ranks (NCCL: a high-priority
        stream; gloo: a group of its own)."""
        self.model, self.dims = model, dims
        self.sched = sched or CommScheduler("off", rank=dims.rank, device=dims.device)
        if self.sched.device.type != dims.device.type:
            raise ValueError(f"the communication scheduler runs on {self.sched.device}, the job on {dims.device}: "
                             f"build it with device=dims.device")
        self.overlap, self.compute_dtype, self.sync = overlap, compute_dtype, sync_gradients
        self.a2a_group = dims.new_channel("ep", high_priority=True, timeout_s=self.sched.timeout_s)
        self.reducer = StatsReducer(dims.group("dp_ep"), self.sched)
        self.layers: list[MoELayer] = []
        self.dispatchers: list[ExpertParallelDispatcher] = []
        self._agg: list[tuple[list[Handle], list[_Inbox]]] = []
        self._agg_issued: set[int] = set()  # layers whose Agg went out this step
        self._chained: set[int] = set()
        self._chunk_bytes = chunk_bytes
        self._channels = self._grad_channels()
        self.grads: GradSync | None = None
        self.ahead: PlanAhead | None = None  # planner.plan_ahead: set_plan_ahead
        self.refresh()

    def set_plan_ahead(self, ahead: PlanAhead | None) -> None:
        """Plan each ahead layer during the layer before it (moebal/distributed/plan_ahead.py); None: off."""
        self.ahead = ahead
        for d in self.dispatchers:
            d.ahead = ahead

    def attach(self, layer: MoELayer) -> ExpertParallelDispatcher:
        """Shard one MoE layer over the "ep" group and route its tokens through a dispatcher (a layer built
        here, or the uninitialised skeleton of a layer migrating in, before its shard's values arrive)."""
        d = layer.dispatcher
        if not isinstance(d, ExpertParallelDispatcher):
            d = ExpertParallelDispatcher(layer, self.dims, self.sched, group=self.a2a_group,
                                         compute_dtype=self.compute_dtype)
            layer.set_dispatcher(d)
            layer.set_stats_reducer(self.reducer)
        return d

    def refresh(self) -> None:
        """Re-read the model's MoE layers (after layers migrated in or out); new ones are sharded, placements
        are indexed in the new order, the gradient buffers are rebuilt for the new parameter set."""
        self.layers = list(self.model.moe_layers())
        self.dispatchers = [self.attach(layer) for layer in self.layers]
        for i, d in enumerate(self.dispatchers):
            d.index = i
            d.on_start = lambda i=i: self._layer_starts(i)
            d.on_grads = None  # Agg's hook under `overlap`: set for the backward passes that issue it (`apply`)
            d.ahead = getattr(self, "ahead", None)
        self._rebuild_grads(self._chunk_bytes)

    def set_chunk_bytes(self, chunk_bytes: float) -> None:
        """Cut the gradient buffers into chunks of this size (between steps; collective over the stage: the
        ranks adopt the smallest size any of them asks for, since every rank of a reduction group must cut
        its buffer alike)."""
        if self.dims.distributed:
            # a host value, once per run: a CPU tensor, which the device-aware group hands to gloo (NCCL would
            # reject it, and a device copy would only add an upload and a read-back)
            t = torch.tensor([float(chunk_bytes)], dtype=torch.float64)
            dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.dims.group("dp_ep"))
            chunk_bytes = t.item()
        self._rebuild_grads(chunk_bytes)

    def _rebuild_grads(self, chunk_bytes: float) -> None:
        if self.grads is not None:
            if self.grads.active:
                raise RuntimeError("the gradient buffers cannot be rebuilt inside a step")
            self.grads.close()
            self.grads = None
        self._chunk_bytes = chunk_bytes
        if not self.sync:
            return
        dense, expert = self._channels
        world = self.dims.size("dp_ep")
        groups = [GradGroup("dp_ep", [p for p in self.parameters(expert=False) if p.requires_grad], dense, world),
                  GradGroup("dp", [p for p in self.parameters(expert=True) if p.requires_grad], expert, world)]
        self.grads = GradSync(self.sched, groups, chunk_bytes if self.sched.mode != "off" else 0.0)

    def _grad_channels(self) -> tuple[Any, Any]:
        """Non-expert gradients are averaged over every rank of the stage, expert gradients summed over their
        data-parallel copies and divided by the same count: on the scheduler's own channels when it overlaps
        the sync with the backward pass (nothing else may issue on them), on the axis groups otherwise; in
        either case with the ring in node order where the axis group's is not (gloo, nodes interleaved: see
        moebal.distributed.groups), which halves what a 4-rank all-reduce puts on each link there."""
        dims = self.dims
        own = self.sched.mode != "off"

        def channel(axis: str) -> Any:
            if own or dims.needs_node_ring(axis):
                return dims.new_channel(axis, timeout_s=self.sched.timeout_s, ring_by_node=True)
            return dims.group(axis)

        dense = channel("dp_ep")
        expert = channel("dp") if dims.size("dp") > 1 else None
        return dense, expert

    def parameters(self, expert: bool) -> Iterator[nn.Parameter]:
        return (p for p in self.model.parameters() if is_expert_param(p) == expert)

    # ---- placements: Trans before forward, Agg after backward ----
    def apply(self, placements: Iterable[ExpertPlacement], *, plan_ahead: bool = True) -> None:
        """Start a step: adopt one placement per MoE layer and issue Trans (all layers now and wait, or with
        `overlap` layer 0 now and each next layer when the previous one starts); arm the gradient hooks. With a
        plan-ahead planner (`set_plan_ahead`) and `plan_ahead`, its ahead layers start static, without Trans:
        their placements are planned and their Trans issued during the layer before them (`place_ahead`)."""
        placements = list(placements)
        if len(placements) != len(self.dispatchers):
            raise ValueError(f"{len(placements)} placements for {len(self.dispatchers)} MoE layers")
        if self.ahead is not None:
            for j in self.ahead.arm(self.place_ahead if plan_ahead else None):
                placements[j] = ExpertPlacement.static(placements[j].num_experts, placements[j].num_ranks,
                                                       placements[j].owner)
        for d, plc in zip(self.dispatchers, placements):
            if plc.num_ranks != d.R or plc.owner != d.owner:
                raise ValueError(f"placement for {plc.num_ranks} ranks with owners {plc.owner} does not match the "
                                 f"expert-parallel layout ({d.R} ranks, owners {d.owner})")
            d.placement, d.replicas, d.trans = plc, {}, None
            d.reset_step()
        self._agg, self._agg_issued = [], set()
        self._chained = set()  # layers whose Trans the overlap chain issued this step
        self._agg_during_backward(False)
        if not self.defer_gradient_sync:
            self.arm_gradient_sync()
        for i in range(len(self.dispatchers) if not self.overlap else 1):
            # weights sharded at rest are freed again once every layer's Trans has copied what it sends: the
            # forward gathers each layer in turn (with `overlap` layer 0 stays gathered for its forward)
            self._trans(i, keep=self.overlap)
        if not self.overlap:
            for d in self.dispatchers:
                d.wait_trans()

    defer_gradient_sync = False
    """Arm the gradient hooks in `arm_gradient_sync` (called before the step's last micro-batch under
    `train.grad_accum`), not in `apply`: a hook reads `.grad` when one backward pass has finished it, which is
    the micro-batches' sum only in the last one."""

    def arm_gradient_sync(self) -> None:
        """Arm what sends gradients during the (next) backward pass: with a scheduler the gradient hooks (chunks go
        out as gradients complete), with `overlap` Agg's hooks (each layer's replica gradients go out when its
        expert backward is done; under deferral with the earlier micro-batches' sum added, `_agg_issue`)."""
        if self.sched.mode != "off" and self.grads is not None and not self.grads.active:
            self.grads.begin_step()
        self._agg_during_backward(self.overlap)

    def arm_agg(self, on: bool) -> None:
        """Arm (or disarm) Agg's in-backward hooks for the forwards that follow, with the earlier passes' sum
        added (`defer_gradient_sync`): a pipeline stage arms them for the forward of its last backward's
        micro-batch only (the hooks are captured per forward), without a gradient scheduler of its own."""
        self._agg_during_backward(on and self.overlap)

    def _agg_during_backward(self, on: bool) -> None:
        for i, d in enumerate(self.dispatchers):
            d.on_grads = (lambda dW, i=i: self._agg_issue(i, dW, earlier=self.defer_gradient_sync)) if on else None

    def place_ahead(self, i: int, placement: ExpertPlacement) -> None:
        """Adopt layer i's placement planned ahead (inside the forward of layer i-1) and issue its Trans, which
        layer i's forward waits for before its token exchange."""
        d = self.dispatchers[i]
        if placement.num_ranks != d.R or placement.owner != d.owner:
            raise ValueError(f"plan-ahead placement for {placement.num_ranks} ranks with owners {placement.owner} "
                             f"does not match the expert-parallel layout ({d.R} ranks, owners {d.owner})")
        d.placement, d.replicas, d.trans = placement, {}, None
        d.reset_step()
        self._trans(i, gather=False)

    def _layer_starts(self, i: int) -> None:
        """MoE layer i's forward begins: with `overlap`, Trans of layer i+1. Else, under plan-ahead, layer i+1's
        expert weights sharded at rest are gathered now on every rank (a prefetch): plan-ahead may issue layer
        i+1's Trans inside layer i, on the ranks whose step runs the plan arm only (the feedback's arm is agreed
        over "ep", not over the ranks a gather spans), and that Trans must then find them gathered rather than
        start a collective some peers would not join."""
        if self.overlap:
            if i + 1 not in self._chained:  # once per step: a later forward (micro-batch) finds the replicas held
                self._chained.add(i + 1)
                self._trans(i + 1)
        elif self.ahead is not None and i + 1 < len(self.dispatchers):
            w = self.dispatchers[i + 1].weights
            if w is not None and w.trans_reads:
                w.gather()

    def _trans(self, i: int, keep: bool = True, gather: bool = True) -> None:
        """Issue Trans of MoE layer i: owners send each replicated expert to its holders (point-to-point). Owned
        weights sharded at rest are gathered first (`gather`), on every rank whatever its placement (the gather
        is a collective over the ranks holding the same experts, whose placements may differ), and kept for the
        layer's forward (`keep`) or freed (the sends go from copies). Plan-ahead's Trans does not gather: the
        layer before prefetched them (`_layer_starts`)."""
        if i >= len(self.dispatchers):
            return
        d = self.dispatchers[i]
        w = d.weights if d.weights is not None and d.weights.trans_reads else None
        if w is not None and gather:
            w.gather()
        ops: list[Any] = []
        for e in d.placement.replicated:
            ops.extend(self._trans_ops(d, e))
        if w is not None and not keep:
            w.release()
        # a replica of a frozen layer's expert (the owner's weights take no gradient) takes none either
        trainable = d.layer.experts.w1.requires_grad
        for buf in d.replicas.values():
            buf.requires_grad_(trainable)
        if ops:
            d.trans = self.sched.p2p(ops, kind="trans", name=f"L{i} trans", layer=i)

    def _trans_ops(self, d: ExpertParallelDispatcher, e: int) -> list[Any]:
        owner, holders = d.placement.owner[e], d.placement.replicas[e]
        tag = 1 + 2 * d.index  # Trans and Agg of every layer on their own tags: no cross-layer matching
        if d.r == owner:
            flat = d.expert_flat(e)
            return [dist.P2POp(dist.isend, flat, d.ep_ranks[h], tag=tag) for h in holders]
        if d.r in holders:
            ex = d.layer.experts
            numel = _expert_numel(ex.w1, ex.w2)
            buf = torch.empty(numel, dtype=d.wire_dtype, device=ex.w1.device)
            d.replicas[e] = buf
            return [dist.P2POp(dist.irecv, buf, d.ep_ranks[owner], tag=tag)]
        return []

    def release(self) -> None:
        """Drop every replica (back to plain expert parallelism for the token path). Call after the optimizer
        step: replicas are copies of the pre-update parameters, so any later forward (validation, the next step
        before its Trans) must not use them."""
        if self.ahead is not None:
            self.ahead.disarm()
        for d in self.dispatchers:
            d.placement, d.replicas, d.trans = ExpertPlacement.static(d.E, d.R), {}, None
            d.reset_step()

    def _agg_issue(self, i: int, grads: dict[int, torch.Tensor], earlier: bool = False) -> None:
        """Issue Agg of MoE layer i: holders send replica gradients (flat [w1 | w3 | w2]) to the owner, which
        posts one receive per holder. `grads` maps each replicated expert held here to its gradient; `earlier`
        (the last micro-batch's backward under accumulation, inside it): add what the earlier micro-batches'
        backward passes left in the replica's `.grad` (this pass's reaches it only after this hook)."""
        d = self.dispatchers[i]
        self._agg_issued.add(i)
        tag = 2 + 2 * d.index
        ops: list[Any] = []
        inbox: list[_Inbox] = []
        for e in d.placement.replicated:
            owner, holders = d.placement.owner[e], d.placement.replicas[e]
            if d.r in holders:
                g = grads.get(e)
                g = g.to(d.wire_dtype) if g is not None else torch.zeros_like(d.replicas[e])
                before = d.replicas[e].grad if earlier else None
                if before is not None:
                    g = g + before.reshape(-1).to(d.wire_dtype)
                ops.append(dist.P2POp(dist.isend, g.contiguous(), d.ep_ranks[owner], tag=tag))
            elif d.r == owner:
                ex = d.layer.experts
                numel = _expert_numel(ex.w1, ex.w2)
                recv = [(h, torch.empty(numel, dtype=d.wire_dtype, device=ex.w1.device)) for h in holders]
                ops.extend(dist.P2POp(dist.irecv, t, d.ep_ranks[h], tag=tag) for h, t in recv)
                inbox.append((d, e, recv))
        handles = [self.sched.p2p(ops, kind="agg", name=f"L{i} agg", layer=i)] if ops else []
        self._agg.append((handles, inbox))

    def aggregate(self) -> None:
        """Agg: sum replica gradients into the owners' gradients (fixed rank order); call after backward. With
        `overlap` the transfers were issued during the backward pass and are only waited for here, except a
        layer's whose last backward pass did not reach its experts (a pipeline stage whose last micro-batch
        skipped the layer, or a stage that differentiates nothing): that one goes now, from `.grad`. Every rank
        of the "ep" group runs the same layers in the same passes, so they agree on which."""
        for i, d in enumerate(self.dispatchers):
            if i not in self._agg_issued:
                self._agg_issue(i, {e: buf.grad for e, buf in d.replicas.items() if buf.grad is not None})
        for handles, inbox in self._agg:
            for h in handles:
                h.wait()
            for d, e, recv in inbox:
                ex, i = d.layer.experts, d._local_index(e)
                if not ex.w1.requires_grad:  # frozen: a gradient here would let the optimizer move the weights
                    continue
                g1, g3, g2 = _grad_of(ex.w1)[i], _grad_of(ex.w3)[i], _grad_of(ex.w2)[i]
                for _, flat in sorted(recv, key=lambda item: item[0]):
                    v1, v3, v2 = d._expert_views(flat)
                    g1.add_(v1)
                    g3.add_(v3)
                    g2.add_(v2)
        self._agg = []

    def sync_gradients(self) -> None:
        """Average gradients so they equal the single-process mean-loss gradient (see the module docstring);
        with a scheduler most chunks are already in flight or done, this waits for the rest. Nothing without
        gradient buffers (`sync_gradients` false)."""
        if self.grads is None:
            return
        if not self._sync.active:
            self._sync.begin_step()
        self._sync.finish()

    def close(self) -> None:
        if self.grads is not None:
            self.grads.close()

    @property
    def _sync(self) -> GradSync:
        if self.grads is None:
            raise RuntimeError("ExpertParallel: the gradient buffers are built in __init__ (refresh); none exist")
        return self.grads


def _expert_numel(w1: torch.Tensor, w2: torch.Tensor) -> int:
    """Elements of one expert's [w1 | w3 | w2], from the shapes alone (weights sharded at rest hold no values)."""
    return 2 * w1.shape[1:].numel() + w2.shape[1:].numel()


def _grad_of(p: torch.Tensor) -> torch.Tensor:
    """p's gradient, created as zeros when it has none yet."""
    g = p.grad
    if g is None:
        g = p.grad = torch.zeros_like(p)
    return g


class StatsReducer:
    """Sums routing statistics over a group; `sum_grad` is differentiable (its backward sums gradients). With a
    scheduler the all-reduces go through it (logged, and counted as critical: gradient chunks wait)."""

    def __init__(self, group: Any, sched: CommScheduler | None = None) -> None:
        self.group, self.sched = group, sched

    def reduce(self, t: torch.Tensor, name: str) -> torch.Tensor:
        if self.sched is not None:
            return self.sched.all_reduce(t, self.group, name=name)
        dist.all_reduce(t, group=self.group)
        return t

    def sum(self, t: torch.Tensor) -> torch.Tensor:
        return self.reduce(t, "routing stats")

    def sum_grad(self, t: torch.Tensor) -> torch.Tensor:
        total: torch.Tensor = _AllReduceSum.apply(t, self)  # Function.apply is typed Any
        return total


class _AllReduceSum(torch.autograd.Function):
    """y = sum over ranks of x; every rank's y feeds its own loss, so dL/dx = sum over ranks of dL_r/dy."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, red: StatsReducer) -> torch.Tensor:
        ctx.red = red
        return red.reduce(x.clone(), "balancing loss")

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None]:
        return ctx.red.reduce(g.clone(), "balancing loss bwd"), None
