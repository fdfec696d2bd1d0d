"""Tiny random HF checkpoints written by `transformers` itself, and a tiny tokenizer.json, for interop tests."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from moebal.interop.tensor_io import DirectorySource


def transformers_or_skip() -> Any:
    return pytest.importorskip("transformers", reason="transformers (extra 'hf') is not installed")


def _quiet_save(model: Any, path: Path, **kw: Any) -> None:
    with contextlib.redirect_stderr(io.StringIO()):
        model.save_pretrained(str(path), **kw)


def tiny_mixtral(path: Path, seed: int = 0, shard: str | None = None, **overrides: Any) -> Any:
    """A random MixtralForCausalLM saved to `path` (GQA 4:2, rope theta 5e5, untied); returns the model."""
    transformers = transformers_or_skip()
    kw: dict[str, Any] = dict(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                              num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                              rope_theta=5e5, rms_norm_eps=1e-5, tie_word_embeddings=False, max_position_embeddings=64,
                              sliding_window=None, router_aux_loss_coef=0.02)
    kw.update(overrides)
    torch.manual_seed(seed)
    model = transformers.MixtralForCausalLM(transformers.MixtralConfig(**kw)).eval()
    _quiet_save(model, path, **({"max_shard_size": shard} if shard else {}))
    return model


def tiny_qwen2_moe(path: Path, seed: int = 0, **overrides: Any) -> Any:
    """A random Qwen2MoeForCausalLM saved to `path`: shared expert with sigmoid gate, q/k/v biases, MoE on
    every second layer (dense MLPs between)."""
    transformers = transformers_or_skip()
    kw: dict[str, Any] = dict(vocab_size=96, hidden_size=32, intermediate_size=40, moe_intermediate_size=16,
                              shared_expert_intermediate_size=24, num_hidden_layers=4, num_attention_heads=4,
                              num_key_value_heads=2, num_experts=6, num_experts_per_tok=2, decoder_sparse_step=2,
                              norm_topk_prob=False, max_position_embeddings=64, rope_theta=20000.0,
                              tie_word_embeddings=False)
    kw.update(overrides)
    torch.manual_seed(seed)
    model = transformers.Qwen2MoeForCausalLM(transformers.Qwen2MoeConfig(**kw)).eval()
    with torch.no_grad():  # transformers initialises biases to zero; make them matter
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.normal_(0, 0.02)
    _quiet_save(model, path)
    return model


def _save_random(model: Any, path: Path, bias_std: float = 0.0, norm_std: float = 0.0, **save: Any) -> Any:
    """Perturb what transformers initialises to constants (biases at zero, norm weights at one) so that a
    mapping error in them shows in the logits, then save."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".bias") and bias_std:
                p.normal_(0, bias_std)
            if "norm" in name and norm_std:
                p.add_(torch.randn_like(p) * norm_std)
    _quiet_save(model, path, **save)
    return model


def tiny_qwen3_moe(path: Path, seed: int = 0, save: dict[str, Any] | None = None, **overrides: Any) -> Any:
    """A random Qwen3MoeForCausalLM saved to `path`: per-head q/k RMSNorm, head_dim 12 (not 32 / 4), MoE every
    layer but the dense layer 1 (`mlp_only_layers`), untied; returns the model."""
    transformers = transformers_or_skip()
    kw: dict[str, Any] = dict(vocab_size=96, hidden_size=32, intermediate_size=40, moe_intermediate_size=16,
                              num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=12,
                              num_experts=6, num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[1],
                              norm_topk_prob=True, max_position_embeddings=64, rope_theta=20000.0,
                              rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    kw.update(overrides)
    torch.manual_seed(seed)
    model = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**kw)).eval()
    return _save_random(model, path, norm_std=0.1, **(save or {}))


def tiny_olmoe(path: Path, seed: int = 0, **overrides: Any) -> Any:
    """A random OlmoeForCausalLM saved to `path`: q/k RMSNorm over the whole projections, GQA 4:2; returns it."""
    transformers = transformers_or_skip()
    kw: dict[str, Any] = dict(vocab_size=96, hidden_size=32, intermediate_size=16, num_hidden_layers=2,
                              num_attention_heads=4, num_key_value_heads=2, num_experts=8, num_experts_per_tok=3,
                              norm_topk_prob=False, max_position_embeddings=64, rope_theta=10000.0,
                              rms_norm_eps=1e-5, tie_word_embeddings=False, eos_token_id=2, pad_token_id=1)
    kw.update(overrides)
    torch.manual_seed(seed)
    model = transformers.OlmoeForCausalLM(transformers.OlmoeConfig(**kw)).eval()
    return _save_random(model, path, norm_std=0.1)


def tiny_tokenizer(path: Path, texts: list[str], vocab_size: int = 96) -> Path:
    """A byte-level BPE tokenizer.json trained on `texts` with `tokenizers` (ids < vocab_size)."""
    tokenizers = pytest.importorskip("tokenizers", reason="tokenizers (extra 'hf') is not installed")
    tok = tokenizers.Tokenizer(tokenizers.models.BPE(unk_token=None))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<s>", "</s>"],
                                             show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    tok.post_processor = tokenizers.processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    out = path / "tokenizer.json"
    tok.save(str(out))
    assert json.loads(out.read_text())["model"]["type"] == "BPE"
    assert tok.get_vocab_size() <= vocab_size
    return out


def logits(model: Any, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits


def read_tensors(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a safetensors checkpoint directory, read into memory."""
    src = DirectorySource(path)
    try:
        return {k: src.read(k).clone() for k in src.info()}
    finally:
        src.close()
