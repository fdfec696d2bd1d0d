"""Checkpoints: round trip, atomic writes, verification, clear errors, never a partial load, no pickle."""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from moebal.config import TrainConfig
from moebal.errors import CheckpointError
from moebal.train.checkpoint import (
    apply_checkpoint,
    find_checkpoints,
    latest_good_checkpoint,
    prune_checkpoints,
    read_checkpoint,
    restore_rng,
    rng_state,
    save_checkpoint,
)
from moebal.train.optim import build_optimizer


class Tiny(nn.Module):
    def __init__(self, dim: int = 8, tie: bool = False) -> None:
        super().__init__()
        self.emb = nn.Embedding(16, dim)
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, 16)
        self.register_buffer("bias_E", torch.zeros(4))
        if tie:
            self.head.weight = self.emb.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.emb(ids)))


def _trained(dim: int = 8, tie: bool = False, seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = Tiny(dim, tie)
    opt = build_optimizer(model, TrainConfig())
    for _ in range(3):
        ids = torch.randint(0, 16, (4, 5))
        nn.functional.cross_entropy(model(ids).flatten(0, 1), ids.flatten()).backward()
        opt.step()
        opt.zero_grad()
    model.bias_E += 1.5
    return model, opt


def _save(run: Path, step: int, model: nn.Module, opt: torch.optim.Optimizer) -> Path:
    return save_checkpoint(run, step, model, opt, {"data": {"epoch": 1, "index": step}, "rng": rng_state()},
                           "name: test\n")


@pytest.mark.parametrize("tie", [False, True])
def test_round_trip_restores_weights_buffers_optimizer_and_rng(tmp_path, tie):
    model, opt = _trained(tie=tie)
    random.seed(5)
    np.random.seed(6)
    torch.manual_seed(7)
    path = _save(tmp_path, 3, model, opt)
    want = (random.random(), np.random.rand(), torch.rand(1))
    assert sorted(p.name for p in path.iterdir()) == ["config.yaml", "manifest.json", "model.safetensors",
                                                      "optimizer.safetensors", "state.json"]
    ckpt = read_checkpoint(path)
    fresh, fresh_opt = _trained(tie=tie, seed=1)
    apply_checkpoint(ckpt, fresh, fresh_opt)
    for (name, a), b in zip(model.state_dict().items(), fresh.state_dict().values()):
        assert torch.equal(a, b), name
    if tie:
        assert fresh.head.weight.data_ptr() == fresh.emb.weight.data_ptr()  # still tied after loading
    for pa, pb in zip(opt.state.values(), fresh_opt.state.values()):
        assert all(torch.equal(pa[k], pb[k]) for k in pa)
    assert fresh_opt.param_groups[0]["betas"] == opt.param_groups[0]["betas"]
    restore_rng(ckpt.state["rng"])
    assert (random.random(), np.random.rand(), torch.rand(1)) == want
    assert ckpt.state["data"] == {"epoch": 1, "index": 3} and ckpt.step == 3
    # one more identical optimizer step from both
    for m, o in ((model, opt), (fresh, fresh_opt)):
        torch.manual_seed(0)
        ids = torch.randint(0, 16, (4, 5))
        nn.functional.cross_entropy(m(ids).flatten(0, 1), ids.flatten()).backward()
        o.step()
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), fresh.parameters()))


def test_write_is_atomic_a_crash_before_the_rename_leaves_no_checkpoint(tmp_path, monkeypatch):
    model, opt = _trained()
    good = _save(tmp_path, 1, model, opt)

    def crash(*args, **kwargs):
        raise OSError("simulated crash")

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(OSError, match="simulated"):
        _save(tmp_path, 2, model, opt)
    monkeypatch.undo()
    assert find_checkpoints(tmp_path) == [good]  # the half-written one is invisible
    assert any(p.name.startswith(".ckpt-0000002.tmp") for p in tmp_path.iterdir())
    assert latest_good_checkpoint(tmp_path) == good
    prune_checkpoints(tmp_path, keep=2)
    assert find_checkpoints(tmp_path) == [good]


def test_prune_keeps_the_newest(tmp_path):
    model, opt = _trained()
    for step in (1, 2, 3, 4):
        _save(tmp_path, step, model, opt)
        prune_checkpoints(tmp_path, keep=2)
    assert [p.name for p in find_checkpoints(tmp_path)] == ["ckpt-0000003", "ckpt-0000004"]


@pytest.mark.parametrize("damage", ["flip", "truncate", "delete", "manifest"])
@pytest.mark.parametrize("target", ["model.safetensors", "optimizer.safetensors", "state.json"])
def test_damaged_checkpoint_names_the_file_and_offers_the_previous_good_one(tmp_path, damage, target):
    model, opt = _trained()
    previous = _save(tmp_path, 1, model, opt)
    latest = _save(tmp_path, 2, model, opt)
    f = latest / ("manifest.json" if damage == "manifest" else target)
    data = f.read_bytes()
    if damage == "flip":
        f.write_bytes(data[:-5] + bytes([data[-5] ^ 1]) + data[-4:])
        expect = f"{f} is corrupt"
    elif damage == "truncate":
        f.write_bytes(data[: len(data) // 2])
        expect = "truncated"
    elif damage == "delete":
        f.unlink()
        expect = f"{f} is missing"
    else:
        f.unlink()
        expect = "incomplete"
    with pytest.raises(CheckpointError, match="previous good checkpoint") as err:
        read_checkpoint(latest)
    assert expect in str(err.value) and str(previous) in str(err.value)
    assert latest_good_checkpoint(tmp_path) == previous
    read_checkpoint(previous)  # the older one still loads


def test_mismatched_model_is_rejected_before_anything_changes(tmp_path):
    model, opt = _trained(dim=8)
    path = _save(tmp_path, 1, model, opt)
    other, other_opt = _trained(dim=12, seed=3)
    before = {k: v.clone() for k, v in other.state_dict().items()}
    opt_before = json.dumps({k: v.tolist() for k, v in other_opt.state[other.emb.weight].items()})
    with pytest.raises(CheckpointError, match="does not match this model.*other shape: emb.weight"):
        apply_checkpoint(read_checkpoint(path), other, other_opt)
    assert all(torch.equal(before[k], v) for k, v in other.state_dict().items())
    assert json.dumps({k: v.tolist() for k, v in other_opt.state[other.emb.weight].items()}) == opt_before


def test_loading_never_unpickles(tmp_path, monkeypatch):
    model, opt = _trained()
    path = _save(tmp_path, 1, model, opt)
    import pickle

    def refuse(*args, **kwargs):
        raise AssertionError("checkpoint loading must not unpickle")

    monkeypatch.setattr(torch, "load", refuse)
    monkeypatch.setattr(pickle, "load", refuse)
    monkeypatch.setattr(pickle, "loads", refuse)
    fresh, fresh_opt = _trained(seed=2)
    apply_checkpoint(read_checkpoint(path), fresh, fresh_opt)
    assert torch.equal(fresh.head.weight, model.head.weight)
