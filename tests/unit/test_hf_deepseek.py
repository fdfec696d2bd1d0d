"""DeepSeek-V2/V3 interop against `transformers` itself: tiny random models (group counts, shared experts on and
off, first-k dense layers, compressed or plain query, yarn or plain rotary, tied embeddings): fp32 logits within
1e-4 of transformers, HF -> moebal -> HF bit-identical, and the export loads back into transformers."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from moebal.errors import CheckpointError
from moebal.interop.hf import config_from_hf, from_hf, to_hf
from tests.hf_util import logits, read_tensors, transformers_or_skip

YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 16,
        "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 0.707, "mscale_all_dim": 0.707}
PLAIN = {"rope_type": "default", "rope_theta": 20000.0}


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny tensors (tests/conftest.py)


def tiny_deepseek(path: Path, version: int, seed: int = 0, **overrides: Any) -> Any:
    """A random DeepseekV{2,3}ForCausalLM saved to `path`, its router, selection bias and norms randomised so
    that routing and normalisation matter; returns the model."""
    transformers = transformers_or_skip()
    kw: dict[str, Any] = dict(vocab_size=96, hidden_size=32, intermediate_size=40, moe_intermediate_size=12,
                              num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=16,
                              num_experts_per_tok=4, n_shared_experts=1, first_k_dense_replace=1, q_lora_rank=16,
                              kv_lora_rank=20, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6,
                              max_position_embeddings=64, rope_parameters=dict(YARN), tie_word_embeddings=False,
                              routed_scaling_factor=2.5 if version == 3 else 1.5)
    kw.update(overrides)
    cls = transformers.DeepseekV3ForCausalLM if version == 3 else transformers.DeepseekV2ForCausalLM
    conf = transformers.DeepseekV3Config if version == 3 else transformers.DeepseekV2Config
    torch.manual_seed(seed)
    model = cls(conf(**kw)).eval()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
            elif p.dim() == 1:
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.05 * torch.randn(b.shape, generator=g))
    with contextlib.redirect_stderr(io.StringIO()):
        model.save_pretrained(str(path))
    return model


CASES = {  # version, overrides of tiny_deepseek
    "v3-groups4of2-shared1-dense1-yarn": (3, dict(n_group=4, topk_group=2)),
    "v3-groups8of3-noshared-qplain-halfrope": (3, dict(n_group=8, topk_group=3, n_shared_experts=0, q_lora_rank=None,
                                                       rope_interleave=False, rope_parameters=dict(PLAIN))),
    "v3-nogroups-shared2-dense0-tied": (3, dict(n_group=1, topk_group=1, n_shared_experts=2, first_k_dense_replace=0,
                                                tie_word_embeddings=True)),
    "v2lite-greedy-shared2-dense1-yarn": (2, dict(q_lora_rank=None, n_shared_experts=2, topk_method="greedy")),
    "v2-grouplimited4of2-plain": (2, dict(topk_method="group_limited_greedy", n_group=4, topk_group=2,
                                          rope_parameters=dict(PLAIN), first_k_dense_replace=2)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_deepseek_logits_equal_transformers_and_the_round_trip_is_bit_identical(case, tmp_path):
    version, overrides = CASES[case]
    src = tmp_path / "src"
    ref = tiny_deepseek(src, version, **overrides)
    ours = from_hf(src).eval()
    cfg = ours.config
    hf = ref.config
    assert cfg.moe.first_dense == hf.first_k_dense_replace and cfg.moe.shared_experts == hf.n_shared_experts
    assert [layer.is_moe for layer in ours.model.layers] == [i >= hf.first_k_dense_replace for i in range(3)]
    assert cfg.moe.gate == ("sigmoid_topk" if version == 3 else "softmax_topk")
    ids = torch.randint(0, 96, (2, 37), generator=torch.Generator().manual_seed(3))
    err = (logits(ours, ids) - logits(ref, ids)).abs().max().item()
    assert err < 1e-4, err
    base = json.loads((src / "config.json").read_text())
    out = to_hf(ours, tmp_path / "out", base=base)  # what a continuation run's export does: keep every key
    assert json.loads((out / "config.json").read_text()) == {**base, "dtype": "float32"}
    a, b = read_tensors(src), read_tensors(out)
    a = {k: v for k, v in a.items() if v.numel()}  # a 0-wide shared expert (n_shared_experts 0) holds nothing
    assert set(a) == set(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k
    back = transformers_or_skip().AutoModelForCausalLM.from_pretrained(str(out)).eval()
    assert type(back) is type(ref)
    assert torch.equal(logits(back, ids), logits(ref, ids))


def test_export_without_a_base_config_writes_what_transformers_reads(tmp_path):
    """The config.json written from moebal's config alone (no base) rebuilds the same model in transformers."""
    src = tmp_path / "src"
    ref = tiny_deepseek(src, 3, n_group=4, topk_group=2)
    ours = from_hf(src).eval()
    (tmp_path / "out").mkdir()
    from moebal.interop.hf import write_hf
    from moebal.interop.tensor_io import StateDictSource

    out = write_hf(StateDictSource(dict(ours.state_dict())), ours.config, tmp_path / "out" / "m")
    back = transformers_or_skip().AutoModelForCausalLM.from_pretrained(str(out)).eval()
    ids = torch.randint(0, 96, (2, 30), generator=torch.Generator().manual_seed(4))
    assert torch.equal(logits(back, ids), logits(ref, ids))


def test_v3_selection_bias_loads_into_expert_bias_and_only_changes_the_choice(tmp_path):
    src = tmp_path / "src"
    ref = tiny_deepseek(src, 3, n_group=4, topk_group=2)
    ours = from_hf(src)
    layer = ours.model.layers[1].block_sparse_moe
    want = ref.model.layers[1].mlp.gate.e_score_correction_bias
    assert torch.equal(layer.expert_bias, want) and layer.expert_bias.dtype == torch.float32
    assert ours.config.moe.selection_bias and ours.config.moe.bias_update_rate == 0.0
    r = layer.route(torch.randn(50, 32))
    torch.testing.assert_close(r.weights_TK.sum(-1), torch.full((50,), 2.5))  # unbiased, normalised, scaled


def test_deepseek_refusals_name_the_key(tmp_path):
    src = tmp_path / "src"
    tiny_deepseek(src, 2)
    conf = json.loads((src / "config.json").read_text())
    for key, value, match in (("norm_topk_prob", True, "norm_topk_prob"), ("topk_method", "noaux_tc", "topk_method"),
                              ("moe_layer_freq", 2, "moe_layer_freq"), ("first_k_dense_replace", 3, "no MoE layer"),
                              ("rope_parameters", {"rope_type": "dynamic", "factor": 2.0}, "dynamic"),
                              ("quantization_config", {"quant_method": "fp8"}, "dequantise to bf16")):
        (src / "config.json").write_text(json.dumps({**conf, key: value}))
        with pytest.raises(CheckpointError, match=match):
            config_from_hf(src)


@pytest.mark.parametrize("version", [2, 3])
def test_bf16_round_trip_keeps_the_fp32_router_bit_identical(version, tmp_path):
    """transformers keeps DeepSeek's gate.weight (and V3's e_score_correction_bias) in fp32 in a bf16 checkpoint;
    a bf16 load keeps them fp32 and the export writes them back as fp32, the rest as bf16."""
    transformers = transformers_or_skip()
    tiny_deepseek(tmp_path / "a", version, n_group=4, topk_group=2,
                  **({"topk_method": "group_limited_greedy"} if version == 2 else {}))
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "a"), dtype=torch.bfloat16)
    with contextlib.redirect_stderr(io.StringIO()):
        hf.save_pretrained(str(tmp_path / "b"))
    ours = from_hf(tmp_path / "b", dtype="auto")
    layer = ours.model.layers[1].block_sparse_moe
    assert layer.gate.weight.dtype == torch.float32 and layer.experts.w1.dtype == torch.bfloat16
    a, b = read_tensors(tmp_path / "b"), read_tensors(to_hf(ours, tmp_path / "c"))
    assert {k: v.dtype for k, v in a.items()} == {k: v.dtype for k, v in b.items()}
    assert all(torch.equal(a[k], b[k]) for k in a)
    # through a moebal weights directory (`moebal convert` both ways): the router stays fp32 there too
    from moebal.interop.hf import hf_to_moebal

    hf_to_moebal(tmp_path / "b", tmp_path / "mb")
    assert from_hf(tmp_path / "mb", dtype="auto").model.layers[1].block_sparse_moe.gate.weight.dtype == torch.float32
    c = read_tensors(to_hf(from_hf(tmp_path / "mb", dtype="auto"), tmp_path / "d"))
    assert {k: v.dtype for k, v in a.items()} == {k: v.dtype for k, v in c.items()}
    assert all(torch.equal(a[k], c[k]) for k in a)


def test_router_fp32_ignores_autocast():
    from moebal.models.moe import MoELayer

    layer = MoELayer(32, 8, 16, 4, gate="sigmoid_topk", n_group=4, topk_group=2, group_score="top2_sum",
                     router_fp32=True)
    x = torch.randn(40, 32)
    want = x @ layer.gate.weight.t()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = layer.router_logits(x)
    assert got.dtype == torch.float32 and torch.equal(got, want)
    # every linear of the router: LLaMA-MoE's tanh MLP and its noise scale too (training, a seeded draw)
    mlp = MoELayer(32, 8, 16, 4, router="mlp_tanh", router_noise=0.1, router_fp32=True)
    want = torch.tanh(x @ mlp.gate.weight.t()) @ mlp.gate_out.weight.t()
    for noisy in (False, True):
        mlp.train(noisy)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            torch.manual_seed(1)
            got = mlp.router_logits(x)
        torch.manual_seed(1)
        std = torch.nn.functional.softplus(x @ mlp.gate_noise.weight.t()) + 0.1
        draw = torch.empty_like(want).normal_()
        assert got.dtype == torch.float32 and torch.equal(got, want + draw * std if noisy else want), noisy


def test_convert_cli_both_ways_through_a_moebal_directory(tmp_path, capsys):
    """`moebal convert hf-to-moebal` keeps MLA, the routing fields and V3's selection bias; `moebal-to-hf` gives
    back the same tensors."""
    from moebal.cli import main

    src = tmp_path / "src"
    ref = tiny_deepseek(src, 3, n_group=4, topk_group=2)
    assert main(["convert", "hf-to-moebal", str(src), str(tmp_path / "mb")]) == 0
    ours = from_hf(tmp_path / "mb").eval()
    assert ours.config.moe.selection_bias and ours.config.model.mla is not None
    ids = torch.randint(0, 96, (2, 21), generator=torch.Generator().manual_seed(6))
    assert (logits(ours, ids) - logits(ref, ids)).abs().max().item() < 1e-4
    assert main(["convert", "moebal-to-hf", str(tmp_path / "mb"), str(tmp_path / "back"), "--arch", "deepseek_v3"]) == 0
    a, b = read_tensors(src), read_tensors(tmp_path / "back")
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)


def test_exports_refuse_what_the_layout_cannot_express(tmp_path):
    from moebal.config import with_overrides
    from moebal.errors import ConfigError
    from moebal.interop.hf import check_exportable, choose_arch

    src = tmp_path / "src"
    tiny_deepseek(src, 3, n_group=4, topk_group=2)
    cfg = config_from_hf(src)
    assert choose_arch(cfg) == "deepseek_v3"
    with pytest.raises(ConfigError, match="multi-head latent attention"):
        check_exportable(cfg, "mixtral")
    with pytest.raises(ConfigError, match="deepseek_v2 routes with"):
        check_exportable(cfg, "deepseek_v2")
    with pytest.raises(ConfigError, match="sigmoid_topk"):
        check_exportable(with_overrides(cfg, ["moe.gate=softmax_topk"]), "deepseek_v3")
    with pytest.raises(ConfigError, match="gated shared expert"):
        check_exportable(with_overrides(cfg, ["moe.shared_gate=true"]), "deepseek_v3")


def test_v3_multi_token_prediction_layer_is_skipped(tmp_path):
    """DeepSeek-V3 ships its multi-token-prediction module as model.layers.61.*, which transformers ignores."""
    from safetensors.torch import load_file, save_file

    src = tmp_path / "src"
    ref = tiny_deepseek(src, 3, n_group=4, topk_group=2)
    f = src / "model.safetensors"
    sd = load_file(str(f))
    sd["model.layers.61.eh_proj.weight"] = torch.zeros(32, 64)
    save_file(sd, str(f), metadata={"format": "pt"})
    ours = from_hf(src).eval()
    ids = torch.randint(0, 96, (1, 12), generator=torch.Generator().manual_seed(8))
    assert (logits(ours, ids) - logits(ref, ids)).abs().max().item() < 1e-4
