"""Activation recomputation on real gloo ranks: expert parallelism (with Pro-Prophet replicas, Trans and Agg)
and a 2-stage pipeline give bit-identical fp32 losses, gradients and parameters to recompute none."""

from __future__ import annotations

import copy
import dataclasses

import torch

from moebal.config import from_dict
from moebal.distributed.testing import random_placements, run_ranks

MODES = ("none", "moe", "attention", "full")


def _ep_cfg():
    return from_dict({
        "model": {"dim": 32, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "ffn_dim": 48, "max_seq_len": 16},
        "moe": {"num_experts": 4, "top_k": 2, "expert_ffn_dim": 24, "aux_loss_coef": 0.01, "z_loss_coef": 0.001,
                "jitter": 0.1, "shared_experts": 1, "kernel": "loop"},
        "data": {"seq_len": 16},
    })


def _ep_worker(rank: int, world: int, overlap: bool) -> dict:
    """Every mode's model under expert parallelism (replicas, block overlap) for 3 SGD steps; per mode the
    losses, gradients, stats and final parameters, as numpy."""
    from moebal.distributed.expert_parallel import ExpertParallel
    from moebal.distributed.groups import ParallelDims
    from moebal.models import build_model
    from moebal.models.recompute import set_recompute

    cfg = _ep_cfg()
    torch.manual_seed(0)
    base = build_model(cfg)
    dims = ParallelDims(world_size=world, rank=rank, ep=world).init()
    out: dict = {}
    for mode in MODES:
        model = copy.deepcopy(base)
        set_recompute(model, mode)
        ep = ExpertParallel(model, dims, overlap=overlap)
        experts = model.model.layers[0].block_sparse_moe.experts
        calls = [0]
        compute = experts.compute

        def counted(*a: object, compute=compute, calls=calls) -> torch.Tensor:
            calls[0] += 1
            return compute(*a)

        experts.compute = counted  # the exchange calls experts.compute: count forwards and recomputations
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        rec: dict = {"loss": [], "grads": [], "stats": []}
        for step in range(3):
            g = torch.Generator().manual_seed(step)
            ids = torch.randint(0, 256, (2 * world, 17), generator=g)
            x, y = ids[2 * rank:2 * rank + 2, :-1], ids[2 * rank:2 * rank + 2, 1:]
            ep.apply(random_placements(4, world, step, 2))
            torch.manual_seed(100 + step)  # jitter draws
            res = model(x, y)
            (res.loss + res.aux_loss).backward()
            ep.aggregate()
            ep.sync_gradients()
            rec["loss"].append((res.loss.item(), res.aux_loss.item()))
            rec["grads"].append({n: p.grad.numpy().copy() for n, p in model.named_parameters()})
            rec["stats"].append([m.take_stats().packed().numpy() for m in model.moe_layers()])
            opt.step()
            opt.zero_grad()
            ep.release()
        rec["params"] = {n: p.detach().numpy().copy() for n, p in model.named_parameters()}
        rec["expert_calls"] = calls[0]
        ep.close()
        out[mode] = rec
    return out


def _equal_runs(a: dict, b: dict) -> None:
    assert a["loss"] == b["loss"]
    for ga, gb in zip(a["grads"], b["grads"]):
        assert ga.keys() == gb.keys()
        for n in ga:
            assert (ga[n] == gb[n]).all(), n
    for sa, sb in zip(a["stats"], b["stats"]):
        assert all((x == y).all() for x, y in zip(sa, sb))
    assert all((a["params"][n] == b["params"][n]).all() for n in a["params"])


def test_recompute_under_expert_parallelism_is_bitwise_exact():
    for overlap in (False, True):
        for r in run_ranks(_ep_worker, 2, overlap, timeout_s=300.0):
            for mode in MODES[1:]:
                _equal_runs(r["none"], r[mode])
            # the expert GEMMs run once per step, twice where moe and full recompute them
            assert [r[m]["expert_calls"] for m in MODES] == [3, 6, 3, 6]


def _pipe_cfg(recompute: str):
    return from_dict({
        "model": {"dim": 32, "n_layers": 4, "n_heads": 4, "n_kv_heads": 2, "ffn_dim": 64, "max_seq_len": 32},
        "moe": {"num_experts": 4, "top_k": 2, "expert_ffn_dim": 32, "kernel": "loop", "jitter": 0.1, "every": 2},
        "data": {"seq_len": 16, "batch_size": 8, "max_bytes": 200_000},
        "train": {"steps": 3, "warmup_steps": 0, "lr": 1e-2, "eval_every": 0, "precision": "fp32",
                  "recompute": recompute},
        "parallel": {"pp": 2, "nproc": 2}})


def _pipe_train(recompute: str, **opts: object) -> dict:
    from moebal.pipeline.runner import PipelineRunner

    cfg = _pipe_cfg(recompute)
    force = opts.pop("force", ())
    cfg = dataclasses.replace(cfg, pipeline=dataclasses.replace(cfg.pipeline, micro_batches=2, **opts))
    runner = PipelineRunner(cfg, force=force)
    out = runner.train(3)
    return {"losses": [r["loss"] for r in out.records],
            "state": {k: v.numpy() for k, v in runner.full_state().items()}}


def _pipe_worker(rank: int, world: int) -> dict:
    out = {f"{m}_1f1b": _pipe_train(m) for m in MODES}
    # zero bubble (deferred weight gradients) with a forced migration: the received layers recompute too
    out.update({f"{m}_zb": _pipe_train(m, schedule="zb", force=((1, (1, 3)),)) for m in ("none", "full")})
    return out


def test_recompute_in_the_pipeline_is_bitwise_exact():
    results = run_ranks(_pipe_worker, 2, timeout_s=600.0)
    for case in ("1f1b", "zb"):
        ref = results[0][f"none_{case}"]
        for mode in MODES[1:] if case == "1f1b" else ("full",):
            got = results[0][f"{mode}_{case}"]
            assert got["losses"] == ref["losses"], (mode, case)
            for r in results:  # each stage's state (full_state is the stage's own tensors)
                a, b = r[f"none_{case}"]["state"], r[f"{mode}_{case}"]["state"]
                assert a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a), (mode, case)


SUBSET_SCHEMES = {
    # tokens leave from layer 1 on: layers 2-3 run token subsets (5 % to 99 % of the tokens over the steps)
    "early_exit": {"threshold": 0.98, "first_layer": 1, "start": 0, "ramp_steps": 0},
    # layers 1 and 3 are routed blocks at capacity 0.5
    "mod": {"capacity": 0.5, "every": 2, "first_layer": 1},
}


def _scheme_train(scheme: str, recompute: str, schedule: str = "1f1b") -> dict:
    from moebal.dynamism.scheme import build_dynamism
    from moebal.pipeline.runner import PipelineRunner

    cfg = _pipe_cfg(recompute)
    cfg = dataclasses.replace(cfg, pipeline=dataclasses.replace(cfg.pipeline, micro_batches=2, schedule=schedule))
    runner = PipelineRunner(cfg, scheme=build_dynamism(scheme, SUBSET_SCHEMES[scheme], cfg=cfg))
    out = runner.train(4)
    return {"losses": [r["loss"] for r in out.records], "records": out.records,
            "state": {k: v.numpy() for k, v in runner.full_state().items()}}


def _scheme_worker(rank: int, world: int) -> dict:
    out = {f"{s}_{m}": _scheme_train(s, m) for s in SUBSET_SCHEMES for m in MODES}
    # zero bubble: the replayed subsets' Linears run again in B, their weight gradients deferred to W like F's
    out.update({f"{s}_zb_{m}": _scheme_train(s, m, "zb") for s in SUBSET_SCHEMES for m in ("none", "full")})
    return out


def test_recompute_with_early_exit_and_mod_is_bitwise_exact():
    """The token-subset layers of early exit and Mixture-of-Depths recompute as the plain layers do
    (moebal/models/subset.py): every mode gives the losses and parameters of none, bit for bit."""
    results = run_ranks(_scheme_worker, 2, timeout_s=600.0)
    cases = [(f"{s}_none", f"{s}_{m}") for s in SUBSET_SCHEMES for m in MODES[1:]]
    cases += [(f"{s}_zb_none", f"{s}_zb_full") for s in SUBSET_SCHEMES]
    for ref_key, key in cases:
        assert results[0][key]["losses"] == results[0][ref_key]["losses"], key
        for r in results:
            a, b = r[ref_key]["state"], r[key]["state"]
            assert a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a), key
    # the subsets ran: tokens left (early exit) and the routed blocks kept half of them (mod)
    survival = [s for rec in results[-1]["early_exit_full"]["records"] for s in rec["survival"][2:]]
    assert sum(0 < s < 1 for s in survival) >= 4, survival
    assert all(rec["mod_capacity"] == 0.5 for rec in results[-1]["mod_full"]["records"])
