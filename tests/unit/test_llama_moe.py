"""LLaMA-MoE v1 against a literal re-implementation of its maths, on synthetic checkpoints with the released
models' tensor names and shapes (docs/hf-interop.md; the layout is that of the base 2_8 / 4_16 / 2_16 repos).

The reference below follows the model's own description step by step (router z = G2 tanh(G1 x), top-k on the
raw logits, softmax over the k selected logits, sum of p_i * sigma * expert_i(x), token by token, LLaMA
attention with the rotate-half RoPE) and shares no code with moebal.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from moebal.errors import CheckpointError
from moebal.interop.hf import from_hf, to_hf
from moebal.interop.tensor_io import DirectorySource

H, NH, V, L = 32, 4, 80, 2


def _config(E: int, k: int, sigma: float, width: int, **extra: object) -> dict:
    cfg = {"architectures": ["LlamaMoEForCausalLM"], "model_type": "llama_moe",
           "auto_map": {"AutoConfig": "configuration_llama_moe.LlamaMoEConfig",
                        "AutoModelForCausalLM": "modeling_llama_moe_hf.LlamaMoEForCausalLM"},
           "hidden_size": H, "intermediate_size": E * width, "num_hidden_layers": L, "num_attention_heads": NH,
           "num_key_value_heads": NH, "vocab_size": V, "max_position_embeddings": 64, "rms_norm_eps": 1e-5,
           "hidden_act": "silu", "pretraining_tp": 1, "rope_scaling": None, "bos_token_id": 1, "eos_token_id": 2,
           "pad_token_id": 0, "num_experts": E, "num_selects": k, "size_experts": [[width] * E] * L,
           "gate_type": "TopKBalancedNoisyGate", "gate_network": "mlp", "gates": "mlp", "gate_use_softmax": True,
           "gate_use_balance": True, "gate_add_noise": True, "gate_noise_epsilon": 0.01,
           "gate_balance_loss_weight": 0.01, "calculator_type": "UniversalCalculator", "multiply_gate_scores": True,
           "score_scale_factor": sigma, "add_weight_norm": False, "drop_tokens": True, "dropped_padding": "zero",
           "capacity_factor": 1.25, "torch_dtype": "bfloat16"}
    cfg.update(extra)
    return cfg


def _state_dict(E: int, width: int, seed: int) -> dict[str, torch.Tensor]:
    """Random weights under the released checkpoints' names (inv_freq in bf16, as stored there)."""
    g = torch.Generator().manual_seed(seed)

    def w(*shape: int, std: float = 0.08) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * std

    sd = {"model.embed_tokens.weight": w(V, H, std=1.0), "model.norm.weight": 1 + w(H), "lm_head.weight": w(V, H)}
    d = H // NH
    for n in range(L):
        p = f"model.layers.{n}."
        sd[p + "input_layernorm.weight"] = 1 + w(H)
        sd[p + "post_attention_layernorm.weight"] = 1 + w(H)
        for proj in "qkvo":
            sd[f"{p}self_attn.{proj}_proj.weight"] = w(H, H)
        sd[p + "self_attn.rotary_emb.inv_freq"] = (1.0 / 10000 ** (torch.arange(0, d, 2).float() / d)).bfloat16()
        sd[p + "mlp.gate.gate_network.0.weight"] = w(E, H, std=0.5)
        sd[p + "mlp.gate.gate_network.2.weight"] = w(E, E, std=0.5)
        sd[p + "mlp.gate.weight_noise.weight"] = w(E, H)
        for e in range(E):
            sd[f"{p}mlp.calculator.experts.weight_gate.{e}"] = w(width, H)
            sd[f"{p}mlp.calculator.experts.weight_up.{e}"] = w(width, H)
            sd[f"{p}mlp.calculator.experts.weight_down.{e}"] = w(H, width)
    return sd


def _write(path: Path, config: dict, sd: dict[str, torch.Tensor]) -> Path:
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    save_file(sd, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


# ---- the literal reference ------------------------------------------------------------------------------


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    return w * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def _attention(x: torch.Tensor, sd: dict, p: str) -> torch.Tensor:
    T, d = x.shape[0], H // NH
    q = (x @ sd[p + "q_proj.weight"].T).view(T, NH, d).transpose(0, 1)
    k = (x @ sd[p + "k_proj.weight"].T).view(T, NH, d).transpose(0, 1)
    v = (x @ sd[p + "v_proj.weight"].T).view(T, NH, d).transpose(0, 1)
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2, dtype=torch.float32) / d))  # recomputed, not the bf16 copy
    ang = torch.outer(torch.arange(T, dtype=torch.float32), inv)
    cos, sin = torch.cat([ang, ang], -1).cos(), torch.cat([ang, ang], -1).sin()

    def rope(t: torch.Tensor) -> torch.Tensor:
        half = torch.cat([-t[..., d // 2:], t[..., : d // 2]], -1)
        return t * cos + half * sin

    q, k = rope(q), rope(k)
    scores = q @ k.transpose(-1, -2) / math.sqrt(d)
    scores = scores + torch.full((T, T), float("-inf")).triu(1)
    out = torch.softmax(scores.float(), -1).to(q.dtype) @ v
    return out.transpose(0, 1).reshape(T, H) @ sd[p + "o_proj.weight"].T


def _moe(x: torch.Tensor, sd: dict, p: str, E: int, k: int, sigma: float) -> torch.Tensor:
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        z = sd[p + "gate.gate_network.2.weight"] @ torch.tanh(sd[p + "gate.gate_network.0.weight"] @ x[t])
        top = torch.topk(z, k).indices
        probs = torch.softmax(z[top].float(), -1)
        for i, e in enumerate(top.tolist()):
            wg = sd[f"{p}calculator.experts.weight_gate.{e}"]
            wu = sd[f"{p}calculator.experts.weight_up.{e}"]
            wd = sd[f"{p}calculator.experts.weight_down.{e}"]
            y = wd @ (F.silu(wg @ x[t]) * (wu @ x[t]))
            out[t] += probs[i] * sigma * y
    return out


def reference_logits(sd: dict, ids: torch.Tensor, E: int, k: int, sigma: float) -> torch.Tensor:
    rows = []
    for seq in ids:
        h = sd["model.embed_tokens.weight"][seq]
        for n in range(L):
            p = f"model.layers.{n}."
            h = h + _attention(_rms(h, sd[p + "input_layernorm.weight"], 1e-5), sd, p + "self_attn.")
            h = h + _moe(_rms(h, sd[p + "post_attention_layernorm.weight"], 1e-5), sd, p + "mlp.", E, k, sigma)
        rows.append(_rms(h, sd["model.norm.weight"], 1e-5) @ sd["lm_head.weight"].T)
    return torch.stack(rows)


# ---- tests ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("E, k, sigma, width", [(8, 2, 4.0, 12), (16, 4, 4.0, 6), (16, 2, 8.0, 6)])
def test_llama_moe_logits_equal_the_literal_maths(tmp_path, E, k, sigma, width):
    sd = _state_dict(E, width, seed=E + k)
    path = _write(tmp_path, _config(E, k, sigma, width), sd)
    model = from_hf(path).eval()
    moe = model.config.moe
    assert (moe.router, moe.gate, moe.score_scale, moe.router_noise, moe.expert_ffn_dim) == \
        ("mlp_tanh", "topk_softmax", sigma, 0.01, width)
    assert model.config.model.norm_eps == 1e-5  # from config.json, not LlamaMoEConfig's 1e-6 default
    ids = torch.randint(0, V, (2, 24), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        got = model(ids).logits
    want = reference_logits(sd, ids, E, k, sigma)
    err = (got - want).abs().max().item()
    assert err < 1e-4, err


def test_llama_moe_export_keeps_names_config_and_companions(tmp_path):
    sd = _state_dict(8, 12, seed=3)
    src = _write(tmp_path / "src", _config(8, 2, 4.0, 12), sd)
    (src / "modeling_llama_moe_hf.py").write_text("# the model's remote code\n")
    (src / "tokenizer_config.json").write_text("{}")
    model = from_hf(src)
    base = json.loads((src / "config.json").read_text())
    out = to_hf(model, tmp_path / "out", base=base, copy_from=src, dtype=torch.float32)
    written = DirectorySource(out)
    try:
        names = set(written.info())
        assert names == {n for n in sd if not n.endswith("inv_freq")}  # the rotary table is recomputed, not kept
        assert all(torch.equal(written.read(n), sd[n]) for n in names)
    finally:
        written.close()
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["auto_map"] == base["auto_map"] and cfg["score_scale_factor"] == 4.0 and cfg["torch_dtype"] == "float32"
    assert (out / "modeling_llama_moe_hf.py").is_file() and (out / "tokenizer_config.json").is_file()
    fresh = to_hf(model, tmp_path / "fresh")  # without a base: written from moebal's config alone
    again = from_hf(fresh)
    assert again.config.moe == model.config.moe and again.config.model == model.config.model


def test_noisy_gating_matches_its_formula_in_training_only(tmp_path):
    path = _write(tmp_path, _config(8, 2, 4.0, 12), _state_dict(8, 12, seed=5))
    layer = from_hf(path).model.layers[0].block_sparse_moe
    x = torch.randn(10, H, generator=torch.Generator().manual_seed(0))
    clean = layer.gate_out(torch.tanh(layer.gate(x)))
    layer.eval()
    assert torch.equal(layer.router_logits(x), clean)
    layer.train()
    torch.manual_seed(11)
    noisy = layer.router_logits(x)
    torch.manual_seed(11)
    eps = torch.randn_like(clean)
    want = clean + eps * (F.softplus(x @ layer.gate_noise.weight.T) + 0.01)
    assert torch.allclose(noisy, want, atol=1e-6)


@pytest.mark.parametrize("change, message", [
    ({"size_experts": [[12] * 7 + [11]] * L}, "equal expert widths"),
    ({"gate_use_softmax": False}, "gate_use_softmax=False is not supported"),
    ({"calculator_type": "SwitchDropTokenCalculator"}, "calculator_type='SwitchDropTokenCalculator'"),
    ({"score_scale_factor": [4.0, 2.0]}, "per-layer score_scale_factor"),
    ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
])
def test_llama_moe_variants_outside_v1_are_refused(tmp_path, change, message):
    path = _write(tmp_path, _config(8, 2, 4.0, 12, **change), _state_dict(8, 12, seed=1))
    with pytest.raises(CheckpointError, match=message):
        from_hf(path)


def test_linear_gate_variant_and_no_noise_skip_the_extra_tensors(tmp_path):
    sd = _state_dict(8, 12, seed=2)
    for n in range(L):
        p = f"model.layers.{n}.mlp.gate."
        del sd[p + "gate_network.2.weight"]
        sd[p + "gate_network.weight"] = sd.pop(p + "gate_network.0.weight")
    path = _write(tmp_path, _config(8, 2, 4.0, 12, gate_network="linear", gate_add_noise=False), sd)
    model = from_hf(path)
    assert model.config.moe.router == "linear" and model.config.moe.router_noise is None
    assert not hasattr(model.model.layers[0].block_sparse_moe, "gate_noise")  # weight_noise present, not needed
