"""MoELayer parity against a naive per-expert loop (HF Mixtral's block), and its interface.

Shape legend: T tokens, D dim, E experts, K top_k.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import moebal
from moebal.config import load
from moebal.models.moe import MoELayer
from moebal.routing import RoutingStats

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny tensors (tests/conftest.py)


def naive_moe(layer: MoELayer, x: torch.Tensor) -> torch.Tensor:
    """HF Mixtral's sparse block, written plainly: softmax, top-k, renormalise, per-expert loop, index_add."""
    x_TD = x.reshape(-1, layer.dim)
    logits_TE = layer.gate(x_TD)
    if layer.router == "mlp_tanh":
        logits_TE = layer.gate_out(torch.tanh(logits_TE))
    probs_TE = torch.softmax(logits_TE.float(), dim=-1)
    w_TK, idx_TK = probs_TE.topk(layer.top_k, dim=-1)
    w_TK = (w_TK / w_TK.sum(-1, keepdim=True)).to(x.dtype) * layer.spec.score_scale
    out_TD = torch.zeros_like(x_TD)
    ex = layer.experts
    for e in range(layer.num_experts):
        t, j = torch.where(idx_TK == e)
        h = x_TD[t]
        y = F.linear(F.silu(F.linear(h, ex.w1[e])) * F.linear(h, ex.w3[e]), ex.w2[e])
        out_TD = out_TD.index_add(0, t, y * w_TK[t, j, None])
    if layer.shared_expert is not None:
        out_TD = out_TD + layer.shared_expert(x_TD)
    return out_TD.view(x.shape)


def dense_swiglu(x: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    return F.linear(F.silu(F.linear(x, w1)) * F.linear(x, w3), w2)


def grads(module: torch.nn.Module, x: torch.Tensor, fn) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    module.zero_grad()
    x = x.detach().clone().requires_grad_()
    out = fn(x)
    (out * torch.linspace(-1, 1, out.numel()).view(out.shape)).sum().backward()
    return out.detach(), {"x": x.grad.clone(), **{n: p.grad.clone() for n, p in module.named_parameters()}}


@pytest.mark.parametrize("kernel", ["loop", "grouped_mm"])
@pytest.mark.parametrize("router", ["linear", "mlp_tanh"])
def test_forward_and_gradients_match_naive_loop(kernel: str, router: str) -> None:
    torch.manual_seed(0)
    layer = MoELayer(16, 24, 5, 2, kernel=kernel, router=router, shared_ffn_dim=8, score_scale=1.5,
                     aux_loss_coef=0.0, init_std=0.2)
    x = torch.randn(3, 7, 16)
    out, g = grads(layer, x, layer)
    ref, g_ref = grads(layer, x, lambda x: naive_moe(layer, x))
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    assert g.keys() == g_ref.keys()
    for name in g:
        torch.testing.assert_close(g[name], g_ref[name], rtol=1e-5, atol=1e-6, msg=name)
    assert g["gate.weight"].abs().sum() > 0  # the router is trained through the combine weights


def test_one_expert_is_a_dense_swiglu() -> None:
    torch.manual_seed(1)
    layer = MoELayer(12, 20, 1, 1, init_std=0.3)
    x = torch.randn(9, 12)
    e = layer.experts
    torch.testing.assert_close(layer(x), dense_swiglu(x, e.w1[0], e.w3[0], e.w2[0]), rtol=1e-5, atol=1e-6)


def test_grouped_mm_equals_loop_with_empty_experts() -> None:
    torch.manual_seed(2)
    a = MoELayer(8, 16, 6, 2, kernel="loop", init_std=0.3)
    b = MoELayer(8, 16, 6, 2, kernel="grouped_mm")
    b.load_state_dict(a.state_dict())
    with torch.no_grad():
        a.gate.weight[3:] = -a.gate.weight[3:].abs() - 1.0  # positive tokens never choose experts 3..5
        a.gate.weight[:3] = a.gate.weight[:3].abs() + 1.0
        b.gate.weight.copy_(a.gate.weight)
    x = torch.randn(11, 8).abs()
    out_a, g_a = grads(a, x, a)
    out_b, g_b = grads(b, x, b)
    assert a.last_stats is not None and a.last_stats.counts_E[3:].sum() == 0
    torch.testing.assert_close(out_a, out_b)
    for name in g_a:
        torch.testing.assert_close(g_a[name], g_b[name], msg=name)


def test_dropless_equals_capacity_too_large_to_drop() -> None:
    torch.manual_seed(3)
    a = MoELayer(8, 16, 4, 2, None, init_std=0.3)
    b = MoELayer(8, 16, 4, 2, 100.0)
    b.load_state_dict(a.state_dict())
    x = torch.randn(2, 13, 8)
    torch.testing.assert_close(a(x), b(x))
    assert b.last_stats is not None and int(b.last_stats.dropped) == 0


@pytest.mark.parametrize("gate", ["softmax_topk", "topk_softmax"])
def test_adaptive_extremes_equal_top1_and_topk(gate: str) -> None:
    torch.manual_seed(4)
    x = torch.randn(40, 8)
    base = MoELayer(8, 16, 6, 3, gate=gate, init_std=0.5)
    top1 = MoELayer(8, 16, 6, 1, gate=gate)
    t0 = MoELayer(8, 16, 6, 3, gate=gate, adaptive_threshold=0.0)
    t1 = MoELayer(8, 16, 6, 3, gate=gate, adaptive_threshold=1.0)
    for m in (top1, t0, t1):
        m.load_state_dict(base.state_dict())
    torch.testing.assert_close(t0(x), top1(x), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(t1(x), base(x), rtol=1e-5, atol=1e-6)
    assert t0.last_stats is not None and t0.last_stats.used_K.tolist() == [40, 0, 0]
    assert t1.last_stats is not None and t1.last_stats.used_K.tolist() == [0, 0, 40]


def test_gate_orders_agree() -> None:
    torch.manual_seed(5)
    a = MoELayer(8, 16, 6, 2, gate="softmax_topk", init_std=0.3)
    b = MoELayer(8, 16, 6, 2, gate="topk_softmax")
    b.load_state_dict(a.state_dict())
    x = torch.randn(30, 8)
    torch.testing.assert_close(a(x), b(x), rtol=1e-5, atol=1e-6)


@settings(max_examples=15, deadline=None)
@given(tokens=st.integers(1, 40), dim=st.integers(1, 12), ffn=st.integers(1, 12), experts=st.integers(1, 7),
       data=st.data())
def test_random_shapes_match_naive(tokens: int, dim: int, ffn: int, experts: int, data: st.DataObject) -> None:
    k = data.draw(st.integers(1, experts))
    kernel = data.draw(st.sampled_from(["loop", "auto"]))
    torch.manual_seed(tokens * 31 + dim)
    layer = MoELayer(dim, ffn, experts, k, kernel=kernel, init_std=0.4)
    x = torch.randn(tokens, dim)
    out, g = grads(layer, x, layer)
    ref, g_ref = grads(layer, x, lambda x: naive_moe(layer, x))
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)
    for name in g:
        torch.testing.assert_close(g[name], g_ref[name], rtol=1e-4, atol=1e-5, msg=name)


def test_bf16_and_autocast_close_to_fp32() -> None:
    torch.manual_seed(6)
    layer = MoELayer(16, 32, 4, 2, init_std=0.2)
    x = torch.randn(20, 16)
    ref = layer(x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = layer(x)
    assert out.dtype == x.dtype
    torch.testing.assert_close(out, ref, rtol=0.05, atol=0.02)
    low = MoELayer(16, 32, 4, 2).to(torch.bfloat16)
    low.load_state_dict(layer.state_dict())
    out16 = low(x.bfloat16())
    assert out16.dtype == torch.bfloat16
    torch.testing.assert_close(out16.float(), ref, rtol=0.05, atol=0.02)
    torch.testing.assert_close(out, out16.float(), rtol=0, atol=0)  # autocast really computes in bf16


def test_interface_and_from_config() -> None:
    cfg = load(None, ["moe.shared_experts=1", "moe.router=mlp_tanh", "moe.num_experts=4", "moe.top_k=2"])
    layer = moebal.MoELayer.from_config(cfg)
    assert layer.gate.weight.shape == (4, cfg.model.dim)
    assert layer.gate_out.weight.shape == (4, 4)
    F_ = cfg.expert_ffn_dim
    assert layer.experts.w1.shape == (4, F_, cfg.model.dim) and layer.experts.w3.shape == (4, F_, cfg.model.dim)
    assert layer.experts.w2.shape == (4, cfg.model.dim, F_)
    assert layer.shared_expert is not None and layer.shared_expert.gate_proj.weight.shape == (F_, cfg.model.dim)
    x = torch.randn(2, 3, cfg.model.dim)
    assert layer(x).shape == x.shape
    assert layer.aux_loss.dim() == 0 and layer.aux_loss.dtype == torch.float32
    assert isinstance(layer.last_stats, RoutingStats)


def test_step_stats_accumulate_over_microbatches() -> None:
    torch.manual_seed(7)
    layer = MoELayer(8, 16, 4, 2)
    x1, x2 = torch.randn(5, 8), torch.randn(7, 8)
    layer(x1)
    s1 = layer.last_stats.clone()
    layer(x2)
    s2 = layer.last_stats
    with torch.no_grad():
        layer(torch.randn(3, 8))  # evaluation-style forward: not part of the step
    step = layer.take_stats()
    assert int(step.tokens) == 12
    assert torch.equal(step.counts_E, s1.counts_E + s2.counts_E)
    assert int(layer.take_stats().tokens) == 0  # reset after reading


def test_bias_update_moves_load_toward_cold_experts() -> None:
    torch.manual_seed(8)
    layer = MoELayer(8, 16, 4, 1, bias_update_rate=0.5, aux_loss_coef=0.0)
    with torch.no_grad():
        layer.gate.weight.zero_()
        layer.gate.weight[0] = 1.0  # expert 0 wins for tokens with positive sums
    x = torch.randn(64, 8).abs()
    layer(x)
    before = layer.last_stats.counts_E.clone()
    assert before[0] == 64
    layer.update_bias(layer.take_stats().routed_E)
    assert layer.expert_bias.tolist() == [-0.5, 0.5, 0.5, 0.5]
    out_before = layer.last_routing.weights_TK
    for _ in range(40):
        layer(x)
        layer.update_bias(layer.take_stats().routed_E)
    assert layer.last_stats.counts_E.max() < 64
    # the bias changes the choice only: a top-1 token's weight is still its renormalised probability (1.0)
    torch.testing.assert_close(layer.last_routing.weights_TK, torch.ones_like(out_before))


@pytest.mark.parametrize("kwargs, match", [
    ({"top_k": 5}, "top_k"),
    ({"top_k": 0}, "top_k"),
    ({"capacity_factor": 0.0}, "capacity_factor"),
    ({"capacity_factor": -1.0}, "capacity_factor"),
    ({"adaptive_threshold": 1.5}, "adaptive_threshold"),
    ({"gate": "sigmoid"}, "gate"),
    ({"router": "mlp"}, "router"),
    ({"drop_policy": "random"}, "drop_policy"),
    ({"kernel": "triton"}, "kernel"),
    ({"jitter": -0.1}, "jitter"),
    ({"aux_loss_coef": -1.0}, "aux_loss_coef"),
    ({"shared_ffn_dim": -2}, "shared_ffn_dim"),
])
def test_bad_arguments_raise(kwargs: dict, match: str) -> None:
    args = {"dim": 8, "ffn_dim": 16, "num_experts": 4, "top_k": 2, **kwargs}
    with pytest.raises(ValueError, match=match):
        MoELayer(**args)


def test_grouped_mm_on_unaligned_rows_raises() -> None:
    layer = MoELayer(6, 16, 4, 2, kernel="grouped_mm")  # 6 fp32 = 24 bytes per row
    with pytest.raises(ValueError, match="16 bytes"):
        layer(torch.randn(3, 6))


def test_bad_input_shape_raises() -> None:
    layer = MoELayer(8, 16, 4, 2)
    with pytest.raises(ValueError, match=r"\(\.\.\., 8\)"):
        layer(torch.randn(3, 7))
    with pytest.raises(ValueError, match="bias_update_rate"):
        layer.update_bias(torch.zeros(4))


@pytest.mark.parametrize("kernel", ["loop", "grouped_mm"])
def test_empty_input(kernel: str) -> None:
    layer = MoELayer(8, 16, 4, 2, kernel=kernel, z_loss_coef=1e-3)
    x = torch.randn(0, 8, requires_grad=True)
    out = layer(x)
    assert float(layer.aux_loss) == 0.0  # no balancing or z loss over no token (not a mean over nothing: NaN)
    (out.sum() + layer.aux_loss).backward()
    assert out.shape == (0, 8) and layer.experts.w1.grad is not None and layer.experts.w1.grad.abs().sum() == 0
    assert layer.last_stats is not None and layer.last_stats.read()["tokens"] == 0


def test_deepcopy_after_forward() -> None:
    import copy

    layer = MoELayer(8, 16, 4, 2)
    layer(torch.randn(3, 8))
    clone = copy.deepcopy(layer)
    x = torch.randn(5, 8)
    torch.testing.assert_close(clone(x), layer(x))


def naive_weighted(layer: MoELayer, x_TD: torch.Tensor, w_TE: torch.Tensor) -> torch.Tensor:
    """sum_e w_TE[:, e] * expert_e(x) over the experts with a nonzero weight, token by token."""
    ex = layer.experts
    out = torch.zeros_like(x_TD)
    for t in range(x_TD.shape[0]):
        for e in torch.nonzero(w_TE[t]).flatten().tolist():
            out[t] += w_TE[t, e] * dense_swiglu(x_TD[t], ex.w1[e], ex.w3[e], ex.w2[e])
    return out


def test_adaptive_midway_matches_hand_rule() -> None:
    torch.manual_seed(9)
    T_, E, K, thr = 25, 5, 3, 0.15
    layer = MoELayer(6, 10, E, K, adaptive_threshold=thr, init_std=0.6)
    x = torch.randn(T_, 6)
    probs = torch.softmax(layer.gate(x).float(), -1)
    w_TE = torch.zeros(T_, E)
    for t in range(T_):
        p, idx = probs[t].topk(K)
        p = p / p.sum()
        take = 1
        while take < K and p[take - 1] - p[take] <= thr:
            take += 1
        w_TE[t, idx[:take]] = p[:take] / p[:take].sum()
    torch.testing.assert_close(layer(x), naive_weighted(layer, x, w_TE), rtol=1e-5, atol=1e-6)
    used = layer.last_stats.used_K.tolist()
    assert sum(used) == T_ and used == [int(((w_TE > 0).sum(-1) == j + 1).sum()) for j in range(K)]


@pytest.mark.parametrize("policy", ["probs", "position"])
def test_capacity_layer_matches_hand_drops(policy: str) -> None:
    torch.manual_seed(10)
    T_, E, K, cf = 16, 4, 2, 0.5  # capacity ceil(0.5 * 16 * 2 / 4) = 4
    layer = MoELayer(6, 10, E, K, cf, drop_policy=policy, init_std=0.6)
    with torch.no_grad():
        layer.gate.weight[0] += 0.5  # make expert 0 popular so it overflows
    x = torch.randn(T_, 6).abs()
    probs = torch.softmax(layer.gate(x).detach().float(), -1)
    p_TK, idx_TK = probs.topk(K)
    p_TK = p_TK / p_TK.sum(-1, keepdim=True)
    # hand rule: per expert, order candidates (choice level, token) or by descending probability; keep 4
    w_TE = torch.zeros(T_, E)
    for e in range(E):
        cand = [(j, t) for j in range(K) for t in range(T_) if idx_TK[t, j] == e]
        if policy == "probs":
            cand.sort(key=lambda jt: -float(p_TK[jt[1], jt[0]]))
        for j, t in cand[:4]:
            w_TE[t, e] = p_TK[t, j]
    out = layer(x)
    assert int(layer.last_stats.dropped) > 0
    torch.testing.assert_close(out, naive_weighted(layer, x, w_TE), rtol=1e-5, atol=1e-6)


def test_aux_loss_gradient_reaches_router_only() -> None:
    torch.manual_seed(11)
    layer = MoELayer(6, 10, 4, 2, aux_loss_coef=1.0, z_loss_coef=0.1)
    layer(torch.randn(12, 6))
    layer.aux_loss.backward()
    assert layer.gate.weight.grad is not None and layer.gate.weight.grad.abs().sum() > 0
    assert layer.experts.w1.grad is None  # the balancing terms depend on the router alone
