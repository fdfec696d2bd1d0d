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
  to them reduce-scatters them over "dp" after Agg and steps AdamW on the owned parts. Their weights are sharded
  at rest too (ZeRO-3, `ExpertsAtRest`): each MoE layer's experts are a unit of flats of their own whose buffers
  are freed between uses; a rank keeps its 1/W part (W = ranks of "dp"), and the layer's weights are
  all-gathered over "dp" for its forward (or earlier, when Trans reads them to send replicas), freed at the
  forward's end, gathered again when the backward pass reaches the layer's output, and freed once their
  gradients have accumulated. Readers between steps (checkpoints) enter `gathered()`. In a pipeline stage the
  same holds per micro-batch (each forward gathers and frees, each backward gathers and frees), and a migration
  gathers every unit of the stage whole before its walk (`StageShardedAdamW.full_state`). Under the pruning or
  freezing scheme (which read and edit expert weights between steps) and with one rank per expert shard ("dp"
  of 1) they stay replicated over "dp" (ZeRO-2): the optimizer all-gathers them after each step.

Order (why the expert gathers cannot deadlock): every gather is a blocking all-gather over "dp", the ranks
holding the same experts, issued at points every rank reaches in the same sequence: in the forward pass at the
first of (the layer's Trans, issued at step start or, with block overlap, at the start of the layer before it,
on every rank whatever its placement; under plan-ahead a prefetch at the start of the layer before it, so that
plan-ahead's Trans, which only the ranks on the plan arm issue, never gathers; the layer's forward), in the
backward pass when the layer's output gradient arrives,
before the layer's backward all-to-alls; layers in forward order, then reverse. Release points are local (no
communication). So every rank issues the same sequence of blocking collectives (expert gathers over "dp",
token all-to-alls over "ep", FSDP2's over "dp_ep"); the first of them that some rank waits on is reached by
all its members, since each has completed every earlier one, so no rank waits on a peer that must first enter
an all-to-all this rank has not reached.

Mixed precision (`parallel.param_dtype`, `parallel.reduce_dtype`): FSDP2's `MixedPrecisionPolicy` keeps the
sharded fp32 master weights and AdamW moments, all-gathers the weights cast to `param_dtype` for compute, and
reduce-scatters gradients in `reduce_dtype` (the expert reduce-scatters use the same dtype); gradients reach
the optimizer in fp32. fp32 / fp32 (the default) is the parity case.

Checkpoints keep their logical names (docs/checkpoints.md) and are written by each owner, with no gather: a
rank writes the rows of the dense weights and moments it holds as row pieces of the logical tensors (the
manifest lists them; readers assemble them), and the rows it holds of a stacked expert tensor (`parallel.ep:
1`) as whole logical experts with their moments. Loading keeps the rank's dim-0 chunk of each logical tensor,
so a checkpoint resumes under any shard size, or none. Expert-parallel expert weights sharded at rest are
gathered for a checkpoint's write and load one MoE layer at a time (`units_gathered`; a load's owned parts
then take the loaded weights), and written as before.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from moebal.config import Config
from moebal.distributed.expert_parallel import ExpertParallelDispatcher, is_expert_param
from moebal.distributed.groups import ParallelDims
from moebal.distributed.sharded import ShardedAdamW

if TYPE_CHECKING:
    from moebal.pipeline.stage import PipelineStage
    from moebal.train.checkpoint import CheckpointReader, RowPiece

__all__ = ["DeferredGradReducer", "ExpertsAtRest", "FullyShardedAdamW", "StageShardedAdamW", "StepHold", "fsdp_units",
           "fully_shard_model", "fully_shard_stage", "local_chunk", "mask_rows_", "plain_layer", "shard_rows",
           "stage_mesh", "stage_units", "unshard_leaving", "whole_tensor"]

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


class _GatherInBackward(torch.autograd.Function):
    """Identity whose backward gathers a layer's expert weights (sharded at rest) before the layer's backward
    reads them: placed on the layer's output, so it runs before the backward all-to-alls and expert GEMMs."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weights: ExpertsAtRest) -> torch.Tensor:
        ctx.weights = weights
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None]:
        ctx.weights.gather()  # wait: all-gather over "dp" (module docstring, "Order")
        return g, None


class ExpertsAtRest:
    """One MoE layer's owned expert weights sharded at rest (`ExpertParallelDispatcher.weights`): unit `unit` of
    the expert `ShardedAdamW`. `last`: the model's last MoE layer, whose backward follows its forward with no
    other layer's in between: kept gathered from its forward into its backward (one all-gather fewer per step),
    as FSDP2 keeps its root."""

    def __init__(self, optimizer: ShardedAdamW, unit: int, trans_reads: bool, last: bool = False) -> None:
        self.optimizer, self.unit, self.trans_reads, self.last = optimizer, unit, trans_reads, last

    @property
    def gathered(self) -> bool:
        return self.optimizer.unit_gathered(self.unit)

    def gather(self) -> None:
        self.optimizer.gather_unit(self.unit)

    def release(self) -> None:
        self.optimizer.release_unit(self.unit)

    def after_forward(self, out: torch.Tensor) -> torch.Tensor:
        if not (torch.is_grad_enabled() and out.requires_grad):
            self.release()
            return out
        if not self.last:
            self.release()
        y: torch.Tensor = _GatherInBackward.apply(out, self)  # Function.apply is typed Any
        return y


AT_REST_MIN_DP = 2
"""The fewest ranks per expert shard ("dp") at which `shard: full` keeps expert weights sharded at rest: with one
the part is the whole and freeing it saves nothing. (Tests lower it to 1 to run the gather-and-free life cycle on
4 ranks of a pipeline, where 2 stages x 2 expert shards leave one rank per shard.)"""


def experts_at_rest(model: nn.Module, cfg: Config, dims: ParallelDims
                    ) -> list[tuple[ExpertParallelDispatcher, list[nn.Parameter]]]:
    """Per MoE layer under expert parallelism, its dispatcher and expert parameters, when `shard: full` keeps
    them sharded at rest (module docstring: not under the pruning or freezing scheme, at least `AT_REST_MIN_DP`
    ranks per expert shard); else none. `model`: a whole model or a pipeline stage (its MoE layers)."""
    if dims.size("dp") < AT_REST_MIN_DP or cfg.dynamism.scheme in ("pruning", "freezing"):
        return []
    get = getattr(model, "moe_layers", None)
    layers = [m for m in (get() if get is not None else []) if isinstance(m.dispatcher, ExpertParallelDispatcher)]
    return [(m.dispatcher, [p for p in m.experts.parameters() if is_expert_param(p)]) for m in layers]


def whole_tensor(t: torch.Tensor) -> torch.Tensor:
    """`t` whole: a DTensor (FSDP2's shard) all-gathered (collective over its mesh: every rank of the stage calls it
    in the same order), any other tensor as it is."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def mask_rows_(t: torch.Tensor, mask: torch.Tensor) -> None:
    """`t *= mask` in place, `mask` shaped like the logical tensor: a DTensor (dim-0 shard) multiplies its local
    rows by the same rows of `mask` (no communication), any other tensor by the whole mask."""
    if isinstance(t, DTensor):
        first, rows = shard_rows(t)
        t.to_local().mul_(mask[first:first + rows].to(t.dtype))
    else:
        t.mul_(mask.to(t.dtype))


class FullyShardedAdamW(torch.optim.Optimizer):
    """AdamW of a `fully_shard_model` model: torch's AdamW on the dense DTensor shards, `ShardedAdamW` on the
    expert parameters (module docstring). Its `param_groups` are the model's (the trainer sets the learning
    rate there); the dense state lives in `dense.state`, the expert state on `experts`' parts."""

    def __init__(self, model: nn.Module, cfg: Config, dims: ParallelDims, norm_channel: Any = "new",
                 expert_divisor: float | None = None, expert_channels: dict[str, Any] | None = None,
                 accumulate: bool = False, skip: Sequence[torch.Tensor] = ()) -> None:
        """`norm_channel`: the "dp_ep" communicator of the gradient norm; "new" makes one (collective).
        `expert_divisor`, `expert_channels`: the expert `ShardedAdamW`'s `divisor` and `channels` (a pipeline
        stage: 1, and communicators made once per run); `accumulate`: a pipeline stage's micro-batches add up
        the expert gradients before `reduce` (`ShardedAdamW`'s `accumulate`: in fp32 under bf16 weights);
        `skip`: parameters another rank steps (a pipeline's tied head copy)."""
        from moebal.train.optim import param_groups

        t = cfg.train
        groups = param_groups(model, t.weight_decay, skip)
        super().__init__(groups, {"lr": t.lr})
        self.dims = dims
        self.reduce_dtype = DTYPES[cfg.parallel.reduce_dtype]
        dense = [{"params": [p for p in g["params"] if not is_expert_param(p)], "weight_decay": g["weight_decay"]}
                 for g in groups]
        dense = [g for g in dense if g["params"]]
        # foreach: DTensor parameters (the fused kernel takes plain tensors)
        self.dense = torch.optim.AdamW(dense, lr=t.lr, betas=(t.beta1, t.beta2), eps=t.adam_eps, foreach=True) \
            if dense else None
        has_experts = any(is_expert_param(p) for p in model.parameters())
        units = experts_at_rest(model, cfg, dims)
        # bf16 compute copies of the expert weights where "dp" > 1, fp32 masters in the parts (in a pipeline stage
        # their micro-batches' gradients add up in fp32: `accumulate`)
        self.experts = ShardedAdamW(model, t, dims, include=is_expert_param, reduce_dtype=self.reduce_dtype,
                                    divisor=expert_divisor, channels=expert_channels,
                                    at_rest=[ps for _, ps in units], param_dtype=DTYPES[cfg.parallel.param_dtype],
                                    accumulate=accumulate) if has_experts else None
        trans_reads = cfg.planner.policy != "static"  # only replicating placements send the owner's weights
        # the last MoE layer's backward follows its forward at once only without a pipeline (in a stage other
        # micro-batches' forwards come between)
        last = len(units) - 1 if cfg.parallel.pp == 1 else -1
        for u, (d, _) in enumerate(units):
            assert self.experts is not None
            d.weights = ExpertsAtRest(self.experts, u, trans_reads, last=u == last)
        self.experts_at_rest = len(units)
        """MoE layers whose expert weights are sharded at rest (0: replicated over "dp", ZeRO-2)."""
        if isinstance(norm_channel, str):
            norm_channel = dims.new_channel("dp_ep") if dims.size("dp_ep") > 1 else None
        self._norm_channel = norm_channel
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

    def param_state_bytes(self, p: torch.Tensor, whole: bool = False) -> int:
        """AdamW moment bytes of parameter `p` on this rank (its shards or parts), or all of them (`whole`: what
        a migration moves); 0 before the first step. For the layer balancer's estimates (pipeline/observe.py)."""
        if is_expert_param(p):
            return self.experts.param_state_bytes(p, whole) if self.experts is not None else 0
        st = self.dense.state.get(p) if self.dense is not None else None
        if not st:
            return 0
        return sum((v.numel() if whole else _local(v).numel()) * v.element_size()
                   for k, v in st.items() if k != "step")

    def param_weight_bytes(self, p: torch.Tensor) -> int | None:
        """Bytes of parameter `p`'s weights this rank keeps between steps: a dense parameter's FSDP2 shard, an
        expert parameter's as the expert optimizer keeps it (`ShardedAdamW.param_weight_bytes`). For the layer
        balancer's memory estimate (pipeline/observe.py)."""
        if is_expert_param(p):
            return self.experts.param_weight_bytes(p) if self.experts is not None else None
        return _local(p).numel() * p.element_size()

    # ---- expert weights at rest ----
    def gathered(self, write: bool = False) -> AbstractContextManager[Any]:
        """Every expert weight whole inside (`ShardedAdamW.gathered`; collective over "dp")."""
        return self.experts.gathered(write) if self.experts is not None else nullcontext()

    def weight_parts(self) -> list[torch.Tensor]:
        return self.experts.weight_parts() if self.experts is not None else []

    def each_unit_gathered(self, write: bool = False) -> Iterator[int]:
        """The expert units gathered one at a time (`ShardedAdamW.each_unit_gathered`; collective over "dp")."""
        return self.experts.each_unit_gathered(write) if self.experts is not None else iter(())

    def mask_state(self, p: torch.Tensor, mask: torch.Tensor) -> None:
        """Multiply parameter `p`'s AdamW moments by `mask` (shaped like `p`, the same on every rank): the dense
        moments' local rows, an expert parameter's owned parts (the pruning scheme zeroes pruned entries)."""
        if is_expert_param(p):
            if self.experts is not None:
                self.experts.mask_state(p, mask)
            return
        for key, v in (self.dense.state.get(p, {}) if self.dense is not None else {}).items():
            if key != "step":
                mask_rows_(v, mask)

    def mask_grad(self, p: torch.Tensor, mask: torch.Tensor) -> bool:
        """An expert parameter's fp32 gradient sum masked where the expert optimizer sums its bf16 compute copies'
        gradients (`ShardedAdamW.mask_grad`); False otherwise (the gradient is the parameter's `.grad`)."""
        return self.experts is not None and is_expert_param(p) and self.experts.mask_grad(p, mask)

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

    def master_names(self, module: nn.Module, stacked: dict[str, tuple[tuple[int, ...], int]]) -> set[str]:
        """The expert weights `logical_state` writes from their fp32 masters (bf16 compute copies,
        `ShardedAdamW.master_names`)."""
        return self.experts.master_names(module, stacked) if self.experts is not None else set()

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


# ---- a pipeline stage (`parallel.shard: full` with `parallel.pp` > 1) ----------------------------------------

def stage_mesh(dims: ParallelDims) -> Any:
    """The device mesh of this stage's "dp_ep" ranks on a channel of its own. Collective on every rank, once per
    run (rebuilds after a migration reuse it)."""
    from torch.distributed.device_mesh import DeviceMesh

    return DeviceMesh.from_group(dims.new_channel("dp_ep"), dims.device.type)


def _stage_units(stage: PipelineStage) -> list[nn.Module]:
    """The stage's FSDP2 units in run order: each whole layer; each held half-submodule of a split layer
    (`pipeline.split_layers`: the engine calls `attention_part`/`ffn_part`, which call the norms, attention and
    MLP, never the layer, so FSDP2's hooks must sit on those); the embedding, final norm and head."""
    from moebal.pipeline.stage import held_halves

    body = stage.model
    # a last stage's tied head copy is no unit: whole on every rank, it follows the first stage's embedding
    # (moebal/pipeline/tied.py)
    head = None if stage.holds_tied_copy else stage.lm_head
    roots = [body.embed_tokens, body.norm, head]
    split = set(stage.units.split_layers)
    layers = [m for i, layer in body.layers.items()
              for m in (held_halves(layer) if int(i) in split else [layer])]
    return [*layers, *(m for m in roots if m is not None)]


def fully_shard_stage(stage: PipelineStage, cfg: Config, mesh: Any) -> None:
    """`fully_shard` each layer of a pipeline stage (each held half-submodule of a split layer: `_stage_units`) and
    its embedding, final norm and LM head over `mesh`, each one FSDP2 unit and its own root (the engine calls
    these modules, never the stage): weights all-gathered for each
    micro-batch's forward and again for its backward (`reshard_after_forward`), and reduce-scattered in each
    micro-batch's backward into the shards' gradients, which accumulate over the micro-batches. The reductions
    are sums (divide factor 1): the pipeline's losses are normalised by the global label count, as in the
    unsharded sync. Expert-parallel experts (`parallel.ep` > 1) are left out (`ignored_params`): plain
    parameters whose whole gradients accumulate over the micro-batches until Agg, for the expert `ShardedAdamW`.
    Units sharded already are left as they are; a plain unit's gradients (a migration between backward and
    optimizer step) become its shards' (no communication)."""
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

    par = cfg.parallel
    policy = MixedPrecisionPolicy(param_dtype=DTYPES[par.param_dtype], reduce_dtype=DTYPES[par.reduce_dtype])
    for m in _stage_units(stage):
        if isinstance(m, FSDPModule):
            continue
        grads = {n: p.grad for n, p in m.named_parameters() if p.grad is not None}
        ignored = {p for p in m.parameters() if is_expert_param(p)}  # expert-parallel experts: the ShardedAdamW's
        # reshard_after_forward explicitly (a root's default keeps the gathered weights after its forward): zero
        # bubble's W finds every unit holding its shards again (`DeferredGradReducer`)
        fully_shard(m, mesh=mesh, mp_policy=policy, reshard_after_forward=True, ignored_params=ignored or None)
        assert isinstance(m, FSDPModule)
        m.set_gradient_divide_factor(1.0)
        m.set_force_sum_reduction_for_comms(True)  # a plain SUM (gloo has no PREMUL_SUM; the factor is 1)
        for n, p in m.named_parameters():
            if n in grads and isinstance(p, DTensor):
                p.grad = local_chunk(grads[n], p)


class StepHold:
    """What FSDP2 holds whole through a training step of several micro-batches (`train.grad_accum`, a pipeline
    stage's), by `parallel.accumulate` and `parallel.reshard`:
    - whole gradient sums (`accumulate: whole`): gradient sync off for every backward pass but the step's last,
      so each unit's gradients add up whole (in reduce_dtype) and that pass reduce-scatters the sums once;
    - weights kept gathered (`reshard: step`): no reshard after a forward or a backward pass until the step's
      last backward, so each unit is all-gathered once per step instead of once per forward and once per
      backward pass of every micro-batch.
    `begin` before the step's first forward, `last_backward` before its last backward pass (before that
    micro-batch's forward is as good: the switches are read when a pass ends), `end` after the step, whatever
    happened: sync on, the construction-time resharding back, every unit resharded (a unit that the last backward
    did not reach too). All local: FSDP2 reads these flags in its hooks; no communication here."""

    def __init__(self, units: Callable[[], list[Any]], whole_sums: bool, keep_gathered: bool,
                 after_forward: Callable[[Any], bool]) -> None:
        """`units`: the FSDP2 modules now (a pipeline stage's change with migrations); `after_forward`: whether a
        unit reshards after its forward by construction (FSDP2's root of a whole model does not)."""
        self.units, self.whole_sums, self.keep_gathered = units, whole_sums, keep_gathered
        self.after_forward = after_forward

    @classmethod
    def of(cls, cfg: Config, units: Callable[[], list[Any]], after_forward: Callable[[Any], bool]) -> StepHold | None:
        """The hold `cfg` asks for under `parallel.shard: full`; None when it holds nothing across micro-batches."""
        par = cfg.parallel
        whole, keep = par.accumulate == "whole", par.reshard == "step"
        return cls(units, whole, keep, after_forward) if whole or keep else None

    def begin(self) -> None:
        for m in self.units():
            if self.whole_sums:
                m.set_requires_gradient_sync(False, recurse=False)
            if self.keep_gathered:
                m.set_reshard_after_forward(False, recurse=False)
                m.set_reshard_after_backward(False, recurse=False)

    def last_backward(self) -> None:
        for m in self.units():
            m.set_requires_gradient_sync(True, recurse=False)  # the whole sums out in this pass
            m.set_reshard_after_backward(True, recurse=False)  # and the weights freed after it

    def end(self) -> None:
        for m in self.units():
            m.set_requires_gradient_sync(True, recurse=False)
            m.set_reshard_after_backward(True, recurse=False)
            if self.keep_gathered:
                if self.after_forward(m):
                    m.set_reshard_after_forward(True, recurse=False)
                m.reshard()  # a unit that the last backward did not reach (or a step cut short) too

    @contextmanager
    def step(self) -> Iterator[None]:
        """`begin`, then `end` on the way out whatever happened."""
        self.begin()
        try:
            yield
        finally:
            self.end()


def fsdp_units(module: nn.Module) -> list[Any]:
    """The FSDP2 modules in `module` (itself included), in module order."""
    from torch.distributed.fsdp import FSDPModule

    return [m for m in module.modules() if isinstance(m, FSDPModule)]


def stage_units(stage: PipelineStage) -> list[Any]:
    """A fully sharded stage's FSDP2 units, each its own root (`fully_shard_stage`)."""
    from torch.distributed.fsdp import FSDPModule

    return [m for m in _stage_units(stage) if isinstance(m, FSDPModule)]


class StageShardedAdamW(FullyShardedAdamW):
    """`FullyShardedAdamW` of a pipeline stage: shards the stage on construction (`fully_shard_stage`: dense
    parameters over the stage's ranks; with `parallel.ep` > 1 the expert-parallel experts stay plain, under the
    expert `ShardedAdamW` over "dp" with divisor 1 on the runner's `expert_channels`), and moves layers whole for
    a migration (moebal/pipeline/migrate.py): `full_state` gathers the leaving layers' weights, gradients and
    moments and swaps in plain layers, and the optimizer rebuilt after the walk re-shards them
    (`load_full_state`). The embedding, final norm and head never move and stay sharded, with their state."""

    def __init__(self, stage: PipelineStage, cfg: Config, dims: ParallelDims, mesh: Any,
                 expert_channels: dict[str, Any] | None = None,
                 prepare_layer: Callable[[int, nn.Module], None] | None = None,
                 skip: Sequence[torch.Tensor] = ()) -> None:
        """`prepare_layer`: the dynamism scheme's structural change of a fresh layer skeleton
        (`Dynamism.prepare_layer`: a router), applied to the plain skeletons a migration gathers leaving layers
        into; `skip`: parameters another rank steps (a tied head copy, which `fully_shard_stage` leaves whole)."""
        self.prepare_layer = prepare_layer
        before = dict(stage.named_parameters())
        fully_shard_stage(stage, cfg, mesh)
        self.stage = stage
        self._was = {id(p): before[n] for n, p in stage.named_parameters()}
        """id of each (sharded) parameter -> the parameter it was made from (itself when it was sharded, and
        for the plain expert-parallel experts)."""
        held = {id(p) for p in stage.parameters()}
        for old in self._was.values():
            if id(old) not in held:  # only its identity keys a walk's state (`load_full_state`): its whole weights
                old.data, old.grad = old.data.new_empty(0), None  # and gradient would stay beside the shards
        super().__init__(stage, cfg, dims, norm_channel=None, expert_divisor=1.0, expert_channels=expert_channels,
                         accumulate=True, skip=skip)

    leaving: tuple[int, ...] = ()
    """The layers a migration is about to send away, wholly or a half of (`migrate_layers` sets it before
    `full_state`)."""

    def full_state(self) -> dict[nn.Parameter, dict[str, torch.Tensor]]:
        """Replace every layer of the stage about to leave (`leaving`) by a plain skeleton holding its gathered
        weights, buffers and gradients, and return the AdamW state of the stage's parameters for the walk: the
        plain layers' moments whole, the other dense parameters' as they are (sharded: they stay), and every
        expert-parallel expert's whole (`ShardedAdamW.full_state`: the same parameter objects, which the
        skeletons keep). Collective over the stage's ranks (layers in ascending order, then the experts). Peak:
        the leaving layers and their moments whole, and the stage's expert moments whole, beside the shards."""
        dense = self.dense.state if self.dense is not None else {}
        out: dict[nn.Parameter, dict[str, torch.Tensor]] = {}
        if self.experts is not None:  # expert weights at rest whole for the walk (the leaving layers') and for
            for u in range(len(self.experts.units)):  # the rebuilt optimizer's new flats (the staying ones')
                self.experts.gather_unit(u)  # collective over "dp", layers in order; this optimizer is discarded
        for i in self.leaving:
            new, states = plain_layer(self.stage, i, self.dims.device, dense, self.prepare_layer)
            out.update(states)
            self.stage.model.layers[str(i)] = new
        for p in self.stage.parameters():
            if isinstance(p, DTensor) and dense.get(p):  # the layers that stay, embedding, norm, head
                out[p] = dict(dense[p])
        if self.experts is not None:
            out.update(self.experts.full_state())
        return out

    def load_full_state(self, states: dict[nn.Parameter, dict[str, torch.Tensor]]) -> None:
        """Adopt the AdamW state of `full_state` (and of layers received in the walk), keyed by the parameters
        the sharded ones were made from: this rank's chunks of whole moments, sharded ones as they are; the
        expert-parallel experts' parts of their whole moments (`ShardedAdamW.load_full_state`)."""
        if self.experts is not None:
            self.experts.load_full_state({p: st for p, st in states.items() if is_expert_param(p)})
        if self.dense is None:
            return
        for p in self._dense_params:
            st = states.get(self._was[id(p)])
            if not st:
                continue
            moments = {k: local_chunk(v, p) if isinstance(p, DTensor) and not isinstance(v, DTensor) else v
                       for k, v in st.items() if k != "step"}
            step = st["step"].detach().to(torch.float32).reshape(()).cpu()
            self.dense.state[p] = {"step": step, **moments}


def plain_layer(stage: PipelineStage, i: int, device: torch.device, dense: dict[Any, Any],
                prepare_layer: Callable[[int, nn.Module], None] | None = None
                ) -> tuple[nn.Module, dict[nn.Parameter, dict[str, Any]]]:
    """Layer i of `stage` as a plain skeleton (`build_layer_skeleton`, no RNG; the scheme's `prepare_layer` change
    applied): FSDP2's weights and gradients gathered whole (collective over the stage), expert-parallel experts
    the layer's own parameter objects (their state is the expert optimizer's); with the AdamW state in `dense`
    (by sharded parameter) of the skeleton's parameters, gathered whole. A split layer keeps the halves it holds
    (both, when one of them leaves: the other is re-sharded with the rebuild)."""
    from moebal.pipeline.stage import build_layer_skeleton, same_halves

    old = stage.layer(i)
    new = build_layer_skeleton(stage.cfg, i, device)
    if prepare_layer is not None:
        prepare_layer(i, new)
    same_halves(new, old)
    fresh = dict(new.named_parameters())
    out: dict[nn.Parameter, dict[str, Any]] = {}
    with torch.no_grad():
        for n, p in old.named_parameters():
            if not isinstance(p, DTensor):  # an expert-parallel shard of the experts: moves as it is
                owner, _, leaf = n.rpartition(".")
                setattr(new.get_submodule(owner), leaf, p)
                continue
            q = fresh[n]
            q.copy_(whole_tensor(p))
            q.requires_grad_(p.requires_grad)
            if p.grad is not None:
                q.grad = whole_tensor(p.grad)
            st = dense.get(p)
            if st:
                out[q] = {"step": st["step"], "exp_avg": whole_tensor(st["exp_avg"]),
                          "exp_avg_sq": whole_tensor(st["exp_avg_sq"])}
        for n, b in old.named_buffers():
            new.get_buffer(n).copy_(b)
    return new, out


def unshard_leaving(stage: PipelineStage, leaving: tuple[int, ...],
                    prepare_layer: Callable[[int, nn.Module], None] | None = None) -> None:
    """Swap plain skeletons in for the FSDP2-sharded layers of `leaving` on a stage with no optimizer (nothing
    trains there: a frozen stage), so that a migration sends them whole. Collective over the stage."""
    for i in leaving:
        if any(isinstance(p, DTensor) for p in stage.layer(i).parameters()):
            stage.model.layers[str(i)] = plain_layer(stage, i, next(stage.parameters()).device, {}, prepare_layer)[0]


class DeferredGradReducer:
    """The zero-bubble schedule's W under `parallel.shard: full` (moebal/pipeline/zero_bubble.py): the deferred
    Linear weight gradients of one micro-batch, computed whole outside autograd after FSDP2's post-backward hook
    has reduce-scattered the rest and resharded the module, are reduce-scattered here into the shards'
    gradients, as FSDP2 would have in B(j): summed over the stage's ranks (divide factor 1, as
    `fully_shard_stage` sets FSDP2's), communicated in `reduce_dtype`, added in the shard's dtype. Peak: one cost
    slot's whole Linear weight gradients (the engine flushes slot by slot), about what FSDP2 holds unsharded for
    one unit in B.

    Phases of `flush` (per cost slot of a W op, on every rank of the stage at the same point of the same
    schedule, the slots in the same order):
      1. order the kept gradients as the stage's parameters (module order: the same on every rank of the stage,
         which runs the same layers, as FSDP2's own reduce-scatters need too);
      2. lay each out as FSDP2 shards it: dim 0 padded to W x ceil(n / W) rows, rank r's chunk in row block r;
         one [W, total] buffer of every gradient's chunks side by side;
      3. one reduce-scatter (SUM) over the stage's mesh, synchronous (host-side wait on gloo; on NCCL the
         compute stream's order);
      4. each parameter's piece, cut to its shard's rows (`shard_rows`), added to (or made) its DTensor grad."""

    def __init__(self, stage: nn.Module, mesh: Any, reduce_dtype: torch.dtype) -> None:
        self.stage, self.group, self.size = stage, mesh.get_group(), mesh.size()
        self.reduce_dtype = reduce_dtype
        self._kept: dict[int, tuple[DTensor, torch.Tensor]] = {}

    def holds(self, p: torch.Tensor) -> bool:
        return isinstance(p, DTensor)

    def add(self, p: torch.Tensor, g: torch.Tensor) -> None:
        assert isinstance(p, DTensor) and tuple(g.shape) == tuple(p.shape), (type(p), g.shape, p.shape)
        kept = self._kept.get(id(p))
        if kept is None:
            self._kept[id(p)] = (p, g)
        else:
            kept[1].add_(g)

    def pending(self) -> int:
        return len(self._kept)

    def flush(self) -> None:
        if not self._kept:
            return
        order = [self._kept[id(p)][0] for p in self.stage.parameters() if id(p) in self._kept]
        assert len(order) == len(self._kept), "a deferred gradient of a parameter the stage no longer holds"
        W = self.size
        blocks = [self._blocks(self._kept[id(p)][1], W) for p in order]
        self._kept.clear()
        send_WN = torch.cat(blocks, dim=1)
        out_N = send_WN.new_empty(send_WN.shape[1])
        dist.reduce_scatter_single(out_N, send_WN.reshape(-1), group=self.group)
        for p, piece in zip(order, out_N.split([b.shape[1] for b in blocks])):
            _, rows = shard_rows(p)
            local = piece.view(-1, *p.shape[1:])[:rows].to(p.dtype)
            if p.grad is None:
                p.grad = DTensor.from_local(local, p.device_mesh, p.placements, run_check=False, shape=p.shape,
                                            stride=p.stride())
            else:
                _local(p.grad).add_(local)

    def _blocks(self, g: torch.Tensor, W: int) -> torch.Tensor:
        """[W, ceil(n / W) * rest]: row block r of `g` (dim 0 padded with zeros) is rank r's shard."""
        n = g.shape[0]
        per = -(-n // W)
        padded = g.new_zeros((per * W, *g.shape[1:]), dtype=self.reduce_dtype)
        padded[:n] = g
        return padded.reshape(W, -1)


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
