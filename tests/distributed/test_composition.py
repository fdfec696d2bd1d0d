"""The balancers compose (docs/training.md, "Combination matrix"): the layer balancer's closed loop, and planned
micro-batches under layer rebalancing, on real gloo ranks. Work-moving keeps the losses.

Each cell runs 4 to 8 steps of a tiny model on 2 ranks (one spawn for the module) beside the same run without
the balancer.
"""

from __future__ import annotations

import functools
import math

import numpy as np
import pytest

from moebal.config import Config
from moebal.distributed.testing import run_ranks

from .test_microbatching import docs, write_samples
from .test_pipeline import SCHEMES, pipeline_cfg, runner_knobs, tiny
from .test_pipeline_ep import SCHEMES as EP_SCHEMES
from .test_pipeline_ep import moe_cfg

SKEWED = np.array([10.0, 1.0, 1.0, 1.0])
"""Injected unit costs: layer 0 looks ten times dearer, so the planner moves layers 1-3 off stage 0 ([1, 3])."""
PLAN = {"rebalance": "partition", "every": 2, "bandwidth": 1e15, "latency": 0.0, "min_gain": 0.0}


def _feedback_run(steps: int, slower: bool | None, scheme: str = "none", cfg: Config | None = None,
                  **opts: object) -> dict:
    """A run whose planner sees `SKEWED` costs (layer 0 dear: on 2 stages of 4 layers it proposes [1, 3]) and
    whose measured iteration time is 1 s on the initial partition and 2 s (`slower`) or 0.5 s on any other;
    `slower=None`: no balancer. `opts`: `pipeline.feedback` settings."""
    from moebal.balance.feedback import FeedbackConfig
    from moebal.dynamism.scheme import build_dynamism
    from moebal.pipeline.runner import PipelineRunner

    cfg = cfg or tiny(n_layers=4, pp=2, moe=4 if scheme == "moe" else 0)
    dyn = build_dynamism(scheme, SCHEMES.get(scheme, {}), cfg=cfg)
    options = {"micro_batches": 2, **(PLAN if slower is not None else {}),
               "feedback": FeedbackConfig(**{"enabled": True, **opts})}  # type: ignore[arg-type]
    runner = PipelineRunner(pipeline_cfg(cfg, options), scheme=dyn, **runner_knobs(options))
    bal = runner.balancer
    bal.costs = lambda: np.resize(SKEWED, runner.U)  # type: ignore[method-assign]
    start = list(runner.sizes)
    bal.iteration_time = lambda red: 1.0 if runner.sizes == start else (2.0 if slower else 0.5)  # type: ignore
    out = runner.train(steps)
    return {"losses": [r["loss"] for r in out.records], "sizes": out.final_sizes, "plans": out.plans,
            "migrations": [(r["step"], r["migration"], r["sizes_after"]) for r in out.records if "migration" in r]}


def _planned_run(steps: int, rebalance: str = "off", moe: int = 0, cfg: Config | None = None, scheme: str = "none",
                 every: int = 2, **opts: object) -> dict:
    """DynaPipe micro-batches (analytic costs, inline planning) on the corpus of test_microbatching.py; the layer
    balancer profiles every `every` steps."""
    import dataclasses

    from moebal.dynamism.scheme import build_dynamism
    from moebal.pipeline.planned import PlannedPipelineRunner

    cfg = cfg or docs(moe=moe)
    cfg = dataclasses.replace(cfg, pipeline=dataclasses.replace(cfg.pipeline, rebalance=rebalance, every=every,
                                                                min_gain=0.0))
    runner = PlannedPipelineRunner(pipeline_cfg(cfg, opts), **runner_knobs(opts),
                                   scheme=build_dynamism(scheme, SCHEMES.get(scheme, {}), cfg=cfg))
    out = runner.train(steps)
    return {"losses": [r["loss"] for r in out.records], "sizes": out.final_sizes, "dilate": runner.engine.dilate,
            "migrations": [(r["step"], r["migration"]) for r in out.records if "migration" in r]}


def _merge(a: dict, b: dict) -> dict:
    out = dict(a)
    for k, v in b.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def _two_ranks(rank: int, world: int, path: str) -> dict:
    from .test_microbatching import SAMPLES

    SAMPLES["path"] = path
    return {
        "static": _feedback_run(8, None),
        "reverted": _feedback_run(8, True, window=2, hold=2),
        "kept": _feedback_run(8, False, window=2, hold=2),
        "open_loop": _feedback_run(8, True, enabled=False),
        **{f"{scheme}_{case}": _feedback_run(6, slower, scheme)
           for scheme in ("moe", "freezing", "pruning") for case, slower in (("static", None), ("partition", False))},
        "planned_static": _planned_run(4, dilate=1.25),  # an emulated slower device: the same losses
        "planned_rebalance": _planned_run(4, "partition", bandwidth=1e15, latency=0.0, force=((2, (1, 3)),)),
        "planned_moe_static": _planned_run(4, moe=4),
        "planned_moe_rebalance": _planned_run(4, "diffusion", moe=4, bandwidth=1e15, latency=0.0,
                                              force=((2, (3, 1)),)),
    }


def _four_ranks(rank: int, world: int) -> dict:
    import torch.distributed as dist

    ep = moe_cfg()  # 2 stages x 2 expert shards
    runs = {"ep_static": lambda: _feedback_run(4, None, cfg=ep),
            "ep_partition": lambda: _feedback_run(4, False, cfg=ep),
            "ep_moe_static": lambda: _feedback_run(6, None, "moe", cfg=ep),
            "ep_moe_reverted": lambda: _feedback_run(6, True, "moe", cfg=ep, window=2, hold=8)}
    for scheme in ("early_exit", "mod", "freezing", "pruning"):
        runs[f"ep_{scheme}_static"] = functools.partial(_feedback_run, 4, None, scheme, ep)
        runs[f"ep_{scheme}_partition"] = functools.partial(_feedback_run, 4, False, scheme, ep)
    for scheme in ("moe", "mod", "freezing", "pruning"):
        pp4 = tiny(n_layers=8, pp=4, nproc=4, moe=4 if scheme == "moe" else 0)
        runs[f"pp4_{scheme}_static"] = functools.partial(_feedback_run, 4, None, scheme, pp4)
        runs[f"pp4_{scheme}_repack"] = functools.partial(_repack_run, pp4, scheme)
    out = {}
    for name, run in runs.items():
        out[name] = run()
        dist.barrier()  # released ranks wait here until the survivors have finished the run
    return out


def _repack_run(cfg: Config, scheme: str) -> dict:
    """Rebalancing and planned re-packing (a slack that accepts any pack) under `scheme`."""
    from moebal.dynamism.scheme import build_dynamism
    from moebal.pipeline.runner import PipelineRunner

    options = {"micro_batches": 2, "repack": True, "repack_slack": 100.0, **PLAN}
    runner = PipelineRunner(pipeline_cfg(cfg, options), **runner_knobs(options),
                            scheme=build_dynamism(scheme, SCHEMES.get(scheme, {}), cfg=cfg))
    out = runner.train(4)
    return {"losses": [r["loss"] for r in out.records], "sizes": out.final_sizes, "released": out.released,
            "plans": out.plans}


@pytest.fixture(scope="module")
def two(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    path = write_samples(str(tmp_path_factory.mktemp("samples") / "samples.jsonl"))
    return run_ranks(_two_ranks, 2, path)


def test_a_partition_that_measures_slower_is_reverted_with_the_same_losses(two):
    static, run = two[0]["static"], two[0]["reverted"]
    assert run["losses"] == static["losses"] and two[1]["reverted"]["losses"] == static["losses"]
    # adopted at 2, judged after a 2-step trial and migrated back at 4; held 2 steps (no plan at 4); tried
    # again at 6 (base window refilled), reverted at 8
    assert run["migrations"] == [(2, "partition", [1, 3]), (4, "feedback-revert", [2, 2]),
                                 (6, "partition", [1, 3]), (8, "feedback-revert", [2, 2])]
    assert run["sizes"] == [2, 2]
    verdicts = [p for p in run["plans"] if p["balancer"] == "feedback"]
    assert [v["meta"]["action"] for v in verdicts] == ["reverted", "reverted"]
    first = verdicts[0]
    assert first["sizes"] == [2, 2] and first["meta"]["trial_sizes"] == [1, 3] and first["meta"]["adopted_at"] == 2
    assert first["meta"]["predicted_gain"] > 0 > first["meta"]["measured_gain"]  # predicted faster, measured slower
    assert first["meta"]["base_s"] == 1.0 and first["meta"]["plan_s"] == 2.0 and first["meta"]["hold"] == 2
    assert [v["meta"]["hold"] for v in verdicts] == [2, 4]  # doubled after the second failure


def test_a_partition_that_pays_is_kept_and_the_open_loop_never_reverts(two):
    static = two[0]["static"]["losses"]
    kept = two[0]["kept"]
    assert kept["losses"] == static and kept["sizes"] == [1, 3]
    assert kept["migrations"] == [(2, "partition", [1, 3])]
    [verdict] = [p for p in kept["plans"] if p["balancer"] == "feedback"]
    assert verdict["meta"]["action"] == "kept" and verdict["meta"]["measured_gain"] == 0.5
    open_loop = two[0]["open_loop"]
    assert open_loop["losses"] == static and open_loop["sizes"] == [1, 3]
    assert not [p for p in open_loop["plans"] if p["balancer"] == "feedback"]


def test_planned_micro_batches_compose_with_layer_rebalancing(two):
    static, run = two[0]["planned_static"], two[0]["planned_rebalance"]
    assert run["migrations"][0] == (2, "forced")  # layers moved under planned micro-batches
    assert all(r["planned_rebalance"]["losses"] == run["losses"] for r in two)  # every rank agrees
    # the plans after the move are costed on the new partition: the same samples, maybe split otherwise, so
    # the loss per token is equal up to the order of the sums
    assert all(math.isclose(a, b, rel_tol=1e-6) for a, b in zip(run["losses"], static["losses"])), \
        (run["losses"], static["losses"])
    assert run["losses"][:2] == static["losses"][:2]  # before the move: bit for bit
    # pipeline.dilate reaches the planned engine (it once stayed on the engine the planned one replaced)
    assert static["dilate"] == 1.25 and run["dilate"] == 1.0


def test_every_scheme_s_partition_under_the_closed_loop_keeps_the_losses(two):
    for scheme in ("moe", "freezing", "pruning"):
        static, run = two[0][f"{scheme}_static"], two[0][f"{scheme}_partition"]
        assert run["losses"] == static["losses"], scheme
        assert run["migrations"][0] == (2, "partition", [1, 3]) and run["sizes"] == [1, 3], scheme
        assert [p["meta"]["action"] for p in run["plans"] if p["balancer"] == "feedback"] == ["kept"], scheme


def test_planned_moe_micro_batches_compose_with_diffusion(two):
    static, run = two[0]["planned_moe_static"], two[0]["planned_moe_rebalance"]
    assert run["migrations"][0] == (2, "forced")
    assert run["losses"][:2] == static["losses"][:2]
    assert all(math.isclose(a, b, rel_tol=1e-6) for a, b in zip(run["losses"], static["losses"])), \
        (run["losses"], static["losses"])


@pytest.fixture(scope="module")
def four() -> list[dict]:
    return run_ranks(_four_ranks, 4)


def _planned_ep_ranks(rank: int, world: int, path: str) -> dict:
    """2 stages x 2 expert shards with routing losses: planned micro-batches in lockstep, with and without a
    forced migration, without a scheme and with the MoE routing cost."""
    from .test_microbatching import SAMPLES

    SAMPLES["path"] = path
    cfg = docs(nproc=4, moe=4, ep=2, z=1e-3, max_tokens=96)
    out = {}
    for scheme in ("none", "moe"):
        out[f"{scheme}_static"] = _planned_run(4, cfg=cfg, scheme=scheme)
        # no profile within the 4 steps (every 8): only the forced move, since a partition adopted from measured
        # times would plan the later batches' micro-batches on another stage table than the static run's
        out[f"{scheme}_partition"] = _planned_run(4, "partition", cfg=cfg, scheme=scheme, every=8, bandwidth=1e15,
                                                  latency=0.0, force=((2, (1, 3)),))
    return out


@pytest.fixture(scope="module")
def planned_ep(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    path = write_samples(str(tmp_path_factory.mktemp("samples") / "samples.jsonl"))
    return run_ranks(_planned_ep_ranks, 4, path, timeout_s=300)  # 4 short runs: a loaded host needs the time


def test_expert_parallel_stages_under_the_layer_balancer_keep_the_losses(four):
    for scheme in ("none", "early_exit", "mod", "freezing", "pruning"):
        prefix = "ep" if scheme == "none" else f"ep_{scheme}"
        kept = four[0][f"{prefix}_partition"]
        assert kept["losses"] == four[0][f"{prefix}_static"]["losses"] and kept["sizes"] == [1, 3], scheme
        assert all(r[f"{prefix}_partition"]["losses"] == kept["losses"] for r in four), scheme
    reverted = four[0]["ep_moe_reverted"]
    assert reverted["losses"] == four[0]["ep_moe_static"]["losses"]
    assert [m[:2] for m in reverted["migrations"]] == [(2, "partition"), (4, "feedback-revert")]
    held = [p for p in reverted["plans"] if p["step"] == 5 and p["balancer"] == "partition"]
    assert held and held[0]["meta"]["held"] and not held[0]["meta"]["adopt"]  # the MoE cost re-plans each step


def test_planned_micro_batches_on_expert_parallel_stages_compose_with_layer_rebalancing(planned_ep):
    """pp 2 x ep 2, planned micro-batches in lockstep, a forced migration of expert-sharded layers at step 2,
    without a scheme and with the MoE routing cost."""
    for scheme in ("none", "moe"):
        static, run = planned_ep[0][f"{scheme}_static"], planned_ep[0][f"{scheme}_partition"]
        assert run["migrations"][0] == (2, "forced"), scheme  # expert-sharded layers moved
        assert all(r[f"{scheme}_partition"]["losses"] == run["losses"] for r in planned_ep), scheme
        assert run["losses"][:2] == static["losses"][:2], scheme  # before the move: bit for bit
        assert all(math.isclose(a, b, rel_tol=1e-6) for a, b in zip(run["losses"], static["losses"])), \
            (scheme, run["losses"], static["losses"])


def test_repacking_under_every_scheme_releases_ranks_and_keeps_the_losses(four):
    for scheme in ("moe", "mod", "freezing", "pruning"):
        static = four[0][f"pp4_{scheme}_static"]["losses"]
        runs = [r[f"pp4_{scheme}_repack"] for r in four]
        assert [r["released"] for r in runs] == [False, True, True, False], scheme
        assert all(r["losses"] == static for r in runs if not r["released"]), scheme
        assert any(p["balancer"] == "repack" for p in runs[0]["plans"]), scheme


def test_the_remaining_refusals_are_one_line_each():
    from moebal.config import from_dict
    from moebal.errors import ConfigError

    base = {"model": {"n_layers": 4}, "moe": {"num_experts": 0}, "parallel": {"pp": 2, "nproc": 4},
            "pipeline": {"microbatching": "dynamic"}}
    for extra, match in (({"pipeline": {"microbatching": "dynamic", "repack": True, "dynamic": {"costs": "t.json"}}},
                          "re-packing and a micro-batch cost table file"),
                         ({"parallel": {"pp": 1, "nproc": 1}, "pipeline": {"rebalance": "partition"}},
                          "parallel.pp 1 has one stage")):
        with pytest.raises(ConfigError, match=match) as e:
            from_dict(_merge(base, extra))
        assert "\n" not in str(e.value).strip()
    # planned micro-batches with expert shards inside stages, and with routing losses on data-parallel
    # pipelines, run in lockstep, and every dynamism scheme runs on them (tests/distributed/test_microbatching.py):
    # accepted
    for extra in ({"parallel": {"pp": 2, "nproc": 4, "ep": 2}, "moe": {"num_experts": 4}},
                  {"dynamism": {"scheme": "mod"}},
                  {"parallel": {"pp": 2, "nproc": 4, "ep": 2}, "moe": {"num_experts": 4},
                   "dynamism": {"scheme": "pruning"}},
                  {"moe": {"num_experts": 4}},  # ep null: 4 / 2
                  {"parallel": {"pp": 2, "nproc": 4, "ep": 1}, "moe": {"num_experts": 4, "z_loss_coef": 1e-3}},
                  {"parallel": {"pp": 2, "nproc": 4, "ep": 2}, "moe": {"num_experts": 4},
                   "pipeline": {"microbatching": "packing", "rebalance": "diffusion"}}):
        from_dict(_merge(base, extra))


SIX_SCHEMES = ("none", "moe", "early_exit", "mod", "freezing")


def _six_ranks(rank: int, world: int) -> dict:
    import dataclasses

    import torch.distributed as dist

    from moebal.dynamism.scheme import build_dynamism
    from moebal.pipeline.runner import PipelineRunner

    cfg = moe_cfg(n_layers=6)
    cfg = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, pp=3, nproc=6))
    out = {}
    for scheme in SIX_SCHEMES:
        for case, force in (("static", ()), ("repack", ((2, (2, 4)),))):
            runner = PipelineRunner(pipeline_cfg(cfg, {"micro_batches": 2}), force=force,
                                    scheme=build_dynamism(scheme, EP_SCHEMES.get(scheme, {}), cfg=cfg))
            run = runner.train(4)
            out[f"{scheme}_{case}"] = {"losses": [r["loss"] for r in run.records], "released": run.released,
                                       "sizes": run.final_sizes}
            dist.barrier()  # the released stage's ranks wait here
    return out


def test_repacking_expert_parallel_stages_releases_a_whole_stage():
    runs = run_ranks(_six_ranks, 6)  # 3 stages x 2 expert shards; the middle stage's two ranks leave
    for scheme in SIX_SCHEMES:
        assert [r[f"{scheme}_repack"]["released"] for r in runs] == [False, False, True, True, False, False]
        static = runs[0][f"{scheme}_static"]["losses"]
        for r in runs:
            if not r[f"{scheme}_repack"]["released"]:
                assert r[f"{scheme}_repack"]["sizes"] == [2, 4]
                # to 1e-6, not bit for bit: on a loaded host this 6-rank layout's 4th loss takes one of two values
                # (8th digit) from run to run, static and re-packed alike, on main before this change too
                assert all(math.isclose(a, b, rel_tol=1e-6) for a, b in zip(r[f"{scheme}_repack"]["losses"],
                                                                            static)), scheme
