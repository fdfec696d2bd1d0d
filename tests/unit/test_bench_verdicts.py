"""The pipeline benchmark's verdicts pair each rebalanced run with the static run of its own round."""

from __future__ import annotations

import pytest

from tests.cli_util import load_script


@pytest.fixture(scope="module")
def bench():
    return load_script("bench_pipeline_rebalance")


def _row(scheme: str, bal: str, rnd: int, tp: float, **kw: object) -> dict:
    kw.setdefault("mode", "dilate")
    kw.setdefault("schedule", "zb" if str(kw["mode"]).endswith("+zb") else "1f1b")
    return {"wait": "dilate", "scheme": scheme, "balancer": bal, "round": rnd, "throughput": tp,
            "cpu_model_iteration_s": 1.0 / tp, "overhead_fraction": 0.01, "repack_experiment": False, **kw}


def test_speedup_is_the_median_of_per_round_ratios(bench) -> None:
    # round 1 ran on a slow machine: a ratio of medians over rounds (1000 / 800 = 1.25) would mix rounds
    rows = [_row("freezing", "static", 0, 1000.0), _row("freezing", "partition", 0, 1200.0),
            _row("freezing", "static", 1, 600.0), _row("freezing", "partition", 1, 800.0),
            _row("freezing", "static", 2, 800.0), _row("freezing", "partition", 2, 960.0)]
    v = bench.verdicts(rows)
    assert v["speedup_per_round"]["dilate/freezing/partition"] == [1.2, 1.333, 1.2]
    assert v["speedup"]["dilate/freezing/partition"] == 1.2
    assert v["cpu_model_speedup"]["dilate/freezing/partition"] == 1.2
    assert v["targets"]["dilate: freezing: partition / static >= 1.3"] == {"measured": 1.2, "met": False}
    assert not [k for k in v["targets"] if "diffusion" in k or "best" in k]  # only the balancers that ran


def test_repack_verdict_needs_a_released_rank(bench) -> None:
    pack = {"repack_experiment": True, "scheme": "early_exit"}
    rows = [_row(**pack, bal="partition", rnd=0, tp=1000.0, repack=False, throughput_per_rank=250.0,
                 released_ranks=[]),
            _row(**pack, bal="partition", rnd=0, tp=950.0, repack=True, throughput_per_rank=316.7,
                 released_ranks=[2])]
    got = bench.verdicts(rows)["targets"]["dilate: re-pack releases >= 1 of 4 ranks, throughput within 10% of unpacked"]
    assert got["released_ranks"] == 1 and got["throughput_ratio"] == 0.95 and got["met"]
    rows[1]["released_ranks"] = []
    got = bench.verdicts(rows)["targets"]["dilate: re-pack releases >= 1 of 4 ranks, throughput within 10% of unpacked"]
    assert not got["met"]


def test_each_schedule_is_paired_with_its_own_static_run(bench) -> None:
    rows = [_row("mod", "static", 0, 1000.0), _row("mod", "partition", 0, 1100.0),
            _row("mod", "static", 0, 1050.0, mode="dilate+zb"), _row("mod", "partition", 0, 1218.0, mode="dilate+zb")]
    v = bench.verdicts(rows)
    assert v["speedup"] == {"dilate/mod/partition": 1.1, "dilate+zb/mod/partition": 1.16}
    assert v["targets"]["dilate+zb: mod: partition / static >= 1.1"]["met"]
    assert bench._mode("dilate", "1f1b") == "dilate" and bench._mode("spin", "zb") == "spin+zb"
    groups = bench.build_groups(["mod"], 1, 10, ["dilate"], schedules=("1f1b", "zb"))
    assert [g["variants"] for g in groups] == [["static", "partition", "diffusion",
                                                "static@zb", "partition@zb", "diffusion@zb"]]
    assert bench.split_variant("partition+repack@zb") == ("partition+repack", "zb")
    assert bench.split_variant("static") == ("static", "1f1b")


def test_zero_bubble_is_compared_with_1f1b_of_the_same_balancer_and_round(bench) -> None:
    rows = [_row("mod", b, rnd, tp, schedule=s, mode="dilate" if s == "1f1b" else "dilate+zb")
            for b, rnd, tp, s in [("static", 0, 1000.0, "1f1b"), ("static", 0, 1020.0, "zb"),
                                  ("partition", 0, 1100.0, "1f1b"), ("partition", 0, 1155.0, "zb"),
                                  ("static", 1, 500.0, "1f1b"), ("static", 1, 520.0, "zb")]]
    z = bench.verdicts(rows)["zb_over_1f1b"]
    assert z == {"dilate/mod/static": 1.03, "dilate/mod/partition": 1.05}


def test_split_units_are_paired_with_their_own_static_run_and_with_whole_layers(bench) -> None:
    rows = [_row("mod", "static", 0, 1000.0), _row("mod", "partition", 0, 1080.0),
            _row("mod", "static", 0, 1010.0, mode="dilate+halves", units="halves"),
            _row("mod", "partition", 0, 1161.5, mode="dilate+halves", units="halves")]
    v = bench.verdicts(rows)
    assert v["speedup"] == {"dilate/mod/partition": 1.08, "dilate+halves/mod/partition": 1.15}
    assert v["targets"]["dilate+halves: mod: partition / static >= 1.1"]["met"]
    assert v["halves_over_layers"] == {"dilate/mod/static": 1.01, "dilate/mod/partition": 1.075}
    assert bench._mode("dilate", "zb", "halves") == "dilate+zb+halves"
    groups = bench.build_groups(["mod"], 1, 10, ["dilate"], units=("layers", "halves"))
    assert groups[0]["variants"] == ["static", "partition", "diffusion",
                                     "static~halves", "partition~halves", "diffusion~halves"]
    assert bench.split_variant("partition@zb~halves") == ("partition", "zb")
    # --seq-len: every group's rows, in the config each rank builds (the scheme's own length without it)
    long = bench.build_groups(["sparse_attention", "mod"], 1, 10, ["dilate"], seq_len=2048)
    assert {g["seq_len"] for g in long} == {2048}
    cfg = bench.bench_config(10, "sparse_attention", 4, long[0]["seq_len"])
    assert cfg.data.seq_len == cfg.model.max_seq_len == 2048 and cfg.data.batch_size == 4
    assert bench.bench_config(10, "mod").data.seq_len == bench.SEQ_LEN["mod"]
    assert bench.variant_units("partition@zb~halves") == "halves" and bench.variant_units("static") == "layers"


def test_an_option_reaches_its_scheme_s_groups_and_bad_ones_are_named(bench) -> None:
    over = bench.parse_options(["sparse_attention.depth_tilt=0.75", "sparse_attention.walk_step=0.2"])
    assert over == {"sparse_attention": {"depth_tilt": 0.75, "walk_step": 0.2}}
    options = {k: {**v, **over.get(k, {})} for k, v in bench.SCHEMES.items()}
    groups = bench.build_groups(["sparse_attention", "mod"], 1, 10, ["dilate"], options=options)
    sa = [g for g in groups if g["scheme"] == "sparse_attention"]
    assert sa[0]["options"] == {**bench.SCHEMES["sparse_attention"], "depth_tilt": 0.75, "walk_step": 0.2}
    assert [g["options"] for g in groups if g["scheme"] == "mod"] == [bench.SCHEMES["mod"]]
    for bad, why in (("depth_tilt=1", "SCHEME.KEY=VALUE"), ("attention.depth_tilt=1", "unknown scheme"),
                     ("sparse_attention.tilt=1", "no setting 'tilt'")):
        with pytest.raises(ValueError, match=why):
            bench.parse_options([bad])


def test_the_unit_ceiling_costs_the_start_and_the_best_partition_from_the_last_profile(bench) -> None:
    # costs falling with depth, 8 layers on 2 stages: the uniform start [4, 4] has stages 26 and 11 (max/mean
    # 26 / 18.5); the exact min-max partition is [3, 5] with 21 and 16, so the ceiling is 26 / 21
    costs = [8.0, 7.0, 6.0, 5.0, 4.0, 3.0, 2.0, 2.0]

    def plan(step: int, sizes: list[int], frm: list[int], c: list[float], bal: str = "partition") -> dict:
        return {"step": step, "sizes": sizes, "balancer": bal,
                "meta": {"from": frm, "costs": c, "first_extra": 0.0, "last_extra": 0.0}}

    plans = [plan(4, [4, 4], [4, 4], [1.0] * 8), plan(8, [3, 5], [4, 4], costs),
             plan(12, [3, 5], [3, 5], costs), plan(12, [8], [3, 5], costs, bal="repack")]
    c = bench.unit_ceiling(plans)
    assert c["step"] == 12 and c["start_sizes"] == [4, 4] and c["best_sizes"] == [3, 5]
    assert c["start_max_over_mean"] == round(26 / 18.5, 4) and c["best_max_over_mean"] == round(21 / 18.5, 4)
    assert c["ceiling"] == round(26 / 21, 4)
    # a pinned head as heavy as the first stage's surplus: the uniform start is already the best
    head = [plan(4, [4, 4], [4, 4], costs)]
    head[0]["meta"]["last_extra"] = 15.0
    h = bench.unit_ceiling(head)
    assert h["best_sizes"] == [4, 4] and h["ceiling"] == 1.0
    assert bench.unit_ceiling([]) is None and bench.unit_ceiling(plans[-1:]) is None  # static; re-pack only
    # the verdict carries the median ceiling of the mode's rebalanced runs beside the measured speed-up
    rows = [_row("sparse_attention", "static", 0, 1000.0, unit_ceiling=None),
            _row("sparse_attention", "partition", 0, 1060.0, unit_ceiling={"ceiling": 1.08}),
            _row("sparse_attention", "diffusion", 0, 1050.0, unit_ceiling={"ceiling": 1.09})]
    targets = bench.verdicts(rows)["targets"]  # each balancer's own verdict, not the better one after the run
    assert targets["dilate: sparse_attention: partition / static >= 1.15"] == {"measured": 1.06, "met": False,
                                                                              "unit_ceiling": 1.08}
    assert targets["dilate: sparse_attention: diffusion / static >= 1.15"] == {"measured": 1.05, "met": False,
                                                                              "unit_ceiling": 1.09}


def test_the_dedicated_device_estimate_replays_the_runs_own_micro_batch_count(bench):
    """Uniform stages of 0.8 s CPU time a step, 1F1B over 4 stages: (M + 3) micro-batch slots of 0.8 / M s each
    (it once divided by 16 and replayed 16 whatever `--micro-batches` said)."""
    def rec(step: int) -> dict:
        return {"step": step, "step_time_s": 1.0, "stage_cpu_s": [0.8] * 4, "stage_busy_s": [0.9] * 4, "tokens": 100,
                "stages": 4, "overhead_s": 0.0, "bubble_ratio": 0.1, "cpu_imbalance": 1.0, "busy_imbalance": 1.0,
                "pipeline_s": 1.0, "sizes": [6] * 4, "profiled": False, "layers_moved": 0, "loss": 1.0}

    run = {"scheme": "none", "balancer": "static", "repack": False, "wait": "spin", "schedule": "1f1b", "round": 0,
           "variant": "static", "repack_experiment": False, "plans": [], "load_before": 1.0, "load_after": 1.0,
           "wall_s": 1.0, "gantt": {}, "records": [rec(s) for s in range(1, 9)]}
    for m in (16, 8):
        out = bench.summarise_run({**run, "micro_batches": m}, 2)
        assert out["cpu_model_iteration_s"] == pytest.approx((m + 3) * 0.8 / m)
