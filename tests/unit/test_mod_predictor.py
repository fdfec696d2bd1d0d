"""Mixture-of-Depths' causal predictor (moebal/dynamism/mod.py): it trains beside the run without changing it, it
learns the top-k selection, and generation routes by it, KV-cached, as the served forward under the same routing
(moebal/models/generate.py, `DepthRule`)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from moebal.dynamism.mod import predictor_targets
from moebal.dynamism.scheme import build_dynamism
from moebal.models import build_model
from moebal.models.generate import DepthRule, KVCache, cached_form, cached_forward, causal_routing, generate_many
from tests.unit.test_dynamism import small

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny tensors (tests/conftest.py)


def _built(predictor: int, experts: int = 0) -> tuple[Any, Any]:
    """(MoD at capacity 0.25 on layers 1 and 3 of a 4-layer model, at step 1; the model)."""
    cfg = small(4, experts)
    torch.manual_seed(0)
    model = build_model(cfg)
    mod = build_dynamism("mod", {"capacity": 0.25, "every": 2, "first_layer": 1, "predictor": predictor}, cfg=cfg)
    mod.prepare_model(model)
    mod.begin_step(1)
    return mod, model


def test_the_predictor_trains_beside_the_run_without_changing_it() -> None:
    """The same routed layer with and without a predictor: the output and every shared parameter's gradient (and
    the input's) are equal bit for bit; only the predictor's parameters are new, and they get a gradient."""
    runs = {}
    for width in (0, 8):
        mod, model = _built(width)
        layer = model.model.layers[1]
        h = torch.randn(2, 16, 32, generator=torch.Generator().manual_seed(1), requires_grad=True)
        cos, sin = model.model.rotary(16, h.dtype)
        out = mod.layer_forward(1, layer, h, cos, sin, {})
        out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(2)))
        runs[width] = (out.detach(), h.grad, {n: p.grad for n, p in layer.named_parameters()}, mod)
    (out0, gh0, grads0, _), (out8, gh8, grads8, mod8) = runs[0], runs[8]
    assert torch.equal(out0, out8) and torch.equal(gh0, gh8)
    assert set(grads8) - set(grads0) == {"mod_predictor.0.weight", "mod_predictor.0.bias", "mod_predictor.2.weight",
                                         "mod_predictor.2.bias"}
    assert all(torch.equal(g, grads8[n]) for n, g in grads0.items())
    assert all(grads8[n] is not None and grads8[n].abs().sum() > 0 for n in set(grads8) - set(grads0))
    m = mod8.metrics()
    assert all(0.0 <= m[f"predictor_{k}"][1] <= 1.0 for k in ("accuracy", "recall", "precision"))


def test_the_predictor_learns_the_selection() -> None:
    """AdamW on the predictor alone, from the loss it carries into the backward: on fixed rows its accuracy goes
    from chance to above 0.9, and it picks most of the kept tokens (recall above 0.7: not the 0.75 of picking none)
    (the selection is the top quarter of a linear score, which an MLP can learn)."""
    mod, model = _built(16)
    layer = model.model.layers[1]
    h = torch.randn(8, 16, 32, generator=torch.Generator().manual_seed(3))
    cos, sin = model.model.rotary(16, h.dtype)
    opt = torch.optim.AdamW(layer.mod_predictor.parameters(), lr=1e-2)
    accuracy = []
    for _ in range(150):
        opt.zero_grad()
        out = mod.layer_forward(1, layer, h, cos, sin, {})
        (out * 0).sum().backward()  # a zero gradient reaches the output: the predictor's loss gets its own
        opt.step()
        m = mod.metrics()
        accuracy.append((m["predictor_accuracy"][1], m["predictor_recall"][1]))
    assert accuracy[0][0] < 0.8 and accuracy[-1][0] > 0.9 and accuracy[-1][1] > 0.7, (accuracy[0], accuracy[-1])


def test_predictor_targets_count_a_padded_row_s_real_tokens_only() -> None:
    pos = torch.tensor([[1, 3], [0, 4]])
    target, real = predictor_targets(pos, 5, torch.tensor([5, 3]))
    assert target.tolist() == [[0, 1, 0, 1, 0], [1, 0, 0, 0, 0]]  # row 1's position 4 is padding
    assert real.tolist() == [[True] * 5, [True, True, True, False, False]]
    target, real = predictor_targets(pos, 5, None)
    assert target[1].tolist() == [1, 0, 0, 0, 1] and bool(real.all())


def _served(experts: int = 0, window: int | None = None) -> Any:
    """A model served through MoD with predictors that pick about half the tokens (their last bias at 0)."""
    mod, model = _built(8, experts)
    mod.serve(model, 9)
    if window is not None:
        for layer in model.model.layers:
            layer.self_attn.sliding_window = window
    return model.eval()


@pytest.mark.parametrize("experts,window", [(0, None), (4, 5)], ids=["dense", "moe-window5"])
def test_generation_routes_by_the_predictors_with_the_cache_as_without(experts: int, window: int | None) -> None:
    """A left-padded batch (prompts of 9 and 4 tokens), 6 positions decoded one by one: the cached decoder's logits
    equal the served forward's under causal routing to 1e-5 at every real position; that routing differs from the
    top-k one; greedy tokens with and without the cache are the same."""
    model = _served(experts, window)
    assert cached_form(model) == DepthRule(frozenset({1, 3}))
    ids = torch.randint(0, 256, (2, 15), generator=torch.Generator().manual_seed(5))
    pad = torch.tensor([0, 5])
    ids[1, :5] = 0
    cache = KVCache.empty(4, 16)
    with torch.no_grad(), causal_routing(model):
        parts = [cached_forward(model, ids[:, :9], cache, pad)]
        parts += [cached_forward(model, ids[:, t:t + 1], cache, pad) for t in range(9, 15)]
        full = [model(ids[0:1]).logits[0], model(ids[1:2, 5:]).logits[0]]  # each row alone, its real tokens
    got = torch.cat(parts, dim=1)
    scale = full[0].abs().max().item()
    assert (got[0] - full[0]).abs().max().item() < 1e-5 * scale
    assert (got[1, 5:] - full[1]).abs().max().item() < 1e-5 * scale
    assert sum(r.sum().item() for r in cache.ran.values()) > 0 and not all(bool(r[:, :15].all())
                                                                           for r in cache.ran.values())
    with torch.no_grad():
        top_k = model(ids[0:1]).logits[0]  # the served forward outside causal_routing: top-k over the row
    assert (top_k - full[0]).abs().max().item() > 1e-3
    prompts = [ids[0, :9].tolist(), ids[1, 5:9].tolist()]
    assert [g.tokens for g in generate_many(model, prompts, 6)] == \
        [g.tokens for g in generate_many(model, prompts, 6, cache=False)]


def test_a_served_padded_row_keeps_the_routed_share_of_its_real_tokens() -> None:
    """`moebal eval` serves a padded validation batch with its rows' real tokens (`served_forward`'s `row_tokens`,
    as the engine's validation sets `ROW_TOKENS`): each padded row's real positions equal the row served alone,
    unpadded, to 1e-5; served without them, padding takes routed slots and the padded rows differ; full rows give
    the unpadded path's logits bit for bit."""
    mod, model = _built(0)
    mod.serve(model, 9)
    model.eval()
    ids = torch.randint(0, 256, (3, 16), generator=torch.Generator().manual_seed(7))
    n_B = torch.tensor([16, 9, 4])
    with torch.no_grad():
        told = model(ids, row_tokens=n_B).logits
        untold = model(ids).logits
        alone = [model(ids[b:b + 1, :n]).logits[0] for b, n in enumerate(n_B.tolist())]
        full = model(ids, row_tokens=torch.tensor([16, 16, 16])).logits
    scale = untold.abs().max().item()
    for b, n in enumerate(n_B.tolist()):
        assert (told[b, :n] - alone[b]).abs().max().item() < 1e-5 * scale, b
    assert all((untold[b, :n] - alone[b]).abs().max().item() > 1e-3 * scale for b, n in ((1, 9), (2, 4)))
    assert torch.equal(full, untold)
