"""DeepSeek's routing pieces as routing code: sigmoid scoring, group-limited top-k (V2's max, V3's top-2 sum),
routed scaling, bias-corrected selection and normalised sigmoid weights; each against a plain per-token
reference written here, and against transformers' own DeepseekV2/V3 routers on random inputs.

Shape legend: T tokens, D model dim, E experts, K top_k.
"""

from __future__ import annotations

import math

import pytest
import torch

from moebal.config import ConfigError, load
from moebal.models.moe import MoELayer
from moebal.routing import GateSpec, group_limit, route, select_topk

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny tensors (tests/conftest.py)


def reference_route(logits_TE: torch.Tensor, k: int, gate: str, bias_E: torch.Tensor | None, n_group: int,
                    topk_group: int | None, how: str, norm: bool, scale: float) -> list[dict[int, float]]:
    """Per token, in Python floats: {expert: combine weight} of its k chosen experts."""
    out = []
    bias = [0.0] * logits_TE.shape[1] if bias_E is None else bias_E.double().tolist()
    for row in logits_TE.double().tolist():
        E = len(row)
        if gate == "sigmoid_topk":
            score = [1 / (1 + math.exp(-x)) for x in row]
            choice = [s + b for s, b in zip(score, bias)]
        else:
            z = sum(math.exp(x) for x in row)
            score = [math.exp(x) / z for x in row]
            choice = [x + b for x, b in zip(row, bias)] if bias_E is not None else score
        M = E // n_group
        ranked = choice
        if how == "top2_sum" and gate != "sigmoid_topk":  # softmax gates: the probabilities of the biased logits
            zb = sum(math.exp(x + b) for x, b in zip(row, bias))
            ranked = [math.exp(x + b) / zb for x, b in zip(row, bias)]
        members = [ranked[g * M:(g + 1) * M] for g in range(n_group)]
        g_score = [max(m) if how == "max" else sum(sorted(m)[-2:]) for m in members]
        keep = sorted(range(n_group), key=lambda g: -g_score[g])[:topk_group or n_group]
        allowed = [e for e in range(E) if e // M in keep]
        chosen = sorted(allowed, key=lambda e: -choice[e])[:k]
        w = [score[e] for e in chosen]
        if norm:
            w = [x / sum(w) for x in w]
        out.append({e: x * scale for e, x in zip(chosen, w)})
    return out


def as_dicts(indices_TK: torch.Tensor, weights_TK: torch.Tensor) -> list[dict[int, float]]:
    return [dict(zip(i, w)) for i, w in zip(indices_TK.tolist(), weights_TK.double().tolist())]


def assert_same_choice(got: list[dict[int, float]], want: list[dict[int, float]], tol: float = 1e-6) -> None:
    for t, (g, w) in enumerate(zip(got, want)):
        assert set(g) == set(w), f"token {t}: experts {sorted(g)} vs {sorted(w)}"
        for e in w:
            assert abs(g[e] - w[e]) <= tol * max(1.0, abs(w[e])), f"token {t}, expert {e}: {g[e]} vs {w[e]}"


CASES = [  # gate, E, K, n_group, topk_group, group_score, norm_topk, scale, bias
    ("sigmoid_topk", 16, 4, 4, 2, "top2_sum", True, 2.5, True),  # DeepSeek-V3's rule, small
    ("sigmoid_topk", 32, 8, 8, 4, "top2_sum", True, 2.5, True),
    ("sigmoid_topk", 12, 3, 1, None, "max", True, 1.0, True),  # sigmoid + bias, no groups
    ("sigmoid_topk", 12, 3, 3, 1, "top2_sum", False, 1.0, False),
    ("softmax_topk", 16, 6, 8, 3, "max", False, 16.0, False),  # DeepSeek-V2's group_limited_greedy
    ("softmax_topk", 16, 2, 2, 1, "max", True, 1.0, True),  # groups on biased logits
    ("topk_softmax", 16, 4, 4, 2, "max", True, 1.0, False),
    ("softmax_topk", 16, 4, 4, 2, "top2_sum", True, 1.0, False),  # softmax gates' top2_sum: on probabilities
    ("topk_softmax", 16, 4, 4, 2, "top2_sum", True, 1.0, True),
]


@pytest.mark.parametrize("case", CASES, ids=[f"{c[0]}-E{c[1]}-G{c[3]}-{c[5]}" for c in CASES])
def test_route_equals_the_plain_reference(case) -> None:
    gate, E, K, G, TG, how, norm, scale, with_bias = case
    g = torch.Generator().manual_seed(E * 7 + K)
    logits_TE = torch.randn(40, E, generator=g) * 2
    bias_E = torch.randn(E, generator=g) * 0.3 if with_bias else None
    spec = GateSpec(num_experts=E, top_k=K, gate=gate, norm_topk=norm, score_scale=scale, n_group=G,
                    topk_group=TG, group_score=how)
    r = route(logits_TE, spec, bias_E)
    assert_same_choice(as_dicts(r.indices_TK, r.weights_TK),
                       reference_route(logits_TE, K, gate, bias_E, G, TG, how, norm, scale))
    torch.testing.assert_close(r.probs_TE.sum(-1), torch.ones(40))  # what the balancing loss reads sums to one


def test_group_limit_keeps_only_the_best_groups_by_hand() -> None:
    # 4 experts in 2 groups: group 0 = {0, 1}, group 1 = {2, 3}
    choice_TE = torch.tensor([[0.9, 0.0, 0.5, 0.5],   # max: group 0 (0.9); top2_sum: group 1 (1.0 > 0.9)
                              [0.1, 0.2, 0.3, 0.4]])  # both: group 1
    by_max = group_limit(choice_TE, 2, 1, "max")
    by_sum = group_limit(choice_TE, 2, 1, "top2_sum")
    inf = float("-inf")
    torch.testing.assert_close(by_max, torch.tensor([[0.9, 0.0, inf, inf], [inf, inf, 0.3, 0.4]]))
    torch.testing.assert_close(by_sum, torch.tensor([[inf, inf, 0.5, 0.5], [inf, inf, 0.3, 0.4]]))
    # the group limit changes the top-1: expert 0 is the best expert overall but its group loses on top2_sum
    idx_TK, _, _ = select_topk(choice_TE.logit(eps=1e-6), 1, "sigmoid_topk", n_group=2, topk_group=1,
                               group_score="top2_sum")
    assert idx_TK[:, 0].tolist() in ([2, 3], [3, 3])


@pytest.mark.parametrize("how", ["max", "top2_sum"])
def test_softmax_gates_choose_alike_in_either_order_and_with_a_zero_bias(how) -> None:
    # the sum of a group's two best logits once ranked groups for topk_softmax (and for any softmax gate with a
    # bias), the sum of its two best probabilities for softmax_topk: 128 of 1,000 tokens chose other experts
    logits_TE = torch.randn(1000, 16, generator=torch.Generator().manual_seed(0)) * 2
    by_hand = torch.tensor([[3.0, -5.0, 0.5, 0.5]])  # group {0, 1}: logits sum -2, probabilities 0.86 of 1
    for x in (logits_TE, by_hand):
        E = x.shape[1]
        picks = [select_topk(x, 1 if E == 4 else 4, gate, bias, n_group=2 if E == 4 else 4, topk_group=1,
                             group_score=how)[0]
                 for gate in ("softmax_topk", "topk_softmax") for bias in (None, torch.zeros(E))]
        assert all(torch.equal(picks[0], p) for p in picks[1:]), how
    assert select_topk(by_hand, 1, "topk_softmax", n_group=2, topk_group=1, group_score=how)[0].item() == 0


def test_sigmoid_bias_changes_the_choice_never_the_weights() -> None:
    """DeepSeek-V3 eq. 16: the bias only in the top-k; the gate values are the unbiased, normalised sigmoids."""
    logits_TE = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    bias_E = torch.tensor([-5.0, 0.0, 0.0, 0.0])
    idx_TK, p_TK, _ = select_topk(logits_TE, 2, "sigmoid_topk", bias_E)
    assert idx_TK[0].tolist() == [1, 2]
    s1, s2 = 1 / (1 + math.exp(-1.0)), 0.5
    torch.testing.assert_close(p_TK[0], torch.tensor([s1 / (s1 + s2), s2 / (s1 + s2)]))
    spec = GateSpec(num_experts=4, top_k=2, gate="sigmoid_topk", score_scale=2.5)
    r = route(logits_TE, spec, bias_E)
    torch.testing.assert_close(r.weights_TK.sum(-1), torch.tensor([2.5]))  # normalised, then scaled


@pytest.mark.parametrize("gate, with_bias, scale", [("sigmoid_topk", False, 1.0), ("sigmoid_topk", True, 2.5),
                                                     ("softmax_topk", False, 1.0), ("softmax_topk", True, 2.5)])
def test_normalised_weights_pass_the_router_gradient_through_their_sum(gate, with_bias, scale) -> None:
    """The logits' gradient of the normalised combine weights equals autograd of the plain formula on the same
    chosen experts, s_i / (sum_chosen s_j + eps) * scale (DeepSeek-V3 eq. 15-16; Mixtral's renormalised top-k):
    the sum is differentiated, not treated as a constant."""
    T, E, K = 24, 8, 3
    g = torch.Generator().manual_seed(11)
    logits_TE = (torch.randn(T, E, generator=g) * 2).requires_grad_()
    bias_E = torch.randn(E, generator=g) * 0.3 if with_bias else None
    c_TK = torch.randn(T, K, generator=g, dtype=torch.float64)  # a random cotangent per weight
    r = route(logits_TE, GateSpec(num_experts=E, top_k=K, gate=gate, score_scale=scale), bias_E)
    (r.weights_TK.double() * c_TK).sum().backward()
    ref_TE = logits_TE.detach().double().requires_grad_()  # float64 reference; route itself computes in fp32
    scores_TE = torch.sigmoid(ref_TE) if gate == "sigmoid_topk" else torch.softmax(ref_TE, dim=-1)
    s_TK = scores_TE.gather(1, r.indices_TK)
    eps = 1e-20 if gate == "sigmoid_topk" else 0.0  # HF DeepseekV3TopkRouter's
    ((s_TK / (s_TK.sum(-1, keepdim=True) + eps) * scale) * c_TK).sum().backward()
    assert logits_TE.grad is not None and ref_TE.grad is not None
    assert ref_TE.grad.abs().max() > 0.05  # a gradient that could be missed
    torch.testing.assert_close(logits_TE.grad.double(), ref_TE.grad, rtol=0, atol=1e-6)


def test_groups_without_a_limit_change_nothing() -> None:
    logits_TE = torch.randn(30, 16, generator=torch.Generator().manual_seed(3))
    plain = route(logits_TE, GateSpec(num_experts=16, top_k=4))
    for TG in (None, 4):
        grouped = route(logits_TE, GateSpec(num_experts=16, top_k=4, n_group=4, topk_group=TG))
        assert torch.equal(plain.indices_TK, grouped.indices_TK) and torch.equal(plain.weights_TK, grouped.weights_TK)


@pytest.mark.parametrize("bad, match", [
    ({"n_group": 3}, "divisor"),
    ({"n_group": 4, "topk_group": 5}, "topk_group"),
    ({"n_group": 4, "topk_group": 1, "top_k": 5}, "raise topk_group"),
    ({"n_group": 16, "topk_group": 2, "group_score": "top2_sum"}, "top2_sum"),
    ({"gate": "topk_softmax", "norm_topk": False}, "topk_softmax"),
])
def test_gate_spec_refuses_impossible_groups(bad, match) -> None:
    kw = {"num_experts": 16, "top_k": 2, **bad}
    with pytest.raises(ValueError, match=match):
        GateSpec(**kw)


# ---- against transformers' own routers -----------------------------------------------------------------------


def _hf_router(version: int, **kw):
    pytest.importorskip("transformers", reason="transformers is not installed: the HF router parity needs it")
    if version == 2:
        from transformers.models.deepseek_v2.configuration_deepseek_v2 import DeepseekV2Config
        from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter

        return DeepseekV2TopkRouter(DeepseekV2Config(**kw))
    from transformers.models.deepseek_v3.configuration_deepseek_v3 import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    return DeepseekV3TopkRouter(DeepseekV3Config(**kw))


@pytest.mark.parametrize("E, K, G, TG", [(16, 4, 4, 2), (32, 8, 8, 4), (16, 2, 1, 1), (24, 6, 6, 3)])
def test_v3_router_matches_transformers(E, K, G, TG) -> None:
    D = 24
    hf = _hf_router(3, hidden_size=D, num_attention_heads=4, n_routed_experts=E, num_experts_per_tok=K,
                    n_group=G, topk_group=TG, routed_scaling_factor=2.5, norm_topk_prob=True)
    g = torch.Generator().manual_seed(E + K)
    with torch.no_grad():
        hf.weight.copy_(torch.randn(E, D, generator=g) * 0.3)
        hf.e_score_correction_bias.copy_(torch.randn(E, generator=g) * 0.2)
    x_TD = torch.randn(64, D, generator=g)
    _, w_hf, idx_hf = hf(x_TD)
    layer = MoELayer(D, 8, E, K, gate="sigmoid_topk", n_group=G, topk_group=TG, group_score="top2_sum",
                     score_scale=2.5, selection_bias=True)
    with torch.no_grad():
        layer.gate.weight.copy_(hf.weight)
        layer.expert_bias.copy_(hf.e_score_correction_bias)
    r = layer.route(x_TD)
    assert_same_choice(as_dicts(r.indices_TK, r.weights_TK), as_dicts(idx_hf, w_hf), tol=1e-6)


@pytest.mark.parametrize("method, E, K, G, TG", [("group_limited_greedy", 16, 6, 8, 3),
                                                 ("group_limited_greedy", 64, 6, 8, 3),
                                                 ("greedy", 16, 4, None, None)])
def test_v2_router_matches_transformers(method, E, K, G, TG) -> None:
    D = 24
    hf = _hf_router(2, hidden_size=D, num_attention_heads=4, n_routed_experts=E, num_experts_per_tok=K,
                    n_group=G, topk_group=TG, topk_method=method, routed_scaling_factor=16.0)
    g = torch.Generator().manual_seed(E + K)
    with torch.no_grad():
        hf.weight.copy_(torch.randn(E, D, generator=g) * 0.3)
    x_TD = torch.randn(64, D, generator=g)
    _, w_hf, idx_hf = hf(x_TD)
    # DeepSeek-V2 as transformers runs it: softmax, (group-limited) greedy top-k, weights not renormalised
    layer = MoELayer(D, 8, E, K, gate="softmax_topk", norm_topk=False, n_group=G or 1, topk_group=TG,
                     group_score="max", score_scale=16.0)
    with torch.no_grad():
        layer.gate.weight.copy_(hf.weight)
    r = layer.route(x_TD)
    assert_same_choice(as_dicts(r.indices_TK, r.weights_TK), as_dicts(idx_hf, w_hf), tol=1e-6)


# ---- the MoE layer and the config --------------------------------------------------------------------------


def test_config_builds_a_v3_gate_and_a_selection_bias_that_rate_zero_keeps() -> None:
    cfg = load(None, ["model.dim=32", "moe.num_experts=16", "moe.top_k=4", "moe.gate=sigmoid_topk", "moe.n_group=4",
                      "moe.topk_group=2", "moe.group_score=top2_sum", "moe.score_scale=2.5",
                      "moe.selection_bias=true"])
    layer = MoELayer.from_config(cfg)
    s = layer.spec
    assert (s.gate, s.n_group, s.topk_group, s.group_score, s.score_scale) == ("sigmoid_topk", 4, 2, "top2_sum", 2.5)
    assert "expert_bias" in dict(layer.named_buffers())  # saved and loaded with the layer's state
    layer.expert_bias.fill_(0.25)
    layer.update_bias(torch.arange(16))  # bias_update_rate 0: a loaded bias is used as it is
    assert torch.equal(layer.expert_bias, torch.full((16,), 0.25))
    out = layer(torch.randn(2, 5, 32))
    assert out.shape == (2, 5, 32) and torch.isfinite(out).all()


def test_bias_update_moves_sigmoid_choices_toward_balance() -> None:
    """The auxiliary-loss-free update (routing/balance.py) acts on the sigmoid gate's bias as on the softmax one's:
    repeated updates on a skewed router lower the load imbalance."""
    torch.manual_seed(0)
    layer = MoELayer(16, 8, 8, 2, gate="sigmoid_topk", n_group=4, topk_group=2, group_score="top2_sum",
                     bias_update_rate=0.01)
    with torch.no_grad():
        layer.gate.weight.normal_(0, 0.2)
    x_TD = torch.randn(512, 16) + 1  # a shared offset skews every token the same way
    before = torch.bincount(layer.route(x_TD).indices_TK.reshape(-1), minlength=8)
    for _ in range(60):
        r = layer.route(x_TD)
        layer.update_bias(torch.bincount(r.indices_TK.reshape(-1), minlength=8))
    after = torch.bincount(layer.route(x_TD).indices_TK.reshape(-1), minlength=8)
    assert before.max() > 2 * 128 and after.max() < 1.2 * 128, (before.tolist(), after.tolist())  # mean load 128
    torch.testing.assert_close(layer.route(x_TD).weights_TK.sum(-1), torch.ones(512))  # weights stay unbiased


@pytest.mark.parametrize("bad, match", [
    (["moe.n_group=3"], "n_group"),
    (["moe.n_group=4", "moe.topk_group=5"], "topk_group"),
    (["moe.n_group=4", "moe.topk_group=1", "moe.top_k=3"], "raise moe.topk_group"),
    (["moe.n_group=8", "moe.topk_group=2", "moe.group_score=top2_sum"], "top2_sum"),
    (["moe.gate=sigmoid_topk", "moe.norm_topk=false", "moe.adaptive_threshold=0.1"], "norm_topk"),
    (["moe.group_score=sum"], "group_score"),
])
def test_config_refuses_impossible_routing(bad, match) -> None:
    with pytest.raises(ConfigError, match=match):
        load(None, bad)
