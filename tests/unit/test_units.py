"""Partition units: the unit map, a layer's halves against the layer, and a stage holding halves."""

from __future__ import annotations

import pytest
import torch

from moebal.config import from_dict
from moebal.models import build_model
from moebal.pipeline.stage import PipelineStage
from moebal.pipeline.units import ATTN, FFN, LAYER, UnitMap


def _cfg(n_layers: int = 4):
    return from_dict({"model": {"dim": 32, "n_layers": n_layers, "n_heads": 4, "n_kv_heads": 2, "ffn_dim": 64,
                                "max_seq_len": 32, "tie_embeddings": False},
                      "moe": {"num_experts": 0}, "data": {"seq_len": 16}, "train": {"precision": "fp32"}})


def test_unit_map_splits_the_chosen_layers_in_model_order():
    m = UnitMap.build(4, [1, 3])
    assert m.parts == ((0, LAYER), (1, ATTN), (1, FFN), (2, LAYER), (3, ATTN), (3, FFN))
    assert m.size == 6 and m.split_layers == [1, 3]
    assert m.units_of(1) == [1, 2] and m.layer(4) == 3 and m.kind(5) == FFN
    assert m.unit_sizes([2, 2]) == [3, 3] and m.unit_sizes([1, 3]) == [1, 5]
    assert m.stage_layers([2, 4]) == [1.5, 2.5]
    assert m.per_unit([1.0, 0.5, 0.25, 2.0]) == [1.0, 0.5, 0.5, 0.25, 2.0, 2.0]
    assert UnitMap.whole(3).parts == ((0, LAYER), (1, LAYER), (2, LAYER))
    with pytest.raises(ValueError, match="outside"):
        UnitMap.build(2, [2])
    with pytest.raises(ValueError, match="does not cover"):
        m.unit_sizes([2, 1])


def test_the_halves_of_a_layer_are_the_layer_bit_for_bit():
    cfg = _cfg()
    torch.manual_seed(0)
    model = build_model(cfg)
    layer = model.model.layers[1]
    cos, sin = model.model.rotary(16, torch.float32)
    h = torch.randn(2, 16, 32, requires_grad=True)
    whole = layer(h, cos, sin)
    (g_whole,) = torch.autograd.grad(whole.square().sum(), h)
    halves = layer.ffn_part(layer.attention_part(h, cos, sin))
    (g_halves,) = torch.autograd.grad(halves.square().sum(), h)
    assert torch.equal(whole, halves) and torch.equal(g_whole, g_halves)


def test_a_stage_holds_halves_under_the_model_names_and_merges_them():
    cfg = _cfg()
    units = UnitMap.build(4, [1, 2])  # 0 | 1a 1f | 2a 2f | 3
    model = build_model(cfg)
    names = set(model.state_dict())
    first = PipelineStage.from_model(model, 0, 2, True, False, units)  # layer 0 and layer 1's attention half
    assert first.unit_ids == [0, 1] and first.layer_ids == [0, 1]
    assert first.layer(1).mlp is None and first.layer(1).self_attn is not None
    held = set(first.state_dict())
    assert held <= names
    assert not any(k.startswith("model.layers.1.mlp") or k.startswith("model.layers.1.post_") for k in held)
    assert any(k.startswith("model.layers.1.self_attn") for k in held)
    assert first.num_layers_slot() == 6 and sorted(first.slot_modules()) == [0, 1, 6]

    rest = build_model(cfg)
    second = PipelineStage.from_model(rest, 2, 6, False, True, units)  # 1f, 2a, 2f, 3
    assert second.layer(1).self_attn is None and second.unit_ids == [2, 3, 4, 5]
    # the FFN half of layer 1 moves to the first stage: the layer is whole there again
    piece = second.layer(1)
    second.remove_unit(2)
    first.add_unit(2, piece)
    assert 1 not in second.layer_ids and first.unit_ids == [0, 1, 2]
    assert first.layer(1).mlp is not None and first.layer(1).self_attn is not None
    first.check_contiguous()
    second.check_contiguous()
    # and layer 2's attention half leaves a stage that keeps its FFN half
    second.remove_unit(3)
    assert second.layer(2).self_attn is None and second.layer(2).mlp is not None


def test_split_layers_refuses_planned_micro_batching():
    from moebal.errors import ConfigError

    with pytest.raises(ConfigError, match="split_layers"):
        from_dict({"pipeline": {"split_layers": True, "microbatching": "dynamic"}})
