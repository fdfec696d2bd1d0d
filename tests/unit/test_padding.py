"""The MoE layers' balancing and z losses leave right padding out (moebal/models/padding.py)."""

from __future__ import annotations

import copy

import pytest
import torch

from moebal.config import from_dict
from moebal.models import build_model, padding
from moebal.models.recompute import set_recompute
from moebal.routing import assignment_counts, load_balancing_loss, router_z_loss


def _model(**moe):
    base = dict(num_experts=4, top_k=2, jitter=0.0, aux_loss_coef=0.1, z_loss_coef=0.01, every=1)
    base.update(moe)
    cfg = from_dict({"model": dict(vocab_size=256, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=48,
                                   max_seq_len=16), "moe": base, "data": {"seq_len": 16}})
    torch.manual_seed(0)
    return build_model(cfg)


def _aux_and_grads(model, ids, row_tokens=None):
    model.train()
    model.zero_grad()
    out = model(ids, row_tokens=row_tokens)
    out.aux_loss.backward()
    return out.aux_loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("moe", [{}, {"adaptive_threshold": 0.3}, {"shared_experts": 1}])
def test_a_padded_row_adds_to_the_moe_losses_what_it_adds_unpadded(moe):
    """One row of 5 tokens, alone and right-padded to 12: the same balancing and z losses, and the same
    gradients from them (causal attention keeps the padding from the real positions); without its row tokens
    the padding counts (the test distinguishes)."""
    model = _model(**moe)
    ids = torch.randint(1, 256, (1, 5))
    padded = torch.cat([ids, torch.zeros(1, 7, dtype=torch.long)], dim=1)
    aux0, g0 = _aux_and_grads(model, ids)
    aux1, g1 = _aux_and_grads(model, padded, torch.tensor([5]))
    aux2, _ = _aux_and_grads(model, padded)
    assert torch.allclose(aux0, aux1, rtol=1e-6, atol=0) and g0.keys() == g1.keys()
    for n in g0:
        assert torch.allclose(g0[n], g1[n], rtol=1e-5, atol=1e-8), n
    assert abs(float(aux2 - aux0)) > 1e-4


def test_the_losses_of_padded_rows_equal_the_real_positions_counted_by_hand():
    """Two rows of 9 and 4 real tokens in 12 positions: each layer's loss equals Switch's balancing loss and the
    z loss computed on the real positions gathered out (an independent path from the masked sums)."""
    model = _model()
    model.train()
    ids = torch.randint(1, 256, (2, 12))
    n_B = torch.tensor([9, 4])
    out = model(ids, row_tokens=n_B)
    real_T = (torch.arange(12) < n_B.unsqueeze(1)).reshape(-1)
    want = torch.zeros(())
    for layer in model.moe_layers():
        r = layer.last_routing
        counts_E = assignment_counts(r.indices_TK[real_T], None, 4)
        want = want + 0.1 * load_balancing_loss(r.probs_TE[real_T], counts_E) + 0.01 * router_z_loss(
            r.logits_TE[real_T])
    assert torch.allclose(out.aux_loss, want, rtol=1e-6, atol=0)


@pytest.mark.parametrize("mode", ["moe", "full"])
def test_a_recomputed_region_replays_under_its_forwards_padding(mode):
    """The backward's replay comes after the forward left `padding.rows`: it restores the forward's rows, so the
    gradients equal those without recomputation bit for bit."""
    ref = _model(router_noise=0.01, jitter=0.1)
    model = copy.deepcopy(ref)
    set_recompute(model, mode)
    ids = torch.randint(1, 256, (2, 12))
    n_B = torch.tensor([12, 7])
    torch.manual_seed(3)
    aux0, g0 = _aux_and_grads(ref, ids, n_B)
    torch.manual_seed(3)
    aux1, g1 = _aux_and_grads(model, ids, n_B)
    assert torch.equal(aux0, aux1) and g0.keys() == g1.keys() and len(g0) > 5
    for n in g0:
        assert torch.equal(g0[n], g1[n]), n


class _OneRank:
    """The statistics reducer of one rank: a sum over one rank is the tensor."""

    def sum(self, t):
        return t

    def sum_grad(self, t):
        return t


def test_the_global_losses_leave_padding_out_as_the_local_ones():
    """The losses from statistics summed over ranks (expert or data parallelism) on one rank equal the local
    losses on padded rows."""
    model = _model(adaptive_threshold=None)
    ids = torch.randint(1, 256, (2, 12))
    n_B = torch.tensor([3, 10])
    aux0, g0 = _aux_and_grads(model, ids, n_B)
    for layer in model.moe_layers():
        layer.set_stats_reducer(_OneRank())
    aux1, g1 = _aux_and_grads(model, ids, n_B)
    assert torch.allclose(aux0, aux1, rtol=1e-6, atol=0)
    for n in g0:
        assert torch.allclose(g0[n], g1[n], rtol=1e-5, atol=1e-8), n


def test_rows_of_labels_and_the_mask():
    labels = torch.tensor([[1, 2, 3, -100], [4, 5, 6, 7]])
    assert padding.rows_of_labels(labels).tolist() == [3, 4]
    assert padding.rows_of_labels(labels[1:]) is None  # no row is padded
    with padding.rows(torch.tensor([3, 4]), 4):
        assert padding.real_mask((2, 4), torch.device("cpu")).tolist() == [True] * 3 + [False] + [True] * 4
        assert padding.real_mask((8,), torch.device("cpu")) is None  # a subset of positions: not the rows
        assert padding.real_mask((3, 4), torch.device("cpu")) is None
        assert padding.real_mask((2, 3), torch.device("cpu")) is None  # [B, Q] slots of the rows
    assert padding.current() is None


@pytest.mark.parametrize("accum", [1, 2])
def test_the_trainer_leaves_the_padding_of_documents_out_of_the_moe_losses(tmp_path, accum):
    """The local trainer on `data.samples: documents` (rows right-padded, label -100), in one pass or two
    micro-batches: its auxiliary loss is the masked one of each micro-batch's rows, not the one counting the
    padding (the model's forward once reset the trainer's rows to none)."""
    from moebal.config import Config, with_overrides
    from moebal.train import Trainer
    from tests.unit.test_train import TINY

    cfg = with_overrides(Config(), [*TINY, "data.samples=documents", "data.units=blocks", f"train.grad_accum={accum}",
                                    "moe.jitter=0.0", "moe.aux_loss_coef=0.1", "moe.z_loss_coef=0.01"])
    trainer = Trainer(cfg, tmp_path)
    step = trainer.strategy
    ref = copy.deepcopy(step.model)
    batch = next(b for b in (step.data.train.next_batch() for _ in range(200)) if (b.labels_BT == -100).any())
    _, aux, _ = step.forward_backward(trainer, 1, batch, 1.0)
    parts = [batch.part(j, accum) for j in range(accum)]
    with torch.no_grad():
        masked = sum(float(ref(p.ids_BT, p.labels_BT, padding.rows_of_labels(p.labels_BT)).aux_loss) for p in parts)
        counted = sum(float(ref(p.ids_BT, p.labels_BT).aux_loss) for p in parts)
    assert float(aux) == pytest.approx(masked / accum, rel=1e-6, abs=0)
    assert abs(counted - masked) > 1e-4 * masked


def test_a_forward_without_row_tokens_keeps_the_caller_s_rows():
    """`padding.rows` around a plain forward (the trainer's way) masks as `row_tokens` does; an empty batch's rows
    (a rank's empty share) run."""
    model = _model()
    model.train()
    ids = torch.randint(1, 256, (2, 12))
    n_B = torch.tensor([5, 12])
    with padding.rows(n_B, 12):
        around = model(ids).aux_loss
    assert torch.allclose(around, model(ids, row_tokens=n_B).aux_loss, rtol=1e-6, atol=0)
    assert abs(float(around - model(ids).aux_loss)) > 1e-4
    assert model(ids[:0], row_tokens=n_B[:0]).logits.shape == (0, 12, 256)
