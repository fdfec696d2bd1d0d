"""Pipeline x expert parallelism on real gloo ranks (2 stages x 2 expert shards on 4 ranks).

Parity with the single-process model at the expert-parallel tests' tolerance (1e-5 relative; expert
gradients are summed in another order), and exact equality, bit for bit, between runs that differ only in
where the layers sit: forced migrations of MoE layers (their expert shards, AdamW state and placement
planners travel), planned rebalancing with the MoE routing cost, every dynamism scheme. One spawn of 4 ranks
runs every short training below.
"""

from __future__ import annotations

import math

import pytest
import torch

from moebal.config import Config, from_dict
from moebal.distributed.testing import run_ranks
from tests.distributed.test_pipeline import pipeline_cfg, reference_losses, runner_knobs


def moe_cfg(n_layers: int = 4, policy: str = "static", batch: int = 8, **moe: object) -> Config:
    return from_dict({
        "model": {"dim": 32, "n_layers": n_layers, "n_heads": 4, "n_kv_heads": 2, "ffn_dim": 64, "max_seq_len": 32},
        "moe": {"num_experts": 4, "top_k": 2, "expert_ffn_dim": 32, "kernel": "loop", "aux_loss_coef": 0.01,
                "z_loss_coef": 0.001, **moe},
        "data": {"seq_len": 16, "batch_size": batch, "max_bytes": 200_000},
        "train": {"steps": 6, "warmup_steps": 0, "lr": 1e-2, "eval_every": 0, "precision": "fp32"},
        "parallel": {"pp": 2, "ep": 2, "nproc": 4},
        # a fixed hardware profile: every run plans the same placements from the same counts
        "planner": {"policy": policy, "costs": "rtx3090", "hysteresis": 0.0}})


def _train(cfg: Config, steps: int, scheme: str = "none", options: dict | None = None, **opts: object) -> dict:
    from moebal.dynamism.scheme import build_dynamism
    from moebal.pipeline.runner import PipelineRunner

    dyn = build_dynamism(scheme, options or {}, cfg=cfg)
    if scheme == "pruning":
        dyn = _recording(dyn)
    runner = PipelineRunner(pipeline_cfg(cfg, opts), scheme=dyn, **runner_knobs(opts))
    out = runner.train(steps)
    return {"losses": [r["loss"] for r in out.records], "sizes": out.final_sizes, "records": out.records,
            "plans": out.plans, "pruned": getattr(dyn, "seen", None),
            "state": {k: v.numpy() for k, v in runner.full_state().items()}}


def _recording(scheme):
    """The pruning scheme, recording at each pruning step what each of its layers' prunable matrices held on this
    rank before it (this shard's rows of an expert matrix) and the masks it chose."""
    from moebal.dynamism.pruning import GradualPruning, prunable_params

    class Recording(GradualPruning):
        def prune(self, ctx, sparsity):
            layers = {i: prunable_params(ctx.stage.layer(i)) for i in ctx.stage.layer_ids}
            before = {i: {n: p.detach().numpy().copy() for n, p in ps} for i, ps in layers.items()}
            super().prune(ctx, sparsity)
            self.seen.append({"keep": round((1.0 - sparsity) * self.total), "shard": ctx.ep_index, "before": before,
                              "masks": {i: {n: m.numpy().copy() for n, m in self.masks[i].items()} for i in layers}})

    scheme.__class__ = Recording
    scheme.seen = []
    return scheme


SCHEMES = {
    "early_exit": {"threshold": 0.9, "first_layer": 1, "start": 1},  # nearly every token leaves after layer 1
    "mod": {"capacity": 0.5, "every": 2, "first_layer": 1},
    "freezing": {"threshold": 0.5, "check_every": 2, "max_fraction": 0.5},
    "moe": {},
    # the global top-k counts each expert shard's rows once and every dense matrix once per stage; the CSR kernel
    # (`auto` picks kernels by a timing race: runs then differ in the last bits, docs/dynamism.md)
    "pruning": {"start": 0, "every": 2, "steps": 2, "final_sparsity": 0.8, "kernel": "csr"},
}


def _skip_one_side(rank: int, world: int) -> dict:
    """One expert-parallel rank has no token left for an MoE layer (early exit), its peer has some: the empty
    rank still joins the all-to-alls and the statistics all-reduce, forward and backward."""
    import copy

    import torch.distributed as dist
    from torch import nn

    from moebal.distributed.expert_parallel import ExpertParallel, is_expert_param
    from moebal.distributed.groups import ParallelDims
    from moebal.dynamism.early_exit import pack_positions
    from moebal.models.subset import skip_layer, subset_block
    from moebal.models.transformer import DecoderLayer, Rotary

    class One(nn.Module):
        def __init__(self, layer: nn.Module) -> None:
            super().__init__()
            self.layer = layer

        def moe_layers(self) -> list[nn.Module]:
            return [self.layer.block_sparse_moe]

    cfg = moe_cfg()
    dims = ParallelDims(world_size=world, rank=rank, ep=2, pp=2).init()
    torch.manual_seed(0)
    ref = DecoderLayer(cfg, 0)
    layer = copy.deepcopy(ref)
    ExpertParallel(One(layer), dims)
    cos, sin = Rotary(cfg.head_dim, 32, cfg.model.rope_theta)(8, torch.float32)
    g = torch.Generator().manual_seed(1)
    h, w = torch.randn(2, 8, 32, generator=g), torch.randn(2, 8, 32, generator=g)
    active = torch.rand(2, 8, generator=g) < 0.5
    pos, valid = pack_positions(active)
    if dims.index("ep") == 0:
        out = skip_layer(layer, h)
    else:
        out = subset_block(layer, h, cos, sin, pos, valid, keys="all")
    ((out * w).sum() + layer.block_sparse_moe.aux_loss / 2).backward()
    grads = {}
    for name, p in layer.named_parameters():
        grad = p.grad if p.grad is not None else torch.zeros_like(p)  # attention: nothing ran on the empty rank
        if not is_expert_param(p):
            dist.all_reduce(grad, group=dims.group("ep"))
        grads[name] = grad.clone()
    ref_out = subset_block(ref, h, cos, sin, pos, valid, keys="all")
    ((ref_out * w).sum() + ref.block_sparse_moe.aux_loss).backward()
    worst = 0.0
    half = slice(2 * dims.index("ep"), 2 * dims.index("ep") + 2)
    for name, p in ref.named_parameters():
        rg = p.grad[half] if ".experts.w" in name else p.grad
        worst = max(worst, float((grads[name] - rg).norm() / rg.norm().clamp(min=1e-12)))
    return {"grad": worst, "same_out": bool(torch.equal(out, h)) if dims.index("ep") == 0 else True}


def _coarse_layer(i: int) -> list[torch.Tensor]:
    """Layer i's prunable matrices: dense, expert-stacked (4 experts), dense; coarse values, many ties."""
    g = torch.Generator().manual_seed(i)
    return [torch.randint(-3, 4, (3, 4), generator=g).float(), torch.randint(-3, 4, (4, 2, 3), generator=g).float(),
            torch.randint(-3, 4, (5,), generator=g).float()]


def _sharded_topk(rank: int, world: int) -> dict:
    """`distributed_keep_masks` over 2 stages (layers 0-1 | 2-4) x 2 expert shards (rank = 2 x stage + shard),
    each shard holding 2 of the 4 experts' rows."""
    import torch.distributed as dist

    from moebal.dynamism.pruning import ExpertShards, distributed_keep_masks
    from moebal.pipeline.p2p import PipeChain

    stage, shard = divmod(rank, 2)
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]

    def shard_sum(v: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(v, group=groups[stage])
        return v

    chain = PipeChain([shard, 2 + shard], rank)
    mine = {i: [m[2 * shard:2 * shard + 2] if m.dim() == 3 else m for m in _coarse_layer(i)]
            for i in range(5) if (i < 2) == (stage == 0)}
    shards = ExpertShards(index=shard, count=2, width=3, stacked={i: [False, True, False] for i in mine},
                          sum=shard_sum)
    return {keep: {i: [m.numpy() for m in ms] for i, ms in distributed_keep_masks(mine, keep, chain, 5,
                                                                                   shards).items()}
            for keep in (0, 9, 70, 131, 205)}


def _four_ranks(rank: int, world: int) -> dict:
    static, prophet = moe_cfg(), moe_cfg(policy="broadcast_topk")
    six = moe_cfg(n_layers=6, policy="broadcast_topk")
    moves = ((1, (4, 2)), (2, (1, 5)), (4, (5, 1)))
    out = {
        "skip": _skip_one_side(rank, world),
        "topk": _sharded_topk(rank, world),
        "static": _train(static, 4, micro_batches=2),
        "placed": _train(prophet, 4, micro_batches=2),
        "six": _train(six, 5, micro_batches=2),
        "six_forced": _train(six, 5, micro_batches=2, force=moves, force_mid=((3, (2, 4)),)),
    }
    for name, options in SCHEMES.items():
        out[f"{name}_static"] = _train(six, 5, name, options, micro_batches=2)
        out[f"{name}_forced"] = _train(six, 5, name, options, micro_batches=2, force=moves)
    # a forced lopsided partition after step 1 (layer 0 alone on the first stage) that the planner must undo
    out["moe_partition"] = _train(six, 5, "moe", micro_batches=2, rebalance="partition", every=2, min_gain=0.0,
                                  bandwidth=1e15, latency=0.0, force=((1, (1, 5)),))
    return out


@pytest.fixture(scope="module")
def four() -> list[dict]:
    return run_ranks(_four_ranks, 4)


def _merge(states: list[dict]) -> dict[str, torch.Tensor]:
    """Full-model parameters from the ranks' stages: replicated tensors once, expert shards concatenated."""
    out: dict[str, list[torch.Tensor]] = {}
    for s in states:
        for k, v in s.items():
            out.setdefault(k, []).append(torch.from_numpy(v))
    merged = {}
    for k, vs in out.items():
        if ".experts.w" in k:
            merged[k] = torch.cat(vs)  # ranks in order: expert index innermost
        else:
            assert all(torch.equal(vs[0], v) for v in vs[1:]), f"{k} differs between ranks that replicate it"
            merged[k] = vs[0]
    return merged


def test_pipeline_x_expert_parallel_matches_single_process(four):
    # a stage's 2 ranks split each of the 2 micro-batches' rows and sum its routing statistics: the same maths as
    # accumulating the batch's 2 micro-batches in one process
    ref, ref_state = reference_losses(moe_cfg(), 4, micro=2)
    for case in ("static", "placed"):
        got = four[0][case]["losses"]
        assert all(r[case]["losses"] == got for r in four)  # every rank reports the same loss
        assert all(math.isclose(a, b, rel_tol=1e-5) for a, b in zip(got, ref)), (case, got, ref)
        state = _merge([r[case]["state"] for r in four])
        assert set(state) == set(ref_state)
        for k, v in ref_state.items():
            torch.testing.assert_close(state[k], v, rtol=1e-4, atol=1e-5, msg=f"{case}: {k}")
    replicas = [sum(r["replicas"]) for r in four[0]["placed"]["records"]]
    assert replicas[0] == 0 and sum(replicas) > 0, replicas  # Trans/Agg of replicated experts ran


def test_forced_migrations_of_expert_shards_keep_the_losses_bit_for_bit(four):
    base = four[0]["six"]
    forced = four[0]["six_forced"]
    assert forced["losses"] == base["losses"]
    assert all(r["six_forced"]["sizes"] == [5, 1] for r in four)
    a = _merge([r["six"]["state"] for r in four])
    b = _merge([r["six_forced"]["state"] for r in four])
    for k in a:
        assert torch.equal(a[k], b[k]), k
    moved = [r for r in forced["records"] if r.get("migration")]
    assert [m["layers_moved"] for m in moved] == [1, 3, 1, 3]
    assert all(r["replicas"] == b2["replicas"] for r, b2 in zip(forced["records"], base["records"]))


def test_every_scheme_under_expert_parallelism_migrates_and_keeps_the_losses(four):
    for name in SCHEMES:
        static, forced = four[0][f"{name}_static"], four[0][f"{name}_forced"]
        assert forced["losses"] == static["losses"], name
        assert all(math.isfinite(x) for x in static["losses"]), name
    survival = four[0]["early_exit_forced"]["records"][-1]["survival"]
    assert survival[1] == 1.0 and survival[-1] == 0.0  # MoE layers ran on no token of a stage's ranks
    assert four[0]["freezing_forced"]["records"][-1]["frozen_layers"] >= 1
    assert min(four[0]["mod_forced"]["records"][-1]["predicted_cost"]) < 1.0
    assert max(four[0]["moe_forced"]["records"][-1]["predicted_cost"]) > 1.0  # routing imbalance is seen


def test_the_global_top_k_over_expert_shards_equals_the_single_process_one_with_its_ties(four):
    from moebal.dynamism.pruning import global_magnitude_masks

    layers = [_coarse_layer(i) for i in range(5)]
    for keep in (0, 9, 70, 131, 205):  # 205 of 205: all
        ref = global_magnitude_masks(layers, keep)
        for i in range(5):
            held = [r["topk"][keep][i] for r in four if i in r["topk"][keep]]
            assert len(held) == 2  # both shards of the stage
            got = [torch.from_numpy(held[0][0]), torch.cat([torch.from_numpy(h[1]) for h in held]),
                   torch.from_numpy(held[0][2])]
            assert all((h[j] == held[0][j]).all() for h in held for j in (0, 2))  # dense masks alike
            for g, r in zip(got, ref[i]):
                assert torch.equal(g, r), (keep, i)


def test_pruning_over_expert_shards_keeps_the_single_process_top_k(four):
    """pp 2 x ep 2 pruning: at each pruning step the kept set over every stage and expert shard is the single
    process's global top-k of the whole model's matrices (ties in model order), every rank predicts the same
    layer costs, and the pruned weights stay zero."""
    from moebal.dynamism.pruning import global_magnitude_masks

    events = [r["pruning_static"]["pruned"] for r in four]
    assert [len(e) for e in events] == [2, 2, 2, 2]  # steps 2 and 4
    for k in range(2):
        seen = [e[k] for e in events]
        keep = seen[0]["keep"]
        layers = sorted({i for s in seen for i in s["before"]})
        full, kept = [], []
        for i in layers:
            held = sorted((s for s in seen if i in s["before"]), key=lambda s: s["shard"])
            assert [s["shard"] for s in held] == [0, 1]
            names = list(held[0]["before"][i])
            for field, out in (("before", full), ("masks", kept)):
                # an expert matrix is its shards' rows in order; every shard holds the same dense matrix and mask
                out.append([torch.cat([torch.from_numpy(s[field][i][n]) for s in held]) if ".experts.w" in n
                            else torch.from_numpy(held[0][field][i][n]) for n in names])
            for n in names:
                if ".experts.w" not in n:
                    assert all((s["masks"][i][n] == held[0]["masks"][i][n]).all() for s in held), (i, n)
        ref = global_magnitude_masks(full, keep)
        assert sum(int(m.sum()) for ms in kept for m in ms) == keep
        for i, (got, want) in enumerate(zip(kept, ref)):
            for g, w in zip(got, want):
                assert torch.equal(g.bool(), w), (k, layers[i])
    preds = [r["pruning_static"]["records"][-1]["predicted_cost"] for r in four]
    assert all(p == preds[0] for p in preds)
    density = four[0]["pruning_static"]["records"][-1]["layer_density"]
    assert all(abs(d - 0.2) < 0.1 for d in density), density  # the global 80 % spread over the layers
    from moebal.dynamism.pruning import _PRUNABLE_SUFFIXES

    state = _merge([r["pruning_static"]["state"] for r in four])
    prunable = [v for k, v in state.items() if k.endswith(_PRUNABLE_SUFFIXES)]
    # the target counts the whole model's matrices, every expert, though a rank builds only its shard's rows
    assert events[0][-1]["keep"] == round((1.0 - 0.8) * sum(v.numel() for v in prunable))
    assert sum(int((v != 0).sum()) for v in prunable) == events[0][-1]["keep"]  # after 1 more optimizer step


def test_an_expert_parallel_rank_without_tokens_joins_its_peers(four):
    for r in four:
        assert r["skip"]["grad"] < 1e-5 and r["skip"]["same_out"], r["skip"]



def test_rebalancing_with_the_moe_routing_cost_plans_every_step_and_keeps_the_losses(four):
    run, off = four[0]["moe_partition"], four[0]["moe_static"]
    assert run["losses"] == off["losses"]
    assert any(r.get("migration") == "partition" for r in run["records"])  # the planner undid the forced cut
    steps = [p["step"] for p in run["plans"]]
    assert steps == [2, 3, 4, 5], steps  # profiled at 2 and 4, planned after every step from the first profile
    # between profiles the costs follow the routing: step 3's plan is step 2's profile x step 3's prediction
    p2, p3 = run["plans"][0]["meta"]["costs"], run["plans"][1]["meta"]["costs"]
    f2, f3 = (run["records"][s - 1]["predicted_cost"] for s in (2, 3))
    kappa = run["plans"][0]["meta"]["kappa"] / run["plans"][1]["meta"]["kappa"]
    for i in range(6):
        assert math.isclose(p3[i] * f2[i] * kappa, p2[i] * f3[i], rel_tol=1e-3), (i, p2, p3, f2, f3)


def test_the_moe_routing_cost_prices_the_placement_the_step_ran(four):
    """Under a replicating policy (broadcast_topk here) the moe scheme prices each MoE layer at its busiest rank's
    rows under the placement the step ran (`observe_placement`), not under the experts' owners: without capacity
    drops the factor is (other + ffn x imbalance) / (other + ffn), with the record's `rank_imbalance_after`."""
    from moebal.dynamism.scheme import layer_token_flops

    cfg = moe_cfg(n_layers=6, policy="broadcast_topk")
    run = four[0]["moe_static"]
    moe_ids = [i for i in range(6) if cfg.is_moe_layer(i)]
    replicas_helped = 0
    for r in run["records"]:
        for n, i in enumerate(moe_ids):
            f = layer_token_flops(cfg, i, cfg.data.seq_len)
            other = f["q_o"] + f["kv"] + f["attn"]
            after, before = r["rank_imbalance_after"][n], r["rank_imbalance_before"][n]
            want = (other + f["ffn"] * after) / (other + f["ffn"])
            assert math.isclose(r["predicted_cost"][i], want, rel_tol=1e-3), (r["step"], i, r["predicted_cost"], want)
            replicas_helped += after < before - 1e-3
    assert replicas_helped >= 2  # the placement's imbalance is not the owners' in this run
