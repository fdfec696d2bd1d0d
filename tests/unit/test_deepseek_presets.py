"""The DeepSeek presets have the published sizes (meta device, nothing allocated): DeepSeek-V2-Lite 15.7B
parameters with 2.4B active per token, DeepSeek-V3 671B with 37B active.

The published active counts leave out the input embedding table (a lookup, no compute): with it, V2-Lite would be
2.66B and V3 37.55B; without it they are 2.45B and 36.6B, the figures the papers round to 2.4B and 37B."""

from __future__ import annotations

import pytest
import torch

from moebal.config import load
from moebal.models.transformer import MoebalForCausalLM


@pytest.mark.parametrize("preset, total, active", [("deepseek-v2-lite", 15.7e9, 2.4e9), ("deepseek-v3", 671e9, 37e9)])
def test_preset_parameter_counts_match_the_published_figures(preset, total, active):
    cfg = load(preset)
    with torch.device("meta"):
        model = MoebalForCausalLM(cfg)
    n_total = model.num_parameters()
    n_active = model.num_parameters(active=True) - model.model.embed_tokens.weight.numel()
    assert abs(n_total - total) < 0.05e9, n_total
    assert abs(n_active - active) < 0.6e9, n_active
    layers = model.model.layers
    assert sum(not layer.is_moe for layer in layers) == cfg.moe.first_dense
    assert type(layers[0].self_attn).__name__ == "MLAttention"


def test_v3_preset_routes_as_deepseek_v3():
    moe = load("deepseek-v3").moe
    assert (moe.gate, moe.n_group, moe.topk_group, moe.group_score, moe.score_scale, moe.norm_topk) == (
        "sigmoid_topk", 8, 4, "top2_sum", 2.5, True)
    assert moe.selection_bias and moe.bias_update_rate == 0.001


def test_cost_model_shape_counts_the_dense_first_layers():
    from moebal.planner.cost import ModelShape

    cfg = load("deepseek-v3")
    shape = ModelShape.from_config(cfg)
    assert [shape.is_moe(i) for i in range(cfg.model.n_layers)] == [cfg.is_moe_layer(i)
                                                                    for i in range(cfg.model.n_layers)]
    assert sum(shape.is_moe(i) for i in range(cfg.model.n_layers)) == 58


def test_token_subset_schemes_are_refused_with_mla():
    from moebal.config import ConfigError

    with pytest.raises(ConfigError, match="model.mla"):
        load("deepseek-v2-lite", ["dynamism.scheme=mod", "parallel.pp=2"])
