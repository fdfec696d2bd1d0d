"""Lina's inference scheduling (moebal/distributed/lina_inference.py) on gloo ranks: the outputs of every policy
equal plain expert parallelism's and the single-process model's; skewed routing gets replicas and re-plans."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.distributed as dist

from moebal.config import from_dict
from moebal.distributed.lina_inference import MIN_ROWS, LinaInference
from moebal.distributed.testing import run_ranks
from moebal.models import build_model
from moebal.planner.paths import PathProfile, build_profile

E, L = 8, 4


def _model(top_k: int) -> torch.nn.Module:
    cfg = from_dict({
        "model": {"dim": 32, "n_layers": L, "n_heads": 4, "n_kv_heads": 2, "ffn_dim": 48, "max_seq_len": 16},
        "moe": {"num_experts": E, "top_k": top_k, "expert_ffn_dim": 24},
        "data": {"seq_len": 16},
    })
    torch.manual_seed(0)
    model = build_model(cfg).eval()
    for i, layer in enumerate(model.moe_layers()):  # skew: a different hot expert per layer
        bias = -2.0 * torch.log1p(torch.roll(torch.arange(E, dtype=torch.float32), i * 3))
        layer.expert_bias = bias
    return model


def _ids(rows: int) -> torch.Tensor:
    return torch.randint(0, 256, (rows, 16), generator=torch.Generator().manual_seed(1))


def _profile(model: torch.nn.Module) -> PathProfile:
    with torch.no_grad():
        model(torch.randint(0, 256, (16, 16), generator=torch.Generator().manual_seed(2)))
    ids = np.stack([layer.last_routing.indices_TK.numpy() for layer in model.moe_layers()])
    return build_profile([ids], E, path_len=3)


def _check(rank: int, world: int, top_k: int) -> dict[str, object]:
    model = _model(top_k)
    ids = _ids(2 * world)
    small_ids = ids[2 * rank:2 * rank + 1, :4]
    with torch.no_grad():
        ref = model(ids).logits[2 * rank:2 * rank + 2]
        small_ref = model(small_ids).logits
    prof = _profile(model)
    out, recs = {}, {}
    slept = 0.0
    # min_rows 0: the thesis's allocation, replicas at any size (these batches are 64 tokens in all); "... at
    # min_rows": the default, where no holder takes fewer than MIN_ROWS of an expert's rows
    for policy in ("static", "lina", "phase1", "oracle", "lina on emulated devices", "lina at min_rows",
                   "oracle at min_rows"):
        name = policy.split()[0]
        sched = LinaInference(model, dist.group.WORLD, name, prof if name in ("lina", "phase1") else None,
                              dilate=2.0 if "emulated" in policy else 1.0,
                              min_rows=MIN_ROWS if "min_rows" in policy else 0)
        sched.begin()
        with torch.no_grad():
            out[policy] = model(ids[2 * rank:2 * rank + 2]).logits
        recs[policy] = list(sched.records)
        slept += sched.clock.slept_s if "emulated" in policy else 0.0
    static = out["static"]
    small = _small_batch(model, prof, small_ids, small_ref)
    # layer 0's marginal stays whole
    truncated = LinaInference(model, dist.group.WORLD, "lina", prof, truncate=1, min_rows=0)
    whole = prof.estimate(np.zeros((1, 0), dtype=np.int64), 0)
    # (under top-k, k >= 2, the marginal has k experts or more, so a truncation to 1 would differ)
    first_whole = bool(np.array_equal(truncated.first_est, whole)) and (top_k == 1 or (whole > 0).sum() > 1)
    # a profile recorded at top-2 serving top-1: its estimates are scaled to the served assignments (one a token)
    two = build_profile([np.random.default_rng(3).permuted(np.tile(np.arange(E), (L, 16, 1)), axis=2)[:, :, :2]],
                        E, path_len=3)
    scaled = LinaInference(model, dist.group.WORLD, "lina", two, min_rows=0)
    one_token = float(scaled.first_est.sum()) if top_k == 1 else None
    # a layer's parts (experts, planning, time inside the collectives) are disjoint spans of its time
    parts_ok = all(r.exchange_s > 0 and r.experts_s + r.plan_s + r.exchange_s <= r.seconds
                   for rs in recs.values() for r in rs)
    return {"parts_ok": parts_ok, "first_whole": first_whole, "vs_ref": (static - ref).abs().max().item(),
            "vs_static": {p: (o - static).abs().max().item() for p, o in out.items()},
            "equal": {p: bool(torch.equal(o, static)) for p, o in out.items()},
            "replicas": {p: sum(r.replicas for r in rs) for p, rs in recs.items()},
            "replans": {p: sum(r.replanned for r in rs) for p, rs in recs.items()},
            "layer0": {p: (rs[0].replicas, rs[0].estimate_hit, rs[0].rank_rows) for p, rs in recs.items()},
            "static_rows": [r.rank_rows for r in recs["static"]], "oracle_rows": [r.rank_rows for r in recs["oracle"]],
            "slept": slept, "small": small, "one_token": one_token}


def _small_batch(model: torch.nn.Module, prof: PathProfile, ids: torch.Tensor,
                 ref: torch.Tensor) -> dict[str, object]:
    """A batch whose assignments over every rank fill no MIN_ROWS group (4 tokens a rank, as a decode step of
    4 sequences: 8 or 32 assignments here) under each policy at the default least share: its outputs (against
    each other and the single-process model's `ref`), its layers' records and the layers the path estimate was
    asked for."""
    asked: list[int] = []
    estimate = PathProfile.estimate

    def counted(self: PathProfile, paths: np.ndarray, layer: int, **kw: object) -> np.ndarray:
        asked.append(layer)
        return estimate(self, paths, layer, **kw)  # type: ignore[arg-type]

    out, recs, layers_asked = {}, {}, {}
    for policy in ("static", "lina", "phase1", "oracle"):
        sched = LinaInference(model, dist.group.WORLD, policy, prof if policy in ("lina", "phase1") else None)
        PathProfile.estimate = counted  # type: ignore[method-assign]
        try:
            sched.begin()
            with torch.no_grad():
                out[policy] = model(ids).logits
        finally:
            PathProfile.estimate = estimate  # type: ignore[method-assign]
        recs[policy] = [(r.replicas, r.replanned, r.estimate_hit, r.rank_rows) for r in sched.records]
        layers_asked[policy], asked[:] = list(asked), []
    return {"equal": all(torch.equal(o, out["static"]) for o in out.values()), "records": recs,
            "asked": layers_asked, "vs_ref": (out["static"] - ref).abs().max().item()}


@pytest.mark.parametrize("world,top_k", [(2, 1), (4, 2)])
def test_policies_give_the_static_outputs(world: int, top_k: int) -> None:
    res = run_ranks(_check, world, top_k, timeout_s=300)
    for r in res:
        assert r["vs_ref"] < 1e-5, r  # plain expert parallelism = the single-process model
        assert all(r["equal"].values()), r  # scheduling only moves work: bit for bit the static outputs
        assert r["replicas"]["oracle"] > 0 and r["replicas"]["lina"] > 0, r  # skewed: replicas were made
        # ... but none of an expert under MIN_ROWS rows a holder: 2 ranks' 64 top-1 tokens have no expert that
        # fills two; 4 ranks' 256 top-2 assignments may
        at_min = (r["replicas"]["lina at min_rows"], r["replicas"]["oracle at min_rows"])
        assert at_min == (0, 0) if world == 2 else at_min[0] <= r["replicas"]["lina"], r
        assert at_min[1] <= r["replicas"]["oracle"], r
        assert r["replans"]["static"] == 0 and r["replans"]["phase1"] == 0
        assert r["slept"] > 0  # emulated devices: compute spans stretched, outputs unchanged (in "equal" above)
        assert top_k != 1 or r["one_token"] == pytest.approx(1.0), r  # not 2: the profile's k
        # layer 0 has no path: lina plans it from the profile's marginal, the oracle from its real counts
        assert r["first_whole"] and r["parts_ok"]
        assert r["layer0"]["lina"][0] > 0 and r["layer0"]["oracle"][0] > 0, r["layer0"]
        assert r["layer0"]["lina"][1] is not None and r["layer0"]["static"] == (0, None, r["layer0"]["static"][2])
        # a batch too small to fill a MIN_ROWS group runs static's blocks unplanned under every policy: no
        # replica, no re-plan, no estimate compared; the estimate is asked for once (during layer 0, for layer 1,
        # before the batch's size over every rank is known), then never
        small = r["small"]
        assert small["equal"] and small["vs_ref"] < 1e-5, small  # (unpadded: the groups are alike everywhere)
        assert all(recs == small["records"]["static"] for recs in small["records"].values()), small
        assert all(rec[:3] == (0, False, None) for rec in small["records"]["lina"]), small
        assert small["asked"] == {"static": [], "lina": [1], "phase1": [1], "oracle": []}, small
    # the oracle's rank loads are flatter than static placement's on the skewed layers
    worst = lambda rows: max(max(x) / (sum(x) / len(x)) for x in rows)  # noqa: E731
    assert worst(res[0]["oracle_rows"]) < worst(res[0]["static_rows"])
