"""Pipeline pieces that need no second process: schedules, re-pack planning, stages, subset blocks, profiler."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from moebal.config import from_dict
from moebal.dynamism.early_exit import pack_positions
from moebal.errors import ConfigError
from moebal.models import build_model
from moebal.models.subset import subset_block
from moebal.pipeline.observe import CostTracker, LayerProfiler
from moebal.pipeline.runner import expand_repack
from moebal.pipeline.stage import PipelineStage, build_layer_skeleton
from moebal.planner.partition import (
    StagePartition,
    iteration_time,
    partition_by_time,
    plan_repack,
    replay_time,
    should_adopt,
)
from moebal.planner.schedule import gpipe, in_flight, make_schedule, one_f_one_b, simulate, zero_bubble


def small(n_layers: int = 4, **model):
    return from_dict({"model": {"dim": 32, "n_layers": n_layers, "n_heads": 4, "n_kv_heads": 2, "ffn_dim": 64,
                                "max_seq_len": 32, **model},
                      "moe": {"num_experts": 0}, "data": {"seq_len": 16, "batch_size": 4}})


# ---- schedules -------------------------------------------------------------------------------------------------
def test_one_f_one_b_order_by_hand():
    assert one_f_one_b(4, 0, 6) == [("F", 0), ("F", 1), ("F", 2), ("F", 3), ("B", 0), ("F", 4), ("B", 1),
                                    ("F", 5), ("B", 2), ("B", 3), ("B", 4), ("B", 5)]
    assert one_f_one_b(4, 3, 3) == [("F", 0), ("B", 0), ("F", 1), ("B", 1), ("F", 2), ("B", 2)]
    assert one_f_one_b(4, 0, 2) == [("F", 0), ("F", 1), ("B", 0), ("B", 1)]  # fewer micro-batches than warm-up
    assert gpipe(2, 1, 2) == [("F", 0), ("F", 1), ("B", 0), ("B", 1)]
    assert in_flight("1f1b", 4, 0, 8) == 4 and in_flight("1f1b", 4, 3, 8) == 1 and in_flight("gpipe", 4, 2, 8) == 8


def test_zero_bubble_order_by_hand():
    # stage 0 fills the wait for B(1)'s gradient with W(0); the last stage may hold one micro-batch (1F1B's bound)
    assert zero_bubble(2, 0, 3) == [("F", 0), ("F", 1), ("B", 0), ("W", 0), ("F", 2), ("B", 1), ("W", 1),
                                    ("B", 2), ("W", 2)]
    assert zero_bubble(2, 1, 2) == [("F", 0), ("B", 0), ("W", 0), ("F", 1), ("B", 1), ("W", 1)]
    assert in_flight("zb", 4, 0, 8) == 4 and in_flight("zb", 4, 3, 8) == 1


@pytest.mark.parametrize("P,M", [(1, 3), (2, 1), (3, 2), (4, 6), (4, 16), (6, 5)])
def test_zero_bubble_schedules_are_complete_ordered_and_within_1f1b_memory(P, M):
    for p in range(P):
        ops = zero_bubble(P, p, M)
        assert sorted(ops) == sorted((k, j) for k in "FBW" for j in range(M))  # each op exactly once
        at = {op: i for i, op in enumerate(ops)}
        for j in range(M):
            assert at[("F", j)] < at[("B", j)] < at[("W", j)]
            if j:
                assert at[("F", j - 1)] < at[("F", j)] and at[("B", j - 1)] < at[("B", j)]
        assert in_flight("zb", P, p, M) <= in_flight("1f1b", P, p, M)
    # executable whatever the real times: the replay finishes (it asserts against deadlock) on random times
    g = torch.Generator().manual_seed(P * 100 + M)
    for _ in range(5):
        f, b = torch.rand(P, generator=g).tolist(), (torch.rand(P, generator=g) * 3).tolist()
        makespan, timed = simulate("zb", f, b, M)
        assert len(timed) == 3 * P * M and makespan >= max(fp + bp for fp, bp in zip(f, b)) * M - 1e-9


def test_zero_bubble_shrinks_the_bubble_of_equal_and_of_unequal_stages():
    for fwd in ([1.0] * 4, [1.0, 1.3, 1.3, 1.0]):
        bwd = [2 * x for x in fwd]
        one, _ = simulate("1f1b", fwd, bwd, 16)
        zb, timed = simulate("zb", fwd, bwd, 16)
        busy = max(16 * (f + b) for f, b in zip(fwd, bwd))
        assert busy <= zb < one
        w = [o for o in timed if o.kind == "W"]
        assert all(o.end - o.start == pytest.approx(bwd[o.stage] * 0.5) for o in w)
    # without W time the zero-bubble order costs what 1F1B costs on equal stages
    assert simulate("zb", [1.0] * 3, [2.0] * 3, 6, w_share=0.0)[0] == pytest.approx(simulate("1f1b", [1.0] * 3,
                                                                                              [2.0] * 3, 6)[0])


def test_zero_bubble_replay_takes_one_w_share_per_stage():
    fwd, bwd = [1.0, 1.0], [2.0, 2.0]
    _, timed = simulate("zb", fwd, bwd, 4, w_share=[0.25, 0.0])
    for o in timed:
        if o.kind == "W":
            assert o.end - o.start == pytest.approx([0.5, 0.0][o.stage])
        if o.kind == "B":
            assert o.end - o.start == pytest.approx([1.5, 2.0][o.stage])
    # a stage without W time adds nothing to the zero-bubble order; a larger W share fills more of the bubble
    assert simulate("zb", fwd, bwd, 4, w_share=0.5)[0] < simulate("zb", fwd, bwd, 4, w_share=0.1)[0]
    for bad in ([0.5], [0.5, 1.5], -0.1):
        with pytest.raises(ConfigError, match="w_share"):
            simulate("zb", fwd, bwd, 4, w_share=bad)


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_simulated_makespan_of_equal_stages(name):
    P, M, f, b = 4, 6, 1.0, 2.0
    makespan, ops = simulate(name, [f] * P, [b] * P, M)
    assert makespan == pytest.approx((M + P - 1) * (f + b))
    assert len(ops) == 2 * P * M
    # every op starts after its dependency ended
    end = {(o.kind, o.stage, o.micro_batch): o.end for o in ops}
    for o in ops:
        if o.kind == "F" and o.stage > 0:
            assert o.start >= end[("F", o.stage - 1, o.micro_batch)]
        if o.kind == "B" and o.stage < P - 1:
            assert o.start >= end[("B", o.stage + 1, o.micro_batch)]


@pytest.mark.parametrize("slow", [0, 1, 3])
def test_iteration_time_model_is_gpipe_exact_and_bounds_1f1b(slow):
    # stage loads (f+b) of 3 with one stage at 6 (b = 2f): (M-1) max + sum, DynPipe's formula
    fwd, bwd = [1.0] * 4, [2.0] * 4
    fwd[slow], bwd[slow] = 2.0, 4.0
    model = iteration_time([f + b for f, b in zip(fwd, bwd)], 8)
    assert simulate("gpipe", fwd, bwd, 8)[0] == pytest.approx(model)
    assert simulate("1f1b", fwd, bwd, 8)[0] <= model + 1e-9


def test_schedule_errors():
    with pytest.raises(ConfigError, match="unknown pipeline schedule"):
        make_schedule("zb2", 2, 0, 2)
    with pytest.raises(ConfigError, match="micro-batches"):
        gpipe(2, 0, 0)
    with pytest.raises(ConfigError, match="outside"):
        one_f_one_b(2, 2, 4)


# ---- iteration time, re-packing, plans -----------------------------------------------------------------------
def test_iteration_time_by_hand():
    assert iteration_time([2.0, 1.0], 4) == 3 * 2 + 3
    assert iteration_time([2.0, 1.0, 1.0], 4, comm_s=0.5) == 3 * 2 + 4 + 2 * 2 * 0.5


def test_replay_time_by_hand_and_against_the_closed_form():
    # 2 stages, 2 micro-batches, 1F1B. Stage 0: F0 0-2, F1 2-4, B0 5-9 (after stage 1's B0 ends at 5),
    # B1 9-13; stage 1: F0 2-3, B0 3-5, F1 5-6, B1 6-8. The closed form charges 1 x 6 + 9 = 15.
    assert replay_time([2.0, 1.0], [4.0, 2.0], 2) == 13.0
    assert iteration_time([6.0, 3.0], 2) == 15.0
    rng = np.random.default_rng(0)
    for _ in range(20):
        P, M = int(rng.integers(2, 6)), int(rng.integers(1, 17))
        loads = rng.uniform(0.5, 2.0, P)
        f, b = loads / 3, 2 * loads / 3
        # GPipe with forward and backward in one ratio on every stage: the closed form is exact
        assert replay_time(f, b, M, schedule="gpipe") == pytest.approx(iteration_time(loads, M))
        # 1F1B: never above the closed form, which is its upper bound
        assert replay_time(f, b, M) <= iteration_time(loads, M) + 1e-12
    # equal stages: (M + P - 1) stage times in both
    assert replay_time([1.0] * 4, [2.0] * 4, 16) == pytest.approx(19 * 3.0)
    # the case the planner got wrong: a slow first stage hides most of the others' fill behind its warm-up
    slow_first = [2.78, 1.81, 1.83, 1.85]
    t_replay = replay_time([x / 48 for x in slow_first], [x / 24 for x in slow_first], 16)
    assert t_replay < 0.96 * iteration_time([x / 16 for x in slow_first], 16)
    with pytest.raises(ConfigError, match="one of each per stage"):
        replay_time([1.0, 1.0], [2.0], 4)


def test_planner_decisions_follow_the_given_time_model():
    costs = [1.0] * 4 + [0.1] * 12
    # a model in which fewer stages are never slower: pack down to min_stages
    assert plan_repack(costs, 4, 8, slack=0.0, time_fn=lambda sizes: 1.0) == partition_by_time(costs, 2)
    # one in which fewer stages are always much slower: keep all four
    assert plan_repack(costs, 4, 8, slack=0.1, time_fn=lambda sizes: 10.0 / len(sizes)) is None
    # adoption compares the model's times of the current and proposed partition
    def faster_when_balanced(sizes):
        return 2.0 if list(sizes) == [8, 8] else 3.0
    adopt, gain, cost = should_adopt([1.0] * 16, [12, 4], [8, 8], 8, 10, [0.0] * 16, 1e9,
                                     time_fn=faster_when_balanced)
    assert adopt and gain == pytest.approx(10.0) and cost == 0.0
    adopt, gain, _ = should_adopt([1.0] * 16, [12, 4], [8, 8], 8, 10, [0.0] * 16, 1e9, time_fn=lambda s: 2.0)
    assert not adopt and gain == 0.0


def test_the_runner_predicts_by_replaying_measured_forward_and_backward_shares():
    from types import SimpleNamespace

    from moebal.balance.layers import LayerBalancer
    tr = CostTracker(4)
    # layers 0-2 measured 1 : 2, layer 3 frozen (forward only), embedding 0.5 forward, head 0.25 + 0.5
    tr.update(np.array([1.0, 1.0, 1.0, 3.0, 0.5, 0.25]), np.array([2.0, 2.0, 2.0, 0.0, 0.0, 0.5]),
              np.zeros(6))
    runner = SimpleNamespace(tracker=tr, kappa=2.0, U=4, comm_s=0.1, opts=SimpleNamespace(schedule="1f1b"),
                             _num_micro=lambda: 4)
    costs = tr.layer_costs() * 2.0  # what `_costs` gives: wall seconds (CPU x kappa)
    t_iter = LayerBalancer.time_fn(runner, costs)
    # stage 0: layers 0-1 + embedding: forward 2 x 2 + 1 = 5, backward 2 x 4 = 8; stage 1: layers 2-3 + head:
    # forward 2 + 6 + 0.5 = 8.5, backward 4 + 0 + 1 = 5
    assert t_iter([2, 2]) == replay_time([5.0, 8.5], [8.0, 5.0], 4, 0.1)
    assert t_iter([1, 3]) == replay_time([3.0, 10.5], [4.0, 9.0], 4, 0.1)


def test_the_runner_replays_zero_bubble_with_each_stage_s_measured_w_share():
    from types import SimpleNamespace

    from moebal.balance.layers import LayerBalancer
    tr = CostTracker(4)
    # every layer 1 forward, 2 backward of which W: 1.0 (layer 0), 0.5 (1), 0 (2, 3); embedding and head none
    tr.update(np.array([1.0, 1.0, 1.0, 1.0, 0.0, 0.0]), np.array([2.0, 2.0, 2.0, 2.0, 0.0, 0.0]), np.zeros(6),
              wgt=np.array([1.0, 0.5, 0.0, 0.0, 0.0, 0.0]))
    runner = SimpleNamespace(tracker=tr, kappa=1.0, U=4, comm_s=0.0, opts=SimpleNamespace(schedule="zb"),
                             _num_micro=lambda: 4)
    t_iter = LayerBalancer.time_fn(runner, tr.layer_costs())
    # stage 0 (layers 0-1): backward 4 of which W 1.5; stage 1 (layers 2-3): no W
    assert t_iter([2, 2]) == replay_time([2.0, 2.0], [4.0, 4.0], 4, 0.0, "zb", [1.5 / 4, 0.0])
    assert t_iter([1, 3]) == replay_time([1.0, 3.0], [2.0, 6.0], 4, 0.0, "zb", [0.5, 0.5 / 6])


@pytest.mark.parametrize("sharded", [False, True])
def test_the_runners_clip_never_scales_gradients_up(sharded):
    """`PipelineRunner._clip`: torch's clip_grad_norm_ rule over the per-slot squares, whether the stage's
    gradients are its own (scaled in place) or a sharded optimizer's parts (`scale_grads`): a norm below
    grad_clip leaves them as they were, bit for bit; one above scales them by grad_clip / norm."""
    from types import SimpleNamespace

    from moebal.pipeline.runner import PipelineRunner

    stage = torch.nn.Linear(3, 2)
    for p in stage.parameters():
        p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(0))
    before = [p.grad.clone() for p in stage.parameters()]
    coefs: list[float] = []
    runner = SimpleNamespace(cfg=from_dict({"train": {"grad_clip": 1.0}}), stage=stage, optimizer=None,
                             sharded=SimpleNamespace(scale_grads=lambda c: coefs.append(float(c))) if sharded else None)
    sq_S = torch.tensor([0.09, 0.16], dtype=torch.float64)  # norm 0.5: below grad_clip, yet above a tenth of it
    assert PipelineRunner._clip(runner, sq_S) == pytest.approx(0.5)  # type: ignore[arg-type]
    assert coefs == [] and all(torch.equal(p.grad, b) for p, b in zip(stage.parameters(), before))
    assert PipelineRunner._clip(runner, 16 * sq_S) == pytest.approx(2.0)  # type: ignore[arg-type]
    if sharded:
        assert coefs == [pytest.approx(0.5)]
    else:
        assert all(torch.allclose(p.grad, b / 2) for p, b in zip(stage.parameters(), before))


def test_repack_releases_ranks_when_fewer_stages_run_as_fast():
    # 16 layers: a dense front and a tail whose tokens have exited (the early-exit profile); four stages are
    # bottlenecked at 2 (two front layers), and so are three: [2, 2, 12] loads 2, 2, 1.2
    costs = [1.0] * 4 + [0.1] * 12
    assert plan_repack(costs, 4, 8, slack=0.1) == [2, 2, 12]
    # two stages would be 3/2 as slow per micro-batch: not within 10%, but within 60%
    assert plan_repack(costs, 4, 8, slack=0.6) == partition_by_time(costs, 2)
    # on uniform costs fewer stages are much slower: keep all four
    assert plan_repack([1.0] * 16, 4, 8, slack=0.1) is None
    # transfers make more stages dearer: with costly boundaries fewer stages win sooner
    assert plan_repack([1.0] * 16, 4, 2, slack=0.1, comm_s=10.0) is not None


def test_repack_respects_memory_caps_and_min_stages():
    costs = [1.0] * 4 + [0.1] * 12
    memory = [1.0] * 16
    # 12 tail layers do not fit under a cap of 11; [2, 3, 11] does and is still within 10%
    assert plan_repack(costs, 4, 8, slack=0.1, memory=memory, capacity=11.0) == [2, 3, 11]
    assert plan_repack(costs, 4, 8, slack=0.1, memory=memory, capacity=5.0) is None  # 3 stages need 6 layers
    assert plan_repack(costs, 4, 8, slack=0.6, min_stages=3) == [2, 2, 12]


def test_expand_repack_keeps_first_and_last_ranks():
    assert expand_repack([3, 5], 4) == [3, 0, 0, 5]
    assert expand_repack([2, 2, 4], 4) == [2, 2, 0, 4]
    assert expand_repack([1, 1, 1, 1], 4) == [1, 1, 1, 1]
    with pytest.raises(ConfigError, match="one stage"):
        expand_repack([8], 4)
    with pytest.raises(ConfigError, match="more stages"):
        expand_repack([1] * 5, 4)
    for empty_end in ([0, 4], [4, 0], [0, 2, 2, 2]):  # a forced plan releasing the embedding's or the head's rank
        with pytest.raises(ConfigError, match="the first and last stages hold the embedding and the head"):
            expand_repack(empty_end, 4)


def test_stage_partition_round_trip_and_validation():
    p = StagePartition(sizes=(3, 5), ranks=(0, 3), step=7, balancer="repack", released=(1, 2), meta={"x": 1})
    assert StagePartition.from_dict(p.to_dict()) == p
    assert p.bounds == [0, 3, 8]
    with pytest.raises(ConfigError, match="at least one layer"):
        StagePartition(sizes=(3, 0), ranks=(0, 1))
    with pytest.raises(ConfigError):
        StagePartition(sizes=(3,), ranks=(0, 1))


def test_pipeline_config_errors():
    import dataclasses

    from moebal.config import Config

    base = Config()
    for key, bad in (("schedule", "interleaved"), ("rebalance", "greedy"), ("min_stages", 1), ("wait", "poll"),
                     ("dilate", 0.5)):
        with pytest.raises(ConfigError, match=key):
            dataclasses.replace(base, pipeline=dataclasses.replace(base.pipeline, **{key: bad}))


def test_dilated_ops_last_a_multiple_of_their_cpu_time():
    from moebal.pipeline.engine import PipelineEngine
    from moebal.pipeline.p2p import PipeChain

    torch.manual_seed(0)
    model = build_model(small(2))
    stage = PipelineStage.from_model(model, 0, 2, first=True, last=True)
    ids = torch.randint(0, 256, (4, 16))
    for dilate in (1.0, 3.0):
        engine = PipelineEngine(stage, PipeChain([0], 0), num_micro=2)
        engine.dilate = dilate
        res = engine.run(ids, ids, ids.numel())
        if dilate > 1:
            assert res.busy_s >= 0.95 * dilate * res.busy_cpu_s  # the op ends at dilate x its CPU time, or later


# ---- stages and blocks -----------------------------------------------------------------------------------------
def test_stage_slices_the_model_with_its_parameter_names():
    torch.manual_seed(0)
    model = build_model(small(4))
    first = PipelineStage.from_model(model, 0, 2, first=True, last=False)
    last = PipelineStage.from_model(model, 2, 4, first=False, last=True)
    names = set(first.state_dict()) | set(last.state_dict())
    assert names == set(model.state_dict())
    assert first.layer_ids == [0, 1] and "lm_head.weight" in last.state_dict()
    layer = last.remove_layer(2)
    first.add_layer(2, layer)
    assert first.layer_ids == [0, 1, 2] and last.layer_ids == [3]
    first.check_contiguous()
    # tied embeddings: the last stage's head holds the embedding's tensor (a copy on its own rank: tied.py)
    tied = build_model(small(2, tie_embeddings=True))
    head = PipelineStage.from_model(tied, 1, 2, first=False, last=True)
    assert head.tied_head is tied.model.embed_tokens.weight and head.model.embed_tokens is None
    assert PipelineStage.from_model(tied, 0, 1, first=True, last=False).tied_head is None


def test_layer_skeleton_draws_no_random_numbers():
    state = torch.random.get_rng_state()
    layer = build_layer_skeleton(small(), 1, "cpu")
    assert torch.equal(state, torch.random.get_rng_state())
    assert not any(p.is_meta for p in layer.parameters())


# the attention variants a token subset must keep: the subset path once ran plain attention under each of them
# (no q/k norms, no window): these tests then failed by up to 0.011, where they now agree to 1e-5
ATTENTION = {"plain": {}, "qk-norm-head": {"qk_norm": "head"}, "qk-norm-full": {"qk_norm": "full"},
             "window": {"sliding_window": 4}, "window-and-norm": {"sliding_window": 5, "qk_norm": "head"}}


def _layer_and_input(**model):
    torch.manual_seed(1)
    cfg = small(2, **model)
    built = build_model(cfg)
    with torch.no_grad():  # norms away from 1, so a path that skips one differs
        for name, p in built.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    h = torch.randn(2, 12, 32)
    cos, sin = built.model.rotary(12, h.dtype)
    return built.model.layers[0], h, cos, sin


@pytest.mark.parametrize("attention", ATTENTION)
def test_subset_block_with_all_keys_equals_the_layer_on_the_selected_rows(attention):
    layer, h, cos, sin = _layer_and_input(**ATTENTION[attention])
    active = torch.rand(2, 12) > 0.4
    active[:, 0] = True
    pos, valid = pack_positions(active)
    out = subset_block(layer, h, cos, sin, pos, valid, keys="all")
    full = layer(h, cos, sin)
    torch.testing.assert_close(out[active], full[active], rtol=1e-5, atol=1e-5)
    assert torch.equal(out[~active], h[~active])  # skipped tokens keep their state


@pytest.mark.parametrize("attention", ATTENTION)
def test_subset_block_on_selected_keys_is_a_shorter_sequence(attention):
    layer, h, cos, sin = _layer_and_input(**ATTENTION[attention])
    k = 7
    pos = torch.arange(k).expand(2, k)  # a prefix keeps its rotary positions 0..k-1
    ref = layer(h[:, :k], cos[:k], sin[:k])
    for valid in (torch.ones(2, k, dtype=torch.bool), None):  # with padding masks, and the all-valid path
        out = subset_block(layer, h, cos, sin, pos, valid, keys="subset")
        torch.testing.assert_close(out[:, :k], ref, rtol=1e-5, atol=1e-5)
        assert torch.equal(out[:, k:], h[:, k:])
    # scattered positions: the all-valid path equals the masked one
    pos = torch.tensor([[1, 4, 5, 9], [0, 2, 3, 11]])
    scale = torch.rand(2, 4)
    a = subset_block(layer, h, cos, sin, pos, torch.ones(2, 4, dtype=torch.bool), keys="subset", scale_BQ=scale)
    b = subset_block(layer, h, cos, sin, pos, None, keys="subset", scale_BQ=scale)
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_pack_positions_pads_rows():
    active = torch.tensor([[True, False, True, True], [False, True, False, False]])
    pos, valid = pack_positions(active)
    assert pos.tolist() == [[0, 2, 3], [1, 0, 0]]
    assert valid.tolist() == [[True, True, True], [True, False, False]]


# ---- observing -------------------------------------------------------------------------------------------------
def test_backward_marks_by_hand():
    prof = LayerProfiler(4)
    # a middle stage with layers 1, 2: backward starts at 10, grad of layer 2's input at 13, of layer 1's at 17
    prof.backward_marks([1, 2], {2: 13.0, 1: 17.0}, 10.0, 18.0)
    # a last stage with layer 3 and the head (slot 5): head 20->21, layer 3 21->24
    prof.backward_marks([3, 5], {5: 21.0, 3: 24.0}, 20.0, 24.5)
    # a first stage: embedding (slot 4) then layer 0 whose input needs no gradient
    prof.backward_marks([4, 0], {}, 30.0, 31.0)
    r = prof.result([0, 1, 2, 3, 4, 5])
    assert r.bwd.tolist() == [1.0, 4.0, 3.0, 3.0, 0.0, 1.0]
    assert r.wgt.tolist() == [0.0] * 6


def test_deferred_weight_gradients_count_in_their_micro_batch_s_backward():
    prof = LayerProfiler(2)
    for j in range(3):  # layer 0's B takes 2 s per micro-batch, its W 1 s (micro-batch 1: 3 s)
        prof.backward_marks([0, 1], {1: 10.0 * j + 1.0, 0: 10.0 * j + 3.0}, 10.0 * j, 10.0 * j + 3.0)
        prof.add_weight_grad(0, j, 3.0 if j == 1 else 1.0)
    r = prof.result([0, 1])
    assert r.bwd[0] == 3.0 and r.wgt[0] == 1.0 and r.wgt[1] == 0.0


def test_cost_tracker_smooths():
    t = CostTracker(2, ema=0.5)
    t.update(np.array([1.0, 1.0, 0.1, 0.2]), np.array([2.0, 2.0, 0.1, 0.2]), np.zeros(4))
    t.update(np.array([3.0, 1.0, 0.1, 0.2]), np.array([2.0, 2.0, 0.1, 0.2]), np.zeros(4))
    assert t.layer_costs().tolist() == [4.0, 3.0]
    assert t.first_extra == pytest.approx(0.2) and t.last_extra == pytest.approx(0.4)
    s = CostTracker(2)
    s.load_state_dict(t.state_dict())
    assert s.layer_costs().tolist() == [4.0, 3.0]
    # W times smooth like the rest; a tracker saved before they existed loads with none
    t.update(np.array([3.0, 1.0, 0.1, 0.2]), np.array([2.0, 2.0, 0.1, 0.2]), np.zeros(4),
             wgt=np.array([1.0, 0.0, 0.0, 0.0]))
    assert t.wgt.tolist() == [0.5, 0.0, 0.0, 0.0]
    old = {k: v for k, v in t.state_dict().items() if k != "wgt"}
    s.load_state_dict(old)
    assert s.wgt.tolist() == [0.0] * 4


def test_cost_tracker_normalises_profiles_by_the_predicted_factor():
    t = CostTracker(2, ema=0.5)
    # layer 0 measured at 3 s while predicted at 0.5 of its plain cost: 6 s without dynamism
    t.update(np.array([1.0, 1.0, 0.0, 0.0]), np.array([2.0, 2.0, 0.0, 0.0]), np.zeros(4), factors=[0.5, 1.0])
    assert t.layer_costs().tolist() == [6.0, 3.0]
    assert t.layer_costs([0.25, 2.0]).tolist() == [1.5, 6.0]  # scaled by the latest prediction
    # a later profile at factor 1 averages with the first in the same unit
    t.update(np.array([2.0, 1.0, 0.0, 0.0]), np.array([2.0, 2.0, 0.0, 0.0]), np.zeros(4), factors=[1.0, 1.0])
    assert t.layer_costs().tolist() == [5.0, 3.0]
    assert t.layer_costs([0.0, 1.0])[0] > 0  # a layer never costs nothing


class _Send:
    """A posted send that completes when told to (`is_completed` as NCCL's: the transfer is done)."""

    def __init__(self) -> None:
        self.done = self.waited = False

    def is_completed(self) -> bool:
        return self.done

    def wait(self) -> bool:
        self.waited = True
        return True


def test_a_chain_holds_only_the_sends_still_in_flight(monkeypatch):
    """The chain drops a completed send's buffer at its next send (waiting on it, which returns at once), and
    keeps every send not yet completed until `flush`: a stage holds the sends in flight, not the iteration's."""
    from moebal.pipeline import p2p

    works: list[_Send] = []
    monkeypatch.setattr(p2p.dist, "isend", lambda t, dst, group=None: works.append(_Send()) or works[-1])
    chain = p2p.PipeChain([0, 1], 0)
    for j in range(8):
        chain.send(torch.full((4,), float(j)), 1)
        if j % 2 == 0:
            works[-1].done = True  # the even sends complete at once, the odd ones stay in flight
    assert [float(t[0]) for _, t in chain._pending] == [1.0, 3.0, 5.0, 7.0]  # the odd ones: still in flight
    assert all(w.waited for w in works[::2]) and not any(w.waited for w in works[1::2])
    chain.flush()
    assert chain._pending == [] and all(w.waited for w in works)
