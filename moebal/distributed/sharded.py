"""Sharded gradients and AdamW state (`parallel.shard: optimizer`, ZeRO-2): weights replicated, each rank
keeps the gradient and the AdamW moments of its own part of every parameter only.

Shape legend: W = ranks of a shard group, S = elements a rank owns of one bucket (its part), N = a flat's
elements (padded to a multiple of W).

Layout, fixed at start-up (identical on every rank of a shard group, which holds the same parameters):
- the parameters are split into flats by (shard axis, weight decay, dtype): dense parameters are sharded over
  every rank of the stage ("dp_ep", the ranks that average dense gradients), expert parameters over their
  expert-data-parallel copies ("dp", the ranks that hold the same experts); the weight decay of AdamW's two
  parameter groups (moebal/train/optim.py) is a flat's own;
- a flat is one buffer that its parameters become views of, in reverse registration order (roughly the order
  the backward pass finishes them), cut into buckets of a multiple of W elements (the last one padded); rank
  r owns part r of every bucket: S contiguous elements, the AdamW leaf of that bucket (a view of the flat, so
  the optimizer's in-place update is the weights' update on the owner).

One step (`begin` before the forward pass, `reduce` after the hooks' `after_backward`, then `clip_grad_norm`,
`step`):
  1. backward: when every gradient of a dense bucket is final (a post-accumulate-grad hook) the bucket's
     gradients are copied into a send buffer, the parameters' gradients whose last bucket this was are freed,
     and the bucket is reduce-scattered (async) into its owners' parts; buckets go out in one fixed order on
     every rank (by position, then flat) whatever order the hooks fire in, so the ranks agree; every hook polls
     the collectives in flight and drops the send buffers of those done (no wait). On gloo the reduce-scatter
     is an all-reduce of the send buffer in place, this rank's part kept: gloo's own reduce-scatter all-reduces
     a clone behind a handle that reports completion only once waited for, which kept two copies of every
     bucket until `reduce` (the same sums);
  2. `reduce` (after Agg: expert gradients are final only once replica gradients were added into the owner's)
     treats gradients that never arrived as zero, issues every remaining bucket (the expert ones last), waits
     for all of them                                                       <- wait: every reduce-scatter
     and divides by the stage's rank count (the same averages the unsharded sync makes);
  3. `clip_grad_norm`: the squares of every owned part, summed over the stage in one all-reduce: each element
     of the model is in exactly one rank's part (dense over "dp_ep", experts over "dp" and disjoint over "ep");
  4. `step`: AdamW on the owned parts (fused where torch has the kernel), then every bucket's parts are
     all-gathered into the flat: the updated weights on every rank; the gradient parts are freed.
Memory per rank: the weights (replicated) + 1/W of the gradients (while a step runs) + 1/W of AdamW's two
moments; no persistent full-size gradient buffer. The full-size gradients of the backward pass are freed
bucket by bucket as their buckets go out, their send buffers as their collectives complete: about two layers'
full-size gradients at a time (one layer's waiting for its last gradient, the previous layer's in flight).

Weights at rest (`at_rest`, ZeRO-3 for the expert parameters of `parallel.shard: full`, moebal/distributed/fsdp.py
`ExpertsAtRest`): each unit (an MoE layer's expert parameters) gets flats of its own whose owned parts are
tensors of their own, the only copy of the weights kept; the flat buffers, which the parameters are views of,
are freed (`untyped_storage().resize_(0)`) and re-filled by an all-gather of the parts (`gather_unit`) when the
caller needs the weights; step 4 all-gathers nothing for them.

Compute copies (`param_dtype`, `parallel.param_dtype: bf16` under `shard: optimizer`, mixed-precision ZeRO-2):
the flats of non-expert-parallel parameters hold the weights in bf16 (the parameters are bf16 views of them, so
their gradients arrive in bf16 and are reduce-scattered in `reduce_dtype`, fp32 by default), and the owned parts
are fp32 tensors of their own, the only fp32 copy: AdamW updates them and step 4 all-gathers them rounded to
bf16. Per rank and parameter 2 bytes of weights + 4/W of masters + 4/W of gradient parts + 8/W of moments: on 4
ranks 6 of the 16 bytes of fp32 unsharded state (0.375x), below fp32 ZeRO-2's floor (1.75 / 4 = 0.4375x).
Expert-parallel experts get compute copies too where their shard group ("dp") has more than one rank (with one
the master would be a whole fp32 copy beside the bf16 one); their gradients then arrive in bf16, Agg adds the
replicas' (which travel in the compute dtype anyway) into them in bf16, and under `shard: full` their weights
at rest are all-gathered from the masters rounded to bf16 (`gather_unit`). Checkpoints hold the fp32 masters:
`logical_state` writes each such logical tensor's weights whole from the owners' parts (`master_names`; no rank
writes the rounded copies) and `read_logical_state` reads them back into the parts, so a resume continues bit
for bit.

Accumulation (`accumulate`, a pipeline stage's optimizer under `shard: optimizer`, its expert optimizer under
`full`): gradients add up over the micro-batches before `reduce`. A compute copy's gradient of one backward pass
arrives in bf16; a hook adds it into an fp32 buffer of its flat and drops it (`_acc_hook`), so the sum is taken
in fp32, not bf16, and `reduce` sends that sum plus whatever arrived after the hooks (Agg's replica gradients);
the zero-bubble schedule's W adds its deferred gradients outside autograd, through `holds`/`add`. A migration
(`full_state`) first turns every compute copy back into an fp32 parameter holding the masters whole, with the
fp32 gradient sum as its gradient (`_masters_whole`): the walk moves those, and the rebuilt optimizer takes its
masters from them and folds a carried gradient into its own buffer.

Parameters without a gradient (`skips`, a pipeline whose dynamism scheme may leave one: early exit's layers that
every token of a step has left, MoD's routers before they start; `Dynamism.idle_parameters`): torch's AdamW
skips a parameter whose gradient is None, and keeps a step count per parameter for its bias correction. One
state per owned part has one count for every parameter in it, and its fused step would update a parameter
without a gradient anyway (its moments decay, weight decay shrinks it). So each parameter keeps its own count
(`_steps`, the same on every rank of its shard group), `reduce` agrees which parameters had a gradient on some rank
of the group (a gradient sent as zeros where a peer had one, the unsharded pipeline's rule; one small host
all-reduce per shard axis: `_agree_stepped`), and `step` updates the owned parts slice by slice in the arithmetic
of torch's AdamW (`_step_each`: neighbouring parameters that step with one count are one slice, and a flat's
slices go to torch's fused kernel in one call, each with its count: the unsharded fused AdamW's bits). The
counts travel with a migration (`full_state`, `load_full_state`) and a checkpoint (`<name>:step` per logical
tensor, as unsharded), so a resume, sharded or not, continues each parameter's bias correction.

Checkpoints keep the format of unsharded ones (moebal/train/checkpoint.py): every logical tensor's AdamW state
is written whole, by the owner of its first element, which receives the other owners' pieces point to point
(`logical_state`); loading reads the logical tensors that overlap this rank's parts and keeps the overlap
(`read_logical_state`), so a checkpoint resumes under any shard size, or none.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from moebal.config import TrainConfig
from moebal.distributed.expert_parallel import is_expert_param
from moebal.distributed.groups import ParallelDims
from moebal.sync import to_host

if TYPE_CHECKING:
    from moebal.train.checkpoint import CheckpointReader

__all__ = ["ShardedAdamW", "model_state_bytes", "units_gathered", "weights_gathered"]

# 16 MB of fp32 per bucket: large enough that a collective's latency is small against its transfer, small
# enough that the send buffers in flight stay a small part of the gradients
DEFAULT_BUCKET_ELEMS = 1 << 22


def native_reduce_scatter(backend: str, device_type: str) -> bool:
    """Whether a group of `backend` ("gloo", "nccl", or per device as moebal's CUDA groups are: "cpu:gloo,cuda:nccl")
    reduce-scatters tensors on `device_type` natively, behind a handle that reports completion: NCCL. gloo's
    reduce-scatter is an all-reduce of a clone whose handle reports completion only once waited for."""
    by_device = dict(part.split(":", 1) for part in backend.split(",")) if ":" in backend else {device_type: backend}
    return by_device.get(device_type) == "nccl"


@dataclass
class _Bucket:
    flat: int
    start: int  # flat offset
    part: int  # S: elements each rank owns
    params: list[int]  # indices (into the flat's params) of the parameters overlapping it
    position: int  # of its last parameter in reverse registration order (the issue order)
    late: bool  # expert weights: released only after Agg, in `reduce`
    missing: int = 0


@dataclass
class _InFlight:
    """A bucket's collective not known to be complete: its handle and the send buffer it reads (all-reduced in
    place when `out` is None; else reduce-scattered into `out`, this rank's part)."""

    handle: Any
    send: torch.Tensor
    bucket: int
    out: torch.Tensor | None


@dataclass
class _Piece:
    """One logical tensor of a flat (a parameter, or one expert's row of a stacked one): its checkpoint name,
    shape and flat range."""

    name: str
    stacked: str | None
    expert: int | None
    shape: tuple[int, ...]
    start: int
    stop: int


@dataclass
class _Flat:
    params: list[nn.Parameter]
    offsets: list[int]
    buf: torch.Tensor  # [N], the parameters are views of it
    group: Any
    ranks: list[int]  # global ranks of the shard group, in group order
    index: int  # this rank's position in it
    weight_decay: float
    axis: str = "dp_ep"  # the shard axis ("dp_ep" dense, "dp" experts)
    native: bool = False  # the backend reduce-scatters natively and reports completion (NCCL), else all-reduce
    buckets: list[int] = field(default_factory=list)  # global bucket indices
    # per bucket: this rank's part (a view of buf; at rest a tensor of its own)
    leaves: list[torch.Tensor] = field(default_factory=list)
    unit: int | None = None  # the at-rest unit it belongs to: its leaves are tensors of their own, buf is freed
    master: bool = False  # buf is a compute-dtype copy; the leaves, tensors of their own, are the fp32 masters

    @property
    def W(self) -> int:
        return len(self.ranks)

    @property
    def state_dtype(self) -> torch.dtype:
        """The dtype of the owned parts and their AdamW moments (fp32 masters under compute copies)."""
        return self.leaves[0].dtype if self.leaves else self.buf.dtype


@dataclass
class _Unit:
    """Parameters whose weights are kept sharded between uses (an MoE layer's experts under `parallel.shard:
    full`): their flats' buffers are freed, and re-filled by an all-gather of the owned parts when needed."""

    flats: list[int]
    params: list[nn.Parameter]
    gathered: bool = True
    arrived: set[int] = field(default_factory=set)  # params whose gradient arrived since the last gather


class ShardedAdamW(torch.optim.Optimizer):
    """AdamW over gradient and moment shards (see the module docstring). Its `param_groups` are the model's
    (the trainer sets the learning rate there); `state` stays empty: the moments live on the owned parts."""

    def __init__(self, model: nn.Module, t: TrainConfig, dims: ParallelDims,
                 bucket_elems: int = DEFAULT_BUCKET_ELEMS, include: Callable[[torch.Tensor], bool] | None = None,
                 reduce_dtype: torch.dtype | None = None, divisor: float | None = None,
                 channels: dict[str, Any] | None = None, at_rest: Sequence[Sequence[nn.Parameter]] = (),
                 param_dtype: torch.dtype | None = None, accumulate: bool = False, skips: bool = False) -> None:
        """`include`: which parameters it shards (None: all; `parallel.shard: full` gives it the expert ones,
        moebal/distributed/fsdp.py); `reduce_dtype`: the dtype gradients are reduce-scattered in (None: theirs);
        the owned parts' gradients are always in the parameters' dtype. `divisor`: what the summed gradients are
        divided by (None: the stage's rank count, for per-rank mean losses; a pipeline's losses are already
        normalised by the global label count: 1). `channels`: `make_channels`' communicators to reuse (a
        pipeline stage rebuilding its optimizer after a migration, when not every rank could create new ones).
        `at_rest`: units of expert parameters whose weights it keeps sharded between uses (ZeRO-3; each unit's
        flats of its own, gathered by `gather_unit`, freed by `release_unit`; "Weights at rest" above).
        `param_dtype`: the dtype the weights are kept in for compute (bf16; expert-parallel ones where "dp" has more
        than one rank), their fp32
        values kept as the owned parts only ("Compute copies" above); None: the weights' own dtype.
        `accumulate`: gradients accumulate over several backward passes before `reduce` (a pipeline stage's
        micro-batches); the compute copies' gradients then add up in an fp32 buffer per flat, not in bf16
        ("Accumulation" above). `skips`: a step may leave a parameter without a gradient on every rank (a
        pipeline's early exit or idle routers): each parameter keeps its own step count and one without a gradient
        is not stepped, as torch's AdamW skips it ("Parameters without a gradient" above)."""
        from moebal.train.optim import param_groups

        groups = param_groups(model, t.weight_decay)
        if include is not None:
            groups = [{**g, "params": [p for p in g["params"] if include(p)]} for g in groups]
            groups = [g for g in groups if g["params"]]
        super().__init__(groups, {"lr": t.lr})
        self.reduce_dtype = reduce_dtype
        self.dims = dims
        self.divisor = float(dims.size("dp_ep")) if divisor is None else divisor
        self.flats: list[_Flat] = []
        self.buckets: list[_Bucket] = []
        # channels of our own (collective to create, in this order everywhere): the reduce-scatters are issued
        # from backward hooks, which must never interleave with what the communication scheduler's thread
        # issues on the axis groups
        self._channels = channels if channels is not None else self.make_channels(dims)
        order = {id(p): i for i, p in enumerate(p for p in model.parameters() if include is None or include(p))}
        unit_of = {id(p): u for u, ps in enumerate(at_rest) for p in ps}
        if any(not is_expert_param(p) for ps in at_rest for p in ps):
            raise ValueError("ShardedAdamW: at_rest units hold expert parameters only")
        self.units = [_Unit([], list(ps)) for ps in at_rest]
        self.param_dtype = param_dtype
        self.accumulate = accumulate
        self._acc: dict[int, torch.Tensor] = {}  # flat -> fp32 sum of its compute copies' gradients (`accumulate`)
        self.skips = skips
        self._got: set[int] = set()  # `skips`: the parameters that had a gradient on this rank this step
        self._stepped: list[list[bool]] | None = None  # `skips`: per flat and parameter, what `step` updates
        for g in groups:
            for expert in (False, True):
                ps = [p for p in g["params"] if is_expert_param(p) == expert]
                for dtype, u in dict.fromkeys((p.dtype, unit_of.get(id(p))) for p in ps):
                    same = sorted((p for p in ps if p.dtype == dtype and unit_of.get(id(p)) == u),
                                  key=lambda p: -order[id(p)])
                    self._add_flat(same, "dp" if expert else "dp_ep", g["weight_decay"], expert, order,
                                   bucket_elems, u)
        # one issue order on every rank: dense buckets by the position their last gradient arrives at, expert
        # buckets (after Agg) last
        self.order = sorted(range(len(self.buckets)),
                            key=lambda k: (self.buckets[k].late, self.buckets[k].position, k))
        self._steps = [[0] * len(fl.params) for fl in self.flats]  # `skips`: each parameter's AdamW step count
        self._of_param: dict[int, tuple[int, int]] = {id(p): (f, i) for f, fl in enumerate(self.flats)
                                                      for i, p in enumerate(fl.params)}
        self._param_buckets: dict[int, list[int]] = {}
        for k, b in enumerate(self.buckets):
            for i in b.params:
                self._param_buckets.setdefault(id(self.flats[b.flat].params[i]), []).append(k)
        fused = all(p.device.type in ("cpu", "cuda") and p.is_floating_point() for fl in self.flats
                    for p in fl.params)
        self.inner = torch.optim.AdamW([{"params": fl.leaves, "weight_decay": fl.weight_decay}
                                        for fl in self.flats if fl.leaves],
                                       lr=t.lr, betas=(t.beta1, t.beta2), eps=t.adam_eps,
                                       fused=fused or None, foreach=None if fused else True)
        self._active = False
        self._next = 0  # position in `order` of the next bucket to issue
        self._inflight: list[_InFlight] = []
        self._outs: dict[int, torch.Tensor] = {}
        self._arrived: set[int] = set()
        self._hooks = [p.register_post_accumulate_grad_hook(self._hook) for fl in self.flats for p in fl.params
                       if not is_expert_param(p)]
        self._unit_of = unit_of
        self._hooks += [p.register_post_accumulate_grad_hook(self._unit_hook) for unit in self.units
                        for p in unit.params]
        if accumulate:  # after the unit hook: a unit is freed once its gradients arrived, whatever holds them
            self._hooks += [p.register_post_accumulate_grad_hook(self._acc_hook) for fl in self.flats if fl.master
                            for p in fl.params]
        for u in range(len(self.units)):
            self.release_unit(u)

    @staticmethod
    def make_channels(dims: ParallelDims) -> dict[str, Any]:
        """Its own communicators over "dp_ep" and "dp" (None where an axis has one rank). Collective on every
        rank, in the same order everywhere."""
        return {axis: dims.new_channel(axis) if dims.size(axis) > 1 else None for axis in ("dp_ep", "dp")}

    @property
    def channels(self) -> dict[str, Any]:
        return self._channels

    # ---- layout ----
    def _add_flat(self, params: list[nn.Parameter], axis: str, weight_decay: float, late: bool,
                  order: dict[int, int], bucket_elems: int, unit: int | None = None) -> None:
        if not params:
            return
        ranks = self.dims.ranks_of(axis)
        W = len(ranks)
        total = sum(p.numel() for p in params)
        N = -(-total // W) * W
        buf = torch.zeros(N, dtype=params[0].dtype, device=params[0].device)
        offsets, o = [], 0
        with torch.no_grad():
            for p in params:
                buf[o:o + p.numel()].copy_(p.detach().reshape(-1))
                p.data = buf[o:o + p.numel()].view_as(p)  # the weights live in the flat from now on
                offsets.append(o)
                o += p.numel()
        group = self._channels[axis]
        # compute copies in param_dtype: the non-expert-parallel weights, and the expert-parallel ones where more
        # than one rank shares their masters (with one the fp32 master would be a whole copy beside the compute
        # one: 6 bytes a parameter against 4)
        master = (self.param_dtype is not None and self.param_dtype != buf.dtype
                  and (not is_expert_param(params[0]) or W > 1))
        fl = _Flat(params, offsets, buf, group, ranks, ranks.index(self.dims.rank), weight_decay, axis,
                   native=group is not None and native_reduce_scatter(str(dist.get_backend(group)), buf.device.type),
                   unit=unit, master=master)
        f = len(self.flats)
        if unit is not None:
            self.units[unit].flats.append(f)
        self.flats.append(fl)
        step = max(W, bucket_elems // W * W)
        for start in range(0, N, step):
            stop = min(N, start + step)
            ids = [i for i, (p, a) in enumerate(zip(params, offsets)) if a < stop and a + p.numel() > start]
            position = max(len(order) - 1 - order[id(params[i])] for i in ids)
            fl.buckets.append(len(self.buckets))
            self.buckets.append(_Bucket(f, start, (stop - start) // W, ids, position, late))
            part = buf[start + fl.index * ((stop - start) // W):start + (fl.index + 1) * ((stop - start) // W)]
            # at rest the owned part is the only copy of the weights, with compute copies the only fp32 one: a
            # tensor of its own, not a view of buf
            own = unit is not None or master
            fl.leaves.append((part.detach().clone() if own else part.detach()).requires_grad_(True))
        if master:
            assert self.param_dtype is not None
            fl.buf = buf.to(self.param_dtype)
            with torch.no_grad():
                for p, o in zip(params, offsets):
                    g, p.grad = p.grad, None  # a gradient carried by a migration (fp32, not reduced yet)
                    p.data = fl.buf[o:o + p.numel()].view_as(p)  # gradients come in param_dtype too
                    if g is not None:  # into the flat's fp32 sum, which `reduce` sends
                        self._got.add(id(p))
                        acc = self._acc.setdefault(f, torch.zeros(N, dtype=torch.float32, device=buf.device))
                        acc[o:o + p.numel()] += g.reshape(-1)

    def pieces(self, module: nn.Module, stacked: dict[str, tuple[tuple[int, ...], int]]) -> Iterator[
            tuple[int, _Piece]]:
        """(flat, piece) of every logical tensor, in one order on every rank."""
        from moebal.train.checkpoint import expert_name

        names = {id(p): n for n, p in module.named_parameters()}
        for f, fl in enumerate(self.flats):
            for p, o in zip(fl.params, fl.offsets):
                name = names[id(p)]
                if name in stacked:
                    row = math.prod(p.shape[1:])  # from the shape: weights at rest may be freed (no view)
                    for j, e in enumerate(stacked[name][0]):
                        yield f, _Piece(expert_name(name, e), name, e, tuple(p.shape[1:]), o + j * row,
                                        o + (j + 1) * row)
                else:
                    yield f, _Piece(name, None, None, tuple(p.shape), o, o + p.numel())

    def _runs(self, f: int, start: int, stop: int) -> Iterator[tuple[int, int, int, int]]:
        """(owner, bucket, lo, hi): the flat range [start, stop) cut where the owner changes; [lo, hi) are flat
        offsets inside one owner's part of one bucket."""
        for k in self.flats[f].buckets:
            b = self.buckets[k]
            for j in range(self.flats[f].W):
                a, z = b.start + j * b.part, b.start + (j + 1) * b.part
                lo, hi = max(a, start), min(z, stop)
                if lo < hi:
                    yield j, k, lo, hi

    # ---- gradients ----
    def begin(self) -> None:
        """Arm the hooks for one backward pass."""
        for b in self.buckets:
            b.missing = len(b.params)
        self._arrived, self._inflight, self._outs, self._next = set(), [], {}, 0
        self._active = True

    def _hook(self, p: torch.Tensor) -> None:
        if self._active:
            self._mark(p)
            self._issue_ready()

    def _mark(self, p: torch.Tensor) -> None:
        if id(p) in self._arrived or id(p) not in self._of_param:
            return
        self._arrived.add(id(p))
        for k in self._param_buckets.get(id(p), []):
            self.buckets[k].missing -= 1

    def _issue_ready(self) -> None:
        self.release_completed()
        while self._next < len(self.order) and self.buckets[self.order[self._next]].missing == 0:
            self._issue(self.order[self._next])
            self._next += 1
            self.release_completed()

    @property
    def issued(self) -> int:
        """Buckets sent since `begin` (dense ones during the backward pass, the rest in `reduce`)."""
        return self._next

    def release_completed(self) -> int:
        """Settle the collectives already complete and drop their send buffers; the bytes of send buffers still
        held. Polled, never waited for: a rank waiting inside the backward pass could hold up a collective of it
        (an all-to-all) another rank needs first."""
        pending = []
        for x in self._inflight:
            if x.handle.is_completed():
                self._settle(x)
            else:
                pending.append(x)
        self._inflight = pending
        return sum(x.send.numel() * x.send.element_size() for x in pending)

    def _settle(self, x: _InFlight) -> None:
        """A complete collective's result kept as the bucket's part; its send buffer is dropped with `x`."""
        x.handle.wait()  # complete already (polled) or in `reduce`: raises a failed collective's error here
        if x.out is None:
            b, fl = self.buckets[x.bucket], self.flats[self.buckets[x.bucket].flat]
            self._outs[x.bucket] = x.send[fl.index * b.part:(fl.index + 1) * b.part].clone()

    def _issue(self, k: int) -> None:
        b = self.buckets[k]
        fl = self.flats[b.flat]
        end = b.start + b.part * fl.W
        send = torch.zeros(b.part * fl.W, dtype=self.reduce_dtype or fl.buf.dtype, device=fl.buf.device)
        acc = self._acc.get(b.flat)
        for i in b.params:
            p, o = fl.params[i], fl.offsets[i]
            lo, hi = max(o, b.start), min(o + p.numel(), end)
            if p.grad is not None:
                self._got.add(id(p))
            if acc is not None:  # the micro-batches' sum in fp32, and what arrived since (Agg's replica gradients)
                send[lo - b.start:hi - b.start].copy_(acc[lo:hi])
                if p.grad is not None:
                    send[lo - b.start:hi - b.start] += p.grad.detach().reshape(-1)[lo - o:hi - o]
            elif p.grad is not None:
                send[lo - b.start:hi - b.start].copy_(p.grad.detach().reshape(-1)[lo - o:hi - o])
            if self._param_buckets[id(p)][-1] == k:
                p.grad = None  # its last bucket went out: the full-size gradient is not needed any more
        if fl.W == 1:
            self._outs[k] = send
        elif fl.native:
            out = torch.empty(b.part, dtype=send.dtype, device=send.device)
            self._inflight.append(_InFlight(dist.reduce_scatter_single(out, send, group=fl.group, async_op=True),
                                            send, k, out))
            self._outs[k] = out
        else:
            # gloo's reduce-scatter is an all-reduce of a clone of the input whose handle never reports completion
            # (torch ProcessGroupGloo::reduce_scatter_tensor_coalesced: a LambdaWork): two full-size copies per
            # bucket held until `reduce` waits. The all-reduce in place gives the same sums, one copy, and a
            # handle that completes, so the send buffer goes as soon as gloo is done with it.
            self._inflight.append(_InFlight(dist.all_reduce(send, group=fl.group, async_op=True), send, k, None))

    def reduce(self) -> None:
        """After the backward pass and Agg: every remaining bucket out, every part's gradient averaged and set."""
        if not self._active:
            self.begin()
        for u in range(len(self.units)):  # a layer whose weights took no gradient here (frozen) is still held
            self.release_unit(u)
        for fl in self.flats:
            for p in fl.params:
                self._mark(p)
        self._issue_ready()
        for x in self._inflight:
            self._settle(x)  # wait: the step's reduce-scatters
        self._inflight, self._active = [], False
        for fl in self.flats:
            for k, leaf in zip(fl.buckets, fl.leaves):
                leaf.grad = self._outs[k].to(leaf.dtype).div_(self.divisor)
        self._outs, self._acc = {}, {}
        if self.skips:
            self._agree_stepped()

    def _agree_stepped(self) -> None:
        """`skips`: which parameters `step` updates: those with a gradient on some rank of their shard group. The
        unsharded pipeline's rule (`PipelineRunner._join_peers_grads`): where a peer has a gradient the sum is its,
        where no rank has one the gradient stays None, which torch's AdamW skips (`_over_axes`)."""
        flags = [torch.tensor([id(p) in self._got for p in fl.params], dtype=torch.int32) for fl in self.flats]
        self._stepped = [[bool(x) for x in v.tolist()] for v in self._over_axes(flags)]

    def owned_squares(self) -> list[torch.Tensor]:
        """The summed squares of every owned part's gradient (fp32 scalars)."""
        return [leaf.grad.float().square().sum() for fl in self.flats for leaf in fl.leaves if leaf.grad is not None]

    def squares_by(self, slot_of: Callable[[nn.Parameter], int], n: int) -> torch.Tensor:
        """[n] float64: the summed squares of the owned gradient parts, per slot of the parameter each element
        belongs to (`slot_of`; padding counts nowhere). Summed over the stage ("dp_ep") each element of the
        model counts once (collective there): a pipeline's per-slot gradient norms (`PipelineRunner`)."""
        out = torch.zeros(n, dtype=torch.float64, device=self.dims.device)
        for f, fl in enumerate(self.flats):
            for p, o in zip(fl.params, fl.offsets):
                for j, k, lo, hi in self._runs(f, o, o + p.numel()):
                    leaf_grad = fl.leaves[fl.buckets.index(k)].grad
                    if j != fl.index or leaf_grad is None:
                        continue
                    a = lo - self.buckets[k].start - j * self.buckets[k].part
                    out[slot_of(p)] += leaf_grad[a:a + hi - lo].double().square().sum()
        if self._channels["dp_ep"] is not None:
            dist.all_reduce(out, group=self._channels["dp_ep"])
        return out

    def scale_grads(self, coef: torch.Tensor) -> None:
        """Every owned part's gradient times `coef` (a scalar tensor)."""
        for fl in self.flats:
            for leaf in fl.leaves:
                if leaf.grad is not None:
                    leaf.grad.mul_(coef.to(leaf.grad.dtype))

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        """Clip by the norm of the whole model's gradient (each element counted once over the stage); no host
        read."""
        sq = self.owned_squares()
        total_sq = torch.stack(sq).sum() if sq else torch.zeros((), device=self.dims.device)
        if self._channels["dp_ep"] is not None:
            dist.all_reduce(total_sq, group=self._channels["dp_ep"])
        total = total_sq.sqrt()
        if max_norm != float("inf"):
            self.scale_grads((max_norm / (total + 1e-6)).clamp(max=1.0))
        return total

    # ---- the update ----
    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        """AdamW on the owned parts, then the updated weights all-gathered into every rank's flat."""
        lr = self.param_groups[0]["lr"]
        for g in self.inner.param_groups:
            g["lr"] = lr
        if self.skips:
            self._step_each(lr)
        else:
            self.inner.step()
        for fl in self.flats:
            for k, leaf in zip(fl.buckets, fl.leaves):
                leaf.grad = None
                if fl.unit is not None or (fl.W == 1 and not fl.master):  # at rest: gathered when next needed
                    continue  # (`gather_unit`); one rank: the part is a view of the flat, updated in place
                # a copy: the part may be a view of the flat gathered into (with compute copies: the master rounded)
                self._gather_parts(fl, k, leaf, fl.buf, copy=True)
        self._got, self._stepped = set(), None

    def _step_each(self, lr: float) -> None:
        """`skips`: AdamW on the owned parts parameter by parameter: a parameter `reduce` found without a gradient on
        every rank of its group keeps its weights, moments and step count; the others step with their own count.
        Neighbouring parameters of one part that step with the same count update as one slice (every one of them,
        in a step that leaves none out). The slices of a flat go to torch's fused AdamW kernel in one call, each
        with its count (as the unsharded fused AdamW: the same bits); without it (a foreach optimizer), torch's
        single-tensor arithmetic slice by slice."""
        beta1, beta2 = self.inner.defaults["betas"]
        eps = self.inner.defaults["eps"]
        fused = bool(self.inner.defaults.get("fused"))
        for f, fl in enumerate(self.flats):
            stepped = self._stepped[f] if self._stepped is not None else [True] * len(fl.params)
            steps = self._steps[f]
            for i, on in enumerate(stepped):
                steps[i] += on
            # the flat's slices: weights, gradients, moments, and each slice's count (a 0-d tensor on the part's
            # device, where the fused kernel reads it; `torch.full` fills it without a host sync)
            ws: list[torch.Tensor] = []
            gs: list[torch.Tensor] = []
            ms: list[torch.Tensor] = []
            vs: list[torch.Tensor] = []
            counts: list[torch.Tensor] = []
            ns: list[int] = []  # the counts on the host
            for k, leaf in zip(fl.buckets, fl.leaves):
                if leaf.grad is None:
                    continue
                state = self.inner.state[leaf]
                if not state:  # AdamW's own start: zero moments
                    state.update(exp_avg=torch.zeros_like(leaf), exp_avg_sq=torch.zeros_like(leaf))
                b = self.buckets[k]
                first = b.start + fl.index * b.part
                runs: list[list[int]] = []  # [lo, hi, step] in part offsets
                for i in b.params:
                    lo = max(fl.offsets[i], first) - first
                    hi = min(fl.offsets[i] + fl.params[i].numel(), first + b.part) - first
                    if lo >= hi or not stepped[i]:
                        continue
                    if runs and runs[-1][1] == lo and runs[-1][2] == steps[i]:
                        runs[-1][1] = hi
                    else:
                        runs.append([lo, hi, steps[i]])
                for lo, hi, n in runs:
                    ws.append(leaf.detach()[lo:hi])
                    gs.append(leaf.grad[lo:hi])
                    ms.append(state["exp_avg"][lo:hi])
                    vs.append(state["exp_avg_sq"][lo:hi])
                    counts.append(torch.full((), float(n), device=leaf.device))
                    ns.append(n)
                # the part's count (what a resume without `skips` takes): its most-stepped parameter's
                state["step"] = torch.tensor(float(max((steps[i] for i in b.params), default=0)))
            if not counts:
                continue
            if fused:  # torch's own kernel, as the unsharded AdamW runs it: the same bits
                torch._fused_adamw_(ws, gs, ms, vs, [], counts, lr=float(lr), beta1=float(beta1), beta2=float(beta2),
                                    weight_decay=float(fl.weight_decay), eps=float(eps), amsgrad=False, maximize=False)
            else:
                for w, g, m, v, n in zip(ws, gs, ms, vs, ns):
                    _adamw(w, g, m, v, lr, fl.weight_decay, beta1, beta2, eps, n)

    def _gather_parts(self, fl: _Flat, k: int, part: torch.Tensor, out: torch.Tensor, copy: bool = False) -> None:
        """Every rank's part of bucket k (this rank's: `part`, in `out`'s dtype on the way) gathered into `out`, a
        tensor laid out as flat `fl`; with one rank a copy. `copy`: send a copy of `part` (it may be a view of
        `out`). Collective over the flat's shard group (synchronous)."""
        b = self.buckets[k]
        dst = out[b.start:b.start + b.part * fl.W]
        if fl.W > 1:
            dist.all_gather_single(dst, part.detach().to(out.dtype, copy=copy).contiguous(), group=fl.group)
        else:
            dst.copy_(part.detach())

    # ---- weights at rest (ZeRO-3 for the `at_rest` units) ----
    def gather_unit(self, u: int) -> None:
        """Unit u's weights whole again: its flats' buffers re-allocated (the parameters, views of them, and any
        tensor autograd saved of them see the same storage) and filled by an all-gather of the owned parts over
        "dp" (synchronous: the caller reads them next). Nothing when it is gathered already. Collective over the
        unit's shard group, which must call it at the same point (see FullyShardedAdamW, "Order")."""
        unit = self.units[u]
        if unit.gathered:
            return
        for f in unit.flats:
            fl = self.flats[f]
            fl.buf.untyped_storage().resize_(fl.buf.numel() * fl.buf.element_size())
            with torch.no_grad():
                for k, leaf in zip(fl.buckets, fl.leaves):  # compute copies: the masters rounded on the way
                    self._gather_parts(fl, k, leaf, fl.buf)  # wait: synchronous
        unit.gathered, unit.arrived = True, set()

    def release_unit(self, u: int) -> None:
        """Free unit u's gathered weights (its flats' storage to 0 bytes); the owned parts stay. No communication.
        The parameters keep their shapes; reading their values before `gather_unit` is an error."""
        unit = self.units[u]
        if not unit.gathered:
            return
        for f in unit.flats:
            self.flats[f].buf.untyped_storage().resize_(0)
        unit.gathered = False

    def unit_gathered(self, u: int) -> bool:
        return self.units[u].gathered

    def _unit_hook(self, p: torch.Tensor) -> None:
        """Backward: a unit is freed once every trainable parameter of it has its gradient (nothing after reads
        it: autograd accumulates a parameter's gradient only when every use of it in the graph is done)."""
        u = self._unit_of[id(p)]
        unit = self.units[u]
        if unit.gathered:
            unit.arrived.add(id(p))
            if len(unit.arrived) == sum(q.requires_grad for q in unit.params):
                self.release_unit(u)

    def _acc_hook(self, p: torch.Tensor) -> None:
        """`accumulate`: a compute copy's gradient of one backward pass added into its flat's fp32 sum, and
        dropped (the next backward pass starts it afresh in bf16)."""
        if p.grad is not None:
            self.add(p, p.grad.detach())
            p.grad = None

    # the zero-bubble schedule's deferred weight gradients (moebal/pipeline/zero_bubble.py `GradReducer`) reach the
    # compute copies' fp32 sums here: W adds them outside autograd, where no gradient hook fires
    def holds(self, p: torch.Tensor) -> bool:
        """Whether `p` is a compute copy whose gradients this optimizer sums in fp32 (`accumulate`)."""
        at = self._of_param.get(id(p))
        return self.accumulate and at is not None and self.flats[at[0]].master

    def add(self, p: torch.Tensor, g: torch.Tensor) -> None:
        """`g` (one backward pass's gradient of `p`, in its compute dtype) added into its flat's fp32 sum."""
        self._got.add(id(p))
        f, i = self._of_param[id(p)]
        fl = self.flats[f]
        acc = self._acc.get(f)
        if acc is None:
            acc = self._acc[f] = torch.zeros(fl.buf.numel(), dtype=torch.float32, device=g.device)
        o = fl.offsets[i]
        acc[o:o + p.numel()] += g.reshape(-1)

    def flush(self) -> None:
        """Nothing to reduce at the end of a W slot: the sums go out in `reduce`."""

    @contextmanager
    def gathered(self, write: bool = False) -> Iterator[None]:
        """Every unit gathered inside (a checkpoint's write or load, a caller reading the weights between steps),
        freed after; `write`: the weights were written inside (a checkpoint load), and the owned parts take them.
        Collective over "dp" (every rank of a stage enters it at the same point)."""
        for u in range(len(self.units)):
            self.gather_unit(u)
        try:
            yield
        finally:
            for u in range(len(self.units)):
                if write:
                    self._take_parts(u)
                self.release_unit(u)

    def each_unit_gathered(self, write: bool = False) -> Iterator[int]:
        """Unit by unit, each gathered while the caller reads it (yielded), freed before the next is gathered: a
        checkpoint's copy or load of the weights at rest holds one MoE layer's experts whole at a time beside the
        parts, as the forward pass does, not every layer's. `write`: the caller wrote the unit's weights, and
        the owned parts take them before it is freed. A unit gathered before is left gathered. Collective over
        each unit's shard group (every rank of it iterates to the end, in the same order)."""
        for u in range(len(self.units)):
            held = self.units[u].gathered
            self.gather_unit(u)
            try:
                yield u
                if write:
                    self._take_parts(u)
            finally:
                if not held:
                    self.release_unit(u)

    @torch.no_grad()
    def _take_parts(self, u: int) -> None:
        """Unit u's owned parts copied from its gathered weights (after something wrote the weights)."""
        for f in self.units[u].flats:
            fl = self.flats[f]
            for k, leaf in zip(fl.buckets, fl.leaves):
                b = self.buckets[k]
                a = b.start + fl.index * b.part
                leaf.copy_(fl.buf[a:a + b.part])

    def weight_parts(self) -> list[torch.Tensor]:
        """The owned parts that are tensors of their own: of the weights at rest (the only copy of them this rank
        keeps between uses) and the fp32 masters of compute copies."""
        return [leaf for fl in self.flats if fl.unit is not None or fl.master for leaf in fl.leaves]

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._acc, self._got = {}, set()
        for fl in self.flats:
            for p in fl.params:
                p.grad = None
            for leaf in fl.leaves:
                leaf.grad = None

    def close(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []

    def mask_state(self, p: torch.Tensor, mask: torch.Tensor) -> None:
        """Multiply parameter `p`'s AdamW moments by `mask` (shaped like `p`, the same on every rank): the slices of
        the owned parts that hold `p`'s elements (the pruning scheme zeroes pruned entries); no communication.
        Where `p` is a compute copy, its fp32 masters' slices too: the next step's copies are made from them. A
        parameter it does not hold (frozen): nothing; no moments yet (before the first step): the masters only."""
        if id(p) not in self._of_param:
            return
        f, i = self._of_param[id(p)]
        fl, o, m = self.flats[f], self.flats[f].offsets[i], mask.reshape(-1)
        for j, k, lo, hi in self._runs(f, o, o + p.numel()):
            if j != fl.index:
                continue
            a = lo - self.buckets[k].start - j * self.buckets[k].part
            state = self._part_state(k)
            held = [state[key] for key in ("exp_avg", "exp_avg_sq") if key in state]
            if fl.master:
                held.append(fl.leaves[fl.buckets.index(k)].data)
            for t in held:
                t[a:a + hi - lo].mul_(m[lo - o:hi - o].to(t.dtype))

    def mask_grad(self, p: torch.Tensor, mask: torch.Tensor) -> bool:
        """Multiply the fp32 sum of compute copy `p`'s gradients (`accumulate`) by `mask` (shaped like `p`, the same
        on every rank), and what `reduce` adds to it from `p.grad` (Agg's replica gradients, which arrive after the
        backward pass), before `reduce`; no communication. False when `p` is not a compute copy summed here (its
        gradient is its own `.grad`); True otherwise."""
        if not self.holds(p):
            return False
        f, i = self._of_param[id(p)]
        acc = self._acc.get(f)
        if acc is not None:
            o = self.flats[f].offsets[i]
            acc[o:o + p.numel()].mul_(mask.reshape(-1).to(acc.dtype))
        if p.grad is not None:
            p.grad.mul_(mask.to(p.grad.dtype))
        return True

    # ---- what it holds ----
    def shard_tensors(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """(gradient parts, AdamW state tensors) held now."""
        grads = [leaf.grad for fl in self.flats for leaf in fl.leaves if leaf.grad is not None]
        state = [v for s in self.inner.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
        return grads, state

    # ---- migration (moebal/pipeline/migrate.py) ----
    def full_state(self) -> dict[nn.Parameter, dict[str, torch.Tensor]]:
        """Every parameter's AdamW state whole, as torch's AdamW keeps it (`step`, `exp_avg`, `exp_avg_sq`),
        all-gathered from the owned parts (collective over each flat's shard group): what a pipeline migration
        moves and the rebuilt optimizer re-shards. Empty before the first step. Peak: the whole state of the
        stage on every rank of it, as unsharded, for the migration's duration. Compute copies are turned back into
        fp32 parameters first (`_masters_whole`): the walk and the rebuilt optimizer see the masters. This
        optimizer is not used afterwards."""
        self._masters_whole()
        out: dict[nn.Parameter, dict[str, torch.Tensor]] = {}
        if self.skips:  # each parameter's own count; one never stepped has no state, as in torch's AdamW
            self._steps = self._agreed_steps()
            counts = self._steps
        else:  # every part steps together
            step = self._agreed_step()
            if step is None:
                return out
            counts = [[int(step)] * len(fl.params) for fl in self.flats]
        for fl, steps in zip(self.flats, counts):
            if not any(steps):  # none of the flat's parameters stepped (its shard group agrees): nothing to send
                continue
            full = {key: torch.zeros(fl.buf.numel(), dtype=fl.state_dtype, device=fl.buf.device)  # fp32 moments
                    for key in ("exp_avg", "exp_avg_sq")}
            for k, leaf in zip(fl.buckets, fl.leaves):
                state = self.inner.state.get(leaf, {})
                for key, buf in full.items():
                    # a part of padding only may have no state (after a resume): it sends zeros
                    self._gather_parts(fl, k, state[key] if key in state else torch.zeros_like(leaf), buf)
            for p, o, n in zip(fl.params, fl.offsets, steps):
                if n:
                    out[p] = {"step": torch.tensor(float(n)),
                              **{key: buf[o:o + p.numel()].view_as(p) for key, buf in full.items()}}
        return out

    def _agreed_steps(self) -> list[list[int]]:
        """`skips`: every parameter's step count, the same on every rank of its shard group (a count read from a
        checkpoint is right on the ranks that own a slice of the parameter): the largest over the group."""
        return [v.tolist() for v in self._over_axes([torch.tensor(x, dtype=torch.int64) for x in self._steps],
                                                     dist.ReduceOp.MAX)]

    def _over_axes(self, per_flat: list[torch.Tensor], op: Any = dist.ReduceOp.SUM) -> list[torch.Tensor]:
        """One host vector per flat (a value per parameter) all-reduced over the flat's shard group: the flats of
        an axis in one small all-reduce on its channel (a CPU tensor: gloo under the device-aware backend)."""
        out = list(per_flat)
        for axis in ("dp_ep", "dp"):
            fs = [f for f, fl in enumerate(self.flats) if fl.axis == axis]
            if self._channels[axis] is None or not fs:
                continue
            v = torch.cat([out[f] for f in fs])
            dist.all_reduce(v, op=op, group=self._channels[axis])
            for f, part in zip(fs, v.split([len(out[f]) for f in fs])):
                out[f] = part
        return out

    @torch.no_grad()
    def _masters_whole(self) -> None:
        """Every compute copy's parameter made fp32 again: its data the masters all-gathered whole (collective
        over the flat's shard group), its gradient the fp32 sum accumulated so far (`accumulate`) plus what
        arrived since, or none. A migration then moves the masters, not their bf16 rounding, and the rebuilt
        optimizer builds its masters from them."""
        for f, fl in enumerate(self.flats):
            if not fl.master:
                continue
            whole = torch.empty(fl.buf.numel(), dtype=fl.state_dtype, device=fl.leaves[0].device)
            for k, leaf in zip(fl.buckets, fl.leaves):
                self._gather_parts(fl, k, leaf, whole)
            acc = self._acc.get(f)
            for p, o in zip(fl.params, fl.offsets):
                g, p.grad = p.grad, None
                p.data = whole[o:o + p.numel()].view_as(p)
                if acc is not None or g is not None:
                    grad = acc[o:o + p.numel()].view_as(p).clone() if acc is not None else torch.zeros_like(p)
                    if g is not None:
                        grad += g
                    p.grad = grad
        self._acc = {}

    def _agreed_step(self) -> torch.Tensor | None:
        """The stage's AdamW step count (every part steps together), the same on every rank of the stage (one
        small all-reduce over "dp_ep": a rank whose parts are all padding may hold no state); None before the
        first step."""
        steps = [s["step"] for s in self.inner.state.values() if "step" in s]
        v = (steps[0].detach().double().reshape(1) if steps else torch.full((1,), -1.0, dtype=torch.float64))
        if self._channels["dp_ep"] is not None:
            v = v.to(self.dims.device)
            dist.all_reduce(v, op=dist.ReduceOp.MAX, group=self._channels["dp_ep"])
        n = float(to_host(v, "sharded state: the step count a migration carries")[0])
        return None if n < 0 else torch.tensor(n, dtype=torch.float32)

    def load_full_state(self, states: dict[nn.Parameter, dict[str, torch.Tensor]]) -> None:
        """Adopt whole per-parameter AdamW state (`full_state`'s, or a migrated layer's): each owned part takes its
        slice of it. Every parameter of the stage steps together, so one step count serves every part; a
        parameter without state (none before the first step) leaves zeros, AdamW's own start."""
        if not states:
            return
        step = next(iter(states.values()))["step"]
        if self.skips:  # each parameter's own count; the parts' (unused by `_step_each`) their largest
            self._steps = [[int(states[p]["step"]) if p in states else 0 for p in fl.params] for fl in self.flats]
            step = torch.tensor(float(max(n for steps in self._steps for n in steps)))
        for f, fl in enumerate(self.flats):
            parts = {k: {key: torch.zeros(self.buckets[k].part, dtype=fl.state_dtype, device=fl.buf.device)
                         for key in ("exp_avg", "exp_avg_sq")} for k in fl.buckets}
            for p, o in zip(fl.params, fl.offsets):
                s = states.get(p)
                for j, k, lo, hi in self._runs(f, o, o + p.numel()):
                    if j != fl.index or s is None:
                        continue
                    a = lo - self.buckets[k].start - j * self.buckets[k].part
                    for key, dst in parts[k].items():
                        dst[a:a + hi - lo] = s[key].reshape(-1)[lo - o:hi - o]
            for k, part in parts.items():
                self._adopt(k, {"step": step, **part})

    def _adopt(self, k: int, s: dict[str, torch.Tensor]) -> None:
        """Bucket k's owned part takes AdamW state `s` (`step` where torch keeps it: on the device when fused)."""
        fl = self.flats[self.buckets[k].flat]
        leaf = fl.leaves[fl.buckets.index(k)]
        step = s["step"].detach().to(torch.float32).reshape(()).clone()  # AdamW counts each part's step in place
        on = leaf.device if self.inner.defaults.get("fused") else torch.device("cpu")
        self.inner.state[leaf] = {"step": step.to(on), "exp_avg": s["exp_avg"].to(leaf.device),
                                  "exp_avg_sq": s["exp_avg_sq"].to(leaf.device)}

    def param_state_bytes(self, p: torch.Tensor, whole: bool = False) -> int:
        """AdamW moment bytes of parameter `p`: this rank's share of them (1/W), or all of them (`whole`: what a
        migration moves); 0 before the first step or for a parameter it does not hold. For the layer balancer's
        memory and transfer estimates (moebal/pipeline/observe.py)."""
        if not self.inner.state or id(p) not in self._of_param:
            return 0
        fl = self.flats[self._of_param[id(p)][0]]
        n = 2 * p.numel() * fl.state_dtype.itemsize  # the moments' dtype: fp32 masters' under compute copies
        return n if whole else n // fl.W

    def param_weight_bytes(self, p: torch.Tensor) -> int | None:
        """Bytes of parameter `p`'s weights this rank keeps between steps: the flat's copy (none at rest: freed)
        and its share of the owned parts where those are tensors of their own (at rest, or fp32 masters beside
        compute copies); None for a parameter it does not hold. For the layer balancer's memory estimate."""
        at = self._of_param.get(id(p))
        if at is None:
            return None
        fl = self.flats[at[0]]
        held = 0 if fl.unit is not None else p.numel() * fl.buf.element_size()
        if fl.unit is not None or fl.master:
            held += p.numel() * fl.state_dtype.itemsize // fl.W
        return held

    # ---- checkpoints ----
    def _param_at(self, f: int, offset: int) -> int:
        """The index in flat f of the parameter holding flat offset `offset`."""
        return bisect.bisect_right(self.flats[f].offsets, offset) - 1

    def _part_state(self, k: int) -> dict[str, torch.Tensor]:
        fl = self.flats[self.buckets[k].flat]
        leaf = fl.leaves[fl.buckets.index(k)]
        state: dict[str, torch.Tensor] = self.inner.state.get(leaf, {})
        return state

    def logical_state(self, module: nn.Module, stacked: dict[str, tuple[tuple[int, ...], int]]
                      ) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """What this rank writes of every logical tensor whose first element it owns, whole (the other owners'
        pieces received point to point): its AdamW state by `<logical name>:<key>`, and under compute copies its
        fp32 weights by `<logical name>` (`master_names`; the compute copies are rounded). Collective over the
        shard groups."""
        out: dict[str, torch.Tensor] = {}
        moments = ("exp_avg", "exp_avg_sq") if self.inner.state else ()
        ops: list[Any] = []
        for f, piece in self.pieces(module, stacked):
            fl = self.flats[f]
            keys = (*moments, *(("weight",) if fl.master else ()))
            if not keys:
                continue
            runs = list(self._runs(f, piece.start, piece.stop))
            writer = runs[0][0]
            mine = fl.index == writer
            full = {key: torch.empty(piece.stop - piece.start, dtype=fl.state_dtype, device=fl.buf.device)
                    for key in keys} if mine else {}
            for j, k, lo, hi in runs:
                b = self.buckets[k]
                a = lo - b.start - j * b.part
                z = hi - b.start - j * b.part
                if j == fl.index:
                    state = self._part_state(k) if moments else {}
                    src = {key: state[key] for key in moments}
                    if fl.master:
                        src["weight"] = fl.leaves[fl.buckets.index(k)].detach()
                    for key in keys:
                        if mine:
                            full[key][lo - piece.start:hi - piece.start].copy_(src[key][a:z])
                        else:
                            ops.append(dist.P2POp(dist.isend, src[key][a:z].contiguous(), fl.ranks[writer]))
                elif mine:
                    ops.extend(dist.P2POp(dist.irecv, full[key][lo - piece.start:hi - piece.start],
                                          fl.ranks[j]) for key in keys)
            if mine:
                for key in moments:
                    out[f"{piece.name}:{key}"] = full[key].view(piece.shape)
                if moments and self.skips:
                    out[f"{piece.name}:step"] = torch.tensor(float(self._steps[f][self._param_at(f, piece.start)]))
                elif moments:
                    out[f"{piece.name}:step"] = self._part_state(runs[0][1])["step"].detach().clone()
                if fl.master:
                    out[piece.name] = full["weight"].view(piece.shape)
        if ops:
            for req in dist.batch_isend_irecv(ops):
                req.wait()  # wait: the pieces of the logical tensors this rank writes
        return out, {}

    def master_names(self, module: nn.Module, stacked: dict[str, tuple[tuple[int, ...], int]]) -> set[str]:
        """The logical tensors whose weights `logical_state` writes (from the fp32 masters of compute copies):
        no rank writes them from the module, whose copies are rounded."""
        return {piece.name for f, piece in self.pieces(module, stacked) if self.flats[f].master}

    def read_logical_state(self, reader: CheckpointReader, module: nn.Module,
                           stacked: dict[str, tuple[tuple[int, ...], int]]) -> dict[str, Any]:
        """The AdamW state of this rank's parts from a checkpoint's logical tensors (of any shard size), and under
        compute copies the fp32 weights of its parts, for `load_state_dict`. Raises CheckpointError for state
        that does not fit."""
        from moebal.errors import CheckpointError

        parts: dict[int, dict[str, torch.Tensor]] = {}
        masters: dict[int, torch.Tensor] = {}
        steps: dict[tuple[int, int], int] = {}  # (flat, parameter) -> its step count (`skips`)
        for f, piece in self.pieces(module, stacked):
            fl = self.flats[f]
            runs = [r for r in self._runs(f, piece.start, piece.stop) if r[0] == fl.index]
            if not runs:
                continue
            if fl.master:  # the checkpoint's fp32 weights (the module's copies of them are rounded)
                w = reader.read(piece.name).reshape(-1)
                for _, k, lo, hi in runs:
                    b = self.buckets[k]
                    a = lo - b.start - fl.index * b.part
                    part = masters.setdefault(k, fl.leaves[fl.buckets.index(k)].detach().to("cpu", copy=True))
                    part[a:a + hi - lo] = w[lo - piece.start:hi - piece.start]
            keys = reader.optimizer_keys(piece.name)
            if not keys:
                continue  # no state saved: the part starts fresh, as an unsharded optimizer's would
            saved = reader.optimizer_state(piece.stacked, piece.expert) if piece.stacked is not None else \
                reader.optimizer_state(piece.name)
            for key in ("exp_avg", "exp_avg_sq"):
                t = saved.get(key)
                if not isinstance(t, torch.Tensor) or tuple(t.shape) != piece.shape:
                    raise CheckpointError(f"{reader.path}: optimizer state '{piece.name}:{key}' is missing or has "
                                          f"another shape than the parameter {piece.shape}")
            for _, k, lo, hi in runs:
                b = self.buckets[k]
                a = lo - b.start - fl.index * b.part
                dst = parts.setdefault(k, {key: torch.zeros(b.part, dtype=fl.state_dtype) for key in
                                           ("exp_avg", "exp_avg_sq")})
                for key in ("exp_avg", "exp_avg_sq"):
                    dst[key][a:a + hi - lo] = saved[key].reshape(-1)[lo - piece.start:hi - piece.start]
                step = saved.get("step")
                dst["step"] = step if isinstance(step, torch.Tensor) else torch.tensor(float(step or 0))
                steps[f, self._param_at(f, piece.start)] = int(dst["step"])
        return {"sharded_parts": parts, "master_parts": masters, "param_steps": steps}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Adopt `read_logical_state`'s parts (the inner AdamW's state of each owned bucket; the fp32 weights of
        compute copies: the module's load wrote the same values, rounded, into the flats)."""
        for k, s in state_dict["sharded_parts"].items():
            self._adopt(k, s)
        for (f, i), n in state_dict.get("param_steps", {}).items():
            self._steps[f][i] = n
        with torch.no_grad():
            for k, w in state_dict.get("master_parts", {}).items():
                fl = self.flats[self.buckets[k].flat]
                fl.leaves[fl.buckets.index(k)].copy_(w)


def _adamw(p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, lr: float, weight_decay: float,
           beta1: float, beta2: float, eps: float, step: int) -> None:
    """One AdamW update of `p` in place (torch's single-tensor AdamW, step `step` >= 1, no amsgrad)."""
    p.mul_(1 - lr * weight_decay)
    m.lerp_(g, 1 - beta1)
    v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
    denom = (v.sqrt() / math.sqrt(1 - beta2 ** step)).add_(eps)
    p.addcdiv_(m, denom, value=-lr / (1 - beta1 ** step))


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (`parallel.shard: full`), other tensors as they are."""
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def weights_gathered(optimizer: Any, write: bool = False) -> AbstractContextManager[Any]:
    """`optimizer.gathered(write)` where the optimizer keeps weights sharded at rest (a reader of the weights
    between steps enters it first: checkpoints, a test's final parameters), else nothing."""
    gathered = getattr(optimizer, "gathered", None)
    return gathered(write) if gathered is not None else nullcontext()


def units_gathered(optimizer: Any, write: bool = False) -> Iterator[int]:
    """`optimizer.each_unit_gathered(write)` where the optimizer keeps weights sharded at rest, else nothing."""
    each = getattr(optimizer, "each_unit_gathered", None)
    return each(write) if each is not None else iter(())


def _storages(tensors: Iterable[torch.Tensor | None]) -> dict[int, int]:
    out: dict[int, int] = {}
    for t in tensors:
        if t is not None and t.numel():
            s = t.untyped_storage()
            out.setdefault(s.data_ptr(), s.nbytes())
    return out


def model_state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer | None,
                      grad_buffers: Iterable[torch.Tensor] = (), more_params: Iterable[torch.Tensor] = ()
                      ) -> dict[str, int]:
    """Bytes of model state this rank holds now, from the tensors' storages (a DTensor's: its local shard's;
    each storage counted once, in the first category that holds it): parameters, gradients (the parameters'
    and a sharded optimizer's parts), persistent gradient buffers, optimizer state; and their total.
    `more_params`: weight tensors the module does not list now (FSDP2's shards while a unit is gathered)."""
    parts = getattr(optimizer, "weight_parts", None)  # weights sharded at rest: the owned parts
    params = _storages([*(_local(p) for p in model.parameters()), *more_params, *(parts() if parts else [])])
    grads_t: list[torch.Tensor | None] = [_local(p.grad) if p.grad is not None else None for p in model.parameters()]
    shard_tensors = getattr(optimizer, "shard_tensors", None)
    if shard_tensors is not None:  # ShardedAdamW, FullyShardedAdamW (moebal/distributed/fsdp.py)
        parts, state_t = shard_tensors()
        grads_t.extend(parts)
    else:
        state_t = [v for s in (optimizer.state.values() if optimizer is not None else [])
                   for v in s.values() if isinstance(v, torch.Tensor)]
    seen = dict(params)
    out = {"params": sum(params.values())}
    for key, ts in (("grads", grads_t), ("grad_buffers", list(grad_buffers)), ("optimizer", state_t)):
        new = {k: v for k, v in _storages(ts).items() if k not in seen}
        seen.update(new)
        out[key] = sum(new.values())
    out["total"] = sum(seen.values())
    return out
