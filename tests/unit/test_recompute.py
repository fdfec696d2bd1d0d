"""Activation recomputation (`train.recompute`) against none: bit-identical fp32 losses and gradients."""

from __future__ import annotations

import copy

import pytest
import torch

from moebal.config import ConfigError, from_dict
from moebal.models import build_model
from moebal.models.recompute import set_recompute

MODES = ("moe", "attention", "full")


def _cfg(**moe):
    base = dict(num_experts=4, top_k=2, jitter=0.1, router_noise=0.01, z_loss_coef=0.001, shared_experts=1,
                every=1)
    base.update(moe)
    return from_dict({"model": dict(vocab_size=256, dim=32, n_layers=3, n_heads=4, n_kv_heads=2, ffn_dim=48,
                                    max_seq_len=16), "moe": base, "data": {"seq_len": 16}})


def _step(model, ids, labels):
    """Loss, aux loss, gradients and the accumulated routing statistics of one training forward + backward."""
    model.train()
    torch.manual_seed(7)  # jitter and router noise draw from the global generator
    out = model(ids, labels)
    (out.loss + out.aux_loss).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    stats = [layer.take_stats().packed() for layer in model.moe_layers()]
    return out.loss.detach(), out.aux_loss.detach(), grads, stats


@pytest.mark.parametrize("mode", MODES)
def test_recompute_is_bitwise_exact(mode):
    cfg = _cfg()
    torch.manual_seed(0)
    ref = build_model(cfg)
    model = copy.deepcopy(ref)
    set_recompute(model, mode)
    ids = torch.randint(0, 256, (2, 16))
    labels = torch.randint(0, 256, (2, 16))
    loss0, aux0, g0, s0 = _step(ref, ids, labels)
    loss1, aux1, g1, s1 = _step(model, ids, labels)
    assert torch.equal(loss0, loss1) and torch.equal(aux0, aux1)
    assert g0.keys() == g1.keys() and len(g0) > 10
    for n in g0:
        assert torch.equal(g0[n], g1[n]), n
    # routing statistics counted once: the replay in the backward pass does no bookkeeping
    for a, b in zip(s0, s1):
        assert torch.equal(a, b)


def test_recompute_dense_layers_and_config_field():
    cfg = from_dict({"model": dict(vocab_size=256, dim=32, n_layers=2, n_heads=4, n_kv_heads=4, ffn_dim=48,
                                   max_seq_len=8), "moe": {"num_experts": 0}, "data": {"seq_len": 8},
                     "train": {"recompute": "full"}})
    torch.manual_seed(0)
    model = build_model(cfg)
    assert all(layer.recompute == "full" for layer in model.model.layers)
    ref = copy.deepcopy(model)
    set_recompute(ref, "none")
    ids = torch.randint(0, 256, (2, 8))
    l0, _, g0, _ = _step(ref, ids, ids)
    l1, _, g1, _ = _step(model, ids, ids)
    assert torch.equal(l0, l1) and all(torch.equal(g0[n], g1[n]) for n in g0)


def test_recompute_actually_recomputes():
    """The checkpointed regions start twice (forward and backward), the plain ones once (pre-hooks: torch stops
    a recomputation as soon as it has every tensor the backward needs, before the module returns)."""
    cfg = _cfg()
    torch.manual_seed(0)
    model = build_model(cfg)
    calls = {"attn": 0, "ffn": 0}
    layer = model.model.layers[0]
    layer.self_attn.register_forward_pre_hook(lambda *a: calls.__setitem__("attn", calls["attn"] + 1))
    layer.block_sparse_moe.register_forward_pre_hook(lambda *a: calls.__setitem__("ffn", calls["ffn"] + 1))
    ids = torch.randint(0, 256, (2, 16))
    expected = {"none": (1, 1), "moe": (1, 2), "attention": (2, 1), "full": (2, 2)}
    for mode, (attn, ffn) in expected.items():
        set_recompute(model, mode)
        calls.update(attn=0, ffn=0)
        out = model(ids, ids)
        (out.loss + out.aux_loss).backward()
        assert (calls["attn"], calls["ffn"]) == (attn, ffn), mode
        with torch.no_grad():  # no gradient: nothing to recompute
            calls.update(attn=0, ffn=0)
            model(ids)
            assert (calls["attn"], calls["ffn"]) == (1, 1)


def test_recompute_bad_value_is_refused():
    with pytest.raises(ConfigError, match="recompute"):
        from_dict({"train": {"recompute": "everything"}})
    with pytest.raises(ValueError, match="recompute mode"):
        set_recompute(torch.nn.Linear(2, 2), "some")


# ---- token-subset layers (early exit, Mixture-of-Depths: moebal/models/subset.py) ----

def _subset_case(keys: str, moe: bool):
    """A layer (MoE with router noise and jitter, or dense), its input and a selection: early exit's (every key,
    a padded selection) or Mixture-of-Depths' (selected keys, the router's scale)."""
    from moebal.dynamism.early_exit import pack_positions

    cfg = _cfg() if moe else _cfg(num_experts=0)
    torch.manual_seed(0)
    model = build_model(cfg)
    layer = model.model.layers[0]
    h = torch.randn(2, 16, 32, requires_grad=True)
    cos, sin = model.model.rotary(16, h.dtype)
    if keys == "all":
        active = torch.rand(2, 16) > 0.4
        active[:, 0] = True
        pos, valid = pack_positions(active)
        return layer, h, cos, sin, pos, valid, None
    pos = torch.tensor([[1, 4, 5, 9, 12], [0, 2, 3, 11, 15]])
    return layer, h, cos, sin, pos, None, torch.rand(2, 5, requires_grad=True)


def _subset_step(layer, h, cos, sin, pos, valid, scale, keys):
    from moebal.models.subset import subset_block

    for t in (h, scale):
        if t is not None:
            t.grad = None
    layer.zero_grad(set_to_none=True)
    torch.manual_seed(7)
    out = subset_block(layer, h, cos, sin, pos, valid, keys=keys, scale_BQ=scale)
    aux = layer.block_sparse_moe.aux_loss if layer.is_moe else torch.zeros(())
    (out.square().mean() + aux).backward()
    grads = {n: p.grad.clone() for n, p in layer.named_parameters() if p.grad is not None}
    grads["h"] = h.grad.clone()
    if scale is not None:
        grads["scale"] = scale.grad.clone()
    stats = layer.block_sparse_moe.take_stats().packed() if layer.is_moe else None
    return out.detach(), aux.detach(), grads, stats


@pytest.mark.parametrize("keys", ["all", "subset"])
@pytest.mark.parametrize("moe", [True, False], ids=["moe", "dense"])
def test_subset_block_recompute_is_bitwise_exact_and_recomputes(keys, moe):
    """Early exit's and Mixture-of-Depths' layers honour `train.recompute`: bit-identical outputs, gradients and
    routing statistics, and the regions each mode names start twice (pre-hooks, as above)."""
    layer, h, cos, sin, pos, valid, scale = _subset_case(keys, moe)
    calls = {"attn": 0, "ffn": 0}
    # the subset runs the attention's projections itself (not the attention module): count its query projection
    layer.self_attn.q_proj.register_forward_pre_hook(lambda *a: calls.__setitem__("attn", calls["attn"] + 1))
    layer.ffn.register_forward_pre_hook(lambda *a: calls.__setitem__("ffn", calls["ffn"] + 1))
    set_recompute(layer, "none")
    ref = _subset_step(layer, h, cos, sin, pos, valid, scale, keys)
    assert len(ref[2]) > 5
    expected = {"moe": (0, 1), "attention": (1, 0), "full": (1, 1)}
    for mode, (attn_again, ffn_again) in expected.items():
        set_recompute(layer, mode)
        calls.update(attn=0, ffn=0)
        got = _subset_step(layer, h, cos, sin, pos, valid, scale, keys)
        assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1]), mode
        assert got[2].keys() == ref[2].keys() and all(torch.equal(got[2][n], ref[2][n]) for n in ref[2]), mode
        if moe:
            assert torch.equal(got[3], ref[3]), mode  # statistics counted once
        assert (calls["attn"], calls["ffn"]) == (1 + attn_again, 1 + ffn_again), (mode, calls)
