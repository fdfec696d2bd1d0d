"""Expert parallelism: an MoE layer's experts sharded over the "ep" group, placements applied per step.

Shape legend: T local tokens, K = top_k, E logical experts, R ranks in the EP group, D model dim,
N rows this rank sends, M rows it receives, L experts present on this rank (owned + replicated here).

One layer's forward on rank r (`ExpertParallelDispatcher.forward`):
  1. route locally (the layer's gate, unchanged), then sort this rank's active assignments by
     (compute rank, expert): the compute rank of (r, e) is r itself when r owns e or holds a replica of e
     (Pro-Prophet: a replica computes its own rank's tokens), else e's owner;
  2. exchange the [R, E] count matrix with one small all-to-all              <- host sync: split sizes
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

from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from moebal.dist.comm import all_to_all_rows, exchange_counts, sum_gradients
from moebal.dist.groups import ParallelDims
from moebal.kernels.dispatch import DispatchPlan, combine
from moebal.planner.plan import ExpertPlacement, default_owners

__all__ = ["ExpertParallel", "ExpertParallelDispatcher", "is_expert_param"]

_EXPERT_ATTR = "_moebal_expert_param"


def is_expert_param(p: torch.Tensor) -> bool:
    """True for parameters sharded by expert parallelism (their gradients sync over "dp" only)."""
    return bool(getattr(p, _EXPERT_ATTR, False))


def _sorted_plan(keys_A: torch.Tensor, num_keys: int, num_tokens: int, top_k: int) -> DispatchPlan:
    """Rows grouped by an integer key in [0, num_keys); key == num_keys marks an inactive assignment."""
    order_A = torch.sort(keys_A, stable=True).indices
    counts = torch.bincount(keys_A, minlength=num_keys + 1)
    n_active = int(keys_A.numel() - counts[num_keys])  # host sync, folded into the count exchange below
    order_N = order_A[:n_active]
    return DispatchPlan(order_N=order_N, token_N=torch.div(order_N, top_k, rounding_mode="floor"),
                        counts_E=counts[:num_keys], num_tokens=num_tokens, top_k=top_k)


def _group_plan(counts: list[int], device: torch.device) -> DispatchPlan:
    """A plan that only carries per-expert row counts (rows are already grouped by expert)."""
    counts_E = torch.tensor(counts, dtype=torch.int64, device=device)
    empty = torch.empty(0, dtype=torch.int64, device=device)
    plan = DispatchPlan(order_N=empty, token_N=empty, counts_E=counts_E, num_tokens=0, top_k=1)
    plan._host = list(counts)
    return plan


class ExpertParallelDispatcher:
    """The token path of one MoE layer under expert parallelism (replaces the local dispatch/compute/combine)."""

    def __init__(self, layer: nn.Module, dims: ParallelDims) -> None:
        self.layer = layer
        self.group = dims.group("ep")
        self.R, self.r = dims.size("ep"), dims.index("ep")
        self.ep_ranks = dims.ranks_of("ep")
        self.E = layer.num_experts
        self.owner = default_owners(self.E, self.R)
        self.owned = [e for e in range(self.E) if self.owner[e] == self.r]
        self.placement = ExpertPlacement.static(self.E, self.R)
        self.replicas: dict[int, torch.Tensor] = {}  # expert -> flat [w1 | w3 | w2] buffer (a leaf with grad)
        self._shard(layer)

    # ---- sharding and replicas ----
    def _shard(self, layer: nn.Module) -> None:
        lo, hi = self.owned[0], self.owned[-1] + 1
        for name in ("w1", "w3", "w2"):
            full = getattr(layer.experts, name)
            p = nn.Parameter(full.detach()[lo:hi].clone())
            setattr(p, _EXPERT_ATTR, True)
            setattr(layer.experts, name, p)
        layer.experts.expert_ids = tuple(self.owned)  # rows are experts lo..hi-1 (checkpoints key them so)

    def _local_index(self, e: int) -> int:
        return e - self.owned[0]

    def expert_flat(self, e: int) -> torch.Tensor:
        """An owned expert's parameters as one flat tensor [w1 | w3 | w2] (what Trans sends)."""
        i, ex = self._local_index(e), self.layer.experts
        return torch.cat([ex.w1[i].reshape(-1), ex.w3[i].reshape(-1), ex.w2[i].reshape(-1)]).detach()

    def _expert_views(self, flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        ex = self.layer.experts
        F_, D = ex.w1.shape[1], ex.w1.shape[2]
        n = F_ * D
        return flat[:n].view(F_, D), flat[n:2 * n].view(F_, D), flat[2 * n:].view(D, F_)

    def _local_weights(self, local: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Stacked [L, ...] weights of the experts computed here, in ascending expert id."""
        ex = self.layer.experts
        if local == self.owned:
            return ex.w1, ex.w3, ex.w2  # plain expert parallelism: no copy
        parts: list[tuple[torch.Tensor, ...]] = []
        for e in local:
            if e in self.replicas:
                parts.append(self._expert_views(self.replicas[e]))
            else:
                i = self._local_index(e)
                parts.append((ex.w1[i], ex.w3[i], ex.w2[i]))
        return tuple(torch.stack([p[j] for p in parts]) for j in range(3))  # type: ignore[return-value]

    def _destinations(self, device: torch.device) -> torch.Tensor:
        """Compute rank of this rank's tokens for each expert under the current placement (cached per plan)."""
        key = (self.placement, device)
        if getattr(self, "_dest_key", None) != key:
            self._dest_E = torch.tensor([self.placement.compute_rank(self.r, e) for e in range(self.E)],
                                        device=device)
            self._dest_key = key
        return self._dest_E

    # ---- the token path ----
    def forward(self, x_TD: torch.Tensor, routing: Any) -> torch.Tensor:
        T, K = routing.indices_TK.shape
        E, R, dev = self.E, self.R, x_TD.device
        # 1. sort assignments by (compute rank, expert)
        dest_E = self._destinations(dev)
        experts_A = routing.indices_TK.reshape(-1)
        keys_A = dest_E[experts_A] * E + experts_A
        if routing.active_TK is not None:
            keys_A = torch.where(routing.active_TK.reshape(-1), keys_A, R * E)
        plan = _sorted_plan(keys_A, R * E, T, K)
        send_RE = plan.counts_E.view(R, E)
        # 2. counts: recv_RE[s, e] = rows rank s sends here for expert e
        recv_RE = exchange_counts(send_RE, self.group)
        send_counts, recv_counts = send_RE.tolist(), recv_RE.tolist()  # host sync
        send_splits = [sum(row) for row in send_counts]
        recv_splits = [sum(row) for row in recv_counts]
        # 3. dispatch
        x_ND = x_TD.index_select(0, plan.token_N)
        x_MD = all_to_all_rows(x_ND, send_splits, recv_splits, self.group)
        # 4. regroup by expert and compute
        local = list(self.placement.local_experts(self.r))
        perm, per_expert = _regroup(recv_counts, local)
        perm_t = torch.as_tensor(perm, device=dev)
        w1, w3, w2 = self._local_weights(local)
        y_MD = self.layer.experts.compute(x_MD.index_select(0, perm_t), w1, w3, w2,
                                          _group_plan(per_expert, dev))
        y_MD = torch.empty_like(y_MD).index_copy(0, perm_t, y_MD) if len(perm) else y_MD
        # 5. return and combine
        y_ND = all_to_all_rows(y_MD, recv_splits, send_splits, self.group)
        return combine(y_ND, plan, routing.weights_TK)


def _regroup(recv_counts: list[list[int]], local: list[int]) -> tuple[np.ndarray, list[int]]:
    """Row permutation from (source rank, expert) order to (expert, source rank) order, and rows per expert."""
    counts_RE = np.asarray(recv_counts, dtype=np.int64)
    sub_RL = counts_RE[:, local] if local else np.zeros((counts_RE.shape[0], 0), dtype=np.int64)
    if counts_RE[:, [e for e in range(counts_RE.shape[1]) if e not in local]].any():
        raise RuntimeError("received tokens for an expert this rank does not hold: ranks disagree on the placement")
    starts_RL = (np.cumsum(sub_RL.reshape(-1)) - sub_RL.reshape(-1)).reshape(sub_RL.shape)
    pieces = [np.arange(starts_RL[s, j], starts_RL[s, j] + sub_RL[s, j])
              for j in range(sub_RL.shape[1]) for s in range(sub_RL.shape[0])]
    perm = np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.int64)
    return perm, sub_RL.sum(axis=0).tolist()


class ExpertParallel:
    """Expert parallelism for a whole model: sharding, per-step placements, Trans, Agg and gradient sync."""

    def __init__(self, model: nn.Module, dims: ParallelDims) -> None:
        self.model, self.dims = model, dims
        self.layers: list[nn.Module] = []
        self.dispatchers: list[ExpertParallelDispatcher] = []
        self.refresh()

    def attach(self, layer: nn.Module) -> ExpertParallelDispatcher:
        """Shard one MoE layer over the "ep" group and route its tokens through a dispatcher (a layer built
        here, or the uninitialised skeleton of a layer migrating in, before its shard's values arrive)."""
        d = layer.dispatcher
        if not isinstance(d, ExpertParallelDispatcher):
            d = ExpertParallelDispatcher(layer, self.dims)
            layer.set_dispatcher(d)
            layer.set_stats_reducer(StatsReducer(self.dims.group("dp_ep")))
        return d

    def refresh(self) -> None:
        """Re-read the model's MoE layers (after layers migrated in or out); new ones are sharded, placements
        are indexed in the new order."""
        self.layers = list(self.model.moe_layers())
        self.dispatchers = [self.attach(layer) for layer in self.layers]

    def parameters(self, expert: bool) -> Iterator[nn.Parameter]:
        return (p for p in self.model.parameters() if is_expert_param(p) == expert)

    # ---- placements: Trans before forward, Agg after backward ----
    def apply(self, placements: Iterable[ExpertPlacement]) -> None:
        """Adopt one placement per MoE layer and run Trans (collective over the EP group)."""
        placements = list(placements)
        if len(placements) != len(self.dispatchers):
            raise ValueError(f"{len(placements)} placements for {len(self.dispatchers)} MoE layers")
        ops: list[Any] = []
        for d, plc in zip(self.dispatchers, placements):
            if plc.num_ranks != d.R or plc.owner != d.owner:
                raise ValueError(f"placement for {plc.num_ranks} ranks with owners {plc.owner} does not match the "
                                 f"expert-parallel layout ({d.R} ranks, owners {d.owner})")
            d.placement, d.replicas = plc, {}
            for e in plc.replicated:
                ops.extend(self._trans_ops(d, e))
        _run_p2p(ops)
        for d in self.dispatchers:
            for buf in d.replicas.values():
                buf.requires_grad_(True)

    def _trans_ops(self, d: ExpertParallelDispatcher, e: int) -> list[Any]:
        owner, holders = d.placement.owner[e], d.placement.replicas[e]
        if d.r == owner:
            flat = d.expert_flat(e)
            return [dist.P2POp(dist.isend, flat, d.ep_ranks[h]) for h in holders]
        if d.r in holders:
            ex = d.layer.experts
            numel = ex.w1[0].numel() * 2 + ex.w2[0].numel()
            buf = torch.empty(numel, dtype=ex.w1.dtype, device=ex.w1.device)
            d.replicas[e] = buf
            return [dist.P2POp(dist.irecv, buf, d.ep_ranks[owner])]
        return []

    def release(self) -> None:
        """Drop every replica (back to plain expert parallelism for the token path). Call after the optimizer
        step: replicas are copies of the pre-update parameters, so any later forward (validation, the next step
        before its Trans) must not use them."""
        for d in self.dispatchers:
            d.placement, d.replicas = ExpertPlacement.static(d.E, d.R), {}

    def aggregate(self) -> None:
        """Agg: sum replica gradients into the owners' gradients (fixed rank order); call after backward."""
        ops: list[Any] = []
        inbox: list[tuple[ExpertParallelDispatcher, int, list[tuple[int, torch.Tensor]]]] = []
        for d in self.dispatchers:
            for e in d.placement.replicated:
                owner, holders = d.placement.owner[e], d.placement.replicas[e]
                if d.r in holders:
                    buf = d.replicas[e]
                    grad = buf.grad if buf.grad is not None else torch.zeros_like(buf)
                    ops.append(dist.P2POp(dist.isend, grad.contiguous(), d.ep_ranks[owner]))
                elif d.r == owner:
                    recv = [(h, torch.empty_like(d.expert_flat(e))) for h in holders]
                    ops.extend(dist.P2POp(dist.irecv, t, d.ep_ranks[h]) for h, t in recv)
                    inbox.append((d, e, recv))
        _run_p2p(ops)
        for d, e, recv in inbox:
            ex, i = d.layer.experts, d._local_index(e)
            for p in (ex.w1, ex.w3, ex.w2):
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
            g1, g3, g2 = ex.w1.grad[i], ex.w3.grad[i], ex.w2.grad[i]
            for _, flat in sorted(recv, key=lambda item: item[0]):
                v1, v3, v2 = d._expert_views(flat)
                g1.add_(v1)
                g3.add_(v3)
                g2.add_(v2)

    def sync_gradients(self) -> None:
        """Average gradients so they equal the single-process mean-loss gradient (see the module docstring)."""
        world = self.dims.size("dp_ep")
        sum_gradients(list(self.parameters(expert=False)), self.dims.group("dp_ep"), world)
        sum_gradients(list(self.parameters(expert=True)), self.dims.group("dp"), world)


class StatsReducer:
    """Sums routing statistics over a group; `sum_grad` is differentiable (its backward sums gradients)."""

    def __init__(self, group: Any) -> None:
        self.group = group

    def sum(self, t: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(t, group=self.group)
        return t

    def sum_grad(self, t: torch.Tensor) -> torch.Tensor:
        return _AllReduceSum.apply(t, self.group)


class _AllReduceSum(torch.autograd.Function):
    """y = sum over ranks of x; every rank's y feeds its own loss, so dL/dx = sum over ranks of dL_r/dy."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        y = x.clone()
        dist.all_reduce(y, group=group)
        return y

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None]:
        g = g.clone()
        dist.all_reduce(g, group=ctx.group)
        return g, None


def _run_p2p(ops: list[Any]) -> None:
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()
