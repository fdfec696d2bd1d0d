"""Qwen3-MoE, OLMoE and Qwen2-MoE's gaps against `transformers` itself: fp32 logits, HF -> moebal -> HF round
trips with the same config keys, exports that `AutoModelForCausalLM` loads and generates with, exports that keep
the source's keys and files, sliding-window attention past the window, the fused expert layout, and the real
presets' parameter counts."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from moebal.errors import CheckpointError, ConfigError
from moebal.interop.hf import config_from_hf, from_hf, to_hf
from moebal.interop.hf_config import load
from moebal.models.transformer import MoebalForCausalLM
from tests.hf_util import (
    logits,
    read_tensors,
    tiny_mixtral,
    tiny_olmoe,
    tiny_qwen2_moe,
    tiny_qwen3_moe,
    tiny_tokenizer,
    transformers_or_skip,
)

TEXTS = [f"sample {i}: experts, routers and tokens; the lazy dog sleeps {i % 5} hours." for i in range(12)]


def _err(ours: Any, ref: Any, T: int = 37, seed: int = 0) -> float:
    ids = torch.randint(0, ref.config.vocab_size, (2, T), generator=torch.Generator().manual_seed(seed))
    return (logits(ours, ids) - logits(ref, ids)).abs().max().item()


def _round_trip(src: Path, out: Path, ignore: tuple[str, ...] = ()) -> None:
    """to_hf(from_hf(src)): the same tensors bit for bit, the same config.json keys and values."""
    to_hf(from_hf(src), out)
    a, b = read_tensors(src), read_tensors(out)
    assert set(a) == set(b), sorted(set(a) ^ set(b))[:4]
    for k in a:
        if not k.endswith(ignore):
            assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k
    assert json.loads((out / "config.json").read_text()) == json.loads((src / "config.json").read_text())


def _generates_like(out: Path, ref: Any) -> None:
    """The export loads with AutoModelForCausalLM and greedy generation gives the reference's tokens."""
    back = transformers_or_skip().AutoModelForCausalLM.from_pretrained(str(out)).eval()
    assert type(back) is type(ref)
    ids = torch.randint(3, ref.config.vocab_size, (1, 6), generator=torch.Generator().manual_seed(7))
    kw = dict(max_new_tokens=4, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        got, want = back.generate(ids, **kw), ref.generate(ids, **kw)
    assert got.shape == (1, 10) and torch.equal(got, want)


# ---- Qwen3-MoE -------------------------------------------------------------------------------------------

QWEN3_SETTINGS = {
    "dense-layer-head-dim": {},  # mlp_only_layers [1], head_dim 12 != 32 / 4, norm_topk_prob true
    "sparse-step-unnormalised": dict(decoder_sparse_step=2, mlp_only_layers=[], norm_topk_prob=False,
                                     num_hidden_layers=4),
    "tied-odd-sizes": dict(vocab_size=101, hidden_size=40, num_attention_heads=5, num_key_value_heads=1,
                           head_dim=8, moe_intermediate_size=20, intermediate_size=28, num_experts=5,
                           num_experts_per_tok=3, mlp_only_layers=[0, 2], tie_word_embeddings=True),
}


@pytest.mark.parametrize("setting", QWEN3_SETTINGS)
def test_qwen3_moe_logits_round_trip_and_generation(tmp_path, setting):
    src = tmp_path / "src"
    ref = tiny_qwen3_moe(src, **QWEN3_SETTINGS[setting])
    ours = from_hf(src).eval()
    m, moe = ours.config.model, ours.config.moe
    assert m.qk_norm == "head" and moe.shared_experts == 0
    hf = ref.config
    assert ours.config.head_dim == (hf.head_dim or hf.hidden_size // hf.num_attention_heads)
    moe_layers = [i for i in range(hf.num_hidden_layers) if i not in hf.mlp_only_layers
                  and (i + 1) % hf.decoder_sparse_step == 0]
    assert [layer.is_moe for layer in ours.model.layers] == [i in moe_layers for i in range(hf.num_hidden_layers)]
    assert _err(ours, ref) < 1e-4
    _round_trip(src, tmp_path / "out")
    _generates_like(tmp_path / "out", ref)


def test_qwen3_moe_export_without_origin_loads_in_transformers(tmp_path):
    """A config.json written from moebal's config alone (no source to keep keys from) describes the same model."""
    src = tmp_path / "src"
    ref = tiny_qwen3_moe(src)
    out = to_hf(from_hf(src), tmp_path / "out", keep_origin=False)
    written = json.loads((out / "config.json").read_text())
    assert written["head_dim"] == 12 and written["mlp_only_layers"] == [1] and written["norm_topk_prob"] is True
    back = transformers_or_skip().AutoModelForCausalLM.from_pretrained(str(out)).eval()
    assert _err(back, ref) < 1e-6


def test_qwen3_moe_convert_cli_both_ways(tmp_path):
    from moebal.cli import main

    src = tmp_path / "src"
    ref = tiny_qwen3_moe(src)
    assert main(["convert", "hf-to-moebal", str(src), str(tmp_path / "mb")]) == 0
    cfg = load(tmp_path / "mb" / "config.yaml")
    assert (cfg.model.qk_norm, cfg.model.head_dim, cfg.moe.dense_layers) == ("head", 12, (1,))
    assert _err(from_hf(tmp_path / "mb").eval(), ref) < 1e-4
    assert main(["convert", "moebal-to-hf", str(tmp_path / "mb"), str(tmp_path / "hf")]) == 0
    a, b = read_tensors(src), read_tensors(tmp_path / "hf")
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)
    assert json.loads((tmp_path / "hf" / "config.json").read_text()) == json.loads((src / "config.json").read_text())


# ---- OLMoE -----------------------------------------------------------------------------------------------

OLMOE_SETTINGS = {
    "gqa-unnormalised": {},
    "normalised-tied": dict(norm_topk_prob=True, tie_word_embeddings=True, num_key_value_heads=4),
    "odd-sizes": dict(vocab_size=77, hidden_size=24, num_attention_heads=3, num_key_value_heads=3,
                      intermediate_size=12, num_experts=6, num_experts_per_tok=1, num_hidden_layers=3),
}


@pytest.mark.parametrize("setting", OLMOE_SETTINGS)
def test_olmoe_logits_round_trip_and_generation(tmp_path, setting):
    src = tmp_path / "src"
    ref = tiny_olmoe(src, **OLMOE_SETTINGS[setting])
    ours = from_hf(src).eval()
    assert ours.config.model.qk_norm == "full"
    attn = ours.model.layers[0].self_attn
    assert attn.q_norm.weight.shape == (ref.config.hidden_size,)  # over the whole projection, not per head
    assert attn.k_norm.weight.shape == (ref.config.num_key_value_heads * ours.config.head_dim,)
    assert _err(ours, ref) < 1e-4
    _round_trip(src, tmp_path / "out")
    _generates_like(tmp_path / "out", ref)


def test_olmoe_refuses_clip_qkv(tmp_path):
    tiny_olmoe(tmp_path, clip_qkv=8.0)
    with pytest.raises(CheckpointError, match="clip_qkv is 8.0"):
        from_hf(tmp_path)


# ---- Qwen2-MoE's gaps: mlp_only_layers, no shared expert ----------------------------------------------------


@pytest.mark.parametrize("shared", [24, 0], ids=["shared-expert", "no-shared-expert"])
def test_qwen2_moe_mlp_only_layers_and_no_shared_expert(tmp_path, shared):
    src = tmp_path / "src"
    ref = tiny_qwen2_moe(src, shared_expert_intermediate_size=shared, decoder_sparse_step=1, mlp_only_layers=[0, 3])
    ours = from_hf(src).eval()
    assert [layer.is_moe for layer in ours.model.layers] == [False, True, True, False]
    assert (ours.config.moe.shared_experts > 0) == (shared > 0)
    assert _err(ours, ref) < 1e-4
    # An absent shared expert is stored by transformers as empty tensors and a gate that multiplies nothing; the
    # export writes those as zeros (the gate's random values cannot change any output).
    _round_trip(src, tmp_path / "out", ignore=("shared_expert_gate.weight",) if not shared else ())
    gates = {k: v for k, v in read_tensors(tmp_path / "out").items() if k.endswith("shared_expert_gate.weight")}
    assert len(gates) == 2 and (shared > 0 or all(not v.any() for v in gates.values()))
    _generates_like(tmp_path / "out", ref)


def test_a_moebal_model_without_shared_expert_exports_as_qwen2_moe(tmp_path):
    """Dense layers and attention biases need the Qwen2-MoE layout, which no longer requires a shared expert."""
    cfg = load(None, ["model.vocab_size=256", "model.dim=32", "model.n_layers=3", "model.n_heads=4",
                      "model.n_kv_heads=2", "model.ffn_dim=40", "model.attention_bias=true", "moe.num_experts=4",
                      "moe.expert_ffn_dim=16", "moe.dense_layers=[1]", "data.seq_len=32", "model.max_seq_len=64"])
    torch.manual_seed(0)
    model = MoebalForCausalLM(cfg).eval()
    out = to_hf(model, tmp_path / "out")
    written = json.loads((out / "config.json").read_text())
    assert written["model_type"] == "qwen2_moe" and written["shared_expert_intermediate_size"] == 0
    back = transformers_or_skip().AutoModelForCausalLM.from_pretrained(str(out)).eval()
    assert _err(model, back) < 1e-4


# ---- exports keep everything ---------------------------------------------------------------------------------


def test_export_keeps_every_source_key_and_companion_file(tmp_path):
    src = tmp_path / "src"
    tiny_qwen3_moe(src)
    tiny_tokenizer(src, TEXTS, vocab_size=96)
    (src / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 64}))
    assert (src / "generation_config.json").is_file()  # transformers writes it for bos/eos ids
    model = from_hf(src)
    shutil.move(src, tmp_path / "moved")  # the origin's config.json is kept in memory with the model
    out = to_hf(model, tmp_path / "out")
    base = json.loads(((tmp_path / "moved") / "config.json").read_text())
    assert json.loads((out / "config.json").read_text()) == base
    assert (base["bos_token_id"], base["eos_token_id"], base["head_dim"]) == (1, 2, 12)
    # the companion files travel from where the model was read; that directory moved, so a model whose
    # hf.init_from is present copies them
    model2 = from_hf(tmp_path / "moved")
    out2 = to_hf(model2, tmp_path / "out2")
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (out2 / name).read_bytes() == (tmp_path / "moved" / name).read_bytes(), name


def test_export_never_writes_a_config_of_another_model(tmp_path):
    src, mixtral = tmp_path / "src", tmp_path / "mixtral"
    tiny_qwen3_moe(src)
    tiny_mixtral(mixtral)  # the qwen2_moe layout could hold its weights, but config.json would name another model
    with pytest.raises(ConfigError, match="loaded from a mixtral checkpoint but is exported as qwen2_moe"):
        to_hf(from_hf(mixtral), tmp_path / "a", arch="qwen2_moe")
    with pytest.raises(ConfigError, match=r"model.qk_norm: head needs the qwen3_moe layout"):
        to_hf(from_hf(src), tmp_path / "b", arch="qwen2_moe", keep_origin=False)
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


# ---- sliding-window attention -------------------------------------------------------------------------------


def test_sliding_window_matches_transformers_past_the_window_and_trains_longer(tmp_path):
    src = tmp_path / "src"
    ref = tiny_mixtral(src, sliding_window=8, max_position_embeddings=64)
    ours = from_hf(src).eval()
    assert ours.config.model.sliding_window == 8 and ours.config.model.max_seq_len == 64
    err = _err(ours, ref, T=40)
    full = from_hf(src, cfg=config_from_hf(src, {"model": {"sliding_window": None}})).eval()
    assert err < 1e-4 and _err(full, ref, T=40) > 1e-3  # the window matters on 40 tokens, and is applied
    cfg = load(None, [f"hf.init_from={src}", "data.seq_len=48", f"data.tokenizer={src}/tokenizer.json"])
    assert cfg.data.seq_len == 48  # longer than the window: accepted
    out = to_hf(ours, tmp_path / "out")
    assert json.loads((out / "config.json").read_text())["sliding_window"] == 8


def test_qwen3_moe_s_sliding_window_is_one_window_on_every_layer_as_in_transformers(tmp_path):
    """Qwen3-MoE's `use_sliding_window: true` windows every layer alike in transformers 5 (Qwen2-MoE's per-layer
    windows stay refused): the logits match past the window, the window matters, and the export writes it back
    (a transformers model loaded from the export gives the same logits)."""
    transformers = pytest.importorskip("transformers")
    src = tmp_path / "src"
    ref = tiny_qwen3_moe(src, use_sliding_window=True, sliding_window=8)
    ours = from_hf(src).eval()
    assert ours.config.model.sliding_window == 8
    full = from_hf(src, cfg=config_from_hf(src, {"model": {"sliding_window": None}})).eval()
    assert _err(ours, ref, T=40) < 1e-4 and _err(full, ref, T=40) > 1e-3
    out = to_hf(ours, tmp_path / "out")
    saved = json.loads((out / "config.json").read_text())
    assert (saved["use_sliding_window"], saved["sliding_window"]) == (True, 8)
    back = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert _err(back, ref, T=40) < 1e-6
    plain = to_hf(full, tmp_path / "plain", keep_origin=False)  # another model than the base config.json
    assert json.loads((plain / "config.json").read_text())["use_sliding_window"] is False
    tiny_qwen2_moe(tmp_path / "q2", use_sliding_window=True, sliding_window=8)
    with pytest.raises(CheckpointError, match="not Qwen2-MoE's per-layer windows"):
        from_hf(tmp_path / "q2")


def test_sequence_longer_than_the_checkpoint_gives_one_way_advice(tmp_path):
    tiny_mixtral(tmp_path, max_position_embeddings=64)
    with pytest.raises(ConfigError, match=r"max_position_embeddings\): lower data.seq_len to at most 64$"):
        load(None, [f"hf.init_from={tmp_path}", "data.seq_len=80", f"data.tokenizer={tmp_path}/tokenizer.json"])


# ---- transformers 5's fused expert layout -----------------------------------------------------------------


@pytest.mark.parametrize("family", ["qwen3_moe", "olmoe", "qwen2_moe", "mixtral"])
def test_fused_expert_layout_is_read_directly(tmp_path, family):
    """save_pretrained(..., save_original_format=False) stacks each layer's experts (gate_up_proj [E, 2F, D],
    down_proj [E, D, F]); moebal reads it, and into moebal directories, and exports the per-expert layout."""
    make = {"qwen3_moe": tiny_qwen3_moe, "olmoe": tiny_olmoe, "qwen2_moe": tiny_qwen2_moe, "mixtral": tiny_mixtral}
    fused, plain = tmp_path / "fused", tmp_path / "plain"
    ref = make[family](plain)
    ref.save_pretrained(str(fused), save_original_format=False)
    assert any(k.endswith("mlp.experts.gate_up_proj") for k in read_tensors(fused))
    ours = from_hf(fused).eval()
    assert _err(ours, ref) < 1e-4
    to_hf(ours, tmp_path / "out")
    a, b = read_tensors(plain), read_tensors(tmp_path / "out")
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)
    part = from_hf(fused, experts=[2, 3])  # an expert-parallel rank's rows only
    assert torch.equal(next(part.moe_layers()).experts.w3, next(ours.moe_layers()).experts.w3[2:4])
    from moebal.interop.hf import hf_to_moebal

    assert _err(from_hf(hf_to_moebal(fused, tmp_path / "mb")).eval(), ref) < 1e-4


def test_fused_layout_of_a_layout_without_one_is_refused_in_one_line(tmp_path):
    from moebal.interop.hf import check_source, hf_links
    from moebal.interop.tensor_io import StateDictSource

    cfg = config_from_hf(_qwen3_dir(tmp_path))
    src = StateDictSource({"model.layers.0.mlp.experts.gate_up_proj": torch.zeros(6, 32, 32)})
    with pytest.raises(CheckpointError) as e:
        check_source(src, hf_links(cfg, "llama_moe"), {}, "llama_moe", False, "DIR")
    msg = str(e.value)
    assert "fused layout" in msg and "save_original_format" in msg and "not for llama_moe" in msg
    assert len(msg.splitlines()) == 1


def _qwen3_dir(tmp_path: Path) -> Path:
    tiny_qwen3_moe(tmp_path / "q3")
    return tmp_path / "q3"


# ---- presets with the real shapes ---------------------------------------------------------------------------


@pytest.mark.parametrize("preset, total, active", [
    ("qwen3-30b-a3b", 30_532_122_624, 3_353_032_704),
    ("olmoe-1b-7b", 6_919_161_856, 1_282_017_280),
])
def test_real_presets_have_the_published_parameter_counts(preset, total, active):
    cfg = load(preset)
    with torch.device("meta"):
        model = MoebalForCausalLM(cfg)
    assert (model.num_parameters(), model.num_parameters(active=True)) == (total, active)
