"""The sparse_attention scheme on one process: its budget rules, its cost model, its recomputation and its
refusals."""

from __future__ import annotations

import math

import pytest
import torch

from moebal.config import from_dict, to_dict
from moebal.dynamism.scheme import build_dynamism, layer_token_flops
from moebal.errors import ConfigError
from moebal.kernels.sparse_attention import coverage_density, kept_fraction


def cfg(seq: int = 64, **model):
    return from_dict({"model": {"dim": 32, "n_layers": 4, "n_heads": 4, "n_kv_heads": 2, "ffn_dim": 64,
                                "max_seq_len": seq, **model},
                      "moe": {"num_experts": 0}, "data": {"seq_len": seq, "batch_size": 2}})


class _Ctx:
    def __init__(self, step: int) -> None:
        self.step = step


def test_coverage_density_on_hand_made_scores() -> None:
    inf = float("-inf")
    # 3 query blocks; block 1 puts all mass on one key block, block 2 spreads it evenly over three
    s = torch.tensor([[0.0, inf, inf], [10.0, -10.0, inf], [0.0, 0.0, 0.0]]).view(1, 1, 3, 3)
    # coverage 0.9: needs 1, 1, 3 blocks of 1 + 2 + 3 = 6
    assert float(coverage_density(s, 0.9)) == pytest.approx(5 / 6)
    # coverage 0.5: 1, 1, 2
    assert float(coverage_density(s, 0.5)) == pytest.approx(4 / 6)


def test_random_walk_stays_in_bounds_moves_and_is_seeded() -> None:
    c = cfg()
    opts = {"budget": "random_walk", "block": 16, "min_density": 0.2, "max_density": 0.9, "walk_step": 0.1,
            "start": 1}
    a, b = build_dynamism("sparse_attention", opts, cfg=c), build_dynamism("sparse_attention", opts, cfg=c)
    seen = []
    for step in range(1, 8):
        for s in (a, b):
            s.begin_step(step)
        assert a.ran == b.ran
        seen.append(a.ran)
        if step == 1:
            assert a.ran == [1.0] * 4  # dense until start
        else:
            assert all(0.2 <= d <= 0.9 for d in a.ran)
        if step >= 3:
            assert all(abs(x - y) <= 0.1 + 1e-12 for x, y in zip(seen[-1], seen[-2]))
        for s in (a, b):
            s.update(_Ctx(step))
    assert len({tuple(d) for d in seen[1:]}) == 6


def _walk(opts: dict, steps: int) -> list[list[float]]:
    s = build_dynamism("sparse_attention", {"budget": "random_walk", "block": 16, "start": 1, **opts},
                       cfg=cfg(n_layers=5))
    seen = []
    for step in range(1, steps + 1):
        s.begin_step(step)
        seen.append(list(s.ran))
        s.update(_Ctx(step))
    return seen[1:]


def test_depth_tilt_gives_each_layer_its_band() -> None:
    base = {"min_density": 0.1, "max_density": 1.0, "walk_step": 0.3}
    # no tilt: the walk's numbers exactly as without the option
    assert _walk({**base, "depth_tilt": 0.0}, 12) == _walk(base, 12)
    # tilt 0.5: layer i of 5 walks in a band 0.45 wide whose top slides from 1.0 (layer 0) to 0.55 (layer 4)
    bands = [(0.1 + 0.45 * (1 - i / 4), 1.0 - 0.45 * i / 4) for i in range(5)]
    seen = _walk({**base, "depth_tilt": 0.5}, 30)
    for row in seen:
        assert all(lo - 1e-12 <= d <= hi + 1e-12 for d, (lo, hi) in zip(row, bands))
    assert len({tuple(r) for r in seen}) == len(seen)  # it still moves
    means = [sum(r[i] for r in seen) / len(seen) for i in range(5)]
    assert means[0] > means[2] > means[4]
    # tilt 1: a fixed ramp from max_density to min_density
    assert _walk({**base, "depth_tilt": 1.0}, 4) == [pytest.approx([1.0, 0.775, 0.55, 0.325, 0.1])] * 3
    with pytest.raises(ConfigError, match="depth_tilt"):
        build_dynamism("sparse_attention", {"budget": "random_walk", "block": 16, "depth_tilt": 1.5}, cfg=cfg())


def test_coverage_rule_sets_the_next_density_from_the_chain_sums() -> None:
    s = build_dynamism("sparse_attention", {"budget": "coverage", "block": 16, "min_density": 0.3}, cfg=cfg())
    s.begin_step(1)
    # per layer: summed needed share, then the number of rows it was measured on
    s.set_global_stats(torch.tensor([1.2, 0.4, 3.0, 0.0, 2.0, 2.0, 3.0, 0.0], dtype=torch.float64))
    s.update(_Ctx(1))
    assert s.density == pytest.approx([0.6, 0.3, 1.0, 1.0])  # 0.2 raised to min_density; layer 3 unmeasured


def test_cost_model_is_the_flops_model_with_the_measured_weights() -> None:
    c = cfg(seq=64)
    s = build_dynamism("sparse_attention", {"block": 16, "attn_weight": 2.0, "overhead": 0.1}, cfg=c)
    s.density = [1.0, 0.5, 0.25, 0.999]
    f = layer_token_flops(c, 0, 64)
    other, attn = f["q_o"] + f["kv"] + f["ffn"], 2.0 * f["attn"]
    want = [1.0] + [(other + attn * (0.1 + kept_fraction(64, 16, d))) / (other + attn) for d in (0.5, 0.25, 0.999)]
    assert s.cost_factors(4) == pytest.approx(want)
    assert want[2] < want[1] < 1.0 < want[3]  # below density 1 the sparse path's overhead can exceed the saving


def _scheme_points(c, w: float, o: float, densities=(0.75, 0.5, 0.25, 0.1)) -> list[tuple[float, float]]:
    """(kept share, the scheme's factor) of layer 0 at each density, under constants w and o."""
    s = build_dynamism("sparse_attention", {"block": 32, "attn_weight": w, "overhead": o}, cfg=c)
    out = []
    for d in densities:
        s.density = [d] * 4
        out.append((kept_fraction(256, 32, d), s.cost_factors(4)[0]))
    return out


def test_fitted_constants_reproduce_the_schemes_own_factors() -> None:
    """`fit_cost_constants` inverts the scheme's cost model: factors the scheme predicts under (w, o) give back
    (w, o); with o below 0, which the scheme refuses, it fits o = 0 and the least-squares slope through 0."""
    from moebal.planner.sparse_blocks import fit_cost_constants

    c = cfg(seq=256)
    f = layer_token_flops(c, 0, 256)
    other, attn = f["q_o"] + f["kv"] + f["ffn"], f["attn"]
    for w, o in ((1.6, 0.22), (3.0, 0.0), (0.5, 0.6)):
        assert fit_cost_constants(_scheme_points(c, w, o), other, attn) == pytest.approx((w, o), abs=1e-9)
    # a sparse path cheaper than the dense one at equal kept share (o = -0.1) is outside the model: o = 0
    pts = [(k, m - 0.02) for k, m in _scheme_points(c, 1.6, 0.0)]
    w, o = fit_cost_constants(pts, other, attn)
    xs, ys = [k - m for k, m in pts], [m - 1 for _, m in pts]
    assert o == 0.0 and w == pytest.approx(sum(x * y for x, y in zip(xs, ys)) / sum(x * x for x in xs) * other / attn)
    with pytest.raises(ValueError, match="at least two densities"):
        fit_cost_constants(pts[:1], other, attn)
    with pytest.raises(ValueError, match="do not fall with the kept share"):
        fit_cost_constants([(0.75, 0.7), (0.25, 0.9)], other, attn)  # cheaper where more blocks are kept


class _Chain:
    """A chain of one stage: the sum over it is the vector itself."""

    def allreduce_sum(self, vec: torch.Tensor) -> torch.Tensor:
        return vec.clone()


def _attention_factors(c, block: int, w: float, o: float) -> list[float]:
    """What `measure_attention_factors` would time if the device ran the attention module exactly as the scheme's
    model says under (w, o): (q_o + kv + w attn (o + f)) / (q_o + kv + w attn) at COST_DENSITIES."""
    from moebal.dynamism.sparse_attention import COST_DENSITIES

    T = c.data.seq_len
    f = layer_token_flops(c, 0, T)
    other, attn = f["q_o"] + f["kv"], w * f["attn"]
    return [(other + attn * (o + kept_fraction(T, block, d))) / (other + attn) for d in COST_DENSITIES]


def test_measured_costs_fit_the_constants_and_travel_in_the_checkpoint(capsys) -> None:
    """`costs: measure`: the factors timed at start-up are fitted to (w, o) (here factors the model itself gives
    under w 2.5, o 0.05 come back exactly), the prediction then uses them, the metrics and the checkpoint carry
    them, and a run resumed from it plans with them (not with its own measurement); `costs: given` keeps its own."""
    from moebal.dynamism.scheme import SchemeContext

    c = cfg(seq=256)
    s = build_dynamism("sparse_attention", {"block": 32, "costs": "measure"}, cfg=c)
    assert (s.attn_weight, s.overhead, s.cost_source) == (1.6, 0.22, "given")
    ctx = SchemeContext(step=0, stage=None, chain=_Chain(), num_layers=4, rows=256, device=torch.device("cpu"))
    s.measure_costs(ctx, factors=_attention_factors(c, 32, 2.5, 0.05))
    assert (s.attn_weight, s.overhead) == pytest.approx((2.5, 0.05), abs=1e-9) and s.cost_source == "measured"
    assert "cost constants measured: attn_weight 2.500, overhead 0.050" in capsys.readouterr().err
    s.density = [0.5] * 4
    assert s.metrics()["attention_cost_constants"] == [2.5, 0.05]
    same = build_dynamism("sparse_attention", {"block": 32, "attn_weight": 2.5, "overhead": 0.05}, cfg=c)
    same.density = [0.5] * 4
    assert s.cost_factors(4) == pytest.approx(same.cost_factors(4), abs=1e-12)
    state = s.state_dict()
    resumed = build_dynamism("sparse_attention", {"block": 32, "costs": "measure"}, cfg=c)
    resumed.measure_costs(ctx, factors=_attention_factors(c, 32, 1.0, 0.3))  # its own start-up measurement
    resumed.load_state_dict(state)
    assert (resumed.attn_weight, resumed.overhead, resumed.cost_source) == (s.attn_weight, s.overhead, "measured")
    given = build_dynamism("sparse_attention", {"block": 32, "costs": "given", "attn_weight": 3.0}, cfg=c)
    given.load_state_dict(state)
    assert (given.attn_weight, given.overhead, given.cost_source) == (3.0, 0.22, "given")


def test_a_measurement_that_cannot_be_fitted_keeps_the_given_constants(capsys) -> None:
    from moebal.dynamism.scheme import SchemeContext

    c = cfg(seq=256)
    s = build_dynamism("sparse_attention", {"block": 32, "attn_weight": 1.2, "overhead": 0.3}, cfg=c)
    ctx = SchemeContext(step=0, stage=None, chain=_Chain(), num_layers=4, rows=256, device=torch.device("cpu"))
    s.measure_costs(ctx, factors=[1.1, 1.2, 1.3, 1.4])  # dearer the fewer blocks it keeps: no weight fits
    assert (s.attn_weight, s.overhead) == (1.2, 0.3)
    assert s.cost_source.startswith("given (the measurement was not fitted: the measured times do not fall")
    assert "cost constants given (the measurement was not fitted" in capsys.readouterr().err
    assert s.state_dict()["cost_source"] == s.cost_source
    with pytest.raises(ConfigError, match="costs must be measure .* or given"):
        build_dynamism("sparse_attention", {"block": 32, "costs": "fitted"}, cfg=c)


def test_measuring_the_attention_times_this_device_and_draws_no_random_numbers() -> None:
    """The real timing (a small CPU shape): four factors, the run's RNG state untouched (the losses of a run
    do not depend on whether it measured)."""
    from moebal.dynamism.sparse_attention import COST_DENSITIES, measure_attention_factors

    c = cfg(seq=256)
    before = torch.random.get_rng_state()
    got = measure_attention_factors(c, 32, 512, torch.device("cpu"), repeats=2)
    assert torch.equal(torch.random.get_rng_state(), before)
    assert len(got) == len(COST_DENSITIES) and all(0.0 < m < 10.0 for m in got)


def test_a_split_layers_halves_add_up_to_the_whole_layers_prediction() -> None:
    """Attention half x (its dense multiply-adds) + FFN half x (the FFN's) = whole layer x (the layer's)."""
    from moebal.pipeline.units import UnitMap

    c = cfg(seq=64)
    s = build_dynamism("sparse_attention", {"block": 16, "attn_weight": 2.0, "overhead": 0.1}, cfg=c)
    s.density = [1.0, 0.5, 0.25, 0.999]
    units = UnitMap.build(4, [1, 2, 3])
    got = s.unit_cost_factors(units)
    assert len(got) == 7 and got[0] == 1.0 and got[2::2] == [1.0] * 3  # layer 0 whole and dense; the FFN halves
    f = layer_token_flops(c, 0, 64)
    half, ffn = f["q_o"] + f["kv"] + 2.0 * f["attn"], f["ffn"]
    for a, whole in zip(got[1::2], s.cost_factors(4)[1:]):
        assert a * half + ffn == pytest.approx(whole * (half + ffn))
    assert got[1] < s.cost_factors(4)[1] < 1.0  # the saving concentrates in the attention half
    assert s.unit_cost_factors(UnitMap.whole(4)) == s.cost_factors(4)


def test_the_attention_half_then_the_plain_ffn_half_is_the_layer() -> None:
    from moebal.models import build_model

    c = cfg()
    torch.manual_seed(0)
    m = build_model(c)
    s = build_dynamism("sparse_attention", {"block": 16, "budget": "random_walk", "start": 0}, cfg=c)
    s.begin_step(1)
    s.density = [0.4] * 4
    h = torch.randn(2, 64, 32)
    cos, sin = m.model.rotary(64, torch.float32)
    layer = m.model.layers[2]
    whole = s.layer_forward(2, layer, h, cos, sin, {})
    halves = layer.ffn_part(s.attention_half(2, layer, h, cos, sin))
    torch.testing.assert_close(halves, whole, rtol=0, atol=0)
    s.density = [1.0] * 4
    assert not torch.equal(halves, s.layer_forward(2, layer, h, cos, sin, {}))  # the density mattered


@pytest.mark.parametrize("opts,match", [({"block": 48}, "block"), ({"block": 64}, "block"),
                                        ({"budget": "hash"}, "budget"), ({"min_density": 0.0}, "min_density"),
                                        ({"coverage": 1.5}, "coverage")])
def test_bad_options_are_refused(opts, match) -> None:
    with pytest.raises(ConfigError, match=match):
        build_dynamism("sparse_attention", {"block": 16, **opts}, cfg=cfg())


def _recompute_step(c, mode: str, split: bool) -> tuple:
    """One forward + backward of layer 1 (an MoE layer with router jitter, or dense) through the scheme (coverage
    budget, density 0.4) under `train.recompute` `mode`: output, every gradient, the step's coverage statistics
    and the query projection's forward count (the attention replayed or not)."""
    from moebal.models import build_model
    from moebal.models.recompute import set_recompute

    torch.manual_seed(0)
    m = build_model(c)
    set_recompute(m, mode)
    s = build_dynamism("sparse_attention", {"block": 16, "budget": "coverage", "start": 0}, cfg=c)
    s.begin_step(1)
    s.density = [0.4] * 4
    layer = m.model.layers[1]
    calls = [0]
    layer.self_attn.q_proj.register_forward_pre_hook(lambda *a: calls.__setitem__(0, calls[0] + 1))
    h = torch.randn(2, 64, 32, requires_grad=True)
    cos, sin = m.model.rotary(64, torch.float32)
    torch.manual_seed(7)  # router jitter
    out = (layer.ffn_part(s.attention_half(1, layer, h, cos, sin)) if split
           else s.layer_forward(1, layer, h, cos, sin, {}))
    aux = layer.block_sparse_moe.aux_loss if layer.is_moe else torch.zeros(())
    (out.square().mean() + aux).backward()
    grads = {n: p.grad.clone() for n, p in layer.named_parameters() if p.grad is not None}
    return out.detach(), {**grads, "h": h.grad.clone()}, s.local_stats(), calls[0]


@pytest.mark.parametrize("split", [False, True], ids=["whole", "halves"])
@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_recomputation_is_bitwise_exact_and_counts_the_statistics_once(split, moe) -> None:
    """The scheme runs the attention itself and recomputes it itself: every mode gives the output, gradients and
    coverage statistics of none, bit for bit, and the attention runs twice where the mode recomputes it."""
    c = from_dict({**to_dict(cfg()), "moe": {"num_experts": 4 if moe else 0, "top_k": 2, "jitter": 0.1,
                                             "expert_ffn_dim": 32, "kernel": "loop"}})
    ref = _recompute_step(c, "none", split)
    assert ref[3] == 1 and float(ref[2][c.model.n_layers + 1]) == 2.0  # measured once, on 2 rows
    for mode, attn_runs in (("moe", 1), ("attention", 2), ("full", 2)):
        got = _recompute_step(c, mode, split)
        assert torch.equal(got[0], ref[0]), mode
        assert got[1].keys() == ref[1].keys() and all(torch.equal(got[1][k], ref[1][k]) for k in ref[1]), mode
        assert torch.equal(got[2], ref[2]), mode  # the replay adds nothing to the statistics
        assert got[3] == attn_runs, (mode, got[3])


def test_sliding_window_is_refused() -> None:
    with pytest.raises(ConfigError, match="sliding_window"):
        build_dynamism("sparse_attention", {"block": 16}, cfg=cfg(sliding_window=16))


def test_the_layer_at_density_one_is_the_plain_layer() -> None:
    from moebal.models import build_model

    c = cfg()
    torch.manual_seed(0)
    m = build_model(c)
    s = build_dynamism("sparse_attention", {"block": 16, "budget": "coverage"}, cfg=c)
    s.begin_step(1)  # coverage measures from step 0: the scheme's own attention path runs at density 1
    h = torch.randn(2, 64, 32)
    cos, sin = m.model.rotary(64, torch.float32)
    layer = m.model.layers[1]
    torch.testing.assert_close(s.layer_forward(1, layer, h, cos, sin, {}), layer(h, cos, sin), rtol=0, atol=0)
    assert s.needed[s.L + 1] == 2  # the coverage statistics counted the two rows


@pytest.mark.parametrize("T", [5, 16, 37, 48])
def test_a_prefix_of_any_length_keeps_its_real_rows_selection(T: int) -> None:
    """`moebal generate` runs a sparse-attention run on prefixes of every length; training rows hold whole blocks.
    On a prefix that ends inside a block, each query block keeps the key blocks its causal pooled query (the mean
    of the `block` queries ending at its first row, written out here) ranks highest, and the output is dense
    attention under that selection's mask, to 1e-5; on whole blocks the same reference holds."""
    from moebal.dynamism.sparse_attention import sparse_attention_forward
    from moebal.kernels.sparse_attention import dense_block_attention, select_from_scores
    from moebal.models.transformer import Attention, Rotary, apply_rotary

    torch.manual_seed(0)
    block, density = 8, 0.4
    attn = Attention(32, 4, 2, 8)
    x = torch.randn(2, T, 32)
    cos, sin = Rotary(8, 64, 500.0)(T, torch.float32)
    with torch.no_grad():
        got, _ = sparse_attention_forward(attn, x, cos, sin, density, block)
        q = apply_rotary(attn.project(x, attn.q_proj, 4, "q_norm"), cos, sin)
        k = apply_rotary(attn.project(x, attn.k_proj, 2, "k_norm"), cos, sin)
        v = attn.v_proj(x).view(2, T, 2, 8).transpose(1, 2)
        N = -(-T // block)
        q_pad = torch.nn.functional.pad(q, (0, 0, block - 1, 0))  # row t + block - 1 holds query t
        qm = torch.stack([q_pad[:, :, n * block:(n + 1) * block].mean(2) for n in range(N)], 2)  # [B, H, N, K]
        qm = qm.view(2, 2, 2, N, 8).mean(2)  # a group's heads averaged
        km = torch.stack([k[:, :, n * block:(n + 1) * block].mean(2) for n in range(N)], 2)
        s = (qm @ km.transpose(-1, -2) / 8 ** 0.5).masked_fill(torch.ones(N, N, dtype=torch.bool).triu(1), -math.inf)
        sel = select_from_scores(s, block, density)
        pad = N * block - T
        ref = dense_block_attention(*(torch.nn.functional.pad(t, (0, 0, 0, pad)) for t in (q, k, v)), sel)[:, :, :T]
        want = attn.o_proj(ref.transpose(1, 2).reshape(2, T, 32))
    assert (got - want).abs().max().item() < 1e-5


def test_no_position_depends_on_a_later_token() -> None:
    """The layer is causal at every density: changing the input at position t leaves every earlier position's output
    bit for bit, including the rows of t's own query block before it (a block's own mean query as its score made
    them depend on later rows, their next-token targets included), while the selection does move with the data."""
    from moebal.dynamism.sparse_attention import sparse_attention_forward
    from moebal.models.transformer import Attention, Rotary

    torch.manual_seed(0)
    block, T = 4, 32
    attn = Attention(32, 4, 2, 8)
    cos, sin = Rotary(8, 64, 500.0)(T, torch.float32)
    x = torch.randn(3, T, 32)
    moved = 0
    with torch.no_grad():
        for density in (0.3, 0.6):
            base, s_base = sparse_attention_forward(attn, x, cos, sin, density, block)
            for t in (5, 14, 27, 31):  # inside blocks and at a block's end
                y = x.clone()
                y[:, t] = torch.randn(3, 32) * 3
                out, s = sparse_attention_forward(attn, y, cos, sin, density, block)
                assert torch.equal(out[:, :t], base[:, :t]), (density, t)
                assert not torch.equal(out[:, t], base[:, t])
                moved += int(not torch.equal(s, s_base))
    assert moved > 0  # the scores read the data (a selection independent of it would pass vacuously)
