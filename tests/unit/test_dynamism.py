"""Dynamism schemes: schedules and cost accounting against hand-computed cases, kernels against references."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from moebal.config import from_dict
from moebal.dynamism.freezing import FORWARD_SHARE
from moebal.dynamism.moe_routing import routing_cost_factor
from moebal.dynamism.pruning import (
    CSRStructure,
    csr_linear,
    distributed_keep_masks,
    global_magnitude_masks,
    zhu_gupta_schedule,
)
from moebal.dynamism.scheme import ROW_TOKENS, SchemeContext, build_dynamism, layer_token_flops, ramp
from moebal.errors import ConfigError
from moebal.models import build_model
from moebal.models.subset import subset_block
from moebal.pipeline.p2p import PipeChain
from moebal.pipeline.stage import PipelineStage


def small(n_layers: int = 4, experts: int = 0):
    return from_dict({"model": {"dim": 32, "n_layers": n_layers, "n_heads": 4, "n_kv_heads": 2, "ffn_dim": 64,
                                "max_seq_len": 32},
                      "moe": {"num_experts": experts, "top_k": 2, "expert_ffn_dim": 16},
                      "data": {"seq_len": 16, "batch_size": 4}})


def test_ramp():
    assert [ramp(s, 10, 4, 1.0, 0.5) for s in (0, 10, 12, 14, 20)] == [1.0, 1.0, 0.75, 0.5, 0.5]
    assert ramp(10, 10, 0, 1.0, 0.5) == 0.5


# ---- pruning ---------------------------------------------------------------------------------------------------
def test_zhu_gupta_schedule_by_hand():
    sched = zhu_gupta_schedule(0.9, 0.0, start=3000, every=1000, steps=4)
    assert [t for t, _ in sched] == [4000, 5000, 6000, 7000]
    assert [round(s, 4) for _, s in sched] == [0.5203, 0.7875, 0.8859, 0.9]
    # per step, the share of the weights still alive that goes (DynPipe's "52/56/46%"; the extraction's 0.5573
    # for the second step is a rounding slip: 1 - 0.2125 / 0.4796875 = 0.5570)
    alive, rel = 1.0, []
    for _, s in sched:
        rel.append(round(1 - (1 - s) / alive, 4))
        alive = 1 - s
    assert rel == [0.5203, 0.557, 0.4632, 0.1233]
    with pytest.raises(ConfigError, match="pruning schedule"):
        zhu_gupta_schedule(1.0)
    # s_i > 0: the schedule starts at t0 with s_i (Zhu & Gupta's t in {t0, ..., t0 + n dt}); it was left out
    sched = zhu_gupta_schedule(0.9, 0.5, start=30, every=10, steps=4)
    assert [t for t, _ in sched] == [30, 40, 50, 60, 70] and sched[0][1] == 0.5 and sched[-1][1] == pytest.approx(0.9)
    assert [round(s, 4) for _, s in sched[1:]] == [0.7312, 0.85, 0.8938, 0.9]
    with pytest.raises(ConfigError, match="must be at least 1"):
        zhu_gupta_schedule(0.9, 0.5, start=0)


def test_global_magnitude_masks_keep_the_largest_with_ties_in_model_order():
    a = torch.tensor([[0.5, -3.0], [2.0, 0.5]])
    b = torch.tensor([0.5, -1.0, 4.0])
    masks = global_magnitude_masks([[a], [b]], keep=5)
    # magnitudes 4, 3, 2, 1 are kept, then one of the three 0.5s: the first in model order (a[0, 0])
    assert masks[0][0].tolist() == [[True, True], [True, False]]
    assert masks[1][0].tolist() == [False, True, True]
    assert global_magnitude_masks([[a], [b]], keep=0)[0][0].sum() == 0


def test_distributed_masks_on_one_rank_equal_the_reference():
    torch.manual_seed(0)
    layers = {i: [torch.randn(6, 5).round(decimals=1), torch.randn(4).round(decimals=1)] for i in range(3)}
    chain = PipeChain([0], 0)
    for keep in (0, 1, 17, 40, 54):
        got = distributed_keep_masks(layers, keep, chain, 3)
        ref = global_magnitude_masks([layers[i] for i in range(3)], keep)
        for i in range(3):
            for g, r in zip(got[i], ref[i]):
                assert torch.equal(g, r), (keep, i)


def test_csr_linear_matches_masked_dense_forward_and_backward():
    torch.manual_seed(0)
    w = torch.randn(12, 9)
    mask = torch.rand(12, 9) > 0.7
    x = torch.randn(3, 5, 9, requires_grad=True)
    w1 = (w * mask).requires_grad_(True)
    w2 = (w * mask).requires_grad_(True)
    y_ref = torch.nn.functional.linear(x, w1)
    y = csr_linear(x, w2, CSRStructure.from_mask(mask))
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-5)
    g = torch.randn_like(y)
    dx_ref, dw_ref = torch.autograd.grad(y_ref, (x, w1), g)
    dx, dw = torch.autograd.grad(y, (x, w2), g)
    torch.testing.assert_close(dx, dx_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(dw, dw_ref * mask, rtol=1e-5, atol=1e-5)  # only kept entries get gradient


def test_pruning_step_masks_globally_and_times_kernels_on_one_stage():
    cfg = small(2)
    torch.manual_seed(0)
    model = build_model(cfg)
    pr = build_dynamism("pruning", {"final_sparsity": 0.9, "start": 0, "every": 1, "steps": 1, "kernel": "auto"},
                        cfg=cfg)
    pr.prepare_model(model)
    stage = PipelineStage.from_model(model, 0, 2, first=True, last=True)
    ctx = SchemeContext(step=1, stage=stage, chain=PipeChain([0], 0), num_layers=2, rows=64)
    pr.on_start(ctx)
    rng = torch.get_rng_state()
    assert pr.update(ctx) is True  # the one pruning step, at step 1
    # timing the kernels draws no global random numbers (how many matrices a stage times depends on the partition)
    assert torch.equal(torch.get_rng_state(), rng)
    kept = sum(int(m.sum()) for i in (0, 1) for m in pr.masks[i].values())
    assert kept == round(0.1 * pr.total)
    q = stage.layer(0).self_attn.q_proj.weight
    assert (q[~pr.masks[0]["self_attn.q_proj.weight"]] == 0).all()  # pruned weights are zero
    assert set(pr.kernels[0].values()) <= {0, 1}  # a measured choice per matrix
    x = torch.randn(1, 8, 32)
    cos, sin = model.model.rotary(8, x.dtype)
    stage.layer(0)(x, cos, sin).sum().backward()  # whichever kernel: it runs and differentiates
    # a migration's receiver sizes its buffers from the spec: it must name what the sender packs
    sent = pr.layer_state(0)
    spec = pr.layer_state_spec(0, stage.layer(0))
    assert sent and {k: (tuple(v.shape), v.dtype) for k, v in sent.items()} == spec


def test_pruning_to_sparsity_zero_masks_nothing_and_migrates_nothing():
    """`final_sparsity: 0` (a control run): no pruning step masks or times anything, and a migrated layer carries
    no masks, as its receiver expects (masks sent against an empty spec broke every migration)."""
    cfg = small(2)
    model = build_model(cfg)
    pr = build_dynamism("pruning", {"final_sparsity": 0.0, "start": 0, "every": 1, "steps": 2, "kernel": "auto"},
                        cfg=cfg)
    pr.prepare_model(model)
    stage = PipelineStage.from_model(model, 0, 2, first=True, last=True)
    for step in (1, 2):
        assert pr.update(SchemeContext(step=step, stage=stage, chain=PipeChain([0], 0), num_layers=2,
                                       rows=64)) is False
    assert pr.masks == {} and pr.level == 0.0
    assert pr.layer_state(0) == {} == pr.layer_state_spec(0, stage.layer(0))


# ---- cost accounting -------------------------------------------------------------------------------------------
def test_layer_token_flops_by_hand():
    cfg = small(2)  # D 32, H 4, G 2, K 8, F 64, T 16
    f = layer_token_flops(cfg, 0, 16)
    assert f == {"q_o": 2 * 32 * 32, "kv": 2 * 32 * 16, "attn": 2 * 8 * 32, "ffn": 3 * 32 * 64}
    moe = layer_token_flops(small(2, experts=4), 0, 16)
    assert moe["ffn"] == 2 * 3 * 32 * 16 + 32 * 4
    # a shared expert (as wide as shared_experts x expert_ffn_dim, or shared_ffn_dim) and its gate count too
    shared = dataclasses.replace(small(2, experts=4), moe=dataclasses.replace(small(2, experts=4).moe,
                                                                             shared_experts=2, shared_gate=True))
    assert layer_token_flops(shared, 0, 16)["ffn"] == moe["ffn"] + 3 * 32 * (2 * 16) + 32
    wide = dataclasses.replace(shared, moe=dataclasses.replace(shared.moe, shared_ffn_dim=40, shared_gate=False))
    assert layer_token_flops(wide, 0, 16)["ffn"] == moe["ffn"] + 3 * 32 * 40


def test_early_exit_cost_and_threshold_by_hand():
    cfg = small(4)
    ee = build_dynamism("early_exit", {"threshold": 0.9, "first_layer": 1, "start": 10, "ramp_steps": 10}, cfg=cfg)
    assert ee.tau(5) == 1.0 and ee.tau(15) == pytest.approx(0.95) and ee.tau(30) == pytest.approx(0.9)
    kv = (2 * 32 * 16) / (2 * 32 * 32 + 2 * 32 * 16 + 2 * 8 * 32 + 3 * 32 * 64)
    ee.set_global_stats(torch.tensor([100.0, 100.0, 50.0, 25.0, 100.0], dtype=torch.float64))
    assert ee.survival == [1.0, 1.0, 0.5, 0.25]
    assert ee.cost_factors(4) == pytest.approx([1.0, 1.0, kv + (1 - kv) * 0.5, kv + (1 - kv) * 0.25])


def _everyone_exits_at_1():
    """A 4-layer model, early exit from which every token leaves after layer 1, and 2 rows of 8 positions."""
    cfg = small(4)
    torch.manual_seed(0)
    model = build_model(cfg)
    ee = build_dynamism("early_exit", {"threshold": -1.0, "first_layer": 1}, cfg=cfg)
    ee.begin_step(1)
    h = torch.randn(2, 8, 32)
    return model, ee, h, *model.model.rotary(8, h.dtype)


def test_early_exit_layer_step_skips_exited_tokens():
    model, ee, h, cos, sin = _everyone_exits_at_1()
    carry = ee.init_carry(2, 8, h.device)
    for i in range(4):
        h = ee.layer_forward(i, model.model.layers[i], h, cos, sin, carry)
    assert ee.tokens_in.tolist() == [16.0, 16.0, 0.0, 0.0, 16.0]
    assert not carry["active"].any()


def test_early_exit_counts_the_real_tokens_of_padded_rows():
    """On a padded micro-batch (`ROW_TOKENS`, rows of 8 and 5 real tokens in 8 positions) padding runs and exits
    like a token, but the survival statistics count real tokens only, with the same single named read per layer."""
    from moebal.sync import audit

    model, ee, h, cos, sin = _everyone_exits_at_1()
    n_B = torch.tensor([8, 5])
    carry = {**ee.init_carry(2, 8, h.device, n_B), ROW_TOKENS: n_B}
    with audit() as a:
        for i in range(4):
            h = ee.layer_forward(i, model.model.layers[i], h, cos, sin, carry)
    assert ee.tokens_in.tolist() == [13.0, 13.0, 0.0, 0.0, 13.0]
    assert not carry["active"].any()  # padding exited too
    assert dict(a.counted) == {"early exit: active tokens": 4} and not a.unaccounted
    ee.set_global_stats(ee.local_stats())
    assert ee.survival == [1.0, 1.0, 0.0, 0.0]


@pytest.mark.parametrize("capacity", [0.25, 0.5, 0.75])
def test_mod_keeps_the_share_of_each_padded_rows_real_tokens(capacity):
    """A padded micro-batch under MoD: each row keeps round(c x its real tokens) of its real tokens, those the
    router scores highest, and its real positions come out as the row run alone, unpadded (fp32, 1e-5);
    padding fills the slots the longest row needs and never takes a real token's place."""
    from moebal.dynamism.mod import padded_selection
    from moebal.sync import audit

    cfg = small(4)
    torch.manual_seed(0)
    model = build_model(cfg)
    mod = build_dynamism("mod", {"capacity": capacity, "every": 2, "first_layer": 1}, cfg=cfg)
    mod.prepare_model(model)
    mod.begin_step(1)
    layer = model.model.layers[1]
    n = [12, 7, 3, 1]
    h = torch.randn(4, 12, 32)
    cos, sin = model.model.rotary(12, h.dtype)
    n_B = torch.tensor(n)
    score = layer.mod_router(h).squeeze(-1)
    pos = padded_selection(score, capacity, n_B)
    keep = [max(1, round(capacity * k)) for k in n]
    assert pos.shape == (4, max(keep))
    for b, k in enumerate(n):
        real = [p for p in pos[b].tolist() if p < k]
        assert real == sorted(real) and len(real) == keep[b]
        assert set(real) == set(torch.topk(score[b, :k], keep[b]).indices.tolist())
        assert pos[b].tolist() == real + list(range(k, k + max(keep) - keep[b]))  # then the first padding
    with audit() as a:
        out = mod.layer_forward(1, layer, h, cos, sin, {ROW_TOKENS: n_B})
    assert a.syncs == 0, a  # the plan's numbers are host values; the selection stays on the device
    for b, k in enumerate(n):
        alone = mod.layer_forward(1, layer, h[b:b + 1, :k], *model.model.rotary(k, h.dtype), {})
        torch.testing.assert_close(out[b:b + 1, :k], alone, rtol=1e-5, atol=1e-5)
    # every row full: the selection of the unpadded micro-batch
    full = torch.full((4,), 12)
    assert torch.equal(mod.layer_forward(1, layer, h, cos, sin, {ROW_TOKENS: full}),
                       mod.layer_forward(1, layer, h, cos, sin, {}))


def test_mod_cost_capacity_and_plain_layer_at_full_capacity():
    cfg = small(4)
    mod = build_dynamism("mod", {"capacity": 0.25, "every": 2, "first_layer": 1, "start": 0, "ramp_steps": 4},
                         cfg=cfg)
    mod.begin_step(2)
    assert mod.current_capacity() == pytest.approx(0.625)
    mod.begin_step(9)
    f = layer_token_flops(cfg, 1, 16)
    routed = ((f["q_o"] + f["kv"] + f["ffn"]) * 0.25 + f["attn"] * 0.0625) / sum(f.values())
    assert mod.cost_factors(4) == pytest.approx([1.0, routed, 1.0, routed])
    torch.manual_seed(0)
    model = build_model(cfg)
    state = torch.random.get_rng_state()
    mod.prepare_model(model)
    assert torch.equal(state, torch.random.get_rng_state())  # the routers' init draws from their own generator
    assert hasattr(model.model.layers[1], "mod_router") and not hasattr(model.model.layers[0], "mod_router")
    h = torch.randn(2, 8, 32)
    cos, sin = model.model.rotary(8, h.dtype)
    mod.begin_step(0)  # capacity 1.0: the dense layer
    assert torch.equal(mod.layer_forward(1, model.model.layers[1], h, cos, sin, {}),
                       model.model.layers[1](h, cos, sin))
    mod.begin_step(9)  # capacity 0.25: 2 of 8 tokens per row change
    out = mod.layer_forward(1, model.model.layers[1], h, cos, sin, {})
    assert ((out != h).any(dim=-1).sum(dim=1) == 2).all()


def test_freezing_criterion_freezes_a_prefix_and_the_embedding():
    cfg = small(4)
    torch.manual_seed(0)
    stage = PipelineStage.from_model(build_model(cfg), 0, 4, first=True, last=True)
    fr = build_dynamism("freezing", {"threshold": 0.05, "check_every": 2, "max_fraction": 0.5}, cfg=cfg)
    ctx = SchemeContext(step=0, stage=stage, chain=PipeChain([0], 0), num_layers=4)
    fr.on_start(ctx)
    with torch.no_grad():  # layers 0 and 2 barely move, layer 1 moves a lot: only layer 0 may freeze
        for i, scale in ((0, 1.001), (1, 1.5), (2, 1.001), (3, 1.001)):
            for p in stage.layer(i).parameters():
                p.mul_(scale)
    ctx.step = 1
    assert fr.update(ctx) is False  # not a check step
    ctx.step = 2
    assert fr.update(ctx) is True
    assert fr.frozen_prefix() == 1 and fr.plasticity[0] == pytest.approx(0.001, rel=1e-3)
    assert not any(p.requires_grad for p in stage.layer(0).parameters())
    assert not stage.model.embed_tokens.weight.requires_grad
    assert all(p.requires_grad for p in stage.layer(2).parameters())  # behind an unfrozen layer: stays
    assert fr.cost_factors(4) == [FORWARD_SHARE, 1.0, 1.0, 1.0]
    ctx.step = 4  # nothing moved since: layers 1 then 2 freeze, up to max_fraction (2 of 4)
    assert fr.update(ctx) is True and fr.frozen_prefix() == 2


def test_moe_routing_cost_factor_by_hand():
    f = {"q_o": 10.0, "kv": 5.0, "attn": 5.0, "ffn": 80.0}
    # 100 tokens x top-2 = 200 assignments; 20 dropped by capacity: the FFN does 90% of its work
    assert routing_cost_factor(f, [60, 60, 40, 20], 100, 2) == pytest.approx((20 + 80 * 0.9) / 100)
    # expert parallel over 4 ranks: the busiest expert (60) sets the time, as if 240 rows
    assert routing_cost_factor(f, [60, 60, 40, 20], 100, 2, ranks=4) == pytest.approx((20 + 96) / 100)
    # over 2 ranks of 2 experts: the first rank computes 120 rows, as if 240 in all
    assert routing_cost_factor(f, [60, 60, 40, 20], 100, 2, ranks=2) == pytest.approx((20 + 96) / 100)
    assert routing_cost_factor(f, [60, 20, 40, 60], 100, 2, ranks=2) == pytest.approx((20 + 80) / 100)
    # a placement whose busiest rank computes 1.1x the mean (replicas took part of the first rank's 120 rows):
    # 180 assignments x 1.1, whatever the owners
    assert routing_cost_factor(f, [60, 60, 40, 20], 100, 2, ranks=2, imbalance=1.1) == \
        pytest.approx((20 + 80 * 198 / 200) / 100)


def test_build_dynamism_errors():
    cfg = small(4)
    with pytest.raises(ConfigError, match="unknown dynamism scheme"):
        build_dynamism("hashed_attention", {}, cfg=cfg)
    with pytest.raises(ConfigError, match="bad options"):
        build_dynamism("mod", {"capacty": 0.5}, cfg=cfg)
    with pytest.raises(ConfigError, match="capacity"):
        build_dynamism("mod", {"capacity": 0.0}, cfg=cfg)
    with pytest.raises(ConfigError, match="first_layer"):
        build_dynamism("early_exit", {"first_layer": 4}, cfg=cfg)
    # exits follow layers first_layer .. L - 2: after the last but one layer, or on 2 layers by default, none could
    with pytest.raises(ConfigError, match=r"first_layer must be in \[0, 2\] \(the last of the 4 layers always runs\); "
                                          "got 3"):
        build_dynamism("early_exit", {"first_layer": 3}, cfg=cfg)
    with pytest.raises(ConfigError, match=r"in \[0, 0\] .*; got null, max\(1, n_layers // 4\) = 1"):
        build_dynamism("early_exit", {}, cfg=small(2))
    assert build_dynamism("early_exit", {"first_layer": 0}, cfg=small(2)).first_layer == 0
    with pytest.raises(ConfigError, match="kernel"):
        build_dynamism("pruning", {"kernel": "sputnik"}, cfg=cfg)


def _mod_on_a_small_model(**options: str) -> tuple:
    """MoD at capacity 0.25 on layer 1 of a 4-layer model (step 1), and a batch of 2 rows of 8 tokens:
    (mod, model, layer 1, h, cos, sin)."""
    cfg = small(4)
    torch.manual_seed(0)
    model = build_model(cfg)
    h = torch.randn(2, 8, 32)
    cos, sin = model.model.rotary(8, h.dtype)
    mod = build_dynamism("mod", {"capacity": 0.25, "every": 2, "first_layer": 1, **options}, cfg=cfg)
    mod.prepare_model(model)
    mod.begin_step(1)
    return mod, model, model.model.layers[1], h, cos, sin


def test_mod_routed_block_leaves_bf16_autocast_on_cpu_when_it_keeps_few_tokens():
    outs = {}
    for precision in ("auto", "autocast"):
        mod, _, layer, h, cos, sin = _mod_on_a_small_model(subset_precision=precision)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            outs[precision] = mod.layer_forward(1, layer, h, cos, sin, {})
            assert mod._fp32_subset(layer, h.device, 2, 8) == (precision == "auto")
            assert not mod._fp32_subset(layer, h.device, 6, 8)  # keeps most of the row: the run's precision
        assert not mod._fp32_subset(layer, h.device, 2, 8)  # no autocast: nothing to leave
    with torch.autocast("cpu", dtype=torch.bfloat16):  # the same selection, the block computed in fp32 by hand
        score = layer.mod_router(h).squeeze(-1)
    pos = torch.topk(score, 2, dim=1).indices.sort(dim=1).values
    weight = torch.sigmoid(score.gather(1, pos)).float()
    ref = subset_block(layer, h, cos, sin, pos, None, keys="subset", scale_BQ=weight)
    assert torch.equal(outs["auto"], ref)
    assert not torch.equal(outs["autocast"], ref)  # bf16 inside
    torch.testing.assert_close(outs["autocast"], ref, rtol=0.05, atol=0.05)


def test_mod_routed_block_with_bf16_weights_stays_under_autocast():
    # parallel.param_dtype bf16: the layer's weights are bf16 copies; leaving autocast for fp32 met them with fp32
    # activations (F.linear: "expected m1 and m2 to have the same dtype")
    mod, _, layer, h, cos, sin = _mod_on_a_small_model()
    cfg = mod.cfg
    ref = {}
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref["fp32 weights"] = mod.layer_forward(1, layer, h, cos, sin, {})
        layer.to(torch.bfloat16)
        assert not mod._fp32_subset(layer, h.device, 2, 8)
        out = mod.layer_forward(1, layer, h, cos, sin, {})
    assert out.dtype == h.dtype and torch.isfinite(out).all()
    torch.testing.assert_close(out, ref["fp32 weights"], rtol=0.05, atol=0.05)
    bf16 = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, param_dtype="bf16"),
                               train=dataclasses.replace(cfg.train, precision="bf16"))
    with pytest.raises(ConfigError, match="subset_precision fp32"):
        build_dynamism("mod", {"subset_precision": "fp32"}, cfg=bf16)


def test_mixture_of_depths_forgets_a_layer_that_left_the_stage():
    """Its predictor figures (accuracy, recall, precision) are reported by the stage that holds the layer."""
    mod = build_dynamism("mod", {"capacity": 0.5, "every": 2, "first_layer": 1, "predictor": 8}, cfg=small(4))
    mod.accuracy = {1: torch.tensor([0.9, 0.8, 0.7]), 3: torch.tensor([0.6, 0.5, 0.4])}
    assert set(mod.metrics()["predictor_accuracy"]) == {1, 3}
    mod.drop_layer(3)
    assert mod.metrics()["predictor_accuracy"] == {1: 0.9}


@pytest.mark.parametrize("scheme,key", [("early_exit", "start"), ("early_exit", "ramp_steps"), ("mod", "start"),
                                        ("mod", "ramp_steps"), ("freezing", "start"), ("pruning", "start"),
                                        ("sparse_attention", "start")])
def test_a_negative_step_setting_is_refused_naming_it(scheme, key):
    """`start` and `ramp_steps` are step counts: -1 once read as 0 (the scheme set in at once)."""
    with pytest.raises(ConfigError, match=rf"dynamism\.{scheme}\.{key} is a step count, >= 0; got -1"):
        build_dynamism(scheme, {key: -1, **({"block": 8} if scheme == "sparse_attention" else {})}, cfg=small())
