"""Expert parallelism on real gloo ranks against the single-process model: losses, gradients, placements."""

from __future__ import annotations

import copy
import random

import pytest
import torch
import torch.distributed as dist

from moebal.config import from_dict
from moebal.distributed.expert_parallel import ExpertParallel, is_expert_param
from moebal.distributed.groups import ParallelDims
from moebal.distributed.testing import run_ranks
from moebal.models import build_model
from moebal.planner.plan import ExpertPlacement, default_owners


def _cfg(experts: int, capacity: float | None = None, scope: str = "layer", aux: float = 0.01):
    return from_dict({
        "model": {"dim": 32, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "ffn_dim": 48, "max_seq_len": 16},
        "moe": {"num_experts": experts, "top_k": 2, "expert_ffn_dim": 24, "aux_loss_coef": aux,
                "z_loss_coef": 0.001, "capacity_factor": capacity, "aux_loss_scope": scope},
        "data": {"seq_len": 16},
    })


def _placements(kind: str, E: int, R: int, step: int, layers: int) -> list[ExpertPlacement]:
    owner = default_owners(E, R)
    if kind == "static":
        return [ExpertPlacement.static(E, R) for _ in range(layers)]
    rng = random.Random(1000 * step + 7)  # the same on every rank
    out = []
    for _ in range(layers):
        reps = tuple(tuple(sorted(r for r in range(R) if r != owner[e] and rng.random() < 0.5)) for e in range(E))
        out.append(ExpertPlacement(num_ranks=R, owner=owner, replicas=reps, policy="random"))
    return out


def step_against_reference(model: torch.nn.Module, ref: torch.nn.Module, ep: ExpertParallel, ids: torch.Tensor,
                           placements: list[ExpertPlacement], per: int, worst: dict[str, float]) -> None:
    """One step of `model` on this rank's 2 rows of `ids` under expert parallelism and of `ref` on all rows in
    one process (gradients left for the caller's optimizers); the worst relative loss, auxiliary loss (the mean
    over ranks: a global loss is the same on each, a per-sequence one each rank's rows') and gradient and the
    worst absolute parameter difference so far go into `worst`. Rank r holds experts [r * per, (r + 1) * per)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    x, y = ids[:, :-1], ids[:, 1:]
    ep.apply(placements)
    out = model(x[2 * rank:2 * rank + 2], y[2 * rank:2 * rank + 2])
    (out.loss + out.aux_loss).backward()
    ep.aggregate()
    ep.sync_gradients()
    loss = torch.stack([out.loss.detach(), out.aux_loss.detach()])
    dist.all_reduce(loss)
    ref_out = ref(x, y)
    (ref_out.loss + ref_out.aux_loss).backward()
    worst["loss"] = max(worst["loss"], abs(loss[0].item() / world - ref_out.loss.item()) / ref_out.loss.item())
    worst["aux"] = max(worst.get("aux", 0.0),
                       abs(loss[1].item() / world - ref_out.aux_loss.item()) / ref_out.aux_loss.item())
    for p, rp in zip(model.parameters(), ref.parameters()):
        rg = rp.grad[rank * per:(rank + 1) * per] if is_expert_param(p) else rp.grad
        rw = rp.detach()[rank * per:(rank + 1) * per] if is_expert_param(p) else rp.detach()
        worst["grad"] = max(worst["grad"], ((p.grad - rg).norm() / rg.norm().clamp(min=1e-12)).item())
        worst["param"] = max(worst["param"], ((p.detach() - rw).abs().max()).item())


def _worker(rank: int, world: int, experts: int, kind: str, steps: int, scope: str = "layer",
            aux: float = 0.01) -> dict[str, float]:
    cfg = _cfg(experts, scope=scope, aux=aux)
    torch.manual_seed(0)
    ref = build_model(cfg)
    model = copy.deepcopy(ref)
    dims = ParallelDims(world_size=world, rank=rank, ep=world).init()
    ep = ExpertParallel(model, dims)
    # SGD keeps rounding differences proportional; Adam divides by sqrt(v) and would amplify the summation-order
    # noise of near-zero gradients into visible parameter differences.
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    per = experts // world
    worst = {"loss": 0.0, "grad": 0.0, "param": 0.0}
    for step in range(steps):
        g = torch.Generator().manual_seed(step)
        ids = torch.randint(0, 256, (2 * world, 17), generator=g)
        step_against_reference(model, ref, ep, ids, _placements(kind, experts, world, step, cfg.model.n_layers),
                               per, worst)
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    return worst


@pytest.mark.parametrize("world, experts, kind", [(2, 4, "static"), (2, 4, "random"), (4, 8, "random"),
                                                  (4, 4, "static")])
def test_expert_parallel_matches_single_process(world, experts, kind):
    for worst in run_ranks(_worker, world, experts, kind, 20):
        assert worst["loss"] < 1e-5, worst
        assert worst["aux"] < 1e-5, worst
        assert worst["grad"] < 1e-5, worst
        assert worst["param"] < 1e-5, worst


@pytest.mark.parametrize("scope", ["pooled", "sequence"])
def test_balancing_loss_scopes_match_single_process(scope):
    """moe.aux_loss_scope under expert parallelism, its loss weighted up to matter (0.5): pooled sums every
    layer's statistics over the ranks, sequence keeps each rank's rows' own."""
    for worst in run_ranks(_worker, 2, 4, "random", 8, scope, 0.5):
        assert worst["loss"] < 1e-5, worst
        assert worst["aux"] < 1e-5, worst
        assert worst["grad"] < 1e-5, worst
        assert worst["param"] < 1e-5, worst


def _z_loss_uneven(rank: int, world: int) -> dict[str, float]:
    """One MoE layer under a `StatsReducer` with 3 tokens on rank 0 and 9 on rank 1 against the layer in one
    process over all 12: z-loss coefficient 1 and router init std 0.5, so that the router logits are far from 0
    and the per-token z values differ (with the other tests' 0.02 and 0.001 a wrong mean hides under 1e-5)."""
    from moebal.distributed.expert_parallel import StatsReducer
    from moebal.models.moe import MoELayer

    def layer() -> MoELayer:
        torch.manual_seed(0)
        return MoELayer(16, 8, 4, 2, aux_loss_coef=0.0, z_loss_coef=1.0, init_std=0.5)

    x = torch.randn(12, 16, generator=torch.Generator().manual_seed(1))
    m = layer()
    m.set_stats_reducer(StatsReducer(None))  # the default group: both ranks
    m(x[:3] if rank == 0 else x[3:])
    m.aux_loss.backward()
    grad = m.gate.weight.grad.clone()
    dist.all_reduce(grad)
    grad /= world  # the data-parallel mean of the gradients
    loss = m.aux_loss.detach().clone()
    dist.all_reduce(loss)
    loss /= world
    ref = layer()
    ref(x)
    ref.aux_loss.backward()
    return {"loss": abs(loss.item() - ref.aux_loss.item()) / ref.aux_loss.item(),
            "grad": ((grad - ref.gate.weight.grad).norm() / ref.gate.weight.grad.norm()).item()}


def test_z_loss_with_uneven_tokens_per_rank_is_the_global_token_mean():
    """The z-loss over ranks holding different numbers of tokens (after early exits, uneven packing) is the mean
    over every token, not the mean of the ranks' means (which weighs rank 0's 3 tokens as rank 1's 9): loss and
    router gradient as one process's over all tokens."""
    for worst in run_ranks(_z_loss_uneven, 2):
        assert worst["loss"] < 1e-5, worst
        assert worst["grad"] < 1e-5, worst


def _budget_worker(rank: int, world: int) -> dict:
    """One bf16-autocast step with replicas: host syncs per MoE layer (through moebal.sync), the dtype of every
    token payload, and the loss against the single-process model under the same autocast."""
    from moebal.sync import audit

    cfg = _cfg(4, capacity=1.0)
    torch.manual_seed(0)
    ref = build_model(cfg)
    model = copy.deepcopy(ref)
    dims = ParallelDims(world_size=world, rank=rank, ep=world).init()
    ep = ExpertParallel(model, dims, compute_dtype=torch.bfloat16)
    payloads: list[torch.dtype] = []
    real = ep.sched.all_to_all

    def spy(out, inp, out_splits, in_splits, group, **kw):
        if kw.get("kind", "a2a") == "a2a":
            payloads.append(inp.dtype)
        return real(out, inp, out_splits, in_splits, group, **kw)

    ep.sched.all_to_all = spy
    ids = torch.randint(0, 256, (2 * world, 17), generator=torch.Generator().manual_seed(3))
    x, y = ids[:, :-1], ids[:, 1:]
    ep.apply(_placements("random", 4, world, 1, cfg.model.n_layers))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with audit() as fwd:
            out = model(x[2 * rank:2 * rank + 2], y[2 * rank:2 * rank + 2])
        with audit() as bwd:
            (out.loss + out.aux_loss).backward()
        ref_out = ref(x, y)
    ep.aggregate()
    ep.sync_gradients()
    replica_dtypes = sorted({str(b.dtype) for d in ep.dispatchers for b in d.replicas.values()})
    loss = out.loss.detach().float().clone()
    dist.all_reduce(loss)
    return {"fwd": dict(fwd.counted), "fwd_raw": fwd.unaccounted, "bwd": dict(bwd.counted),
            "bwd_raw": bwd.unaccounted, "payloads": sorted({str(p) for p in payloads}), "n_payloads": len(payloads),
            "replicas": replica_dtypes, "loss": loss.item() / world, "ref": ref_out.loss.item()}


def test_expert_parallel_host_syncs_and_payloads_under_autocast():
    layers = _cfg(4).model.n_layers
    for r in run_ranks(_budget_worker, 2):
        # one sync per MoE layer forward (the count exchange; budget 2), none in the backward (budget 1)
        assert r["fwd_raw"] == [] and r["bwd_raw"] == [], r
        assert r["fwd"] == {"all-to-all counts": layers}, r
        assert r["bwd"] == {}, r
        # token rows, expert outputs and their gradients all travel in the autocast dtype
        assert r["payloads"] == ["torch.bfloat16"] and r["n_payloads"] == 4 * layers, r
        assert r["replicas"] in ([], ["torch.bfloat16"]), r
        assert abs(r["loss"] - r["ref"]) / r["ref"] < 2e-2, r
