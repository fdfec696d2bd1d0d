"""The balancing loss's scopes (`moe.aux_loss_scope`): `pooled` against transformers' `load_balancing_loss_func`
(Mixtral, Qwen2-MoE with dense layers between, OLMoE at top-3), its value and router gradients, with right padding
left out by the attention mask; `sequence` against DeepSeek's `seq_aux` written out row by row; both under
recomputation and padding; the HF mapping of `seq_aux`; the configurations refused."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from moebal.config import from_dict
from moebal.errors import ConfigError
from moebal.interop.hf import config_from_hf, from_hf, to_hf
from moebal.models import build_model, padding
from moebal.models.moe import MoELayer
from moebal.models.recompute import set_recompute
from moebal.routing import pooled_balancing_loss, sequence_balancing_loss
from tests.hf_util import tiny_mixtral, tiny_olmoe, tiny_qwen2_moe

FAMILIES = {"mixtral": tiny_mixtral, "qwen2_moe": tiny_qwen2_moe, "olmoe": tiny_olmoe}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_pooled_equals_transformers_loss_and_router_gradients(tmp_path, family):
    ref = FAMILIES[family](tmp_path)
    cfg = config_from_hf(tmp_path, {"moe": {"aux_loss_scope": "pooled"}})
    ours = from_hf(tmp_path, cfg=cfg).eval()
    coef = cfg.moe.aux_loss_coef
    ids = torch.randint(0, 96, (3, 20), generator=torch.Generator().manual_seed(0))
    for n_B in (None, torch.tensor([20, 13, 7])):  # whole rows, then right padding under the attention mask
        mask = None if n_B is None else (torch.arange(20) < n_B[:, None]).long()
        ref.zero_grad()
        ours.zero_grad()
        theirs = ref(input_ids=ids, attention_mask=mask, output_router_logits=True).aux_loss
        with padding.rows(n_B, 20):
            mine = ours(ids).aux_loss / coef
        assert abs(mine.item() - theirs.item()) < 1e-6 * theirs.item(), (mine.item(), theirs.item())
        theirs.backward()
        mine.backward()
        ref_grads = [p.grad for n, p in ref.named_parameters() if n.endswith("mlp.gate.weight")]
        our_grads = [layer.gate.weight.grad for layer in ours.moe_layers()]
        assert len(ref_grads) == len(our_grads) == sum(1 for _ in ours.moe_layers())
        for g, rg in zip(our_grads, ref_grads):
            assert ((g - rg).norm() / rg.norm()).item() < 1e-5
        emb = ((ours.model.embed_tokens.weight.grad - ref.model.embed_tokens.weight.grad).norm()
               / ref.model.embed_tokens.weight.grad.norm()).item()
        assert emb < 1e-4, emb


def _deepseek_seq_aux(probs_BTE: torch.Tensor, idx_BTK: torch.Tensor) -> torch.Tensor:
    """DeepSeek's `seq_aux` as its modeling code writes it (MoEGate, alpha left out): per row, the counts of the
    row's T * K choices scaled by E / (T * K), times the row's mean scores, summed; the mean over rows."""
    B, T, E = probs_BTE.shape
    K = idx_BTK.shape[-1]
    ce = torch.zeros(B, E).scatter_add_(1, idx_BTK.reshape(B, -1), torch.ones(B, T * K)).div_(T * K / E)
    return (ce * probs_BTE.mean(dim=1)).sum(dim=1).mean()


@pytest.mark.parametrize("gate", ["softmax_topk", "sigmoid_topk"])
def test_sequence_equals_deepseek_s_seq_aux_and_leaves_padding_out(gate):
    torch.manual_seed(0)
    layer = MoELayer(16, 8, 8, 3, gate=gate, norm_topk=gate == "sigmoid_topk", aux_loss_coef=1.0,
                     aux_loss_scope="sequence")
    with torch.no_grad():
        layer.gate.weight.normal_(0, 1.0)  # skewed routing: rows differ
    x = torch.randn(4, 10, 16)
    layer(x)
    mine = layer.aux_loss
    logits = x.reshape(-1, 16) @ layer.gate.weight.t()
    scores = logits.softmax(-1) if gate == "softmax_topk" else logits.sigmoid()
    idx = scores.topk(3, dim=-1).indices  # V2 greedy; V3 without groups or bias
    probs = scores if gate == "softmax_topk" else scores / scores.sum(-1, keepdim=True)  # V3 eq. 19's s'
    theirs = _deepseek_seq_aux(probs.view(4, 10, 8), idx.view(4, 10, 3))
    assert abs(mine.item() - theirs.item()) < 1e-6, (mine.item(), theirs.item())
    # per sequence, not per batch: the batch's Switch loss is another number
    layer.aux_loss_scope = "layer"
    layer(x)
    assert abs(layer.aux_loss.item() - mine.item()) > 1e-3
    # right padding is left out: row 0 cut to 6 tokens and padded gives what its 6 tokens alone give
    layer.aux_loss_scope = "sequence"
    x_pad = x.clone()
    x_pad[0, 6:] = torch.randn(4, 16) * 5  # padding that routes anywhere
    with padding.rows(torch.tensor([6, 10, 10, 10]), 10):
        layer(x_pad)
    padded = layer.aux_loss
    parts = [x[0, :6]] + [x[i] for i in range(1, 4)]
    alone = []
    for part in parts:
        layer(part.unsqueeze(0))
        alone.append(layer.aux_loss)
    assert abs(padded.item() - torch.stack(alone).mean().item()) < 1e-6


def test_the_loss_functions_at_their_edges():
    probs = torch.full((6, 4), 0.25)
    idx = torch.tensor([[0, 1], [2, 3], [0, 1], [2, 3], [0, 1], [2, 3]])
    assert abs(sequence_balancing_loss(probs, idx, None, 2).item() - 1.0) < 1e-7  # balance gives 1
    # a row of padding only leaves the mean over the rows that hold a token
    real = torch.tensor([True, True, True, False, False, False])
    assert abs(sequence_balancing_loss(probs, idx, None, 2, real).item() - 1.0) < 1e-7
    assert sequence_balancing_loss(probs[:0], idx[:0], None, 1).item() == 0.0
    # pooled: balance gives k (here 2), and no token anywhere gives 0, not NaN
    sums = torch.cat([torch.tensor([6.0]), torch.full((4,), 3.0), torch.full((4,), 1.5)])
    assert abs(pooled_balancing_loss([sums, sums]).item() - 2.0) < 1e-7
    assert pooled_balancing_loss([torch.zeros(9)]).item() == 0.0


def _model_cfg(scope: str, **moe: object):
    return from_dict({
        "model": {"dim": 32, "n_layers": 3, "n_heads": 4, "n_kv_heads": 2, "ffn_dim": 48, "max_seq_len": 16},
        "moe": {"num_experts": 4, "top_k": 2, "expert_ffn_dim": 24, "aux_loss_coef": 0.5, "z_loss_coef": 0.01,
                "aux_loss_scope": scope, "shared_experts": 1, "kernel": "loop", **moe},
        "data": {"seq_len": 16},
    })


@pytest.mark.parametrize("scope", ["pooled", "sequence"])
def test_recompute_keeps_the_scoped_losses_and_gradients_bitwise(scope):
    torch.manual_seed(0)
    base = build_model(_model_cfg(scope))
    ids = torch.randint(0, 256, (3, 16), generator=torch.Generator().manual_seed(1))
    n_B = torch.tensor([16, 11, 5])
    runs = {}
    for mode in ("none", "moe", "full"):
        model = build_model(_model_cfg(scope))
        model.load_state_dict(base.state_dict())
        set_recompute(model, mode)
        with padding.rows(n_B, 16):
            out = model(ids, ids)
        (out.loss + out.aux_loss).backward()
        runs[mode] = (out.aux_loss.item(), [p.grad.clone() for p in model.parameters()])
    for mode in ("moe", "full"):
        assert runs[mode][0] == runs["none"][0]
        assert all(torch.equal(a, b) for a, b in zip(runs[mode][1], runs["none"][1]))


def test_pooled_model_loss_is_the_one_loss_over_its_layers():
    """A model's pooled term from its layers' sums, and a layer the forward skipped adds nothing."""
    torch.manual_seed(0)
    model = build_model(_model_cfg("pooled", z_loss_coef=0.0))
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(2))
    out = model(ids)
    layers = list(model.moe_layers())
    probs = [m.last_routing.probs_TE for m in layers]
    idx = torch.cat([m.last_routing.indices_TK for m in layers]).reshape(-1)
    F_E = torch.bincount(idx, minlength=4).float() / (len(layers) * 32)
    P_E = torch.cat(probs).mean(dim=0)
    assert abs(out.aux_loss.item() - 0.5 * 4 * (F_E * P_E).sum().item()) < 1e-6
    assert all(m.aux_loss.item() == 0.0 for m in layers)  # the balancing term is the model's, not a layer's
    layers[1].balance_sums = torch.full((9,), float("nan"))  # stale sums from an earlier forward are cleared
    assert torch.isfinite(model(ids).aux_loss)


def test_deepseek_seq_aux_maps_to_the_sequence_scope_and_back(tmp_path):
    from tests.unit.test_hf_deepseek import tiny_deepseek

    tiny_deepseek(tmp_path / "v2", 2, q_lora_rank=None, topk_method="greedy")
    assert config_from_hf(tmp_path / "v2").moe.aux_loss_scope == "sequence"  # DeepSeek's default seq_aux: true
    cfg_file = tmp_path / "v2" / "config.json"
    import json

    conf = json.loads(cfg_file.read_text())
    assert "seq_aux" not in conf  # transformers writes none: it reads as true
    layer = config_from_hf(tmp_path / "v2", {"moe": {"aux_loss_scope": "layer"}})
    out = to_hf(from_hf(tmp_path / "v2", cfg=layer), tmp_path / "layer")
    assert config_from_hf(out).moe.aux_loss_scope == "layer"  # written back as false, not left out
    conf["seq_aux"] = False
    cfg_file.write_text(json.dumps(conf))
    cfg = config_from_hf(tmp_path / "v2")
    assert cfg.moe.aux_loss_scope == "layer"
    out = to_hf(from_hf(tmp_path / "v2", cfg=cfg), tmp_path / "out")
    assert json.loads((Path(out) / "config.json").read_text())["seq_aux"] is False
    conf["seq_aux"] = "yes"
    cfg_file.write_text(json.dumps(conf))
    with pytest.raises(Exception, match="seq_aux"):
        config_from_hf(tmp_path / "v2")


def test_scopes_the_configuration_cannot_run_are_refused():
    with pytest.raises(ConfigError, match="aux_loss_scope: sequence.*mod"):
        from_dict({"moe": {"num_experts": 4, "aux_loss_scope": "sequence"}, "dynamism": {"scheme": "mod"}})
    with pytest.raises(ConfigError, match="aux_loss_scope"):
        from_dict({"moe": {"num_experts": 4, "aux_loss_scope": "rows"}})
    # pipelines take both (tests/distributed/test_pipeline_aux_scopes.py), pooled the token subsets too
    for scope in ("pooled", "sequence"):
        assert from_dict({"moe": {"num_experts": 4, "aux_loss_scope": scope}, "parallel": {"pp": 2}})
    assert from_dict({"moe": {"num_experts": 4, "aux_loss_scope": "pooled"}, "dynamism": {"scheme": "mod"}})
