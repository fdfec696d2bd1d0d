"""Fully sharded model state (`parallel.shard: full`): dense weights, gradients and AdamW state split over the
ranks of the stage with torch's FSDP2 (`torch.distributed.fsdp.fully_shard`, DTensor), expert parameters under
the sharded optimizer of `parallel.shard: optimizer` (moebal/distributed/sharded.py) over their
expert-data-parallel ranks.

Who shards what:
- dense parameters (every parameter that expert parallelism does not split: attention, norms, embeddings,
  routers, shared experts; with `parallel.ep: 1` the experts too) are `fully_shard`ed over "dp_ep" (the ranks
  that average dense gradients), one FSDP unit per decoder layer plus the root (embedding, final norm, head):
  between steps a rank keeps dim-0 shards (DTensor `Shard(0)`), a layer's weights are all-gathered for its
  forward and again for its backward (`reshard_after_forward` for every layer but the root), and the backward
  pass reduce-scatters each layer's gradients as soon as they are final: the same mean over "dp_ep" as the
  unsharded sync. FSDP2 issues on a channel of its own (never the axis groups, which the communication
  scheduler's thread issues on), in one order on every rank (its units in forward order).
- expert parameters (`is_expert_param`: the rows expert parallelism gives a rank) stay out of FSDP2
  (`ignored_params`): their gradients are final only after Pro-Prophet's Agg has added replica gradients into
  the owner's, after the backward pass, when FSDP2 would have reduced them already. `ShardedAdamW` restricted
  to them reduce-scatters them over "dp" after Agg, steps AdamW on the owned parts and all-gathers the weights;
  Trans reads the owner's weights as before. Expert weights are therefore replicated over "dp" (ZeRO-2), their
  gradients and moments sharded.

Mixed precision (`parallel.param_dtype`, `parallel.reduce_dtype`): FSDP2's `MixedPrecisionPolicy` keeps the
sharded fp32 master weights and AdamW moments, all-gathers the weights cast to `param_dtype` for compute, and
reduce-scatters gradients in `reduce_dtype` (the expert reduce-scatters use the same dtype); gradients reach
the optimizer in fp32. fp32 / fp32 (the default) is the parity case.

Checkpoints keep their logical names (docs/checkpoints.md) and are written by each owner, with no gather: a
rank writes the rows of the dense weights and moments it holds as row pieces of the logical tensors (the
manifest lists them; readers assemble them), and the rows it holds of a stacked expert tensor (`parallel.ep:
1`) as whole logical experts with their moments. Loading keeps the rank's dim-0 chunk of each logical tensor,
so a checkpoint resumes under any shard size, or none.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from moebal.config import Config
from moebal.distributed.expert_parallel import is_expert_param
from moebal.distributed.groups import ParallelDims
from moebal.distributed.sharded import ShardedAdamW

if TYPE_CHECKING:
    from moebal.train.checkpoint import CheckpointReader, RowPiece

__all__ = ["FullyShardedAdamW", "fully_shard_model", "local_chunk", "shard_rows"]

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def fully_shard_model(model: nn.Module, cfg: Config, dims: ParallelDims) -> Any:
    """`fully_shard` every decoder layer and then the root over a "dp_ep" channel, expert parameters left out;
    returns the device mesh. Collective (creates the channel), in the same order on every rank."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from moebal.models.transformer import DecoderLayer

    group = dims.new_channel("dp_ep")
    mesh = DeviceMesh.from_group(group, dims.device.type)
    par = cfg.parallel
    policy = MixedPrecisionPolicy(param_dtype=DTYPES[par.param_dtype], reduce_dtype=DTYPES[par.reduce_dtype])
    ignored = {p for p in model.parameters() if is_expert_param(p)}
    for m in list(model.modules()):
        if isinstance(m, DecoderLayer):
            fully_shard(m, mesh=mesh, mp_policy=policy, ignored_params=ignored or None)
    fully_shard(model, mesh=mesh, mp_policy=policy, ignored_params=ignored or None)
    return mesh


def local_chunk(full: torch.Tensor, like: DTensor) -> DTensor:
    """`full` (a logical tensor, the same on every rank) as a DTensor laid out like `like`: this rank keeps its
    own chunk; no communication."""
    return distribute_tensor(full.to(dtype=like.dtype, device=like.device), like.device_mesh,
                             list(like.placements), src_data_rank=None)


def shard_rows(t: DTensor) -> tuple[int, int]:
    """(first row, rows) of the logical tensor that this rank's shard of `t` holds: FSDP2's dim-0 layout, chunks of
    ceil(n / W) rows in mesh order, the last ones short or empty (as `torch.chunk`)."""
    if t.device_mesh.ndim != 1 or len(t.placements) != 1 or not t.placements[0].is_shard(0):
        raise RuntimeError(f"a DTensor laid out as {t.placements} over a {t.device_mesh.ndim}-d mesh: checkpoints "
                           f"write dim-0 shards over one mesh dimension (FSDP2's layout) only")
    n, W = t.shape[0], t.device_mesh.size()
    first = min(n, t.device_mesh.get_local_rank() * -(-n // W))
    rows = t.to_local().shape[0]
    if first + rows > n or (rows and rows != min(-(-n // W), n - first)):
        raise RuntimeError(f"a shard of {rows} rows at row {first} of a {n}-row DTensor over {W} ranks: not FSDP2's "
                           f"dim-0 chunks")
    return first, rows


class FullyShardedAdamW(torch.optim.Optimizer):
    """AdamW of a `fully_shard_model` model: torch's AdamW on the dense DTensor shards, `ShardedAdamW` on the
    expert parameters (module docstring). Its `param_groups` are the model's (the trainer sets the learning
    rate there); the dense state lives in `dense.state`, the expert state on `experts`' parts."""

    def __init__(self, model: nn.Module, cfg: Config, dims: ParallelDims) -> None:
        from moebal.train.optim import param_groups

        t = cfg.train
        groups = param_groups(model, t.weight_decay)
        super().__init__(groups, {"lr": t.lr})
        self.dims = dims
        self.reduce_dtype = DTYPES[cfg.parallel.reduce_dtype]
        dense = [{"params": [p for p in g["params"] if not is_expert_param(p)], "weight_decay": g["weight_decay"]}
                 for g in groups]
        dense = [g for g in dense if g["params"]]
        # foreach: DTensor parameters (the fused kernel takes plain tensors)
        self.dense = torch.optim.AdamW(dense, lr=t.lr, betas=(t.beta1, t.beta2), eps=1e-8, foreach=True) \
            if dense else None
        has_experts = any(is_expert_param(p) for p in model.parameters())
        self.experts = ShardedAdamW(model, t, dims, include=is_expert_param, reduce_dtype=self.reduce_dtype) \
            if has_experts else None
        self._norm_channel = dims.new_channel("dp_ep") if dims.size("dp_ep") > 1 else None
        self._dense_params = [p for g in dense for p in g["params"]]

    # ---- one step ----
    def begin(self) -> None:
        if self.experts is not None:
            self.experts.begin()

    def reduce(self) -> None:
        """After the backward pass (FSDP2 has reduce-scattered the dense gradients) and Agg: the expert buckets."""
        if self.experts is not None:
            self.experts.reduce()

    def _dense_grads(self) -> list[torch.Tensor]:
        return [_local(p.grad) for p in self._dense_params if p.grad is not None]

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        """Clip by the norm of the whole model's gradient: the squares of every owned dense shard and expert
        part (each element of the model in exactly one rank's), one all-reduce over "dp_ep"."""
        sq = [g.float().square().sum() for g in self._dense_grads()]
        if self.experts is not None:
            sq.extend(self.experts.owned_squares())
        total_sq = torch.stack(sq).sum() if sq else torch.zeros((), device=self.dims.device)
        if self._norm_channel is not None:
            dist.all_reduce(total_sq, group=self._norm_channel)
        total = total_sq.sqrt()
        if max_norm != float("inf"):
            coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
            for g in self._dense_grads():
                g.mul_(coef.to(g.dtype))
            if self.experts is not None:
                self.experts.scale_grads(coef)
        return total

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        lr = self.param_groups[0]["lr"]
        if self.dense is not None:
            for g in self.dense.param_groups:
                g["lr"] = lr
            self.dense.step()
        if self.experts is not None:
            for g in self.experts.param_groups:
                g["lr"] = lr
            self.experts.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self._dense_params:
            p.grad = None
        if self.experts is not None:
            self.experts.zero_grad()

    def close(self) -> None:
        if self.experts is not None:
            self.experts.close()

    # ---- what it holds ----
    def shard_tensors(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """(gradient shards and parts, AdamW state tensors) held now (local tensors)."""
        grads = self._dense_grads()
        state = [_local(v) for s in (self.dense.state.values() if self.dense is not None else [])
                 for v in s.values() if isinstance(v, torch.Tensor)]
        if self.experts is not None:
            g, s = self.experts.shard_tensors()
            grads, state = grads + g, state + s
        return grads, state

    # ---- checkpoints ----
    def _named_dense(self, module: nn.Module) -> list[tuple[str, nn.Parameter]]:
        ids = {id(p) for p in self._dense_params}
        return [(n, p) for n, p in module.named_parameters() if id(p) in ids]

    def logical_state(self, module: nn.Module, stacked: dict[str, tuple[tuple[int, ...], int]]
                      ) -> tuple[dict[str, torch.Tensor | RowPiece], dict[str, Any]]:
        """The AdamW state this rank writes, by `<logical name>:<key>`: the rows of each dense moment it holds (a
        `RowPiece`, or per logical expert for a stacked expert tensor, with its step), the step count by the
        holder of row 0; expert-parallel experts as `ShardedAdamW.logical_state` (collective)."""
        from moebal.train.checkpoint import RowPiece, expert_name

        out: dict[str, torch.Tensor | RowPiece] = {}
        if self.dense is not None:
            for name, p in self._named_dense(module):
                state = self.dense.state.get(p)
                if not state:
                    continue
                first, rows = shard_rows(p) if isinstance(p, DTensor) else (0, p.shape[0] if p.dim() else 1)
                step = _local(state["step"]).detach().clone()
                moments = {key: _local(state[key]) for key in ("exp_avg", "exp_avg_sq")}
                if name in stacked:  # rows are whole experts
                    ids = stacked[name][0]
                    for row in range(rows):
                        ln = expert_name(name, ids[first + row])
                        out.update({f"{ln}:{k}": v[row] for k, v in moments.items()})
                        out[f"{ln}:step"] = step
                    continue
                if rows:
                    whole = rows == (p.shape[0] if p.dim() else 1)
                    out.update({f"{name}:{k}": v if whole else RowPiece(v, first, tuple(p.shape))
                                for k, v in moments.items()})
                if first == 0:
                    out[f"{name}:step"] = step
        if self.experts is not None:
            out.update(self.experts.logical_state(module, stacked)[0])
        return out, {}

    def read_logical_state(self, reader: CheckpointReader, module: nn.Module,
                           stacked: dict[str, tuple[tuple[int, ...], int]]) -> dict[str, Any]:
        """This rank's shards of the AdamW state from a checkpoint's logical tensors (any shard size, or none),
        for `load_state_dict`. Raises CheckpointError for state that does not fit."""
        from moebal.errors import CheckpointError

        dense: dict[str, dict[str, torch.Tensor]] = {}
        for name, p in self._named_dense(module):
            saved = _saved_state(reader, name, stacked)
            if saved is None:
                continue  # never stepped: starts fresh, as an unsharded optimizer's would
            entry: dict[str, torch.Tensor] = {}
            for key in ("exp_avg", "exp_avg_sq"):
                v = saved.get(key)
                if not isinstance(v, torch.Tensor) or tuple(v.shape) != tuple(p.shape):
                    raise CheckpointError(f"{reader.path}: optimizer state '{name}:{key}' is missing or has "
                                          f"another shape than the parameter {tuple(p.shape)}")
                entry[key] = local_chunk(v, p) if isinstance(p, DTensor) else v.to(p.device, p.dtype)
            step = saved.get("step")
            entry["step"] = (step if isinstance(step, torch.Tensor) else torch.tensor(float(step or 0))
                             ).detach().to(torch.float32).reshape(())
            dense[name] = entry
        experts = self.experts.read_logical_state(reader, module, stacked) if self.experts is not None else None
        return {"dense": dense, "experts": experts, "module": module}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Adopt `read_logical_state`'s shards."""
        if self.dense is not None:
            for name, p in self._named_dense(state_dict["module"]):
                if name in state_dict["dense"]:
                    self.dense.state[p] = dict(state_dict["dense"][name])
        if self.experts is not None and state_dict["experts"] is not None:
            self.experts.load_state_dict(state_dict["experts"])


def _saved_state(reader: CheckpointReader, name: str, stacked: dict[str, tuple[tuple[int, ...], int]]
                 ) -> dict[str, Any] | None:
    """Parameter `name`'s saved AdamW state, a stacked expert tensor's assembled from its logical experts (moments
    stacked, the step of the first); None when nothing was saved."""
    from moebal.errors import CheckpointError
    from moebal.train.checkpoint import expert_name

    if name not in stacked or reader.optimizer_keys(name):  # plain, or stacked under its own name
        return reader.optimizer_state(name) if reader.optimizer_keys(name) else None
    ids = stacked[name][0]
    have = [reader.optimizer_keys(expert_name(name, e)) for e in ids]
    if not any(have):
        return None
    if any(h != have[0] for h in have):
        raise CheckpointError(f"{reader.path}: optimizer state of some experts of '{name}' is missing")
    per = [reader.optimizer_state(name, e) for e in ids]
    return {k: torch.stack([s[k] for s in per]) if k != "step" else per[0][k] for k in have[0]}


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (a view), other tensors as they are."""
    return t.to_local() if isinstance(t, DTensor) else t
