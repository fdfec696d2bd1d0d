"""Rank-local initialisation (moebal/models/local_init.py): a rank's tensors built on the meta device and
materialised alone equal the full model's bit for bit, and its host peak stays near what it holds."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
import torch

from moebal.config import from_dict
from moebal.models import build_model
from moebal.models.local_init import Holding, build_local


def _cfg(model: dict | None = None, moe: dict | None = None):
    m = dict(vocab_size=256, dim=32, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=48, max_seq_len=16)
    m.update(model or {})
    e = dict(num_experts=4, top_k=2, expert_ffn_dim=24, every=2)
    e.update(moe or {})
    return from_dict({"model": m, "moe": e, "data": {"seq_len": 16}})


CONFIGS = {
    "mixtral": _cfg(),
    "routers": _cfg(moe=dict(router_noise=0.01, shared_experts=1, shared_gate=True, router="mlp_tanh",
                             bias_update_rate=0.01)),
    "tied_bias_qknorm": _cfg(model=dict(tie_embeddings=True, attention_bias=True, qk_norm="head")),
    "mla": _cfg(model=dict(n_kv_heads=4, mla=dict(q_lora_rank=16, kv_lora_rank=8, qk_nope_head_dim=6,
                                                  qk_rope_head_dim=4, v_head_dim=5))),
    "dense": _cfg(moe=dict(num_experts=0)),
}
HOLDINGS = {
    "all": Holding(),
    "ep_rank1_of_2": Holding(experts=(2, 3)),
    "ep_rank0_of_4": Holding(experts=(0,)),
    "first_stage": Holding(layers=frozenset({0, 1}), embed=True, head=False),
    "last_stage_ep": Holding(layers=frozenset({3}), embed=False, head=True, experts=(1,)),
}


@pytest.mark.parametrize("holding", HOLDINGS)
@pytest.mark.parametrize("name", CONFIGS)
def test_rank_local_init_equals_the_full_model_bitwise(name, holding):
    cfg, hold = CONFIGS[name], HOLDINGS[holding]
    if cfg.model.tie_embeddings and hold.head and not hold.embed:  # the head's weight is the embedding's tensor
        with pytest.raises(ValueError, match="tie_embeddings"):
            build_local(cfg, hold)
        return
    torch.manual_seed(3)
    ref = build_model(cfg).state_dict()
    after_ref = torch.rand(4)  # the generator's state after the build: the same after a rank-local one
    torch.manual_seed(3)
    local = build_local(cfg, hold)
    assert torch.equal(torch.rand(4), after_ref)
    got = local.state_dict()
    assert got.keys() == ref.keys()
    real = 0
    for k, v in got.items():
        tied = cfg.model.tie_embeddings and k == "lm_head.weight" and hold.embed  # the embedding's tensor
        if not hold.holds(k) and not tied:
            assert v.is_meta, k  # never allocated
            continue
        rows = hold.rows(k) if cfg.moe.num_experts else None
        want = ref[k][list(rows)] if rows is not None else ref[k]
        assert torch.equal(v, want), k
        real += 1
    assert real > 5
    if hold.experts is not None and cfg.moe.num_experts:
        assert all(m.experts.expert_ids == hold.experts for m in local.moe_layers())


_PEAK_CHILD = textwrap.dedent("""
    import json, resource, sys
    import torch
    from moebal.config import from_dict
    from moebal.models.local_init import Holding, build_local, meta_model
    mode = sys.argv[1]
    cfg = from_dict({"model": dict(vocab_size=256, dim=256, n_layers=4, n_heads=4, n_kv_heads=4, ffn_dim=512,
                                   max_seq_len=16),
                     "moe": dict(num_experts=16, top_k=2, expert_ffn_dim=1536), "data": {"seq_len": 16}})
    hold = {"ep": Holding(experts=(4, 5, 6, 7)),
            "stage": Holding(layers=frozenset({1}), embed=False, head=False)}[mode]
    kb = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # imports (the model's modules load lazily) and the allocator warmed up before the baseline
    build_local(from_dict({"model": dict(vocab_size=256, dim=16, n_layers=1, n_heads=2, n_kv_heads=2, ffn_dim=16,
                                         max_seq_len=16), "moe": dict(num_experts=2, top_k=1, expert_ffn_dim=16),
                           "data": {"seq_len": 16}}), Holding())
    torch.manual_seed(0)
    before = kb()
    model = build_local(cfg, hold)
    after = kb()
    sd = model.state_dict()
    held = sum(t.numel() * t.element_size() for t in sd.values() if not t.is_meta)
    every = meta_model(cfg)[0].state_dict().values()
    full = sum(t.numel() * t.element_size() for t in every)
    largest = max(t.numel() * t.element_size() for t in every)
    print(json.dumps({"peak": (after - before) * 1024, "held": held, "full": full, "largest": largest}))
""")


@pytest.mark.parametrize("mode", ["ep", "stage"])
def test_start_up_host_peak_is_what_the_rank_holds_plus_the_largest_tensor(mode):
    """A ~310 MB model (16 experts x 4 layers); the rank holds a quarter of it (4 of 16 experts, or 1 of 4
    layers): its start-up peak (ru_maxrss in a fresh process) stays under held + the largest tensor (one stacked
    expert weight, 25 MB) + 8 MB slack."""
    out = subprocess.run([sys.executable, "-c", _PEAK_CHILD, mode], check=True, capture_output=True, text=True)
    r = json.loads(out.stdout.strip().splitlines()[-1])
    bound = r["held"] + r["largest"] + 8 * 2**20
    assert r["full"] > 3.5 * r["held"] and r["full"] > 2 * bound, r  # the full model would not fit the bound
    assert r["peak"] < bound, {**r, "bound": bound}
