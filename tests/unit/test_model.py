"""The decoder's maths against transformers' own implementation (dense layers: LLaMA), and basic invariants."""

from __future__ import annotations

import pytest
import torch

from moebal.config import from_dict
from moebal.models import build_model


def _dense_cfg(**model):
    base = dict(vocab_size=300, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=96, max_seq_len=32,
                rope_theta=500.0, norm_eps=1e-6)
    base.update(model)
    return from_dict({"model": base, "moe": {"num_experts": 0}, "data": {"seq_len": base["max_seq_len"]}})


def test_dense_logits_match_transformers_llama():
    transformers = pytest.importorskip("transformers", reason="transformers (extra 'hf') is not installed")
    cfg = _dense_cfg()
    torch.manual_seed(0)
    ours = build_model(cfg).eval()
    m = cfg.model
    hf_cfg = transformers.LlamaConfig(vocab_size=m.vocab_size, hidden_size=m.dim, intermediate_size=m.ffn_dim,
                                      num_hidden_layers=m.n_layers, num_attention_heads=m.n_heads,
                                      num_key_value_heads=m.n_kv_heads, max_position_embeddings=m.max_seq_len,
                                      rope_theta=m.rope_theta, rms_norm_eps=m.norm_eps, tie_word_embeddings=False,
                                      attention_bias=False, mlp_bias=False)
    hf = transformers.LlamaForCausalLM(hf_cfg).eval()
    missing, unexpected = hf.load_state_dict(ours.state_dict(), strict=False)
    assert not unexpected and all("rotary" in k for k in missing)
    ids = torch.randint(0, m.vocab_size, (3, 17))
    with torch.no_grad():
        ref = hf(ids).logits
        got = ours(ids).logits
    assert (got - ref).abs().max().item() < 1e-4


def test_loss_ignores_minus_100_and_is_causal():
    cfg = _dense_cfg()
    torch.manual_seed(0)
    model = build_model(cfg).eval()
    ids = torch.randint(0, 300, (2, 12))
    labels = ids.clone()
    labels[:, 6:] = -100
    with torch.no_grad():
        out = model(ids, labels)
        # causality: changing later tokens changes neither earlier logits nor the loss over early labels
        ids2 = ids.clone()
        ids2[:, 8:] = (ids2[:, 8:] + 1) % 300
        out2 = model(ids2, labels)
    assert torch.equal(out.logits[:, :8], out2.logits[:, :8])
    assert torch.equal(out.loss, out2.loss)
    expected = torch.nn.functional.cross_entropy(out.logits[:, :6].reshape(-1, 300), ids[:, :6].reshape(-1))
    assert torch.allclose(out.loss, expected)


def test_sequence_longer_than_rotary_table_is_a_clear_error():
    model = build_model(_dense_cfg(max_seq_len=8))
    with pytest.raises(ValueError, match="max_seq_len"):
        model(torch.zeros(1, 9, dtype=torch.long))


def test_tied_embeddings_share_storage():
    model = build_model(_dense_cfg(tie_embeddings=True))
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()


def test_a_sliding_window_s_mask_is_one_saved_tensor_for_every_layer_and_the_same_attention(monkeypatch):
    """Layers within a window shorter than the sequence attend through one cached additive mask: the backward
    saves that one [T, T] tensor for every layer, not a conversion per layer, and the outputs and gradients equal
    those of the boolean mask SDPA converts itself, bit for bit."""
    import moebal.models.transformer as tr

    torch.manual_seed(0)
    layers = [tr.Attention(32, 4, 2, 8, sliding_window=5) for _ in range(3)]
    cos, sin = tr.Rotary(8, 16, 10000.0)(12, torch.float32)
    x = torch.randn(2, 12, 32)

    def run() -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
        saved: list[torch.Tensor] = []
        xi = x.clone().requires_grad_(True)
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            h = xi
            for layer in layers:
                h = h + layer(h, cos, sin)
        for layer in layers:
            layer.zero_grad(set_to_none=True)
        h.square().sum().backward()
        masks = [t for t in saved if t.shape == (12, 12)]
        return h.detach(), [xi.grad, *(p.grad for la in layers for p in la.parameters())], masks

    out, grads, masks = run()
    assert len(masks) == 3 and len({m.untyped_storage().data_ptr() for m in masks}) == 1  # one tensor, 3 layers
    monkeypatch.setattr(tr, "window_bias", lambda T, w, device, dtype: tr.window_mask(T, w, device))
    out_b, grads_b, _ = run()
    assert torch.equal(out, out_b) and all(torch.equal(a, b) for a, b in zip(grads, grads_b))


@pytest.mark.parametrize("window", [None, 5])
def test_grouped_query_attention_with_keys_and_values_expanded_equals_enable_gqa(monkeypatch, window):
    """The CUDA fp32 path (keys and values repeated to every query head, no `enable_gqa`) computes what the
    grouped call does: forward and every gradient, on the CPU with the switch forced."""
    import moebal.models.transformer as tr

    assert not tr.expand_kv_heads(torch.zeros(1, 4, 2, 8))  # the CPU keeps enable_gqa
    torch.manual_seed(0)
    attn = tr.Attention(32, 4, 2, 8, sliding_window=window)
    rope = tr.Rotary(8, 16, 10000.0)
    x = torch.randn(2, 12, 32)
    cos, sin = rope(12, torch.float32)

    def run(expand: bool) -> tuple[torch.Tensor, list[torch.Tensor]]:
        monkeypatch.setattr(tr, "expand_kv_heads", lambda q: expand)
        attn.zero_grad(set_to_none=True)
        xi = x.clone().requires_grad_(True)
        out = attn(xi, cos, sin)
        out.square().sum().backward()
        return out.detach(), [xi.grad, *(p.grad for p in attn.parameters())]

    out_g, grads_g = run(False)
    out_e, grads_e = run(True)
    torch.testing.assert_close(out_e, out_g, rtol=1e-5, atol=1e-6)
    for a, b in zip(grads_e, grads_g):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
