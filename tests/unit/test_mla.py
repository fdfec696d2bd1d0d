"""Multi-head latent attention against transformers' DeepseekV3Attention and DeepseekV2Attention (random weights,
fp32, within 1e-5), with and without a compressed query, interleaved or rotate-half rotary, plain or YaRN
rotary scaling; YaRN tables against transformers' own.

Shape legend: B batch, T sequence, D model dim, R rotary width.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from moebal.config import MLAConfig, RopeScalingConfig
from moebal.models.mla import MLAttention, ScaledRotary, mla_softmax_scale, rotate_interleaved

pytest.importorskip("transformers", reason="transformers is not installed: MLA parity is checked against it")

D, H, B, T = 48, 4, 2, 11
YARN = {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4, "beta_fast": 32.0,
        "beta_slow": 1.0, "mscale": 0.707, "mscale_all_dim": 0.707}
YARN_V3 = {**YARN, "mscale": 1.0, "mscale_all_dim": 1.0}


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny tensors (tests/conftest.py)


def _hf_config(version: int, q_lora: int | None, rope: dict[str, Any] | None, interleave: bool = True):
    kw = dict(hidden_size=D, num_attention_heads=H, num_key_value_heads=H, q_lora_rank=q_lora, kv_lora_rank=24,
              qk_nope_head_dim=12, qk_rope_head_dim=8, v_head_dim=10, max_position_embeddings=160,
              rope_parameters={"rope_type": "default", "rope_theta": 10000.0, **(rope or {})})
    if version == 3:
        from transformers.models.deepseek_v3.configuration_deepseek_v3 import DeepseekV3Config

        cfg = DeepseekV3Config(rope_interleave=interleave, **kw)
    else:
        from transformers.models.deepseek_v2.configuration_deepseek_v2 import DeepseekV2Config

        cfg = DeepseekV2Config(**kw)
    cfg._attn_implementation = "eager"
    return cfg


def _scaling(rope: dict[str, Any] | None) -> RopeScalingConfig | None:
    if rope is None:
        return None
    return RopeScalingConfig(factor=rope["factor"], original_max_seq_len=rope["original_max_position_embeddings"],
                             beta_fast=rope["beta_fast"], beta_slow=rope["beta_slow"], mscale=rope["mscale"],
                             mscale_all_dim=rope["mscale_all_dim"])


def _hf_attention(version: int, hf_cfg):
    if version == 3:
        from transformers.models.deepseek_v3 import modeling_deepseek_v3 as mod

        return mod.DeepseekV3Attention(hf_cfg, 0), mod.DeepseekV3RotaryEmbedding(hf_cfg)
    from transformers.models.deepseek_v2 import modeling_deepseek_v2 as mod

    return mod.DeepseekV2Attention(hf_cfg, 0), mod.DeepseekV2RotaryEmbedding(hf_cfg)


def _randomise(module: torch.nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * (0.3 if p.dim() > 1 else 1.0) + (1.0 if p.dim() == 1 else 0))


CASES = [  # transformers version, q_lora_rank, rope scaling, interleaved rotary
    (3, 16, None, True), (3, None, None, True), (3, 16, YARN_V3, True), (3, 16, YARN, False),
    (2, None, YARN, True), (2, 16, None, True),
]


@pytest.mark.parametrize("version, q_lora, rope, interleave", CASES,
                         ids=[f"v{c[0]}-q{c[1]}-{'yarn' if c[2] else 'plain'}-{'il' if c[3] else 'half'}"
                              for c in CASES])
def test_mla_matches_transformers(version, q_lora, rope, interleave) -> None:
    hf_cfg = _hf_config(version, q_lora, rope, interleave)
    hf, hf_rotary = _hf_attention(version, hf_cfg)
    _randomise(hf, seed=version * 10 + (q_lora or 0))
    mla = MLAConfig(q_lora_rank=q_lora, kv_lora_rank=24, qk_nope_head_dim=12, qk_rope_head_dim=8, v_head_dim=10,
                    rope_interleave=interleave)
    scaling = _scaling(rope)
    ours = MLAttention(D, H, mla, mla_softmax_scale(20, scaling))
    missing, unexpected = ours.load_state_dict(hf.state_dict(), strict=True)
    assert not missing and not unexpected  # the HF parameter names, one to one
    x_BTD = torch.randn(B, T, D, generator=torch.Generator().manual_seed(5))
    pos = torch.arange(T)[None].expand(B, T)
    mask = torch.full((T, T), float("-inf")).triu(1)[None, None]
    with torch.no_grad():
        want = hf(x_BTD, position_embeddings=hf_rotary(x_BTD, pos), attention_mask=mask)[0]
        cos_TR, sin_TR = ScaledRotary(8, 160, 10000.0, scaling)(T, torch.float32)
        got = ours(x_BTD, cos_TR, sin_TR)
    assert ours.softmax_scale == pytest.approx(hf.scaling, rel=1e-12)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("rope", [YARN, YARN_V3, {**YARN, "original_max_position_embeddings": 64, "factor": 4.0}])
def test_yarn_tables_equal_transformers(rope) -> None:
    hf_cfg = _hf_config(3, 16, rope)
    _, hf_rotary = _hf_attention(3, hf_cfg)
    x = torch.zeros(1, 160, 8)
    cos_want, sin_want = hf_rotary(x, torch.arange(160)[None])
    cos_TR, sin_TR = ScaledRotary(8, 160, 10000.0, _scaling(rope))(160, torch.float32)
    torch.testing.assert_close(cos_TR, cos_want[0], atol=0, rtol=0)
    torch.testing.assert_close(sin_TR, sin_want[0], atol=0, rtol=0)


def test_interleaved_rotation_is_pairwise_by_hand() -> None:
    """Pair (x0, x1) rotates by angle a0, pair (x2, x3) by a1; written out as (evens, odds)."""
    x = torch.tensor([[[[1.0, 0.0, 0.0, 1.0]]]])
    a0, a1 = 0.5, 0.25
    freqs = torch.tensor([[a0, a1, a0, a1]])
    out = rotate_interleaved(x, freqs.cos(), freqs.sin())
    c0, s0, c1, s1 = map(float, (torch.cos(torch.tensor(a0)), torch.sin(torch.tensor(a0)),
                                 torch.cos(torch.tensor(a1)), torch.sin(torch.tensor(a1))))
    # pair 0 = (1, 0) -> (c0, s0); pair 1 = (0, 1) -> (-s1, c1); layout: evens (c0, -s1), odds (s0, c1)
    torch.testing.assert_close(out[0, 0, 0], torch.tensor([c0, -s1, s0, c1]))


def test_mla_is_causal_and_shapes_follow_the_latent_ranks() -> None:
    mla = MLAConfig(q_lora_rank=None, kv_lora_rank=8, qk_nope_head_dim=6, qk_rope_head_dim=4, v_head_dim=5)
    attn = MLAttention(16, 2, mla, mla_softmax_scale(10, None))
    assert attn.kv_a_proj_with_mqa.weight.shape == (8 + 4, 16) and attn.kv_b_proj.weight.shape == (2 * 11, 8)
    assert attn.o_proj.weight.shape == (16, 2 * 5) and not hasattr(attn, "q_a_proj")
    cos, sin = ScaledRotary(4, 32, 10000.0, None)(7, torch.float32)
    x = torch.randn(1, 7, 16)
    y = attn(x, cos, sin)
    x2 = x.clone()
    x2[0, 5:] += 1.0  # changing later tokens leaves earlier outputs alone
    torch.testing.assert_close(attn(x2, cos, sin)[0, :5], y[0, :5])
