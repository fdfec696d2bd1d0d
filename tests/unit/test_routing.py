"""Routing against hand-computed cases: gate orders, adaptive top-k, capacity drops, losses, stats, bias.

Shape legend: T tokens, E experts, K top_k.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from moebal.models.moe import MoELayer
from moebal.routing import (
    GateSpec,
    RoutingStats,
    adaptive_take,
    capacity_keep,
    expert_capacity,
    load_balancing_loss,
    route,
    router_z_loss,
    select_topk,
    update_selection_bias,
)

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny tensors (tests/conftest.py)


@pytest.mark.parametrize("gate", ["softmax_topk", "topk_softmax"])
def test_topk_weights_by_hand(gate: str) -> None:
    logits_TE = torch.tensor([[2.0, 1.0, 0.0, -1.0], [0.0, 0.0, 3.0, 0.0]])
    idx_TK, p_TK, probs_TE = select_topk(logits_TE, 2, gate)  # type: ignore[arg-type]
    assert idx_TK[0].tolist() == [0, 1] and idx_TK[1, 0] == 2
    s = 1 / (1 + math.exp(-1.0))
    torch.testing.assert_close(p_TK[0], torch.tensor([s, 1 - s]))
    torch.testing.assert_close(p_TK.sum(-1), torch.ones(2))
    torch.testing.assert_close(probs_TE, torch.softmax(logits_TE, -1))


@pytest.mark.parametrize("gate", ["softmax_topk", "topk_softmax"])
def test_selection_bias_changes_choice_not_weights(gate: str) -> None:
    logits_TE = torch.tensor([[2.0, 1.0, 0.0]])
    bias_E = torch.tensor([-5.0, 0.0, 0.0])
    idx_TK, p_TK, _ = select_topk(logits_TE, 2, gate, bias_E)  # type: ignore[arg-type]
    assert idx_TK[0].tolist() == [1, 2]
    s = 1 / (1 + math.exp(-1.0))  # weights from the unbiased logits 1 and 0
    torch.testing.assert_close(p_TK[0], torch.tensor([s, 1 - s]))


def test_adaptive_take_by_hand() -> None:
    p_TK = torch.tensor([
        [0.5, 0.375, 0.125],    # gaps 0.125, 0.25
        [0.75, 0.125, 0.125],   # gap 0.625 stops the chain although the next gap is 0
        [0.375, 0.375, 0.25],   # gaps 0, 0.125
    ])
    assert adaptive_take(p_TK, 0.125).tolist() == [[True, True, False], [True, False, False], [True, True, True]]
    assert adaptive_take(p_TK, 0.0).tolist() == [[True, False, False], [True, False, False], [True, True, False]]
    assert adaptive_take(p_TK, 1.0).all()


def test_adaptive_gating_takes_the_same_experts_whether_or_not_the_weights_are_normalised() -> None:
    """The rule's gaps are between normalised probabilities: softmax_topk without norm_topk (Qwen2-MoE's raw
    weights) takes the experts it takes with norm_topk, only the combine weights differ."""
    logits = torch.randn(64, 8, generator=torch.Generator().manual_seed(3))
    a, b = (route(logits, GateSpec(num_experts=8, top_k=2, adaptive_threshold=0.065, norm_topk=n))
            for n in (True, False))
    assert torch.equal(a.indices_TK, b.indices_TK) and torch.equal(a.active_TK, b.active_TK)
    assert 0 < int(a.active_TK[:, 1].sum()) < 64  # the threshold splits the tokens
    # without norm_topk the taken experts keep their raw weights: T = 1 is the norm_topk=false top-k gate (the
    # weights were renormalised regardless)
    raw = route(logits, GateSpec(num_experts=8, top_k=2, norm_topk=False))
    one = route(logits, GateSpec(num_experts=8, top_k=2, adaptive_threshold=1.0, norm_topk=False))
    assert torch.equal(one.weights_TK, raw.weights_TK)
    probs = torch.softmax(logits.float(), dim=-1).gather(1, b.indices_TK)
    assert torch.equal(b.weights_TK, probs * b.active_TK)


@settings(max_examples=30, deadline=None)
@given(T=st.integers(1, 30), E=st.integers(2, 8), data=st.data())
def test_adaptive_share_grows_with_threshold(T: int, E: int, data: st.DataObject) -> None:
    K = data.draw(st.integers(2, E))
    logits = torch.randn(T, E, generator=torch.Generator().manual_seed(T * 7 + E)) * 2
    _, p_TK, _ = select_topk(logits, K, "softmax_topk")
    taken = [adaptive_take(p_TK, t).sum().item() for t in (0.0, 0.05, 0.1, 0.3, 0.6, 1.0)]
    assert taken == sorted(taken) and taken[-1] == T * K
    spec = GateSpec(num_experts=E, top_k=K, adaptive_threshold=0.2)
    r = route(logits, spec)
    torch.testing.assert_close(r.weights_TK.sum(-1), torch.ones(T))  # renormalised over the taken experts
    assert ((r.weights_TK > 0) == r.taken_TK).all()


def test_expert_capacity() -> None:
    assert expert_capacity(1.0, 8, 2, 4) == 4
    assert expert_capacity(1.25, 10, 1, 4) == 4  # ceil(3.125)
    assert expert_capacity(0.01, 10, 1, 4) == 1


IDX_TK = torch.tensor([[0, 1], [0, 1], [1, 0], [0, 1]])


def test_capacity_position_policy_by_hand() -> None:
    # First choices take slots before second choices, earlier tokens first (GShard/Tutel).
    kept = capacity_keep(IDX_TK, None, torch.zeros(4, 2), 2, 2, "position")
    assert kept.tolist() == [[True, True], [True, False], [True, False], [False, False]]


def test_capacity_probs_policy_by_hand() -> None:
    prio_TK = torch.tensor([[0.6, 0.4], [0.9, 0.1], [0.7, 0.3], [0.8, 0.2]])
    kept = capacity_keep(IDX_TK, None, prio_TK, 2, 2, "probs")
    # expert 0 keeps t1 (0.9) and t3 (0.8); expert 1 keeps t2 (0.7) and t0 (0.4)
    assert kept.tolist() == [[False, True], [True, False], [True, False], [True, False]]


def test_capacity_ignores_assignments_not_taken() -> None:
    taken_TK = torch.tensor([[True, False], [True, False], [True, False], [True, True]])
    kept = capacity_keep(IDX_TK, taken_TK, torch.zeros(4, 2), 2, 2, "position")
    assert kept.tolist() == [[True, False], [True, False], [True, False], [False, True]]


def test_route_with_capacity_zeroes_dropped_weights_and_counts_drops() -> None:
    logits_TE = torch.tensor([[3.0, 0.0], [2.0, 0.0], [1.0, 0.0], [0.0, 4.0]])
    spec = GateSpec(num_experts=2, top_k=1, capacity_factor=1.0, drop_policy="probs")  # capacity 2
    r = route(logits_TE, spec)
    assert r.capacity == 2
    assert r.active_TK is not None and r.active_TK[:, 0].tolist() == [True, True, False, True]
    assert r.weights_TK[:, 0].tolist() == [1.0, 1.0, 0.0, 1.0]
    stats = RoutingStats.from_routing(r).read()
    assert stats["counts"] == [2, 1] and stats["routed"] == [3, 1] and stats["dropped"] == 1
    assert stats["max_load"] == 2 and stats["mean_load"] == 1.5 and stats["imbalance"] == pytest.approx(4 / 3)


def test_load_balancing_loss_by_hand() -> None:
    logits_TE = torch.log(torch.tensor([[0.8, 0.2], [0.6, 0.4]])).requires_grad_()
    probs_TE = torch.softmax(logits_TE, -1)
    loss = load_balancing_loss(probs_TE, torch.tensor([2, 0]))
    torch.testing.assert_close(loss, torch.tensor(2 * 0.7))  # E * (1.0 * 0.7 + 0 * 0.3)
    loss.backward()
    assert logits_TE.grad is not None and logits_TE.grad.abs().sum() > 0  # through the mean probabilities
    balanced = load_balancing_loss(torch.full((4, 4), 0.25), torch.tensor([3, 3, 3, 3]))
    torch.testing.assert_close(balanced, torch.tensor(1.0))


def test_z_loss_by_hand() -> None:
    z = router_z_loss(torch.tensor([[0.0, 0.0], [1.0, 1.0]]))
    expected = (math.log(2) ** 2 + (1 + math.log(2)) ** 2) / 2
    torch.testing.assert_close(z, torch.tensor(expected))


def test_layer_aux_loss_matches_hand_formula() -> None:
    torch.manual_seed(0)
    layer = MoELayer(4, 8, 3, 2, aux_loss_coef=0.5, z_loss_coef=0.25, init_std=0.5)
    x = torch.randn(6, 4)
    layer(x)
    logits = layer.gate(x).float()
    probs = torch.softmax(logits, -1)
    idx = probs.topk(2, -1).indices
    f = torch.bincount(idx.flatten(), minlength=3).float() / 12
    aux = 3 * (f * probs.mean(0)).sum()
    z = (torch.logsumexp(logits, -1) ** 2).mean()
    torch.testing.assert_close(layer.aux_loss, 0.5 * aux + 0.25 * z)


def test_adaptive_aux_loss_counts_first_choices_only() -> None:
    torch.manual_seed(1)
    layer = MoELayer(4, 8, 3, 2, adaptive_threshold=0.3, init_std=0.5, aux_loss_coef=1.0)
    x = torch.randn(10, 4)
    layer(x)
    probs = torch.softmax(layer.gate(x).float(), -1)
    first = probs.argmax(-1)
    f = torch.bincount(first, minlength=3).float() / 10
    torch.testing.assert_close(layer.aux_loss, 3 * (f * probs.mean(0)).sum())


def test_stats_used_k_and_add() -> None:
    spec = GateSpec(num_experts=3, top_k=2, adaptive_threshold=0.1)
    logits_TE = torch.tensor([[5.0, 0.0, 0.0], [1.0, 1.0, -9.0], [0.0, 0.0, 5.0]])
    s = RoutingStats.from_routing(route(logits_TE, spec))
    assert s.used_K.tolist() == [2, 1]
    assert s.counts_E.tolist() == [2, 1, 1]
    total = RoutingStats.zeros(3, 2).add(s).add(s)
    assert total.read()["tokens"] == 6 and total.counts_E.tolist() == [4, 2, 2]
    assert total.read()["used_k_share"] == [pytest.approx(2 / 3), pytest.approx(1 / 3)]
    assert int(total.dropped) == 0


def test_bias_update_direction() -> None:
    bias_E = torch.zeros(4)
    update_selection_bias(bias_E, torch.tensor([10, 2, 4, 4]), 0.1)  # mean 5
    torch.testing.assert_close(bias_E, torch.tensor([-0.1, 0.1, 0.1, 0.1]))
    update_selection_bias(bias_E, torch.tensor([3, 3, 3, 3]), 0.1)  # balanced: unchanged
    torch.testing.assert_close(bias_E, torch.tensor([-0.1, 0.1, 0.1, 0.1]))


def test_jitter_only_in_training() -> None:
    torch.manual_seed(2)
    layer = MoELayer(8, 8, 4, 2, jitter=0.5)
    x = torch.randn(5, 8)
    layer.eval()
    torch.testing.assert_close(layer.router_logits(x), layer.gate(x))
    layer.train()
    assert not torch.allclose(layer.router_logits(x), layer.gate(x))


@pytest.mark.parametrize("kwargs, match", [
    ({"top_k": 0}, "top_k"),
    ({"top_k": 5}, "top_k"),
    ({"num_experts": 0}, "num_experts"),
    ({"adaptive_threshold": -0.1}, "adaptive_threshold"),
    ({"capacity_factor": float("inf")}, "capacity_factor"),
    ({"gate": "softmax"}, "gate"),
    ({"drop_policy": "first"}, "drop_policy"),
])
def test_gate_spec_rejects_bad_values(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        GateSpec(**{"num_experts": 4, "top_k": 2, **kwargs})


@settings(max_examples=40, deadline=None)
@given(T=st.integers(1, 20), E=st.integers(1, 5), cap=st.integers(1, 6), policy=st.sampled_from(["probs", "position"]),
       data=st.data())
def test_capacity_keep_matches_brute_force(T: int, E: int, cap: int, policy: str, data: st.DataObject) -> None:
    K = data.draw(st.integers(1, E))
    gen = torch.Generator().manual_seed(T * 100 + E * 10 + cap)
    idx_TK = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(T)])
    prio_TK = torch.rand(T, K, generator=gen)
    taken_TK = torch.rand(T, K, generator=gen) > 0.3
    taken_TK[:, 0] = True
    kept = capacity_keep(idx_TK, taken_TK, prio_TK, E, cap, policy)
    expected = torch.zeros(T, K, dtype=torch.bool)
    for e in range(E):
        cand = [(j, t) for j in range(K) for t in range(T) if idx_TK[t, j] == e and taken_TK[t, j]]
        if policy == "probs":
            cand.sort(key=lambda jt: -float(prio_TK[jt[1], jt[0]]))  # stable: ties keep (choice, token) order
        for j, t in cand[:cap]:
            expected[t, j] = True
    assert torch.equal(kept, expected)


@pytest.mark.parametrize("autocast", [False, True])
@pytest.mark.parametrize("case", ["sigmoid", "sigmoid_adaptive", "softmax_bias"])
def test_extreme_router_logits_give_finite_weights_losses_and_gradients(case: str, autocast: bool) -> None:
    """A token whose sigmoid scores all round to 0 (logits below about -88.7), or whose biased choice picks
    experts of probability 0 (a logit gap above about 103): finite weights, outputs, losses and gradients, and
    every other token's routing bit for bit what it is without the extreme token."""
    torch.manual_seed(0)
    gate = "softmax_topk" if case == "softmax_bias" else "sigmoid_topk"
    layer = MoELayer(dim=8, ffn_dim=16, num_experts=4, top_k=2, gate=gate,
                     adaptive_threshold=0.5 if case == "sigmoid_adaptive" else None,
                     bias_update_rate=1e-3 if case == "softmax_bias" else 0.0)
    with torch.no_grad():
        if case == "softmax_bias":
            layer.gate.weight.zero_()
            layer.gate.weight[0].fill_(1.0)
            layer.expert_bias.copy_(torch.tensor([-200.0, 0.0, 0.0, 0.0]))
        else:
            layer.gate.weight.fill_(-1.0)
    x = torch.full((3, 8), 0.1)
    x[1] = torch.linspace(-0.5, 0.5, 8)
    x[0] = 14.0 if case == "softmax_bias" else 12.0  # logits [112, 0, 0, 0] or all -96
    x.requires_grad_(True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        y = layer(x)
    r = layer.last_routing
    (y.float().sum() + layer.aux_loss).backward()
    assert torch.isfinite(y).all() and torch.isfinite(layer.aux_loss)
    assert torch.isfinite(r.weights_TK).all() and torch.isfinite(r.probs_TE).all()
    assert torch.isfinite(layer.gate.weight.grad).all() and torch.isfinite(x.grad).all()
    if case == "sigmoid":
        assert torch.equal(r.probs_TE[0], torch.full((4,), 0.25))  # no score at all: uniform
    if case == "softmax_bias":
        assert torch.equal(r.weights_TK[0], torch.tensor([0.5, 0.5]))  # the chosen logits' own softmax
    rest = route(r.logits_TE[1:], layer.spec, layer.expert_bias if case == "softmax_bias" else None)
    assert torch.equal(rest.weights_TK, r.weights_TK[1:]) and torch.equal(rest.probs_TE, r.probs_TE[1:])


def test_a_layer_that_routed_no_token_shares_no_multi_expert_tokens() -> None:
    """`multi_expert_share` is the share of tokens that took more than one expert: 0 for a layer with no token in the
    step (a layer every token skipped or left), as for a top-1 layer; it was 1 - (the top-1 share, 0)."""
    from moebal.routing.stats import packed_numbers
    from moebal.train.metrics import routing_record

    empty = packed_numbers([0] * 4 + [0] * 4 + [0, 0] + [0], 4)  # 4 experts, top-2, no token
    top2 = packed_numbers([3, 1, 2, 2] + [3, 1, 2, 2] + [0, 4] + [4], 4)  # 4 tokens, each of two experts
    top1 = packed_numbers([1, 1, 1, 1] + [1, 1, 1, 1] + [4] + [4], 4)
    assert routing_record([empty, top2, top1])["multi_expert_share"] == [0.0, 1.0, 0.0]
