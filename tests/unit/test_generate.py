"""Generation (moebal/models/generate.py): the KV-cached decoder against the model's full forward, the sampling
filters on hand-made logits, and greedy generation against transformers' own `generate` on HF checkpoints."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch

from moebal.config import from_dict
from moebal.interop.hf import from_hf
from moebal.models import build_model
from moebal.models.generate import (
    KVCache,
    Sampling,
    cached_forward,
    dropless,
    filter_logits,
    generate,
    generate_many,
    next_tokens,
    query_mask,
)
from tests.hf_util import tiny_mixtral, tiny_qwen2_moe
from tests.unit.test_hf_deepseek import CASES as DEEPSEEK_CASES
from tests.unit.test_hf_deepseek import tiny_deepseek

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny tensors (tests/conftest.py)

MODELS: dict[str, dict[str, Any]] = {  # config sections over a tiny base (below)
    "dense": {"moe": {"num_experts": 0}},
    "moe-window5": {"model": {"sliding_window": 5}},
    "moe-qknorm-full-bias-tied": {"model": {"qk_norm": "full", "attention_bias": True, "tie_embeddings": True}},
    "moe-qknorm-head-shared-capacity": {"model": {"qk_norm": "head"},
                                        "moe": {"shared_experts": 1, "capacity_factor": 1.0}},
    "mla-yarn": {"model": {"n_kv_heads": 4, "mla": {"q_lora_rank": 16, "kv_lora_rank": 20, "qk_nope_head_dim": 8,
                                                    "qk_rope_head_dim": 4, "v_head_dim": 6},
                           "rope_scaling": {"factor": 4.0, "original_max_seq_len": 8,
                                            "mscale_all_dim": 0.707}}},
}


def _model(case: str) -> Any:
    data: dict[str, Any] = {"model": dict(vocab_size=256, dim=32, n_layers=3, n_heads=4, n_kv_heads=2, ffn_dim=48,
                                          max_seq_len=40, rope_theta=500.0),
                            "moe": {"num_experts": 4, "top_k": 2, "expert_ffn_dim": 24}, "data": {"seq_len": 40}}
    for section, values in MODELS[case].items():
        data[section].update(values)
    torch.manual_seed(0)
    model = build_model(from_dict(data)).eval()
    with torch.no_grad():  # biases and norms away from their initial zeros and ones, so that they matter
        g = torch.Generator().manual_seed(1)
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(0.1 * torch.randn(p.shape, generator=g))
    return model


@pytest.mark.parametrize("case", list(MODELS))
def test_the_cached_decoder_gives_the_full_forward_s_logits(case: str) -> None:
    """A prompt of 7 positions, 12 decoded one by one and a chunk of 4 after them: every position's logits equal
    the full forward's over the 23 positions to 1e-5 (grouped-query and latent attention, a sliding window shorter
    than the sequence, q/k norms, biases, tied embeddings, shared experts); under a capacity factor both run
    dropless. Greedy generation with and without the cache gives the same tokens."""
    model = _model(case)
    ids = torch.randint(0, 256, (2, 23), generator=torch.Generator().manual_seed(2))
    cache = KVCache.empty(3, 24)
    with dropless(model), torch.no_grad():
        full = model(ids).logits
        parts = [cached_forward(model, ids[:, :7], cache)]
        parts += [cached_forward(model, ids[:, t:t + 1], cache) for t in range(7, 19)]
        parts.append(cached_forward(model, ids[:, 19:], cache))
    got = torch.cat(parts, dim=1)
    assert cache.length == 23 and all(k is not None and k.shape[2] == 24 for k in cache.keys)
    assert (got - full).abs().max().item() < 1e-5 * full.abs().max().item() + 1e-6
    prompt = ids[0, :5].tolist()
    assert generate(model, prompt, 16).tokens == generate(model, prompt, 16, cache=False).tokens
    if MODELS[case].get("moe", {}).get("capacity_factor"):  # the capacity factor is back after generating
        assert all(layer.spec.capacity_factor == 1.0 for layer in model.moe_layers())


@pytest.mark.parametrize("latent", [True, False], ids=["latent", "per-head"])
def test_latent_attention_caches_its_latent_and_gives_the_per_head_forms_logits(latent: bool) -> None:
    """Multi-head latent attention's cached decoder in both forms: the latent (the absorbed form, C + R numbers
    per position and layer) and the per-head keys and values (H * (N + R + V)); each gives the full forward's
    logits to 1e-5 over a left-padded batch, and they give each other's tokens."""
    model = _model("mla-yarn")  # H 4, C 20, R 4, N 8, V 6, 3 layers
    ids = torch.randint(0, 256, (2, 15), generator=torch.Generator().manual_seed(4))
    cache = KVCache.empty(3, 16, latent=latent)
    with torch.no_grad():
        full = model(ids).logits
        parts = [cached_forward(model, ids[:, :6], cache)]
        parts += [cached_forward(model, ids[:, t:t + 1], cache) for t in range(6, 15)]
    got = torch.cat(parts, dim=1)
    assert (got - full).abs().max().item() < 1e-5 * full.abs().max().item() + 1e-6
    per_position = 3 * 2 * 4 * ((20 + 4) if latent else 4 * (8 + 4 + 6))  # layers x rows x fp32 bytes x numbers
    assert cache.position_bytes() == per_position
    assert all((v is None) == latent for v in cache.values)
    # a padded batch: the shorter prompt's row is its own generation in both forms
    prompts = [ids[0, :9].tolist(), ids[1, :4].tolist()]
    both = generate_many(model, prompts, 8, latent=latent)
    assert [g.tokens for g in both] == [generate(model, p, 8, latent=not latent).tokens for p in prompts]
    assert both[1].cache_bytes == per_position // 2


def test_the_query_mask_covers_the_cache_and_the_window_and_the_cache_its_capacity() -> None:
    assert query_mask(0, 4, None, torch.device("cpu")) is None  # the model's own causal fast path
    assert query_mask(0, 4, 4, torch.device("cpu")) is None
    m = query_mask(3, 2, 3, torch.device("cpu"))
    assert m is not None
    # queries at positions 3 and 4 over keys 0..4, each seeing itself and the 2 positions before it
    assert m.tolist() == [[False, True, True, True, False], [False, False, True, True, True]]
    m = query_mask(5, 1, None, torch.device("cpu"))
    assert m is not None and m.tolist() == [[True] * 6]
    cache = KVCache.empty(1, 2)
    cache.extend(0, torch.zeros(1, 2, 2, 4), torch.zeros(1, 2, 2, 4))
    cache.length = 2
    with pytest.raises(ValueError, match="holds 2 positions; 3 asked for"):
        cache.extend(0, torch.zeros(1, 2, 1, 4), torch.zeros(1, 2, 1, 4))


def test_top_k_and_top_p_keep_the_tokens_they_name() -> None:
    probs = torch.tensor([[0.5, 0.05, 0.25, 0.2]])
    logits = probs.log()
    kept = lambda s: torch.isfinite(filter_logits(logits, s))[0].tolist()  # noqa: E731
    assert kept(Sampling(temperature=1.0, top_k=2)) == [True, False, True, False]
    # nucleus: 0.5 < 0.7, then 0.5 + 0.25 reaches 0.7: the two most likely
    assert kept(Sampling(temperature=1.0, top_p=0.7)) == [True, False, True, False]
    assert kept(Sampling(temperature=1.0, top_p=0.76)) == [True, False, True, True]
    assert kept(Sampling(temperature=1.0, top_p=0.01)) == [True, False, False, False]  # the most likely stays
    assert kept(Sampling(temperature=1.0, top_k=3, top_p=0.9)) == [True, False, True, True]
    # the temperature divides the logits (shifted by their max: the same softmax)
    torch.testing.assert_close(filter_logits(logits, Sampling(temperature=0.5)), (logits - logits.max()) * 2)
    # a tiny temperature the check accepts: the most likely token, not inf - inf (it once ended in a NaN error)
    tiny = Sampling(temperature=1e-40, seed=1)
    assert next_tokens(logits, tiny, torch.Generator().manual_seed(1)).tolist() == [0]
    # one that rounds to 0 in fp32 (below its smallest subnormal): greedy, not 0 / 0 at the top token
    for t in (1e-46, 1e-300):
        assert Sampling(temperature=t).greedy and next_tokens(logits, Sampling(temperature=t), None).tolist() == [0]


def test_draws_follow_the_filtered_distribution_and_repeat_by_seed() -> None:
    """20,000 rows of the same logits under top-p 0.76: the three kept tokens drawn in proportion 0.5 : 0.25 :
    0.2 renormalised (each within 0.015), the cut one never; the same seed draws the same tokens."""
    logits = torch.tensor([0.5, 0.05, 0.25, 0.2]).log().expand(20_000, 4)
    s = Sampling(temperature=1.0, top_p=0.76, seed=5)
    draw = lambda: next_tokens(logits, s, torch.Generator().manual_seed(s.seed))  # noqa: E731
    toks = draw()
    share = torch.bincount(toks, minlength=4).double() / toks.numel()
    want = torch.tensor([0.5, 0.0, 0.25, 0.2], dtype=torch.float64) / 0.95
    assert share[1] == 0 and (share - want).abs().max().item() < 0.015, share
    assert torch.equal(toks, draw())
    assert torch.equal(next_tokens(logits[:2], Sampling(), None), torch.tensor([0, 0]))  # greedy: the argmax


def test_generation_stops_at_a_stop_token_and_refuses_what_it_cannot_do() -> None:
    model = _model("dense")
    first = generate(model, [1, 2, 3], 8)
    g = generate(model, [1, 2, 3], 8, stop_ids=[first.tokens[2]])
    assert g.stop == "stop_token" and g.tokens == first.tokens[:3] and first.stop == "length"
    with pytest.raises(ValueError, match="exceed the model's max_seq_len"):
        generate(model, list(range(30)), 12)  # 41 positions of 40
    # the last new token is never fed back: a prompt filling max_seq_len still gets its one next token, the
    # prediction the forward over it makes (it was refused)
    limit = model.model.rotary.cos_TK.shape[0]
    whole = list(range(1, limit + 1))
    for cache in (True, False):
        want = int(model(torch.tensor([whole])).logits[0, -1].argmax())
        assert generate(model, whole, 1, cache=cache).tokens == [want]
        assert len(generate(model, whole[:-2], 3, cache=cache).tokens) == 3
    with pytest.raises(ValueError, match="exceed the model's max_seq_len"):
        generate(model, whole, 2)
    with pytest.raises(ValueError, match="no tokens"):
        generate(model, [], 4)
    with pytest.raises(ValueError, match="top_p must be in"):
        Sampling(temperature=1.0, top_p=0.0)
    with pytest.raises(ValueError, match="temperature must be"):
        Sampling(temperature=-1.0)


def test_generation_records_no_routing_statistics_and_restores_the_layers() -> None:
    """Inside `dropless` (generation) MoE layers skip their training bookkeeping (statistics, balancing loss),
    and leave it on again after; the tokens are those of a model whose layers record."""
    model = _model("moe-window5")
    layers = list(model.moe_layers())
    model(torch.tensor([[1, 2, 3]]))  # a forward outside generation records
    before = [layer.last_stats for layer in layers]
    assert all(s is not None for s in before)
    got = generate(model, [1, 2, 3, 4], 10)
    assert [layer.last_stats for layer in layers] == before and all(layer.records for layer in layers)
    with dropless(model):
        assert not any(layer.records for layer in layers)
        for layer in layers:
            layer.records = True  # a model that records while it generates: the same tokens
        again = generate(model, [1, 2, 3, 4], 10)
    assert again.tokens == got.tokens


def _hf_greedy(ref: Any, prompt: list[int], n: int) -> list[int]:
    with torch.no_grad():
        ids = torch.tensor([prompt])  # the mask given: transformers would take pad id 0 in a prompt for padding
        out = ref.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                           eos_token_id=None, pad_token_id=0)
    return [int(t) for t in out[0, len(prompt):]]


HF_CASES = {
    "mixtral": lambda p: tiny_mixtral(p),
    "mixtral-window6": lambda p: tiny_mixtral(p, sliding_window=6),
    "qwen2-moe": lambda p: tiny_qwen2_moe(p),
    "deepseek-v3": lambda p: tiny_deepseek(p, 3, **DEEPSEEK_CASES["v3-groups4of2-shared1-dense1-yarn"][1]),
}


@pytest.mark.parametrize("case", list(HF_CASES))
def test_greedy_generation_equals_transformers_generate(case: str, tmp_path: Path) -> None:
    """A HF checkpoint written by transformers: moebal's KV-cached greedy tokens equal transformers' own
    `generate` (its KV cache) for 20 new tokens after a 5-token prompt (past a sliding window of 6)."""
    ref = HF_CASES[case](tmp_path / "src")
    ours = from_hf(tmp_path / "src").eval()
    prompt = [5, 17, 33, 2, 60]
    assert generate(ours, prompt, 20).tokens == _hf_greedy(ref, prompt, 20)


def test_bf16_generation_runs_in_bf16() -> None:
    model = _model("moe-window5").to(torch.bfloat16)
    g = generate(model, [1, 2, 3], 6)
    assert len(g.tokens) == 6 and all(0 <= t < 256 for t in g.tokens) and not math.isnan(g.prefill_s)


def _early_exit_model(threshold: float) -> Any:
    """A model served through early exit (exits after layers 1..3 of 5) at `threshold`, untrained."""
    from moebal.train.pipelined import scheme_from_config

    cfg = from_dict({"model": dict(vocab_size=256, dim=32, n_layers=5, n_heads=4, n_kv_heads=2, ffn_dim=48,
                                   max_seq_len=40),
                     "moe": {"num_experts": 4, "top_k": 2, "expert_ffn_dim": 24}, "data": {"seq_len": 40},
                     "dynamism": {"scheme": "early_exit", "early_exit": {"threshold": threshold, "first_layer": 1}}})
    torch.manual_seed(0)
    model = build_model(cfg).eval()
    scheme = scheme_from_config(cfg)
    scheme.prepare_model(model)
    assert scheme.serve(model, 100) is not None
    return model


def test_early_exit_decodes_with_its_exits_as_the_served_forward() -> None:
    """At a threshold about half the tokens pass after layer 1 (cosine similarities 0.987-0.997 here), the served
    forward differs from the plain model's; the KV-cached decoder (prompt of 7, then one by one) gives the served
    forward's logits to 1e-5, and greedy generation with and without the cache the same tokens. Without the exits
    the cached decoder would give the plain model's logits."""
    model = _early_exit_model(0.996)
    ids = torch.randint(0, 256, (1, 23), generator=torch.Generator().manual_seed(2))
    cache = KVCache.empty(5, 23)
    with torch.no_grad():
        served = model(ids).logits
        parts = [cached_forward(model, ids[:, :7], cache)]
        parts += [cached_forward(model, ids[:, t:t + 1], cache) for t in range(7, 23)]
        plain_forward = vars(model.model).pop("forward")
        plain = model(ids).logits
        model.model.forward = plain_forward
    got = torch.cat(parts, dim=1)
    assert (served - plain).abs().max().item() > 100 * (got - served).abs().max().item()
    assert (got - served).abs().max().item() < 1e-5 * served.abs().max().item() + 1e-6
    prompt = ids[0, :5].tolist()
    assert generate(model, prompt, 12).tokens == generate(model, prompt, 12, cache=False).tokens


@pytest.mark.parametrize("case", ["dense", "moe-window5", "mla-yarn", "early-exit"])
def test_a_batch_of_prompts_generates_what_each_prompt_generates_alone(case: str) -> None:
    """Prompts of 3, 9 and 5 tokens in one left-padded batch: the prompt forward's logits at each row's real
    positions equal the row's own to 1e-5 (no row attends to padding; it fails when padding is a key), and greedy
    and seeded sampled tokens equal each prompt's alone (each row draws from its own generator)."""
    model = _early_exit_model(0.996) if case == "early-exit" else _model(case)
    prompts = [[5, 17, 33], list(range(40, 49)), [7, 8, 9, 10, 11]]
    pad = torch.tensor([6, 0, 4])
    batch = torch.tensor([[0] * int(k) + p for k, p in zip(pad, prompts)])
    with torch.no_grad():
        together = cached_forward(model, batch, KVCache.empty(len(model.model.layers), 9), pad)
        for b, p in enumerate(prompts):
            alone = cached_forward(model, torch.tensor([p]), KVCache.empty(len(model.model.layers), 9))
            assert (together[b, int(pad[b]):] - alone[0]).abs().max().item() < 1e-5 * alone.abs().max().item() + 1e-6
    assert [g.tokens for g in generate_many(model, prompts, 10)] == [generate(model, p, 10).tokens for p in prompts]
    s = Sampling(temperature=1.0, top_p=0.9, seed=3)
    assert [g.tokens for g in generate_many(model, prompts, 10, s)] == \
        [generate(model, p, 10, s).tokens for p in prompts]


def test_rows_that_stop_keep_their_tokens_while_the_others_go_on() -> None:
    model = _model("dense")
    prompts = [[1, 2, 3], [4, 5]]
    first = [generate(model, p, 8).tokens for p in prompts]
    out = generate_many(model, prompts, 8, stop_ids=[first[0][1]])
    assert out[0].tokens == first[0][:first[0].index(first[0][1]) + 1] and out[0].stop == "stop_token"
    stop = first[0][1]
    want = first[1][:first[1].index(stop) + 1] if stop in first[1] else first[1]
    assert out[1].tokens == want
