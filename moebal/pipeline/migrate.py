"""Apply a stage partition: move partition units (whole layers, or halves of split layers: `units.py`) between
pipeline ranks with everything that belongs to them.

A moved layer carries (in this order, one flat byte buffer after a small int64 header):
  - its state dict (parameters and persistent buffers, e.g. an MoE layer's selection bias);
  - per parameter, when present: its gradient (a migration between backward and optimizer step keeps it)
    and its AdamW state (`step`, `exp_avg`, `exp_avg_sq`);
  - its dynamism-scheme state (pruning masks, a freezing snapshot, ...) and, under expert parallelism, its
    placement planner's state (forecast and current placement; `balance/experts.py`).
The header says, per parameter, whether a gradient and optimizer state follow; every other size is known
to the receiver from the layer's structure, which it rebuilds as an uninitialised skeleton (no random
draws, so the run's random stream is the same with or without migrations). Under expert parallelism the
skeleton is sharded like the sender's layer (shard e of the chain's ep coordinate) before its values arrive.

Protocol (every rank of the chain runs it with the same old and new partitions):
  1. list the moves (unit, from, to) in ascending unit order (`partition.migration_layers`; a unit is a layer
     under whole-layer units);
  2. walk the list: the sender posts header and payload (non-blocking) and drops the layer, the receiver
     blocks on them, rebuilds the layer (or the half, joined to the other half when the receiver holds it)
     and inserts it at its place in layer order; since every rank walks
     the same list and sends never block, the walk cannot deadlock;
  3. wait for every send, then rebuild the optimizer over the stage's new parameter set and give every
     parameter its old state object (kept layers) or the received one (moved layers).
Sharded state (`parallel.shard: optimizer`, a `ShardedAdamW`, moebal/distributed/sharded.py): before the walk
every rank of a stage all-gathers its stage's AdamW state whole per parameter (`full_state`, collective over
the stage's shard groups), the walk moves it as above, and the rebuilt sharded optimizer (new flats and buckets
over the new parameter set) takes its owned slices (`load_full_state`); the sender drops the moved layer's
whole. Gradients of a migration between backward and optimizer step are the parameters' own, not reduced yet,
and travel as above. Peak: the stage's whole AdamW state on every rank of it, for the migration's duration.
Fully sharded state (`parallel.shard: full`, a `StageShardedAdamW`, moebal/distributed/fsdp.py): `full_state`
gathers the weights, gradients and moments of the layers about to leave (`leaving`) and swaps plain layers in
for them before the walk, and the rebuilt optimizer `fully_shard`s the layers that arrived (plain skeletons) and
takes its chunks of their whole moments; the layers that stay, the embedding, norm and head stay sharded with
their state. Peak: the leaving layers and their moments whole on every rank of the sending stage.
A partition over the chain may give released ranks zero layers (re-packing): the same walk empties them.

Devices: the header is a CPU tensor (gloo under the device-aware backend: the receiver reads it on the host at
once, so a device copy would only add a round trip); the payload is built on the stage's compute device (NCCL
on CUDA), every part moved there first (AdamW's `step` and a scheme's bookkeeping may live on the CPU), and
arrives on the receiver's compute device. Optimizer state is put back where torch's AdamW keeps it: `step` on
the CPU unless the optimizer is fused or capturable.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from moebal.config import Config
from moebal.distributed.fsdp import unshard_leaving
from moebal.dynamism.scheme import Dynamism
from moebal.pipeline.p2p import PipeChain
from moebal.pipeline.stage import PipelineStage, build_layer_skeleton, half_modules, keep_half
from moebal.pipeline.units import LAYER, UnitMap
from moebal.planner.partition import migration_layers

__all__ = ["MigrationReport", "OPT_KEYS", "WholeState", "migrate_layers", "rebuild_optimizer"]

OPT_KEYS = ("step", "exp_avg", "exp_avg_sq")
"""AdamW's per-parameter state, in transfer order."""


@dataclass
class MigrationReport:
    moves: list[tuple[int, int, int]]
    bytes_sent: int
    seconds: float


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


class WholeState:
    """A sharded optimizer's state gathered whole per parameter for the walk (what the unsharded path reads
    from `optimizer.state` and `param_groups`)."""

    def __init__(self, state: dict[nn.Parameter, dict[str, torch.Tensor]], param_groups: list[dict[str, Any]]):
        self.state = state
        self.param_groups = param_groups


Stateful = torch.optim.Optimizer | WholeState
"""Where a layer's AdamW state is read from during the walk."""


def _layer_tensors(layer: nn.Module, i: int, optimizer: Stateful | None,
                   parts: Sequence[Dynamism]) -> tuple[torch.Tensor, list[torch.Tensor]]:
    params = list(layer.parameters())
    flags, tensors = [], [v for v in layer.state_dict(keep_vars=True).values()]
    for p in params:
        state = optimizer.state.get(p, {}) if optimizer is not None else {}
        unknown = set(state) - set(OPT_KEYS)
        assert not unknown, f"optimizer state keys {unknown} are not migrated; extend OPT_KEYS"
        has_opt = all(k in state for k in OPT_KEYS)
        flags.append((1 if p.grad is not None else 0) | (2 if has_opt else 0))
        if p.grad is not None:
            tensors.append(p.grad)
        if has_opt:
            tensors += [state["step"].float().reshape(()), state["exp_avg"], state["exp_avg_sq"]]
    for part in parts:
        extra = part.layer_state(i)
        tensors += [extra[k] for k in sorted(extra)]
    return torch.tensor(flags, dtype=torch.int64), tensors


def _send_layer(chain: PipeChain, dst: int, layer: nn.Module, i: int, optimizer: Stateful | None,
                parts: Sequence[Dynamism], device: torch.device) -> int:
    header, tensors = _layer_tensors(layer, i, optimizer, parts)
    payload = (torch.cat([_flat(t.to(device)) for t in tensors]) if tensors
               else torch.empty(0, dtype=torch.uint8, device=device))
    chain.send(header, dst)
    chain.send(payload, dst)
    return header.numel() * 8 + payload.numel()


def _recv_unit(chain: PipeChain, src: int, cfg: Config, units: UnitMap, u: int, device: torch.device,
               parts: Sequence[Dynamism]) -> tuple[nn.Module, dict[nn.Parameter, dict[str, torch.Tensor]]]:
    """Unit u's layer module as it arrives: the whole layer, or a skeleton holding only the half."""
    i, kind = units.parts[u]
    layer = build_layer_skeleton(cfg, i, device)
    if kind == LAYER:
        for part in parts:  # expert sharding first: a scheme's structural change sees the shard's parameters
            part.prepare_layer(i, layer)
        return layer, _recv_into(chain, src, layer, i, device, parts)
    keep_half(layer, kind)  # a split layer has no scheme or expert state (`Dynamism.splittable`)
    return layer, _recv_into(chain, src, half_modules(layer, kind), i, device, ())


def _recv_into(chain: PipeChain, src: int, layer: nn.Module, i: int, device: torch.device,
               parts: Sequence[Dynamism]) -> dict[nn.Parameter, dict[str, torch.Tensor]]:
    """Receive header and payload into the skeleton `layer` (what `_send_layer` sent); returns the optimizer
    state that arrived per parameter."""
    params = list(layer.parameters())
    header = chain.recv(torch.empty(len(params), dtype=torch.int64), src).tolist()
    sd = layer.state_dict(keep_vars=True)
    specs: list[tuple[str, tuple[int, ...], torch.dtype]] = [(k, tuple(v.shape), v.dtype) for k, v in sd.items()]
    for n, (p, f) in enumerate(zip(params, header)):
        if f & 1:
            specs.append((f"grad{n}", tuple(p.shape), p.dtype))
        if f & 2:
            specs += [(f"step{n}", (), torch.float32), (f"avg{n}", tuple(p.shape), p.dtype),
                      (f"sq{n}", tuple(p.shape), p.dtype)]
    extra_specs = [part.layer_state_spec(i, layer) for part in parts]
    specs += [(f"x{n}:{k}", *spec[k]) for n, spec in enumerate(extra_specs) for k in sorted(spec)]
    sizes = [_nbytes(shape, dt) for _, shape, dt in specs]
    payload = chain.recv(torch.empty(sum(sizes), dtype=torch.uint8, device=device), src)
    got = {}
    for (name, shape, dt), chunk in zip(specs, torch.split(payload, sizes)):
        got[name] = chunk.clone().view(dt).reshape(shape)  # clone first: an aligned copy can be viewed as dt
    with torch.no_grad():
        for k, v in sd.items():
            v.copy_(got[k])
    states: dict[nn.Parameter, dict[str, torch.Tensor]] = {}
    for n, (p, f) in enumerate(zip(params, header)):
        if f & 1:
            p.grad = got[f"grad{n}"]
        if f & 2:
            states[p] = {"step": got[f"step{n}"], "exp_avg": got[f"avg{n}"], "exp_avg_sq": got[f"sq{n}"]}
    for n, (part, spec) in enumerate(zip(parts, extra_specs)):
        part.load_layer_state(i, layer, {k: got[f"x{n}:{k}"] for k in spec})
    return states


def _nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    n = 1
    for s in shape:
        n *= s
    return n * torch.empty((), dtype=dtype).element_size()


def migrate_layers(stage: PipelineStage, chain: PipeChain, old: Sequence[int], new: Sequence[int],
                   optimizer: torch.optim.Optimizer | None, scheme: Dynamism,
                   make_optimizer: Callable[[nn.Module], torch.optim.Optimizer | None],
                   experts: Any = None) -> tuple[torch.optim.Optimizer | None, MigrationReport]:
    """Move layers so that chain member p holds new[p] layers (a partition over the current chain, zeros allowed
    for members about to be released). Returns the rebuilt optimizer (None if this rank ends with no layers).
    `experts` (a `StageExperts`) shards arriving MoE layers and carries their placement planners."""
    import time

    t0 = time.perf_counter()
    moves = migration_layers(old, new)
    walk: Stateful | None = optimizer
    gather = getattr(optimizer, "full_state", None)
    leaving = tuple(sorted({stage.units.parts[u][0] for u, src, _ in moves if src == chain.index}))
    if gather is not None:  # sharded state: whole for the walk, re-sharded by the rebuilt optimizer
        assert optimizer is not None
        if hasattr(optimizer, "leaving"):  # fully sharded: only the layers that leave are gathered
            optimizer.leaving = leaving
        walk = WholeState(gather(), optimizer.param_groups)
        getattr(optimizer, "close", lambda: None)()  # its gradient hooks go with it
    elif optimizer is None and stage.cfg.parallel.shard == "full":  # a frozen stage keeps FSDP2's shards
        unshard_leaving(stage, leaving, scheme.prepare_layer)
    me = chain.index
    received: dict[nn.Parameter, dict[str, torch.Tensor]] = {}
    sent = 0
    device = next(stage.parameters()).device
    parts = [p for p in (experts, scheme) if p is not None]
    units = stage.units
    for u, src, dst in moves:
        i, kind = units.parts[u]
        if src == me:
            if kind == LAYER:
                sent += _send_layer(chain, chain.ranks[dst], stage.layer(i), i, walk, parts, device)
            else:
                assert not any(part.layer_state(i) for part in parts), f"split layer {i} has scheme state"
                sent += _send_layer(chain, chain.ranks[dst], stage.unit_module(u), i, walk, (), device)
            stage.remove_unit(u)
            if i not in stage.layer_ids:
                for part in parts:
                    part.drop_layer(i)
        elif dst == me:
            layer, states = _recv_unit(chain, chain.ranks[src], stage.cfg, units, u, device, parts)
            stage.add_unit(u, layer)
            received.update(states)
    chain.flush()
    if experts is not None:
        experts.refresh()
    if new[me] > 0:
        stage.check_contiguous()
    if new[me] == 0:
        return None, MigrationReport(moves, sent, time.perf_counter() - t0)
    new_opt = rebuild_optimizer(stage, walk, received, make_optimizer)
    return new_opt, MigrationReport(moves, sent, time.perf_counter() - t0)


def rebuild_optimizer(module: nn.Module, old: Stateful | None,
                      received: dict[nn.Parameter, dict[str, torch.Tensor]],
                      make_optimizer: Callable[[nn.Module], torch.optim.Optimizer | None]
                      ) -> torch.optim.Optimizer | None:
    """A fresh optimizer over `module`'s parameters (same construction rule as at start) whose per-parameter
    state is the old optimizer's for parameters that stayed and the received state for those that arrived.
    Learning rate and hyper-parameters come from the construction rule; the runner sets the lr every step.
    A sharded optimizer (`load_full_state`) takes its owned slices of the whole states instead."""
    held = list(module.parameters())  # before the rebuild: a fully sharded one replaces them by their shards
    opt = make_optimizer(module)
    if opt is None:
        return None  # nothing left to train here (a frozen stage)
    adopt = getattr(opt, "load_full_state", None)
    if adopt is not None:
        kept = {p: old.state[p] for p in held if old is not None and p in old.state}
        adopt({**kept, **received})
        _keep_lr(opt, old)
        return opt
    step_on_device = bool(opt.defaults.get("fused") or opt.defaults.get("capturable"))
    for group in opt.param_groups:
        for p in group["params"]:
            if p in received:
                opt.state[p] = {k: v.to(p.device if k != "step" or step_on_device else torch.device("cpu"))
                                for k, v in received[p].items()}
            elif old is not None and p in old.state:
                opt.state[p] = old.state[p]
    _keep_lr(opt, old)
    return opt


def _keep_lr(opt: torch.optim.Optimizer, old: Stateful | None) -> None:
    if old is not None:
        for g_new, g_old in zip(opt.param_groups, old.param_groups):
            g_new["lr"] = g_old["lr"]
