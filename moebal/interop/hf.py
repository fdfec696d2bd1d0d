"""Hugging Face interop: Mixtral, LLaMA-MoE v1, Qwen2-MoE, Qwen3-MoE and OLMoE checkpoints <-> moebal's decoder.

Three pieces, each usable alone:

1. `config_fields(dir)`: the checkpoint's `config.json` mapped onto moebal's `model.*` and `moe.*` fields,
   split into shape fields (the weights only fit these values) and training defaults (values a continuation
   run starts from but may override, such as the load-balancing coefficient). `moebal.interop.hf_config.load` applies
   them when `hf.init_from` is set; `config_from_hf(dir)` builds a whole `Config` from them.
2. `hf_links(cfg, arch)`: the name mapping, one `Link` per HF tensor: HF tensor `hf` equals moebal tensor
   `ours`, or row `index` of it (moebal stacks a layer's experts, `experts.w1` [E, F, D]; HF stores one tensor
   per expert). Loading and exporting walk the same list, so the two directions cannot disagree.
3. `load_hf_weights` / `from_hf` and `write_hf` / `to_hf`: both stream tensor by tensor through a
   `TensorSource` (moebal/interop/tensor_io.py). A model to fill is built on the meta device and materialised
   empty, then every parameter is read straight into its storage; an export produces each HF tensor (a view
   of the model, or a row range of a file) only when its bytes are written. Peak memory is the model being
   built plus one tensor in flight (two when the dtype changes), whatever the checkpoint's size.

Every check happens before the first byte of weights is read: a missing, unexpected or misshapen tensor is a
`CheckpointError` naming the tensor, its file and the fix; nothing is returned half-loaded.

Maths the three formats share with moebal, and what maps where: docs/hf-interop.md. In short:
- Mixtral: softmax over all experts, top-k, renormalise (`moe.gate: softmax_topk`), linear router, dropless.
- LLaMA-MoE v1: Linear-tanh-Linear router (`moe.router: mlp_tanh`), softmax over the k selected logits
  (`moe.gate: topk_softmax`), output scaled by `score_scale_factor` (`moe.score_scale`, kept as a runtime
  factor rather than folded into w2 so that the parameters, their gradients and weight decay stay those of
  the original), noisy gating while training (`moe.router_noise`).
- Qwen2-MoE: softmax, top-k, optionally renormalised (`moe.norm_topk`), a shared expert scaled by a sigmoid
  gate (`moe.shared_gate`; none when its width is 0), q/k/v biases (`model.attention_bias`), dense layers
  between MoE layers (`moe.every`, `moe.dense_layers`).
- Qwen3-MoE: Qwen2-MoE's routing without shared expert or biases, RMSNorm on each q/k head (`model.qk_norm:
  head`), its own head_dim. OLMoE: RMSNorm over the whole q and k projections (`model.qk_norm: full`).
- transformers 5's fused experts (`mlp.experts.gate_up_proj` [E, 2F, D], `down_proj` [E, D, F]) are read
  row by row (`Link.hf_row`, `Link.half`); exports always use the per-expert layout.

A model `from_hf` returns carries `hf_origin` (the original config.json and its directory): `to_hf` keeps
every key of that config.json and copies the directory's tokenizer and generation files.
"""

from __future__ import annotations

import functools
import json
import os
import re
import shutil
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from moebal.config import Config, from_dict
from moebal.errors import CheckpointError, ConfigError
from moebal.fileio import read_json, sha256_of
from moebal.interop.tensor_io import (
    INDEX_NAME,
    SINGLE_NAME,
    DirectorySource,
    OutTensor,
    ScratchReader,
    StateDictSource,
    TensorSource,
    iter_shards,
    write_safetensors,
)

if TYPE_CHECKING:
    from moebal.models.local_init import Holding
    from moebal.models.transformer import MoebalForCausalLM

__all__ = [
    "ARCHITECTURES",
    "HFFields",
    "HFOrigin",
    "Link",
    "choose_arch",
    "config_fields",
    "config_from_hf",
    "from_hf",
    "hf_config_for",
    "hf_links",
    "hf_origin",
    "load_hf_weights",
    "read_hf_config",
    "to_hf",
    "write_hf",
]

# HF class name -> moebal's name for the layout
ARCHITECTURES = {"MixtralForCausalLM": "mixtral", "LlamaMoEForCausalLM": "llama_moe",
                 "Qwen2MoeForCausalLM": "qwen2_moe", "Qwen3MoeForCausalLM": "qwen3_moe", "OlmoeForCausalLM": "olmoe"}
ARCHITECTURES.update({"DeepseekV2ForCausalLM": "deepseek_v2", "DeepseekV3ForCausalLM": "deepseek_v3"})
_MODEL_TYPES = {v: v for v in ARCHITECTURES.values()}
_ARCH_CLASS = {v: k for k, v in ARCHITECTURES.items()}
# Files of a HF model directory that are not weights and travel with an export (tokenizer, generation
# defaults, the remote code LLaMA-MoE's config.json points to).
_COMPANIONS = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
               "generation_config.json", "added_tokens.json")
DTYPE_NAMES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# A moebal weights directory (`hf_to_moebal`): the model's config, its weights under moebal's names, the
# source's config.json (kept so an export restores every original key), and a manifest of sizes and sha256.
MOEBAL_CONFIG, BASE_CONFIG, MANIFEST = "config.yaml", "hf_config.json", "manifest.json"


# ---------------------------------------------------------------------------------------------
# config.json -> moebal fields


def read_hf_config(path: str | Path) -> dict[str, Any]:
    """The parsed config.json of a HF model directory."""
    p = Path(path)
    if not p.is_dir():
        raise CheckpointError(f"{path} is not a directory: give a HF model directory (config.json + "
                              f"*.safetensors)")
    f = p / "config.json"
    if not f.is_file():
        raise CheckpointError(f"{p} has no config.json: a HF model directory holds config.json next to its "
                              f"*.safetensors (save it with save_pretrained, or copy the model's config.json there)")
    data = read_json(f, "HF config", CheckpointError)
    if not isinstance(data, dict):
        raise CheckpointError(f"{f}: expected a JSON object")
    return data


def architecture(hf: dict[str, Any], where: str) -> str:
    """The layout name ('mixtral', 'qwen3_moe', ...) from config.json's `architectures` (or `model_type`)."""
    names = hf.get("architectures") or []
    for n in names if isinstance(names, list) else []:
        if n in ARCHITECTURES:
            return ARCHITECTURES[n]
    if hf.get("model_type") in _MODEL_TYPES:
        return _MODEL_TYPES[hf["model_type"]]
    got = ", ".join(map(str, names)) if isinstance(names, list) and names else f"model_type {hf.get('model_type')!r}"
    raise CheckpointError(f"{where}: architecture {got} is not supported; moebal loads "
                          f"{', '.join(ARCHITECTURES)} (dense models and other MoE layouts are not mapped)")


@dataclass(frozen=True)
class HFFields:
    """A checkpoint's config.json in moebal's terms."""

    arch: str
    shape: dict[str, dict[str, Any]]
    """Fields the weights fix ({'model': {...}, 'moe': {...}}): a config must agree with every one."""
    defaults: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Training settings of the original model, used unless the config sets its own."""


def _get(hf: dict[str, Any], key: str, default: Any, where: str, kind: type | tuple[type, ...] = int) -> Any:
    v = hf.get(key, default)
    if v is None:
        v = default
    if kind is float and isinstance(v, int) and not isinstance(v, bool):
        v = float(v)
    if not isinstance(v, kind) or isinstance(v, bool) and kind is not bool:
        raise CheckpointError(f"{where}: '{key}' must be {getattr(kind, '__name__', kind)}; got {v!r}")
    return v


def _dict_field(hf: dict[str, Any], key: str) -> dict[str, Any]:
    """hf[key] when it is a JSON object, else {} (absent, null, or another kind of value)."""
    v = hf.get(key)
    return v if isinstance(v, dict) else {}


def _rope_theta(hf: dict[str, Any], default: float, where: str) -> float:
    params, scaling = _dict_field(hf, "rope_parameters"), _dict_field(hf, "rope_scaling")
    kind = params.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    if kind != "default":
        raise CheckpointError(f"{where}: rotary scaling '{kind}' is not supported (moebal implements plain RoPE); "
                              f"use a checkpoint without rope_scaling")
    theta = params.get("rope_theta", hf.get("rope_theta"))
    return float(default if theta is None else theta)


def _common(hf: dict[str, Any], where: str, *, rope: float, eps: float, kv_default: int | None,
            max_pos: int, vocab: int, shape: tuple[int, int, int] = (4096, 32, 32)) -> dict[str, Any]:
    """The decoder fields every supported architecture shares (LLaMA's names). Keys the config.json leaves out
    take the architecture's transformers defaults: `shape` is (hidden_size, num_hidden_layers,
    num_attention_heads)."""
    act = hf.get("hidden_act", "silu")
    if act != "silu":
        raise CheckpointError(f"{where}: hidden_act '{act}' is not supported: moebal's MLPs and experts are SwiGLU "
                              f"(silu)")
    dim = _get(hf, "hidden_size", shape[0], where)
    heads = _get(hf, "num_attention_heads", shape[2], where)
    kv = _get(hf, "num_key_value_heads", kv_default or heads, where)
    head_dim = hf.get("head_dim")
    if head_dim is not None and head_dim == dim // heads and dim % heads == 0:
        head_dim = None  # the default: keep the config's null
    return {"vocab_size": _get(hf, "vocab_size", vocab, where), "dim": dim,
            "n_layers": _get(hf, "num_hidden_layers", shape[1], where), "n_heads": heads, "n_kv_heads": kv,
            "head_dim": head_dim, "max_seq_len": _get(hf, "max_position_embeddings", max_pos, where),
            "rope_theta": _rope_theta(hf, rope, where), "norm_eps": _get(hf, "rms_norm_eps", eps, where, float),
            "tie_embeddings": bool(hf.get("tie_word_embeddings", False)), "qk_norm": "none", "sliding_window": None}


_NO_GROUPS: dict[str, Any] = {"first_dense": 0, "n_group": 1, "topk_group": None, "group_score": "max"}
"""The routing fields of DeepSeek's that the other families fix: compared with a YAML that sets them, so a
`moe.n_group` on a Mixtral checkpoint is refused rather than change its logits (`selection_bias` stays free: an
aux-loss-free continuation of any family)."""


def _mixtral(hf: dict[str, Any], where: str) -> HFFields:
    # Defaults are MixtralConfig's, so a config.json that omits a key means what it means to transformers.
    model = _common(hf, where, rope=1e6, eps=1e-5, kv_default=8, max_pos=4096 * 32, vocab=32000)
    model["sliding_window"] = _window(hf, where)
    ffn = _get(hf, "intermediate_size", 14336, where)
    model["ffn_dim"] = ffn
    moe = {"num_experts": _get(hf, "num_local_experts", 8, where), "top_k": _get(hf, "num_experts_per_tok", 2, where),
           "expert_ffn_dim": ffn, "every": 1, "dense_layers": (), "shared_experts": 0, "shared_ffn_dim": None,
           "shared_gate": False, "router": "linear", "gate": "softmax_topk", "norm_topk": True, "score_scale": 1.0,
           **_NO_GROUPS}
    defaults = {"moe": {"aux_loss_coef": _get(hf, "router_aux_loss_coef", 0.001, where, float),
                        "jitter": _get(hf, "router_jitter_noise", 0.0, where, float)}}
    return HFFields("mixtral", {"model": model, "moe": moe}, defaults)


def _llama_moe(hf: dict[str, Any], where: str) -> HFFields:
    # LlamaMoEConfig's defaults: rms_norm_eps 1e-6 (the released config.json files say 1e-5), rope 10000.
    model = _common(hf, where, rope=10000.0, eps=1e-6, kv_default=None, max_pos=2048, vocab=32000)
    if hf.get("attention_bias"):
        raise CheckpointError(f"{where}: attention_bias is true; LLaMA attention biases (q, k, v and o) are not "
                              f"supported")
    E, k, L = _get(hf, "num_experts", 16, where), _get(hf, "num_selects", 4, where), model["n_layers"]
    total = _get(hf, "intermediate_size", 11008, where)
    sizes = hf.get("size_experts")
    if sizes is None:
        if total % E:
            raise CheckpointError(f"{where}: intermediate_size {total} does not split into {E} equal experts and "
                                  f"size_experts is absent")
        width = total // E
    else:
        flat = {int(s) for layer in sizes for s in layer} if isinstance(sizes, list) else set()
        if len(flat) != 1 or len(sizes) != L or any(len(layer) != E for layer in sizes):
            raise CheckpointError(f"{where}: size_experts must list {L} layers of {E} equal expert widths; experts "
                                  f"of different widths are not supported (got widths {sorted(flat)[:6]})")
        width = flat.pop()
    checks = [("gate_type", "TopKBalancedNoisyGate"), ("calculator_type", "UniversalCalculator"),
              ("gate_use_softmax", True), ("multiply_gate_scores", True), ("add_weight_norm", False)]
    for key, want in checks:
        if key in hf and hf[key] != want:
            raise CheckpointError(f"{where}: {key}={hf[key]!r} is not supported (LLaMA-MoE v1 uses {want!r}): "
                                  f"see docs/hf-interop.md for the variants moebal maps")
    network = hf.get("gate_network", "mlp")
    if network not in ("mlp", "linear"):
        raise CheckpointError(f"{where}: gate_network '{network}' is not supported; expected 'mlp' or 'linear'")
    scale = hf.get("score_scale_factor", 1.0)
    if isinstance(scale, list):
        if len(set(scale)) != 1:
            raise CheckpointError(f"{where}: a per-layer score_scale_factor with different values {scale[:4]}... is "
                                  f"not supported (moe.score_scale is one number)")
        scale = scale[0]
    model["ffn_dim"] = total
    moe = {"num_experts": E, "top_k": k, "expert_ffn_dim": width, "every": 1, "dense_layers": (), "shared_experts": 0,
           "shared_ffn_dim": None, "shared_gate": False, "router": "mlp_tanh" if network == "mlp" else "linear",
           "gate": "topk_softmax", "norm_topk": True, "score_scale": float(scale), **_NO_GROUPS}
    noise = float(hf.get("gate_noise_epsilon", 0.01)) if hf.get("gate_add_noise", True) else None
    return HFFields("llama_moe", {"model": model, "moe": moe}, {"moe": {"router_noise": noise}})


def _dense_layers(hf: dict[str, Any], where: str, n_layers: int) -> tuple[int, ...]:
    layers = hf.get("mlp_only_layers") or []
    if not isinstance(layers, list) or not all(isinstance(i, int) and 0 <= i < n_layers for i in layers):
        raise CheckpointError(f"{where}: 'mlp_only_layers' must list layer indices in 0..{n_layers - 1}; "
                              f"got {layers!r}")
    return tuple(sorted(set(layers)))


def _no_sliding_window(hf: dict[str, Any], where: str) -> None:
    if hf.get("use_sliding_window"):
        raise CheckpointError(f"{where}: use_sliding_window is true; moebal implements one window for every layer "
                              f"(Mixtral's and Qwen3-MoE's sliding_window), not Qwen2-MoE's per-layer windows "
                              f"(max_window_layers, layer_types)")


def _window(hf: dict[str, Any], where: str) -> int | None:
    """The config's `sliding_window`: token t attends to t-W+1..t on every layer (None: full attention)."""
    window = hf.get("sliding_window")
    if window is not None and (not isinstance(window, int) or isinstance(window, bool) or window < 1):
        raise CheckpointError(f"{where}: 'sliding_window' must be a positive integer or null; got {window!r}")
    return window


def _num_experts(hf: dict[str, Any], where: str, default: int) -> int:
    # transformers 5 saves Qwen3-MoE's num_experts under its attribute-map name num_local_experts
    key = "num_experts" if "num_experts" in hf else "num_local_experts"
    E: int = _get(hf, key, default, where)
    if E < 1:
        raise CheckpointError(f"{where}: {key} is {E}: a dense model is not an MoE checkpoint")
    return E


def _routed_moe(hf: dict[str, Any], where: str, n_layers: int, E: int, ffn: int, top_k: int = 8) -> dict[str, Any]:
    """The MoE fields Qwen2-MoE, Qwen3-MoE and OLMoE share: softmax, top-k, optionally renormalised (`top_k`: the
    architecture's default num_experts_per_tok)."""
    return {"num_experts": E, "top_k": _get(hf, "num_experts_per_tok", top_k, where), "expert_ffn_dim": ffn,
            "every": _get(hf, "decoder_sparse_step", 1, where), "dense_layers": _dense_layers(hf, where, n_layers),
            "shared_experts": 0, "shared_ffn_dim": None, "shared_gate": False, "router": "linear",
            "gate": "softmax_topk", "norm_topk": bool(hf.get("norm_topk_prob", False)), "score_scale": 1.0,
            **_NO_GROUPS}


def _qwen2_moe(hf: dict[str, Any], where: str) -> HFFields:
    model = _common(hf, where, rope=10000.0, eps=1e-6, kv_default=16, max_pos=32768, vocab=151936,
                    shape=(2048, 24, 16))
    _no_sliding_window(hf, where)
    shared = _get(hf, "shared_expert_intermediate_size", 5632, where)
    if shared < 0:
        raise CheckpointError(f"{where}: shared_expert_intermediate_size must be >= 0; got {shared}")
    model["ffn_dim"] = _get(hf, "intermediate_size", 5632, where)
    model["attention_bias"] = bool(hf.get("qkv_bias", True))
    moe = _routed_moe(hf, where, model["n_layers"], _num_experts(hf, where, 60),
                      _get(hf, "moe_intermediate_size", 1408, where), top_k=4)
    if shared:  # size 0: the checkpoint's shared expert has empty weights (no shared expert)
        moe.update(shared_experts=1, shared_ffn_dim=shared, shared_gate=True)
    defaults = {"moe": {"aux_loss_coef": _get(hf, "router_aux_loss_coef", 0.001, where, float)}}
    return HFFields("qwen2_moe", {"model": model, "moe": moe}, defaults)


def _qwen3_moe(hf: dict[str, Any], where: str) -> HFFields:
    # Qwen3MoeConfig's defaults; the architecture is Qwen2-MoE's without shared expert and biases, plus an
    # RMSNorm over each query and key head before rotary.
    model = _common(hf, where, rope=10000.0, eps=1e-6, kv_default=4, max_pos=32768, vocab=151936,
                    shape=(2048, 24, 32))
    if hf.get("use_sliding_window"):  # transformers 5 windows every layer alike (max_window_layers is not read)
        model["sliding_window"] = _window(hf, where)
    if hf.get("attention_bias"):
        raise CheckpointError(f"{where}: attention_bias is true; biases on q, k, v and o are not supported "
                              f"(moebal has q/k/v biases only)")
    model.update(ffn_dim=_get(hf, "intermediate_size", 6144, where), qk_norm="head")
    moe = _routed_moe(hf, where, model["n_layers"], _num_experts(hf, where, 128),
                      _get(hf, "moe_intermediate_size", 768, where))
    defaults = {"moe": {"aux_loss_coef": _get(hf, "router_aux_loss_coef", 0.001, where, float)}}
    return HFFields("qwen3_moe", {"model": model, "moe": moe}, defaults)


def _olmoe(hf: dict[str, Any], where: str) -> HFFields:
    # OlmoeConfig's defaults; every layer is MoE, q and k are normalised over the whole projection.
    model = _common(hf, where, rope=10000.0, eps=1e-5, kv_default=None, max_pos=4096, vocab=50304,
                    shape=(2048, 16, 16))
    for key in ("attention_bias", "clip_qkv"):
        if hf.get(key):
            raise CheckpointError(f"{where}: {key} is {hf[key]!r}; moebal maps OLMoE without it (the released "
                                  f"OLMoE-1B-7B sets it to false/null)")
    if "head_dim" in hf and model["head_dim"] is not None:
        raise CheckpointError(f"{where}: OLMoE's head width is hidden_size / num_attention_heads; got head_dim "
                              f"{hf['head_dim']}")
    ffn = _get(hf, "intermediate_size", 1024, where)
    model.update(ffn_dim=ffn, qk_norm="full")
    moe = _routed_moe({**hf, "decoder_sparse_step": 1, "mlp_only_layers": []}, where, model["n_layers"],
                      _num_experts(hf, where, 64), ffn)
    defaults = {"moe": {"aux_loss_coef": _get(hf, "router_aux_loss_coef", 0.01, where, float)}}
    return HFFields("olmoe", {"model": model, "moe": moe}, defaults)


_FIELDS = {"mixtral": _mixtral, "llama_moe": _llama_moe, "qwen2_moe": _qwen2_moe, "qwen3_moe": _qwen3_moe,
           "olmoe": _olmoe}


def fields_of(hf: dict[str, Any], where: str) -> HFFields:
    """moebal fields of a parsed config.json (`where` names it in errors)."""
    return _FIELDS[architecture(hf, where)](hf, where)


_MOE_SHAPE: tuple[str, ...] = (
    "num_experts", "top_k", "expert_ffn_dim", "every", "dense_layers", "shared_experts", "shared_ffn_dim",
    "shared_gate", "router", "gate", "norm_topk", "score_scale")
_MOE_SHAPE += ("first_dense", "n_group", "topk_group", "group_score", "selection_bias")


def is_moebal_dir(path: str | Path) -> bool:
    """A directory written by `hf_to_moebal` (moebal names, stacked experts) rather than a HF one."""
    p = Path(path)
    return (p / MOEBAL_CONFIG).is_file() and (p / SINGLE_NAME).is_file() and not (p / "config.json").is_file()


def _moebal_dir_fields(path: Path) -> HFFields:
    from moebal.config import load

    c = load(path / MOEBAL_CONFIG)
    base = path / BASE_CONFIG
    arch = fields_of(json.loads(base.read_text(encoding="utf-8")), str(base)).arch if base.is_file() else "moebal"
    model = {k: _plain(v) for k, v in vars(c.model).items() if k != "init_std"}
    moe = {k: getattr(c.moe, k) for k in _MOE_SHAPE}
    defaults = {"moe": {k: getattr(c.moe, k) for k in ("aux_loss_coef", "jitter", "router_noise", "router_fp32")}}
    return HFFields(arch, {"model": model, "moe": moe}, defaults)


def _plain(v: Any) -> Any:
    """A config section (model.mla, model.rope_scaling) as the plain dict config.json fields hold."""
    import dataclasses

    return dataclasses.asdict(v) if dataclasses.is_dataclass(v) and not isinstance(v, type) else v


def config_fields(path: str | Path) -> HFFields:
    """moebal fields of the HF model directory `path` (or of a moebal weights directory)."""
    if is_moebal_dir(path):
        return _moebal_dir_fields(Path(path))
    return fields_of(read_hf_config(path), str(Path(path) / "config.json"))


def config_from_hf(path: str | Path, overrides: dict[str, Any] | None = None) -> Config:
    """A whole moebal Config for the checkpoint in `path`: its shape and training defaults, its tokenizer.json,
    moebal's defaults elsewhere (the sequence length capped by the model's), plus `overrides`
    ({'train': {'lr': 1e-5}, ...})."""
    f = config_fields(path)
    data: dict[str, Any] = {"hf": {"init_from": str(path)}}
    for src in (f.defaults, f.shape):
        for section, values in src.items():
            data.setdefault(section, {}).update(values)
    # The model's own tokenizer (validated only when data is loaded) and a sequence the model can take.
    data["data"] = {"seq_len": min(128, f.shape["model"]["max_seq_len"]),
                    "tokenizer": str(Path(path) / "tokenizer.json")}
    data["parallel"] = {"ep": None}
    for section, values in (overrides or {}).items():
        data.setdefault(section, {}).update(values)
    return from_dict(data, source=f"{path}/config.json")


# ---------------------------------------------------------------------------------------------
# the name mapping


@dataclass(frozen=True)
class Link:
    """HF tensor `hf` is moebal tensor `ours` (row `index` of it when moebal stacks experts)."""

    hf: str
    ours: str
    index: int | None = None
    zeros: tuple[int, ...] | None = None
    """Set (with `ours` empty) for a HF tensor moebal has no parameter for because it does nothing: read past
    when loading, written as zeros of this shape (Qwen2-MoE's empty shared expert and its gate)."""
    hf_row: int | None = None
    """transformers 5's fused layout (read only): `ours` row `index` is row `hf_row` of the stacked HF tensor..."""
    half: int | None = None
    """... or its first (0, gate) or second (1, up) half along the row's first dim (`gate_up_proj`)."""


_EXPERT_NAMES = {  # HF per-expert names of moebal's w1 (gate), w3 (up), w2 (down)
    "mixtral": ("block_sparse_moe.", "experts.{e}.w1.weight", "experts.{e}.w3.weight", "experts.{e}.w2.weight"),
    "qwen2_moe": ("mlp.", "experts.{e}.gate_proj.weight", "experts.{e}.up_proj.weight",
                  "experts.{e}.down_proj.weight"),
    "llama_moe": ("mlp.", "calculator.experts.weight_gate.{e}", "calculator.experts.weight_up.{e}",
                  "calculator.experts.weight_down.{e}"),
}
_EXPERT_NAMES["qwen3_moe"] = _EXPERT_NAMES["olmoe"] = _EXPERT_NAMES["qwen2_moe"]


def _router_links(cfg: Config, arch: str, hp: str, op: str) -> list[Link]:
    moe = cfg.moe
    if arch == "llama_moe":
        if moe.router == "mlp_tanh":
            links = [Link(hp + "gate.gate_network.0.weight", op + "gate.weight"),
                     Link(hp + "gate.gate_network.2.weight", op + "gate_out.weight")]
        else:
            links = [Link(hp + "gate.gate_network.weight", op + "gate.weight")]
        if moe.router_noise is not None:
            links.append(Link(hp + "gate.weight_noise.weight", op + "gate_noise.weight"))
        return links
    return [Link(hp + "gate.weight", op + "gate.weight")]


def moebal_links(cfg: Config) -> list[Link]:
    """moebal's own names, one tensor each (a moebal weights directory)."""
    from moebal.models.transformer import MoebalForCausalLM

    with torch.device("meta"):
        names = list(MoebalForCausalLM(cfg).state_dict())
    skip = {"lm_head.weight"} if cfg.model.tie_embeddings else set()
    keep_bias = cfg.moe.selection_bias  # a loaded DeepSeek-V3 bias is part of the model
    return [Link(n, n) for n in names if n not in skip and (keep_bias or not n.endswith("expert_bias"))]


def _fused_expert_links(hp: str, op: str, num_experts: int) -> list[Link]:
    """transformers 5's own layout (`save_original_format=False`): per layer one gate_up_proj [E, 2F, D] (gate
    rows first) and one down_proj [E, D, F]."""
    links = []
    for e in range(num_experts):
        links += [Link(hp + "experts.gate_up_proj", op + "experts.w1", e, hf_row=e, half=0),
                  Link(hp + "experts.gate_up_proj", op + "experts.w3", e, hf_row=e, half=1),
                  Link(hp + "experts.down_proj", op + "experts.w2", e, hf_row=e)]
    return links


# the fused layouts moebal reads (transformers 5 writes DeepSeek-V2/V3 fused too; those are refused: re-save)
_FUSED_ARCHS = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe")


def is_fused(names: Iterable[str]) -> bool:
    """Whether checkpoint tensor names are in transformers 5's fused expert layout."""
    return any(n.endswith(".experts.gate_up_proj") for n in names)


def hf_links(cfg: Config, arch: str, fused: bool = False) -> list[Link]:
    """Every HF tensor of `arch` for the model `cfg` describes, in checkpoint order (layer by layer); `fused`:
    the experts in transformers 5's fused layout (read only: exports use the per-expert layout)."""
    if arch == "moebal":
        return moebal_links(cfg)
    if arch in _DEEPSEEK:
        return _deepseek_links(cfg, arch)
    m, moe = cfg.model, cfg.moe
    links = [Link("model.embed_tokens.weight", "model.embed_tokens.weight")]
    for i in range(m.n_layers):
        p = f"model.layers.{i}."
        links += [Link(p + n, p + n) for n in ("input_layernorm.weight", "post_attention_layernorm.weight")]
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            links.append(Link(f"{p}self_attn.{proj}.weight", f"{p}self_attn.{proj}.weight"))
            if m.attention_bias and proj != "o_proj":
                links.append(Link(f"{p}self_attn.{proj}.bias", f"{p}self_attn.{proj}.bias"))
        if m.qk_norm != "none":
            links += [Link(f"{p}self_attn.{n}.weight", f"{p}self_attn.{n}.weight") for n in ("q_norm", "k_norm")]
        if not cfg.is_moe_layer(i):
            links += [Link(f"{p}mlp.{n}.weight", f"{p}mlp.{n}.weight") for n in ("gate_proj", "up_proj", "down_proj")]
            continue
        sub, w1, w3, w2 = _EXPERT_NAMES[arch]
        hp, op = p + ("mlp." if fused else sub), p + "block_sparse_moe."
        links += _router_links(cfg, arch, hp, op)
        if fused:
            links += _fused_expert_links(hp, op, moe.num_experts)
        for e in range(0 if fused else moe.num_experts):
            links += [Link(hp + w1.format(e=e), op + "experts.w1", e), Link(hp + w3.format(e=e), op + "experts.w3", e),
                      Link(hp + w2.format(e=e), op + "experts.w2", e)]
        if moe.shared_experts:
            links += [Link(f"{hp}shared_expert.{n}.weight", f"{op}shared_expert.{n}.weight")
                      for n in ("gate_proj", "up_proj", "down_proj")]
            if moe.shared_gate:
                links.append(Link(hp + "shared_expert_gate.weight", op + "shared_expert_gate.weight"))
        elif arch == "qwen2_moe":  # transformers keeps an empty shared expert whose gate multiplies nothing
            D = m.dim
            links += [Link(f"{hp}shared_expert.{n}.weight", "", zeros=shape)
                      for n, shape in (("gate_proj", (0, D)), ("up_proj", (0, D)), ("down_proj", (D, 0)))]
            links.append(Link(hp + "shared_expert_gate.weight", "", zeros=(1, D)))
    links.append(Link("model.norm.weight", "model.norm.weight"))
    if not m.tie_embeddings:
        links.append(Link("lm_head.weight", "lm_head.weight"))
    return links


def _ignorable(arch: str, tied: bool) -> re.Pattern[str]:
    """HF tensors a load may skip: rotary tables (recomputed in fp32), LLaMA-MoE's noise projection when noisy
    gating is off, and a tied model's stored copy of the LM head."""
    parts = [r"\.rotary_emb\.inv_freq$"]
    if arch == "llama_moe":
        parts.append(r"\.mlp\.gate\.weight_noise\.weight$")
    if arch == "deepseek_v3":  # its multi-token-prediction layer, as transformers' _keys_to_ignore_on_load_unexpected
        parts.append(r"^model\.layers\.61\.")
    if tied:
        parts.append(r"^lm_head\.weight$")
    return re.compile("|".join(parts))


# ---------------------------------------------------------------------------------------------
# DeepSeek-V2 / V3: multi-head latent attention, shared experts, first-k dense layers, their routing


_DEEPSEEK = ("deepseek_v2", "deepseek_v3")


def _deepseek_rope(hf: dict[str, Any], where: str) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, model.rope_scaling fields or None) from transformers 5's `rope_parameters` or the original
    configs' `rope_scaling` (DeepSeek-V2 and V3 ship yarn)."""
    params, scaling = _dict_field(hf, "rope_parameters"), _dict_field(hf, "rope_scaling")
    src = {**scaling, **params}
    kind = src.get("rope_type") or src.get("type") or "default"
    theta = float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))
    if kind == "default":
        return theta, None
    if kind != "yarn":
        raise CheckpointError(f"{where}: rotary scaling '{kind}' is not supported for DeepSeek (moebal implements "
                              f"plain RoPE and yarn): use a checkpoint whose rope_scaling is yarn or absent")
    if src.get("factor") is None or src.get("original_max_position_embeddings") is None:
        raise CheckpointError(f"{where}: yarn rope_scaling needs 'factor' and 'original_max_position_embeddings'")
    return theta, {"type": "yarn", "factor": float(src["factor"]),
                   "original_max_seq_len": int(src["original_max_position_embeddings"]),
                   "beta_fast": float(src.get("beta_fast") or 32.0), "beta_slow": float(src.get("beta_slow") or 1.0),
                   "mscale": src.get("mscale"), "mscale_all_dim": src.get("mscale_all_dim"),
                   "attention_factor": src.get("attention_factor"), "truncate": bool(src.get("truncate", True))}


def _deepseek_model(hf: dict[str, Any], where: str, v3: bool) -> dict[str, Any]:
    theta, yarn = _deepseek_rope(hf, where)
    plain = {k: v for k, v in hf.items() if k not in ("rope_scaling", "rope_parameters", "head_dim")}
    plain["rope_theta"] = theta
    model = _common(plain, where, rope=10000.0, eps=1e-6, kv_default=None, max_pos=4096 if v3 else 2048,
                    vocab=129280 if v3 else 102400, shape=(7168, 61, 128) if v3 else (4096, 32, 32))
    q_rank = hf.get("q_lora_rank", 1536)
    if q_rank is not None and (not isinstance(q_rank, int) or isinstance(q_rank, bool)):
        raise CheckpointError(f"{where}: 'q_lora_rank' must be an integer or null; got {q_rank!r}")
    mla = {"q_lora_rank": q_rank, "kv_lora_rank": _get(hf, "kv_lora_rank", 512, where),
           "qk_nope_head_dim": _get(hf, "qk_nope_head_dim", 128, where),
           "qk_rope_head_dim": _get(hf, "qk_rope_head_dim", 64, where),
           "v_head_dim": _get(hf, "v_head_dim", 128, where),
           # transformers' DeepseekV2 always rotates interleaved pairs; V3 lets config.json choose
           "rope_interleave": bool(hf.get("rope_interleave", True)) if v3 else True}
    model.update(ffn_dim=_get(hf, "intermediate_size", 18432 if v3 else 11008, where),
                 attention_bias=bool(hf.get("attention_bias", False)), rope_scaling=yarn, mla=mla)
    return model


def _deepseek_routing(hf: dict[str, Any], where: str, v3: bool) -> dict[str, Any]:
    """The moe.* routing fields: V2 softmax with greedy or group-limited greedy top-k, weights not renormalised;
    V3 sigmoid, e_score_correction_bias, group-limited top-k on the sum of each group's two best, normalised."""
    if not v3:
        method = hf.get("topk_method") or "greedy"
        if method not in ("greedy", "group_limited_greedy"):
            raise CheckpointError(f"{where}: DeepSeek-V2 topk_method '{method}' is not supported; expected greedy or "
                                  f"group_limited_greedy")
        if hf.get("norm_topk_prob"):
            raise CheckpointError(f"{where}: norm_topk_prob is true, which transformers' DeepseekV2 ignores (it never "
                                  f"renormalises) while DeepSeek's own code renormalises: set it to false to get "
                                  f"transformers' maths")
        limited = method == "group_limited_greedy"
        return {"gate": "softmax_topk", "norm_topk": False, "n_group": _get(hf, "n_group", 1, where) if limited else 1,
                "topk_group": _get(hf, "topk_group", 1, where) if limited else None, "group_score": "max",
                "selection_bias": False}
    if (hf.get("scoring_func") or "sigmoid") != "sigmoid":
        raise CheckpointError(f"{where}: DeepSeek-V3 scoring_func '{hf['scoring_func']}' is not supported; expected "
                              f"sigmoid (transformers' DeepseekV3 always uses it)")
    n_group = _get(hf, "n_group", 8, where)
    return {"gate": "sigmoid_topk", "norm_topk": bool(hf.get("norm_topk_prob", True)), "n_group": n_group,
            "topk_group": _get(hf, "topk_group", 4, where), "group_score": "top2_sum" if n_group > 1 else "max",
            "selection_bias": True}


def _deepseek(hf: dict[str, Any], where: str, v3: bool) -> HFFields:
    quant = hf.get("quantization_config")
    if quant:
        method = quant.get("quant_method") if isinstance(quant, dict) else quant
        raise CheckpointError(f"{where}: quantised weights (quantization_config {method!r}, e.g. DeepSeek-V3's FP8 "
                              f"blocks with weight_scale_inv) are not supported: dequantise to bf16 first and drop "
                              f"quantization_config from config.json")
    model = _deepseek_model(hf, where, v3)
    if hf.get("moe_layer_freq", 1) != 1:
        raise CheckpointError(f"{where}: moe_layer_freq {hf['moe_layer_freq']} is not supported (transformers' "
                              f"DeepSeek makes every layer after first_k_dense_replace an MoE layer)")
    L, first = model["n_layers"], _get(hf, "first_k_dense_replace", 3 if v3 else 0, where)
    if first >= L:
        raise CheckpointError(f"{where}: first_k_dense_replace ({first}) leaves no MoE layer among {L}: a dense "
                              f"model is not an MoE checkpoint")
    E = _get(hf, "n_routed_experts", 256 if v3 else 64, where)
    moe = {"num_experts": E, "top_k": _get(hf, "num_experts_per_tok", 8 if v3 else 6, where),
           "expert_ffn_dim": _get(hf, "moe_intermediate_size", 2048 if v3 else 1407, where), "every": 1,
           "first_dense": first, "shared_experts": _get(hf, "n_shared_experts", 1 if v3 else 2, where),
           "shared_ffn_dim": None, "shared_gate": False, "router": "linear",
           "score_scale": _get(hf, "routed_scaling_factor", 2.5 if v3 else 1.0, where, float),
           **_deepseek_routing(hf, where, v3)}
    # DeepSeek's balance loss is per sequence (`seq_aux`, true in the released configs and DeepSeek's default)
    scope = "sequence" if _get(hf, "seq_aux", True, where, bool) else "layer"
    defaults = {"moe": {"aux_loss_coef": _get(hf, "aux_loss_alpha", 0.001, where, float), "router_fp32": True,
                        "aux_loss_scope": scope}}
    return HFFields("deepseek_v3" if v3 else "deepseek_v2", {"model": model, "moe": moe}, defaults)


# HF tensors a layout keeps in fp32 in a bf16 checkpoint (transformers' `_keep_in_fp32_modules_strict`)
_KEEP_FP32 = {"deepseek_v2": re.compile(r"\.mlp\.gate\.weight$"),
              "deepseek_v3": re.compile(r"\.mlp\.gate\.(weight|e_score_correction_bias)$")}


def _deepseek_v2(hf: dict[str, Any], where: str) -> HFFields:
    return _deepseek(hf, where, v3=False)


def _deepseek_v3(hf: dict[str, Any], where: str) -> HFFields:
    return _deepseek(hf, where, v3=True)


_FIELDS.update({"deepseek_v2": _deepseek_v2, "deepseek_v3": _deepseek_v3})


def _deepseek_links(cfg: Config, arch: str) -> list[Link]:
    """Every HF tensor of a DeepSeek-V2/V3 checkpoint (transformers' per-expert names) for the model `cfg`."""
    m, moe, mla = cfg.model, cfg.moe, cfg.model.mla
    assert mla is not None  # check_exportable / config_fields guarantee it
    links = [Link("model.embed_tokens.weight", "model.embed_tokens.weight")]
    for i in range(m.n_layers):
        p = f"model.layers.{i}."
        names = ["input_layernorm.weight", "post_attention_layernorm.weight"]
        biased = ["kv_a_proj_with_mqa", "o_proj"] + (["q_a_proj"] if mla.q_lora_rank is not None else [])
        names += [f"self_attn.{n}.weight" for n in
                  (["q_proj"] if mla.q_lora_rank is None else ["q_a_proj", "q_a_layernorm", "q_b_proj"])
                  + ["kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj", "o_proj"]]
        names += [f"self_attn.{n}.bias" for n in biased] if m.attention_bias else []
        if not cfg.is_moe_layer(i):
            names += [f"mlp.{n}.weight" for n in ("gate_proj", "up_proj", "down_proj")]
        links += [Link(p + n, p + n) for n in names]
        if not cfg.is_moe_layer(i):
            continue
        hp, op = p + "mlp.", p + "block_sparse_moe."
        links.append(Link(hp + "gate.weight", op + "gate.weight"))
        if arch == "deepseek_v3":
            links.append(Link(hp + "gate.e_score_correction_bias", op + "expert_bias"))
        for e in range(moe.num_experts):
            links += [Link(f"{hp}experts.{e}.gate_proj.weight", op + "experts.w1", e),
                      Link(f"{hp}experts.{e}.up_proj.weight", op + "experts.w3", e),
                      Link(f"{hp}experts.{e}.down_proj.weight", op + "experts.w2", e)]
        if moe.shared_experts:
            links += [Link(f"{hp}shared_experts.{n}.weight", f"{op}shared_expert.{n}.weight")
                      for n in ("gate_proj", "up_proj", "down_proj")]
    links.append(Link("model.norm.weight", "model.norm.weight"))
    if not m.tie_embeddings:
        links.append(Link("lm_head.weight", "lm_head.weight"))
    return links


def _deepseek_only(cfg: Config) -> list[str]:
    """What only the DeepSeek layouts express (problems when exporting to another one)."""
    m, moe, out = cfg.model, cfg.moe, []
    if m.mla is not None or m.rope_scaling is not None:
        out.append("multi-head latent attention and yarn rotary scaling need a deepseek layout")
    if moe.gate == "sigmoid_topk" or moe.selection_bias:
        out.append("sigmoid gates and a loaded selection bias need the deepseek_v3 layout")
    if moe.n_group > 1 and moe.topk_group is not None and moe.topk_group < moe.n_group:
        out.append("group-limited routing (moe.n_group, moe.topk_group) needs a deepseek layout")
    if moe.first_dense:
        out.append("dense first layers (moe.first_dense) need a deepseek layout")
    return out


def _check_deepseek_exportable(cfg: Config, arch: str) -> list[str]:
    m, moe, v3 = cfg.model, cfg.moe, arch == "deepseek_v3"
    problems = []
    if m.mla is None:
        problems.append("the deepseek layouts use multi-head latent attention: set model.mla")
    if moe.router != "linear" or moe.router_noise is not None or moe.shared_gate or moe.every != 1:
        problems.append("a tanh-MLP or noisy router, a gated shared expert and moe.every > 1 have no place in them")
    if moe.shared_experts and moe.shared_ffn_dim not in (None, moe.shared_experts * cfg.expert_ffn_dim):
        problems.append("DeepSeek's shared experts are n_shared_experts * moe_intermediate_size wide: set "
                        "moe.shared_ffn_dim to null")
    limited = moe.n_group > 1 and moe.topk_group is not None and moe.topk_group < moe.n_group
    if v3:
        if moe.gate != "sigmoid_topk" or (limited and moe.group_score != "top2_sum"):
            problems.append("deepseek_v3 routes with moe.gate sigmoid_topk and, with groups, group_score top2_sum")
    else:
        if moe.gate != "softmax_topk" or moe.norm_topk or (limited and moe.group_score != "max"):
            problems.append("deepseek_v2 routes with moe.gate softmax_topk, moe.norm_topk false and group_score max")
        if moe.selection_bias or moe.bias_update_rate > 0:
            problems.append("deepseek_v2 has no selection bias (moe.selection_bias, moe.bias_update_rate)")
    return problems


def _deepseek_hf_fields(cfg: Config, arch: str) -> dict[str, Any]:
    """config.json keys for a DeepSeek layout (the inverse of `_deepseek`); rotary as transformers 5 writes it."""
    m, moe, mla, v3 = cfg.model, cfg.moe, cfg.model.mla, arch == "deepseek_v3"
    assert mla is not None
    limited = moe.n_group > 1 and moe.topk_group is not None and moe.topk_group < moe.n_group
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": m.rope_theta}
    r = m.rope_scaling
    if r is not None:
        rope.update({"rope_type": "yarn", "factor": r.factor,
                     "original_max_position_embeddings": r.original_max_seq_len, "beta_fast": r.beta_fast,
                     "beta_slow": r.beta_slow, "truncate": r.truncate})
        rope.update({k: v for k, v in (("mscale", r.mscale), ("mscale_all_dim", r.mscale_all_dim),
                                       ("attention_factor", r.attention_factor)) if v is not None})
    out: dict[str, Any] = {
        "architectures": [_ARCH_CLASS[arch]], "model_type": arch, "vocab_size": m.vocab_size, "hidden_size": m.dim,
        "num_hidden_layers": m.n_layers, "num_attention_heads": m.n_heads, "num_key_value_heads": m.n_kv_heads,
        "max_position_embeddings": m.max_seq_len, "rope_parameters": rope, "rms_norm_eps": m.norm_eps,
        "tie_word_embeddings": m.tie_embeddings, "hidden_act": "silu", "attention_bias": m.attention_bias,
        "intermediate_size": m.ffn_dim, "moe_intermediate_size": cfg.expert_ffn_dim,
        "n_routed_experts": moe.num_experts, "num_experts_per_tok": moe.top_k, "n_shared_experts": moe.shared_experts,
        "first_k_dense_replace": moe.first_dense, "moe_layer_freq": 1, "routed_scaling_factor": moe.score_scale,
        "norm_topk_prob": moe.norm_topk, "q_lora_rank": mla.q_lora_rank, "kv_lora_rank": mla.kv_lora_rank,
        "qk_nope_head_dim": mla.qk_nope_head_dim, "qk_rope_head_dim": mla.qk_rope_head_dim,
        "v_head_dim": mla.v_head_dim, "aux_loss_alpha": moe.aux_loss_coef, "seq_aux": moe.aux_loss_scope == "sequence"}
    if v3:
        out.update(n_group=moe.n_group, topk_group=moe.topk_group or moe.n_group, rope_interleave=mla.rope_interleave,
                   topk_method="noaux_tc", scoring_func="sigmoid")
    else:
        out.update(topk_method="group_limited_greedy" if limited else "greedy",
                   n_group=moe.n_group if limited else None, topk_group=moe.topk_group if limited else None)
    return out


# ---------------------------------------------------------------------------------------------
# loading


def _show(names: Iterable[str], n: int = 4) -> str:
    names = sorted(names)
    return ", ".join(names[:n]) + (f" and {len(names) - n} more" if len(names) > n else "")


def _refuse_fused_experts(info: dict[str, Any], arch: str, where: str) -> None:
    fused = sorted(n for n in info if n.endswith(".experts.gate_up_proj"))
    if fused and arch not in _FUSED_ARCHS:
        raise CheckpointError(
            f"{where}: the experts are in transformers 5's fused layout ('{fused[0]}', one [E, 2F, D] gate_up_proj "
            f"and one [E, D, F] down_proj per layer, written by save_pretrained(..., save_original_format=False)), "
            f"which moebal reads for {', '.join(_FUSED_ARCHS)} but not for {arch}: "
            f"re-save once with "
            f"AutoModelForCausalLM.from_pretrained(DIR).save_pretrained(NEW_DIR) (save_original_format=True, the "
            f"default)")


def _hf_shape(ln: Link, ours: dict[str, tuple[int, ...]]) -> tuple[int, ...]:
    """The shape HF tensor `ln.hf` must have, given moebal's (whole) tensor shapes."""
    if ln.zeros is not None:
        return ln.zeros
    if ln.index is None:
        return ours[ln.ours]
    E, *row = ours[ln.ours]
    if ln.half is not None:
        row[0] *= 2
    return (E, *row) if ln.hf_row is not None else tuple(row)


def read_link(reader: ScratchReader, ln: Link) -> torch.Tensor:
    """The values of moebal tensor `ln.ours` (row `ln.index`) that HF tensor `ln.hf` holds (valid until the
    reader's next read)."""
    t = reader.read(ln.hf, ln.hf_row)
    if ln.half is not None:
        F = t.shape[0] // 2
        t = t[ln.half * F:(ln.half + 1) * F]
    return t


def check_source(source: TensorSource, links: list[Link], ours: dict[str, tuple[int, ...]], arch: str,
                 tied: bool, where: str) -> None:
    """Every linked tensor present with the right shape, nothing unexpected left over; CheckpointError
    naming the tensors, their files and the likely fix otherwise."""
    info = source.info()
    _refuse_fused_experts(info, arch, where)
    want = {ln.hf for ln in links}
    skip = _ignorable(arch, tied)
    missing = sorted(want - set(info))
    # a zero-size tensor holds no weight (transformers' DeepSeek builds a 0-wide shared expert for n_shared_experts 0)
    extra = sorted(n for n in set(info) - want if not skip.search(n) and all(info[n].shape))
    if missing or extra:
        msg = [f"{where}: the weights do not match the model config.json describes"]
        if missing:
            msg.append(f"missing {len(missing)} tensor(s): {_show(missing)}")
        if extra:
            msg.append(f"unexpected {len(extra)} tensor(s): {_show(extra)} (in {info[extra[0]].where})")
        msg.append("check that config.json belongs to these weights (num_local_experts, num_hidden_layers, "
                   "tie_word_embeddings, ...) and that no shard is missing")
        raise CheckpointError("; ".join(msg))
    wrong = []
    for ln in links:
        shape = _hf_shape(ln, ours)
        got = info[ln.hf]
        if got.shape != shape:
            wrong.append(f"'{ln.hf}' in {got.where} is {list(got.shape)}, expected {list(shape)}")
        elif not got.dtype.is_floating_point:
            wrong.append(f"'{ln.hf}' in {got.where} has dtype {got.dtype}, expected a floating-point dtype")
    if wrong:
        raise CheckpointError(f"{where}: {len(wrong)} tensor(s) do not fit the model config.json describes: "
                              f"{'; '.join(wrong[:3])}{' ...' if len(wrong) > 3 else ''}; check that config.json "
                              f"(hidden_size, intermediate_size, num_key_value_heads, head_dim) belongs to these "
                              f"weights")


def _empty_model(cfg: Config, dtype: torch.dtype, device: torch.device | str,
                 experts: Sequence[int] | None = None, holding: Holding | None = None) -> MoebalForCausalLM:
    """The model with uninitialised storage (built on the meta device: no time spent on a random init that
    the checkpoint overwrites, no second copy), non-persistent buffers rebuilt for real. With `experts`, each
    MoE layer's stacked expert tensors hold only those experts' rows (an expert-parallel rank's shard); with
    `holding`, only the tensors it holds get storage (a pipeline stage's), the others stay on the meta device."""
    from moebal.models.transformer import MoebalForCausalLM, rotary_for

    with torch.device("meta"):
        model = MoebalForCausalLM(cfg)
        if experts is not None:
            for layer in model.moe_layers():
                for name in ("w1", "w3", "w2"):
                    full = getattr(layer.experts, name)
                    setattr(layer.experts, name, torch.nn.Parameter(torch.empty(len(experts), *full.shape[1:])))
    if holding is None:
        model = model.to(dtype=dtype).to_empty(device=device)
    else:
        from moebal.models.local_init import allocate_held

        allocate_held(model.to(dtype=dtype), holding, device, slice_rows=False)
    m = cfg.model
    with torch.device(device):
        model.model.rotary = rotary_for(cfg)  # fp32 tables, as built normally
    for layer in model.moe_layers():
        if layer.expert_bias is not None:
            layer.expert_bias = torch.zeros(layer.num_experts, device=device)
        if layer.router_fp32:  # the router weight stays fp32 in a bf16 model, as transformers keeps it
            layer.gate.float()
    if m.tie_embeddings:  # to_empty makes new parameters: tie them again
        model.lm_head.weight = model.model.embed_tokens.weight
    return model


def load_hf_weights(model: MoebalForCausalLM, source: TensorSource, arch: str, where: str,
                    experts: Sequence[int] | None = None, holding: Holding | None = None) -> None:
    """Fill every parameter of `model` from `source` (HF names of `arch`), one tensor at a time; with
    `experts`, the model's stacked expert tensors hold those experts' rows only (the rest are not read); with
    `holding`, only the tensors it holds are read (the others are on the meta device)."""
    cfg = model.config
    links = hf_links(cfg, arch, fused=arch in _FUSED_ARCHS and is_fused(source.info()))
    state = model.state_dict()
    shapes = {k: tuple(v.shape) for k, v in state.items()}
    row = None
    if experts is not None:  # the checkpoint is checked whole, whichever rows this model keeps
        row = {e: i for i, e in enumerate(experts)}
        stacked = {ln.ours for ln in links if ln.index is not None}
        shapes.update({k: (cfg.moe.num_experts, *shapes[k][1:]) for k in stacked})
    check_source(source, links, shapes, arch, cfg.model.tie_embeddings, where)
    covered = {ln.ours for ln in links if ln.zeros is None} | {k for k in state if k.endswith("expert_bias")}
    if cfg.model.tie_embeddings:
        covered.add("lm_head.weight")
    assert covered == set(state), sorted(set(state) - covered)  # the mapping covers the whole model
    info = source.info()
    reader = ScratchReader(source).prime()
    with torch.no_grad():
        for ln in links:
            if ln.zeros is not None:
                continue  # no moebal parameter: it does nothing
            if holding is not None and not holding.holds(ln.ours):
                continue  # another pipeline stage's tensor
            index = ln.index
            if index is not None and row is not None:
                if index not in row:
                    continue  # another rank's expert
                index = row[index]
            target = state[ln.ours] if index is None else state[ln.ours][index]
            direct = info[ln.hf].dtype == target.dtype and target.is_contiguous() and target.device.type == "cpu"
            if direct and ln.half is None:
                source.read(ln.hf, ln.hf_row, out=target)  # straight into the parameter's storage
            else:
                target.copy_(read_link(reader, ln))  # through one reused buffer: dtype change or a fused half


def _resolve_dtype(dtype: torch.dtype | str | None, hf: dict[str, Any]) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype in (None, "auto"):
        name = hf.get("torch_dtype") or hf.get("dtype") or "float32"
        if name not in DTYPE_NAMES:
            raise CheckpointError(f"config.json dtype '{name}' is not one of {', '.join(DTYPE_NAMES)}")
        return DTYPE_NAMES[name]
    if dtype not in DTYPE_NAMES:
        raise ConfigError(f"dtype must be auto or one of {', '.join(DTYPE_NAMES)}; got {dtype!r}")
    return DTYPE_NAMES[dtype]


def from_hf(path: str | Path, *, cfg: Config | None = None, dtype: torch.dtype | str | None = torch.float32,
            device: torch.device | str = "cpu", experts: Sequence[int] | None = None,
            holding: Holding | None = None) -> MoebalForCausalLM:
    """moebal's model with the weights of the HF checkpoint directory `path` (one of `ARCHITECTURES`; one
    safetensors file or a sharded index; per-expert or fused experts), or of a directory `hf_to_moebal` wrote.

    `cfg` defaults to `config_from_hf(path)`; a given one must describe the same shapes. `dtype` is that of
    the parameters: float32 by default (training keeps fp32 master weights), 'auto' for the checkpoint's own.
    `experts` (logical ids, ascending): keep only these experts' rows in every MoE layer, so an
    expert-parallel rank reads and holds its own shard and never the whole model. `holding`
    (moebal/models/local_init.py): read and hold only its tensors (a pipeline stage's layers, and its `experts`
    when set there); the others stay on the meta device.
    """
    if holding is not None and experts is None:
        experts = holding.experts
    where = str(Path(path))
    if is_moebal_dir(path):
        verify_manifest(Path(path))
        hf, arch = {}, "moebal"
    else:
        hf = read_hf_config(path)
        arch = architecture(hf, f"{where}/config.json")
    cfg = cfg or config_from_hf(path)
    source = DirectorySource(path)
    try:
        if arch == "moebal" and dtype in (None, "auto"):
            dtype = source.info()["model.embed_tokens.weight"].dtype
        model = _empty_model(cfg, _resolve_dtype(dtype, hf), device, experts, holding)
        load_hf_weights(model, source, arch, where, experts, holding)
    finally:
        source.close()
    # to_hf keeps this config.json's keys and copies the directory's tokenizer files, even if it is gone by then
    # a plain attribute (nn.Module's __setattr__ is typed for tensors and modules), read back by to_hf
    setattr(model, "hf_origin", hf_origin(path))  # noqa: B010
    return model


@dataclass(frozen=True)
class HFOrigin:
    """Where a model came from: the original config.json (None for a moebal directory without one) and the
    directory holding its tokenizer and generation files."""

    base: dict[str, Any] | None
    path: Path


def hf_origin(path: str | Path | None) -> HFOrigin | None:
    """The origin of a model loaded from `path` (a HF or moebal weights directory), None when it is not one."""
    if not path or not Path(path).is_dir():
        return None
    p = Path(path)
    if is_moebal_dir(p):
        base = p / BASE_CONFIG
        return HFOrigin(json.loads(base.read_text(encoding="utf-8")) if base.is_file() else None, p)
    return HFOrigin(read_hf_config(p), p)


# ---------------------------------------------------------------------------------------------
# exporting


def choose_arch(cfg: Config) -> str:
    """The HF layout that expresses a moebal model: Qwen3-MoE for per-head q/k norms, OLMoE for whole-projection
    q/k norms, LLaMA-MoE for the tanh-MLP router, Qwen2-MoE for shared experts, dense layers or attention
    biases, Mixtral otherwise."""
    moe = cfg.moe
    if cfg.model.mla is not None:
        return "deepseek_v3" if moe.gate == "sigmoid_topk" else "deepseek_v2"
    if cfg.model.qk_norm != "none":
        return "qwen3_moe" if cfg.model.qk_norm == "head" else "olmoe"
    if moe.router == "mlp_tanh" or moe.score_scale != 1.0 or moe.router_noise is not None:
        return "llama_moe"
    if (moe.shared_experts or moe.every != 1 or moe.dense_layers or cfg.model.attention_bias
            or not moe.norm_topk):
        return "qwen2_moe"
    return "mixtral"


# What each layout can express beyond the Mixtral core (a plain linear router, softmax, renormalised top-k).
_CAN = {
    "mixtral": {"sliding_window"},
    "llama_moe": {"llama_router"},
    "qwen2_moe": {"shared", "dense", "bias", "unnormalised"},
    "qwen3_moe": {"dense", "unnormalised", "qk_head", "sliding_window"},
    "olmoe": {"unnormalised", "qk_full"},
}


def _needs(cfg: Config) -> dict[str, str]:
    """The features of the model `cfg` beyond the Mixtral core, each with the setting that asks for it."""
    m, moe = cfg.model, cfg.moe
    needs = {}
    if m.sliding_window is not None:
        needs["sliding_window"] = "a sliding window (model.sliding_window)"
    if moe.router != "linear" or moe.score_scale != 1.0 or moe.router_noise is not None:
        needs["llama_router"] = "moe.router / moe.score_scale / moe.router_noise (LLaMA-MoE's router)"
    if moe.shared_experts:
        needs["shared"] = "shared experts (moe.shared_experts)"
    if moe.every != 1 or moe.dense_layers:
        needs["dense"] = "dense layers between MoE layers (moe.every, moe.dense_layers)"
    if m.attention_bias:
        needs["bias"] = "attention biases (model.attention_bias)"
    if not moe.norm_topk:
        needs["unnormalised"] = "moe.norm_topk: false"
    if m.qk_norm != "none":
        needs["qk_" + m.qk_norm] = f"model.qk_norm: {m.qk_norm}"
    return needs


def check_exportable(cfg: Config, arch: str) -> None:
    """ConfigError naming each part of the model `arch` cannot express (its inference maths would differ)."""
    m, moe = cfg.model, cfg.moe
    if moe.num_experts == 0:
        raise ConfigError("moe.num_experts is 0: a dense model is not exported as an MoE checkpoint")
    problems = _check_deepseek_exportable(cfg, arch) if arch in _DEEPSEEK else _deepseek_only(cfg)
    if cfg.dynamism.scheme == "mod":  # early exit and sparse attention export the weights: see docs/hf-interop.md
        problems.append("Mixture-of-Depths (dynamism.scheme: mod) sends tokens around blocks by trained routers "
                        "that also scale the block outputs, which no HF layout has: the export would drop them")
    if moe.adaptive_threshold is not None:
        problems.append("adaptive top-k gating (moe.adaptive_threshold) routes some tokens to fewer than top_k "
                        "experts, which no HF layout does")
    if arch in _DEEPSEEK:
        if moe.dense_layers:
            problems.append("the deepseek layouts have dense first layers only (moe.first_dense), not "
                            "moe.dense_layers: they need the qwen2_moe or qwen3_moe layout")
        if problems:
            raise ConfigError(f"cannot export to the {arch} layout: " + "; ".join(problems))
        return
    if moe.bias_update_rate > 0:
        problems.append("the auxiliary-loss-free selection bias (moe.bias_update_rate > 0) has no place in these "
                        "layouts")
    for need, what in _needs(cfg).items():
        if need not in _CAN[arch]:
            fits = [a for a, can in _CAN.items() if need in can]
            problems.append(f"{what} needs the {' or '.join(fits)} layout")
    if arch in ("qwen3_moe", "olmoe") and m.qk_norm == "none":
        problems.append(f"the {arch} layout always normalises q and k (model.qk_norm: "
                        f"{'head' if arch == 'qwen3_moe' else 'full'})")
    if arch == "qwen2_moe" and moe.shared_experts and not moe.shared_gate:
        problems.append("the qwen2_moe layout gates its shared expert (moe.shared_gate: true)")
    if arch == "qwen2_moe" and moe.shared_experts > 1 and moe.shared_ffn_dim is None:
        problems.append("several shared experts are exported as one; set moe.shared_ffn_dim")
    if arch == "olmoe" and m.head_dim is not None and m.head_dim * m.n_heads != m.dim:
        problems.append("the olmoe layout has no head_dim: model.head_dim must be model.dim / model.n_heads")
    if problems:
        raise ConfigError(f"cannot export to the {arch} layout: " + "; ".join(problems))


def _hf_shape_fields(cfg: Config, arch: str) -> dict[str, Any]:
    """config.json keys for the shape of `cfg` in layout `arch` (the inverse of `config_fields`)."""
    if arch in _DEEPSEEK:
        return _deepseek_hf_fields(cfg, arch)
    m, moe = cfg.model, cfg.moe
    out: dict[str, Any] = {
        "architectures": [_ARCH_CLASS[arch]], "model_type": arch, "vocab_size": m.vocab_size, "hidden_size": m.dim,
        "num_hidden_layers": m.n_layers, "num_attention_heads": m.n_heads, "num_key_value_heads": m.n_kv_heads,
        "max_position_embeddings": m.max_seq_len, "rope_theta": m.rope_theta, "rms_norm_eps": m.norm_eps,
        "tie_word_embeddings": m.tie_embeddings, "hidden_act": "silu"}
    if m.head_dim is not None:
        out["head_dim"] = m.head_dim
    F = cfg.expert_ffn_dim
    routed = dict(num_experts=moe.num_experts, num_experts_per_tok=moe.top_k, norm_topk_prob=moe.norm_topk,
                  router_aux_loss_coef=moe.aux_loss_coef)
    if arch == "mixtral":
        out.update(intermediate_size=F, num_local_experts=moe.num_experts, num_experts_per_tok=moe.top_k,
                   sliding_window=m.sliding_window, router_aux_loss_coef=moe.aux_loss_coef,
                   router_jitter_noise=moe.jitter)
    elif arch in ("qwen2_moe", "qwen3_moe"):
        out.update(routed, intermediate_size=m.ffn_dim, moe_intermediate_size=F, decoder_sparse_step=moe.every,
                   mlp_only_layers=list(moe.dense_layers), use_sliding_window=m.sliding_window is not None,
                   sliding_window=m.sliding_window)  # a window only in qwen3_moe (`_CAN`)
        if arch == "qwen2_moe":
            out.update(shared_expert_intermediate_size=_shared_width(cfg), qkv_bias=m.attention_bias)
        else:
            out.update(head_dim=cfg.head_dim, attention_bias=False)
    elif arch == "olmoe":
        out.update(routed, intermediate_size=F, attention_bias=False, clip_qkv=None)
    else:
        out.update(intermediate_size=F * moe.num_experts, size_experts=[[F] * moe.num_experts] * m.n_layers,
                   num_experts=moe.num_experts, num_selects=moe.top_k,
                   gate_network="mlp" if moe.router == "mlp_tanh" else "linear", gate_type="TopKBalancedNoisyGate",
                   calculator_type="UniversalCalculator", gate_use_softmax=True, multiply_gate_scores=True,
                   add_weight_norm=False, score_scale_factor=moe.score_scale, attention_bias=False,
                   gate_add_noise=moe.router_noise is not None, gate_noise_epsilon=moe.router_noise or 0.01)
    return out


def _shared_width(cfg: Config) -> int:
    """Width of the (one) HF shared expert: 0 when the model has none."""
    return cfg.shared_expert_ffn_dim


def hf_config_for(cfg: Config, arch: str, dtype: torch.dtype, base: dict[str, Any] | None = None) -> dict[str, Any]:
    """The config.json of an export. With `base` (the config.json the model was loaded from) every key of
    the original is kept (tokenizer ids, auto_map, sliding window, ...) after checking that its shape is
    still `cfg`'s; without one it is written from `cfg` alone."""
    dtype_name = next(k for k, v in DTYPE_NAMES.items() if v == dtype)
    if base is None:
        return {**_hf_shape_fields(cfg, arch), "torch_dtype": dtype_name}
    where = "the base config.json"
    f = fields_of(base, where)
    if f.arch != arch:
        raise ConfigError(f"the model was loaded from a {f.arch} checkpoint but is exported as {arch}: keep "
                          f"{f.arch}, or write a config from the model alone (to_hf(..., keep_origin=False))")
    ours = {"model": {k: _plain(getattr(cfg.model, k)) for k in f.shape["model"]},
            "moe": {k: getattr(cfg.moe, k) for k in f.shape["moe"]}}
    diff = [f"{s}.{k}: {ours[s][k]!r} vs {v!r}" for s in ("model", "moe") for k, v in f.shape[s].items()
            if ours[s][k] != v]
    if diff:
        raise ConfigError(f"the model no longer has the shape of its base config.json ({'; '.join(diff[:4])}): "
                          f"export without the base config (to_hf(..., keep_origin=False))")
    out = dict(base)
    out["torch_dtype" if "torch_dtype" in base or "dtype" not in base else "dtype"] = dtype_name
    if arch == "mixtral":
        out.update(router_aux_loss_coef=cfg.moe.aux_loss_coef, router_jitter_noise=cfg.moe.jitter)
    elif arch in ("qwen2_moe", "qwen3_moe", "olmoe"):
        out.update(router_aux_loss_coef=cfg.moe.aux_loss_coef)
    elif arch in _DEEPSEEK:
        if "aux_loss_alpha" in base:  # DeepSeek's own keys; transformers 5 writes neither
            out.update(aux_loss_alpha=cfg.moe.aux_loss_coef)
        if "seq_aux" in base or cfg.moe.aux_loss_scope != "sequence":  # absent reads as true
            out.update(seq_aux=cfg.moe.aux_loss_scope == "sequence")
    else:
        out.update(gate_add_noise=cfg.moe.router_noise is not None)
        if cfg.moe.router_noise is not None:
            out["gate_noise_epsilon"] = cfg.moe.router_noise
    return out


def _out_tensors(source: TensorSource, links: list[Link], dtype: torch.dtype,
                 keep_fp32: re.Pattern[str] | None = None) -> list[OutTensor]:
    info = source.info()
    reader = ScratchReader(source).prime()
    out = []
    for ln in links:
        if ln.zeros is not None:
            out.append(OutTensor(ln.hf, dtype, ln.zeros, functools.partial(torch.zeros, ln.zeros, dtype=dtype)))
            continue
        if ln.ours not in info:
            raise CheckpointError(f"the moebal weights lack '{ln.ours}' (needed for HF tensor '{ln.hf}')")
        shape = info[ln.ours].shape if ln.index is None else info[ln.ours].shape[1:]

        def produce(name: str = ln.ours, index: int | None = ln.index) -> torch.Tensor:
            return reader.read(name, index)

        fp32 = keep_fp32 is not None and keep_fp32.search(ln.hf) and info[ln.ours].dtype == torch.float32
        out.append(OutTensor(ln.hf, torch.float32 if fp32 else dtype, tuple(shape), produce))
    return out


def write_hf(source: TensorSource, cfg: Config, path: str | Path, *, arch: str | None = None,
             dtype: torch.dtype = torch.float32, shard_bytes: int = 5 * 10**9, base: dict[str, Any] | None = None,
             copy_from: str | Path | None = None, overwrite: bool = False) -> Path:
    """Write the moebal weights in `source` (moebal names, stacked experts; `cfg` their model) as a HF checkpoint
    directory: config.json, safetensors sharded above `shard_bytes` with an index, and the tokenizer and
    remote-code files of `copy_from`. Written into a temporary directory and renamed into place."""
    arch = arch or (fields_of(base, "the base config.json").arch if base else choose_arch(cfg))
    if arch not in _ARCH_CLASS:
        raise ConfigError(f"unknown HF layout '{arch}'; choose one of {', '.join(_ARCH_CLASS)}")
    check_exportable(cfg, arch)
    if arch != "deepseek_v3":  # the one layout that stores the bias (e_score_correction_bias)
        _check_selection_bias(source)
    config_json = hf_config_for(cfg, arch, dtype, base)
    entries = _out_tensors(source, hf_links(cfg, arch), dtype, _KEEP_FP32.get(arch))
    final = Path(path)
    if final.exists() and not overwrite:
        raise CheckpointError(f"{final} already exists: choose a new directory or pass --overwrite")
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.with_name(f".{final.name}.tmp-{os.getpid()}")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    try:
        shards = list(iter_shards(entries, shard_bytes))
        weight_map: dict[str, str] = {}
        for i, shard in enumerate(shards):
            name = SINGLE_NAME if len(shards) == 1 else f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            write_safetensors(tmp / name, shard, metadata={"format": "pt"})
            weight_map.update((t.name, name) for t in shard)
        if len(shards) > 1:
            index = {"metadata": {"total_size": sum(t.nbytes for t in entries)}, "weight_map": weight_map}
            (tmp / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")
        (tmp / "config.json").write_text(json.dumps(config_json, indent=2) + "\n", encoding="utf-8")
        if copy_from is not None:
            _copy_companions(Path(copy_from), tmp)
        _replace_dir(tmp, final)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return final


def _check_selection_bias(source: TensorSource) -> None:
    for name in (n for n in source.info() if n.endswith("expert_bias")):
        if source.read(name).abs().max().item() != 0:
            raise ConfigError(f"'{name}' is non-zero: the auxiliary-loss-free selection bias changes which experts "
                              f"tokens choose and no HF layout stores it")


def _copy_companions(src: Path, dst: Path) -> None:
    for p in sorted(src.iterdir()) if src.is_dir() else []:
        if p.is_file() and (p.name in _COMPANIONS or p.suffix == ".py"):
            shutil.copy2(p, dst / p.name)


def _replace_dir(tmp: Path, final: Path) -> None:
    old = None
    if final.exists():
        old = final.with_name(f".{final.name}.old-{os.getpid()}")
        os.replace(final, old)
    os.replace(tmp, final)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def to_hf(model: MoebalForCausalLM, path: str | Path, *, arch: str | None = None,
          dtype: torch.dtype | str | None = None, shard_bytes: int = 5 * 10**9, base: dict[str, Any] | None = None,
          copy_from: str | Path | None = None, overwrite: bool = False, keep_origin: bool = True) -> Path:
    """Write `model` (a moebal model) as a HF checkpoint directory `transformers` loads.

    `arch`: one of `ARCHITECTURES`' layouts (default: the one the model came from, else the one that expresses
    it, see `choose_arch`). `dtype`: of the written weights (default: the model's). `base`: the config.json
    whose keys are kept; `copy_from`: a directory whose tokenizer, generation and remote-code files are copied
    along. Both default to the model's origin (the directory `from_hf` read, or the config's `hf.init_from`):
    an export then keeps every key of the original config.json (after checking the model still has its shape)
    and its tokenizer. `keep_origin=False` writes config.json from the model's config alone."""
    cfg = model.config
    origin = (getattr(model, "hf_origin", None) or hf_origin(cfg.hf.init_from)) if keep_origin else None
    if origin is not None:  # each that is not given: the origin's
        base = origin.base if base is None else base
        copy_from = origin.path if copy_from is None else copy_from
    params = dict(model.state_dict())
    if isinstance(dtype, str) and dtype != "auto":
        if dtype not in DTYPE_NAMES:
            raise ConfigError(f"dtype must be auto or one of {', '.join(DTYPE_NAMES)}; got {dtype!r}")
        dtype = DTYPE_NAMES[dtype]
    if not isinstance(dtype, torch.dtype):
        dtype = model.lm_head.weight.dtype
    return write_hf(StateDictSource(params), cfg, path, arch=arch, dtype=dtype, shard_bytes=shard_bytes, base=base,
                    copy_from=copy_from, overwrite=overwrite)


# ---------------------------------------------------------------------------------------------
# moebal weights directories


def write_manifest(path: Path) -> None:
    """manifest.json: size and sha256 of every other file in `path`."""
    files = {p.name: {"bytes": p.stat().st_size, "sha256": sha256_of(p)}
             for p in sorted(path.iterdir()) if p.is_file() and p.name != MANIFEST}
    (path / MANIFEST).write_text(json.dumps({"files": files}, indent=1) + "\n", encoding="utf-8")


def verify_manifest(path: Path) -> None:
    """CheckpointError naming the first file of a moebal weights directory that is missing, truncated or
    altered."""
    m = path / MANIFEST
    try:
        files = json.loads(m.read_text(encoding="utf-8"))["files"]
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError):
        raise CheckpointError(f"{m} is missing or corrupt: re-run moebal convert hf-to-moebal") from None
    for name, want in files.items():
        f = path / name
        if not f.is_file():
            raise CheckpointError(f"{f} is missing (listed in {m})")
        if f.stat().st_size != want["bytes"]:
            raise CheckpointError(f"{f} has {f.stat().st_size} bytes, the manifest says {want['bytes']} (truncated?)")
        if sha256_of(f) != want["sha256"]:
            raise CheckpointError(f"{f} is corrupt: its sha256 does not match {m}")


def hf_to_moebal(src: str | Path, dst: str | Path, *, dtype: torch.dtype | str | None = "auto",
                 overwrite: bool = False) -> Path:
    """Convert the HF checkpoint `src` into a moebal weights directory `dst` (config.yaml, model.safetensors
    under moebal's names with stacked experts, the source's config.json as hf_config.json, its tokenizer files,
    manifest.json), streaming: each stacked expert tensor is written expert by expert, so at most one source
    tensor is in memory. `dst` loads with `from_hf(dst)` and as `hf.init_from: dst`."""
    from moebal.config import dump, with_overrides
    from moebal.models.transformer import MoebalForCausalLM

    src, final = Path(src), Path(dst)
    hf = read_hf_config(src)
    arch = architecture(hf, f"{src}/config.json")
    cfg = config_from_hf(src)
    out_dtype = _resolve_dtype(dtype, hf)
    source = DirectorySource(src)
    try:
        with torch.device("meta"):
            shapes = {k: tuple(v.shape) for k, v in MoebalForCausalLM(cfg).state_dict().items()}
        links = hf_links(cfg, arch, fused=arch in _FUSED_ARCHS and is_fused(source.info()))
        check_source(source, links, shapes, arch, cfg.model.tie_embeddings, str(src))
        parts: dict[str, list[Link]] = {}
        for ln in (ln for ln in links if ln.zeros is None):
            parts.setdefault(ln.ours, []).append(ln)
        reader = ScratchReader(source).prime()
        info, keep = source.info(), _KEEP_FP32.get(arch)
        entries = []
        for name, group in parts.items():
            group.sort(key=lambda ln: -1 if ln.index is None else ln.index)

            def produce(group: list[Link] = group) -> Iterable[torch.Tensor]:
                return (read_link(reader, ln) for ln in group)

            # what transformers keeps in fp32 in a bf16 checkpoint (DeepSeek's router) stays fp32, as `to_hf` writes it
            fp32 = keep is not None and all(keep.search(ln.hf) and info[ln.hf].dtype == torch.float32 for ln in group)
            entries.append(OutTensor(name, torch.float32 if fp32 else out_dtype, shapes[name], produce))
        if final.exists() and not overwrite:
            raise CheckpointError(f"{final} already exists: choose a new directory or pass --overwrite")
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = final.with_name(f".{final.name}.tmp-{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        try:
            write_safetensors(tmp / SINGLE_NAME, entries, metadata={"format": "pt", "moebal_source": arch})
            _copy_companions(src, tmp)
            shutil.copy2(src / "config.json", tmp / BASE_CONFIG)
            tok = str(final.resolve() / "tokenizer.json") if (tmp / "tokenizer.json").is_file() else cfg.data.tokenizer
            dump(with_overrides(cfg, ["hf.init_from=null", f"data.tokenizer={tok}"]), tmp / MOEBAL_CONFIG)
            write_manifest(tmp)
            _replace_dir(tmp, final)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    finally:
        source.close()
    return final
