"""Layer freezing: converged front layers stop training; they run forward only, with no backward.

Criterion (stated; Egeria compares activations against a reference model and AutoFreeze tracks gradient
norms, DynMo gives no threshold): every `check_every` steps, each layer's plasticity is the relative change
of its parameters over the window, ||W_now - W_then|| / ||W_then||. Layers freeze front to back, as in Egeria
and AutoFreeze: the first unfrozen layer freezes when its plasticity is below `threshold`, then the next
one is tested, and so on, up to `max_fraction` of the layers. Frozen layers therefore always form a prefix,
which is what lets them skip backward entirely: nothing before them needs a gradient. The embedding freezes
with layer 0 for the same reason (its gradient would have to flow back through the frozen layers). Freezing
is permanent, as in both systems.

Every stage computes the plasticity of its own layers from sums of squares; under expert parallelism the
expert shards' squares are summed over the expert-parallel group first (each rank holds other experts),
and the numbers are summed along the chain, so every rank takes the same decision. A layer's snapshot
migrates with it, and checkpoints keep it per parameter (an expert shard's rows by logical expert) with the
frozen count and the last plasticities, so a resumed run, under any partition, takes the same decisions.

Cost: a frozen layer's forward still runs (the papers' "frozen costs 0" is wrong for time), so it costs
about a third of its forward+backward time; the planner uses measured time, and predicts 1/3.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from moebal.distributed.expert_parallel import is_expert_param
from moebal.distributed.fsdp import whole_tensor
from moebal.dynamism.scheme import Dynamism, SchemeContext, check_steps, register
from moebal.errors import ConfigError
from moebal.sync import to_host

__all__ = ["FORWARD_SHARE", "LayerFreezing"]

FORWARD_SHARE = 1.0 / 3.0
"""A layer's forward as a share of its forward + backward (backward ~ 2x forward)."""


def _ordered(layer: nn.Module) -> tuple[list[tuple[str, nn.Parameter]], int]:
    """The layer's parameters, replicated ones first, then expert shards (their squares add up over the
    expert-parallel group); and how many entries are replicated."""
    dense = [(n, p) for n, p in layer.named_parameters() if not is_expert_param(p)]
    shard = [(n, p) for n, p in layer.named_parameters() if is_expert_param(p)]
    return dense + shard, sum(p.numel() for _, p in dense)


def _snapshot(layer: nn.Module) -> dict[str, torch.Tensor]:
    """fp32 copies of the layer's parameters by name (kept per parameter, not as one vector, so that a
    checkpoint can key an expert shard's rows by logical expert and restore them under another layout), whole:
    FSDP2's shards gathered (collective over the stage)."""
    return {n: whole_tensor(p.detach()).float().clone() for n, p in layer.named_parameters()}


def _flat(layer: nn.Module, snap: dict[str, torch.Tensor] | None = None) -> tuple[torch.Tensor, int]:
    """The layer's parameters (or their snapshot) as one fp32 vector in `_ordered` order."""
    named, k = _ordered(layer)
    parts = [(whole_tensor(p.detach()) if snap is None else snap[n]).reshape(-1).float() for n, p in named]
    return torch.cat(parts), k


@register("freezing")
class LayerFreezing(Dynamism):
    name = "freezing"

    def __init__(self, cfg: Any, threshold: float = 0.01, check_every: int = 10, max_fraction: float = 0.5,
                 start: int = 0) -> None:
        if threshold <= 0 or check_every < 1 or not 0 < max_fraction < 1:
            raise ConfigError(f"dynamism freezing: threshold ({threshold}) > 0, check_every ({check_every}) >= 1 "
                              f"and max_fraction ({max_fraction}) in (0, 1) required")
        self.L = cfg.model.n_layers
        check_steps("freezing", start=start)
        self.threshold, self.check_every, self.start = float(threshold), int(check_every), int(start)
        self.max_frozen = max(0, min(self.L - 1, int(max_fraction * self.L)))
        self.frozen = 0
        self.snapshots: dict[int, dict[str, torch.Tensor]] = {}
        self.plasticity: list[float | None] = [None] * self.L

    def frozen_prefix(self) -> int:
        return self.frozen

    def on_start(self, ctx: SchemeContext) -> None:
        for i in ctx.stage.layer_ids:
            self.snapshots[i] = _snapshot(ctx.stage.layer(i))

    def update(self, ctx: SchemeContext) -> bool:
        if ctx.step < self.start or ctx.step % self.check_every:
            return False
        L = self.L
        vec = torch.zeros(3 * L, dtype=torch.float64)  # per layer: |W_now - W_then|^2, |W_then|^2, held here
        shard = torch.zeros(2 * L, dtype=torch.float64)  # the same two sums over this rank's expert shards
        ids, sums = list(ctx.stage.layer_ids), []
        for i in ids:
            layer = ctx.stage.layer(i)
            now, k = _flat(layer)
            then = _flat(layer, self.snapshots[i])[0]
            diff, ref = (now - then).double().square(), then.double().square()
            sums.append(torch.stack([diff[:k].sum(), ref[:k].sum(), diff[k:].sum(), ref[k:].sum()]))
            self.snapshots[i] = _snapshot(layer)
        # the layers' sums on the device, read once (a read per layer would wait for the device each time)
        for i, (d, r, d_shard, r_shard) in zip(ids, to_host(torch.stack(sums), "freezing: plasticity") if ids else []):
            vec[i], vec[L + i], vec[2 * L + i] = d, r, 1.0
            shard[i], shard[L + i] = d_shard, r_shard
        vec[:2 * L] += ctx.shard_sum(shard) if ctx.shard_sum is not None else shard
        tot = ctx.chain.allreduce_sum(vec)
        self.plasticity = [math.sqrt(float(tot[i]) / max(float(tot[L + i]), 1e-24)) if tot[2 * L + i] > 0 else None
                           for i in range(L)]
        n = self.frozen
        while n < self.max_frozen and (p := self.plasticity[n]) is not None and p < self.threshold:
            n += 1
        if n == self.frozen:
            return False
        self._freeze(ctx, n)
        return True

    def _freeze(self, ctx: SchemeContext, n: int) -> None:
        stage = ctx.stage
        for i in stage.layer_ids:
            if i < n:
                for p in stage.layer(i).parameters():
                    p.requires_grad_(False)
                    p.grad = None
        if stage.model.embed_tokens is not None:
            stage.model.embed_tokens.weight.requires_grad_(False)
            stage.model.embed_tokens.weight.grad = None
        tied = stage.tied_head  # the head's weight is the embedding's (a copy on a pipeline's last stage)
        if tied is not None:
            tied.requires_grad_(False)
            tied.grad = None
        self.frozen = n

    def prepare_layer(self, i: int, layer: nn.Module) -> None:
        if i < self.frozen:
            for p in layer.parameters():
                p.requires_grad_(False)

    def layer_state(self, i: int) -> dict[str, torch.Tensor]:
        return {f"snapshot:{n}": t for n, t in self.snapshots[i].items()}

    def layer_state_spec(self, i: int, layer: nn.Module) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        return {f"snapshot:{n}": (tuple(p.shape), torch.float32) for n, p in layer.named_parameters()}

    def load_layer_state(self, i: int, layer: nn.Module, state: dict[str, torch.Tensor]) -> None:
        self.snapshots[i] = {k.removeprefix("snapshot:"): t for k, t in state.items()}

    def drop_layer(self, i: int) -> None:
        self.snapshots.pop(i, None)

    def cost_factors(self, num_layers: int) -> list[float]:
        return [FORWARD_SHARE if i < self.frozen else 1.0 for i in range(num_layers)]

    def metrics(self) -> dict[str, Any]:
        return {"frozen_layers": self.frozen,
                "plasticity": [None if p is None else round(p, 6) for p in self.plasticity],
                "predicted_cost": [round(c, 4) for c in self.cost_factors(self.L)]}

    def on_resume(self, ctx: SchemeContext) -> None:
        if self.frozen:
            self._freeze(ctx, self.frozen)  # the held frozen layers and, on the first stage, the embedding

    def state_dict(self) -> dict[str, Any]:
        return {"frozen": self.frozen, "plasticity": self.plasticity}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.frozen = int(state.get("frozen", 0))
        self.plasticity = list(state.get("plasticity", [None] * self.L))
