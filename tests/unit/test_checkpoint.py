"""Checkpoints: round trip, logical names, the read API, atomic writes, verification, one clear error per
kind of damage or mismatch, never a partial load, no pickle, several writers, background writing."""

from __future__ import annotations

import errno
import json
import os
import random
import shutil
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from moebal.config import TrainConfig
from moebal.errors import CheckpointError
from moebal.models import build_model
from moebal.train.checkpoint import (
    Checkpointer,
    CheckpointReader,
    RowPiece,
    apply_checkpoint,
    find_checkpoints,
    latest_good_checkpoint,
    load_checkpoint,
    prune_checkpoints,
    reach_anchors,
    read_checkpoint,
    restore_rng,
    retire_checkpoints,
    rng_state,
    save_checkpoint,
)
from moebal.train.optim import build_optimizer
from tests.unit.test_train import tiny

W1 = "model.layers.0.block_sparse_moe.experts.w1"


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny tensors (tests/conftest.py)


def _trained(*overrides: str, seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer]:
    """The tiny MoE model (4 experts per layer) after 2 AdamW steps on a cheap random quadratic loss (every
    parameter and every expert row gets its own optimizer state)."""
    cfg = tiny(*overrides)
    torch.manual_seed(seed)
    model = build_model(cfg)
    opt = build_optimizer(model, TrainConfig())
    for _ in range(2):
        sum((p * torch.randn_like(p)).square().sum() for p in model.parameters()).backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def _save(run: Path, step: int, model: nn.Module, opt: torch.optim.Optimizer | None, **kw) -> Path:
    return save_checkpoint(run, step, model, opt, {"data": {"epoch": 1, "index": step}, "rng": rng_state()},
                           "name: test\n", **kw)


def _same_state(a: nn.Module, b: nn.Module, oa: torch.optim.Optimizer, ob: torch.optim.Optimizer) -> None:
    for (name, x), y in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.equal(x, y), name
    for pa, pb in zip(oa.state.values(), ob.state.values()):
        assert pa.keys() == pb.keys() and all(torch.equal(pa[k], pb[k]) for k in pa)


@pytest.mark.parametrize("tie", [False, True])
def test_round_trip_restores_weights_optimizer_and_state(tmp_path, tie):
    model, opt = _trained(f"model.tie_embeddings={str(tie).lower()}")
    random.seed(5)
    np.random.seed(6)
    torch.manual_seed(7)
    path = _save(tmp_path, 3, model, opt)
    want = (random.random(), np.random.rand(), torch.rand(1))
    assert sorted(p.name for p in path.iterdir()) == ["config.yaml", "manifest.json", "model-r00000.safetensors",
                                                      "optim-r00000.safetensors", "state.json"]
    reader = read_checkpoint(path)
    fresh, fresh_opt = _trained(f"model.tie_embeddings={str(tie).lower()}", seed=1)
    apply_checkpoint(reader, fresh, fresh_opt)
    _same_state(model, fresh, opt, fresh_opt)
    if tie:
        assert fresh.lm_head.weight.data_ptr() == fresh.model.embed_tokens.weight.data_ptr()
    restore_rng(reader.state["rng"])
    assert (random.random(), np.random.rand(), torch.rand(1)) == want
    assert reader.state["data"] == {"epoch": 1, "index": 3} and reader.step == 3
    for m, o in ((model, opt), (fresh, fresh_opt)):  # one more identical step from both
        torch.manual_seed(0)
        sum((p * torch.randn_like(p)).square().sum() for p in m.parameters()).backward()
        o.step()
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), fresh.parameters()))


def test_the_cuda_rng_is_the_rank_s_own_device_and_older_all_device_states_load_on_fewer_devices(monkeypatch):
    """A rank saves its own device's generator and restores it onto its current device, so a resume that sees
    fewer GPUs (another --nproc, CUDA_VISIBLE_DEVICES) loads. A CPU stands in for CUDA's generator calls."""
    gens = {d: torch.Generator().manual_seed(d) for d in range(2)}
    current = {"device": 1}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: current["device"])
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda device="cuda": gens[current["device"]].get_state())
    monkeypatch.setattr(torch.cuda, "set_rng_state",
                        lambda state, device="cuda": gens[current["device"]].set_state(state))
    saved = rng_state()
    assert saved["cuda"] == gens[1].get_state().tolist()
    want = torch.rand(3, generator=gens[1])
    current["device"] = 0  # resumed on a node that shows this rank one device
    restore_rng(saved)
    assert torch.equal(torch.rand(3, generator=gens[0]), want)
    older = {**saved, "cuda": [gens[1].get_state().tolist()] * 8}  # every device of an 8-GPU node
    restore_rng(older)
    assert torch.equal(torch.rand(3, generator=gens[0]), torch.rand(3, generator=gens[1]))


def test_a_tied_pipeline_stage_s_head_copy_is_kept_as_the_embedding(tmp_path):
    """A last pipeline stage's tied head copy (moebal/pipeline/tied.py) is written as an alias of the first
    stage's embedding, as one process's tie is, and loaded through it; an untied checkpoint is refused."""
    from moebal.pipeline.stage import PipelineStage

    model, _ = _trained("model.tie_embeddings=true")
    path = _save(tmp_path / "one", 1, model, None)  # one process: the embedding, and the head as its alias
    fresh, _ = _trained("model.tie_embeddings=true", seed=1)
    last = PipelineStage.from_model(fresh, 1, 2, first=False, last=True)
    assert last.checkpoint_links == {"lm_head.weight": "model.embed_tokens.weight"}
    written = _save(tmp_path / "last", 1, last, None)
    manifest = json.loads((written / "manifest.json").read_text())
    assert manifest["aliases"] == {"lm_head.weight": "model.embed_tokens.weight"}
    assert "lm_head.weight" not in manifest["tensors"] and "model.embed_tokens.weight" not in manifest["tensors"]
    from moebal.train.checkpoint import load_checkpoint

    load_checkpoint(read_checkpoint(path), last, None).apply()
    assert torch.equal(last.lm_head.weight, model.model.embed_tokens.weight)
    untied, _ = _trained()
    with pytest.raises(CheckpointError, match="does not keep 'lm_head.weight' as 'model.embed_tokens.weight' "
                                              r"\(this model ties them, the checkpoint's did not\)"):
        load_checkpoint(read_checkpoint(_save(tmp_path / "untied", 1, untied, None)), last, None)


def test_experts_are_stored_by_logical_id_and_read_back_stacked(tmp_path):
    model, opt = _trained()
    path = _save(tmp_path, 1, model, opt)
    manifest = json.loads((path / "manifest.json").read_text())
    stored = set(manifest["tensors"])
    assert {f"model.layers.0.block_sparse_moe.experts.{e}.w1" for e in range(4)} <= stored
    assert W1 not in stored and f"{W1.replace('w1', '2.w1')}:exp_avg" in stored
    reader = CheckpointReader(path)
    live = model.state_dict()
    info = reader.info()
    assert sorted(info) == sorted(live)  # the model's own names, experts stacked again
    assert info[W1].shape == tuple(live[W1].shape) and info[W1].dtype == torch.float32
    assert torch.equal(reader.read(W1), live[W1]) and torch.equal(reader.read(W1, index=2), live[W1][2])
    names = [name for name, _ in reader]
    assert names == sorted(live) and all(torch.equal(t, live[n]) for n, t in reader)
    state = reader.optimizer_state(W1, index=1)
    assert torch.equal(state["exp_avg"], opt.state[model.model.layers[0].block_sparse_moe.experts.w1]["exp_avg"][1])


def test_write_is_atomic_a_crash_before_the_rename_leaves_no_checkpoint(tmp_path, monkeypatch):
    model, opt = _trained()
    good = _save(tmp_path, 1, model, opt)
    real = os.replace

    def crash(src, dst):
        if Path(dst).name.startswith("ckpt-"):
            raise OSError("simulated crash")
        real(src, dst)

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(OSError, match="simulated"):
        _save(tmp_path, 2, model, opt)
    monkeypatch.undo()
    assert find_checkpoints(tmp_path) == [good]  # the half-written one is invisible
    assert any(p.name.startswith(".ckpt-0000002.") and p.name.endswith(".tmp") for p in tmp_path.iterdir())
    assert latest_good_checkpoint(tmp_path) == good
    prune_checkpoints(tmp_path, keep=2, session="another")
    assert [p.name for p in tmp_path.iterdir()] == [good.name]


@pytest.mark.parametrize("every,reach,keep", [(10, 100, 2), (10, 100, 1), (30, 100, 2), (7, 20, 3), (50, 20, 1)])
def test_pruning_with_a_reach_always_keeps_a_checkpoint_that_far_back(tmp_path, every, reach, keep):
    """Checkpoints every `every` steps, pruned after each save as a run prunes them: for every bad step before the
    next save, a checkpoint at least `reach` steps older is kept once one was ever written, at most about 2 reach
    plus two intervals back, and never more than `keep` + 2 are on disk."""
    written: list[int] = []
    for step in range(every, 40 * max(every, reach), every):
        (tmp_path / f"ckpt-{step:07d}").mkdir()
        written.append(step)
        prune_checkpoints(tmp_path, keep, reach=reach)
        kept = [int(p.name[5:]) for p in find_checkpoints(tmp_path)]
        assert kept[-keep:] == written[-keep:] and len(kept) <= keep + 2, (step, kept)
        for bad in range(step, step + every):
            old_enough = [s for s in kept if s <= bad - reach]
            if any(s <= bad - reach for s in written):
                assert old_enough and bad - max(old_enough) <= 2 * reach + 2 * every, (bad, kept)
    assert reach_anchors([], reach) == set() and reach_anchors(find_checkpoints(tmp_path), 0) == set()


def test_retired_checkpoints_leave_the_run_for_a_folder_of_their_own(tmp_path):
    for step in (3, 4, 5):
        (tmp_path / f"ckpt-{step:07d}").mkdir()
        (tmp_path / f"ckpt-{step:07d}" / "state.json").write_text(str(step))
    assert retire_checkpoints(tmp_path, 5, "rolled-back") == [] and not (tmp_path / "rolled-back").exists()
    moved = retire_checkpoints(tmp_path, 3, "rolled-back")
    assert moved == ["rolled-back/1/ckpt-0000004", "rolled-back/1/ckpt-0000005"]
    assert [p.name for p in find_checkpoints(tmp_path)] == ["ckpt-0000003"]
    assert (tmp_path / moved[1] / "state.json").read_text() == "5"
    prune_checkpoints(tmp_path, keep=1)  # pruning does not reach into the folder
    assert (tmp_path / moved[0]).is_dir()
    # later retirements number after the largest folder there, even where a user deleted an earlier one
    for step, folder in ((4, "2"), (5, "3")):
        (tmp_path / f"ckpt-{step:07d}").mkdir()
        assert retire_checkpoints(tmp_path, 3, "rolled-back") == [f"rolled-back/{folder}/ckpt-{step:07d}"]
        if folder == "2":
            shutil.rmtree(tmp_path / "rolled-back" / "1")
    assert sorted(p.name for p in (tmp_path / "rolled-back").iterdir()) == ["2", "3"]


def test_the_newest_k_are_kept_and_the_previous_survives_a_failed_save(tmp_path, monkeypatch):
    model, opt = _trained()
    for step in (1, 2, 3, 4):
        _save(tmp_path, step, model, opt, keep=2)
    assert [p.name for p in find_checkpoints(tmp_path)] == ["ckpt-0000003", "ckpt-0000004"]
    monkeypatch.setattr("moebal.train.checkpoint._merge_notes", lambda *a: (_ for _ in ()).throw(OSError("full")))
    with pytest.raises(OSError, match="full"):
        _save(tmp_path, 5, model, opt, keep=1)
    assert [p.name for p in find_checkpoints(tmp_path)] == ["ckpt-0000003", "ckpt-0000004"]


def test_a_full_disk_is_one_line_and_keeps_the_previous(tmp_path, monkeypatch):
    model, opt = _trained()
    good = _save(tmp_path, 1, model, opt)

    def full(path, data):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))

    monkeypatch.setattr("moebal.train.checkpoint._fsync_write", full)
    with pytest.raises(CheckpointError) as e:
        _save(tmp_path, 2, model, opt)
    assert str(e.value).startswith(f"cannot write checkpoint 2 into {tmp_path}: No space left on device (")
    assert f"continue with `moebal train --out {tmp_path} --resume`" in str(e.value) and "\n" not in str(e.value)
    assert find_checkpoints(tmp_path) == [good]
    # the disk full while a shard is written: safetensors' own error type, the same line
    from safetensors import SafetensorError

    def shard_full(tensors, filename, metadata=None):
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.undo()
    monkeypatch.setattr("safetensors.torch.save_file", shard_full)
    with pytest.raises(CheckpointError, match="^cannot write checkpoint 3 into .*: No space left on device;"):
        _save(tmp_path, 3, model, opt)
    assert find_checkpoints(tmp_path) == [good]


@pytest.mark.parametrize("damage", ["flip", "truncate", "delete"])
@pytest.mark.parametrize("target", ["model-r00000.safetensors", "optim-r00000.safetensors", "state.json"])
def test_a_damaged_file_is_named_and_the_previous_good_checkpoint_offered(tmp_path, damage, target):
    model, opt = _trained()
    previous = _save(tmp_path, 1, model, opt)
    latest = _save(tmp_path, 2, model, opt)
    f = latest / target
    data = f.read_bytes()
    if damage == "flip":
        f.write_bytes(data[:-5] + bytes([data[-5] ^ 1]) + data[-4:])
        expect = f"{f} is corrupt: its sha256 does not match"
    elif damage == "truncate":
        f.write_bytes(data[: len(data) // 2])
        expect = f"{f} has {len(data) // 2} bytes, the manifest says {len(data)} (truncated?)"
    else:
        f.unlink()
        expect = f"{f} is missing"
    fresh, fresh_opt = _trained(seed=3)
    before = {k: v.clone() for k, v in fresh.state_dict().items()}
    with pytest.raises(CheckpointError) as err:
        apply_checkpoint(CheckpointReader(latest), fresh, fresh_opt)
    assert expect in str(err.value)
    assert f"the previous good checkpoint is {previous}" in str(err.value)
    assert f"--resume-from {previous}" in str(err.value)
    assert all(torch.equal(before[k], v) for k, v in fresh.state_dict().items())  # nothing loaded
    assert latest_good_checkpoint(tmp_path) == previous
    apply_checkpoint(read_checkpoint(previous), fresh, fresh_opt)  # the older one still loads


@pytest.mark.parametrize("damage", ["missing", "garbage", "format"])
def test_a_bad_manifest_has_its_own_message(tmp_path, damage):
    model, opt = _trained()
    _save(tmp_path, 1, model, opt)
    latest = _save(tmp_path, 2, model, opt)
    m = latest / "manifest.json"
    if damage == "missing":
        m.unlink()
        expect = "manifest.json is missing: the checkpoint is incomplete"
    elif damage == "garbage":
        m.write_text("{not json")
        expect = "manifest.json is corrupt"
    else:
        m.write_text(json.dumps({**json.loads(m.read_text()), "format": 1}))
        expect = "checkpoint format 1, this moebal reads format 2"
    with pytest.raises(CheckpointError, match="previous good checkpoint is .*ckpt-0000001") as err:
        read_checkpoint(latest)
    assert expect in str(err.value)


@pytest.mark.parametrize("how", ["parent", "absolute", "symlink"])
def test_a_manifest_naming_a_file_outside_its_checkpoint_is_refused(tmp_path, how):
    # another run's shard with its true size and sha256: only the path gives it away
    a, a_opt = _trained(seed=1)
    b, b_opt = _trained(seed=2)
    other = _save(tmp_path / "other", 1, a, a_opt)
    latest = _save(tmp_path / "run", 1, b, b_opt)
    m = json.loads((latest / "manifest.json").read_text())
    shard = "model-r00000.safetensors"
    name = {"parent": f"../../other/{other.name}/{shard}", "absolute": str(other / shard), "symlink": "link"}[how]
    if how == "symlink":
        (latest / name).symlink_to(other / shard)
    m["files"][name] = json.loads((other / "manifest.json").read_text())["files"][shard]
    for entry in m["tensors"].values():
        if entry["file"] == shard:
            entry["file"] = name
    (latest / "manifest.json").write_text(json.dumps(m))
    fresh, fresh_opt = _trained(seed=3)
    with pytest.raises(CheckpointError, match="which is not a file of the checkpoint directory"):
        _unchanged_after(lambda: apply_checkpoint(read_checkpoint(latest), fresh, fresh_opt), fresh, fresh_opt)


def _unchanged_after(fn, model: nn.Module, opt: torch.optim.Optimizer) -> None:
    before = {k: v.clone() for k, v in model.state_dict().items()}
    opt_before = {id(p): {k: v.clone() for k, v in s.items()} for p, s in opt.state.items()}
    fn()
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(torch.equal(opt_before[id(p)][k], v) for p, s in opt.state.items() for k, v in s.items())


@pytest.mark.parametrize("case", ["shape", "more-experts", "fewer-experts", "missing-expert", "more-layers"])
def test_a_mismatched_checkpoint_has_its_own_error_and_loads_nothing(tmp_path, case):
    saved_cfg = {"shape": ["model.dim=64"], "more-experts": ["moe.num_experts=8"], "fewer-experts":
                 ["moe.num_experts=2"], "missing-expert": [], "more-layers": ["model.n_layers=3"]}[case]
    model, opt = _trained(*saved_cfg)
    path = _save(tmp_path, 1, model, opt)
    expect = {"shape": r"'model.embed_tokens.weight' has shape \(256, 64\) in the checkpoint but \(256, 32\)",
              "more-experts": f"'{W1}' has 8 experts in the checkpoint but 4 in this model",
              "fewer-experts": f"'{W1}' has 2 experts in the checkpoint but 4 in this model",
              "missing-expert": f"has no expert 3 of '{W1}'",
              "more-layers": r"holds tensors this model does not have \(model.layers.2"}[case]
    if case == "missing-expert":  # a manifest that lost an expert (its shard would still verify)
        m = json.loads((path / "manifest.json").read_text())
        lost = W1.replace("w1", "3.w1")
        del m["tensors"][lost], m["experts"][lost]
        (path / "manifest.json").write_text(json.dumps(m))
    other, other_opt = _trained(*(["model.dim=32"] if case == "shape" else []), seed=3)

    def load() -> None:
        with pytest.raises(CheckpointError, match=expect) as err:
            apply_checkpoint(CheckpointReader(path), other, other_opt)
        assert "previous good checkpoint" not in str(err.value)  # not a damaged file: an older one is no help

    _unchanged_after(load, other, other_opt)


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
    assert torch.equal(fresh.lm_head.weight, model.lm_head.weight)


def _shard(model: nn.Module, opt: torch.optim.Optimizer, rank: int, ranks: int) -> tuple[nn.Module,
                                                                                          torch.optim.Optimizer]:
    """What expert parallelism leaves on `rank` of `ranks`: its rows of every stacked expert tensor (and of
    their optimizer state), with their logical ids."""
    import copy

    m = copy.deepcopy(model)
    o = build_optimizer(m, TrainConfig())
    o.load_state_dict(opt.state_dict())
    for layer in m.moe_layers():
        ex = layer.experts
        per = ex.num_experts // ranks
        rows = slice(rank * per, (rank + 1) * per)
        for name in ex.stacked_expert_params:
            old = getattr(ex, name)
            new = nn.Parameter(old.detach()[rows].clone())
            state = o.state.pop(old)
            o.state[new] = {k: (v[rows].clone() if v.dim() else v.clone()) for k, v in state.items()}
            for g in o.param_groups:
                g["params"] = [new if p is old else p for p in g["params"]]
            setattr(ex, name, new)
        ex.expert_ids = tuple(range(rows.start, rows.stop))
    return m, o


@pytest.mark.parametrize("background", [False, True])
def test_ranks_write_their_experts_and_one_process_reads_the_whole(tmp_path, background):
    """Two writers (threads standing in for two expert-parallel ranks): each writes its experts, rank 0 the
    dense tensors too; the checkpoint loads into the unsharded model, and into a 4-way sharding."""
    model, opt = _trained()
    parts = [_shard(model, opt, r, 2) for r in range(2)]
    writers = [Checkpointer(tmp_path, rank=r, ranks=[0, 1], write_dense=r == 0, background=background,
                            session="s") for r in range(2)]

    def save(r: int) -> None:
        writers[r].save(7, parts[r][0], parts[r][1], global_state={"data": {}}, rank_state={"rank": r},
                        config_yaml="x: 1\n", layout={"ep": 2})
        writers[r].wait()

    threads = [threading.Thread(target=save, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    path = tmp_path / "ckpt-0000007"
    assert sorted(p.name for p in path.iterdir() if "safetensors" in p.name) == [
        "model-r00000.safetensors", "model-r00001.safetensors", "optim-r00000.safetensors",
        "optim-r00001.safetensors"]
    reader = read_checkpoint(path)
    assert reader.state["ranks"] == {"0": {"rank": 0}, "1": {"rank": 1}} and reader.state["layout"] == {"ep": 2}
    whole, whole_opt = _trained(seed=5)
    apply_checkpoint(reader, whole, whole_opt)
    _same_state(model, whole, opt, whole_opt)
    four, four_opt = _shard(*_trained(seed=6), rank=3, ranks=4)
    with pytest.raises(CheckpointError, match="holds tensors this model does not have"):
        apply_checkpoint(reader, four, four_opt)  # alone, a quarter of the experts does not cover it
    load_checkpoint(reader, four, four_opt).apply()  # as rank 3 of 4 (coverage is checked over all ranks)
    ex = four.model.layers[1].block_sparse_moe.experts
    assert torch.equal(ex.w2, model.model.layers[1].block_sparse_moe.experts.w2[3:4])
    assert torch.equal(four_opt.state[ex.w2]["exp_avg_sq"], opt.state[
        model.model.layers[1].block_sparse_moe.experts.w2]["exp_avg_sq"][3:4])


def test_a_save_in_flight_waits_for_the_ranks_of_its_own_step(tmp_path):
    """With background saves, the trainer sets the next save's ranks (a released rank left out) while the previous
    save may still wait for its ranks: that save still waits for all of them and publishes every part."""
    model, opt = _trained()
    parts = [_shard(model, opt, r, 2) for r in range(2)]
    writers = [Checkpointer(tmp_path, rank=r, ranks=[0, 1], write_dense=r == 0, background=r == 0, session="s",
                            timeout_s=30) for r in range(2)]
    writers[0].save(5, parts[0][0], parts[0][1], global_state={"data": {}}, rank_state={"rank": 0}, config_yaml="")
    writers[0].ranks = [0]  # rank 1 released for the next save, while the save of step 5 waits for its part
    time.sleep(0.2)
    writers[1].save(5, parts[1][0], parts[1][1], global_state={"data": {}}, rank_state={"rank": 1}, config_yaml="")
    writers[0].wait()
    path = tmp_path / "ckpt-0000005"
    assert read_checkpoint(path).state["ranks"] == {"0": {"rank": 0}, "1": {"rank": 1}}
    assert {"model-r00001.safetensors", "optim-r00001.safetensors"} <= {p.name for p in path.iterdir()}
    assert not list(tmp_path.glob(".ckpt-*")) and not list(path.glob("rank-*.json"))


def test_a_rank_that_fails_to_write_fails_the_checkpoint_and_keeps_the_previous(tmp_path):
    model, opt = _trained()
    parts = [_shard(model, opt, r, 2) for r in range(2)]
    good = _save(tmp_path, 1, model, opt)
    writers = [Checkpointer(tmp_path, rank=r, ranks=[0, 1], write_dense=r == 0, session="s", timeout_s=30)
               for r in range(2)]
    errors: dict[int, str] = {}

    def save(r: int) -> None:
        state = {"bad": object()} if r == 1 else {}
        try:
            writers[r].save(2, parts[r][0], parts[r][1], global_state={}, rank_state=state, config_yaml="")
        except Exception as e:  # noqa: BLE001
            errors[r] = str(e)

    rank1 = threading.Thread(target=save, args=(1,))
    rank1.start()
    rank1.join()
    assert "not JSON serializable" in errors[1]  # refused in the caller, before writing anything
    writers[0].timeout_s = 0.5  # rank 1 never wrote: rank 0 must time out, not hang
    save(0)
    assert "ranks [1] did not write their part" in errors[0] and "shared" in errors[0]
    assert find_checkpoints(tmp_path) == [good]


def test_when_another_rank_fails_to_load_no_rank_applies_anything(tmp_path):
    """The agreed load: every rank checks and reads first; one rank's failure raises on all of them."""
    from moebal.train.checkpoint import load_agreed

    model, opt = _trained()
    path = _save(tmp_path, 1, model, opt)
    fresh, fresh_opt = _trained(seed=4)

    def gather(obj):  # this rank is rank 0; rank 1 could not read its shard
        return [obj, ("/run/ckpt-0000001/model-r00001.safetensors is corrupt: ...", [])]

    def load() -> None:
        with pytest.raises(CheckpointError, match="rank 1: .*model-r00001.safetensors is corrupt"):
            load_agreed(CheckpointReader(path), fresh, fresh_opt, gather)

    _unchanged_after(load, fresh, fresh_opt)


class _RowOwner:
    """An optimizer stand-in whose state this rank writes as one row piece of a [6, 4] logical tensor (what
    `parallel.shard: full` writes for a dense tensor's moments)."""

    def __init__(self, full: torch.Tensor, rows: tuple[int, int]) -> None:
        self.full, self.rows = full, rows

    def logical_state(self, module, stacked):
        a, b = self.rows
        return {"weight:exp_avg": RowPiece(self.full[a:b], a, tuple(self.full.shape))}, {}


def _two_writers(run: Path, rows: list[tuple[int, int]]) -> Path:
    """Ranks 1 then 0 (which completes) write one checkpoint; rank r's optimizer piece covers rows[r]."""
    full = torch.arange(24, dtype=torch.float32).reshape(6, 4)
    module = nn.Linear(4, 6, bias=False)
    for r in (1, 0):
        Checkpointer(run, rank=r, ranks=[0, 1], write_dense=r == 0, timeout_s=5).save(
            3, module, _RowOwner(full, rows[r]), global_state={}, rank_state={}, config_yaml="")  # type: ignore[arg-type]
    return run / "ckpt-0000003"


def test_row_pieces_of_two_owners_read_as_one_logical_tensor(tmp_path):
    full = torch.arange(24, dtype=torch.float32).reshape(6, 4)
    path = _two_writers(tmp_path, [(0, 4), (4, 6)])
    entry = json.loads((path / "manifest.json").read_text())["tensors"]["weight:exp_avg"]
    assert [p["rows"] for p in entry["pieces"]] == [[0, 4], [4, 6]] and entry["shape"] == [6, 4]
    with read_checkpoint(path) as reader:
        assert torch.equal(reader.optimizer_state("weight")["exp_avg"], full)
        assert torch.equal(reader.read_rows("weight:exp_avg", 3, 2), full[3:5])  # across the two pieces
        assert torch.equal(reader.read_rows("weight", 1, 3), reader.read("weight")[1:4])  # a whole tensor's rows
        with pytest.raises(CheckpointError, match="no rows 5..7"):
            reader.read_rows("weight:exp_avg", 5, 2)


@pytest.mark.parametrize("rows, word", [([(0, 4), (5, 6)], "gap"), ([(0, 4), (3, 6)], "overlap"),
                                        ([(0, 4), (4, 5)], "no rank wrote rows 5")])
def test_row_pieces_that_do_not_tile_the_tensor_fail_the_checkpoint(tmp_path, rows, word):
    with pytest.raises(CheckpointError, match=word):
        _two_writers(tmp_path, rows)
    assert not find_checkpoints(tmp_path)  # nothing published


class _AtRest:
    """Stands in for an optimizer keeping weights sharded at rest: units of tensors whose storages are freed
    between uses and refilled (with their values) by `each_unit_gathered`, which records how many are whole."""

    def __init__(self, units: list[list[torch.Tensor]]) -> None:
        self.units = units
        self.values = [[t.clone() for t in u] for u in units]
        self.whole: list[int] = []
        for u in units:
            for t in u:
                t.untyped_storage().resize_(0)

    def each_unit_gathered(self, write: bool = False):
        for u, vals in zip(self.units, self.values):
            for t, v in zip(u, vals):
                t.untyped_storage().resize_(v.numel() * v.element_size())
                t.detach().copy_(v)
            self.whole.append(sum(t.untyped_storage().nbytes() > 0 for un in self.units for t in un))
            yield
            if write:  # the owned parts take what was written
                for t, v in zip(u, vals):
                    v.copy_(t.detach())
            for t in u:
                t.untyped_storage().resize_(0)


def test_checkpoint_copies_weights_at_rest_one_unit_at_a_time():
    """A checkpoint's copy of expert weights sharded at rest gathers one unit (an MoE layer's experts) at a time,
    copies it to the host and frees it before the next; the other tensors are copied as they are; freed weights
    of the same shape are not taken for tied ones; a freed tensor no unit gathers is an error, not a bad copy.
    A load writes them the same way, one unit at a time, and the units' owned parts take the written values."""
    from moebal.train.checkpoint import PendingLoad, _copy_model, _local_view

    torch.manual_seed(0)
    m = nn.Module()
    m.a, m.b = nn.Parameter(torch.randn(4, 3)), nn.Parameter(torch.randn(4, 3))
    m.dense = nn.Parameter(torch.randn(5))
    want = {"a": m.a.detach().clone(), "b": m.b.detach().clone(), "dense": m.dense.detach().clone()}
    opt = _AtRest([[m.a], [m.b]])
    view = _local_view(m)
    assert view.aliases == {} and set(view.tensors) == {"dense"} and set(view.at_rest) == {"a", "b"}
    names = ["a", "dense", "b"]
    got = _copy_model(view, names, opt)  # type: ignore[arg-type]
    assert list(got) == names and all(torch.equal(got[k], want[k]) for k in want)
    assert opt.whole == [1, 1]  # never both units whole
    assert m.a.untyped_storage().nbytes() == 0 and m.b.untyped_storage().nbytes() == 0  # freed again
    with pytest.raises(RuntimeError, match="freed weights that no unit"):
        _copy_model(view, names, None)
    new = {"a": torch.randn(4, 3), "b": torch.randn(4, 3), "dense": torch.randn(5)}
    load = PendingLoad(m, None, copies=[(m.dense, new["dense"])],
                       at_rest=[(view.at_rest[n], new[n]) for n in ("a", "b")])
    load.optimizer = opt  # type: ignore[assignment]
    load.apply()
    assert opt.whole == [1, 1, 1, 1] and m.a.untyped_storage().nbytes() == 0
    assert torch.equal(opt.values[0][0], new["a"]) and torch.equal(opt.values[1][0], new["b"])
    assert torch.equal(m.dense.detach(), new["dense"])
